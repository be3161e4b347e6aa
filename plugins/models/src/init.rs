//! Random initialisation as transformers' `_init_weights` does it: linear and
//! embedding weights N(0, initializer_range), biases zero, norms one.

use ft_core::model::{Init, Model, ParamSpec};
use tch::{Device, Kind, Tensor};

/// Fresh parameters for every unit of `model`, seeded for reproducibility.
pub fn init_params(model: &dyn Model, seed: i64, dtype: Kind, device: Device) -> Vec<Vec<Tensor>> {
    tch::manual_seed(seed);
    model.units().iter().map(|unit| unit.params.iter().map(|spec| init_param(spec, dtype, device)).collect()).collect()
}

/// One parameter as its `Init` says, drawn from the global generator.
pub fn init_param(spec: &ParamSpec, dtype: Kind, device: Device) -> Tensor {
    let options = (Kind::Float, device);
    let tensor = match spec.init {
        Init::Normal { std } => Tensor::randn(&spec.shape, options) * std,
        Init::Zeros => Tensor::zeros(&spec.shape, options),
        Init::Ones => Tensor::ones(&spec.shape, options),
    };
    tensor.to_kind(dtype)
}

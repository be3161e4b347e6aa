//! What a model is to `ft`: named units of parameters (the sharding
//! granularity) and the math of each unit. A model owns no parameter storage:
//! the sharding strategy owns it and hands the model views before each unit
//! runs, so every strategy works with every model.

use anyhow::Result;
use tch::Tensor;

/// How a parameter is initialised when no checkpoint provides it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Init {
    Normal { std: f64 },
    Zeros,
    Ones,
}

#[derive(Debug, Clone, PartialEq)]
pub struct ParamSpec {
    /// Name inside the unit, e.g. `attn.qkv.weight`.
    pub name: String,
    /// Tensor name in the Hugging Face checkpoint.
    pub hf_name: String,
    pub shape: Vec<i64>,
    pub init: Init,
}

impl ParamSpec {
    pub fn numel(&self) -> i64 {
        self.shape.iter().product()
    }
}

/// A group of parameters gathered, run and reduced together (embeddings, one
/// transformer block, the final norm and head).
#[derive(Debug, Clone, PartialEq)]
pub struct UnitSpec {
    pub name: String,
    pub params: Vec<ParamSpec>,
}

impl UnitSpec {
    pub fn numel(&self) -> i64 {
        self.params.iter().map(ParamSpec::numel).sum()
    }
}

pub trait Model: Send + Sync {
    fn units(&self) -> &[UnitSpec];

    /// Runs unit `unit` on `input`; `params[i]` is a view shaped like
    /// `units()[unit].params[i]`.
    fn forward_unit(&self, unit: usize, params: &[Tensor], input: &Tensor) -> Result<Tensor>;
}

//! Where a rank keeps what it does not compute with: fp32 master weights,
//! gradients and optimizer state. Core owns the mechanism (`distributed/flat.rs`,
//! `train/`): which buffers a unit has, the copies between device and host
//! and their overlap with compute. An `Offload` decides where offloaded
//! buffers are stored and how they are stepped, and composes with every
//! strategy (it holds whatever share of the state the strategy assigns the
//! rank). `none` (here) keeps everything on the compute device; `cpu` is
//! the `strategies/cpu_offload` crate; docs/PLUGINS.md shows how another
//! (NVMe, say) is written without touching core.

use crate::AdamW;
use anyhow::{bail, Result};
use tch::{Device, Tensor};

pub trait Offload: Send + Sync {
    fn name(&self) -> &str;

    /// Whether masters, gradients and optimizer state leave the compute
    /// device; when false, none of the methods below is called.
    fn to_host(&self) -> bool {
        true
    }

    /// Storage of its own for one offloaded buffer of a rank computing on
    /// `device`, holding a copy of `values` (fp32 state, or a frozen
    /// reference copy's parameters in the compute dtype): called once per
    /// buffer when the trainer is built. Core copies reduced gradients into
    /// it and uploads masters and frozen parameters from it asynchronously,
    /// so for a GPU it should be pinned host memory.
    fn store(&self, values: &Tensor, device: Device) -> Result<Tensor>;

    /// The sum of squares of an offloaded gradient (for the global norm).
    fn sum_of_squares(&self, grad: &Tensor) -> Result<f64>;

    /// One AdamW step in place over offloaded `[param, grad, exp_avg,
    /// exp_avg_sq]` parts (each four of one length), at step `step`
    /// (counting this one), gradients divided by `grad_scale`.
    fn adamw(&self, parts: &[[Tensor; 4]], hyper: AdamW, step: f64, grad_scale: f64) -> Result<()>;

    /// This rank's share of the host's cores, for the host optimizer.
    fn use_cores(&self, _cores: usize) {}
}

/// An offload's registration (`--offload NAME`), beside its implementation.
pub struct OffloadRegistration {
    pub name: &'static str,
    pub summary: &'static str,
    pub create: fn() -> Box<dyn Offload>,
}
inventory::collect!(OffloadRegistration);

/// The default: everything on the compute device.
pub struct NoOffload;

impl Offload for NoOffload {
    fn name(&self) -> &str {
        "none"
    }

    fn to_host(&self) -> bool {
        false
    }

    fn store(&self, _values: &Tensor, _device: Device) -> Result<Tensor> {
        bail!("offload `none` stores nothing off the device")
    }

    fn sum_of_squares(&self, _grad: &Tensor) -> Result<f64> {
        bail!("offload `none` holds no gradient off the device")
    }

    fn adamw(&self, _parts: &[[Tensor; 4]], _hyper: AdamW, _step: f64, _grad_scale: f64) -> Result<()> {
        bail!("offload `none` steps nothing off the device")
    }
}

inventory::submit! {
    OffloadRegistration { name: "none", summary: "masters, gradients and optimizer state on the compute device", create: || Box::new(NoOffload) }
}

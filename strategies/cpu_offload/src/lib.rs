//! `--offload cpu` (ZeRO-Offload, FSDP's CPUOffloadPolicy): each rank keeps
//! its fp32 master weights, gradients and AdamW moments in host memory, for
//! whatever share of them its strategy assigns it, and steps them with a
//! multi-core CPU AdamW (`adamw.rs`). The GPU holds only the compute-dtype
//! weights: the whole model, or this rank's shard plus the unit being
//! gathered.
//!
//! Core's mechanism (`distributed/flat.rs`, `train/`) moves the data:
//! - it copies each reduced gradient into the host buffer as the unit's
//!   reduction finishes;
//! - it uploads the updated masters asynchronously before the next forward
//!   gathers them.
//!
//! This crate decides where the buffers live and how they are stepped:
//! - host memory, pinned in exactly its bytes on a GPU (the caching host
//!   allocator would round each block up to a power of two), so those copies
//!   run asynchronously at full speed;
//! - one pass of AdamW over memory per element, on this rank's share of the
//!   host's cores.

mod adamw;

pub use adamw::{cpu_adamw, cpu_sum_of_squares, set_cpu_threads};

use anyhow::Result;
use ft_core::offload::{Offload, OffloadRegistration};
use ft_core::AdamW;
use tch::{Device, Tensor};

pub struct CpuOffload;

impl Offload for CpuOffload {
    fn name(&self) -> &str {
        "cpu"
    }

    fn store(&self, values: &Tensor, device: Device) -> Result<Tensor> {
        Ok(match device.is_cuda() {
            true => ft_sys::pin_memory_exact(&values.to_device(Device::Cpu))?,
            false => values.to_device(Device::Cpu).copy(),
        })
    }

    fn sum_of_squares(&self, grad: &Tensor) -> Result<f64> {
        cpu_sum_of_squares(grad)
    }

    fn adamw(&self, parts: &[[Tensor; 4]], hyper: AdamW, step: f64, grad_scale: f64) -> Result<()> {
        for [param, grad, exp_avg, exp_avg_sq] in parts {
            cpu_adamw(param, grad, exp_avg, exp_avg_sq, hyper, step, grad_scale)?;
        }
        Ok(())
    }

    fn use_cores(&self, cores: usize) {
        set_cpu_threads(cores);
    }
}

inventory::submit! {
    OffloadRegistration {
        name: "cpu",
        summary: "fp32 masters, gradients and AdamW state in pinned host memory, stepped by ft's multi-core CPU AdamW",
        create: || Box::new(CpuOffload),
    }
}

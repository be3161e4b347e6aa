//! Where a rank keeps what it does not compute with: fp32 master weights,
//! gradients and optimizer state — on the compute device, or in host memory
//! stepped by the CPU AdamW (`ft_sys::cpu_adamw`). The mechanism is in
//! `flat.rs` and `train.rs`; an `Offload` chooses it, and composes with
//! every strategy (the host state is whatever the strategy assigns the rank).

use crate::registry::OffloadRegistration;

pub trait Offload: Send + Sync {
    fn name(&self) -> &str;

    /// Whether masters, gradients and optimizer state live in host memory.
    fn to_host(&self) -> bool;
}

/// The default: everything on the compute device.
pub struct NoOffload;

impl Offload for NoOffload {
    fn name(&self) -> &str {
        "none"
    }

    fn to_host(&self) -> bool {
        false
    }
}

inventory::submit! {
    OffloadRegistration { name: "none", summary: "masters, gradients and optimizer state on the compute device", create: || Box::new(NoOffload) }
}

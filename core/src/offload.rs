//! Where a rank keeps what it does not compute with: fp32 master weights,
//! gradients and optimizer state — on the compute device, or in host memory
//! stepped by the CPU AdamW (`ft_sys::cpu_adamw`). The mechanism is in
//! `flat.rs` and `train/`; an `Offload` chooses it, and composes with every
//! strategy (the host state is whatever share the strategy assigns the rank).

pub trait Offload: Send + Sync {
    fn name(&self) -> &str;

    /// Whether masters, gradients and optimizer state live in host memory.
    fn to_host(&self) -> bool;
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
}

inventory::submit! {
    OffloadRegistration { name: "none", summary: "masters, gradients and optimizer state on the compute device", create: || Box::new(NoOffload) }
}

/// `--offload cpu` (ZeRO-Offload, FSDP's CPUOffloadPolicy): each rank keeps
/// its fp32 master weights, gradients and AdamW moments — whatever share of
/// them its strategy assigns it — in host memory, and steps them with ft's
/// multi-core CPU AdamW. The GPU holds only the compute-dtype weights (the
/// whole model, or this rank's shard plus the unit being gathered). Reduced
/// gradients are copied back as each unit's reduction finishes; updated
/// masters are uploaded asynchronously from pinned memory before the next
/// forward gathers them.
pub struct CpuOffload;

impl Offload for CpuOffload {
    fn name(&self) -> &str {
        "cpu"
    }

    fn to_host(&self) -> bool {
        true
    }
}

inventory::submit! {
    OffloadRegistration {
        name: "cpu",
        summary: "fp32 masters, gradients and AdamW state in pinned host memory, stepped by ft's multi-core CPU AdamW",
        create: || Box::new(CpuOffload),
    }
}

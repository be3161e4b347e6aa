//! `--offload cpu` (ZeRO-Offload, FSDP's CPUOffloadPolicy): each rank keeps
//! its fp32 master weights, gradients and AdamW moments — whatever share of
//! them its strategy assigns it — in host memory, and steps them with ft's
//! multi-core CPU AdamW. The GPU holds only the compute-dtype weights (the
//! whole model, or this rank's shard plus the unit being gathered). Reduced
//! gradients are copied back as each unit's reduction finishes; updated
//! masters are uploaded asynchronously from pinned memory before the next
//! forward gathers them.

use ft_core::offload::Offload;
use ft_core::registry::OffloadRegistration;

const NAME: &str = "cpu";

pub struct CpuOffload;

impl Offload for CpuOffload {
    fn name(&self) -> &str {
        NAME
    }

    fn to_host(&self) -> bool {
        true
    }
}

inventory::submit! {
    OffloadRegistration {
        name: NAME,
        summary: "masters, gradients and optimizer state in (pinned) host memory, stepped by the CPU AdamW",
        create: || Box::new(CpuOffload),
    }
}

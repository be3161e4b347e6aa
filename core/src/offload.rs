//! Where a rank keeps what it does not compute with: fp32 master shards,
//! gradient shards and optimizer state (on the GPU, or in pinned host memory).

use tch::Device;

pub trait Offload: Send + Sync {
    fn name(&self) -> &str;

    /// The device that holds master shards and optimizer state, given the
    /// device this rank computes on.
    fn state_device(&self, compute: Device) -> Device;
}

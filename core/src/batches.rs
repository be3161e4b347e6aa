//! From a dataset's indices to the micro-batches each rank computes. An
//! epoch is a seeded shuffle of the whole set; step k's global batch is the
//! k-th slice of it, cut into one contiguous part per rank and each part
//! into micro-batches. So the same global batches are seen whatever the
//! world size and accumulation, which is what makes runs comparable step
//! for step.

use rand::seq::SliceRandom;
use rand::SeedableRng;
use tch::{Device, Tensor};

/// Example indices in the order epoch `epoch` visits them.
pub fn epoch_order(len: usize, epoch: u64, seed: u64, shuffle: bool) -> Vec<usize> {
    let mut order: Vec<usize> = (0..len).collect();
    if shuffle {
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ epoch);
        order.shuffle(&mut rng);
    }
    order
}

/// How a global batch is split.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BatchLayout {
    /// Examples per micro-batch on one rank.
    pub micro_batch: usize,
    pub accumulation: usize,
    pub world: usize,
}

impl BatchLayout {
    pub fn global_batch(&self) -> usize {
        self.micro_batch * self.accumulation * self.world
    }

    /// Full global batches in an epoch of `len` examples (the remainder is dropped).
    pub fn steps_per_epoch(&self, len: usize) -> usize {
        len / self.global_batch()
    }

    /// The indices of `order` in global batch `step`.
    pub fn global<'a>(&self, order: &'a [usize], step: usize) -> &'a [usize] {
        let size = self.global_batch();
        &order[step * size..(step + 1) * size]
    }

    /// Rank `rank`'s micro-batch `micro` of global batch `step`.
    pub fn micro<'a>(&self, order: &'a [usize], step: usize, rank: usize, micro: usize) -> &'a [usize] {
        let per_rank = self.micro_batch * self.accumulation;
        let start = step * self.global_batch() + rank * per_rank + micro * self.micro_batch;
        &order[start..start + self.micro_batch]
    }
}

/// Copies a host tensor to `device` without making the host wait for the
/// GPU: through pinned memory, asynchronously (a pageable copy would block
/// until every queued kernel had run, so the host could not run ahead).
pub fn to_device_async(host: &Tensor, device: Device) -> Tensor {
    match device {
        Device::Cpu => host.shallow_clone(),
        _ => match ft_sys::pin_memory(host) {
            Ok(pinned) => pinned.to_device_(device, host.kind(), true, false),
            // Without pinned memory (none left, no driver) the copy is merely synchronous.
            Err(_) => host.to_device(device),
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranks_and_micro_batches_tile_the_global_batch() {
        let order = epoch_order(20, 3, 1, true);
        assert_eq!(order, epoch_order(20, 3, 1, true));
        assert_ne!(order, epoch_order(20, 4, 1, true));
        let layout = BatchLayout { micro_batch: 2, accumulation: 2, world: 2 };
        assert_eq!(layout.steps_per_epoch(20), 2);
        let mut seen: Vec<usize> = vec![];
        for rank in 0..2 {
            for micro in 0..2 {
                seen.extend(layout.micro(&order, 1, rank, micro));
            }
        }
        assert_eq!(seen, layout.global(&order, 1));
        // One rank with 4× the micro-batch sees the same global batch.
        let single = BatchLayout { micro_batch: 8, accumulation: 1, world: 1 };
        assert_eq!(single.global(&order, 1), layout.global(&order, 1));
    }
}

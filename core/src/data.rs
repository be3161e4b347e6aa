//! From examples to the micro-batches each rank computes. An epoch is a
//! seeded shuffle of the whole set; step k's global batch is the k-th slice
//! of it, cut into one contiguous part per rank and each part into
//! micro-batches. So the same global batches are seen whatever the world
//! size and accumulation, which is what makes runs comparable step for step.

use crate::dataset::{Example, IGNORE_INDEX};
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

/// Target tokens (labels that are not ignored, after the shift) of some examples.
pub fn target_tokens<'a>(examples: impl IntoIterator<Item = &'a Example>) -> usize {
    examples.into_iter().map(|e| e.labels.iter().skip(1).filter(|l| **l != IGNORE_INDEX).count()).sum()
}

/// Right-pads examples to the longest one, rounded up to a multiple of
/// `multiple` (few distinct shapes let the GPU allocator and kernel caches
/// reuse what earlier steps set up): (input ids, labels), [batch, len].
/// Padding is invisible to a causal model's earlier positions and has no loss.
pub fn collate(examples: &[&Example], pad_id: i64, multiple: usize, device: Device) -> (Tensor, Tensor) {
    let longest = examples.iter().map(|e| e.input_ids.len()).max().unwrap_or(0);
    let longest = longest.div_ceil(multiple.max(1)) * multiple.max(1);
    let pad = |values: &[i64], with: i64| {
        let mut row = values.to_vec();
        row.resize(longest, with);
        row
    };
    let ids: Vec<Vec<i64>> = examples.iter().map(|e| pad(&e.input_ids, pad_id)).collect();
    let labels: Vec<Vec<i64>> = examples.iter().map(|e| pad(&e.labels, IGNORE_INDEX)).collect();
    (to_device_async(&Tensor::from_slice2(&ids), device), to_device_async(&Tensor::from_slice2(&labels), device))
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

    #[test]
    fn collate_pads_inputs_and_ignores_padded_labels() {
        let a = Example { input_ids: vec![1, 2, 3], labels: vec![-100, 2, 3] };
        let b = Example { input_ids: vec![4], labels: vec![4] };
        let (ids, labels) = collate(&[&a, &b], 0, 1, Device::Cpu);
        assert_eq!(Vec::<Vec<i64>>::try_from(ids).unwrap(), vec![vec![1, 2, 3], vec![4, 0, 0]]);
        assert_eq!(Vec::<Vec<i64>>::try_from(labels).unwrap(), vec![vec![-100, 2, 3], vec![4, -100, -100]]);
        assert_eq!(target_tokens([&a, &b]), 2);
        let (ids, _) = collate(&[&a, &b], 0, 4, Device::Cpu);
        assert_eq!(ids.size(), [2, 4]);
    }
}

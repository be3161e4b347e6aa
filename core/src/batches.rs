//! From a dataset's indices to the micro-batches each rank computes. An
//! epoch is a seeded shuffle of the whole set; step k's global batch is the
//! k-th slice of it, cut into one contiguous part per rank and each part
//! into micro-batches. So the same global batches are seen whatever the
//! world size and accumulation, which is what makes runs comparable step
//! for step. An epoch's last, short global batch is left out, or with
//! `keep_last` split as evenly as the ranks allow (fewer micro-batches
//! when it is too short for every rank to fill each).

use rand::seq::SliceRandom;
use rand::SeedableRng;
use tch::{Device, Tensor};

/// Example indices in the order epoch `epoch` visits them, in groups of
/// `group` consecutive examples kept together (a prompt's completions;
/// 1 for most tasks).
pub fn epoch_order(len: usize, group: usize, epoch: u64, seed: u64, shuffle: bool) -> Vec<usize> {
    let group = group.max(1);
    let mut groups: Vec<usize> = (0..len / group).collect();
    if shuffle {
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ epoch);
        groups.shuffle(&mut rng);
    }
    groups.into_iter().flat_map(|g| g * group..(g + 1) * group).collect()
}

/// How a global batch is split.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BatchLayout {
    /// Examples per micro-batch on one rank.
    pub micro_batch: usize,
    pub accumulation: usize,
    pub world: usize,
    /// Train an epoch's last global batch when the examples do not fill it
    /// (`data.drop_last=false`), as long as it gives every rank an example.
    pub keep_last: bool,
}

impl BatchLayout {
    pub fn global_batch(&self) -> usize {
        self.micro_batch * self.accumulation * self.world
    }

    /// Global batches in an epoch of `len` examples: the full ones, and
    /// with `keep_last` the short rest when it has an example for every rank.
    pub fn steps_per_epoch(&self, len: usize) -> usize {
        let rest = len % self.global_batch();
        len / self.global_batch() + usize::from(self.keep_last && rest >= self.world)
    }

    /// Examples an epoch of `len` leaves out (after its last global batch).
    pub fn dropped(&self, len: usize) -> usize {
        len.saturating_sub(self.steps_per_epoch(len) * self.global_batch())
    }

    /// The indices of `order` in global batch `step` (the last may be short).
    pub fn global<'a>(&self, order: &'a [usize], step: usize) -> &'a [usize] {
        let size = self.global_batch();
        &order[step * size..((step + 1) * size).min(order.len())]
    }

    /// Micro-batches each rank computes in global batch `step`: the
    /// accumulation, or fewer in a short batch, so that none is empty.
    pub fn micro_steps(&self, order: &[usize], step: usize) -> usize {
        self.accumulation.min(self.global(order, step).len() / self.world).max(1)
    }

    /// Rank `rank`'s micro-batch `micro` of global batch `step`: each rank
    /// a contiguous part of it, each part cut into `micro_steps` (sizes
    /// differ by one at most, in a short batch only).
    pub fn micro<'a>(&self, order: &'a [usize], step: usize, rank: usize, micro: usize) -> &'a [usize] {
        let part = even_part(self.global(order, step), self.world, rank);
        even_part(part, self.micro_steps(order, step), micro)
    }
}

/// Part `index` of `items` cut into `parts` contiguous parts whose sizes differ by one at most.
fn even_part(items: &[usize], parts: usize, index: usize) -> &[usize] {
    let (size, longer) = (items.len() / parts, items.len() % parts);
    let start = index * size + index.min(longer);
    &items[start..start + size + usize::from(index < longer)]
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
        let order = epoch_order(20, 1, 3, 1, true);
        assert_eq!(order, epoch_order(20, 1, 3, 1, true));
        assert_ne!(order, epoch_order(20, 1, 4, 1, true));
        let layout = BatchLayout { micro_batch: 2, accumulation: 2, world: 2, keep_last: false };
        assert_eq!(layout.steps_per_epoch(20), 2);
        let mut seen: Vec<usize> = vec![];
        for rank in 0..2 {
            for micro in 0..2 {
                seen.extend(layout.micro(&order, 1, rank, micro));
            }
        }
        assert_eq!(seen, layout.global(&order, 1));
        // One rank with 4× the micro-batch sees the same global batch.
        let single = BatchLayout { micro_batch: 8, accumulation: 1, world: 1, keep_last: false };
        assert_eq!(single.global(&order, 1), layout.global(&order, 1));
        assert_eq!(layout.micro(&order, 1, 1, 1), &layout.global(&order, 1)[6..8], "a full batch: fixed micro-batches in rank order");
    }

    #[test]
    fn a_short_last_batch_is_dropped_or_split_so_no_micro_batch_is_empty() {
        let order = epoch_order(23, 1, 0, 1, true);
        let dropping = BatchLayout { micro_batch: 2, accumulation: 2, world: 2, keep_last: false };
        assert_eq!((dropping.steps_per_epoch(23), dropping.dropped(23)), (2, 7));
        let keeping = BatchLayout { keep_last: true, ..dropping };
        assert_eq!((keeping.steps_per_epoch(23), keeping.dropped(23)), (3, 0));
        // 7 examples over 2 ranks: 4 and 3, each in 2 micro-batches.
        assert_eq!(keeping.micro_steps(&order, 2), 2);
        let mut seen: Vec<usize> = vec![];
        for rank in 0..2 {
            for micro in 0..2 {
                let part = keeping.micro(&order, 2, rank, micro);
                assert!(!part.is_empty());
                seen.extend(part);
            }
        }
        assert_eq!(seen, keeping.global(&order, 2));
        // 17 examples: one left over, too few for both ranks, so it is still dropped.
        assert_eq!((keeping.steps_per_epoch(17), keeping.dropped(17)), (2, 1));
        // 3 left for 2 ranks: one micro-batch each.
        assert_eq!(keeping.micro_steps(&epoch_order(19, 1, 0, 1, true), 2), 1);
    }
}

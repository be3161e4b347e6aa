//! Packing (`data.packing`): several examples in one row of at most
//! max_seq_len tokens, so a batch of short and long examples is not mostly
//! padding. Which examples share a row is decided here; the row keeps its
//! examples apart when it is computed (`ft_core::model::Inputs::documents`:
//! positions restart and attention stays inside each example, the label at
//! each seam ignored), so a packed example's loss is what it would be alone.

use std::collections::BTreeSet;

/// Rows of example indices for examples of `lengths` tokens in rows of
/// `capacity`, best fit decreasing (as TRL's `bfd`): the longest example
/// first, each into the row it fills most, a new row when none has room.
/// Deterministic (ties by index), so every rank packs alike. An example
/// longer than `capacity` gets a row of its own.
pub fn pack(lengths: &[usize], capacity: usize) -> Vec<Vec<usize>> {
    let mut order: Vec<usize> = (0..lengths.len()).collect();
    order.sort_by_key(|&i| (std::cmp::Reverse(lengths[i]), i));
    let mut rows: Vec<Vec<usize>> = vec![];
    // (room left, row) of every row with room.
    let mut room: BTreeSet<(usize, usize)> = BTreeSet::new();
    for i in order {
        match room.range((lengths[i], 0)..).next().copied() {
            Some((left, row)) => {
                room.remove(&(left, row));
                rows[row].push(i);
                if left > lengths[i] {
                    room.insert((left - lengths[i], row));
                }
            }
            None => {
                rows.push(vec![i]);
                if capacity > lengths[i] {
                    room.insert((capacity - lengths[i], rows.len() - 1));
                }
            }
        }
    }
    rows
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rows_hold_every_example_once_within_capacity_and_fill_best_first() {
        let lengths = [5, 3, 8, 2, 2, 7, 1, 12];
        let rows = pack(&lengths, 10);
        let mut seen: Vec<usize> = rows.concat();
        seen.sort();
        assert_eq!(seen, (0..lengths.len()).collect::<Vec<_>>(), "every example once");
        let used: Vec<usize> = rows.iter().map(|row| row.iter().map(|&i| lengths[i]).sum()).collect();
        assert!(used.iter().zip(&rows).all(|(&u, row)| u <= 10 || row.len() == 1), "{used:?}");
        // 12 alone; 8 + 2; 7 + 3; 5 + 2 + 1 (the 2 goes to the row it fills best: 8's).
        assert_eq!(rows, vec![vec![7], vec![2, 3], vec![5, 1], vec![0, 4, 6]]);
        assert_eq!(pack(&lengths, 10), rows, "the same every time");
        assert!(pack(&[], 10).is_empty());
    }
}

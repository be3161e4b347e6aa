//! Several sources in one training set (`data.mixture`, several
//! `--train-file`s): how many examples each gives, and their interleaving
//! in an order fixed by the seed — so a checkpoint's data cursor, which
//! counts examples of this set, resumes it exactly, and `data.range`
//! slices it as it slices one file.

use crate::example::in_range;
use anyhow::{bail, Result};
use ft_core::config::{DataConfig, DataRange, MixtureSource};
use rand::seq::SliceRandom;
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;
use std::path::Path;

/// How much of the mixture a source is.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Share {
    /// Each of its examples once.
    All,
    /// This many examples.
    Samples(usize),
    /// This part of the examples the weighted sources hold together, by weight.
    Weight(f64),
}

impl Share {
    /// A mixture entry's `weight` or `samples` (not both), named by `name` in errors.
    fn new(weight: Option<f64>, samples: Option<usize>, name: &str) -> Result<Share> {
        match (weight, samples) {
            (Some(_), Some(_)) => bail!("data.mixture: {name} has both a weight and samples; give one"),
            (Some(w), None) if !(w.is_finite() && w > 0.0) => bail!("data.mixture: {name}'s weight must be a positive number (got {w})"),
            (Some(w), None) => Ok(Share::Weight(w)),
            (None, Some(0)) => bail!("data.mixture: {name}'s samples must be at least 1"),
            (None, Some(n)) => Ok(Share::Samples(n)),
            (None, None) => Ok(Share::All),
        }
    }
}

/// One source of a mixture: its name (for the log), its examples in order, its share.
struct Part<T> {
    name: String,
    examples: Vec<T>,
    share: Share,
}

/// How many examples each part gives: `All` its own, `Samples` as many,
/// and the weighted parts together as many as they hold, split by weight
/// (largest remainders, so the counts add up).
fn counts<T>(parts: &[Part<T>]) -> Vec<usize> {
    let weighted: usize = parts.iter().filter(|p| matches!(p.share, Share::Weight(_))).map(|p| p.examples.len()).sum();
    let total_weight: f64 = parts.iter().filter_map(|p| if let Share::Weight(w) = p.share { Some(w) } else { None }).sum();
    let exact: Vec<f64> = parts.iter().map(|p| if let Share::Weight(w) = p.share { weighted as f64 * w / total_weight } else { 0.0 }).collect();
    let mut counts: Vec<usize> = parts
        .iter()
        .zip(&exact)
        .map(|(part, exact)| match part.share {
            Share::All => part.examples.len(),
            Share::Samples(n) => n,
            Share::Weight(_) => exact.floor() as usize,
        })
        .collect();
    let mut short = weighted - counts.iter().zip(parts).filter(|(_, p)| matches!(p.share, Share::Weight(_))).map(|(c, _)| c).sum::<usize>();
    let mut by_remainder: Vec<usize> = (0..parts.len()).filter(|&i| matches!(parts[i].share, Share::Weight(_))).collect();
    by_remainder.sort_by(|&a, &b| (exact[b] - exact[b].floor()).total_cmp(&(exact[a] - exact[a].floor())).then(a.cmp(&b)));
    for i in by_remainder {
        if short == 0 {
            break;
        }
        counts[i] += 1;
        short -= 1;
    }
    counts
}

/// The parts' examples interleaved: each gives its count of examples in
/// its own order (from its start again when it has fewer), at positions
/// a seeded shuffle chooses. The log says each part's share of the items
/// (`what`: examples, preference pairs).
fn interleave<T: Clone>(parts: Vec<Part<T>>, seed: u64, what: &str) -> Result<Vec<T>> {
    let counts = counts(&parts);
    for (part, &count) in parts.iter().zip(&counts) {
        if part.examples.is_empty() && count > 0 {
            bail!("data.mixture: {} gives no {what}", part.name);
        }
    }
    let total: usize = counts.iter().sum();
    let mut order: Vec<usize> = counts.iter().enumerate().flat_map(|(part, &count)| std::iter::repeat_n(part, count)).collect();
    order.shuffle(&mut ChaCha8Rng::seed_from_u64(seed));
    let mut next = vec![0; parts.len()];
    let mixed = order
        .into_iter()
        .map(|part| {
            let examples = &parts[part].examples;
            next[part] += 1;
            examples[(next[part] - 1) % examples.len()].clone()
        })
        .collect();
    let shares: Vec<String> = parts
        .iter()
        .zip(&counts)
        .map(|(part, &count)| {
            let held = part.examples.len();
            let of_it = match count.cmp(&held) {
                std::cmp::Ordering::Less => format!("the first {count} of its {held}"),
                std::cmp::Ordering::Equal => format!("its {held} once"),
                std::cmp::Ordering::Greater => format!("its {held} {:.2} times", count as f64 / held as f64),
            };
            format!("{} {count} ({:.1}%: {of_it})", part.name, 100.0 * count as f64 / total.max(1) as f64)
        })
        .collect();
    if crate::logs_data() {
        tracing::info!("data.mixture: {total} {what} in a seeded order: {}", shares.join(", "));
    }
    Ok(mixed)
}

/// The training set, of whatever a task trains on (`what` names its items
/// in the log): `data.train`'s, as `load(path, None)` reads it (`range` and
/// `limit` its own to apply), or each source of `data.mixture` read whole
/// by `load(path, Some(source))` and interleaved in an order fixed by
/// `seed`, then `range` of the mixture, up to `limit`. None: no training
/// data is set.
pub fn training_set<T: Clone>(
    data: &DataConfig,
    seed: u64,
    range: Option<DataRange>,
    limit: Option<usize>,
    what: &str,
    mut load: impl FnMut(&Path, Option<&MixtureSource>) -> Result<Vec<T>>,
) -> Result<Option<Vec<T>>> {
    let sources = match (&data.train, data.mixture.as_slice()) {
        (None, []) => return Ok(None),
        (Some(path), []) => return Ok(Some(load(path, None)?)),
        (Some(_), [_, ..]) => bail!(
            "data.train and data.mixture are both set: give one training file (data.train) or several (data.mixture, or --train-file more than once)"
        ),
        (None, sources) => sources,
    };
    let mut parts = vec![];
    for source in sources {
        let name = source.path.display().to_string();
        let share = Share::new(source.weight, source.samples, &name)?;
        parts.push(Part { examples: load(&source.path, Some(source))?, name, share });
    }
    let mut items = in_range(range, interleave(parts, seed, what)?, Path::new("data.mixture"), &format!("{what} of the mixture"))?;
    if let Some(limit) = limit {
        items.truncate(limit);
    }
    Ok(Some(items))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn part(name: &str, len: usize, share: Share) -> Part<(String, usize)> {
        Part { name: name.into(), examples: (0..len).map(|i| (name.to_string(), i)).collect(), share }
    }

    #[test]
    fn weights_split_the_weighted_sources_examples_and_samples_fix_a_count() {
        let parts = [part("a", 100, Share::Weight(3.0)), part("b", 101, Share::Weight(1.0)), part("c", 5, Share::Samples(12)), part("d", 7, Share::All)];
        assert_eq!(counts(&parts), vec![151, 50, 12, 7]);
    }

    #[test]
    fn the_order_is_the_seeds_and_each_source_keeps_its_own() {
        let mix = |seed| interleave(vec![part("a", 30, Share::Weight(3.0)), part("b", 10, Share::Weight(1.0))], seed, "examples").unwrap();
        let (first, again, other) = (mix(7), mix(7), mix(8));
        assert_eq!(first, again);
        assert_ne!(first, other);
        let from = |name: &str| first.iter().filter(|(n, _)| n == name).map(|(_, i)| *i).collect::<Vec<_>>();
        // a: 30 of 40 — its 30 once, in order; b: 10 — its 10 once.
        assert_eq!(from("a"), (0..30).collect::<Vec<_>>());
        assert_eq!(from("b"), (0..10).collect::<Vec<_>>());
        // Repeated from its start when it holds fewer than its count.
        let cycled = interleave(vec![part("x", 3, Share::Samples(7))], 0, "examples").unwrap();
        assert_eq!(cycled.iter().map(|(_, i)| *i).collect::<Vec<_>>(), [0, 1, 2, 0, 1, 2, 0]);
        assert!(Share::new(Some(1.0), Some(3), "x").unwrap_err().to_string().contains("both a weight and samples"));
        assert!(Share::new(Some(-1.0), None, "x").is_err());
    }
}

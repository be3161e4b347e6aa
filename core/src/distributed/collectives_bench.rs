//! The collectives benchmark behind `ft comm-test`: the bandwidth
//! self-test run before a multi-node job. Each collective is first checked for correct values with
//! every reduction it supports, then timed; bandwidth uses nccl-tests'
//! definitions so the numbers compare with nccl-tests and with
//! `bench/peers/comm_bench.py` (PyTorch's own torch.distributed).

pub use crate::distributed::comm::Collective;
use crate::device::synchronize;
use crate::distributed::comm::{Communicator, ProcessGroup, Reduction};
use crate::distributed::comm_hook::{CommHook, TokenExchange};
use anyhow::{bail, Result};
use serde::{Deserialize, Serialize};
use std::time::Instant;
use tch::{Device, Kind, Tensor};

/// What `ft comm-test` benchmarks.
pub const BENCHED: [Collective; 5] = [Collective::AllReduce, Collective::AllGather, Collective::ReduceScatter, Collective::AllToAll, Collective::Broadcast];

/// One of `BENCHED`, by name.
pub fn parse_collective(text: &str) -> Result<Collective> {
    BENCHED.into_iter().find(|c| c.name() == text).ok_or_else(|| {
        let names: Vec<&str> = BENCHED.iter().map(|c| c.name()).collect();
        anyhow::anyhow!("unknown collective {text:?}: expected one of {}", names.join(", "))
    })
}

/// Reductions whose results are checked (broadcast and all_gather have none).
fn checked_reductions(collective: Collective) -> &'static [Reduction] {
    match collective {
        Collective::AllReduce => &[Reduction::Sum, Reduction::Avg, Reduction::Max],
        Collective::ReduceScatter => &[Reduction::Sum, Reduction::Avg],
        Collective::AllGather | Collective::AllToAll | Collective::Broadcast => &[Reduction::Sum],
    }
}

#[derive(Debug, Clone)]
pub struct CommTestOptions {
    pub collectives: Vec<Collective>,
    /// Sizes in bytes, as nccl-tests counts them: the whole buffer (the gathered
    /// output of all_gather, the input of reduce_scatter).
    pub sizes: Vec<usize>,
    pub kind: Kind,
    pub warmup: usize,
    pub iters: usize,
    pub check: bool,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct CommTestRow {
    pub op: String,
    pub group: String,
    pub group_size: usize,
    pub bytes: usize,
    pub elements: usize,
    pub dtype: String,
    /// Mean time per collective on the slowest rank.
    pub time_us: f64,
    pub algbw_gbps: f64,
    pub busbw_gbps: f64,
    /// None when checking was switched off.
    pub correct: Option<bool>,
}

pub fn dtype_name(kind: Kind) -> &'static str {
    match kind {
        Kind::Float => "f32",
        Kind::BFloat16 => "bf16",
        Kind::Half => "f16",
        Kind::Double => "f64",
        _ => "other",
    }
}

/// Sizes from `min` to `max` bytes, multiplying by `factor` (nccl-tests' -b/-e/-f).
pub fn size_sweep(min: usize, max: usize, factor: usize) -> Result<Vec<usize>> {
    if min == 0 || min > max || factor < 2 {
        bail!("size sweep needs 0 < min ({min}) <= max ({max}) and factor ({factor}) >= 2");
    }
    let mut sizes = vec![];
    let mut size = min;
    while size <= max {
        sizes.push(size);
        size = size.saturating_mul(factor);
    }
    Ok(sizes)
}

/// Parses "64", "4K", "1M", "2G" (powers of 1024) into bytes.
pub fn parse_bytes(text: &str) -> Result<usize> {
    let text = text.trim();
    let (digits, unit) = match text.char_indices().find(|(_, c)| !c.is_ascii_digit()) {
        Some((i, _)) => text.split_at(i),
        None => (text, ""),
    };
    let scale: usize = match unit.trim_end_matches(['B', 'b', 'i']) {
        "" => 1,
        "K" | "k" => 1 << 10,
        "M" | "m" => 1 << 20,
        "G" | "g" => 1 << 30,
        _ => bail!("cannot read size {text:?}: use a number with an optional K, M or G suffix"),
    };
    let value: usize = digits.parse().map_err(|_| anyhow::anyhow!("cannot read size {text:?}"))?;
    Ok(value * scale)
}

pub fn format_bytes(bytes: usize) -> String {
    const UNITS: [(&str, usize); 3] = [("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)];
    for (name, scale) in UNITS {
        if bytes >= scale && bytes % scale == 0 {
            return format!("{} {name}", bytes / scale);
        }
    }
    format!("{bytes} B")
}

/// The values rank `member` (0-based in its group) contributes: integers
/// scaled by member+1, exact in bf16 for the group sizes a node holds, so that
/// sums and maxima can be compared exactly.
fn pattern(elements: usize, offset: usize, scale: f64, device: Device) -> Tensor {
    let index = Tensor::arange_start((offset) as i64, (offset + elements) as i64, (Kind::Int64, device));
    (index.remainder(3) + 1).to_kind(Kind::Double) * scale
}

fn matches(actual: &Tensor, expected: &Tensor, kind: Kind, exact: bool) -> bool {
    let expected = expected.to_kind(kind).to_kind(Kind::Double);
    let actual = actual.to_kind(Kind::Double);
    let tolerance = if exact {
        0.0
    } else {
        match kind {
            Kind::BFloat16 => 1e-2,
            Kind::Half => 1e-3,
            _ => 1e-6,
        }
    };
    let error = (&actual - &expected).abs().max().double_value(&[]);
    let scale = expected.abs().max().double_value(&[]).max(1.0);
    error <= tolerance * scale
}

struct Buffers {
    input: Tensor,
    output: Tensor,
    /// Elements in the buffer nccl-tests sizes by.
    elements: usize,
    /// A hook's all-to-all: its uneven splits.
    splits: Option<Uneven>,
}

/// The splits of a hook's all-to-all of about `chunk` elements per pair of members.
struct Uneven {
    chunk: usize,
    /// What this member sends each member, and receives from each.
    sent: Vec<i64>,
    received: Vec<i64>,
}

/// Elements member `from` sends member `to` through a hook's all-to-all:
/// `chunk` give or take one, so the splits differ by rank, as expert
/// parallelism's do.
fn uneven_elements(chunk: usize, from: usize, to: usize) -> i64 {
    (chunk + (from + 2 * to) % 3) as i64 - 1
}

/// A hook's all-to-all of about `elements` per member, each member's splits uneven.
fn uneven_buffers(elements: usize, group: &ProcessGroup, kind: Kind, device: Device) -> Buffers {
    let (n, me, chunk) = (group.size(), group.rank(), elements / group.size());
    let sent: Vec<i64> = (0..n).map(|to| uneven_elements(chunk, me, to)).collect();
    let received: Vec<i64> = (0..n).map(|from| uneven_elements(chunk, from, me)).collect();
    let (input, output) = (Tensor::empty([sent.iter().sum::<i64>()], (kind, device)), Tensor::empty([received.iter().sum::<i64>()], (kind, device)));
    Buffers { elements: input.numel(), input, output, splits: Some(Uneven { chunk, sent, received }) }
}

/// Allocates `op`'s buffers for `bytes`, rounded down so every rank gets an
/// equal chunk (uneven ones for a `hook`'s all-to-all).
fn buffers(op: Collective, bytes: usize, group: &ProcessGroup, kind: Kind, device: Device, hook: bool) -> Result<Buffers> {
    let n = group.size();
    let element_size = kind.elt_size_in_bytes();
    let elements = (bytes / element_size / n) * n;
    if elements == 0 {
        bail!("{} bytes is too small for {} over {n} ranks in {}", bytes, op.name(), dtype_name(kind));
    }
    let options = (kind, device);
    let (input, output) = match op {
        Collective::AllReduce | Collective::Broadcast => {
            let t = Tensor::empty([elements as i64], options);
            (t.shallow_clone(), t)
        }
        Collective::AllGather => {
            (Tensor::empty([(elements / n) as i64], options), Tensor::empty([elements as i64], options))
        }
        Collective::ReduceScatter => {
            (Tensor::empty([elements as i64], options), Tensor::empty([(elements / n) as i64], options))
        }
        Collective::AllToAll if hook => return Ok(uneven_buffers(elements, group, kind, device)),
        Collective::AllToAll => (Tensor::empty([elements as i64], options), Tensor::empty([elements as i64], options)),
    };
    Ok(Buffers { input, output, elements, splits: None })
}

/// Launches `op` once on `b` and waits for it (a hook's all-to-all through `hook`).
fn run_once(op: Collective, group: &ProcessGroup, b: &mut Buffers, reduction: Reduction, hook: Option<&mut Box<dyn CommHook>>) -> Result<()> {
    let root = group.size() - 1;
    if let (Collective::AllToAll, Some(hook), Some(uneven)) = (op, hook, &b.splits) {
        let (input, output) = (b.input.shallow_clone(), b.output.shallow_clone());
        let request = TokenExchange { group, input, output, input_splits: uneven.sent.clone(), output_splits: uneven.received.clone() };
        return hook.all_to_all(request)?.wait();
    }
    let work = match op {
        Collective::AllReduce => group.all_reduce(&mut b.output, reduction)?,
        Collective::AllGather => group.all_gather_into_tensor(&mut b.output, &b.input)?,
        Collective::ReduceScatter => group.reduce_scatter_tensor(&mut b.output, &b.input, reduction)?,
        Collective::AllToAll => group.all_to_all(&mut b.output, &b.input)?,
        Collective::Broadcast => group.broadcast(&mut b.output, root)?,
    };
    Ok(work.wait()?)
}

/// Fills the input with this rank's pattern, runs `op`, and compares with
/// what the group must produce. Broadcast's root is the last member, so a
/// root other than 0 is exercised.
fn check(op: Collective, group: &ProcessGroup, b: &mut Buffers, reduction: Reduction, kind: Kind, hook: Option<&mut Box<dyn CommHook>>) -> Result<bool> {
    let (n, me) = (group.size(), group.rank());
    let device = b.input.device();
    let input_len = b.input.numel();
    b.input.copy_(&pattern(input_len, 0, (me + 1) as f64, device));
    run_once(op, group, b, reduction, hook)?;
    let sum_of_scales = (n * (n + 1) / 2) as f64;
    let output_len = b.output.numel();
    let expected = match (op, reduction) {
        (Collective::AllReduce, Reduction::Sum) => pattern(output_len, 0, sum_of_scales, device),
        (Collective::AllReduce, Reduction::Avg) => pattern(output_len, 0, sum_of_scales / n as f64, device),
        (Collective::AllReduce, Reduction::Max) => pattern(output_len, 0, n as f64, device),
        (Collective::AllGather, _) => {
            let chunks: Vec<Tensor> = (0..n).map(|j| pattern(input_len, 0, (j + 1) as f64, device)).collect();
            Tensor::cat(&chunks, 0)
        }
        (Collective::ReduceScatter, Reduction::Sum) => pattern(output_len, me * output_len, sum_of_scales, device),
        (Collective::ReduceScatter, Reduction::Avg) => {
            pattern(output_len, me * output_len, sum_of_scales / n as f64, device)
        }
        (Collective::AllToAll, _) if b.splits.is_some() => {
            // Member j's elements for `me`, at the offset they have in j's input.
            let chunk = b.splits.as_ref().map_or(0, |uneven| uneven.chunk);
            let chunks: Vec<Tensor> = (0..n)
                .map(|j| {
                    let before: i64 = (0..me).map(|to| uneven_elements(chunk, j, to)).sum();
                    pattern(uneven_elements(chunk, j, me) as usize, before as usize, (j + 1) as f64, device)
                })
                .collect();
            Tensor::cat(&chunks, 0)
        }
        (Collective::AllToAll, _) => {
            // Chunk j of the output is chunk `me` of rank j's input.
            let chunk = output_len / n;
            let chunks: Vec<Tensor> = (0..n).map(|j| pattern(chunk, me * chunk, (j + 1) as f64, device)).collect();
            Tensor::cat(&chunks, 0)
        }
        (Collective::Broadcast, _) => pattern(output_len, 0, n as f64, device),
        (op, reduction) => bail!("no expected values for {} with {reduction:?}", op.name()),
    };
    Ok(matches(&b.output, &expected, kind, reduction != Reduction::Avg))
}

/// Runs the sweep over `group`. Every member must call it with the same options;
/// all members get the same rows (times are the slowest member's). With a
/// `hook`, the all-to-all goes through its `all_to_all`, with uneven splits.
pub fn run(group: &ProcessGroup, device: Device, options: &CommTestOptions, hook: &mut Option<Box<dyn CommHook>>) -> Result<Vec<CommTestRow>> {
    let mut rows = vec![];
    for &op in &options.collectives {
        for &bytes in &options.sizes {
            let mut b = buffers(op, bytes, group, options.kind, device, hook.is_some())?;
            let correct = if options.check {
                let mut all_correct = true;
                for &reduction in checked_reductions(op) {
                    all_correct &= check(op, group, &mut b, reduction, options.kind, hook.as_mut())?;
                }
                Some(all_correct)
            } else {
                None
            };
            for _ in 0..options.warmup {
                run_once(op, group, &mut b, Reduction::Sum, hook.as_mut())?;
            }
            synchronize(device);
            group.barrier()?.wait()?;
            let start = Instant::now();
            for _ in 0..options.iters {
                run_once(op, group, &mut b, Reduction::Sum, hook.as_mut())?;
            }
            synchronize(device);
            let seconds = start.elapsed().as_secs_f64() / options.iters.max(1) as f64;
            // The slowest member's time, and whether every member's check passed.
            let mut summary = Tensor::from_slice(&[seconds, if correct == Some(false) { 1.0 } else { 0.0 }])
                .to_device(device);
            group.all_reduce(&mut summary, Reduction::Max)?.wait()?;
            let summary: Vec<f64> = Vec::<f64>::try_from(summary.to_device(Device::Cpu))?;
            let (seconds, any_failed) = (summary[0], summary[1] > 0.0);
            let bytes_moved = b.elements * options.kind.elt_size_in_bytes();
            let algbw = bytes_moved as f64 / seconds / 1e9;
            rows.push(CommTestRow {
                op: op.name().into(),
                group: group.name().into(),
                group_size: group.size(),
                bytes: bytes_moved,
                elements: b.elements,
                dtype: dtype_name(options.kind).into(),
                time_us: seconds * 1e6,
                algbw_gbps: algbw,
                busbw_gbps: algbw * op.bus_factor(group.size()),
                correct: correct.map(|_| !any_failed),
            });
        }
    }
    Ok(rows)
}

/// What a whole job's benchmark found: every row of this rank's groups,
/// and how many checks failed on any rank.
pub struct JobReport {
    pub rows: Vec<CommTestRow>,
    pub failures_on_any_rank: usize,
}

/// `ft comm-test`: joins the job `config` describes, runs the sweep
/// ([`run_job`]) and ends it ([`JobReport::finish`]).
/// With a `hook`, its all-to-all is what runs as `all_to_all`.
pub fn run_command(config: &crate::Config, options: &CommTestOptions, dtypes: &[Kind], group_size: Option<usize>, json: Option<&std::path::Path>, mut hook: Option<Box<dyn CommHook>>) -> Result<()> {
    let rank = crate::setup::Rank::start(config, &crate::offload::NoOffload)?;
    let through = if rank.comm.world().shared_memory() { " (shared memory within this host)" } else { "" };
    tracing::info!("rendezvous complete: rank {} of {}, backend {}{through}", rank.rank(), rank.world_size(), rank.comm.backend_name());
    let report = run_job(&rank.comm, options, dtypes, group_size, &mut hook)?;
    report.finish(&rank.comm, options, json)
}

/// Runs the sweep for every dtype over the world and, with `group_size`,
/// over hybrid sharding's shard and replica sub-groups too (collective:
/// every rank calls it with the same arguments).
pub fn run_job(comm: &Communicator, options: &CommTestOptions, dtypes: &[Kind], group_size: Option<usize>, hook: &mut Option<Box<dyn CommHook>>) -> Result<JobReport> {
    let mut groups = vec![];
    if let Some(size) = group_size {
        let (shard, replica) = comm.hybrid_groups(size)?;
        groups.push(shard);
        groups.push(replica);
    }
    let mut rows = vec![];
    for &kind in dtypes {
        let options = CommTestOptions { kind, ..options.clone() };
        rows.extend(run(comm.world(), comm.device(), &options, hook)?);
        for group in &groups {
            rows.extend(run(group, comm.device(), &options, hook)?);
        }
    }
    let failed: Vec<&CommTestRow> = rows.iter().filter(|r| r.correct == Some(false)).collect();
    for row in &failed {
        tracing::error!("rank {}: {} on {} ({} bytes, {}) gave wrong values", comm.env().rank, row.op, row.group, row.bytes, row.dtype);
    }
    let mut failures = Tensor::from_slice(&[failed.len() as f64]).to_device(comm.device());
    comm.world().all_reduce(&mut failures, Reduction::Sum)?.wait()?;
    Ok(JobReport { rows, failures_on_any_rank: failures.double_value(&[]) as usize })
}

impl JobReport {
    /// The report as `ft comm-test --json` writes it (`bench/peers/comm_bench.py` writes the same).
    pub fn to_json(&self, comm: &Communicator, options: &CommTestOptions) -> serde_json::Value {
        serde_json::json!({
            "tool": "ft",
            "backend": comm.backend_name(),
            "world_size": comm.env().world_size,
            "nodes": comm.env().num_nodes(),
            "warmup": options.warmup,
            "iters": options.iters,
            "rows": self.rows,
        })
    }

    /// Ends `ft comm-test`: rank 0 prints the table and writes the JSON
    /// to `json`; a check that failed on any rank is an error, else rank 0
    /// says all passed (when `options.check`).
    pub fn finish(&self, comm: &Communicator, options: &CommTestOptions, json: Option<&std::path::Path>) -> Result<()> {
        let rank0 = comm.env().rank == 0;
        if rank0 {
            print!("{}", format_table(&self.rows));
            if let Some(path) = json {
                let text = serde_json::to_string_pretty(&self.to_json(comm, options))?;
                std::fs::write(path, text).map_err(|e| anyhow::anyhow!("cannot write {}: {e}", path.display()))?;
            }
        }
        if self.failures_on_any_rank > 0 {
            bail!("{} collective check(s) failed across the ranks (see the lines above)", self.failures_on_any_rank);
        }
        if rank0 && options.check {
            println!("all collectives gave the expected values on all {} ranks", comm.env().world_size);
        }
        Ok(())
    }
}

pub fn format_table(rows: &[CommTestRow]) -> String {
    let mut out = format!(
        "{:<15} {:<10} {:>10} {:>12} {:>5} {:>12} {:>12} {:>12} {:>6}\n",
        "collective", "group", "size", "elements", "dtype", "time (us)", "algbw GB/s", "busbw GB/s", "check"
    );
    for r in rows {
        let check = match r.correct {
            Some(true) => "ok",
            Some(false) => "WRONG",
            None => "-",
        };
        out += &format!(
            "{:<15} {:<10} {:>10} {:>12} {:>5} {:>12.1} {:>12.2} {:>12.2} {:>6}\n",
            r.op,
            format!("{}({})", r.group, r.group_size),
            format_bytes(r.bytes),
            r.elements,
            r.dtype,
            r.time_us,
            r.algbw_gbps,
            r.busbw_gbps,
            check
        );
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bus_factors_follow_nccl_tests() {
        assert_eq!(Collective::AllReduce.bus_factor(4), 1.5);
        assert_eq!(Collective::AllGather.bus_factor(4), 0.75);
        assert_eq!(Collective::ReduceScatter.bus_factor(2), 0.5);
        assert_eq!(Collective::Broadcast.bus_factor(8), 1.0);
    }

    #[test]
    fn sizes_parse_and_sweep() {
        assert_eq!(parse_bytes("64").unwrap(), 64);
        assert_eq!(parse_bytes("4K").unwrap(), 4096);
        assert_eq!(parse_bytes("1MiB").unwrap(), 1 << 20);
        assert_eq!(parse_bytes("2G").unwrap(), 2 << 30);
        assert!(parse_bytes("3X").is_err());
        assert_eq!(size_sweep(1024, 8192, 2).unwrap(), vec![1024, 2048, 4096, 8192]);
        assert!(size_sweep(0, 8, 2).is_err());
        assert_eq!(format_bytes(64 << 20), "64 MiB");
    }

    #[test]
    fn wrong_values_fail_the_check() {
        let expected = pattern(9, 0, 3.0, Device::Cpu);
        let actual = expected.to_kind(Kind::BFloat16);
        assert!(matches(&actual, &expected, Kind::BFloat16, true));
        let _ = actual.get(4).fill_(100.0);
        assert!(!matches(&actual, &expected, Kind::BFloat16, true));
        // Avg tolerates rounding, not a wrong value.
        let close = &expected * 1.001;
        assert!(matches(&close, &expected, Kind::BFloat16, false));
        assert!(!matches(&(&expected * 1.1), &expected, Kind::BFloat16, false));
    }

    #[test]
    fn pattern_values_are_exact_in_bf16() {
        let p = pattern(6, 1, 10.0, Device::Cpu).to_kind(Kind::BFloat16).to_kind(Kind::Double);
        assert_eq!(Vec::<f64>::try_from(p).unwrap(), vec![20.0, 30.0, 10.0, 20.0, 30.0, 10.0]);
    }
}

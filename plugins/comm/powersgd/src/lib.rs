//! `powersgd`: PowerSGD (Vogels et al., 2019) as an ft communication
//! plug-in — each gradient matrix M (n×m) all-reduced as two thin factors,
//! P = M Q (n×r) and Q = Mᵀ P̂ (m×r, P̂ the orthonormalised sum of P), and
//! decompressed as P̂ Qᵀ: r(n+m) elements on the wire instead of nm.
//! README.md beside this file is the walk-through docs/PLUGINS.md points to.
//!
//! - `rank` r (default 4): the factors' width (capped at min(n, m)).
//! - `start_iter` (default 10): steps before it are reduced exactly (the
//!   built-in all-reduce), as torch's `start_powerSGD_iter`.
//! - `min_compression_rate` (default 2): a matrix is compressed only when
//!   nm / (r(n+m)) reaches it; smaller ones, and every vector (biases,
//!   norms), are summed exactly in one all-reduce beside the factors.
//! - `error_feedback` (default true): what a rank's compressed part lost,
//!   M_i − P̂Qᵀ/N, is added to its next gradient, so nothing is lost for good.
//! - `warm_start` (default true): each matrix's Q starts from the last
//!   step's; otherwise from fresh random values each step.
//!
//! Where it applies: the all-reduce stages — ddp and zero1's world
//! all-reduce, hybrid_shard's replica all-reduce (on the rank's shard,
//! whose whole rows of each matrix are compressed). A reduce-scatter is
//! passed to the built-in collective; a strategy with nothing else is
//! refused. Its state — each unit's error and Q matrices — is checkpointed
//! per rank and restored on resume with the same options; at another world
//! size the Q matrices are kept and error feedback restarts.

use anyhow::{bail, Result};
use ft_core::comm_hook::{option, Builtin, CommHook, CommOption, CommPlan, GradReduce, Pending, ReduceStage, Resharded, UnitInfo, Wire, WorldChange};
use ft_core::plugin::PluginRegistrar;
use ft_core::Reduction;
use rand::{Rng, SeedableRng};
use serde_json::{Map, Value};
use std::collections::HashMap;
use tch::{Kind, Tensor};

const NAME: &str = "powersgd";

const OPTIONS: &[CommOption] = &[
    CommOption { key: "rank", default: "4", help: "width r of the low-rank factors" },
    CommOption { key: "start_iter", default: "10", help: "optimizer steps reduced exactly before compression starts" },
    CommOption { key: "min_compression_rate", default: "2", help: "compress a matrix only when nm / (r(n+m)) reaches this" },
    CommOption { key: "error_feedback", default: "true", help: "add what compression lost to the next step's gradient" },
    CommOption { key: "warm_start", default: "true", help: "start each step's Q from the last step's" },
];

#[derive(Debug, Clone, Copy)]
struct Options {
    rank: i64,
    start_iter: usize,
    min_compression_rate: f64,
    error_feedback: bool,
    warm_start: bool,
}

impl Options {
    fn read(options: &Map<String, Value>) -> Result<Options> {
        let read = Options {
            rank: option(NAME, options, "rank", 4)?,
            start_iter: option(NAME, options, "start_iter", 10)?,
            min_compression_rate: option(NAME, options, "min_compression_rate", 2.0)?,
            error_feedback: option(NAME, options, "error_feedback", true)?,
            warm_start: option(NAME, options, "warm_start", true)?,
        };
        if read.rank < 1 {
            bail!("comm.powersgd.rank must be at least 1 (got {})", read.rank);
        }
        if read.min_compression_rate.is_nan() || read.min_compression_rate < 0.0 {
            bail!("comm.powersgd.min_compression_rate must be 0 or more (got {})", read.min_compression_rate);
        }
        Ok(read)
    }
}

/// A run of whole rows of one parameter inside the reduced tensor, compressed as a matrix.
#[derive(Debug, Clone, Copy)]
struct Matrix {
    /// Where it starts in the reduced tensor.
    start: i64,
    rows: i64,
    cols: i64,
    /// The factors' width: `rank` capped at min(rows, cols).
    rank: i64,
}

/// How a reduced tensor splits into compressed matrices and the rest.
#[derive(Debug, Clone, Default)]
struct Layout {
    matrices: Vec<Matrix>,
    /// (start, length) ranges summed exactly.
    plain: Vec<(i64, i64)>,
    /// The matrices by the shape of their P (rows × rank): each group is
    /// orthonormalised in one batched QR instead of one call per matrix.
    same_p: Vec<Vec<usize>>,
}

impl Layout {
    /// The matrices of `unit`'s parameters whose whole rows lie in elements
    /// `offset..offset + len` of its flat buffer and that compress by at
    /// least `min_rate`; every other element is plain.
    fn new(unit: &UnitInfo, offset: i64, len: i64, options: &Options) -> Layout {
        let mut matrices = vec![];
        for param in unit.params.iter().filter(|p| p.shape.len() >= 2) {
            let cols = param.numel() / param.shape[0];
            let (lo, hi) = (param.offset.max(offset), (param.offset + param.numel()).min(offset + len));
            if lo >= hi || cols == 0 {
                continue;
            }
            let first_row = (lo - param.offset + cols - 1) / cols;
            let rows = (hi - param.offset) / cols - first_row;
            if rows < 2 || cols < 2 {
                continue;
            }
            let rank = options.rank.min(rows).min(cols);
            let rate = (rows * cols) as f64 / (rank * (rows + cols)) as f64;
            if rate >= options.min_compression_rate {
                matrices.push(Matrix { start: param.offset + first_row * cols - offset, rows, cols, rank });
            }
        }
        matrices.sort_by_key(|m| m.start);
        let mut plain = vec![];
        let mut at = 0;
        for m in &matrices {
            if m.start > at {
                plain.push((at, m.start - at));
            }
            at = m.start + m.rows * m.cols;
        }
        if at < len {
            plain.push((at, len - at));
        }
        let mut same_p: Vec<Vec<usize>> = vec![];
        for (i, m) in matrices.iter().enumerate() {
            match same_p.iter_mut().find(|group| matrices[group[0]].rows == m.rows && matrices[group[0]].rank == m.rank) {
                Some(group) => group.push(i),
                None => same_p.push(vec![i]),
            }
        }
        Layout { matrices, plain, same_p }
    }

    /// Elements on the wire: the factors and the plain part.
    fn wire_elements(&self) -> i64 {
        self.matrices.iter().map(|m| m.rank * (m.rows + m.cols)).sum::<i64>() + self.plain.iter().map(|(_, len)| len).sum::<i64>()
    }
}

/// Orthonormal columns spanning each of a batch `p` [g, n, r] (fp32):
/// Householder QR, whose columns stay orthonormal where P is rank
/// deficient (Gram-Schmidt's drift there, and measured slower through tch on
/// an H200: bench/results/2026-11-25-h200-comm-hooks.md).
fn orthonormalize(p: Tensor) -> Result<Tensor> {
    Ok(Tensor::f_linalg_qr(&p, "reduced")?.0)
}

/// What PowerSGD keeps for one reduced tensor (a unit at one stage).
#[derive(Default)]
struct UnitState {
    layout: Layout,
    /// This rank's accumulated compression error (fp32, the tensor's size).
    error: Option<Tensor>,
    /// Each matrix's Q (cols × rank), the same on every rank.
    q: Vec<Tensor>,
}

struct PowerSgd {
    options: Options,
    /// By `UnitInfo::id` and stage.
    units: HashMap<String, UnitState>,
    /// Checkpointed state not yet claimed by its unit (claimed at its first reduction).
    restored: HashMap<String, Tensor>,
}

fn key(unit: &UnitInfo, stage: ReduceStage) -> String {
    let stage = if stage == ReduceStage::Replica { "replica" } else { "world" };
    format!("{}.{stage}", unit.id)
}

/// Q's starting values: uniform in [-1, 1), from a generator seeded by the
/// run's seed, the tensor and the matrix (and the step without warm start),
/// so every rank draws the same without communicating.
fn initial_q(seed: u64, key: &str, index: usize, step: Option<usize>, m: &Matrix, device: tch::Device) -> Tensor {
    let mixed = key.bytes().fold(seed ^ 0x9e37_79b9_7f4a_7c15, |h, b| h.rotate_left(5) ^ b as u64);
    let mixed = mixed ^ ((index as u64) << 32) ^ step.map_or(0, |s| s as u64 + 1).rotate_left(48);
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(mixed);
    let values: Vec<f32> = (0..m.cols * m.rank).map(|_| rng.gen_range(-1.0..1.0)).collect();
    Tensor::from_slice(&values).view([m.cols, m.rank]).to_device(device)
}

impl PowerSgd {
    /// The state of `key`, its layout made for `unit`'s elements `offset..offset + len`.
    fn state(&mut self, key: &str, unit: &UnitInfo, offset: i64, len: i64, device: tch::Device) -> &mut UnitState {
        let options = self.options;
        let restored = &mut self.restored;
        self.units.entry(key.to_string()).or_insert_with(|| {
            let layout = Layout::new(unit, offset, len, &options);
            let mut claim = |name: String, shape: &[i64]| restored.remove(&name).filter(|t| t.size() == shape).map(|t| t.to_device(device));
            let error = claim(format!("{key}.error"), &[len]);
            let q = layout.matrices.iter().enumerate().map_while(|(i, m)| claim(format!("{key}.q{i}"), &[m.cols, m.rank])).collect();
            UnitState { layout, error, q }
        })
    }
}

impl CommHook for PowerSgd {
    fn name(&self) -> &str {
        NAME
    }

    /// Low-rank sums with error feedback track the exact run's loss closely, not exactly.
    fn tolerance(&self) -> f64 {
        0.05
    }

    fn check(&self, plan: &CommPlan) -> Result<()> {
        if plan.stages.contains(&ReduceStage::Shard) && !plan.stages.contains(&ReduceStage::Replica) {
            bail!(
                "powersgd compresses all-reduces, and strategy `{}` reduce-scatters every gradient with none: use ddp, zero1 or hybrid_shard (whose replica stage it compresses)",
                plan.strategy
            );
        }
        Ok(())
    }

    fn reduce(&mut self, request: GradReduce) -> Result<Pending> {
        if request.stage == ReduceStage::Shard || request.step < self.options.start_iter {
            return Builtin.reduce(request);
        }
        let options = self.options;
        let key = key(request.unit, request.stage);
        let len = request.input.size()[0];
        let device = request.input.device();
        let state = self.state(&key, request.unit, request.offset, len, device);
        if state.layout.matrices.is_empty() {
            return Builtin.reduce(request);
        }
        let _no_grad = tch::no_grad_guard();
        // The local gradient in fp32 (its own copy: `output` may be the
        // input, and is overwritten with the sum), plus what compression
        // lost last time, in one pass.
        let error = match (&state.error, options.error_feedback) {
            (Some(error), true) => Some(error.shallow_clone()),
            (None, true) => {
                let error = Tensor::zeros([len], (Kind::Float, device));
                state.error = Some(error.shallow_clone());
                Some(error)
            }
            (_, false) => None,
        };
        // Both fp32 buffers live in the workspace core allocated and counts (`workspace_bytes`).
        let scratch = request.workspace.view_dtype(Kind::Float);
        let (x, sum) = (scratch.narrow(0, 0, len), scratch.narrow(0, len, len));
        match &error {
            Some(error) => request.input.f_add_out(&x, error).map(drop)?,
            None => x.shallow_clone().copy_(&request.input),
        }
        let layout = state.layout.clone();
        if !options.warm_start || state.q.len() != layout.matrices.len() {
            let step = (!options.warm_start).then_some(request.step);
            state.q = layout.matrices.iter().enumerate().map(|(i, m)| initial_q(request.seed, &key, i, step, m, device)).collect();
        }
        let q_state: Vec<Tensor> = state.q.iter().map(Tensor::shallow_clone).collect();
        let matrices: Vec<Tensor> = layout.matrices.iter().map(|m| x.narrow(0, m.start, m.rows * m.cols).view([m.rows, m.cols])).collect();

        let group = request.group.clone();
        let mut plain = match layout.plain.is_empty() {
            true => Tensor::new(),
            false => Tensor::cat(&layout.plain.iter().map(|&(start, len)| x.narrow(0, start, len)).collect::<Vec<_>>(), 0),
        };
        let mut pending = Pending::done();
        if plain.defined() {
            pending = pending.and(group.all_reduce(&mut plain, Reduction::Sum)?);
        }
        let ps: Vec<Tensor> = matrices.iter().zip(&q_state).map(|(m, q)| m.matmul(q).reshape([-1])).collect();
        let mut p_all = Tensor::cat(&ps, 0);
        pending = pending.and(group.all_reduce(&mut p_all, Reduction::Sum)?);

        let mut output = request.output;
        Ok(pending.then(move || {
            let _no_grad = tch::no_grad_guard();
            // P̂: an orthonormal basis of each summed P, a batched QR per shape; then Q = Mᵀ P̂, summed.
            let mut starts = vec![];
            let mut at = 0;
            for m in &layout.matrices {
                starts.push(at);
                at += m.rows * m.rank;
            }
            let mut bases: Vec<Tensor> = layout.matrices.iter().map(|_| Tensor::new()).collect();
            for group in &layout.same_p {
                let m = layout.matrices[group[0]];
                let ps: Vec<Tensor> = group.iter().map(|&i| p_all.narrow(0, starts[i], m.rows * m.rank).view([m.rows, m.rank])).collect();
                let orthonormal = orthonormalize(Tensor::stack(&ps, 0))?;
                for (j, &i) in group.iter().enumerate() {
                    bases[i] = orthonormal.get(j as i64);
                }
            }
            let qs: Vec<Tensor> = matrices.iter().zip(&bases).map(|(m, p)| m.transpose(0, 1).matmul(p).reshape([-1])).collect();
            let mut q_all = Tensor::cat(&qs, 0);
            group.all_reduce(&mut q_all, Reduction::Sum)?.wait()?;
            let _ = sum.shallow_clone().zero_();
            let mut at = 0;
            for ((m, basis), q_kept) in layout.matrices.iter().zip(&bases).zip(&q_state) {
                let q = q_all.narrow(0, at, m.cols * m.rank).view([m.cols, m.rank]);
                at += m.cols * m.rank;
                sum.narrow(0, m.start, m.rows * m.cols).copy_(&basis.matmul(&q.transpose(0, 1)).reshape([-1]));
                q_kept.shallow_clone().copy_(&q);
            }
            let mut at = 0;
            for &(start, len) in &layout.plain {
                sum.narrow(0, start, len).copy_(&plain.narrow(0, at, len));
                at += len;
            }
            if let Some(mut error) = error {
                // Each rank keeps its own part of what the sum lost: M_i − P̂Qᵀ/N; the plain part lost nothing.
                error.copy_(&(&x - &sum / group.size() as f64));
                for &(start, len) in &layout.plain {
                    let _ = error.narrow(0, start, len).zero_();
                }
            }
            output.copy_(&sum);
            Ok(())
        }))
    }

    fn state(&self) -> Vec<(String, Tensor)> {
        let mut state = vec![];
        for (key, unit) in &self.units {
            state.extend(unit.error.as_ref().map(|e| (format!("{key}.error"), e.shallow_clone())));
            state.extend(unit.q.iter().enumerate().map(|(i, q)| (format!("{key}.q{i}"), q.shallow_clone())));
        }
        state
    }

    fn load_state(&mut self, state: Vec<(String, Tensor)>) -> Result<()> {
        self.units.clear();
        self.restored = state.into_iter().collect();
        Ok(())
    }

    /// At another world size each rank's error (its share of what the sum
    /// lost, M_i − P̂Qᵀ/N) no longer adds up, but Q, the same on every rank,
    /// still warm-starts its matrix wherever the layout kept its shape.
    fn reshard_state(&mut self, _change: WorldChange, state: Vec<(String, Tensor)>) -> Result<Resharded> {
        let q: Vec<(String, Tensor)> = state.into_iter().filter(|(name, _)| !name.ends_with(".error")).collect();
        let kept = format!("{} Q matrices (warm start; each kept where its shape still fits), error feedback restarts", q.len());
        self.load_state(q)?;
        Ok(Resharded::Kept(kept))
    }

    /// The error (the reduced tensor's size, with error feedback) and each matrix's Q, in fp32.
    fn state_bytes(&self, unit: &UnitInfo, wire: Wire, elements: f64) -> f64 {
        if !matches!(wire, Wire::Reduce(ReduceStage::World | ReduceStage::Replica)) {
            return 0.0;
        }
        let q: i64 = Layout::new(unit, 0, unit.padded, &self.options).matrices.iter().map(|m| m.cols * m.rank).sum();
        4.0 * (if self.options.error_feedback { elements } else { 0.0 } + q as f64)
    }

    /// The local gradient plus error and the decompressed sum, in fp32, while a stage it compresses is in flight.
    fn workspace_bytes(&self, unit: &UnitInfo, wire: Wire, elements: i64) -> i64 {
        match wire {
            Wire::Reduce(ReduceStage::World | ReduceStage::Replica) if !Layout::new(unit, 0, unit.padded, &self.options).matrices.is_empty() => 2 * 4 * elements,
            _ => 0,
        }
    }

    /// Once compressing: the factors and the plain part, in fp32, for the
    /// share of the unit the stage carries.
    fn wire_bytes(&self, unit: &UnitInfo, wire: Wire, elements: f64, element_bytes: f64) -> f64 {
        match wire {
            Wire::Reduce(ReduceStage::World | ReduceStage::Replica) => {
                let share = Layout::new(unit, 0, unit.padded, &self.options).wire_elements() as f64 / unit.padded.max(1) as f64;
                elements * share * 4.0
            }
            _ => elements * element_bytes,
        }
    }
}

fn register(registrar: &mut PluginRegistrar) {
    registrar.add_comm(
        NAME,
        "PowerSGD: all-reduces of gradient matrices as rank-r factors, with error feedback and warm start (lossy)",
        OPTIONS,
        |options| Ok(Box::new(PowerSgd { options: Options::read(options)?, units: HashMap::new(), restored: HashMap::new() })),
    );
}

ft_core::export_plugin!(register);

#[cfg(test)]
mod tests {
    use super::*;
    use ft_core::comm_hook::ParamInfo;

    fn unit() -> UnitInfo {
        let param = |name: &str, shape: &[i64], offset| ParamInfo { name: name.into(), shape: shape.to_vec(), offset };
        UnitInfo { id: "u0".into(), name: "block".into(), params: vec![param("w", &[8, 16], 0), param("b", &[16], 128)], numel: 144, padded: 144 }
    }

    #[test]
    fn matrices_are_compressed_where_it_pays_and_the_rest_is_plain() {
        let options = Options { rank: 2, start_iter: 0, min_compression_rate: 1.0, error_feedback: true, warm_start: true };
        let layout = Layout::new(&unit(), 0, 144, &options);
        assert_eq!(layout.matrices.len(), 1);
        assert_eq!((layout.matrices[0].rows, layout.matrices[0].cols, layout.matrices[0].rank), (8, 16, 2));
        assert_eq!(layout.plain, vec![(128, 16)]);
        assert_eq!(layout.same_p, vec![vec![0]]);
        assert_eq!(layout.wire_elements(), 2 * (8 + 16) + 16);
        // A shard that cuts the matrix: only its whole rows inside are compressed.
        let shard = Layout::new(&unit(), 40, 72, &options);
        assert_eq!((shard.matrices[0].start, shard.matrices[0].rows), (8, 4), "rows 3..7 are elements 48..112, 8 into the shard");
        assert_eq!(shard.plain, vec![(0, 8)]);
        // Not worth it at a high minimum rate.
        let strict = Options { min_compression_rate: 10.0, ..options };
        assert!(Layout::new(&unit(), 0, 144, &strict).matrices.is_empty());
    }

    #[test]
    fn orthonormal_bases_span_the_columns_even_when_some_are_dependent() {
        for rank in [2, 4, 16] {
            // Two independent columns, the rest copies of them: the span has dimension 2.
            let base = Tensor::randn([3, 50, 2], (Kind::Float, tch::Device::Cpu));
            let p = Tensor::cat(&(0..rank / 2).map(|_| base.shallow_clone()).collect::<Vec<_>>(), 2);
            let q = orthonormalize(p.copy()).unwrap();
            // Projecting the original columns onto the basis gives them back.
            let projected = q.matmul(&q.transpose(1, 2).matmul(&p));
            let error = (&projected - &p).abs().max().double_value(&[]) / p.abs().max().double_value(&[]);
            assert!(error < 1e-4, "rank {rank}: projection error {error:e}");
            // The basis's non-zero columns are orthonormal.
            let gram = q.transpose(1, 2).matmul(&q);
            let diagonal = gram.diagonal(0, 1, 2);
            assert!(diagonal.le(1.0 + 1e-4).all().int64_value(&[]) == 1, "rank {rank}: columns longer than 1");
            let off = (&gram - Tensor::diag_embed(&diagonal, 0, 1, 2)).abs().max().double_value(&[]);
            assert!(off < 1e-4, "rank {rank}: columns not orthogonal ({off:e})");
        }
    }
}

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
//!   norms), are summed exactly, in fp32, in the all-reduce of the Ps.
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
use ft_core::lowrank::{self, Factors};
use ft_core::comm_hook::{option, Builtin, Collective, CollectiveBytes, CommHook, CommOption, CommPlan, GradReduce, Pending, ReduceStage, Restored, UnitInfo, Wire, WireRequest, WorldChange};
use ft_core::plugin::PluginRegistrar;
use ft_core::Reduction;
use rand::{Rng, SeedableRng};
use serde_json::{Map, Value};
use std::collections::HashMap;
use std::rc::Rc;
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
    /// Where its P (rows × rank) starts among all the matrices' Ps, and its Q (cols × rank) among the Qs.
    p_at: i64,
    q_at: i64,
}

impl Matrix {
    /// Its elements of `flat` (a tensor of the reduced one's length) as a rows × cols matrix.
    fn of(&self, flat: &Tensor) -> Tensor {
        flat.narrow(0, self.start, self.rows * self.cols).view([self.rows, self.cols])
    }

    /// Its P among all the Ps.
    fn p(&self, all: &Tensor) -> Tensor {
        all.narrow(0, self.p_at, self.rows * self.rank).view([self.rows, self.rank])
    }

    /// Its Q among all the Qs.
    fn q(&self, all: &Tensor) -> Tensor {
        all.narrow(0, self.q_at, self.cols * self.rank).view([self.cols, self.rank])
    }
}

/// How a reduced tensor splits into compressed matrices and the rest.
#[derive(Debug, Clone, Default)]
struct Layout {
    matrices: Vec<Matrix>,
    /// (start, length) ranges summed exactly.
    plain: Vec<(i64, i64)>,
    /// Elements of all the plain ranges, packed together ahead of the Ps.
    plain_len: i64,
    /// Elements of all the Ps, and of all the Qs.
    p_len: i64,
    q_len: i64,
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
                matrices.push(Matrix { start: param.offset + first_row * cols - offset, rows, cols, rank, p_at: 0, q_at: 0 });
            }
        }
        matrices.sort_by_key(|m| m.start);
        let (mut p_len, mut q_len) = (0, 0);
        for m in &mut matrices {
            (m.p_at, m.q_at) = (p_len, q_len);
            p_len += m.rows * m.rank;
            q_len += m.cols * m.rank;
        }
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
        let plain_len = plain.iter().map(|(_, len)| len).sum();
        Layout { matrices, plain, plain_len, p_len, q_len }
    }

    /// Where each matrix's P lies among all the Ps, for `lowrank::orthonormalize`.
    fn p_factors(&self, device: tch::Device) -> Factors {
        Factors::new(self.matrices.iter().map(|m| [m.p_at, m.rows, m.rank]).collect(), device)
    }

    /// Elements on the wire: the factors and the plain part.
    fn wire_elements(&self) -> i64 {
        self.matrices.iter().map(|m| m.rank * (m.rows + m.cols)).sum::<i64>() + self.plain_len
    }

    /// Each plain range (start, length) and where it lies among the plain elements packed together.
    fn packed_plain(&self) -> impl Iterator<Item = (i64, i64, i64)> + '_ {
        self.plain.iter().scan(0, |at, &(start, len)| {
            *at += len;
            Some((start, len, *at - len))
        })
    }
}

/// What PowerSGD keeps for one reduced tensor (a unit at one stage).
struct UnitState {
    layout: Layout,
    /// Its matrices' Ps, as `lowrank::orthonormalize` takes them.
    p_factors: Rc<Factors>,
    /// This rank's accumulated compression error (fp32, the tensor's size).
    error: Option<Tensor>,
    /// Every matrix's Q (cols × rank) laid out as the all-reduced Qs, the same on every rank.
    q: Option<Tensor>,
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

/// Every matrix's starting Q (laid out as the all-reduced Qs): uniform in
/// [-1, 1), from a generator seeded by the run's seed, the tensor and the
/// matrix (and the step without warm start), so every rank draws the same
/// without communicating.
fn initial_q(seed: u64, key: &str, step: Option<usize>, layout: &Layout, device: tch::Device) -> Tensor {
    let mixed = key.bytes().fold(seed ^ 0x9e37_79b9_7f4a_7c15, |h, b| h.rotate_left(5) ^ b as u64);
    let mut values: Vec<f32> = Vec::with_capacity(layout.q_len as usize);
    for (index, m) in layout.matrices.iter().enumerate() {
        let mixed = mixed ^ ((index as u64) << 32) ^ step.map_or(0, |s| s as u64 + 1).rotate_left(48);
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(mixed);
        values.extend((0..m.cols * m.rank).map(|_| rng.gen_range(-1.0f32..1.0)));
    }
    Tensor::from_slice(&values).to_device(device)
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
            // Every matrix's Q, or none (a fresh start).
            let q: Option<Vec<Tensor>> = layout.matrices.iter().enumerate().map(|(i, m)| claim(format!("{key}.q{i}"), &[m.cols, m.rank])).collect();
            let q = q.filter(|q| !q.is_empty()).map(|q| Tensor::cat(&q.iter().map(|t| t.reshape([-1])).collect::<Vec<_>>(), 0));
            UnitState { p_factors: Rc::new(layout.p_factors(device)), layout, error, q }
        })
    }
}

impl CommHook for PowerSgd {
    fn name(&self) -> &str {
        NAME
    }

    /// Low-rank sums with error feedback track the exact run's loss closely, not exactly.
    fn tolerance(&self, _step: usize) -> f64 {
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
        // X, each matrix of the local gradient plus what compression lost
        // last time: with error feedback, built in the error buffer itself
        // (the gradient is added as P is computed), which becomes the next
        // error in place as the sum is written; without, an fp32 copy of the
        // gradient in the workspace core allocated (`workspace_bytes`).
        // Either way `output` (the input itself) is written only at the end.
        let (x, add) = match options.error_feedback {
            true => (state.error.get_or_insert_with(|| Tensor::zeros([len], (Kind::Float, device))).shallow_clone(), Some(&request.input)),
            false => {
                let x = request.workspace.view_dtype(Kind::Float).narrow(0, 0, len);
                x.shallow_clone().f_copy_(&request.input)?;
                (x, None)
            }
        };
        let layout = state.layout.clone();
        if !options.warm_start || state.q.is_none() {
            let step = (!options.warm_start).then_some(request.step);
            state.q = Some(initial_q(request.seed, &key, step, &layout, device));
        }
        let q_state = state.q.as_ref().map(Tensor::shallow_clone).unwrap_or_default();
        let p_factors = state.p_factors.clone();
        let matrices: Vec<Tensor> = layout.matrices.iter().map(|m| m.of(&x)).collect();

        // One all-reduce, in fp32, of the plain elements (summed exactly)
        // followed by every P = X Q: each collective is a round trip.
        let group = request.group.clone();
        let mut sent = Tensor::empty([layout.plain_len + layout.p_len], (Kind::Float, device));
        for (start, len, at) in layout.packed_plain() {
            sent.narrow(0, at, len).f_copy_(&request.input.narrow(0, start, len))?;
        }
        let (plain, p_all) = (sent.narrow(0, 0, layout.plain_len), sent.narrow(0, layout.plain_len, layout.p_len));
        for (m, x_m) in layout.matrices.iter().zip(&matrices) {
            lowrank::project(add.map(|g| m.of(g)).as_ref(), x_m, &m.q(&q_state), &m.p(&p_all))?;
        }
        let pending = Pending::of(group.all_reduce(&mut sent, Reduction::Sum)?);

        let output = request.output;
        Ok(pending.then(move || {
            let _no_grad = tch::no_grad_guard();
            // P̂: an orthonormal basis of each summed P, all in one call; then Q = Xᵀ P̂, summed.
            lowrank::orthonormalize(&p_all, &p_factors)?;
            let mut q_all = Tensor::empty([layout.q_len], (Kind::Float, device));
            for (m, x_m) in layout.matrices.iter().zip(&matrices) {
                lowrank::project_t(x_m, &m.p(&p_all), &m.q(&q_all))?;
            }
            group.all_reduce(&mut q_all, Reduction::Sum)?.wait()?;
            // The sum P̂ Qᵀ into the output; each rank keeps in X its own part
            // of what the sum lost, X − P̂ Qᵀ / N (the plain part lost nothing:
            // its error stays zero).
            let ranks = group.size() as i64;
            for (m, x_m) in layout.matrices.iter().zip(&matrices) {
                lowrank::expand(&m.p(&p_all), &m.q(&q_all), &m.of(&output), options.error_feedback.then_some((x_m, ranks)))?;
            }
            // Warm start: the next step begins from this one's Q.
            q_state.shallow_clone().f_copy_(&q_all)?;
            for (start, len, at) in layout.packed_plain() {
                output.narrow(0, start, len).f_copy_(&plain.narrow(0, at, len))?;
            }
            Ok(())
        }))
    }

    fn state(&self) -> Vec<(String, Tensor)> {
        let mut state = vec![];
        for (key, unit) in &self.units {
            state.extend(unit.error.as_ref().map(|e| (format!("{key}.error"), e.shallow_clone())));
            if let Some(q) = &unit.q {
                state.extend(unit.layout.matrices.iter().enumerate().map(|(i, m)| (format!("{key}.q{i}"), m.q(q))));
            }
        }
        state
    }

    fn load_state(&mut self, state: Vec<(String, Tensor)>) -> Result<Restored> {
        self.units.clear();
        self.restored = state.into_iter().collect();
        let errors = self.restored.keys().filter(|name| name.ends_with(".error")).count();
        let kept = format!("{errors} error buffers and {} Q matrices (each unit claims its own at its first reduction)", self.restored.len() - errors);
        Ok(Restored::Kept(kept))
    }

    /// At another world size each rank's error (its share of what the sum
    /// lost, M_i − P̂Qᵀ/N) no longer adds up, but Q, the same on every rank,
    /// still warm-starts its matrix wherever the layout kept its shape.
    fn reshard_state(&mut self, _change: WorldChange, state: Vec<(String, Tensor)>) -> Result<Restored> {
        let q: Vec<(String, Tensor)> = state.into_iter().filter(|(name, _)| !name.ends_with(".error")).collect();
        let kept = format!("{} Q matrices (warm start; each kept where its shape still fits), error feedback restarts", q.len());
        self.load_state(q)?;
        Ok(Restored::Kept(kept))
    }

    /// The error (the reduced tensor's size, with error feedback) and each matrix's Q, in fp32.
    fn state_bytes(&self, unit: &UnitInfo, request: &WireRequest) -> f64 {
        if !matches!(request.wire, Wire::Reduce(ReduceStage::World | ReduceStage::Replica)) {
            return 0.0;
        }
        let q: i64 = Layout::new(unit, 0, unit.padded, &self.options).matrices.iter().map(|m| m.cols * m.rank).sum();
        4.0 * (if self.options.error_feedback { request.elements } else { 0 } + q) as f64
    }

    /// Without error feedback, an fp32 copy of the gradient while a stage
    /// it compresses is in flight (with it, the error buffer serves).
    fn workspace_bytes(&self, unit: &UnitInfo, request: &WireRequest) -> i64 {
        match request.wire {
            Wire::Reduce(ReduceStage::World | ReduceStage::Replica) if !self.options.error_feedback && !Layout::new(unit, 0, unit.padded, &self.options).matrices.is_empty() => {
                4 * request.elements
            }
            _ => 0,
        }
    }

    /// Once compressing: all-reduces of the factors and the plain part, in
    /// fp32, for the share of the unit the stage carries.
    fn wire_bytes(&self, unit: &UnitInfo, request: &WireRequest) -> Vec<CollectiveBytes> {
        match request.wire {
            Wire::Reduce(ReduceStage::World | ReduceStage::Replica) => {
                let share = Layout::new(unit, 0, unit.padded, &self.options).wire_elements() as f64 / unit.padded.max(1) as f64;
                vec![CollectiveBytes { collective: Collective::AllReduce, bytes: request.elements as f64 * share * 4.0 }]
            }
            _ => vec![request.builtin()],
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
        assert_eq!(layout.wire_elements(), 2 * (8 + 16) + 16);
        // A shard that cuts the matrix: only its whole rows inside are compressed.
        let shard = Layout::new(&unit(), 40, 72, &options);
        assert_eq!((shard.matrices[0].start, shard.matrices[0].rows), (8, 4), "rows 3..7 are elements 48..112, 8 into the shard");
        assert_eq!(shard.plain, vec![(0, 8)]);
        // Plain ranges on both sides of the matrix pack together, in order, ahead of the Ps.
        let both = Layout::new(&unit(), 40, 104, &options);
        assert_eq!(both.packed_plain().collect::<Vec<_>>(), vec![(0, 8, 0), (88, 16, 8)]);
        assert_eq!(both.plain_len, 24);
        // Not worth it at a high minimum rate.
        let strict = Options { min_compression_rate: 10.0, ..options };
        assert!(Layout::new(&unit(), 0, 144, &strict).matrices.is_empty());
    }
}

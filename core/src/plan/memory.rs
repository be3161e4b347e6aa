//! One micro-batch's device memory, walked as `train/step.rs` runs it:
//! the stages in order and then in reverse, each sharded unit gathered,
//! prefetched and released where the trainer does it (a 4-bit unit
//! dequantized for each use), what each stage keeps
//! for backward (the model's `Activations`), the LM head's loss buffers,
//! and each trained unit's gradient (a LoRA stage's: its adapters') from autograd's flat buffer through its
//! reduction into the step's gradient (`train/reduce.rs`, at most
//! `reductions_in_flight` in flight); before them a reference model's
//! forward when one runs with each step, and float8 layers' casts. It
//! allocates nothing.

use crate::distributed::flat::{one_view, MemoryAccount, UnitPlacement};
use crate::model::{head, Float8Layers, Model, Stage, StageKind};
use crate::train::reductions_in_flight;
use serde::{Deserialize, Serialize};
use std::collections::VecDeque;
use tch::Kind;

/// Device bytes at the moment of a step's peak, by what holds them.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct PeakBreakdown {
    /// Parameters and optimizer state kept between steps.
    pub state: f64,
    /// The step's gradients (whole or shards) made so far.
    pub grads: f64,
    /// Sharded units gathered whole, in the compute dtype.
    pub gathered: f64,
    /// What forward keeps for backward, and the attention bias.
    pub activations: f64,
    /// The LM head's logit chunk and gradients.
    pub loss: f64,
    /// Gradients on their way: autograd's flat gradient of a unit, its
    /// reduction's buffers, a block backward's intermediates.
    pub transient: f64,
}

impl PeakBreakdown {
    pub fn total(&self) -> f64 {
        self.state + self.grads + self.gathered + self.activations + self.loss + self.transient
    }
}

/// What one micro-batch is.
pub(super) struct MicroBatch {
    pub batch: i64,
    pub seq: i64,
    pub dtype: Kind,
    /// The dtype gradients are reduced in.
    pub reduce: Kind,
    pub activation_checkpointing: bool,
    /// Under activation checkpointing, the first blocks recomputed (None: all).
    pub checkpoint_layers: Option<usize>,
    /// `train.expert_parallel` (1: none): exchanges hold rows of their own.
    pub expert_parallel: usize,
    /// Each expert is held by one rank alone (the expert group spans the
    /// world), so its gradient is reduced over no replica.
    pub experts_unreplicated: bool,
    /// Gradients of earlier micro-batches are already held (accumulation).
    pub accumulating: bool,
    /// The shard group or world has more than one rank, so gradients are reduced.
    pub data_parallel: bool,
    pub loss_chunk_tokens: i64,
    /// The blocks' float8 linear layers, if any.
    pub float8: Option<Float8Memory>,
}

/// What float8 linear layers add to a micro-batch (`ft_sys::float8`). A
/// float8 layer keeps for backward what one in the compute dtype keeps (its
/// input and weight, besides two amaxes), so the activations are the
/// same; each GEMM casts both its operands to float8 (a byte an element)
/// for the moment it runs.
pub(super) struct Float8Memory {
    /// The largest input features and weight (elements) of a float8 layer.
    input_features: f64,
    weight: f64,
    /// ft's kernels cast (on a GPU, either recipe): the last input cast in
    /// each direction stays cached — forward's until forward ends (with
    /// activation checkpointing the recomputed blocks cache again until the
    /// micro-batch ends), backward's until the micro-batch ends. (A unit
    /// gathered as float8 keeps its bytes inside its own buffer.)
    fused: bool,
}

impl Float8Memory {
    pub fn new(model: &dyn Model, layers: &Float8Layers) -> Float8Memory {
        let shapes: Vec<[i64; 2]> = crate::train::block_weight_shapes(model).into_iter().filter(|shape| layers.runs_shape(shape)).collect();
        let largest = |width: fn(&[i64; 2]) -> i64| shapes.iter().map(width).max().unwrap_or(0) as f64;
        Float8Memory {
            input_features: largest(|[_, input]| *input),
            weight: largest(|[out, input]| out * input),
            fused: !layers.float8.emulate,
        }
    }
}

/// The units a reference model run with each micro-batch reads
/// (`train/step.rs`'s `reference_forward`).
#[derive(Clone, Copy)]
pub(super) struct ReferenceUnits<'a> {
    pub placements: &'a [UnitPlacement],
    /// A frozen copy of the model's units (else the model's own: LoRA's base).
    pub copy: bool,
}

/// What the walk found.
pub(super) struct StepMemory {
    pub peak: PeakBreakdown,
    /// The most bytes gathered at once (what the trainer reports as `gathered_peak`).
    pub gathered_peak: f64,
    /// Each all-gather's unit and bytes, in the order the micro-batch starts them
    /// (the model's units', LoRA's base as the reference included).
    pub gathers: Vec<(usize, f64)>,
    /// The same of the reference's frozen copy.
    pub copy_gathers: Vec<(usize, f64)>,
}

/// Which of the trainer's units a gather or release is of.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Set {
    Model,
    /// The reference model's frozen copy.
    Copy,
}

/// A reduction in flight: the bytes it holds, and the gradient shard it
/// leaves (0 when the result goes to the host or is the gradient itself).
struct Pending {
    held: f64,
    kept: f64,
}

struct Walk<'a> {
    placements: &'a [UnitPlacement],
    /// The reference's frozen copy, unit by unit (empty without one).
    copy: &'a [UnitPlacement],
    /// Each unit's parameter count on a rank (an expert-parallel rank's rows of an experts unit).
    numels: Vec<i64>,
    /// Whether autograd copies each unit's parameters' gradients into its
    /// flat one: not for a unit of one parameter filling its buffer (an
    /// expert-parallel rank's rows of its experts included), whose gradient is the flat one.
    concatenated: Vec<bool>,
    micro: &'a MicroBatch,
    now: PeakBreakdown,
    peak: PeakBreakdown,
    gathered: Vec<bool>,
    copy_gathered: Vec<bool>,
    gathered_peak: f64,
    gathers: Vec<(usize, f64)>,
    copy_gathers: Vec<(usize, f64)>,
    pending: VecDeque<Pending>,
}

impl<'a> Walk<'a> {
    fn element(kind: Kind) -> f64 {
        kind.elt_size_in_bytes() as f64
    }

    /// Bytes of unit `u`'s whole buffer in the compute dtype (a packed
    /// unit's `shard` is over its 4-bit bytes, its buffer holds its parameters).
    fn unit_bytes(&self, u: usize) -> f64 {
        self.bytes_in(Set::Model, u)
    }

    fn bytes_in(&self, set: Set, u: usize) -> f64 {
        let placement = self.placements_of(set)[u];
        let elements = if placement.packed { self.numels[u] } else { placement.shard.padded };
        elements as f64 * Walk::element(self.micro.dtype)
    }

    fn placements_of(&self, set: Set) -> &'a [UnitPlacement] {
        match set {
            Set::Model => self.placements,
            Set::Copy => self.copy,
        }
    }

    fn note(&mut self) {
        if self.now.total() > self.peak.total() {
            self.peak = self.now;
        }
        self.gathered_peak = self.gathered_peak.max(self.now.gathered);
    }

    fn gather(&mut self, u: usize) {
        self.gather_in(Set::Model, u);
    }

    /// Unit `u` of `set` made whole (gathered, dequantized or uploaded) if it is released.
    fn gather_in(&mut self, set: Set, u: usize) {
        let placement = self.placements_of(set)[u];
        let gathered = match set {
            Set::Model => &mut self.gathered[u],
            Set::Copy => &mut self.copy_gathered[u],
        };
        if placement.transient() && !*gathered {
            *gathered = true;
            let bytes = self.bytes_in(set, u);
            self.now.gathered += bytes;
            match set {
                Set::Model => self.gathers.push((u, bytes)),
                Set::Copy => self.copy_gathers.push((u, bytes)),
            }
            if placement.packed && placement.params_sharded {
                // The whole unit's 4-bit bytes, gathered to be dequantized.
                self.briefly(placement.shard.padded as f64);
            }
            self.note();
        }
    }

    fn release(&mut self, u: usize) {
        self.release_in(Set::Model, u);
    }

    fn release_in(&mut self, set: Set, u: usize) {
        let transient = self.placements_of(set)[u].transient();
        let gathered = match set {
            Set::Model => &mut self.gathered[u],
            Set::Copy => &mut self.copy_gathered[u],
        };
        if transient && *gathered {
            *gathered = false;
            self.now.gathered -= self.bytes_in(set, u);
        }
    }

    /// A block's float8 GEMMs: their operands' casts while they run, and
    /// (ft's kernels) the input cast the direction's cache then keeps,
    /// from the first block on; `cached` says whether it is held already.
    fn float8_casts(&mut self, tokens: f64, cached: &mut bool) {
        let Some(float8) = &self.micro.float8 else { return };
        let (input, weight, fused) = (tokens * float8.input_features, float8.weight, float8.fused);
        self.briefly(input + weight);
        if fused && !*cached {
            *cached = true;
            self.now.transient += input;
        }
    }

    /// Forward's cached input cast let go when forward ends, as the trainer
    /// does; with activation checkpointing the first recomputed block
    /// caches one again, so it is held on.
    fn end_forward_float8_cache(&mut self, tokens: f64, cached: &mut bool) {
        let Some(float8) = &self.micro.float8 else { return };
        if *cached && !self.micro.activation_checkpointing {
            *cached = false;
            self.now.transient -= tokens * float8.input_features;
        }
    }

    /// `bytes` held for the moment of a peak, then freed.
    fn briefly(&mut self, bytes: f64) {
        self.now.transient += bytes;
        self.note();
        self.now.transient -= bytes;
    }

    /// Unit `u`'s complete micro-batch gradient (autograd's flat buffer, in
    /// `transient`) handed to its reduction, as `Trainer::reduce` does.
    fn reduce(&mut self, u: usize) {
        let placement = self.placements[u];
        let reduce = Walk::element(self.micro.reduce);
        let cast = self.micro.reduce != self.micro.dtype;
        let flat = self.unit_bytes(u);
        let (padded, shard) = (placement.shard.padded as f64, placement.shard.len as f64);
        if placement.grads_sharded || placement.offload {
            self.make_room();
            // Cast to the reduce dtype (the same buffer when the dtypes agree).
            let input = if cast { padded * reduce } else { flat };
            if cast {
                self.briefly(input);
                self.now.transient += input - flat;
            }
            if !self.micro.data_parallel {
                // One rank, offloaded: copied to the host at once.
                self.now.transient -= input;
                return;
            }
            let (result, kept) = match (placement.grads_sharded, placement.offload) {
                // The reduced shard: one micro-batch's gradient as it is (AdamW reads
                // the reduce dtype), or added to the step's fp32 gradient.
                (true, false) if !self.micro.accumulating => (shard * reduce, shard * reduce),
                (true, false) => (shard * reduce, shard * 4.0),
                (true, true) => (shard * reduce, 0.0),
                // All-reduced in place, then to the host.
                (false, _) => (0.0, 0.0),
            };
            self.now.transient += result;
            self.note();
            self.pending.push_back(Pending { held: input + result, kept });
            return;
        }
        // Whole gradients: accumulated in fp32, all-reduced on the last micro-batch.
        let gradient = padded * 4.0;
        let unreduced = !self.micro.data_parallel || (placement.expert_rows.is_some() && self.micro.experts_unreplicated);
        let whole = !self.micro.accumulating && unreduced;
        match (self.micro.accumulating, self.micro.dtype == Kind::Float) {
            // Added in place.
            (true, _) => self.now.transient -= flat,
            // The flat gradient becomes the step's: fp32 already, or (one
            // micro-batch on one rank, or of experts no other rank holds)
            // kept in the compute dtype for AdamW.
            _ if whole => {
                self.now.transient -= flat;
                self.now.grads += flat;
            }
            (false, true) => {
                self.now.transient -= flat;
                self.now.grads += gradient;
            }
            (false, false) => {
                self.now.grads += gradient;
                self.note();
                self.now.transient -= flat;
            }
        }
        if self.micro.data_parallel {
            self.make_room();
            // In place in fp32, else through a copy in the reduce dtype.
            let copy = if self.micro.reduce == Kind::Float { 0.0 } else { padded * reduce };
            self.now.transient += copy;
            self.note();
            self.pending.push_back(Pending { held: copy, kept: 0.0 });
        }
    }

    /// Finishes the oldest reductions until a new one may start.
    fn make_room(&mut self) {
        while self.pending.len() >= reductions_in_flight(self.micro.dtype, self.micro.reduce) {
            self.finish_oldest_reduction();
        }
    }

    /// Waits for the oldest reduction: with one micro-batch its shard
    /// becomes the step's gradient itself (in the reduce dtype); else it is
    /// added to the fp32 gradient the step holds.
    fn finish_oldest_reduction(&mut self) {
        let Some(done) = self.pending.pop_front() else { return };
        self.now.transient -= done.held;
        if done.kept > 0.0 && !self.micro.accumulating {
            self.now.grads += done.kept;
        }
    }
}

/// One chunk of the LM head's logits — with ATen's ops also their fp32
/// log-probabilities (ft's fused kernel works over bf16 logits).
fn logits_chunk_bytes(model: &dyn Model, micro: &MicroBatch) -> f64 {
    let element = Walk::element(micro.dtype);
    let targets = (micro.batch * (micro.seq - 1)).max(1) as f64;
    let chunk = (micro.loss_chunk_tokens as f64).min(targets);
    let logits_element = if micro.dtype == Kind::BFloat16 { element } else { element + 4.0 };
    chunk * model.dims().vocab as f64 * logits_element
}

/// What the LM head's loss holds (`train/loss.rs`): while it runs (the
/// weight's gradient when `weight_trains`, one chunk of logits, the hidden
/// states' gradient in pieces and concatenated twice), and after it, until
/// the head's backward.
fn lm_loss_bytes(model: &dyn Model, micro: &MicroBatch, weight_trains: bool) -> (f64, f64) {
    let dims = model.dims();
    let element = Walk::element(micro.dtype);
    let weight_grad = if weight_trains { (dims.vocab * dims.hidden) as f64 * element } else { 0.0 };
    let hidden_grad = (micro.batch * micro.seq * dims.hidden) as f64 * element;
    let during = weight_grad + logits_chunk_bytes(model, micro) + 3.0 * hidden_grad;
    (during, weight_grad + hidden_grad)
}

impl Walk<'_> {
    /// The reference's forward without gradients over `set`'s units, as
    /// `Trainer::reference_forward` runs it before the micro-batch's own:
    /// each unit gathered with the next prefetched, and released after its
    /// use when it is a copy's (no backward reads it) or forward releases
    /// it (full_shard, packed); only the hidden states between stages live
    /// on, and the head's log-probabilities are taken a chunk of logits at a time.
    fn reference_forward(&mut self, model: &dyn Model, set: Set, reshard_after_forward: bool) {
        let hidden = (self.micro.batch * self.micro.seq * model.dims().hidden) as f64 * Walk::element(self.micro.dtype);
        let stages = model.stages();
        for (index, stage) in stages.iter().enumerate() {
            for unit in stage.units().chain(stages.get(index + 1).into_iter().flat_map(Stage::units)) {
                self.gather_in(set, unit);
            }
            match stage.kind {
                StageKind::Embed => self.now.activations += hidden,
                // Its output beside its input.
                StageKind::Block => self.briefly(hidden),
                StageKind::Head => {
                    self.briefly(logits_chunk_bytes(model, self.micro));
                    self.now.activations -= hidden;
                }
            }
            self.note();
            for unit in stage.units() {
                let used_next = stages.get(index + 1).is_some_and(|next| next.units().any(|u| u == unit));
                let released = set == Set::Copy || self.placements_of(set)[unit].released_after_forward(reshard_after_forward);
                if released && !used_next {
                    self.release_in(set, unit);
                }
            }
        }
    }
}

/// What each sparse block keeps beyond its activations under expert
/// parallelism, in rows of its assignments (each the hidden size, in the
/// compute dtype): autograd saves no more than without exchanges, but the
/// peaks measured at degrees 2 and 4 hold two such rows more per
/// assignment and layer — the exchanges' buffers, which c10d keeps for the
/// allocator's safety until its watchdog sees them complete, is the
/// suspect. Fitted to bench/results/2026-11-28-h200x4-moe-ep.md's OLMoE
/// rows and the Qwen3-30B-A3B rows of 2026-11-28-h200x4-moe-row5.md.
const EXCHANGED_ROWS_PER_ASSIGNMENT: f64 = 2.0;

/// Walks one micro-batch of `model` with its units placed as `placements`
/// say, over `state` (what the rank holds between steps).
pub(super) fn walk(
    model: &dyn Model,
    placements: &[UnitPlacement],
    state: &MemoryAccount,
    reshard_after_forward: bool,
    micro: &MicroBatch,
    reference: Option<ReferenceUnits>,
) -> StepMemory {
    let dims = model.dims();
    let activations = model.activations();
    let element = Walk::element(micro.dtype);
    let tokens = (micro.batch * micro.seq) as f64;
    let pairs = (micro.batch * micro.seq * micro.seq) as f64;
    let exchanged = match model.experts().filter(|_| micro.expert_parallel > 1) {
        Some(experts) => EXCHANGED_ROWS_PER_ASSIGNMENT * (experts.per_token * dims.hidden) as f64 * element * tokens,
        None => 0.0,
    };
    let block = activations.block_bytes_per_token(element as i64) as f64 * tokens + activations.block_per_position_pair as f64 * element * pairs + exchanged;
    let output = dims.hidden as f64 * element * tokens;
    let embed = activations.embed as f64 * element * tokens;
    let block_backward = activations.block_backward as f64 * element * tokens;
    let causal_lm = model.head_kind() == head::CAUSAL_LM;
    let offload = placements.iter().any(|p| p.offload);
    let copy = reference.as_ref().filter(|r| r.copy).map_or(&[][..], |r| r.placements);
    let mut walk = Walk {
        placements,
        copy,
        numels: model.units().iter().zip(placements).map(|(unit, placement)| unit.numel() / if placement.expert_rows.is_some() { micro.expert_parallel.max(1) as i64 } else { 1 }).collect(),
        concatenated: model.units().iter().zip(placements).map(|(unit, placement)| placement.expert_rows.is_none() && !one_view(unit, placement.shard.padded)).collect(),
        micro,
        now: PeakBreakdown::default(),
        peak: PeakBreakdown::default(),
        gathered: vec![false; placements.len()],
        copy_gathered: vec![false; copy.len()],
        gathered_peak: 0.0,
        gathers: vec![],
        copy_gathers: vec![],
        pending: VecDeque::new(),
    };
    // Offloaded, masters, gradients and moments are on the host; the device keeps the compute copies.
    walk.now.state = state.comm_state + if offload { state.params + state.optimizer_state + state.grads - state.host } else { state.params + state.optimizer_state };
    // The reference's frozen copy: what of it the device holds between steps.
    let copy_held: MemoryAccount = copy.iter().map(|p| p.memory(micro.dtype)).sum();
    walk.now.state += copy_held.params - copy_held.host;
    walk.now.grads = if micro.accumulating && !offload { state.grads } else { 0.0 };
    walk.now.activations = (activations.bias_per_position_pair * micro.seq * micro.seq) as f64 * element;
    walk.note();

    if let Some(reference) = &reference {
        walk.reference_forward(model, if reference.copy { Set::Copy } else { Set::Model }, reshard_after_forward);
    }
    let stages = model.stages();
    let recomputed: Vec<bool> = (0..stages.len())
        .map(|index| stages[index].kind == StageKind::Block && crate::train::recomputes(micro.activation_checkpointing, micro.checkpoint_layers, crate::model::block_number(stages, index)))
        .collect();
    // Whether ft's float8 kernels' input caches hold a cast: forward's, backward's.
    let (mut forward_cache, mut backward_cache) = (false, false);
    for (index, stage) in stages.iter().enumerate() {
        for unit in stage.units().chain(stages.get(index + 1).into_iter().flat_map(Stage::units)) {
            walk.gather(unit);
        }
        if stage.kind == StageKind::Block {
            walk.float8_casts(tokens, &mut forward_cache);
        }
        match stage.kind {
            StageKind::Embed => walk.now.activations += embed,
            // Run without a graph: only the output is kept.
            StageKind::Block if recomputed[index] => walk.now.activations += output,
            StageKind::Block => walk.now.activations += block,
            StageKind::Head if causal_lm => {
                walk.now.activations += output;
                let (during, after) = lm_loss_bytes(model, micro, !placements[stage.unit].frozen);
                walk.now.loss += during;
                walk.note();
                walk.now.loss = after;
            }
            StageKind::Head => {}
        }
        walk.note();
        for unit in stage.units() {
            let used_next = stages.get(index + 1).is_none_or(|next| next.units().any(|u| u == unit));
            if placements[unit].released_after_forward(reshard_after_forward) && !used_next {
                walk.release(unit);
            }
        }
    }
    walk.end_forward_float8_cache(tokens, &mut forward_cache);

    // Units whose flat gradient autograd has started (a tied unit's lives
    // from the head's backward to the embedding's).
    let mut flat_gradient = vec![false; placements.len()];
    for (index, stage) in stages.iter().enumerate().rev() {
        for unit in stage.units().chain(stages[..index].last().into_iter().flat_map(Stage::units)) {
            walk.gather(unit);
        }
        if stage.kind == StageKind::Block {
            walk.float8_casts(tokens, &mut backward_cache);
        }
        if recomputed[index] {
            walk.now.activations += block - output;
            walk.note();
        }
        // What gets a gradient here: the unit unless frozen, and the stage's adapters.
        let trained: Vec<usize> = stage.units().filter(|&u| !placements[u].frozen).chain(stage.adapter).collect();
        for &u in &trained {
            if !flat_gradient[u] {
                flat_gradient[u] = true;
                walk.now.transient += walk.unit_bytes(u);
            }
        }
        // The parameters' gradients before autograd concatenates them into
        // the flat one, and the intermediates' gradients.
        let parameter_grads: f64 = trained.iter().filter(|&&u| walk.concatenated[u]).map(|&u| walk.unit_bytes(u)).sum();
        walk.briefly(parameter_grads + if stage.kind == StageKind::Block { block_backward } else { 0.0 });
        match stage.kind {
            StageKind::Embed => walk.now.activations -= embed,
            StageKind::Block => walk.now.activations -= block,
            StageKind::Head if causal_lm => {
                walk.now.activations -= output;
                walk.now.loss = 0.0;
            }
            StageKind::Head => {}
        }
        if let Some(adapter) = stage.adapter {
            walk.reduce(adapter);
        }
        for unit in stage.units() {
            let gradient_complete = stages.iter().position(|s| s.units().any(|u| u == unit)) == Some(index);
            if gradient_complete && !placements[unit].frozen {
                walk.reduce(unit);
            }
            if gradient_complete || (placements[unit].released_after_forward(reshard_after_forward) && !stages[index - 1].units().any(|u| u == unit)) {
                walk.release(unit);
            }
        }
    }
    while !walk.pending.is_empty() {
        walk.finish_oldest_reduction();
    }
    StepMemory { peak: walk.peak, gathered_peak: walk.gathered_peak, gathers: walk.gathers, copy_gathers: walk.copy_gathers }
}

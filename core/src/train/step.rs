//! Forward and backward of one micro-batch, unit by unit: each stage runs
//! on views of its unit's flat buffer, the activation detached between
//! stages; backward walks the stages in reverse, feeding each stage's output
//! its gradient. Around each stage the strategy's policy decides: a sharded
//! unit is gathered before use (the next unit's gather is issued before this
//! one computes, so it overlaps) and released after forward (full_shard) or
//! after its backward (shard_grad_op). A unit's gradient is handed to
//! `reduce.rs` as soon as backward completes it. An objective that compares
//! with a reference model first gets the reference's outputs, from a
//! forward without gradients over the same stages: the model with its
//! adapters off (LoRA's base), or the trainer's frozen copy.

use super::reduce::{reductions_in_flight, Reductions};
use super::{MicroBatch, Trainer};
use crate::dataset::Batch;
use crate::distributed::comm_hook::GatherPhase;
use crate::distributed::flat::FlatUnit;
use crate::model::{block_number, Float8Layers, Params, Stage, StageKind, UnitSource};
use crate::task::Objective;
use anyhow::Result;
use std::cell::RefCell;
use tch::{Kind, Tensor};

/// What forward keeps of one stage for backward.
struct Saved {
    /// The stage's detached input (None for the embedding).
    input: Option<Tensor>,
    /// Outputs to backpropagate into (empty when the block is recomputed).
    outputs: Vec<Tensor>,
    /// Their gradients, when forward already knows them (the head).
    grads: Vec<Tensor>,
}

/// The parameters `stage` runs with (its adapters joined), as views of its
/// units' flat buffers: made once per unit per micro-batch, while gathered.
/// A block's linear layers run in float8 when the run's `float8` says so
/// (never the embeddings' or the head's: the LM head stays in the compute dtype).
fn stage_params<'v>(model: &'v dyn crate::model::Model, units: &[FlatUnit], views: &'v mut [Option<Vec<Tensor>>], stage: &Stage, float8: Option<&'v Float8Layers>) -> Params<'v> {
    for unit in stage.units().chain(stage.adapter) {
        views[unit].get_or_insert_with(|| units[unit].views());
    }
    let views: &'v [Option<Vec<Tensor>>] = views;
    let params = crate::model::stage_params(model, stage, |unit| views[unit].as_deref().expect("made above"), true);
    params.with_float8(float8.filter(|_| stage.kind == StageKind::Block))
}

/// Which of the trainer's units a forward runs over.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Units {
    /// The model's own (`Trainer::units`).
    Model,
    /// The frozen copy kept as the reference model (`Trainer::reference`).
    Reference,
}

/// Whether the stage after `index` computes with unit `unit` too (a tied embedding's head).
fn used_next(stages: &[Stage], index: usize, unit: usize) -> bool {
    stages.get(index + 1).is_some_and(|next| next.units().any(|u| u == unit))
}

impl Trainer<'_> {
    /// Starts gathering unit `u` if it is released (a prefetch): sharded, or packed.
    fn prefetch(&mut self, u: usize, phase: GatherPhase) -> Result<()> {
        self.prefetch_in(Units::Model, u, phase)
    }

    /// [`Self::prefetch`] of unit `u` of `set`.
    fn prefetch_in(&mut self, set: Units, u: usize, phase: GatherPhase) -> Result<()> {
        // A reference copy's unit is placed as the model's unit of its index.
        let group = self.groups_of(u).shard;
        let (units, info) = match set {
            Units::Model => (&mut self.units, &self.unit_info),
            Units::Reference => (&mut self.reference, &self.reference_info),
        };
        let bytes = units[u].start_gather(group, self.hook.borrow_mut().as_mut(), &self.workspace, &info[u], phase, self.steps, self.options.seed as u64)?;
        self.count_gathered(bytes);
        Ok(())
    }

    fn units_in(&self, set: Units) -> &[FlatUnit] {
        match set {
            Units::Model => &self.units,
            Units::Reference => &self.reference,
        }
    }

    fn units_in_mut(&mut self, set: Units) -> &mut [FlatUnit] {
        match set {
            Units::Model => &mut self.units,
            Units::Reference => &mut self.reference,
        }
    }

    /// Whether unit `u` is released after each forward and gathered again
    /// for backward: full_shard's sharded units, and packed ones always (a
    /// dequantized block kept to its backward would hold the whole model
    /// in the compute dtype by the head).
    fn released_after_forward(&self, u: usize) -> bool {
        self.units[u].placement().released_after_forward(self.reshard_after_forward())
    }

    /// Under float8 gathers, before any gather: every gathered weight's amax
    /// in one reduction, when the shards have changed (the first step, after
    /// an optimizer step or a restore).
    fn refresh_float8_amaxes(&mut self) -> Result<()> {
        // Float8 gathers are the dense blocks' (`float8_gathered_units`), over the strategy's shard group.
        let group = self.parallel.and_then(|p| p.shard());
        if let (Some(amaxes), Some(group)) = (&mut self.float8_amaxes, group) {
            let units = &self.units;
            amaxes.refresh(|unit| units[unit].held_shard().shallow_clone(), group)?;
        }
        Ok(())
    }

    /// Makes unit `u` usable, waiting for its gather if one is in flight.
    fn gather(&mut self, u: usize, phase: GatherPhase) -> Result<()> {
        self.gather_in(Units::Model, u, phase)
    }

    fn gather_in(&mut self, set: Units, u: usize, phase: GatherPhase) -> Result<()> {
        self.prefetch_in(set, u, phase)?;
        self.units_in_mut(set)[u].finish_gather()
    }

    fn release(&mut self, u: usize) -> Result<()> {
        self.release_in(Units::Model, u)
    }

    /// Frees unit `u` of `set` if it is gathered and transient (a no-op otherwise).
    fn release_in(&mut self, set: Units, u: usize) -> Result<()> {
        let freed = self.units_in_mut(set)[u].release()?;
        self.gathered_bytes -= freed;
        Ok(())
    }

    fn count_gathered(&mut self, bytes: i64) {
        self.gathered_bytes += bytes;
        self.gathered_peak = self.gathered_peak.max(self.gathered_bytes);
    }

    /// Whether stage `stage` has parameters to train: its unit, or its adapters.
    fn trains(&self, stage: &Stage) -> bool {
        stage.units().any(|unit| self.units[unit].trainable()) || stage.adapter.is_some()
    }

    /// Runs `batch` through the reference model without gradients and
    /// gives `objective` the head's outputs. The reference is the frozen
    /// copy when the trainer keeps one, else the model with every adapter
    /// off (LoRA's base: the adapters' units never read).
    fn reference_forward(&mut self, batch: &Batch, objective: &dyn Objective) -> Result<()> {
        self.reference_head(batch, &mut |outputs| objective.reference_outputs(outputs, batch))
    }

    /// [`Self::reference_forward`]'s forward, giving `head` the head's outputs.
    fn reference_head(&mut self, batch: &Batch, head: &mut dyn FnMut(&[Tensor]) -> Result<()>) -> Result<()> {
        let set = match (self.reference.is_empty(), self.model.adapter_scaling().is_some()) {
            (false, _) => Units::Reference,
            (true, true) => Units::Model,
            (true, false) => anyhow::bail!(
                "the objective compares with a reference model at every step, and this trainer holds none: the model has no adapters whose base would be one, and it was built without TrainerBuilder::reference_copy"
            ),
        };
        // A copy's units are released after each use, since no backward reads them.
        self.forward_without_grad(set, batch, set == Units::Reference, head)
    }

    /// A forward of `batch` without gradients over `set`'s units with every
    /// adapter off, each unit gathered and released as forward does (with
    /// `release_each`, after each use), giving `head` the head's outputs
    /// while the head's unit is gathered (they may be views of it).
    fn forward_without_grad(&mut self, set: Units, batch: &Batch, release_each: bool, head: &mut dyn FnMut(&[Tensor]) -> Result<()>) -> Result<()> {
        let model = self.model;
        let _no_grad = tch::no_grad_guard();
        let mut ctx = model.context(&batch.inputs, 0, self.options.dtype, false)?;
        ctx.experts = self.token_exchanger();
        let stages = model.stages();
        let mut views: Vec<Option<Vec<Tensor>>> = (0..self.units_in(set).len()).map(|_| None).collect();
        let mut x = None;
        for (index, stage) in stages.iter().enumerate() {
            for unit in stage.units() {
                self.gather_in(set, unit, GatherPhase::Forward)?;
            }
            for next in stages.get(index + 1).into_iter().flat_map(Stage::units) {
                self.prefetch_in(set, next, GatherPhase::Forward)?;
            }
            let params = stage_params(model, self.units_in(set), &mut views, &Stage { adapter: None, ..*stage }, self.float8.as_ref());
            match stage.kind {
                StageKind::Embed => x = Some(model.embed(&params, &batch.inputs, &ctx)),
                StageKind::Block => x = x.map(|input| model.block(&params, &input, &ctx, block_number(stages, index), None)),
                StageKind::Head => head(&model.head(&params, x.as_ref().expect("the head follows the blocks")))?,
            }
            for unit in stage.units() {
                if (release_each || self.released_after_forward(unit)) && !used_next(stages, index, unit) {
                    self.release_in(set, unit)?;
                }
            }
        }
        Ok(())
    }

    /// The weights of each recording block's auxiliary term ([blocks, n],
    /// `AuxiliaryLoss::weights`, over this micro-batch on every
    /// data-parallel rank, divided by the step's micro-batches), and the
    /// statistics they come from; None where the model adds no auxiliary
    /// loss or no block recorded a term.
    fn auxiliary_weights(&self, statistics: &[Tensor], micro: MicroBatch) -> Result<Option<(Tensor, Tensor)>> {
        let Some(loss) = self.model.auxiliary_loss().filter(|_| !statistics.is_empty()) else { return Ok(None) };
        let mut statistics = Tensor::stack(statistics, 0);
        if let Some(parallel) = self.parallel {
            parallel.world.all_reduce(&mut statistics, crate::distributed::comm::Reduction::Sum)?.wait()?;
        }
        Ok(Some((loss.weights(&statistics) / micro.count as f64, statistics)))
    }

    /// Since the last call: this rank's share of the model's auxiliary loss
    /// (before its coefficient) and `AuxiliaryLoss::figures` of its
    /// statistics; None where the model adds none.
    pub fn take_auxiliary(&mut self) -> Option<(Tensor, Vec<(String, Tensor)>)> {
        let (share, statistics) = self.auxiliary.take()?;
        let figures = self.model.auxiliary_loss().map(|loss| loss.figures(&statistics)).unwrap_or_default();
        Some((share, figures))
    }

    /// Forward and backward of one micro-batch; gradients add up until
    /// `step`. The head's outputs go to `objective`, whose loss is divided by
    /// `normalizer`, the whole global batch's loss weight. The last of the
    /// step's micro-batches synchronises gradients across replicas.
    /// Returns this micro-batch's share of the loss, on the device: the
    /// objective's, plus the model's auxiliary loss where it has one
    /// (`Model::auxiliary_loss`), whose statistics are summed over the
    /// data-parallel ranks' same micro-batch, so that N ranks compute what
    /// one rank computes on their batches together; a step's is the mean of
    /// its micro-batches'.
    pub fn forward_backward(&mut self, batch: &Batch, objective: &dyn Objective, normalizer: f64, micro: MicroBatch) -> Result<Tensor> {
        let last_micro_batch = micro.is_last();
        self.refresh_float8_amaxes()?;
        let model = self.model;
        if objective.wants_reference_outputs() {
            self.reference_forward(batch, objective)?;
        }
        let inputs = &batch.inputs;
        let dtype = self.options.dtype;
        let mut ctx = model.context(inputs, 0, dtype, true)?;
        ctx.experts = self.token_exchanger();
        let stages = model.stages();
        let seed = self.options.seed;
        let micro_steps = self.micro_steps;
        let seed_for = |stage: usize| seed.wrapping_mul(1_000_003).wrapping_add(micro_steps * 4099 + stage as i64);
        // Views are made once per unit per micro-batch, while it is gathered;
        // the graph keeps them valid across a release and the refill.
        let mut views: Vec<Option<Vec<Tensor>>> = (0..self.units.len()).map(|_| None).collect();
        // A stage's input needs a gradient only when an earlier stage trains something.
        let input_needs_grad: Vec<bool> = (0..stages.len()).map(|i| stages[..i].iter().any(|s| self.trains(s))).collect();

        // Each block's auxiliary term (its values carry the gradient, unless recomputed), and every term's statistics.
        let mut auxiliary: Vec<Option<Tensor>> = (0..stages.len()).map(|_| None).collect();
        let mut statistics = vec![];
        let mut saved: Vec<Saved> = Vec::with_capacity(stages.len());
        let mut x: Option<Tensor> = None;
        let mut loss = None;
        for (index, stage) in stages.iter().enumerate() {
            for unit in stage.units() {
                self.gather(unit, GatherPhase::Forward)?;
            }
            for next in stages.get(index + 1).into_iter().flat_map(Stage::units) {
                self.prefetch(next, GatherPhase::Forward)?;
            }
            let params = stage_params(model, &self.units, &mut views, stage, self.float8.as_ref());
            let input = x.take().map(|t| t.set_requires_grad(input_needs_grad[index]));
            match stage.kind {
                StageKind::Embed => {
                    let y = model.embed(&params, inputs, &ctx);
                    x = Some(y.detach());
                    saved.push(Saved { input: None, outputs: vec![y], grads: vec![] });
                }
                StageKind::Block => {
                    let input = input.expect("a block follows the embedding");
                    let layer = block_number(stages, index);
                    if self.options.recomputes(layer) {
                        tch::manual_seed(seed_for(index));
                        let y = tch::no_grad(|| model.block(&params, &input, &ctx, layer, None));
                        x = Some(y);
                        saved.push(Saved { input: Some(input), outputs: vec![], grads: vec![] });
                    } else {
                        let y = model.block(&params, &input, &ctx, layer, None);
                        x = Some(y.detach());
                        saved.push(Saved { input: Some(input), outputs: vec![y], grads: vec![] });
                    }
                    if let Some(term) = ctx.auxiliary.take() {
                        statistics.push(term.statistics);
                        auxiliary[index] = Some(term.values);
                    }
                }
                StageKind::Head => {
                    let input = input.expect("the head follows the blocks");
                    let outputs = model.head(&params, &input);
                    let loss_scale = self.scaler.as_ref().map(|s| &s.scale);
                    let (stage_loss, grads) = objective.loss_and_grads(&outputs, batch, normalizer, loss_scale)?;
                    loss = Some(stage_loss);
                    saved.push(Saved { input: Some(input), outputs, grads });
                }
            }
            // The last stage's units are the first backward needs: keep them.
            for unit in stage.units() {
                if self.released_after_forward(unit) && index + 1 < stages.len() && !used_next(stages, index, unit) {
                    self.release(unit)?;
                }
            }
        }
        if self.float8.is_some() {
            // Forward's cached input casts and noted amaxes served its layers: they hold nothing through backward.
            ft_sys::float8::forget_cached_inputs();
        }

        // The gradient of each recording block's values: its weights times the loss's coefficient (and fp16's loss scale).
        let mut auxiliary_grads = None;
        if let Some((weights, statistics)) = self.auxiliary_weights(&statistics, micro)? {
            let values: Vec<Tensor> = auxiliary.iter().flatten().map(Tensor::detach).collect();
            let share = (&weights * Tensor::stack(&values, 0)).sum(Kind::Float);
            let coefficient = model.auxiliary_loss().map_or(0.0, |loss| loss.coefficient());
            loss = loss.map(|loss| loss + &share * coefficient);
            self.auxiliary = Some(match self.auxiliary.take() {
                Some((sum, summed)) => (sum + share, summed + statistics),
                None => (share, statistics),
            });
            let grads = weights * coefficient;
            auxiliary_grads = Some(match &self.scaler {
                Some(scaler) => grads * &scaler.scale,
                None => grads,
            });
        }
        // Block stage index → its row of the weights.
        let mut rows = 0..;
        let weight_rows: Vec<Option<i64>> = auxiliary.iter().map(|values| values.as_ref().and_then(|_| rows.next())).collect();

        let mut grad: Option<Tensor> = None;
        let mut reductions = Reductions::new(reductions_in_flight(self.options.dtype, self.reduce_dtype()));
        let first_micro_batch = self.pending_micro_batches == 0;
        for (index, (stage, mut s)) in stages.iter().zip(saved).enumerate().rev() {
            for unit in stage.units() {
                self.gather(unit, GatherPhase::Backward)?;
            }
            for previous in stages[..index].last().into_iter().flat_map(Stage::units) {
                self.prefetch(previous, GatherPhase::Backward)?;
            }
            if s.outputs.is_empty() {
                // Recompute the checkpointed block, with the same dropout masks.
                let params = stage_params(model, &self.units, &mut views, stage, self.float8.as_ref());
                tch::manual_seed(seed_for(index));
                s.outputs = vec![model.block(&params, s.input.as_ref().expect("block input"), &ctx, block_number(stages, index), None)];
                auxiliary[index] = ctx.auxiliary.take().map(|term| term.values);
            }
            if s.grads.is_empty() {
                // None: nothing up to this stage trains, so nothing needs a gradient through it.
                s.grads = grad.take().into_iter().collect();
            }
            if let (Some(grads), Some(row), Some(values)) = (&auxiliary_grads, weight_rows[index], auxiliary[index].take()) {
                // The auxiliary loss's gradient joins the block's output's.
                s.outputs.truncate(s.grads.len());
                s.outputs.push(values);
                s.grads.push(grads.get(row));
            }
            // Frozen parameters have no gradient to carry (a frozen
            // embedding's output, a frozen LM weight): only what does is fed.
            let (outputs, grads): (Vec<&Tensor>, Vec<&Tensor>) = s.outputs.iter().zip(&s.grads).filter(|(output, _)| output.requires_grad()).unzip();
            if !outputs.is_empty() {
                ft_sys::backward(&outputs, &grads).map_err(anyhow::Error::msg)?;
            }
            grad = s.input.as_ref().filter(|input| input.requires_grad()).map(Tensor::grad);
            drop(s);
            if let Some(adapter) = stage.adapter {
                // A stage's adapters serve it alone: their gradient is complete.
                self.reduce(adapter, first_micro_batch, last_micro_batch, &mut reductions)?;
            }
            for unit in stage.units() {
                let gradient_complete = stages.iter().position(|st| st.units().any(|u| u == unit)) == Some(index);
                if gradient_complete && self.units[unit].trainable() {
                    self.reduce(unit, first_micro_batch, last_micro_batch, &mut reductions)?;
                }
                // Done with the unit, or (full_shard) done until an earlier stage's backward needs it again.
                if gradient_complete || (self.released_after_forward(unit) && !stages[index - 1].units().any(|u| u == unit)) {
                    self.release(unit)?;
                }
            }
        }
        self.finish_reductions(reductions)?;
        if self.float8.is_some() {
            // Nor backward's (and a recomputed block's) past the micro-batch.
            ft_sys::float8::forget_cached_inputs();
        }
        self.micro_steps += 1;
        self.pending_micro_batches += 1;
        Ok(loss.expect("the model has a head stage"))
    }

}

/// The reference model the trainer holds (its frozen copy, or LoRA's
/// base), for a task that runs it outside a step: online RL's rollouts,
/// whose policy (`GatheredPolicy`) may share the trainer.
pub struct ReferenceModel<'c, 't, 'm>(pub &'c RefCell<&'t mut Trainer<'m>>);

impl crate::task::StartingModel for ReferenceModel<'_, '_, '_> {
    fn forward_head(&mut self, batch: &Batch, head: &mut dyn FnMut(&[Tensor]) -> Result<()>) -> Result<()> {
        let mut trainer = self.0.borrow_mut();
        trainer.refresh_float8_amaxes()?;
        trainer.reference_head(batch, head)
    }
}

/// The trainer's policy a unit at a time, for decoding online RL's
/// rollouts without holding it whole (`train.rollout_gather=per_unit`):
/// each stage's units gathered whole in the compute dtype as
/// `Trainer::compute_params` gathers them (so the same values, whatever
/// the communication hook), and dropped when the stage is done.
pub struct GatheredPolicy<'c, 't, 'm> {
    trainer: &'c RefCell<&'t mut Trainer<'m>>,
    held: Vec<Option<Vec<Tensor>>>,
}

impl<'c, 't, 'm> GatheredPolicy<'c, 't, 'm> {
    pub fn new(trainer: &'c RefCell<&'t mut Trainer<'m>>) -> Self {
        let units = trainer.borrow().units.len();
        GatheredPolicy { trainer, held: (0..units).map(|_| None).collect() }
    }
}

impl UnitSource for GatheredPolicy<'_, '_, '_> {
    fn fetch(&mut self, units: &[usize]) -> Result<()> {
        let trainer = self.trainer.borrow();
        for &unit in units {
            self.held[unit] = Some(trainer.compute_unit(unit)?);
        }
        Ok(())
    }

    fn tensors(&self, unit: usize) -> &[Tensor] {
        self.held[unit].as_deref().expect("a stage's units are fetched before it runs")
    }

    fn done(&mut self, units: &[usize]) {
        for &unit in units {
            self.held[unit] = None;
        }
    }

    fn gathers(&self) -> bool {
        true
    }

    fn all_done(&mut self, done: bool) -> Result<bool> {
        self.trainer.borrow().all_ranks_done(done)
    }

    fn device(&self) -> tch::Device {
        self.trainer.borrow().units[0].device()
    }
}

/// Before the first step the trainer is the starting model, as it holds it:
/// each unit gathered for its use and released after it (no backward
/// follows), LoRA's adapters off.
impl crate::task::StartingModel for Trainer<'_> {
    fn forward_head(&mut self, batch: &Batch, head: &mut dyn FnMut(&[Tensor]) -> Result<()>) -> Result<()> {
        self.refresh_float8_amaxes()?;
        self.forward_without_grad(Units::Model, batch, true, head)
    }
}

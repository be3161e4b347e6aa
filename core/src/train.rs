//! The training step, unit by unit (DESIGN.md §4), and the data-parallel
//! mechanism every sharding strategy shares (§5).
//!
//! Each unit's parameters live in flat buffers (`flat.rs`). Forward runs the
//! model's stages with the activation detached between stages; backward
//! walks them in reverse, feeding each stage's output its gradient. Around
//! each stage the trainer applies the strategy's policy: a sharded unit is
//! gathered before use (the next unit's gather is issued before this one
//! computes, so it overlaps), released after forward (full_shard) or after
//! its backward (shard_grad_op). A unit's gradient is complete after its
//! first stage's backward: it is reduce-scattered (or accumulated and
//! all-reduced on the last micro-batch) while backward goes on with earlier
//! units; a reduction is waited for only when its result is needed.

use crate::comm::{ProcessGroup, Reduction, Work};
use crate::flat::{FlatUnit, MemoryAccount, ShardLayout, UnitPlacement};
use crate::model::{Inputs, Model, Params, StageKind};
use crate::strategy::{GradReduction, ParamPlacement, ShardingPolicy};
use anyhow::{bail, Result};
use ft_sys::AdamW;
use std::collections::VecDeque;
use tch::{Kind, Tensor};

pub use crate::flat::unflatten;

#[derive(Debug, Clone)]
pub struct TrainOptions {
    /// Compute dtype (fp32 masters are kept whatever this is).
    pub dtype: Kind,
    pub adamw: AdamW,
    pub max_grad_norm: Option<f64>,
    /// Tokens per chunk of the LM head's logits.
    pub loss_chunk_tokens: i64,
    /// Keep only each block's input and recompute the block in backward.
    pub activation_checkpointing: bool,
    /// Seeds dropout, so recomputation repeats the same masks.
    pub seed: i64,
    /// fp16's first loss scale (dynamic: halved on overflow, doubled after
    /// 2000 clean steps, as torch.amp.GradScaler does).
    pub initial_loss_scale: f64,
    /// Keep fp32 masters, gradients and optimizer state in host memory and
    /// step them with the CPU AdamW (`--offload cpu`).
    pub offload_to_host: bool,
}

impl Default for TrainOptions {
    fn default() -> Self {
        TrainOptions {
            dtype: Kind::Float,
            adamw: AdamW { lr: 1e-5, beta1: 0.9, beta2: 0.999, weight_decay: 0.0, eps: 1e-8 },
            max_grad_norm: Some(1.0),
            loss_chunk_tokens: 1024,
            activation_checkpointing: false,
            seed: 0,
            initial_loss_scale: 65536.0,
            offload_to_host: false,
        }
    }
}

/// fp16's dynamic loss scale, on the device (no host synchronisation).
struct LossScaler {
    scale: Tensor,
    growth_tracker: Tensor,
}

/// Which kernels the step runs where ATen and ft's own CUDA kernels
/// (`ft_sys::kernels`) both could.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kernels {
    /// ATen's ops: any device and dtype.
    Aten,
    /// On a GPU: ft's fused cross-entropy for bf16 logits (two reads of the
    /// logits, the gradient written over them; ATen's ops otherwise) and ft's
    /// one-pass AdamW.
    Ft,
}

impl Kernels {
    /// ft's kernels on a GPU where they compile and load (once per process),
    /// ATen elsewhere or when the environment sets `FT_KERNELS=aten`.
    pub fn select(device: tch::Device) -> Kernels {
        if std::env::var("FT_KERNELS").is_ok_and(|v| v == "aten") {
            return Kernels::Aten;
        }
        match ft_sys::kernels::available(device) {
            Ok(()) => Kernels::Ft,
            Err(why) => {
                if device.is_cuda() {
                    tracing::warn!("{why}; using ATen's cross-entropy and AdamW instead (slower, more memory)");
                }
                Kernels::Aten
            }
        }
    }
}

/// Loss and gradients of the LM head, `chunk` tokens at a time, without
/// autograd: logits exist for one chunk only. `labels` are aligned
/// with the inputs (shifted here); the loss is the sum over target tokens
/// divided by `normalizer` (the target tokens of the whole global batch, so
/// micro-batches and ranks add up to the global mean). Returns the loss and
/// the gradients of `hidden` and `weight`.
pub fn lm_head_loss_and_grads(
    hidden: &Tensor,
    weight: &Tensor,
    labels: &Tensor,
    normalizer: f64,
    chunk: i64,
    grad_multiplier: Option<&Tensor>,
    kernels: Kernels,
) -> Result<(Tensor, Tensor, Tensor)> {
    let _no_grad = tch::no_grad_guard();
    let (batch, seq, dim) = hidden.size3()?;
    if labels.size() != [batch, seq] {
        bail!("labels {:?} do not match the hidden states' [batch, seq] = [{batch}, {seq}]", labels.size());
    }
    let inputs = hidden.narrow(1, 0, seq - 1).reshape([-1, dim]);
    let targets = labels.narrow(1, 1, seq - 1).reshape([-1]);
    let tokens = targets.size()[0];
    let mut grad_inputs = Vec::new();
    // Accumulated in the weight's dtype by the matmul itself (fp32 inside cuBLAS).
    let mut grad_weight: Option<Tensor> = None;
    let mut loss = Tensor::zeros([], (Kind::Float, hidden.device()));
    let mut start = 0;
    while start < tokens {
        let len = chunk.min(tokens - start);
        let h = inputs.narrow(0, start, len);
        let target = targets.narrow(0, start, len).contiguous();
        let valid = target.ne(crate::dataset::IGNORE_INDEX);
        let scale = valid.to_kind(Kind::Float) / normalizer;
        let row_scale = match grad_multiplier {
            Some(multiplier) => &scale * multiplier,
            None => scale.shallow_clone(),
        };
        let mut logits = h.matmul(&weight.tr());
        // d loss / d logits = (softmax − one-hot(target)) · scale.
        let grad_logits = if kernels == Kernels::Ft && logits.kind() == Kind::BFloat16 {
            let mut row_loss = Tensor::empty([len], (Kind::Float, hidden.device()));
            ft_sys::kernels::softmax_xent_backward_(&mut logits, &target, &row_scale, &mut row_loss, crate::dataset::IGNORE_INDEX)?;
            loss += (row_loss * &scale).sum(Kind::Float);
            logits
        } else {
            // Four passes over the [len, vocab] logits: log-softmax (fp32
            // out), exp in place, the cast back, the scale.
            let safe_target = target.clamp_min(0).unsqueeze(1);
            let log_probs = logits.log_softmax(-1, Kind::Float);
            drop(logits);
            let picked = log_probs.gather(1, &safe_target, false).squeeze_dim(1);
            loss -= (picked * &scale).sum(Kind::Float);
            let mut probs = log_probs;
            let _ = probs.exp_();
            let _ = probs.scatter_add_(1, &safe_target, &(-valid.to_kind(Kind::Float)).unsqueeze(1));
            let mut grad_logits = probs.to_kind(weight.kind());
            let _ = grad_logits.g_mul_(&row_scale.to_kind(weight.kind()).unsqueeze(1));
            grad_logits
        };
        grad_inputs.push(grad_logits.matmul(weight));
        grad_weight = Some(match grad_weight {
            None => grad_logits.tr().matmul(&h),
            Some(mut sum) => {
                let _ = sum.addmm_(&grad_logits.tr(), &h);
                sum
            }
        });
        start += len;
    }
    // The last position predicts nothing: its gradient is zero.
    let grad_hidden = Tensor::cat(&grad_inputs, 0).view([batch, seq - 1, dim]);
    let grad_hidden = Tensor::cat(&[grad_hidden, hidden.zeros_like().narrow(1, 0, 1)], 1);
    let grad_weight = grad_weight.unwrap_or_else(|| weight.zeros_like());
    Ok((loss, grad_hidden, grad_weight))
}

fn refs(list: &[Tensor]) -> Vec<&Tensor> {
    list.iter().collect()
}

/// What forward keeps of one stage for backward.
struct Saved {
    /// The stage's detached input (None for the embedding).
    input: Option<Tensor>,
    /// Outputs to backpropagate into (empty when the block is recomputed).
    outputs: Vec<Tensor>,
    /// Their gradients, when forward already knows them (the head).
    grads: Vec<Tensor>,
}

/// The ranks a trainer works with and the strategy's policy over them.
pub struct Parallel<'g> {
    pub policy: ShardingPolicy,
    /// Every data-parallel rank (all-reduced gradients are summed over it).
    pub world: &'g ProcessGroup,
    /// The ranks that split parameters/gradients/optimizer state between
    /// them (None when the policy shards nothing).
    pub shard: Option<&'g ProcessGroup>,
    /// Hybrid sharding: the ranks holding the same shard in other shard
    /// groups, across which reduced gradient shards are all-reduced.
    pub replicas: Option<&'g ProcessGroup>,
    /// The dtype gradients travel in.
    pub reduce_dtype: Kind,
}

/// A gradient reduction in flight, and what to do with its result.
struct PendingReduction {
    unit: usize,
    work: Work,
    result: Tensor,
    then: AfterReduction,
}

enum AfterReduction {
    /// A reduce-scattered micro-batch gradient: add it to the unit's shard.
    AddToShard { first_micro_batch: bool, last_micro_batch: bool },
    /// A gradient all-reduced in a narrower dtype: copy it back to fp32.
    CopyToGrad,
    /// Offloaded: (all-reduce across replicas, then) copy it to the host.
    ToHost,
    Nothing,
}

/// What offloading moved and cost, cumulative over the run.
#[derive(Debug, Clone, Copy, Default, serde::Serialize)]
pub struct OffloadStats {
    pub device_to_host_bytes: f64,
    pub host_to_device_bytes: f64,
    /// Time the step waited for the device's backward and copies to finish.
    pub wait_seconds: f64,
    /// Time in the host optimizer step after that (gradient norm and AdamW).
    pub cpu_step_seconds: f64,
}

/// Reduce-scatters allowed in flight before backward waits for the oldest:
/// enough to overlap communication with the next units' backward, few
/// enough that whole gradients do not pile up.
const REDUCTIONS_IN_FLIGHT: usize = 2;

/// One process's training state: the model's units as flat buffers and the
/// optimizer, data-parallel as the strategy's policy says.
pub struct Trainer<'m> {
    model: &'m dyn Model,
    units: Vec<FlatUnit>,
    options: TrainOptions,
    /// AdamW's step count, on the device, shared by every buffer.
    step: Tensor,
    micro_steps: i64,
    /// Micro-batches since the last optimizer step.
    pending_micro_batches: usize,
    parallel: Option<Parallel<'m>>,
    /// Present when computing in fp16.
    scaler: Option<LossScaler>,
    /// Bytes of sharded units gathered now, and the most at once.
    gathered_bytes: i64,
    gathered_peak: i64,
    offload_stats: OffloadStats,
    kernels: Kernels,
}

impl<'m> Trainer<'m> {
    /// A single-process trainer. `params[unit]` are the initial parameters,
    /// already on the training device.
    pub fn new(model: &'m dyn Model, params: &[Vec<Tensor>], options: TrainOptions) -> Result<Trainer<'m>> {
        Trainer::with_parallel(model, params, options, None)
    }

    /// A data-parallel trainer: every rank passes the same initial
    /// `params` and keeps what the policy assigns it.
    pub fn with_parallel(
        model: &'m dyn Model,
        params: &[Vec<Tensor>],
        options: TrainOptions,
        parallel: Option<Parallel<'m>>,
    ) -> Result<Trainer<'m>> {
        let placement = |numel: i64| match &parallel {
            Some(p) if p.shard.is_some_and(|g| g.size() > 1) => {
                let group = p.shard.expect("checked");
                UnitPlacement {
                    shard: ShardLayout::new(numel, group.size(), group.rank()),
                    params_sharded: matches!(p.policy.params, ParamPlacement::Sharded { .. }),
                    optimizer_sharded: p.policy.optimizer_state_sharded,
                    grads_sharded: p.policy.grads == GradReduction::ReduceScatter,
                    offload: options.offload_to_host,
                }
            }
            _ => UnitPlacement {
                shard: ShardLayout::new(numel, 1, 0),
                params_sharded: false,
                optimizer_sharded: false,
                grads_sharded: false,
                offload: options.offload_to_host,
            },
        };
        let units = model
            .units()
            .iter()
            .zip(params)
            .map(|(spec, t)| FlatUnit::new(spec, t, options.dtype, placement(spec.numel())))
            .collect::<Result<Vec<_>>>()?;
        let device = params[0][0].device();
        let kernels = Kernels::select(device);
        let scaler = (options.dtype == Kind::Half).then(|| LossScaler {
            scale: Tensor::from_slice(&[options.initial_loss_scale as f32]).to_device(device),
            growth_tracker: Tensor::zeros([1], (Kind::Int, device)),
        });
        Ok(Trainer {
            scaler,
            model,
            units,
            options,
            step: Tensor::zeros([], (Kind::Float, device)),
            micro_steps: 0,
            pending_micro_batches: 0,
            parallel,
            gathered_bytes: 0,
            gathered_peak: 0,
            offload_stats: OffloadStats::default(),
            kernels,
        })
    }

    pub fn units(&self) -> &[FlatUnit] {
        &self.units
    }

    fn shard_group(&self) -> Option<&'m ProcessGroup> {
        self.parallel.as_ref().and_then(|p| p.shard)
    }

    fn reshard_after_forward(&self) -> bool {
        self.parallel.as_ref().is_some_and(|p| p.policy.params == ParamPlacement::Sharded { reshard_after_forward: true })
    }

    /// Starts gathering unit `u` if it is sharded and released (a prefetch).
    fn prefetch(&mut self, u: usize) -> Result<()> {
        if let Some(group) = self.shard_group() {
            let bytes = self.units[u].start_gather(group)?;
            self.count_gathered(bytes);
        }
        Ok(())
    }

    /// Makes unit `u` usable, waiting for its gather if one is in flight.
    fn gather(&mut self, u: usize) -> Result<()> {
        let group = self.shard_group();
        let bytes = self.units[u].finish_gather(group)?;
        self.count_gathered(bytes);
        Ok(())
    }

    fn release(&mut self, u: usize) -> Result<()> {
        self.gathered_bytes -= self.units[u].release()?;
        Ok(())
    }

    fn count_gathered(&mut self, bytes: i64) {
        self.gathered_bytes += bytes;
        self.gathered_peak = self.gathered_peak.max(self.gathered_bytes);
    }

    /// Forward and backward of one micro-batch; gradients add up until `step`.
    /// `normalizer` is the target-token count of the whole global batch.
    /// `last_micro_batch` synchronises gradients across replicas.
    /// Returns this micro-batch's share of the loss (sum / `normalizer`), on the device.
    pub fn forward_backward(
        &mut self,
        inputs: &Inputs,
        labels: &Tensor,
        normalizer: f64,
        last_micro_batch: bool,
    ) -> Result<Tensor> {
        let model = self.model;
        let (dtype, checkpoint) = (self.options.dtype, self.options.activation_checkpointing);
        let ctx = model.context(inputs, 0, dtype, true)?;
        let specs = model.units();
        let stages = model.stages();
        let seed = self.options.seed;
        let micro_steps = self.micro_steps;
        let seed_for = |stage: usize| seed.wrapping_mul(1_000_003).wrapping_add(micro_steps * 4099 + stage as i64);
        let reshard_after_forward = self.reshard_after_forward();
        // Views are made once per unit per micro-batch, while it is gathered;
        // the graph keeps them valid across a release and the refill.
        let mut views: Vec<Option<Vec<Tensor>>> = (0..self.units.len()).map(|_| None).collect();

        let mut saved: Vec<Saved> = Vec::with_capacity(stages.len());
        let mut x: Option<Tensor> = None;
        let mut loss = None;
        for (index, stage) in stages.iter().enumerate() {
            let unit = stage.unit;
            self.gather(unit)?;
            if let Some(next) = stages.get(index + 1) {
                self.prefetch(next.unit)?;
            }
            let unit_views = views[unit].get_or_insert_with(|| self.units[unit].views());
            let params = Params::new(&specs[unit], unit_views);
            let input = x.take().map(|t| t.set_requires_grad(true));
            match stage.kind {
                StageKind::Embed => {
                    let y = model.embed(&params, inputs, &ctx);
                    x = Some(y.detach());
                    saved.push(Saved { input: None, outputs: vec![y], grads: vec![] });
                }
                StageKind::Block => {
                    let input = input.expect("a block follows the embedding");
                    if checkpoint {
                        tch::manual_seed(seed_for(index));
                        let y = tch::no_grad(|| model.block(&params, &input, &ctx, None));
                        x = Some(y);
                        saved.push(Saved { input: Some(input), outputs: vec![], grads: vec![] });
                    } else {
                        let y = model.block(&params, &input, &ctx, None);
                        x = Some(y.detach());
                        saved.push(Saved { input: Some(input), outputs: vec![y], grads: vec![] });
                    }
                }
                StageKind::Head => {
                    let input = input.expect("the head follows the blocks");
                    let (hidden, weight) = crate::model::lm_outputs(model.head(&params, &input))?;
                    let (stage_loss, grad_hidden, grad_weight) = lm_head_loss_and_grads(
                        &hidden,
                        &weight,
                        labels,
                        normalizer,
                        self.options.loss_chunk_tokens,
                        self.scaler.as_ref().map(|s| &s.scale),
                        self.kernels,
                    )?;
                    loss = Some(stage_loss);
                    saved.push(Saved { input: Some(input), outputs: vec![hidden, weight], grads: vec![grad_hidden, grad_weight] });
                }
            }
            // The last stage's unit is the first backward needs: keep it.
            let used_next = stages.get(index + 1).is_none_or(|next| next.unit == unit);
            if reshard_after_forward && !used_next {
                self.release(unit)?;
            }
        }

        let mut grad: Option<Tensor> = None;
        let mut pending: VecDeque<PendingReduction> = VecDeque::new();
        let mut replica_reductions: Vec<Work> = vec![];
        let first_micro_batch = self.pending_micro_batches == 0;
        for (index, (stage, mut s)) in stages.iter().zip(saved).enumerate().rev() {
            let unit = stage.unit;
            self.gather(unit)?;
            if index > 0 {
                self.prefetch(stages[index - 1].unit)?;
            }
            if s.outputs.is_empty() {
                // Recompute the checkpointed block, with the same dropout masks.
                let unit_views = views[unit].get_or_insert_with(|| self.units[unit].views());
                let params = Params::new(&specs[unit], unit_views);
                tch::manual_seed(seed_for(index));
                s.outputs = vec![model.block(&params, s.input.as_ref().expect("block input"), &ctx, None)];
            }
            if s.grads.is_empty() {
                s.grads = vec![grad.take().expect("a later stage passed a gradient back")];
            }
            let outputs: Vec<&Tensor> = s.outputs.iter().collect();
            let grads: Vec<&Tensor> = s.grads.iter().collect();
            ft_sys::backward(&outputs, &grads).map_err(anyhow::Error::msg)?;
            grad = s.input.as_ref().map(Tensor::grad);
            drop(s);
            let gradient_complete = stages.iter().position(|st| st.unit == unit) == Some(index);
            if gradient_complete {
                self.reduce(unit, first_micro_batch, last_micro_batch, &mut pending)?;
                while pending.len() > REDUCTIONS_IN_FLIGHT {
                    let oldest = pending.pop_front().expect("non-empty");
                    self.finish_reduction(oldest, &mut replica_reductions)?;
                }
                self.release(unit)?;
            } else if reshard_after_forward && stages[index - 1].unit != unit {
                self.release(unit)?;
            }
        }
        while let Some(oldest) = pending.pop_front() {
            self.finish_reduction(oldest, &mut replica_reductions)?;
        }
        for work in replica_reductions {
            work.wait()?;
        }
        self.micro_steps += 1;
        self.pending_micro_batches += 1;
        Ok(loss.expect("the model has a head stage"))
    }

    /// Hands unit `u`'s complete micro-batch gradient to the reduction the
    /// policy asks for: reduce-scatter it now, or accumulate it and
    /// all-reduce the sum on the last micro-batch.
    fn reduce(&mut self, u: usize, first: bool, last: bool, pending: &mut VecDeque<PendingReduction>) -> Result<()> {
        let _no_grad = tch::no_grad_guard();
        let unit = &mut self.units[u];
        let fresh = unit.take_compute_grad()?;
        let reduce_dtype = self.parallel.as_ref().map_or(Kind::Float, |p| p.reduce_dtype);
        let placement = *unit.placement();
        if placement.grads_sharded || placement.offload {
            // Reduced every micro-batch: into this rank's shard, or (offloaded)
            // on to the host, where micro-batches are summed, so no fp32
            // gradient stays on the device.
            let mut input = if fresh.defined() {
                fresh.to_kind(reduce_dtype)
            } else {
                Tensor::zeros([placement.shard.padded], (reduce_dtype, unit.device()))
            };
            let then = if placement.offload {
                AfterReduction::ToHost
            } else {
                AfterReduction::AddToShard { first_micro_batch: first, last_micro_batch: last }
            };
            let (work, result) = match (&self.parallel, placement.grads_sharded) {
                (Some(parallel), true) => {
                    let group = parallel.shard.expect("sharded gradients have a shard group");
                    let mut result = Tensor::empty([placement.shard.len], (reduce_dtype, input.device()));
                    (group.reduce_scatter_tensor(&mut result, &input, Reduction::Sum)?, result)
                }
                (Some(parallel), false) => (parallel.world.all_reduce(&mut input, Reduction::Sum)?, input),
                (None, _) => {
                    self.offload_stats.device_to_host_bytes += unit.send_to_host(&input) as f64;
                    return Ok(());
                }
            };
            pending.push_back(PendingReduction { unit: u, work, result, then });
            return Ok(());
        }
        unit.accumulate_grad(&fresh, first);
        if let (Some(parallel), true) = (&self.parallel, last) {
            if reduce_dtype == Kind::Float {
                let work = parallel.world.all_reduce(&mut unit.grad, Reduction::Sum)?;
                pending.push_back(PendingReduction { unit: u, work, result: unit.grad.shallow_clone(), then: AfterReduction::Nothing });
            } else {
                let mut result = unit.grad.to_kind(reduce_dtype);
                let work = parallel.world.all_reduce(&mut result, Reduction::Sum)?;
                pending.push_back(PendingReduction { unit: u, work, result, then: AfterReduction::CopyToGrad });
            }
        }
        Ok(())
    }

    /// Waits for one reduction and files its result; a gradient shard complete
    /// on the last micro-batch is then all-reduced across replica groups.
    fn finish_reduction(&mut self, reduction: PendingReduction, replica_reductions: &mut Vec<Work>) -> Result<()> {
        let _no_grad = tch::no_grad_guard();
        reduction.work.wait()?;
        let unit = &mut self.units[reduction.unit];
        match reduction.then {
            AfterReduction::AddToShard { first_micro_batch, last_micro_batch } => {
                unit.accumulate_grad(&reduction.result, first_micro_batch);
                let replicas = self.parallel.as_ref().and_then(|p| p.replicas);
                if let (Some(replicas), true) = (replicas, last_micro_batch) {
                    replica_reductions.push(replicas.all_reduce(&mut unit.grad, Reduction::Sum)?);
                }
            }
            AfterReduction::CopyToGrad => {
                unit.grad.copy_(&reduction.result);
            }
            AfterReduction::ToHost => {
                // Accumulation happens on the host, so replicas sum every micro-batch.
                let mut result = reduction.result;
                let replicas = self.parallel.as_ref().and_then(|p| p.replicas);
                if let (Some(replicas), true) = (replicas, unit.placement().grads_sharded) {
                    replicas.all_reduce(&mut result, Reduction::Sum)?.wait()?;
                }
                self.offload_stats.device_to_host_bytes += unit.send_to_host(&result) as f64;
            }
            AfterReduction::Nothing => {}
        }
        Ok(())
    }

    /// Clips by the global gradient norm (if configured), takes one AdamW step
    /// at `lr`, refreshes the compute copies and clears the gradients.
    /// Returns the gradient norm before clipping, on the device.
    pub fn step(&mut self, lr: f64) -> Result<Tensor> {
        let _no_grad = tch::no_grad_guard();
        if self.pending_micro_batches == 0 {
            bail!("step() without a forward_backward() since the last step");
        }
        let device = self.units[0].device();
        let offloaded = self.units.iter().any(FlatUnit::offloaded_to_host);
        let mut host_started = std::time::Instant::now();
        if offloaded {
            // The host pieces were queued behind the reductions on this stream.
            if let tch::Device::Cuda(index) = device {
                ft_sys::cuda_stream_synchronize(index)?;
            }
            self.offload_stats.wait_seconds += host_started.elapsed().as_secs_f64();
            host_started = std::time::Instant::now();
            for unit in self.units.iter_mut().filter(|u| u.offloaded_to_host()) {
                unit.collect_host_grad();
            }
        }
        // Each rank's optimizer covers its owned gradient; when that is a
        // shard, the squares are summed over the shard group (replica
        // groups hold the same shards after their all-reduce).
        let owned: Vec<Tensor> = self.units.iter().map(FlatUnit::owned_grad).collect();
        let squares = owned
            .iter()
            .map(|g| match g.device() {
                tch::Device::Cpu if offloaded => Ok(Tensor::from(ft_sys::cpu_sum_of_squares(g)? as f32).to_device(device)),
                // One reduction reading the gradient once (square().sum() writes an fp32 copy first).
                _ => Ok(g.norm().square()),
            })
            .collect::<Result<Vec<Tensor>>>()?;
        let mut sum_of_squares = Tensor::stack(&squares, 0).sum(Kind::Float);
        if let Some(group) = self.shard_group().filter(|_| self.units[0].placement().optimizer_sharded) {
            group.all_reduce(&mut sum_of_squares, Reduction::Sum)?.wait()?;
        }
        let mut total_norm = sum_of_squares.sqrt();
        // fp16: gradients carry the loss scale; an overflow skips the step.
        let found_inf = self.scaler.is_some().then(|| total_norm.isfinite().logical_not().to_kind(Kind::Float).reshape([1]));
        if let Some(scaler) = &self.scaler {
            total_norm = &total_norm / scaler.scale.squeeze();
        }
        // Clipping divides every gradient by max(1, norm / max_norm), inside AdamW's kernel.
        let clip = self.options.max_grad_norm.map(|max_norm| (&total_norm / max_norm).clamp_min(1.0));
        let grad_scale = match (&self.scaler, clip) {
            (Some(scaler), Some(clip)) => Some(scaler.scale.squeeze() * clip),
            (Some(scaler), None) => Some(scaler.scale.squeeze()),
            (None, clip) => clip,
        };
        let _ = self.step.g_add_scalar_(1.0);
        let hyper = AdamW { lr, ..self.options.adamw };
        for (decayed, hyper) in [(true, hyper), (false, AdamW { weight_decay: 0.0, ..hyper })] {
            let (mut params, mut grads, mut m, mut v) = (vec![], vec![], vec![], vec![]);
            let mut host = vec![];
            for (unit, grad) in self.units.iter().zip(&owned) {
                let (split, len) = (unit.decayed_in_master(), unit.master.size()[0]);
                let (start, count) = if decayed { (0, split) } else { (split, len - split) };
                if count == 0 {
                    continue;
                }
                let part = [&unit.master, grad, &unit.exp_avg, &unit.exp_avg_sq].map(|t| t.narrow(0, start, count));
                if unit.offloaded_to_host() {
                    host.push(part);
                } else {
                    let [p, g, mm, vv] = part;
                    params.push(p);
                    grads.push(g);
                    m.push(mm);
                    v.push(vv);
                }
            }
            if !params.is_empty() && self.kernels == Kernels::Ft {
                for (((p, g), mm), vv) in params.iter().zip(&grads).zip(&m).zip(&v) {
                    ft_sys::kernels::adamw_(p, g, mm, vv, hyper, &self.step, grad_scale.as_ref(), found_inf.as_ref())?;
                }
            } else if !params.is_empty() {
                let steps: Vec<&Tensor> = params.iter().map(|_| &self.step).collect();
                ft_sys::fused_adamw(&refs(&params), &refs(&grads), &refs(&m), &refs(&v), &steps, hyper, grad_scale.as_ref(), found_inf.as_ref())
                    .map_err(anyhow::Error::msg)?;
            }
            if !host.is_empty() && !found_inf.as_ref().is_some_and(|inf| inf.double_value(&[0]) != 0.0) {
                let scale = grad_scale.as_ref().map_or(1.0, |s| s.double_value(&[]));
                let step = self.step.double_value(&[]);
                for [p, g, mm, vv] in &host {
                    ft_sys::cpu_adamw(p, g, mm, vv, hyper, step, scale)?;
                }
            }
        }
        if let (Some(scaler), Some(found_inf)) = (&mut self.scaler, &found_inf) {
            // A skipped step does not count (as torch.optim's fused AdamW does).
            let _ = self.step.g_sub_(&found_inf.squeeze());
            let _ = scaler.scale.internal_amp_update_scale_(&scaler.growth_tracker, found_inf, 2.0, 0.5, 2000);
        }
        if offloaded {
            self.offload_stats.cpu_step_seconds += host_started.elapsed().as_secs_f64();
        }
        let shard_group = self.shard_group();
        let mut gathers = vec![];
        for unit in &mut self.units {
            unit.release_grad();
            if unit.offloaded_to_host() {
                self.offload_stats.host_to_device_bytes += (unit.master.numel() * 4) as f64;
            }
            gathers.extend(unit.refresh_compute(shard_group)?);
        }
        for work in gathers {
            work.wait()?;
        }
        self.pending_micro_batches = 0;
        Ok(total_norm)
    }

    /// What offloading has moved and how long the host optimizer took, so far.
    pub fn offload_stats(&self) -> OffloadStats {
        self.offload_stats
    }

    /// Unit names and sizes, which a checkpoint must match.
    pub fn layout(&self) -> Vec<crate::checkpoint::UnitLayout> {
        self.units.iter().map(|u| crate::checkpoint::UnitLayout { name: u.name().to_string(), numel: u.numel() }).collect()
    }

    pub fn adamw_step(&self) -> &Tensor {
        &self.step
    }

    pub fn micro_steps(&self) -> i64 {
        self.micro_steps
    }

    /// The whole optimizer state per unit — [master, exp_avg, exp_avg_sq],
    /// fp32, unpadded — gathered from the shard group where it is sharded.
    /// Every rank must call this (it is collective when sharded).
    pub fn whole_state(&self) -> Result<Vec<[Tensor; 3]>> {
        let group = self.shard_group();
        self.units
            .iter()
            .map(|u| Ok([u.whole(&u.master, group)?, u.whole(&u.exp_avg, group)?, u.whole(&u.exp_avg_sq, group)?]))
            .collect()
    }

    /// Puts back whole state (as `whole_state` returns it), each rank keeping its part.
    pub fn restore(&mut self, units: &[Vec<Tensor>], step: &Tensor, micro_steps: i64) -> Result<()> {
        for (unit, state) in self.units.iter_mut().zip(units) {
            unit.restore(state)?;
        }
        self.step.shallow_clone().copy_(step);
        self.micro_steps = micro_steps;
        Ok(())
    }

    /// The whole parameters in the compute dtype, detached, per unit
    /// (gathered when sharded; collective then).
    pub fn compute_params(&self) -> Result<Vec<Vec<Tensor>>> {
        let group = self.shard_group();
        self.units.iter().map(|u| Ok(unflatten(&u.spec, &u.whole_compute(group)?.detach()))).collect()
    }

    /// The current fp32 parameters, per unit, shaped as the model declares
    /// them (gathered when sharded; collective then).
    pub fn params(&self) -> Result<Vec<Vec<Tensor>>> {
        let group = self.shard_group();
        self.units.iter().map(|u| Ok(unflatten(&u.spec, &u.whole(&u.master, group)?))).collect()
    }

    /// What this rank holds for parameters, gradients and optimizer state,
    /// and the peak of gathered units so far.
    pub fn memory(&self) -> MemoryAccount {
        let mut total = MemoryAccount { gathered_peak: self.gathered_peak as f64, ..MemoryAccount::default() };
        for unit in &self.units {
            let m = unit.memory();
            total.params += m.params;
            total.grads += m.grads;
            total.optimizer_state += m.optimizer_state;
            total.host += m.host;
        }
        total
    }

    /// fp16's current loss scale (None in other dtypes).
    pub fn loss_scale(&self) -> Option<f64> {
        self.scaler.as_ref().map(|s| s.scale.double_value(&[0]))
    }

    /// Whether this trainer runs ATen's or ft's kernels.
    pub fn kernels(&self) -> Kernels {
        self.kernels
    }

    pub fn loss_chunk_tokens(&self) -> i64 {
        self.options.loss_chunk_tokens
    }

    pub fn model(&self) -> &dyn Model {
        self.model
    }
}

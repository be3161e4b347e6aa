//! The training step, unit by unit (DESIGN.md §4).
//!
//! Each unit's parameters live in flat buffers: an fp32 master, a copy in
//! the compute dtype whose views the model reads (a leaf, so autograd gives
//! one flat gradient per unit, as FSDP's FlatParameter does), an fp32
//! gradient accumulator and AdamW's moments. Forward runs the model's stages
//! with the activation detached between stages; backward walks them in
//! reverse, feeding each stage's output its gradient. A unit's gradient is
//! complete after its first stage's backward: that is where a sharding
//! strategy reduces it.
//!
//! Inside a unit's flat buffers the matrices come first and the vectors
//! (biases, norm weights) after, so AdamW's weight decay — which, as in
//! Hugging Face's Trainer, skips biases and norms — applies to one prefix.

use crate::comm::{ProcessGroup, Reduction, Work};
use crate::model::{Model, Params, StageKind, UnitSpec};
use anyhow::{bail, Result};
use ft_sys::AdamW;
use tch::{Kind, Tensor};

pub struct FlatUnit {
    spec: UnitSpec,
    /// The parameters (indices into `spec`) in the order the flat buffers hold them.
    order: Vec<usize>,
    /// Elements of the weight-decayed prefix.
    decayed: i64,
    master: Tensor,
    /// In the compute dtype; the same tensor as `master` when that is fp32.
    compute: Tensor,
    grad: Tensor,
    exp_avg: Tensor,
    exp_avg_sq: Tensor,
}

fn is_decayed(shape: &[i64]) -> bool {
    shape.len() >= 2
}

/// How `spec`'s parameters sit in its unit's flat buffer: their order
/// (matrices first), and the end of the weight-decayed prefix.
fn flat_layout(spec: &UnitSpec) -> (Vec<usize>, i64) {
    let order: Vec<usize> = (0..spec.params.len())
        .filter(|&i| is_decayed(&spec.params[i].shape))
        .chain((0..spec.params.len()).filter(|&i| !is_decayed(&spec.params[i].shape)))
        .collect();
    let decayed = order.iter().filter(|&&i| is_decayed(&spec.params[i].shape)).map(|&i| spec.params[i].numel()).sum();
    (order, decayed)
}

/// Views of a flat buffer laid out in `order`, returned in `spec` order and
/// shaped. One `split_with_sizes` makes them all, so autograd returns the
/// gradient of the buffer with one concatenation (a narrow per parameter
/// would zero-fill a buffer-sized tensor per parameter).
fn split_views(spec: &UnitSpec, order: &[usize], flat: &Tensor) -> Vec<Tensor> {
    let sizes: Vec<i64> = order.iter().map(|&i| spec.params[i].numel()).collect();
    let mut by_spec: Vec<Option<Tensor>> = (0..sizes.len()).map(|_| None).collect();
    for (piece, &i) in flat.split_with_sizes(&sizes, 0).into_iter().zip(order) {
        by_spec[i] = Some(piece);
    }
    by_spec
        .into_iter()
        .zip(&spec.params)
        .map(|(piece, p)| piece.expect("every parameter has a piece").view(p.shape.as_slice()))
        .collect()
}

/// A unit's parameters (in `spec` order, shaped) as views of its flat buffer.
pub fn unflatten(spec: &UnitSpec, flat: &Tensor) -> Vec<Tensor> {
    split_views(spec, &flat_layout(spec).0, flat)
}

impl FlatUnit {
    /// Flattens `tensors` (one per parameter of `spec`) onto their device.
    pub fn new(spec: &UnitSpec, tensors: &[Tensor], dtype: Kind) -> FlatUnit {
        let (order, decayed) = flat_layout(spec);
        let pieces: Vec<Tensor> = order.iter().map(|&i| tensors[i].to_kind(Kind::Float).reshape([-1])).collect();
        let master = Tensor::cat(&pieces, 0);
        let compute = if dtype == Kind::Float { master.shallow_clone() } else { master.to_kind(dtype) };
        let compute = compute.set_requires_grad(true);
        FlatUnit {
            spec: spec.clone(),
            order,
            decayed,
            grad: master.zeros_like(),
            exp_avg: master.zeros_like(),
            exp_avg_sq: master.zeros_like(),
            master,
            compute,
        }
    }

    /// Views of the compute buffer: what the model reads, what autograd differentiates.
    fn views(&self) -> Vec<Tensor> {
        self.shaped(&self.compute)
    }

    /// Views of one of the unit's flat buffers, shaped like its parameters.
    fn shaped(&self, flat: &Tensor) -> Vec<Tensor> {
        split_views(&self.spec, &self.order, flat)
    }

    /// What a checkpoint stores: the fp32 master and AdamW's moments.
    pub fn state(&self) -> [(&'static str, &Tensor); 3] {
        [("master", &self.master), ("exp_avg", &self.exp_avg), ("exp_avg_sq", &self.exp_avg_sq)]
    }

    /// The dtype the model computes in.
    pub fn compute_kind(&self) -> Kind {
        self.compute.kind()
    }

    /// The fp32 master values (for saving).
    pub fn master_params(&self) -> Vec<Tensor> {
        self.shaped(&self.master)
    }

    /// The accumulated fp32 gradient.
    pub fn grad_views(&self) -> Vec<Tensor> {
        self.shaped(&self.grad)
    }

    /// Moves the compute buffer's gradient into the fp32 accumulator (a copy
    /// for the first micro-batch after a step, a sum after that) and drops it.
    fn accumulate_grad(&mut self, first_micro_batch: bool) -> Result<()> {
        let grad = self.compute.grad();
        if grad.defined() {
            if first_micro_batch {
                self.grad.copy_(&grad);
            } else {
                let _ = self.grad.g_add_(&grad);
            }
            ft_sys::clear_grad(&self.compute).map_err(anyhow::Error::msg)?;
        } else if first_micro_batch {
            let _ = self.grad.zero_();
        }
        Ok(())
    }
}

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
        }
    }
}

/// fp16's dynamic loss scale, on the device (no host synchronisation).
struct LossScaler {
    scale: Tensor,
    growth_tracker: Tensor,
}

/// Loss and gradients of the LM head, `chunk` tokens at a time, without
/// autograd: logits exist in fp32 for one chunk only. `labels` are aligned
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
        let target = targets.narrow(0, start, len);
        let valid = target.ne(crate::dataset::IGNORE_INDEX);
        let scale = valid.to_kind(Kind::Float) / normalizer;
        let safe_target = target.clamp_min(0).unsqueeze(1);
        // Four passes over the [len, vocab] logits: log-softmax (bf16 in, fp32
        // out), exp in place, the cast back, the scale.
        let log_probs = h.matmul(&weight.tr()).log_softmax(-1, Kind::Float);
        let picked = log_probs.gather(1, &safe_target, false).squeeze_dim(1);
        loss -= (picked * &scale).sum(Kind::Float);
        // d loss / d logits = (softmax − one-hot(target)) · scale.
        let mut probs = log_probs;
        let _ = probs.exp_();
        let _ = probs.scatter_add_(1, &safe_target, &(-valid.to_kind(Kind::Float)).unsqueeze(1));
        let row_scale = match grad_multiplier {
            Some(multiplier) => &scale * multiplier,
            None => scale.shallow_clone(),
        };
        let mut grad_logits = probs.to_kind(weight.kind());
        let _ = grad_logits.g_mul_(&row_scale.to_kind(weight.kind()).unsqueeze(1));
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

/// One process's training state: the model's units as flat buffers and the
/// optimizer. (Sharding strategies distribute the same mechanism.)
pub struct Trainer<'m> {
    model: &'m dyn Model,
    units: Vec<FlatUnit>,
    options: TrainOptions,
    /// AdamW's step count, on the device, shared by every buffer.
    step: Tensor,
    micro_steps: i64,
    /// Micro-batches since the last optimizer step.
    pending_micro_batches: usize,
    /// Replicas whose gradients are summed (data parallelism), if any.
    replicas: Option<&'m ProcessGroup>,
    /// Present when computing in fp16.
    scaler: Option<LossScaler>,
}

impl<'m> Trainer<'m> {
    /// `params[unit]` are the initial parameters, already on the training device.
    pub fn new(model: &'m dyn Model, params: &[Vec<Tensor>], options: TrainOptions) -> Trainer<'m> {
        let units: Vec<FlatUnit> =
            model.units().iter().zip(params).map(|(spec, t)| FlatUnit::new(spec, t, options.dtype)).collect();
        let device = units[0].master.device();
        let scaler = (options.dtype == Kind::Half).then(|| LossScaler {
            scale: Tensor::from_slice(&[options.initial_loss_scale as f32]).to_device(device),
            growth_tracker: Tensor::zeros([1], (Kind::Int, device)),
        });
        Trainer {
            scaler,
            model,
            units,
            options,
            step: Tensor::zeros([], (Kind::Float, device)),
            micro_steps: 0,
            pending_micro_batches: 0,
            replicas: None,
        }
    }

    /// Sums gradients over `group` (every member holds the whole model): each
    /// unit's all-reduce starts as soon as its gradient is complete and runs
    /// while backward continues with earlier units.
    pub fn with_data_parallel(mut self, group: &'m ProcessGroup) -> Trainer<'m> {
        self.replicas = Some(group);
        self
    }

    pub fn units(&self) -> &[FlatUnit] {
        &self.units
    }

    /// Forward and backward of one micro-batch; gradients add up until `step`.
    /// `normalizer` is the target-token count of the whole global batch.
    /// `last_micro_batch` synchronises gradients across replicas.
    /// Returns this micro-batch's share of the loss (sum / `normalizer`), on the device.
    pub fn forward_backward(
        &mut self,
        input_ids: &Tensor,
        labels: &Tensor,
        normalizer: f64,
        last_micro_batch: bool,
    ) -> Result<Tensor> {
        let model = self.model;
        let (dtype, checkpoint) = (self.options.dtype, self.options.activation_checkpointing);
        let ctx = model.context(input_ids, 0, None, dtype, true)?;
        let views: Vec<Vec<Tensor>> = self.units.iter().map(FlatUnit::views).collect();
        let specs = model.units();
        let stages = model.stages();
        let seed_for = |stage: usize| self.options.seed.wrapping_mul(1_000_003).wrapping_add(self.micro_steps * 4099 + stage as i64);

        let mut saved: Vec<Saved> = Vec::with_capacity(stages.len());
        let mut x: Option<Tensor> = None;
        let mut loss = None;
        for (index, stage) in stages.iter().enumerate() {
            let params = Params::new(&specs[stage.unit], &views[stage.unit]);
            let input = x.take().map(|t| t.set_requires_grad(true));
            match stage.kind {
                StageKind::Embed => {
                    let y = model.embed(&params, input_ids, &ctx);
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
                    let (hidden, weight) = model.head(&params, &input);
                    let (stage_loss, grad_hidden, grad_weight) = lm_head_loss_and_grads(
                        &hidden,
                        &weight,
                        labels,
                        normalizer,
                        self.options.loss_chunk_tokens,
                        self.scaler.as_ref().map(|s| &s.scale),
                    )?;
                    loss = Some(stage_loss);
                    saved.push(Saved { input: Some(input), outputs: vec![hidden, weight], grads: vec![grad_hidden, grad_weight] });
                }
            }
        }

        let mut grad: Option<Tensor> = None;
        let mut reductions: Vec<Work> = vec![];
        for (index, (stage, mut s)) in stages.iter().zip(saved).enumerate().rev() {
            if s.outputs.is_empty() {
                // Recompute the checkpointed block, with the same dropout masks.
                let params = Params::new(&specs[stage.unit], &views[stage.unit]);
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
            if stages.iter().position(|st| st.unit == stage.unit) == Some(index) {
                let unit = &mut self.units[stage.unit];
                unit.accumulate_grad(self.pending_micro_batches == 0)?;
                if let (Some(group), true) = (self.replicas, last_micro_batch) {
                    reductions.push(group.all_reduce(&mut unit.grad, Reduction::Sum)?);
                }
            }
        }
        for work in reductions {
            work.wait()?;
        }
        self.micro_steps += 1;
        self.pending_micro_batches += 1;
        Ok(loss.expect("the model has a head stage"))
    }

    /// Clips by the global gradient norm (if configured), takes one AdamW step
    /// at `lr`, refreshes the compute copies and clears the gradients.
    /// Returns the gradient norm before clipping, on the device.
    pub fn step(&mut self, lr: f64) -> Result<Tensor> {
        let _no_grad = tch::no_grad_guard();
        if self.pending_micro_batches == 0 {
            bail!("step() without a forward_backward() since the last step");
        }
        let norms: Vec<Tensor> = self.units.iter().map(|u| u.grad.norm()).collect();
        let mut total_norm = Tensor::stack(&norms, 0).norm();
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
            let part = |t: &Tensor, u: &FlatUnit| {
                if decayed {
                    t.narrow(0, 0, u.decayed)
                } else {
                    t.narrow(0, u.decayed, t.size()[0] - u.decayed)
                }
            };
            let chosen: Vec<&FlatUnit> =
                self.units.iter().filter(|u| if decayed { u.decayed > 0 } else { u.decayed < u.master.size()[0] }).collect();
            if chosen.is_empty() {
                continue;
            }
            let params: Vec<Tensor> = chosen.iter().map(|u| part(&u.master, u)).collect();
            let grads: Vec<Tensor> = chosen.iter().map(|u| part(&u.grad, u)).collect();
            let m: Vec<Tensor> = chosen.iter().map(|u| part(&u.exp_avg, u)).collect();
            let v: Vec<Tensor> = chosen.iter().map(|u| part(&u.exp_avg_sq, u)).collect();
            let steps: Vec<&Tensor> = chosen.iter().map(|_| &self.step).collect();
            ft_sys::fused_adamw(&refs(&params), &refs(&grads), &refs(&m), &refs(&v), &steps, hyper, grad_scale.as_ref(), found_inf.as_ref())
                .map_err(anyhow::Error::msg)?;
        }
        if let (Some(scaler), Some(found_inf)) = (&mut self.scaler, &found_inf) {
            // A skipped step does not count (as torch.optim's fused AdamW does).
            let _ = self.step.g_sub_(&found_inf.squeeze());
            let _ = scaler.scale.internal_amp_update_scale_(&scaler.growth_tracker, found_inf, 2.0, 0.5, 2000);
        }
        for unit in &mut self.units {
            if unit.compute.kind() != Kind::Float {
                let _ = unit.compute.copy_(&unit.master);
            }
        }
        self.pending_micro_batches = 0;
        Ok(total_norm)
    }

    /// Unit names and sizes, which a checkpoint must match.
    pub fn layout(&self) -> Vec<crate::checkpoint::UnitLayout> {
        self.units.iter().map(|u| crate::checkpoint::UnitLayout { name: u.spec.name.clone(), numel: u.master.numel() as i64 }).collect()
    }

    pub fn adamw_step(&self) -> &Tensor {
        &self.step
    }

    pub fn micro_steps(&self) -> i64 {
        self.micro_steps
    }

    /// Puts back a checkpoint's state: per unit [master, exp_avg, exp_avg_sq].
    pub fn restore(&mut self, units: &[Vec<Tensor>], step: &Tensor, micro_steps: i64) -> Result<()> {
        let _no_grad = tch::no_grad_guard();
        for (unit, state) in self.units.iter_mut().zip(units) {
            for (target, source) in [&unit.master, &unit.exp_avg, &unit.exp_avg_sq].into_iter().zip(state) {
                if target.size() != source.size() {
                    bail!("unit {}: checkpoint tensor {:?} does not fit {:?}", unit.spec.name, source.size(), target.size());
                }
                target.shallow_clone().copy_(source);
            }
            if unit.compute.kind() != Kind::Float {
                unit.compute.shallow_clone().copy_(&unit.master);
            }
        }
        self.step.shallow_clone().copy_(step);
        self.micro_steps = micro_steps;
        Ok(())
    }

    /// The parameters the model computes with (compute dtype), detached, per unit.
    pub fn compute_params(&self) -> Vec<Vec<Tensor>> {
        self.units.iter().map(|u| u.views().iter().map(Tensor::detach).collect()).collect()
    }

    /// The current fp32 parameters, per unit, shaped as the model declares them.
    pub fn params(&self) -> Vec<Vec<Tensor>> {
        self.units.iter().map(FlatUnit::master_params).collect()
    }

    /// fp16's current loss scale (None in other dtypes).
    pub fn loss_scale(&self) -> Option<f64> {
        self.scaler.as_ref().map(|s| s.scale.double_value(&[0]))
    }

    pub fn loss_chunk_tokens(&self) -> i64 {
        self.options.loss_chunk_tokens
    }

    pub fn model(&self) -> &dyn Model {
        self.model
    }
}

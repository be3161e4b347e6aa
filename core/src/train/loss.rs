//! Losses of a causal LM's head: the logits of [hidden, weight] formed
//! chunk by chunk, so they never exist whole. The training loss computes its
//! gradients without autograd — ft's fused CUDA kernel writes them over the
//! bf16 logits, ATen's ops elsewhere.

use super::Kernels;
use crate::model::{forward, linear, lm_outputs, matmul, token_batch, Inputs, Model};
use crate::panic::libtorch_errors;
use anyhow::{bail, Result};
use tch::{Kind, Tensor};

/// The label cross-entropy skips (PyTorch's and Hugging Face's convention):
/// prompt tokens, padding.
pub const IGNORE_INDEX: i64 = -100;

/// Mean next-token cross-entropy over labels that are not `IGNORE_INDEX`,
/// with `labels` aligned to the inputs (shifted here, as Hugging Face does).
/// Logits exist `chunk` tokens at a time, in fp32 only for the chunk,
/// soft-capped by `softcap` when the model caps them ([`softcapped`]).
pub fn lm_loss(hidden: &Tensor, weight: &Tensor, labels: &Tensor, chunk: i64, softcap: Option<f64>) -> Result<Tensor> {
    let (sum, count) = lm_loss_sum(hidden, weight, labels, chunk, softcap)?;
    Ok(sum / count.clamp_min(1.0))
}

/// The summed next-token cross-entropy and the number of target tokens.
pub fn lm_loss_sum(hidden: &Tensor, weight: &Tensor, labels: &Tensor, chunk: i64, softcap: Option<f64>) -> Result<(Tensor, Tensor)> {
    let rows = TargetRows::of(hidden, labels)?;
    let mut total = Tensor::zeros([], (Kind::Float, hidden.device()));
    for (_, logits, target) in rows.logit_chunks(weight, chunk) {
        total += fp32_logits(logits, softcap).cross_entropy_loss::<Tensor>(&target, None, tch::Reduction::Sum, IGNORE_INDEX, 0.0);
    }
    let count = Tensor::full([], rows.len() as f64, (Kind::Float, hidden.device()));
    Ok((total, count))
}

/// Each label's log-probability under the head's logits at `rows`,
/// [batch, seq] aligned with their labels (position i: log p(labels\[i\] |
/// the tokens before i)), 0 where the label is ignored and at position 0;
/// the logits formed `chunk` target tokens at a time. With ft's kernels and
/// bf16 logits (no soft cap) one read of each chunk gives its
/// log-probabilities (the fused cross-entropy without its gradient pass);
/// else ATen's fp32 log-softmax.
pub fn lm_label_logps(rows: &TargetRows, weight: &Tensor, chunk: i64, softcap: Option<f64>, kernels: Kernels) -> Result<Tensor> {
    let _no_grad = tch::no_grad_guard();
    let mut parts = vec![];
    for (_, logits, target) in rows.logit_chunks(weight, chunk) {
        parts.push(if kernels == Kernels::Ft && softcap.is_none() && logits.kind() == Kind::BFloat16 {
            let mut row_loss = Tensor::empty([target.size()[0]], (Kind::Float, logits.device()));
            ft_sys::kernels::softmax_xent_loss(&logits, &target, &mut row_loss, IGNORE_INDEX)?;
            -row_loss
        } else {
            let log_probs = fp32_logits(logits, softcap).log_softmax(-1, Kind::Float);
            log_probs.gather(1, &target.unsqueeze(1), false).squeeze_dim(1)
        });
    }
    let logps = Tensor::zeros([rows.labels.iter().product::<i64>()], (Kind::Float, rows.inputs.device()));
    let logps = match parts.is_empty() {
        true => logps,
        false => logps.index_copy(0, &rows.label_positions(), &Tensor::cat(&parts, 0)),
    };
    Ok(logps.view(rows.labels.as_slice()))
}

/// [`lm_label_logps`] with each position's entropy of the next-token
/// distribution beside it (0 where the label is ignored), in ATen's fp32:
/// what online RL logs (`entropy`) besides the log-probabilities it trains on.
pub fn lm_label_logps_and_entropies(rows: &TargetRows, weight: &Tensor, chunk: i64, softcap: Option<f64>) -> Result<(Tensor, Tensor)> {
    let _no_grad = tch::no_grad_guard();
    let (mut logps, mut entropies) = (vec![], vec![]);
    for (_, logits, target) in rows.logit_chunks(weight, chunk) {
        let log_probs = fp32_logits(logits, softcap).log_softmax(-1, Kind::Float);
        logps.push(log_probs.gather(1, &target.unsqueeze(1), false).squeeze_dim(1));
        entropies.push(-(log_probs.exp() * &log_probs).sum_dim_intlist(-1, false, Kind::Float));
    }
    let placed = |parts: Vec<Tensor>| {
        let zeros = Tensor::zeros([rows.labels.iter().product::<i64>()], (Kind::Float, rows.inputs.device()));
        let values = if parts.is_empty() { zeros } else { zeros.index_copy(0, &rows.label_positions(), &Tensor::cat(&parts, 0)) };
        values.view(rows.labels.as_slice())
    };
    Ok((placed(logps), placed(entropies)))
}

/// The head's rows that predict a target: of the flattened hidden states,
/// the positions whose next label is not `IGNORE_INDEX`, with those labels.
/// Prompt tokens, padding and each sequence's last position form no
/// logits at all (in SFT on chat data and in DPO, the prompt is often half
/// the tokens, and the head's logits the step's largest tensor). Finding
/// them reads the labels' mask on the host once: a loss that reads the head
/// twice (DPO's: the log-probabilities, then the gradients) builds them once.
pub struct TargetRows {
    /// Indices into the flattened [batch · seq] positions.
    positions: Tensor,
    /// The hidden states at those positions, [rows, dim].
    inputs: Tensor,
    targets: Tensor,
    /// The labels' shape, [batch, seq].
    labels: Vec<i64>,
}

impl TargetRows {
    /// The rows of `hidden` [batch, seq, dim] that predict one of `labels` [batch, seq].
    pub fn of(hidden: &Tensor, labels: &Tensor) -> Result<TargetRows> {
        let (batch, seq, dim) = hidden.size3()?;
        if labels.size() != [batch, seq] {
            bail!("labels {:?} do not match the hidden states' [batch, seq] = [{batch}, {seq}]", labels.size());
        }
        // Position (b, t) predicts label (b, t + 1); the last position of each sequence predicts nothing.
        let predicts = Tensor::cat(&[labels.narrow(1, 1, seq - 1).ne(IGNORE_INDEX), labels.zeros_like().narrow(1, 0, 1).to_kind(Kind::Bool)], 1);
        let positions = predicts.reshape([-1]).nonzero().squeeze_dim(1);
        let inputs = hidden.reshape([-1, dim]).index_select(0, &positions);
        let targets = labels.reshape([-1]).index_select(0, &(&positions + 1));
        Ok(TargetRows { positions, inputs, targets, labels: labels.size() })
    }

    fn len(&self) -> i64 {
        self.targets.size()[0]
    }

    /// Where each row's label is, in the flattened labels.
    fn label_positions(&self) -> Tensor {
        &self.positions + 1
    }

    /// `chunk` rows at a time: the chunk's first row, its logits in the
    /// weight's dtype (soft-capping is the caller's) and its targets.
    fn logit_chunks<'a>(&'a self, weight: &'a Tensor, chunk: i64) -> impl Iterator<Item = (i64, Tensor, Tensor)> + 'a {
        let rows = self.len();
        (0..rows).step_by(chunk.max(1) as usize).map(move |start| {
            let len = chunk.min(rows - start);
            (start, linear(&self.inputs.narrow(0, start, len), weight, None), self.targets.narrow(0, start, len))
        })
    }

    /// `values` [rows, dim] at these rows' positions of zeros shaped like `hidden` [batch, seq, dim].
    fn placed(&self, values: &Tensor, hidden: &Tensor) -> Tensor {
        hidden.zeros_like().view([-1, hidden.size()[2]]).index_copy(0, &self.positions, values).view_as(hidden)
    }
}

/// Full logits [batch, seq, vocab] in fp32 (for inspection and generation).
pub fn logits(hidden: &Tensor, weight: &Tensor) -> Tensor {
    matmul(hidden, &weight.tr()).to_kind(Kind::Float)
}

/// A chunk of logits in fp32, soft-capped (what ATen's losses read).
fn fp32_logits(logits: Tensor, softcap: Option<f64>) -> Tensor {
    softcapped(logits.to_kind(Kind::Float), softcap)
}

/// `logits` soft-capped as `Model::logit_softcap` says: `c · tanh(logits / c)`.
pub fn softcapped(logits: Tensor, softcap: Option<f64>) -> Tensor {
    match softcap {
        Some(cap) => (logits / cap).tanh() * cap,
        None => logits,
    }
}


/// Loss and gradients of the LM head, `chunk` tokens at a time, without
/// autograd: logits exist for one chunk only. `labels` are aligned
/// with the inputs (shifted here); the loss is the sum over target tokens
/// divided by `normalizer` (the target tokens of the whole global batch, so
/// micro-batches and ranks add up to the global mean). Returns the loss and
/// the gradients of `hidden` and, with `weight_grad`, of `weight`
/// (undefined without: a frozen LM head skips that matmul). With `softcap`
/// the logits are soft-capped first ([`softcapped`]; ATen's ops then, not
/// ft's kernel).
#[allow(clippy::too_many_arguments)]
pub fn lm_head_loss_and_grads(
    hidden: &Tensor,
    weight: &Tensor,
    labels: &Tensor,
    normalizer: f64,
    chunk: i64,
    grad_multiplier: Option<&Tensor>,
    kernels: Kernels,
    weight_grad: bool,
    softcap: Option<f64>,
) -> Result<(Tensor, Tensor, Tensor)> {
    let token_weights = labels.ne(IGNORE_INDEX).to_kind(Kind::Float) / normalizer;
    let rows = TargetRows::of(hidden, labels)?;
    lm_head_weighted_loss_and_grads(hidden, weight, &rows, &token_weights, chunk, grad_multiplier, kernels, weight_grad, softcap)
}

/// [`lm_head_loss_and_grads`] over `rows` of `hidden`, each target's
/// cross-entropy weighed by its own `token_weights` [batch, seq] (aligned
/// with the labels; any sign)
/// instead of 1 / normalizer: the loss is Σ weight · cross-entropy. What a
/// loss of per-sequence log-probabilities (DPO's) backpropagates through
/// the head: its gradient with respect to each token's log-probability,
/// negated, is that token's weight.
#[allow(clippy::too_many_arguments)]
pub fn lm_head_weighted_loss_and_grads(
    hidden: &Tensor,
    weight: &Tensor,
    rows: &TargetRows,
    token_weights: &Tensor,
    chunk: i64,
    grad_multiplier: Option<&Tensor>,
    kernels: Kernels,
    weight_grad: bool,
    softcap: Option<f64>,
) -> Result<(Tensor, Tensor, Tensor)> {
    let _no_grad = tch::no_grad_guard();
    if token_weights.size() != rows.labels {
        bail!("weights {:?} do not match the labels' {:?}", token_weights.size(), rows.labels);
    }
    let weights = token_weights.reshape([-1]).to_kind(Kind::Float).index_select(0, &rows.label_positions());
    let mut grad_inputs = Vec::new();
    // Accumulated in the weight's dtype by the matmul itself (fp32 inside cuBLAS).
    let mut grad_weight: Option<Tensor> = None;
    let mut loss = Tensor::zeros([], (Kind::Float, hidden.device()));
    for (start, mut logits, target) in rows.logit_chunks(weight, chunk) {
        let len = target.size()[0];
        let h = rows.inputs.narrow(0, start, len);
        let scale = weights.narrow(0, start, len);
        let row_scale = match grad_multiplier {
            Some(multiplier) => &scale * multiplier,
            None => scale.shallow_clone(),
        };
        // c · tanh(z / c)'s derivative, 1 − tanh², multiplies the capped logits' gradient.
        let mut cap_derivative = None;
        if let Some(cap) = softcap {
            let tanh = (logits.to_kind(Kind::Float) / cap).tanh();
            cap_derivative = Some(1.0 - tanh.square());
            logits = tanh * cap;
        }
        // d loss / d logits = (softmax − one-hot(target)) · scale.
        let grad_logits = if kernels == Kernels::Ft && logits.kind() == Kind::BFloat16 {
            let mut row_loss = Tensor::empty([len], (Kind::Float, hidden.device()));
            ft_sys::kernels::softmax_xent_backward_(&mut logits, &target, &row_scale, &mut row_loss, IGNORE_INDEX)?;
            loss += (row_loss * &scale).sum(Kind::Float);
            logits
        } else {
            // Four passes over the [len, vocab] logits: log-softmax (fp32
            // out), exp in place, the cast back, the scale.
            let target = target.unsqueeze(1);
            let log_probs = logits.log_softmax(-1, Kind::Float);
            drop(logits);
            let picked = log_probs.gather(1, &target, false).squeeze_dim(1);
            loss -= (picked * &scale).sum(Kind::Float);
            let mut probs = log_probs;
            let _ = probs.exp_();
            let _ = probs.scatter_add_(1, &target, &Tensor::full([len, 1], -1.0, (Kind::Float, hidden.device())));
            if let Some(derivative) = &cap_derivative {
                let _ = probs.g_mul_(derivative);
            }
            let mut grad_logits = probs.to_kind(weight.kind());
            let _ = grad_logits.g_mul_(&row_scale.to_kind(weight.kind()).unsqueeze(1));
            grad_logits
        };
        grad_inputs.push(matmul(&grad_logits, weight));
        if weight_grad {
            grad_weight = Some(match grad_weight {
                None => matmul(&grad_logits.tr(), &h),
                Some(mut sum) => {
                    let _ = sum.addmm_(&grad_logits.tr(), &h);
                    sum
                }
            });
        }
    }
    // Positions that predict no target have a zero gradient.
    let grad_hidden = match grad_inputs.is_empty() {
        true => hidden.zeros_like(),
        false => rows.placed(&Tensor::cat(&grad_inputs, 0), hidden),
    };
    let grad_weight = match (grad_weight, weight_grad) {
        (Some(sum), _) => sum,
        (None, true) => weight.zeros_like(),
        (None, false) => Tensor::new(),
    };
    Ok((loss, grad_hidden, grad_weight))
}

/// A causal LM's logits and loss on `rows` of token ids (checked by
/// `model::token_batch`; labels = ids), and with `with_grads` every
/// parameter's gradient as `grad.<hf name>`, on the CPU in fp32: what `ft
/// forward` writes for comparison with a reference. libtorch's errors
/// (running out of memory, above all) come back as errors.
pub fn lm_inspection(model: &dyn Model, params: &[Vec<Tensor>], rows: &[Vec<i64>], dtype: Kind, with_grads: bool) -> Result<Vec<(String, Tensor)>> {
    let ids = token_batch(model, rows, params[0][0].device())?;
    libtorch_errors("running the model", || inspection(model, params, &ids, dtype, with_grads))?
}

fn inspection(model: &dyn Model, params: &[Vec<Tensor>], ids: &Tensor, dtype: Kind, with_grads: bool) -> Result<Vec<(String, Tensor)>> {
    for tensor in params.iter().flatten() {
        let _ = tensor.set_requires_grad(with_grads);
    }
    let inputs = Inputs::ids(ids);
    let ctx = model.context(&inputs, 0, dtype, false)?;
    let (hidden, weight) = lm_outputs(forward(model, params, &inputs, &ctx, None))?;
    let softcap = model.logit_softcap();
    let loss = lm_loss(&hidden, &weight, ids, 1024, softcap)?;
    let mut out = vec![("logits".to_string(), softcapped(logits(&hidden, &weight), softcap).detach()), ("loss".to_string(), loss.detach())];
    if with_grads {
        loss.backward();
        for (unit, tensors) in model.units().iter().zip(params) {
            for (spec, tensor) in unit.params.iter().zip(tensors) {
                out.push((format!("grad.{}", spec.hf_name), tensor.grad()));
            }
        }
    }
    Ok(out.into_iter().map(|(name, t)| (name, t.to_kind(Kind::Float).to_device(tch::Device::Cpu).contiguous())).collect())
}

//! Losses of a causal LM's head: the logits of [hidden, weight] formed
//! chunk by chunk, so they never exist whole. The training loss computes its
//! gradients without autograd — ft's fused CUDA kernel writes them over the
//! bf16 logits, ATen's ops elsewhere.

use super::Kernels;
use crate::model::{forward, lm_outputs, Inputs, Model};
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
    let (chunks, targets) = logit_chunks(hidden, weight, labels, chunk, softcap)?;
    let count = targets.ne(IGNORE_INDEX).sum(Kind::Float);
    let mut total = Tensor::zeros([], (Kind::Float, hidden.device()));
    for (logits, target) in chunks {
        total += logits.cross_entropy_loss::<Tensor>(&target, None, tch::Reduction::Sum, IGNORE_INDEX, 0.0);
    }
    Ok((total, count))
}

/// Each label's log-probability under the head's logits, [batch, seq]
/// aligned with `labels` (position i: log p(labels\[i\] | the tokens before
/// i)), 0 where the label is ignored and at position 0; the logits formed
/// `chunk` tokens at a time, in fp32 only for the chunk.
pub fn lm_label_logps(hidden: &Tensor, weight: &Tensor, labels: &Tensor, chunk: i64, softcap: Option<f64>) -> Result<Tensor> {
    let _no_grad = tch::no_grad_guard();
    let (batch, seq, _) = hidden.size3()?;
    let (chunks, _) = logit_chunks(hidden, weight, labels, chunk, softcap)?;
    let parts: Vec<Tensor> = chunks
        .map(|(logits, target)| {
            let picked = logits.log_softmax(-1, Kind::Float).gather(1, &target.clamp_min(0).unsqueeze(1), false).squeeze_dim(1);
            picked * target.ne(IGNORE_INDEX).to_kind(Kind::Float)
        })
        .collect();
    let logps = Tensor::cat(&parts, 0).view([batch, seq - 1]);
    Ok(Tensor::cat(&[logps.zeros_like().narrow(1, 0, 1), logps], 1))
}

/// The next-token targets (`labels` shifted, flattened) and, `chunk` tokens
/// at a time, the chunk's fp32 logits (soft-capped as the model caps them)
/// with its targets: the one walk both losses above take over the head.
fn logit_chunks<'a>(
    hidden: &Tensor,
    weight: &'a Tensor,
    labels: &Tensor,
    chunk: i64,
    softcap: Option<f64>,
) -> Result<(impl Iterator<Item = (Tensor, Tensor)> + 'a, Tensor)> {
    let (batch, seq, dim) = hidden.size3()?;
    if labels.size() != [batch, seq] {
        bail!("labels {:?} do not match the hidden states' [batch, seq] = [{batch}, {seq}]", labels.size());
    }
    let hidden = hidden.narrow(1, 0, seq - 1).reshape([-1, dim]);
    let targets = labels.narrow(1, 1, seq - 1).reshape([-1]);
    let tokens = targets.size()[0];
    let chunk_targets = targets.shallow_clone();
    let chunks = (0..tokens).step_by(chunk.max(1) as usize).map(move |start| {
        let len = chunk.min(tokens - start);
        let logits = softcapped(hidden.narrow(0, start, len).matmul(&weight.tr()).to_kind(Kind::Float), softcap);
        (logits, chunk_targets.narrow(0, start, len))
    });
    Ok((chunks, targets))
}

/// Full logits [batch, seq, vocab] in fp32 (for inspection and generation).
pub fn logits(hidden: &Tensor, weight: &Tensor) -> Tensor {
    hidden.matmul(&weight.tr()).to_kind(Kind::Float)
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
    lm_head_weighted_loss_and_grads(hidden, weight, labels, &token_weights, chunk, grad_multiplier, kernels, weight_grad, softcap)
}

/// [`lm_head_loss_and_grads`] with each target's cross-entropy weighed by
/// its own `token_weights` [batch, seq] (aligned with `labels`; any sign)
/// instead of 1 / normalizer: the loss is Σ weight · cross-entropy. What a
/// loss of per-sequence log-probabilities (DPO's) backpropagates through
/// the head: its gradient with respect to each token's log-probability,
/// negated, is that token's weight.
#[allow(clippy::too_many_arguments)]
pub fn lm_head_weighted_loss_and_grads(
    hidden: &Tensor,
    weight: &Tensor,
    labels: &Tensor,
    token_weights: &Tensor,
    chunk: i64,
    grad_multiplier: Option<&Tensor>,
    kernels: Kernels,
    weight_grad: bool,
    softcap: Option<f64>,
) -> Result<(Tensor, Tensor, Tensor)> {
    let _no_grad = tch::no_grad_guard();
    let (batch, seq, dim) = hidden.size3()?;
    if labels.size() != [batch, seq] || token_weights.size() != [batch, seq] {
        bail!("labels {:?} and weights {:?} do not match the hidden states' [batch, seq] = [{batch}, {seq}]", labels.size(), token_weights.size());
    }
    let inputs = hidden.narrow(1, 0, seq - 1).reshape([-1, dim]);
    let targets = labels.narrow(1, 1, seq - 1).reshape([-1]);
    let weights = token_weights.narrow(1, 1, seq - 1).reshape([-1]).to_kind(Kind::Float);
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
        let valid = target.ne(IGNORE_INDEX);
        let scale = weights.narrow(0, start, len) * valid.to_kind(Kind::Float);
        let row_scale = match grad_multiplier {
            Some(multiplier) => &scale * multiplier,
            None => scale.shallow_clone(),
        };
        let mut logits = h.matmul(&weight.tr());
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
            let safe_target = target.clamp_min(0).unsqueeze(1);
            let log_probs = logits.log_softmax(-1, Kind::Float);
            drop(logits);
            let picked = log_probs.gather(1, &safe_target, false).squeeze_dim(1);
            loss -= (picked * &scale).sum(Kind::Float);
            let mut probs = log_probs;
            let _ = probs.exp_();
            let _ = probs.scatter_add_(1, &safe_target, &(-valid.to_kind(Kind::Float)).unsqueeze(1));
            if let Some(derivative) = &cap_derivative {
                let _ = probs.g_mul_(derivative);
            }
            let mut grad_logits = probs.to_kind(weight.kind());
            let _ = grad_logits.g_mul_(&row_scale.to_kind(weight.kind()).unsqueeze(1));
            grad_logits
        };
        grad_inputs.push(grad_logits.matmul(weight));
        if weight_grad {
            grad_weight = Some(match grad_weight {
                None => grad_logits.tr().matmul(&h),
                Some(mut sum) => {
                    let _ = sum.addmm_(&grad_logits.tr(), &h);
                    sum
                }
            });
        }
        start += len;
    }
    // The last position predicts nothing: its gradient is zero.
    let grad_hidden = Tensor::cat(&grad_inputs, 0).view([batch, seq - 1, dim]);
    let grad_hidden = Tensor::cat(&[grad_hidden, hidden.zeros_like().narrow(1, 0, 1)], 1);
    let grad_weight = match (grad_weight, weight_grad) {
        (Some(sum), _) => sum,
        (None, true) => weight.zeros_like(),
        (None, false) => Tensor::new(),
    };
    Ok((loss, grad_hidden, grad_weight))
}


/// A causal LM's logits and loss on `ids` (labels = ids), and with
/// `with_grads` every parameter's gradient as `grad.<hf name>`, on the CPU
/// in fp32: what `ft forward` writes for comparison with a reference.
pub fn lm_inspection(model: &dyn Model, params: &[Vec<Tensor>], ids: &Tensor, dtype: Kind, with_grads: bool) -> Result<Vec<(String, Tensor)>> {
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

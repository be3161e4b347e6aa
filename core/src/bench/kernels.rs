//! ft's CUDA kernels beside ATen's ops on the same random inputs (`ft
//! bench --breakdown`): the LM head's loss and gradients and its labels'
//! log-probabilities without gradients (the model's vocabulary and width), AdamW (64M parameters), blockwise int8 (64M
//! values in the compute dtype, when a kernel serves it), the low-rank
//! products (a 64M-element matrix, rank 4), RoPE and SwiGLU forward and
//! backward, a bias gradient's column sums, LayerNorm forward and
//! backward and a 4-bit NF4 weight's dequantization (the model's shapes),
//! timed and compared.

use crate::dataset::Batch;
use crate::train::loss::{lm_head_loss_and_grads, lm_label_logps, TargetRows};
use crate::train::{Kernels, Trainer};
use anyhow::Result;
use serde::{Deserialize, Serialize};
use std::time::Instant;
use tch::{Kind, Tensor};

/// The comparison's times (ms per call) and differences.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct KernelCheck {
    pub head_ft_ms: f64,
    pub head_aten_ms: f64,
    /// |loss_ft − loss_aten| / |loss_aten|.
    pub head_loss_relative_diff: f64,
    /// max |g_ft − g_aten| / max |g_aten| over the hidden states' and the weight's gradients.
    pub head_grad_relative_diff: f64,
    pub adamw_ft_ms: f64,
    pub adamw_aten_ms: f64,
    /// max |p_ft − p_aten| / max |p_aten − p_before| after one step: the
    /// difference relative to the update itself.
    pub adamw_update_relative_diff: f64,
    /// Quantizing and dequantizing 64M values (`quantize.rs`), when ft's kernels serve the dtype.
    #[serde(default)]
    pub int8_ft_ms: Option<f64>,
    #[serde(default)]
    pub int8_aten_ms: Option<f64>,
    /// Int8 values, scales, dequantized values and two rows' sums that differ from ATen's (0: the same bits).
    #[serde(default)]
    pub int8_mismatches: Option<i64>,
    /// X Q, Xᵀ P and P Qᵀ with the residual (`lowrank.rs`) over a 65536 × 1024 fp32 X, rank 4, on a GPU.
    #[serde(default)]
    pub lowrank_ft_ms: Option<f64>,
    #[serde(default)]
    pub lowrank_aten_ms: Option<f64>,
    /// The largest of max |ft − ATen| / max |ATen| over P, Q, the expansion
    /// and the residual, and over the projector P̂P̂ᵀ onto P's columns
    /// orthonormalised by ft's kernel against Householder QR's.
    #[serde(default)]
    pub lowrank_relative_diff: Option<f64>,
    /// RoPE forward and backward over [batch, seq, heads, head_dim] of the
    /// model's shapes in the compute dtype (`model::rotary`).
    #[serde(default)]
    pub rope: Option<Compared>,
    /// SwiGLU's gating forward and backward over [batch, seq, intermediate]
    /// (`model::swiglu`).
    #[serde(default)]
    pub swiglu: Option<Compared>,
    /// A linear layer's bias gradient: the column sums of a [batch · seq,
    /// intermediate] gradient (`kernels::column_sum`).
    #[serde(default)]
    pub bias_grad: Option<Compared>,
    /// LayerNorm forward and backward over [batch, seq, hidden]
    /// (`ft_sys::layer_norm` against ATen's layer_norm).
    #[serde(default)]
    pub layer_norm: Option<Compared>,
    /// An [intermediate, hidden] weight in NF4 with double quantization
    /// (QLoRA's base, `nf4.rs`) dequantized into the compute dtype.
    #[serde(default)]
    pub nf4_dequantize: Option<Compared>,
    /// The head's log-probability of each label, without gradients (DPO's
    /// sums; `lm_label_logps`), on the batch's labels.
    #[serde(default)]
    pub label_logps: Option<Compared>,
    /// A mixture of experts' SwiGLU over its fused gate-and-up rows, forward
    /// and backward, over [batch · seq · k, 2 · intermediate]
    /// (`model::swiglu_halves`).
    #[serde(default)]
    pub expert_swiglu: Option<Compared>,
    /// A mixture of experts' combine of [batch · seq · k, hidden] rows into
    /// its tokens, forward and backward (`model::combine_experts`).
    #[serde(default)]
    pub expert_combine: Option<Compared>,
    /// Decoding's attention: one query per row and head over a KV cache of
    /// 32 rows and 576 slots, the first 16 hidden as left padding and the
    /// last 256 as not yet written (`model::decode_attention`).
    #[serde(default)]
    pub decode_attention: Option<Compared>,
    /// Decoding's RoPE and cache write: a step's queries, keys and values
    /// (views of one joined projection) rotated and written at a slot of a
    /// cache of the same shape (`KvCache::rotate_and_extend`); ATen's side
    /// is ATen's RoPE and `index_copy_`.
    #[serde(default)]
    pub rope_cache: Option<Compared>,
}

/// One of ft's kernels beside ATen's ops on the same inputs, in the compute
/// dtype: ms per call each way and max |ft − ATen| / max |ATen| over every
/// output (the outputs and, for a forward with backward, the gradients).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Compared {
    pub ft_ms: f64,
    pub aten_ms: f64,
    pub relative_diff: f64,
}

impl KernelCheck {
    /// The comparisons, for the row's log line.
    pub fn describe(&self) -> String {
        let mut line = format!(
            "; LM head: ft {:.2} ms vs ATen {:.2} (loss differs by {:.1e}, gradients by {:.1e}); AdamW over 64M: ft {:.2} ms vs ATen {:.2} (update differs by {:.1e})",
            self.head_ft_ms, self.head_aten_ms, self.head_loss_relative_diff, self.head_grad_relative_diff, self.adamw_ft_ms, self.adamw_aten_ms, self.adamw_update_relative_diff
        );
        if let (Some(ft), Some(aten), Some(mismatches)) = (self.int8_ft_ms, self.int8_aten_ms, self.int8_mismatches) {
            line += &format!("; int8 round trip over 64M: ft {ft:.2} ms vs ATen {aten:.2} ({mismatches} values differ)");
        }
        if let (Some(ft), Some(aten), Some(diff)) = (self.lowrank_ft_ms, self.lowrank_aten_ms, self.lowrank_relative_diff) {
            line += &format!("; low-rank products over 64M: ft {ft:.2} ms vs ATen {aten:.2} (differ by {diff:.1e})");
        }
        let compared = [("RoPE forward+backward", &self.rope), ("SwiGLU forward+backward", &self.swiglu), ("bias gradient", &self.bias_grad), ("LayerNorm forward+backward", &self.layer_norm), ("NF4 dequantization", &self.nf4_dequantize), ("label log-probabilities", &self.label_logps), ("experts' SwiGLU forward+backward", &self.expert_swiglu), ("experts' combine forward+backward", &self.expert_combine), ("decoding attention", &self.decode_attention), ("decoding's RoPE and cache write", &self.rope_cache)];
        for (what, c) in compared {
            if let Some(Compared { ft_ms, aten_ms, relative_diff }) = c {
                line += &format!("; {what}: ft {ft_ms:.3} ms vs ATen {aten_ms:.3} (differ by {relative_diff:.1e})");
            }
        }
        line
    }
}

/// Times ft's kernels and ATen's on the same random inputs and compares
/// their results.
pub(super) fn check(trainer: &Trainer, batch: &Batch, normalizer: f64, chunk_tokens: i64) -> Result<KernelCheck> {
    let ids = &batch.inputs.input_ids;
    let device = ids.device();
    const REPEATS: usize = 5;
    let timed = |run: &mut dyn FnMut() -> Result<()>| -> Result<f64> {
        run()?;
        super::synchronize(device);
        let start = Instant::now();
        for _ in 0..REPEATS {
            run()?;
        }
        super::synchronize(device);
        Ok(start.elapsed().as_secs_f64() / REPEATS as f64 * 1e3)
    };
    let relative = |a: &Tensor, b: &Tensor, scale: &Tensor| {
        let (a, b) = (a.to_kind(Kind::Float), b.to_kind(Kind::Float));
        (a - &b).abs().max().double_value(&[]) / scale.abs().max().double_value(&[]).max(f64::MIN_POSITIVE)
    };

    // Random hidden states and head weight of the model's shapes, in the compute dtype.
    let dims = trainer.model().dims();
    let (rows, seq, dtype) = (ids.size()[0], ids.size()[1], trainer.units()[0].compute_kind());
    let hidden = Tensor::randn([rows, seq, dims.hidden], (dtype, device));
    let weight = Tensor::randn([dims.vocab, dims.hidden], (dtype, device)) * 0.02;
    let head = |kernels| lm_head_loss_and_grads(&hidden, &weight, ids, normalizer, chunk_tokens, None, kernels, true, None);
    let head_ft_ms = timed(&mut || head(Kernels::Ft).map(drop))?;
    let head_aten_ms = timed(&mut || head(Kernels::Aten).map(drop))?;
    let ((ft_loss, ft_hidden, ft_weight), (aten_loss, aten_hidden, aten_weight)) = (head(Kernels::Ft)?, head(Kernels::Aten)?);

    let hyper = crate::AdamW { lr: 1e-3, beta1: 0.9, beta2: 0.999, weight_decay: 0.01, eps: 1e-8 };
    let numel = 64 << 20;
    let [grad, exp_avg, exp_avg_sq] = [1.0, 0.1, 0.01].map(|std| (Tensor::randn([numel], (Kind::Float, device)) * std).abs_());
    let param = Tensor::randn([numel], (Kind::Float, device));
    let (step, grad_scale) = (Tensor::from(1f32).to_device(device), Tensor::from(2f32).to_device(device));
    let fresh = || [&param, &exp_avg, &exp_avg_sq].map(Tensor::copy);
    let ft_step = |[p, m, v]: &[Tensor; 3]| crate::kernels::adamw_(p, &grad, m, v, hyper, &step, Some(&grad_scale), None, None).map_err(anyhow::Error::msg);
    // ATen writes the unscaled gradient back into `grad`: it gets its own copy.
    let aten_step = |[p, m, v]: &[Tensor; 3], grad: &Tensor| {
        crate::fused_adamw(&[p], &[grad], &[m], &[v], &[&step], hyper, Some(&grad_scale), None).map_err(anyhow::Error::msg)
    };
    let (ft_state, aten_state, aten_grad) = (fresh(), fresh(), grad.copy());
    let adamw_ft_ms = timed(&mut || ft_step(&ft_state))?;
    let adamw_aten_ms = timed(&mut || aten_step(&aten_state, &aten_grad))?;
    // One step each from the same state, for the comparison.
    let (ft_state, aten_state) = (fresh(), fresh());
    ft_step(&ft_state)?;
    aten_step(&aten_state, &grad.copy())?;
    let (ft_param, aten_param) = (&ft_state[0], &aten_state[0]);

    let (mut int8_ft_ms, mut int8_aten_ms, mut int8_mismatches) = (None, None, None);
    if crate::quantize::kernels_serve(device, dtype) {
        let values = Tensor::randn([numel], (dtype, device)) * Tensor::logspace(-3.0, 1.0, numel, 10.0, (Kind::Float, device));
        let values = values.to_kind(dtype);
        let round_trip = |fused: bool| -> Result<(crate::quantize::Quantized, Tensor)> {
            let quantized = crate::quantize::quantize_with(&values, 1, 4096, fused)?;
            let back = values.empty_like();
            quantized.dequantize_with(&back, false, fused)?;
            Ok((quantized, back))
        };
        int8_ft_ms = Some(timed(&mut || round_trip(true).map(drop))?);
        int8_aten_ms = Some(timed(&mut || round_trip(false).map(drop))?);
        let ((ft, ft_back), (aten, aten_back)) = (round_trip(true)?, round_trip(false)?);
        // qgZ's side: the values as two rows, summed.
        let row_sum = |fused: bool| -> Result<Tensor> {
            let sum = Tensor::empty([numel / 2], (Kind::Float, device));
            crate::quantize::quantize_with(&values, 2, 4096, fused)?.dequantize_with(&sum, true, fused)?;
            Ok(sum)
        };
        let differ = |a: &Tensor, b: &Tensor| a.to_kind(Kind::Float).ne_tensor(&b.to_kind(Kind::Float)).sum(Kind::Int64).int64_value(&[]);
        int8_mismatches = Some(differ(&ft.q, &aten.q) + differ(&ft.scales, &aten.scales) + differ(&ft_back, &aten_back) + differ(&row_sum(true)?, &row_sum(false)?));
    }

    let (mut lowrank_ft_ms, mut lowrank_aten_ms, mut lowrank_relative_diff) = (None, None, None);
    if crate::kernels::available(device).is_ok() {
        let (rows, cols, rank) = (65_536, 1024, 4);
        let x = Tensor::randn([rows, cols], (Kind::Float, device));
        let q = Tensor::randn([cols, rank], (Kind::Float, device));
        // P, Q, the expansion and the residual X − P Qᵀ / 2.
        let products = |fused: bool| -> Result<[Tensor; 4]> {
            let (mut x, mut p, mut q_back) = (x.copy(), Tensor::empty([rows, rank], (Kind::Float, device)), q.empty_like());
            let mut out = x.empty_like();
            if fused {
                crate::kernels::lowrank_project(None, &mut x, &q, &mut p)?;
                crate::kernels::lowrank_project_t(&x, &p, &mut q_back)?;
                crate::kernels::lowrank_expand(&p, &q_back, &mut out, Some(&mut x), 2.0)?;
            } else {
                let _ = x.f_mm_out(&p, &q)?;
                let _ = x.tr().f_mm_out(&q_back, &p)?;
                let _ = p.f_mm_out(&out, &q_back.tr())?;
                let _ = x.f_sub_(&(&out / 2.0))?;
            }
            Ok([p, q_back, out, x])
        };
        lowrank_ft_ms = Some(timed(&mut || products(true).map(drop))?);
        lowrank_aten_ms = Some(timed(&mut || products(false).map(drop))?);
        let (ft, aten) = (products(true)?, products(false)?);
        // P's columns made orthonormal: the same projector either way.
        let p = &aten[0];
        let ours = p.copy().reshape([-1]);
        crate::lowrank::orthonormalize(&ours, &crate::lowrank::Factors::new(vec![[0, rows, rank]], device))?;
        let ours = ours.view([rows, rank]);
        let (householder, _) = Tensor::linalg_qr(p, "reduced");
        let projector = |basis: &Tensor| basis.mm(&basis.tr().mm(&x.narrow(1, 0, rank)));
        let projected = relative(&projector(&ours), &projector(&householder), &projector(&householder));
        lowrank_relative_diff = Some(ft.iter().zip(&aten).map(|(a, b)| relative(a, b, b)).fold(projected, f64::max));
    }
    // Each comparison runs `outputs(true)` (ft's kernel) and `outputs(false)` (ATen's ops).
    let compare = |outputs: &dyn Fn(bool) -> Result<Vec<Tensor>>| -> Result<Compared> {
        let ft_ms = timed(&mut || outputs(true).map(drop))?;
        let aten_ms = timed(&mut || outputs(false).map(drop))?;
        let (ft, aten) = (outputs(true)?, outputs(false)?);
        Ok(Compared { ft_ms, aten_ms, relative_diff: ft.iter().zip(&aten).map(|(a, b)| relative(a, b, b)).fold(0.0, f64::max) })
    };
    // Backward seeded with a random gradient (the adjoint exercised fully);
    // the outputs are the forward's and each input's gradient.
    let with_grads = |y: Tensor, grad: &Tensor, inputs: &[&Tensor]| -> Result<Vec<Tensor>> {
        ft_sys::backward(&[&y], &[grad]).map_err(anyhow::Error::msg)?;
        let mut outputs = vec![y.detach()];
        for input in inputs {
            outputs.push(input.grad().copy());
            ft_sys::clear_grad(input).map_err(anyhow::Error::msg)?;
        }
        Ok(outputs)
    };
    let (mut rope, mut swiglu, mut bias_grad, mut layer_norm, mut nf4_dequantize, mut label_logps) = (None, None, None, None, None, None);
    let (mut expert_swiglu, mut expert_combine, mut decode_attention, mut rope_cache) = (None, None, None, None);
    if crate::kernels::available(device).is_ok() {
        let kernels = |fused| if fused { Kernels::Ft } else { Kernels::Aten };
        label_logps = Some(compare(&|fused| Ok(vec![lm_label_logps(&TargetRows::of(&hidden, ids)?, &weight, chunk_tokens, None, kernels(fused))?]))?);
        let leaf = |shape: &[i64]| Tensor::randn(shape, (dtype, device)).set_requires_grad(true);
        if dims.hidden % (2 * dims.heads) == 0 {
            let shape = [rows, seq, dims.heads, dims.hidden / dims.heads];
            let (x, grad) = (leaf(&shape), Tensor::randn(shape, (dtype, device)));
            let angles = Tensor::rand([rows, seq, 1, shape[3]], (Kind::Float, device)) * 100.0;
            let (cos, sin) = (angles.cos().to_kind(dtype), angles.sin().to_kind(dtype));
            rope = Some(compare(&|fused| with_grads(crate::model::rotary_with(&x, &cos, &sin, fused), &grad, &[&x]))?);
        }
        let shape = [rows, seq, dims.intermediate];
        let (gate, up, grad) = (leaf(&shape), leaf(&shape), Tensor::randn(shape, (dtype, device)));
        swiglu = Some(compare(&|fused| with_grads(ft_sys::swiglu(&gate, &up, fused).map_err(anyhow::Error::msg)?, &grad, &[&gate, &up]))?);
        let rows_grad = grad.view([rows * seq, dims.intermediate]);
        bias_grad = Some(compare(&|fused| {
            if !fused {
                return Ok(vec![rows_grad.sum_dim_intlist(0, false, dtype)]);
            }
            let mut out = Tensor::empty([dims.intermediate], (dtype, device));
            crate::kernels::column_sum(&rows_grad, None, &mut out)?;
            Ok(vec![out])
        })?);
        let shape = [rows, seq, dims.hidden];
        let (x, grad) = (leaf(&shape), Tensor::randn(shape, (dtype, device)));
        let [weight, bias] = [1.0, 0.0].map(|mean| (Tensor::randn([dims.hidden], (dtype, device)) * 0.1 + mean).set_requires_grad(true));
        layer_norm = Some(compare(&|fused| {
            let y = match fused {
                true => ft_sys::layer_norm(&x, &weight, &bias, 1e-5).map_err(anyhow::Error::msg)?,
                false => x.layer_norm([dims.hidden], Some(&weight), Some(&bias), 1e-5, true),
            };
            with_grads(y, &grad, &[&x, &weight, &bias])
        })?);
        if let Some(experts) = trainer.model().experts() {
            // Each token's k assignments, in a random order as sorting by expert leaves them.
            let (tokens, k) = (rows * seq, experts.per_token);
            let assignments = leaf(&[tokens * k, 2 * dims.intermediate]);
            let grad = Tensor::randn([tokens * k, dims.intermediate], (dtype, device));
            expert_swiglu = Some(compare(&|fused| with_grads(ft_sys::swiglu_halves(&assignments, fused).map_err(anyhow::Error::msg)?, &grad, &[&assignments]))?);
            let outputs = leaf(&[tokens * k, dims.hidden]);
            let weights = Tensor::rand([tokens, k], (Kind::Float, device)).set_requires_grad(true);
            let at = Tensor::randperm(tokens * k, (Kind::Int64, device));
            let grad = Tensor::randn([tokens, dims.hidden], (dtype, device));
            expert_combine = Some(compare(&|fused| with_grads(ft_sys::combine(&outputs, &weights, &at, fused).map_err(anyhow::Error::msg)?, &grad, &[&outputs, &weights]))?);
        }
        let (kv_heads, head_dim) = (dims.kv_heads, dims.hidden / dims.heads);
        if crate::kernels::DECODE_HEAD_DIMS.contains(&head_dim) && dims.heads % kv_heads == 0 && dims.heads / kv_heads <= crate::kernels::DECODE_MAX_GROUPS {
            // Online RL's rollout halfway: 32 rows, a cache of 64 prompt and 512 completion slots, 16 of them padding, the last 256 not written yet.
            let (rows, capacity) = (32, 576);
            let q = Tensor::randn([rows, dims.heads, 1, head_dim], (dtype, device));
            let [k, v] = [0; 2].map(|_| Tensor::randn([rows, kv_heads, capacity, head_dim], (dtype, device)));
            let slots = Tensor::arange(capacity, (Kind::Int64, device));
            let hidden = slots.lt(16).logical_or(&slots.ge(capacity - 256)).view([1, 1, 1, capacity]).expand([rows, 1, 1, capacity], false);
            let bias = Tensor::zeros([rows, 1, 1, capacity], (dtype, device)).masked_fill(&hidden, f64::NEG_INFINITY);
            let grouped = kv_heads != dims.heads;
            decode_attention = Some(compare(&|fused| Ok(vec![crate::model::decode_attention(&q, &k, &v, Some(&bias), grouped, None, fused)]))?);
            // The step's queries, keys and values as views of one joined projection, rotated and written at slot 300.
            let joined = Tensor::randn([rows, 1, (dims.heads + 2 * kv_heads) * head_dim], (dtype, device));
            let view = |start: i64, heads: i64| joined.narrow(2, start * head_dim, heads * head_dim).view([rows, 1, heads, head_dim]);
            let (q, k, v) = (view(0, dims.heads), view(dims.heads, kv_heads), view(dims.heads + kv_heads, kv_heads));
            let angles = Tensor::rand([rows, 1, 1, head_dim], (Kind::Float, device)) * 100.0;
            let (cos, sin) = (angles.cos().to_kind(dtype), angles.sin().to_kind(dtype));
            // Both paths' caches start from the same 64 prompt positions.
            let prompt = [0; 2].map(|_| Tensor::randn([rows, kv_heads, 64, head_dim], (dtype, device)));
            let cache = || -> Result<std::cell::RefCell<crate::model::KvCache>> {
                let mut cache = crate::model::KvCache::with_capacity(capacity);
                let _ = cache.extend(prompt[0].copy(), prompt[1].copy());
                cache.fix_shapes(&Tensor::from_slice(&[300i64]).to_device(device))?;
                Ok(std::cell::RefCell::new(cache))
            };
            let caches = [cache()?, cache()?];
            let rotate = |x: &Tensor| crate::model::rotary_with(x, &cos, &sin, false);
            let _no_grad = tch::no_grad_guard();
            rope_cache = Some(compare(&|fused| Ok(caches[usize::from(fused)].borrow_mut().rotate_and_extend_with(&q, &k, &v, (&cos, &sin), rotate, fused).into()))?);
        }
        let weight = Tensor::randn([dims.intermediate, dims.hidden], (dtype, device)) * 0.02;
        let quantized = crate::nf4::quantize(&weight, crate::nf4::QuantType::Nf4, crate::nf4::DEFAULT_BLOCKSIZE, true)?;
        nf4_dequantize = Some(compare(&|fused| {
            let out = Tensor::empty([dims.intermediate * dims.hidden], (dtype, device));
            quantized.dequantize_with(&out, fused);
            Ok(vec![out])
        })?);
    }
    Ok(KernelCheck {
        head_ft_ms,
        head_aten_ms,
        head_loss_relative_diff: relative(&ft_loss, &aten_loss, &aten_loss),
        head_grad_relative_diff: relative(&ft_hidden, &aten_hidden, &aten_hidden).max(relative(&ft_weight, &aten_weight, &aten_weight)),
        adamw_ft_ms,
        adamw_aten_ms,
        adamw_update_relative_diff: relative(ft_param, aten_param, &(aten_param - &param)),
        int8_ft_ms,
        int8_aten_ms,
        int8_mismatches,
        lowrank_ft_ms,
        lowrank_aten_ms,
        lowrank_relative_diff,
        rope,
        swiglu,
        bias_grad,
        layer_norm,
        nf4_dequantize,
        label_logps,
        expert_swiglu,
        expert_combine,
        decode_attention,
        rope_cache,
    })
}


//! ft's CUDA kernels beside ATen's ops on the same random inputs (`ft
//! bench --breakdown`): the LM head's loss and gradients (the model's
//! vocabulary and width), AdamW (64M parameters) and blockwise int8 (64M
//! values in the compute dtype, when a kernel serves it), timed and compared.

use crate::dataset::Batch;
use crate::train::loss::lm_head_loss_and_grads;
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
    /// Int8 values, scales and dequantized values that differ from ATen's (0: the same bits).
    #[serde(default)]
    pub int8_mismatches: Option<i64>,
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
    let head = |kernels| lm_head_loss_and_grads(&hidden, &weight, ids, normalizer, chunk_tokens, None, kernels, true);
    let head_ft_ms = timed(&mut || head(Kernels::Ft).map(drop))?;
    let head_aten_ms = timed(&mut || head(Kernels::Aten).map(drop))?;
    let ((ft_loss, ft_hidden, ft_weight), (aten_loss, aten_hidden, aten_weight)) = (head(Kernels::Ft)?, head(Kernels::Aten)?);

    let hyper = crate::AdamW { lr: 1e-3, beta1: 0.9, beta2: 0.999, weight_decay: 0.01, eps: 1e-8 };
    let numel = 64 << 20;
    let [grad, exp_avg, exp_avg_sq] = [1.0, 0.1, 0.01].map(|std| (Tensor::randn([numel], (Kind::Float, device)) * std).abs_());
    let param = Tensor::randn([numel], (Kind::Float, device));
    let (step, grad_scale) = (Tensor::from(1f32).to_device(device), Tensor::from(2f32).to_device(device));
    let fresh = || [&param, &exp_avg, &exp_avg_sq].map(Tensor::copy);
    let ft_step = |[p, m, v]: &[Tensor; 3]| crate::kernels::adamw_(p, &grad, m, v, hyper, &step, Some(&grad_scale), None).map_err(anyhow::Error::msg);
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
        let differ = |a: &Tensor, b: &Tensor| a.to_kind(Kind::Float).ne_tensor(&b.to_kind(Kind::Float)).sum(Kind::Int64).int64_value(&[]);
        int8_mismatches = Some(differ(&ft.q, &aten.q) + differ(&ft.scales, &aten.scales) + differ(&ft_back, &aten_back));
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
    })
}


//! `ft calibrate`: a short self-test that measures on this machine the
//! rates `time.rs` otherwise takes from tables — the GEMM rate of each shape
//! class a model's step runs (its blocks' linear layers and its LM head at
//! the planned tokens per step, forward and both backward products, in the
//! compute dtype on the compute device), each host offload's optimizer rate
//! (its own `Offload::adamw` and gradient norm over its own buffers, on all
//! the host's cores) and, on a GPU, the pinned host↔device copy rate each
//! way. `ft plan --calibration` and `ft bench --plan-check --calibration`
//! read the file it writes ([`Cluster::use_calibration`]).

use super::{Cluster, Workload};
use crate::device::synchronize;
use crate::gpu;
use crate::model::Model;
use crate::registry::Registry;
use crate::AdamW;
use anyhow::{bail, Context, Result};
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;
use std::time::Instant;
use tch::{Device, Kind, Tensor};

/// The calibration file's format; a file of another is refused.
pub const CALIBRATION_VERSION: u32 = 1;

/// Bytes the memory-bound kernels of a block move per token and hidden
/// unit in a training step (norms, activations, dropout, residual adds,
/// bias gradients, the copies between them; forward and backward), at the
/// GPU's memory bandwidth; and per token and vocabulary entry, the LM
/// head's loss over its logits. The GEMMs' own rates are measured; these
/// two are fitted to the step time left over besides them and AdamW in
/// BLOOM-560m and OPT-1.3B at 8 × 512 on one H100
/// (bench/results/2026-11-25-h100-single-gpu.md), the two models
/// apart in hidden size (1024, 2048) and vocabulary (250880, 50272).
pub const BLOCK_BYTES_PER_TOKEN_AND_HIDDEN: f64 = 320.0;
pub const HEAD_BYTES_PER_TOKEN_AND_VOCAB: f64 = 28.0;

/// How long each measurement is timed for (after one warm-up run).
const TIMED_SECONDS: f64 = 0.25;

/// Bytes each host↔device copy moves: far past where a copy's fixed cost matters.
const TRANSFER_BYTES: i64 = 256 << 20;

/// What `ft calibrate` measured.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Calibration {
    pub version: u32,
    /// The device measured on: the name NVML reports, or "cpu".
    pub device: String,
    /// The compute dtype the GEMMs ran in (tch's name: "BFloat16").
    pub dtype: String,
    /// Each host offload's optimizer step (gradient norm and AdamW) over
    /// the whole host's cores, in elements per second, by offload name.
    pub host_optimizer_elements_per_second: BTreeMap<String, f64>,
    /// Pinned host memory to the device and back, bytes per second; None on a CPU.
    pub host_to_device_bytes_per_second: Option<f64>,
    pub device_to_host_bytes_per_second: Option<f64>,
    pub gemms: Vec<GemmRate>,
}

/// One GEMM shape class: `[m, k] × [k, n]` forward, and backward's two
/// products of the same FLOPs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
pub struct Gemm {
    /// Tokens.
    pub m: i64,
    /// Output features.
    pub n: i64,
    /// Input features.
    pub k: i64,
}

#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct GemmRate {
    #[serde(flatten)]
    pub gemm: Gemm,
    pub flops_per_second: f64,
    /// With `ft calibrate --fp8`, for a block layer's shape: its rate as a
    /// float8 linear layer (tensorwise, casts included), the compute
    /// dtype's `flops_per_second` scaled by the two layers' time ratio.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub float8_flops_per_second: Option<f64>,
}

/// What to measure.
pub struct CalibrateOptions<'a> {
    /// The models whose shape classes are measured.
    pub models: &'a [&'a dyn Model],
    /// Tokens per micro-batch (batch × seq).
    pub tokens: i64,
    pub loss_chunk_tokens: i64,
    pub dtype: Kind,
    pub device: Device,
    /// Elements of each host optimizer buffer (four of them: master, gradient, two moments).
    pub host_elements: i64,
    /// Also time the block layers' shapes in float8 (a GPU of compute capability 8.9+).
    pub float8: bool,
}

/// `model`'s GEMM shape classes at `tokens` per micro-batch and the
/// training FLOPs of each: every 2-D weight of a block (counted over the
/// blocks), and the LM head's logits `loss_chunk_tokens` at a time, which
/// carries the FLOPs the 6N count gives the units outside the blocks.
fn gemm_classes(model: &dyn Model, tokens: i64, loss_chunk_tokens: i64) -> BTreeMap<Gemm, f64> {
    let blocks: BTreeSet<usize> = crate::model::block_units(model).collect();
    let mut classes = BTreeMap::new();
    let mut outside = 0;
    for (u, unit) in model.units().iter().enumerate() {
        if !blocks.contains(&u) {
            outside += unit.numel();
            continue;
        }
        for param in unit.params.iter().filter(|p| p.shape.len() == 2) {
            let gemm = Gemm { m: tokens, n: param.shape[0], k: param.shape[1] };
            *classes.entry(gemm).or_default() += 6.0 * (tokens * param.numel()) as f64;
        }
    }
    let dims = model.dims();
    let chunk = if loss_chunk_tokens > 0 { tokens.min(loss_chunk_tokens) } else { tokens };
    *classes.entry(Gemm { m: chunk, n: dims.vocab, k: dims.hidden }).or_default() += 6.0 * (tokens * outside) as f64;
    classes
}

/// Seconds one `run` takes on `device`: one warm-up run (allocations,
/// cuBLAS's choice of kernel), one timed alone to size the batch, then
/// as many as fill [`TIMED_SECONDS`], timed together so no per-run
/// synchronisation is counted.
fn seconds_per_run(device: Device, mut run: impl FnMut() -> Result<()>) -> Result<f64> {
    run()?;
    synchronize(device);
    let start = Instant::now();
    run()?;
    synchronize(device);
    let once = start.elapsed().as_secs_f64();
    let runs = (TIMED_SECONDS / once.max(1e-9)).ceil().clamp(3.0, 10_000.0) as usize;
    let start = Instant::now();
    for _ in 0..runs {
        run()?;
    }
    synchronize(device);
    Ok(start.elapsed().as_secs_f64() / runs as f64)
}

/// How much faster `gemm`'s shape runs as a float8 linear layer than as
/// one in `dtype` (forward and backward through autograd both, casts
/// included): the compute dtype's time over float8's.
fn float8_speedup(gemm: Gemm, dtype: Kind, device: Device) -> Result<f64> {
    let Gemm { m, n, k } = gemm;
    let options = (dtype, device);
    let (x, weight, grad) = (Tensor::f_randn([m, k], options)?.set_requires_grad(true), Tensor::f_randn([n, k], options)?.set_requires_grad(true), Tensor::f_randn([m, n], options)?);
    let float8 = ft_sys::float8::Float8 { recipe: ft_sys::float8::Recipe::Tensorwise, emulate: false };
    let fused = crate::kernels::Kernels::loaded(device);
    let time = |linear: &dyn Fn() -> Result<Tensor>| {
        seconds_per_run(device, || {
            // d(Σ out·grad)/d out is `grad`: the same two backward GEMMs.
            (linear()? * &grad).sum(dtype).backward();
            Ok(())
        })
    };
    let plain = time(&|| Ok(x.linear::<Tensor>(&weight, None)))?;
    let in_float8 = time(&|| Ok(ft_sys::float8::linear(&x, &weight, float8, fused, 0)?))?;
    Ok(plain / in_float8)
}

/// FLOP/s of `gemm`'s forward and backward products.
fn gemm_rate(gemm: Gemm, dtype: Kind, device: Device) -> Result<f64> {
    let Gemm { m, n, k } = gemm;
    let options = (dtype, device);
    let (x, weight, grad) = (Tensor::f_randn([m, k], options)?, Tensor::f_randn([n, k], options)?, Tensor::f_randn([m, n], options)?);
    let seconds = seconds_per_run(device, || {
        // Forward, the input's gradient, the weight's gradient: only their time matters.
        let _ = (x.f_matmul(&weight.tr())?, grad.f_matmul(&weight)?, grad.tr().f_matmul(&x)?);
        Ok(())
    })?;
    Ok(6.0 * (m * n * k) as f64 / seconds)
}

/// Elements per second `offload` steps: its gradient norm and AdamW over
/// buffers it stores itself (pinned where the run's would be).
fn host_optimizer_rate(offload: &dyn crate::offload::Offload, elements: i64, device: Device) -> Result<f64> {
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    offload.use_cores(cores);
    let values = Tensor::f_rand([elements], (Kind::Float, Device::Cpu))?;
    let store = || offload.store(&values, device);
    let parts = [[store()?, store()?, store()?, store()?]];
    let hyper = AdamW { lr: 1e-5, beta1: 0.9, beta2: 0.999, weight_decay: 0.01, eps: 1e-8 };
    let mut step = 0.0;
    let seconds = seconds_per_run(Device::Cpu, || {
        step += 1.0;
        offload.sum_of_squares(&parts[0][1])?;
        offload.adamw(&parts, hyper, step, 1.0)
    })?;
    Ok(elements as f64 / seconds)
}

/// Bytes per second from pinned host memory to `device` and back.
fn transfer_rates(device: Device) -> Result<(f64, f64)> {
    let elements = TRANSFER_BYTES / 4;
    let host = ft_sys::pin_memory_exact(&Tensor::f_zeros([elements], (Kind::Float, Device::Cpu))?)?;
    let mut host_copy = host.shallow_clone();
    let mut on_device = Tensor::f_zeros([elements], (Kind::Float, device))?;
    let up = seconds_per_run(device, || Ok(on_device.f_copy_(&host)?))?;
    let down = seconds_per_run(device, || Ok(host_copy.f_copy_(&on_device)?))?;
    Ok((TRANSFER_BYTES as f64 / up, TRANSFER_BYTES as f64 / down))
}

/// Measures what `options` asks for on this machine.
pub fn calibrate(options: &CalibrateOptions, registry: &Registry) -> Result<Calibration> {
    if options.tokens < 1 || options.host_elements < 1 {
        bail!("calibrate at least one token and one host optimizer element");
    }
    if options.float8 {
        crate::train::float8_serves(ft_sys::float8::Float8 { recipe: ft_sys::float8::Recipe::Tensorwise, emulate: false }, options.device)
            .context("ft calibrate --fp8 times float8 GEMMs")?;
    }
    let (mut classes, mut block_shapes) = (BTreeSet::new(), BTreeSet::new());
    for model in options.models {
        classes.extend(gemm_classes(*model, options.tokens, options.loss_chunk_tokens).into_keys());
        block_shapes.extend(crate::train::block_weight_shapes(*model));
    }
    let mut gemms = vec![];
    for gemm in classes {
        let what = || format!("timing a {}x{}x{} GEMM", gemm.m, gemm.n, gemm.k);
        let rate = gemm_rate(gemm, options.dtype, options.device).with_context(what)?;
        let in_float8 = options.float8 && block_shapes.contains(&[gemm.n, gemm.k]) && gemm.n % 16 == 0 && gemm.k % 16 == 0;
        let float8_rate = match in_float8 {
            true => Some(rate * float8_speedup(gemm, options.dtype, options.device).with_context(|| format!("{} in float8", what()))?),
            false => None,
        };
        gemms.push(GemmRate { gemm, flops_per_second: rate, float8_flops_per_second: float8_rate });
    }
    let mut host_optimizer_elements_per_second = BTreeMap::new();
    for registration in registry.offloads() {
        let offload = (registration.create)();
        if offload.to_host() {
            let rate = host_optimizer_rate(offload.as_ref(), options.host_elements, options.device)
                .with_context(|| format!("timing offload {}'s optimizer", registration.name))?;
            host_optimizer_elements_per_second.insert(registration.name.to_string(), rate);
        }
    }
    let (device, links) = match options.device {
        Device::Cuda(index) => {
            let name = gpu::local_gpu(index).map_or_else(|| format!("cuda:{index}"), |(name, _)| name);
            (name, Some(transfer_rates(options.device)?))
        }
        _ => ("cpu".to_string(), None),
    };
    Ok(Calibration {
        version: CALIBRATION_VERSION,
        device,
        dtype: format!("{:?}", options.dtype),
        host_optimizer_elements_per_second,
        host_to_device_bytes_per_second: links.map(|(up, _)| up),
        device_to_host_bytes_per_second: links.map(|(_, down)| down),
        gemms,
    })
}

impl Calibration {
    /// Reads a file `ft calibrate` wrote; every error names the file and what to do.
    pub fn load(path: &Path) -> Result<Calibration> {
        let redo = "make it again with `ft calibrate`";
        let text = std::fs::read_to_string(path).with_context(|| format!("cannot read the calibration file {}: {redo}", path.display()))?;
        // The version first, so that another format is named as such rather than by a field it lacks.
        #[derive(Deserialize)]
        struct Versioned {
            version: u32,
        }
        let versioned: Versioned = serde_json::from_str(&text).with_context(|| format!("{} is not an `ft calibrate` file (JSON with its \"version\"): {redo}", path.display()))?;
        if versioned.version != CALIBRATION_VERSION {
            bail!("{} is calibration format {}, this ft reads format {CALIBRATION_VERSION}: {redo}", path.display(), versioned.version);
        }
        let calibration: Calibration = serde_json::from_str(&text).with_context(|| format!("{} is not a valid `ft calibrate` file: {redo}", path.display()))?;
        let rates = calibration.gemms.iter().flat_map(|g| [Some(g.flops_per_second), g.float8_flops_per_second]).flatten();
        let rates = rates.chain(calibration.host_optimizer_elements_per_second.values().copied());
        let links = [calibration.host_to_device_bytes_per_second, calibration.device_to_host_bytes_per_second];
        if rates.chain(links.into_iter().flatten()).any(|rate| !(rate.is_finite() && rate > 0.0)) {
            bail!("{} holds a rate that is not a positive number: {redo}", path.display());
        }
        Ok(calibration)
    }

    /// What was measured, a line each.
    pub fn summary(&self) -> String {
        let mut out = format!("ft calibrate on {} ({}):\n", self.device, self.dtype);
        for g in &self.gemms {
            out += &format!("  GEMM {:>6} x {:>6} x {:>6}: {:>9.3} TFLOP/s", g.gemm.m, g.gemm.n, g.gemm.k, g.flops_per_second / 1e12);
            if let Some(float8) = g.float8_flops_per_second {
                let verdict = if float8 > g.flops_per_second { "float8" } else { "stays in the compute dtype" };
                out += &format!(", as a float8 layer {:.2}x: {verdict}", float8 / g.flops_per_second);
            }
            out += "\n";
        }
        for (offload, rate) in &self.host_optimizer_elements_per_second {
            out += &format!("  host optimizer of offload {offload}: {:.2} G elements/s\n", rate / 1e9);
        }
        out += &match (self.host_to_device_bytes_per_second, self.device_to_host_bytes_per_second) {
            (Some(up), Some(down)) => format!("  pinned host to device {:.1} GB/s, device to host {:.1} GB/s\n", up / 1e9, down / 1e9),
            _ => "  host link: no device here; plans keep the GPU table's rate\n".into(),
        };
        out
    }

    /// The block weight shapes [out, in] of `model` that float8 does not
    /// speed up at `tokens` per micro-batch (their class at the measured
    /// token count nearest it): what a run with this file as
    /// `train.fp8_calibration` keeps in the compute dtype.
    pub fn float8_kept(&self, model: &dyn Model, tokens: i64, path: &Path) -> Result<BTreeSet<[i64; 2]>> {
        let mut kept = BTreeSet::new();
        for [n, k] in crate::train::block_weight_shapes(model) {
            if n % 16 != 0 || k % 16 != 0 {
                continue;
            }
            let measured = self.gemms.iter().filter(|g| g.gemm.n == n && g.gemm.k == k && g.float8_flops_per_second.is_some());
            let Some(nearest) = measured.min_by_key(|g| (g.gemm.m - tokens).abs()) else {
                bail!(
                    "train.fp8_calibration {} has no float8 rate for the {n}x{k} layers of {}: make it with `ft calibrate --fp8 --config` this model",
                    path.display(),
                    crate::bench::model_label(model)
                );
            };
            if nearest.float8_flops_per_second.is_some_and(|float8| float8 <= nearest.flops_per_second) {
                kept.insert([n, k]);
            }
        }
        Ok(kept)
    }

    pub fn save(&self, path: &Path) -> Result<()> {
        std::fs::write(path, serde_json::to_string_pretty(self)? + "\n").with_context(|| format!("cannot write {}", path.display()))
    }

    /// The FLOP/s of `workload`'s matrix products: its GEMM classes'
    /// measured rates, each weighted by the FLOPs of its class (the FLOPs
    /// outside these classes, attention's, go at the same mix).
    pub fn step_flops(&self, workload: &Workload) -> Result<f64> {
        let dtype = format!("{:?}", workload.dtype);
        if dtype != self.dtype {
            bail!("it measured {} GEMMs and this plan computes in {dtype}: calibrate with the plan's --dtype", self.dtype);
        }
        let tokens = workload.batch * workload.seq;
        let block_shapes = crate::train::block_weight_shapes(workload.model);
        let (mut flops, mut seconds) = (0.0, 0.0);
        for (gemm, class_flops) in gemm_classes(workload.model, tokens, workload.loss_chunk_tokens) {
            let rate = self.gemms.iter().find(|g| g.gemm == gemm).with_context(|| {
                format!(
                    "it has no rate for the {}x{}x{} GEMM of {} at {tokens} tokens per micro-batch: calibrate with its --config, --batch {} and --seq {}",
                    gemm.m,
                    gemm.n,
                    gemm.k,
                    crate::bench::model_label(workload.model),
                    workload.batch,
                    workload.seq
                )
            })?;
            // A block's layers that run in float8 (`--fp8`), at their rate as float8 layers; the others, and the head, in the compute dtype.
            let shape = [gemm.n, gemm.k];
            let float8 = gemm.m == tokens && block_shapes.contains(&shape) && workload.float8.is_some_and(|layers| layers.runs_shape(&shape));
            let flops_per_second = match (float8, rate.float8_flops_per_second) {
                (false, _) => rate.flops_per_second,
                (true, Some(float8)) => float8,
                (true, None) => bail!(
                    "it has no float8 rate for the {}x{}x{} GEMM of {}'s float8 layers: calibrate with --fp8 (on a GPU of compute capability 8.9+)",
                    gemm.m,
                    gemm.n,
                    gemm.k,
                    crate::bench::model_label(workload.model)
                ),
            };
            flops += class_flops;
            seconds += class_flops / flops_per_second;
        }
        Ok(flops / seconds)
    }
}

impl Cluster {
    /// Takes `calibration`'s measured rates in place of the table's: the
    /// FLOP/s of `workload`'s step, the host optimizer's rate and the host
    /// link's, where it measured them.
    pub fn use_calibration(&mut self, calibration: &Calibration, workload: &Workload) -> Result<()> {
        self.flops = calibration.step_flops(workload)?;
        self.calibration = Some(calibration.clone());
        Ok(())
    }

    /// Seconds of a step's memory-bound kernels, besides its matrix
    /// products at the measured rates: none without a calibration (the
    /// table's achieved fraction of the peak covers them). With activation
    /// checkpointing the blocks' forward, a third of theirs, runs again.
    /// `recomputed`: the share of the blocks whose forward runs again.
    pub(super) fn memory_bound_seconds(&self, workload: &Workload, tokens: f64, recomputed: f64) -> f64 {
        if self.calibration.is_none() {
            return 0.0;
        }
        let dims = workload.model.dims();
        let recompute = 1.0 + recomputed / 3.0;
        let block = BLOCK_BYTES_PER_TOKEN_AND_HIDDEN * (dims.layers * dims.hidden) as f64 * recompute;
        let head = HEAD_BYTES_PER_TOKEN_AND_VOCAB * dims.vocab as f64;
        tokens * (block + head) / self.memory_bandwidth
    }

    /// Elements per second one node's host steps under `offload`, where measured.
    pub(super) fn host_optimizer_rate(&self, offload: &str) -> Option<f64> {
        self.calibration.as_ref()?.host_optimizer_elements_per_second.get(offload).copied()
    }

    /// Bytes per second of one GPU's host link, to the device and to the host.
    pub(super) fn host_link(&self) -> (f64, f64) {
        let measured = |rate: Option<f64>| rate.unwrap_or(self.host_link_bandwidth);
        let calibration = self.calibration.as_ref();
        (measured(calibration.and_then(|c| c.host_to_device_bytes_per_second)), measured(calibration.and_then(|c| c.device_to_host_bytes_per_second)))
    }
}

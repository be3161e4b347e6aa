//! AdamW over fp32 host buffers, for offloaded optimizer state: one pass over
//! memory per element (torch's for-loop CPU AdamW makes several), split across
//! cores with rayon, and compiled for AVX2 where the CPU has it — the loop is
//! plain scalar code written for the compiler to vectorise. Same arithmetic
//! as ATen's fused AdamW (decoupled weight decay, bias correction).

use anyhow::{bail, Result};
use ft_core::AdamW;
use rayon::prelude::*;
use std::sync::OnceLock;
use tch::{Device, Kind, Tensor};

/// The optimizer's own threads, apart from rayon's global pool (which other
/// libraries, the tokenizer among them, size for the whole machine).
static POOL: OnceLock<rayon::ThreadPool> = OnceLock::new();

fn pool() -> &'static rayon::ThreadPool {
    POOL.get_or_init(|| {
        let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
        rayon::ThreadPoolBuilder::new().num_threads(threads).build().expect("a thread pool")
    })
}

/// Elements per parallel task: large enough to amortise scheduling, small
/// enough to balance a shard over many cores.
const CHUNK: usize = 1 << 16;

/// The per-step constants of the update.
#[derive(Clone, Copy)]
struct Coefficients {
    decay: f32,
    beta2: f32,
    one_minus_beta1: f32,
    one_minus_beta2: f32,
    step_size: f32,
    bias_correction2_sqrt: f32,
    eps: f32,
    grad_scale: f32,
}

#[inline(always)]
fn update(p: &mut [f32], g: &[f32], m: &mut [f32], v: &mut [f32], c: Coefficients) {
    for i in 0..p.len() {
        let grad = g[i] / c.grad_scale;
        let param = p[i] * c.decay;
        let exp_avg = m[i] + c.one_minus_beta1 * (grad - m[i]);
        let exp_avg_sq = c.beta2 * v[i] + c.one_minus_beta2 * grad * grad;
        let denom = exp_avg_sq.sqrt() / c.bias_correction2_sqrt + c.eps;
        p[i] = param - c.step_size * exp_avg / denom;
        m[i] = exp_avg;
        v[i] = exp_avg_sq;
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn update_avx2(p: &mut [f32], g: &[f32], m: &mut [f32], v: &mut [f32], c: Coefficients) {
    update(p, g, m, v, c)
}

fn update_chunk(p: &mut [f32], g: &[f32], m: &mut [f32], v: &mut [f32], c: Coefficients) {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") {
        // SAFETY: the CPU supports AVX2 (checked just above).
        return unsafe { update_avx2(p, g, m, v, c) };
    }
    update(p, g, m, v, c)
}

fn host_f32(tensor: &Tensor, name: &str) -> Result<(*mut f32, usize)> {
    if tensor.device() != Device::Cpu || tensor.kind() != Kind::Float || !tensor.is_contiguous() {
        bail!("cpu_adamw: {name} must be a contiguous f32 host tensor (got {:?} {:?})", tensor.kind(), tensor.device());
    }
    Ok((tensor.data_ptr() as *mut f32, tensor.numel()))
}

/// One AdamW step in place over `param`, `exp_avg`, `exp_avg_sq` (distinct
/// contiguous f32 host tensors of one length) with `grad`, at step number
/// `step` (already counting this step). Gradients are divided by `grad_scale`.
pub fn cpu_adamw(
    param: &Tensor,
    grad: &Tensor,
    exp_avg: &Tensor,
    exp_avg_sq: &Tensor,
    hyper: AdamW,
    step: f64,
    grad_scale: f64,
) -> Result<()> {
    let (p, n) = host_f32(param, "param")?;
    let (g, gn) = host_f32(grad, "grad")?;
    let (m, mn) = host_f32(exp_avg, "exp_avg")?;
    let (v, vn) = host_f32(exp_avg_sq, "exp_avg_sq")?;
    if [gn, mn, vn] != [n, n, n] {
        bail!("cpu_adamw: lengths differ (param {n}, grad {gn}, exp_avg {mn}, exp_avg_sq {vn})");
    }
    let written = [p as usize, m as usize, v as usize];
    if n > 0 && (written[0] == written[1] || written[0] == written[2] || written[1] == written[2] || written.contains(&(g as usize))) {
        bail!("cpu_adamw: param, grad, exp_avg and exp_avg_sq must be distinct buffers");
    }
    let c = Coefficients {
        decay: (1.0 - hyper.lr * hyper.weight_decay) as f32,
        beta2: hyper.beta2 as f32,
        one_minus_beta1: (1.0 - hyper.beta1) as f32,
        one_minus_beta2: (1.0 - hyper.beta2) as f32,
        step_size: (hyper.lr / (1.0 - hyper.beta1.powf(step))) as f32,
        bias_correction2_sqrt: (1.0 - hyper.beta2.powf(step)).sqrt() as f32,
        eps: hyper.eps as f32,
        grad_scale: grad_scale as f32,
    };
    // SAFETY: four checked, contiguous, distinct f32 buffers of n elements,
    // borrowed for this call only (the tensors outlive it).
    let (p, g, m, v) = unsafe {
        (
            std::slice::from_raw_parts_mut(p, n),
            std::slice::from_raw_parts(g, n),
            std::slice::from_raw_parts_mut(m, n),
            std::slice::from_raw_parts_mut(v, n),
        )
    };
    pool().install(|| {
        p.par_chunks_mut(CHUNK)
            .zip(g.par_chunks(CHUNK))
            .zip(m.par_chunks_mut(CHUNK))
            .zip(v.par_chunks_mut(CHUNK))
            .for_each(|(((p, g), m), v)| update_chunk(p, g, m, v, c))
    });
    Ok(())
}

/// The sum of squares of an f32 host tensor (for the gradient norm), on the
/// optimizer's threads, accumulated in f64.
pub fn cpu_sum_of_squares(tensor: &Tensor) -> Result<f64> {
    let (x, n) = host_f32(tensor, "tensor")?;
    // SAFETY: a checked contiguous f32 buffer of n elements, read during this call only.
    let x = unsafe { std::slice::from_raw_parts(x as *const f32, n) };
    Ok(pool().install(|| x.par_chunks(CHUNK).map(|c| c.iter().map(|&v| (v as f64) * (v as f64)).sum::<f64>()).sum()))
}

/// Sizes the CPU optimizer's thread pool (the first call wins; the default
/// is every core). Ranks sharing a host should split its cores.
pub fn set_cpu_threads(threads: usize) {
    let _ = POOL.set(rayon::ThreadPoolBuilder::new().num_threads(threads.max(1)).build().expect("a thread pool"));
}

#[cfg(test)]
mod tests {
    use super::*;
    use tch::Kind;

    /// ft's CPU AdamW against ATen's `_fused_adamw_` on the host, over
    /// several steps with weight decay and a gradient scale (clipping).
    #[test]
    fn equals_atens_fused_adamw() {
        tch::manual_seed(7);
        let n = 300_007; // not a multiple of the chunk or the vector width
        let hyper = AdamW { lr: 1e-3, beta1: 0.9, beta2: 0.999, weight_decay: 0.01, eps: 1e-8 };
        let param = Tensor::randn([n], (Kind::Float, Device::Cpu));
        let ours = [param.copy(), Tensor::zeros([n], (Kind::Float, Device::Cpu)), Tensor::zeros([n], (Kind::Float, Device::Cpu))];
        let theirs = [param.copy(), Tensor::zeros([n], (Kind::Float, Device::Cpu)), Tensor::zeros([n], (Kind::Float, Device::Cpu))];
        let step = Tensor::zeros([], (Kind::Float, Device::Cpu));
        for t in 1..=5 {
            let grad = Tensor::randn([n], (Kind::Float, Device::Cpu)) * 1e-2;
            let scale = 1.0 + t as f64 * 0.25;
            cpu_adamw(&ours[0], &grad, &ours[1], &ours[2], hyper, t as f64, scale).unwrap();
            let _ = step.shallow_clone().g_add_scalar_(1.0);
            let scale_tensor = Tensor::from(scale as f32);
            ft_core::fused_adamw(&[&theirs[0]], &[&grad], &[&theirs[1]], &[&theirs[2]], &[&step], hyper, Some(&scale_tensor), None).unwrap();
            for (a, b) in ours.iter().zip(&theirs) {
                let relative = ((a - b).abs().max().double_value(&[])) / b.abs().max().double_value(&[]);
                assert!(relative <= 1e-6, "step {t}: relative difference {relative:e}");
            }
        }
    }

    #[test]
    fn sum_of_squares_equals_atens() {
        let x = Tensor::randn([100_003], (Kind::Float, Device::Cpu));
        let ours = cpu_sum_of_squares(&x).unwrap();
        let theirs = x.to_kind(Kind::Double).square().sum(Kind::Double).double_value(&[]);
        assert!((ours - theirs).abs() <= 1e-9 * theirs, "{ours} vs {theirs}");
    }

    #[test]
    fn wrong_buffers_are_refused() {
        let a = Tensor::zeros([4], (Kind::Float, Device::Cpu));
        let hyper = AdamW { lr: 1e-3, beta1: 0.9, beta2: 0.999, weight_decay: 0.0, eps: 1e-8 };
        let short = Tensor::zeros([3], (Kind::Float, Device::Cpu));
        let err = cpu_adamw(&a, &short, &a.zeros_like(), &a.zeros_like(), hyper, 1.0, 1.0).unwrap_err();
        assert!(err.to_string().contains("lengths differ"), "{err}");
        let err = cpu_adamw(&a, &a.zeros_like(), &a, &a.zeros_like(), hyper, 1.0, 1.0).unwrap_err();
        assert!(err.to_string().contains("distinct"), "{err}");
        let half = Tensor::zeros([4], (Kind::Half, Device::Cpu));
        let err = cpu_adamw(&half, &a.zeros_like(), &a.zeros_like(), &a.zeros_like(), hyper, 1.0, 1.0).unwrap_err();
        assert!(err.to_string().contains("contiguous f32 host tensor"), "{err}");
    }
}

//! Criterion: the offload optimizer's throughput, ft's CPU AdamW against
//! torch's two CPU AdamWs on the same buffers and threads — the default
//! `torch.optim.AdamW` (the per-tensor loop of ATen ops, `foreach=False` on
//! CPU) and `fused=True` (ATen's `_fused_adamw_`). Elements per second is
//! the figure (criterion's throughput).
//! `cargo bench --bench cpu_adamw` (after `source scripts/env.sh`).

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use ft_core::AdamW;
use tch::{Device, Kind, Tensor};

const ELEMENTS: i64 = 1 << 24;

/// torch.optim.adamw's `_single_tensor_adamw`, op for op (tch's addcmul_
/// and addcdiv_ take no `value`, so the scalars fold into a temporary and
/// into `denom`: one extra pass over the gradient).
fn torch_default_adamw(p: &mut Tensor, g: &Tensor, m: &mut Tensor, v: &mut Tensor, hyper: AdamW, step: f64) {
    let _ = p.g_mul_scalar_(1.0 - hyper.lr * hyper.weight_decay);
    let _ = m.lerp_(g, 1.0 - hyper.beta1);
    let _ = v.g_mul_scalar_(hyper.beta2);
    let _ = v.addcmul_(g, &(g * (1.0 - hyper.beta2)));
    let step_size = hyper.lr / (1.0 - hyper.beta1.powf(step));
    let bias_correction2_sqrt = (1.0 - hyper.beta2.powf(step)).sqrt();
    let mut denom = v.sqrt();
    let _ = denom.g_div_scalar_(bias_correction2_sqrt);
    let _ = denom.g_add_scalar_(hyper.eps);
    let _ = denom.g_mul_scalar_(-1.0 / step_size);
    let _ = p.addcdiv_(m, &denom);
}

fn cpu_adamw(c: &mut Criterion) {
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    tch::set_num_threads(threads as i32);
    ft_strategy_cpu_offload::set_cpu_threads(threads);
    let hyper = AdamW { lr: 1e-4, beta1: 0.9, beta2: 0.999, weight_decay: 0.01, eps: 1e-8 };
    let new = || Tensor::randn([ELEMENTS], (Kind::Float, Device::Cpu)) * 1e-2;
    let (mut p, g, mut m, mut v) = (new(), new(), new().abs(), new().abs());
    let step = Tensor::from(10.0f32);
    let mut group = c.benchmark_group("cpu_adamw");
    group.sample_size(10).throughput(Throughput::Elements(ELEMENTS as u64));
    group.bench_function("ft", |b| b.iter(|| ft_strategy_cpu_offload::cpu_adamw(&p, &g, &m, &v, hyper, 10.0, 1.0).unwrap()));
    group.bench_function("torch_fused", |b| {
        b.iter(|| ft_sys::fused_adamw(&[&p], &[&g], &[&m], &[&v], &[&step], hyper, None, None).unwrap())
    });
    group.bench_function("torch_default", |b| b.iter(|| torch_default_adamw(&mut p, &g, &mut m, &mut v, hyper, 10.0)));
    group.finish();
}

criterion_group!(benches, cpu_adamw);
criterion_main!(benches);

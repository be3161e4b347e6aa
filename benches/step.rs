//! Criterion benchmarks of the training step's hot paths on CPU: one
//! forward+backward+AdamW step of the tiny fixture models, and the fused
//! LM-head loss against autograd's cross-entropy.
//! `cargo bench --bench step` (after `source scripts/env.sh`).

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion};
use ft_core::dataset::Batch;
use ft_core::model::{Inputs, Model};
use ft_core::train::loss::{lm_head_loss_and_grads, lm_loss};
use ft_core::train::{Kernels, MicroBatch, TrainOptions, TrainerBuilder};
use ft_tasks::causal_lm::CausalLmLoss;
use ft_models::hf;
use std::path::Path;
use tch::{Device, Kind, Tensor};

/// The causal-LM objective over labels equal to the inputs (ATen's kernels, any device).
const LM_LOSS: CausalLmLoss = CausalLmLoss { chunk_tokens: 1024, kernels: Kernels::Aten, softcap: None };

fn lm_batch(ids: &Tensor) -> Batch {
    Batch { inputs: Inputs::ids(ids), targets: vec![ids.shallow_clone()] }
}

fn fixture(name: &str) -> (Box<dyn Model>, Vec<Vec<Tensor>>, Tensor) {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures").join(name);
    let model = hf::load_model(&dir).expect("fixture model");
    let params = hf::load_params(model.as_ref(), &dir, Kind::Float, Device::Cpu).expect("fixture weights");
    let rows: Vec<Vec<i64>> = serde_json::from_str(&std::fs::read_to_string(dir.join("ids.json")).unwrap()).unwrap();
    (model, params, Tensor::from_slice2(&rows))
}

fn training_step(c: &mut Criterion) {
    tch::set_num_threads(1);
    let mut group = c.benchmark_group("train_step");
    for name in ["bloom", "llama-gqa"] {
        let (model, params, ids) = fixture(name);
        let mut trainer = TrainerBuilder::new(model.as_ref(), TrainOptions::default()).build(&params).unwrap();
        let count = ids.narrow(1, 1, ids.size()[1] - 1).numel() as f64;
        group.bench_function(BenchmarkId::from_parameter(name), |b| {
            b.iter(|| {
                let _loss = trainer.forward_backward(&lm_batch(&ids), &LM_LOSS, count, MicroBatch::ONLY).unwrap();
                trainer.step(1e-3).unwrap()
            })
        });
    }
    group.finish();
}

fn lm_head(c: &mut Criterion) {
    tch::set_num_threads(1);
    let mut group = c.benchmark_group("lm_head_loss_and_grads");
    let hidden = Tensor::randn([4, 128, 64], (Kind::Float, Device::Cpu));
    let weight = Tensor::randn([4096, 64], (Kind::Float, Device::Cpu)) * 0.02;
    let labels = Tensor::randint(4096, [4, 128], (Kind::Int64, Device::Cpu));
    let count = (4 * 127) as f64;
    group.bench_function("chunked_no_autograd", |b| b.iter(|| lm_head_loss_and_grads(&hidden, &weight, &labels, count, 256, None, Kernels::Aten, true, None).unwrap()));
    group.bench_function("autograd", |b| {
        b.iter(|| {
            let (h, w) = (hidden.detach().set_requires_grad(true), weight.detach().set_requires_grad(true));
            lm_loss(&h, &w, &labels, 256, None).unwrap().backward();
            (h.grad(), w.grad())
        })
    });
    group.finish();
}

criterion_group!(benches, training_step, lm_head);
criterion_main!(benches);

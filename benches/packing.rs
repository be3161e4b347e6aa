//! Criterion: packing (`data.packing`) against padded batches on data of
//! skewed lengths — most examples short, a few long, as chat data is — with
//! the tiny Llama fixture on CPU. Each iteration trains one epoch over the
//! same 64 examples, 8 rows a step, either one example a row (padded to the
//! batch's longest) or packed into rows of 256 tokens; criterion's
//! throughput is the examples' real (non-padding) tokens per second.
//! `cargo bench --bench packing` (after `source scripts/env.sh`).

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use ft_core::dataset::Dataset;
use ft_core::train::{Kernels, MicroBatch, TrainOptions, TrainerBuilder};
use ft_data::example::Example;
use ft_models::hf;
use ft_tasks::causal_lm::{CausalLmLoss, LmDataset};
use rand::{Rng, SeedableRng};
use std::path::Path;
use tch::{Device, Kind};

const MAX_LEN: usize = 256;
const ROWS_PER_STEP: usize = 8;

/// 64 examples of random tokens: seven in eight of 16–48 tokens, the rest of 160–256.
fn skewed_examples(vocab: i64) -> Vec<Example> {
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(0);
    (0..64)
        .map(|i| {
            let len = if i % 8 == 7 { rng.gen_range(160..=MAX_LEN) } else { rng.gen_range(16..=48) };
            let ids: Vec<i64> = (0..len).map(|_| rng.gen_range(0..vocab)).collect();
            Example { labels: ids.clone(), input_ids: ids }
        })
        .collect()
}

fn packing(c: &mut Criterion) {
    tch::set_num_threads(1);
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/llama");
    let model = hf::load_model(&dir).expect("fixture model");
    let params = hf::load_params(model.as_ref(), &dir, Kind::Float, Device::Cpu).expect("fixture weights");
    let objective = CausalLmLoss { chunk_tokens: 1024, kernels: Kernels::Aten, softcap: None };
    let examples = skewed_examples(model.dims().vocab);
    let real_tokens: usize = examples.iter().map(|e| e.input_ids.len()).sum();
    let mut group = c.benchmark_group("train_epoch_skewed_lengths");
    group.sample_size(10).throughput(Throughput::Elements(real_tokens as u64));
    for (name, data) in [("padded", LmDataset::new(examples.clone(), 0, 1)), ("packed", LmDataset::packed(examples, 0, 1, MAX_LEN))] {
        let mut trainer = TrainerBuilder::new(model.as_ref(), TrainOptions::default()).build(&params).unwrap();
        let rows: Vec<usize> = (0..data.len()).collect();
        group.bench_function(name, |b| {
            b.iter(|| {
                for step in rows.chunks(ROWS_PER_STEP) {
                    let batch = data.collate(step, Device::Cpu).unwrap();
                    let normalizer = step.iter().map(|&i| data.loss_weight(i)).sum::<usize>() as f64;
                    let _loss = trainer.forward_backward(&batch, &objective, normalizer, MicroBatch::ONLY).unwrap();
                    let _grad_norm = trainer.step(1e-3).unwrap();
                }
            })
        });
    }
    group.finish();
}

criterion_group!(benches, packing);
criterion_main!(benches);

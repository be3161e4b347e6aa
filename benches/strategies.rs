//! Criterion: one training step of each strategy for the tiny BLOOM fixture
//! over 2 local Gloo ranks (the design card's "benchmarks comparing
//! strategies"), and the sharding mechanism's hot paths in one process:
//! flattening a unit into (sharded) flat buffers. Steps are timed inside
//! `ft bench`'s workers (process start-up is not in the figure), through
//! criterion's custom timing. `cargo bench --bench strategies`.

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion};
use ft_core::flat::{FlatUnit, UnitPlacement};
use ft_core::strategy::{ShardGroup, ShardingPolicy};
use ft_models::hf;
use std::path::Path;
use std::process::Command;
use std::time::Duration;
use tch::{Device, Kind};

fn fixture() -> String {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/bloom").display().to_string()
}

/// Mean step time of `iterations` steps of `strategy` on 2 Gloo ranks, as `ft bench` measures it.
fn step_time(strategy: &str, iterations: u64) -> Duration {
    let dir = tempfile::tempdir().unwrap();
    let json = dir.path().join("rows.json");
    let output = Command::new(env!("CARGO_BIN_EXE_ft"))
        .args(["bench", "--config", &fixture(), "--device", "cpu", "--dtype", "f32", "--gpus", "2", "--batch", "4", "--seq", "64"])
        .args(["--warmup", "2", "--steps", &iterations.to_string(), "--strategy", strategy, "--json", json.to_str().unwrap()])
        .output()
        .unwrap();
    assert!(output.status.success(), "{}", String::from_utf8_lossy(&output.stderr));
    let rows: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    let step_ms = rows[0]["step_ms"].as_f64().unwrap();
    Duration::from_secs_f64(step_ms / 1e3 * iterations as f64)
}

fn strategies(c: &mut Criterion) {
    let mut group = c.benchmark_group("train_step_2_gloo_ranks");
    group.sample_size(10);
    for strategy in ["ddp", "zero1", "shard_grad_op", "full_shard"] {
        group.bench_function(BenchmarkId::from_parameter(strategy), |b| b.iter_custom(|iterations| step_time(strategy, iterations)));
    }
    group.finish();
}

fn flatten(c: &mut Criterion) {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/bloom");
    let model = hf::load_model(&dir).unwrap();
    let params = hf::load_params(model.as_ref(), &dir, Kind::Float, Device::Cpu).unwrap();
    let (spec, tensors) = (&model.units()[1], &params[1]);
    let mut group = c.benchmark_group("flatten_unit");
    for (name, shards) in [("whole", 1), ("shard_of_4", 4)] {
        let placement = UnitPlacement::new(&ShardingPolicy::sharded(true, ShardGroup::World), spec.numel(), shards, 1 % shards, false);
        group.bench_function(name, |b| b.iter(|| FlatUnit::new(spec, tensors, Kind::BFloat16, placement).unwrap()));
    }
    group.finish();
}

criterion_group!(benches, strategies, flatten);
criterion_main!(benches);

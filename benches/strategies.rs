//! Criterion: one training step of each strategy, and of the in-tree
//! communication plug-ins under the strategies they serve, for the tiny
//! BLOOM fixture over 2 local CPU ranks (through shared memory), with the bytes each step sends as
//! the throughput (criterion's "thrpt" is then bytes sent per second); and
//! the sharding mechanism's hot paths in one process: flattening a unit
//! into (sharded) flat buffers. Steps are timed inside `ft bench`'s workers
//! (process start-up is not in the figure), through criterion's custom
//! timing. `cargo build --workspace --release && cargo bench --bench
//! strategies` (the plug-ins are cdylibs cargo bench does not build; rows
//! whose plug-in is missing are skipped with a note).

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use ft_core::distributed::flat::{FlatUnit, UnitPlacement};
use ft_core::distributed::strategy::{ShardGroup, ShardingPolicy};
use ft_models::hf;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;
use tch::{Device, Kind};

fn fixture() -> String {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/bloom").display().to_string()
}

/// A communication plug-in's library, built beside this bench (None when it was not built).
fn plugin(name: &str) -> Option<PathBuf> {
    let exe = std::env::current_exe().ok()?;
    let path = exe.parent()?.parent()?.join(format!("lib{name}.so"));
    path.is_file().then_some(path)
}

/// Mean step time of `iterations` steps of `strategy` (through `comm`'s
/// hook when given) on 2 local CPU ranks, as `ft bench` measures it, and the
/// bytes rank 0 sent per step.
fn step(strategy: &str, comm: Option<(&str, &Path)>, iterations: u64) -> (Duration, f64) {
    let dir = tempfile::tempdir().unwrap();
    let json = dir.path().join("rows.json");
    let mut command = Command::new(env!("CARGO_BIN_EXE_ft"));
    if let Some((_, library)) = comm {
        command.arg("--plugin").arg(library);
    }
    command
        .args(["bench", "--config", &fixture(), "--device", "cpu", "--dtype", "f32", "--gpus", "2", "--batch", "4", "--seq", "64"])
        .args(["--warmup", "2", "--steps", &iterations.to_string(), "--strategy", strategy, "--json", json.to_str().unwrap()]);
    if let Some((name, _)) = comm {
        command.args(["--comm", name]);
    }
    if comm.is_some_and(|(name, _)| name == "powersgd") {
        // Compression from the first step (its default waits 10).
        command.args(["--comm-option", "comm.powersgd.start_iter=0"]);
    }
    let output = command.output().unwrap();
    assert!(output.status.success(), "{}", String::from_utf8_lossy(&output.stderr));
    let rows: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    let step_ms = rows[0]["step_ms"].as_f64().unwrap();
    (Duration::from_secs_f64(step_ms / 1e3 * iterations as f64), rows[0]["comm_bytes_per_step"].as_f64().unwrap())
}

fn strategies(c: &mut Criterion) {
    let mut group = c.benchmark_group("train_step_2_cpu_ranks");
    group.sample_size(10);
    let runs = [
        ("ddp", None),
        ("zero1", None),
        ("shard_grad_op", None),
        ("full_shard", None),
        ("ddp", Some("bf16")),
        ("ddp", Some("powersgd")),
        ("full_shard", Some("int8")),
    ];
    for (strategy, comm) in runs {
        let library = comm.map(|name| (name, plugin(name)));
        if let Some((name, None)) = library {
            eprintln!("skipping {strategy} + {name}: lib{name}.so is not built beside this bench (cargo build --workspace [--release])");
            continue;
        }
        let comm = library.and_then(|(name, path)| Some((name, path?)));
        let comm = comm.as_ref().map(|(name, path)| (*name, path.as_path()));
        let label = comm.map_or(strategy.to_string(), |(name, _)| format!("{strategy}+{name}"));
        let (_, bytes) = step(strategy, comm, 2);
        eprintln!("{label}: {:.0} bytes sent per step by rank 0", bytes);
        group.throughput(Throughput::Bytes(bytes as u64));
        group.bench_function(BenchmarkId::from_parameter(&label), |b| b.iter_custom(|iterations| step(strategy, comm, iterations).0));
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
        group.bench_function(name, |b| b.iter(|| FlatUnit::new(spec, tensors, Kind::BFloat16, placement, None).unwrap()));
    }
    group.finish();
}

criterion_group!(benches, strategies, flatten);
criterion_main!(benches);

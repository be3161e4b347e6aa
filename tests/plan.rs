//! `ft plan`: its table for the decoder configs (BLOOM, OPT, CodeLlama,
//! Qwen2.5, Mistral, Llama 3.2), its refusal of bad input, each rank's held
//! state against real CPU runs of every strategy at 1, 2 and 4 ranks, the
//! ZeRO paper's closed form for Llama-2-70B on 64 GPUs, multi-node plans,
//! the calibration rows measured on H200s, `ft train --strategy auto`, the
//! out-of-memory report, a DPO run's reference model, float8 (`--fp8`) and
//! online RL's rollout.

use crate::common;
use common::{ft, shared, text};
use ft_core::distributed::strategy::ReduceDtype;
use ft_core::config::{RolloutGather, TrainConfig};
use ft_core::{Model, Registry};
use ft_core::plan::{self, Checkpointing, Cluster, CommTestReport, Plan, PlanRow, Setup, Workload};
use ft_models::hf;
use serde_json::Value;
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::time::Instant;
use tch::Kind;

// The built-in strategies and the cpu offload register themselves; naming the crates links them in.
use ft_strategy_cpu_offload as _;
use ft_strategy_ddp as _;
use ft_strategy_full_shard as _;
use ft_strategy_hybrid_shard as _;
use ft_strategy_shard_grad_op as _;
use ft_strategy_zero1 as _;

const STRATEGIES: [&str; 5] = ["ddp", "full_shard", "hybrid_shard", "shard_grad_op", "zero1"];

/// The shared configs of the decoders users bring most.
const SHARED_DECODERS: [&str; 3] = ["bloom-560m", "opt-1.3b", "codellama-7b"];

fn shared_config(name: &str) -> PathBuf {
    shared::path(&shared::config(name))
}

/// Whether the running test is skipped for want of the shared configs of `models`.
fn skipped_without_configs(models: &[&str]) -> bool {
    shared::skipped_without(&models.iter().map(|model| shared::config(model)).collect::<Vec<_>>())
}

/// The decoders users bring: the shared configs, and the shapes of
/// Qwen2.5-0.5B (tied, q/k/v biases), Mistral-7B (sliding window) and
/// Llama-3.2-1B (llama3 RoPE scaling, tied) kept in tests/fixtures/plan/configs.
fn decoder_configs() -> Vec<(&'static str, PathBuf)> {
    let ours = |name: &str| Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/plan/configs").join(format!("{name}.json"));
    let mut configs: Vec<(&str, PathBuf)> = SHARED_DECODERS.into_iter().map(|name| (name, shared_config(name))).collect();
    configs.extend(["qwen2.5-0.5b", "mistral-7b", "llama-3.2-1b"].map(|name| (name, ours(name))));
    configs
}

fn model(config: &Path) -> Box<dyn Model> {
    hf::ModelSource::resolve(config.to_str().unwrap()).unwrap().model().unwrap()
}

fn workload(model: &dyn Model, batch: i64, seq: i64) -> Workload<'_> {
    Workload { model, batch, seq, grad_accum: 1, dtype: Kind::BFloat16, reduce_dtype: ReduceDtype::Fp32, loss_chunk_tokens: 1024, shard_group_size: None, reference: None, float8: None, float8_gathers: false, rollout: None }
}

fn h100s(gpus: usize, nodes: usize) -> Cluster {
    let mut cluster = Cluster::new(ft_core::gpu::GpuSpec::find("h100").unwrap(), gpus, nodes, Kind::BFloat16).unwrap();
    cluster.host_memory = 2e12;
    cluster
}

fn row<'p>(plan: &'p Plan, strategy: &str, offload: &str, checkpointing: bool) -> &'p PlanRow {
    plan.row(strategy, offload, checkpointing, None).unwrap_or_else(|| panic!("no row {strategy} {offload} {checkpointing}"))
}

fn setup<'a>(registry: &Registry, strategy: &'a str, offload: &'a str, activation_checkpointing: bool) -> Setup<'a> {
    let policy = (registry.strategy(strategy).unwrap().create)().policy();
    Setup { strategy, policy, offload, offload_to_host: offload == "cpu", activation_checkpointing, checkpoint_layers: None, comm: None, expert_parallel: 1 }
}

#[test]
fn the_shipped_decoders_are_planned_in_under_a_second() {
    if skipped_without_configs(&SHARED_DECODERS) {
        return;
    }
    let registry = Registry::builtin();
    for (name, config) in decoder_configs() {
        let model = model(&config);
        let numel = model.numel() as f64;
        let started = Instant::now();
        let plan = Plan::new(&workload(model.as_ref(), 8, 512), &h100s(8, 1), &registry, Checkpointing::Auto).unwrap();
        let seconds = started.elapsed().as_secs_f64();
        assert!(seconds < 1.0, "{name}: planned in {seconds:.2} s");
        assert_eq!(plan.rows.len(), STRATEGIES.len() * 2 * 2, "{name}: strategies x offloads x checkpointing");

        // ddp holds everything: fp32 master and bf16 copy, fp32 gradients, two fp32 moments.
        let ddp = row(&plan, "ddp", "none", false);
        assert_eq!([ddp.state.params, ddp.state.grads, ddp.state.optimizer_state], [6.0 * numel, 4.0 * numel, 8.0 * numel], "{name}");
        // full_shard holds an eighth of master, gradients and moments (units padded to multiples of 8).
        let sharded = row(&plan, "full_shard", "none", false);
        let eighth = |bytes: f64| (bytes - 16.0 * numel / 8.0).abs() / (16.0 * numel / 8.0);
        assert!(eighth(sharded.state.params + sharded.state.grads + sharded.state.optimizer_state) < 1e-5, "{name}");
        assert!(sharded.state.gathered_peak > 0.0 && ddp.state.gathered_peak == 0.0, "{name}");
        // Sharded, activations make the peak; checkpointed, each block keeps its output alone.
        let checkpointed = row(&plan, "full_shard", "none", true);
        assert!(checkpointed.peak.activations < sharded.peak.activations / 4.0, "{name}: {:?} vs {:?}", checkpointed.peak, sharded.peak);
        for strategy in STRATEGIES {
            let (plain, checkpointed) = (row(&plan, strategy, "none", false), row(&plan, strategy, "none", true));
            assert!(checkpointed.peak_allocated_bytes <= plain.peak_allocated_bytes, "{name} {strategy}: checkpointing never costs memory");
            assert!(checkpointed.step_seconds > plain.step_seconds, "{name} {strategy}: recomputation costs time");
            let offloaded = row(&plan, strategy, "cpu", false);
            assert!(offloaded.state.host > 0.0 && offloaded.peak.state < plain.peak.state, "{name} {strategy}: offload moves state to the host");
        }
        // The recommendation is the fastest that fits, and each fitting row's largest batch is exact.
        let recommended = plan.recommended.as_ref().unwrap_or_else(|| panic!("{name}: something fits 8 H100s"));
        assert!(plan.rows.iter().filter(|r| r.fits).all(|r| r.step_seconds >= recommended.step_seconds), "{name}");
        for r in plan.rows.iter().filter(|r| r.fits) {
            let largest = r.max_batch.unwrap();
            assert!(largest >= 8, "{name}: {} fits 8 but allows {largest}", r.label());
            let setup = Setup { checkpoint_layers: r.checkpoint_layers, ..setup(&registry, &r.strategy, &r.offload, r.activation_checkpointing) };
            let at = |batch| plan::predict(&workload(model.as_ref(), batch, 512), &h100s(8, 1), &setup).unwrap();
            assert!(at(largest).fits && !at(largest + 1).fits, "{name}: {} at {largest} and {}", r.label(), largest + 1);
        }
    }
    // The 7B model does not fit 80 GB replicated, and does sharded.
    let plan = Plan::new(&workload(model(&shared_config("codellama-7b")).as_ref(), 8, 512), &h100s(8, 1), &registry, Checkpointing::Off).unwrap();
    assert!(!row(&plan, "ddp", "none", false).fits && row(&plan, "full_shard", "none", false).fits);
}

/// When the activations of every block do not fit and recomputing all of
/// them does, the plan adds a row recomputing the fewest blocks that fit
/// (`train.checkpoint_layers`): one fewer does not, and it is faster than
/// recomputing all.
#[test]
fn the_plan_recomputes_the_fewest_blocks_that_fit() {
    let config = Path::new(env!("CARGO_MANIFEST_DIR")).join("bench/configs/olmoe-1b-7b-8layers.json");
    let model = model(&config);
    let registry = Registry::builtin();
    // 8 × 2048 tokens, whose activations, not the optimizer step, make the peak.
    let work = workload(model.as_ref(), 8, 2048);
    let mut cluster = Cluster::new(ft_core::gpu::GpuSpec::find("h200").unwrap(), 1, 1, Kind::BFloat16).unwrap();
    let predict = |cluster: &Cluster, layers: Option<usize>| {
        plan::predict(&work, cluster, &Setup { checkpoint_layers: layers, ..setup(&registry, "ddp", "none", true) }).unwrap()
    };
    let (plain, all) = (plan::predict(&work, &cluster, &setup(&registry, "ddp", "none", false)).unwrap(), predict(&cluster, None));
    // A GPU between the two.
    cluster.gpu_memory = Some((plain.peak_gpu_bytes + all.peak_gpu_bytes) / 2.0);
    let plan = Plan::new(&work, &cluster, &registry, Checkpointing::Auto).unwrap();
    let partial = plan.rows.iter().find(|r| r.strategy == "ddp" && r.offload == "none" && r.checkpoint_layers.is_some()).expect("a row recomputing some blocks");
    let layers = partial.checkpoint_layers.unwrap();
    assert!(partial.activation_checkpointing && partial.fits && (1..8).contains(&layers), "{}", partial.label());
    assert!(!predict(&cluster, Some(layers - 1)).fits, "{} blocks would fit too", layers - 1);
    assert!(partial.step_seconds < row(&plan, "ddp", "none", true).step_seconds && !row(&plan, "ddp", "none", false).fits);
    assert!(partial.label().ends_with(&format!("activation checkpointing of {layers} blocks")), "{}", partial.label());
    assert!(plan.table().contains(&format!("{layers} blk")), "{}", plan.table());
}

/// Where cargo put the workspace's cdylibs (next to the test's deps/ directory).
fn plugin() -> PathBuf {
    let exe = std::env::current_exe().unwrap();
    let path = exe.parent().unwrap().parent().unwrap().join("libbf16.so");
    assert!(path.is_file(), "{} missing: run `cargo build --workspace` first (scripts/test.sh does)", path.display());
    path
}

/// A mixture of experts: Qwen3-30B-A3B's parameters, all and active, as
/// Qwen publishes them (30.5B, 3.3B); a row per expert-parallel degree
/// within the node, whose ranks each hold 1/N of the experts' state (18
/// bytes a parameter under ddp in bf16: fp32 master, bf16 copy, fp32
/// gradient and moments), with the all-to-all's time only there; and on 8
/// H200s at 2 × 2048 tokens, where ddp without it does not fit, expert
/// parallelism recommended.
#[test]
fn ft_plan_counts_a_mixture_of_experts_and_recommends_an_expert_parallel_degree() {
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("config.json");
    let qwen3_30b_a3b = serde_json::json!({"model_type": "qwen3_moe", "vocab_size": 151936, "hidden_size": 2048, "intermediate_size": 6144,
        "moe_intermediate_size": 768, "num_hidden_layers": 48, "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128,
        "num_experts": 128, "num_experts_per_tok": 8, "norm_topk_prob": true, "decoder_sparse_step": 1, "mlp_only_layers": [],
        "router_aux_loss_coef": 0.001, "tie_word_embeddings": false});
    std::fs::write(&config, qwen3_30b_a3b.to_string()).unwrap();
    let json = dir.path().join("plan.json");
    let output = ft()
        .args(["plan", "--model", config.to_str().unwrap(), "--gpus", "8", "--gpu", "h200", "--host-memory", "2TB", "--batch", "2", "--seq", "2048"])
        .args(["--activation-checkpointing", "off", "--json", json.to_str().unwrap()])
        .output()
        .unwrap();
    let log = text(&output);
    assert!(output.status.success() && log.contains("8 of 128 experts a token in 48 layers"), "{log}");
    let plan: Value = serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    let (total, active) = (plan["experts"]["total"].as_f64().unwrap(), plan["experts"]["active"].as_f64().unwrap());
    assert!((total / 30.5e9 - 1.0).abs() < 0.01 && (active / 3.3e9 - 1.0).abs() < 0.02, "{}", plan["experts"]);
    let rows = plan["rows"].as_array().unwrap();
    let ddp = |degree: Option<u64>| rows.iter().find(|r| r["strategy"] == "ddp" && r["offload"] == "none" && r["expert_parallel"].as_u64() == degree).unwrap_or_else(|| panic!("ddp at {degree:?}"));
    let held = |row: &Value| ["params", "grads", "optimizer_state"].iter().map(|k| row["state"][*k].as_f64().unwrap()).sum::<f64>();
    let experts = 48.0 * 128.0 * 3.0 * 2048.0 * 768.0;
    assert!(ddp(None)["time"]["all_to_all"] == 0.0 && ddp(None)["fits"] == false, "{}", ddp(None));
    for degree in [2, 4, 8] {
        let row = ddp(Some(degree));
        let expected = held(ddp(None)) - 18.0 * experts * (1.0 - 1.0 / degree as f64);
        assert!((held(row) / expected - 1.0).abs() < 1e-9, "ep{degree}: {} held, {expected} expected", held(row));
        assert!(row["time"]["all_to_all"].as_f64().unwrap() > 0.0, "{row}");
    }
    assert!(plan["recommended"]["expert_parallel"].as_u64().is_some_and(|degree| degree > 1), "{}", plan["recommended"]);
}

#[test]
fn ft_plan_prints_the_table_and_writes_json_with_plugin_rows() {
    if skipped_without_configs(&SHARED_DECODERS) {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let json = dir.path().join("plan.json");
    for (name, config) in decoder_configs() {
        let output = ft()
            .args(["--plugin", plugin().to_str().unwrap(), "plan", "--model", config.to_str().unwrap()])
            .args(["--gpus", "8", "--gpu", "h100", "--host-memory", "2TB", "--json", json.to_str().unwrap()])
            .output()
            .unwrap();
        let log = text(&output);
        assert!(output.status.success(), "{log}");
        assert!(log.contains("ft plan: ") && log.contains("on 8 x h100 (85.5 GB) on 1 node(s)") && log.contains("recommended: "), "{log}");
        let plan: Value = serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
        let rows = plan["rows"].as_array().unwrap();
        assert_eq!(rows.len(), 6 * 2 * 2, "{name}: five strategies and the plug-in's, two offloads, with and without checkpointing");
        for key in ["strategy", "offload", "activation_checkpointing", "fits", "peak_gpu_bytes", "host_bytes", "step_seconds", "max_batch"] {
            assert!(rows.iter().all(|r| r.get(key).is_some()), "{name}: rows have {key}");
        }
        assert!(rows.iter().any(|r| r["strategy"] == "ddp_bf16_grads"), "{name}");
        assert!(plan["recommended"]["fits"] == true, "{name}: {}", plan["recommended"]);
    }
    // Planning for another machine assumes its hosts' memory, not this one's.
    let output = ft().args(["plan", "--model", shared_config("codellama-7b").to_str().unwrap(), "--gpus", "8", "--gpu", "h100"]).output().unwrap();
    let log = text(&output);
    assert!(output.status.success() && log.contains("assuming 1800 GB of host memory per node") && log.contains("recommended: "), "{log}");
}

#[test]
fn ft_plan_refuses_bad_input_with_the_reason() {
    if skipped_without_configs(&["opt-1.3b"]) {
        return;
    }
    let opt = shared_config("opt-1.3b");
    let refused = [
        (vec!["--gpu", "b200"], "unknown --gpu \"b200\": ft knows gh200, h200-nvl, h200"),
        (vec!["--gpu-memory", "80"], "give a size with its unit, e.g. 80GB or 80GiB"),
        (vec!["--gpu-memory", "0GB"], "\"0GB\": expected more than 0"),
        (vec!["--host-memory", "lots"], "give a size with its unit"),
        (vec!["--gpus", "0"], "plan for at least one GPU on at least one node (--gpus 0, --nodes 1)"),
        (vec!["--gpus", "12", "--nodes", "8"], "12 GPUs do not spread evenly over 8 nodes"),
        (vec!["--batch", "0"], "plan a batch of at least 1 example"),
        (vec!["--gpus", "8", "--shard-group-size", "3"], "shard group size 3 must divide the world size 8"),
        (vec!["--tflops", "0"], "\"0\": expected more than 0"),
        (vec!["--activation-checkpointing", "maybe"], "expected auto, on or off"),
        (vec!["--lora-r", "0"], "train.lora.r (--lora-r) is 0: LoRA's rank must be at least 1"),
        (vec!["--lora-alpha", "8"], "train.lora.alpha is given, but LoRA is off"),
        (vec!["--quantize", "nf4"], "set train.lora.r (--lora-r) to train adapters on it"),
        (vec!["--reference", "each-step"], "--reference: task causal_lm compares with no reference model (give --task dpo)"),
        (vec!["--task", "dpo", "--reference", "sometimes"], "expected precomputed or each-step"),
        (vec!["--fp8", "rowwise", "--fp8-gathers", "true"], "train.fp8_gathers is given, but float8 gathers cast each weight with one scale"),
        (vec!["--fp8", "tensorwise", "--dtype", "f16"], "train.fp8 (--fp8) with train.dtype fp16"),
    ];
    for (flags, reason) in refused {
        let output = ft().args(["plan", "--model", opt.to_str().unwrap()]).args(&flags).output().unwrap();
        let log = text(&output);
        assert!(!output.status.success() && log.contains(reason) && !log.contains("panicked"), "{flags:?}: {log}");
    }
    let output = ft().args(["plan", "--model", "/nonexistent/config.json"]).output().unwrap();
    assert!(!output.status.success() && !text(&output).contains("panicked"), "{}", text(&output));
}

/// `ft plan --json` for `ranks` CPU ranks in fp32, as the runs below train.
fn plan_json(dir: &Path, config: &Path, ranks: usize, extra: &[&str]) -> Value {
    let json = dir.join(format!("plan-{ranks}-{}.json", extra.join("")));
    let output = ft()
        .args(["plan", "--model", config.to_str().unwrap(), "--gpus", &ranks.to_string(), "--dtype", "f32", "--batch", "2", "--seq", "32"])
        .args(["--activation-checkpointing", "off", "--json", json.to_str().unwrap()])
        .args(extra)
        .output()
        .unwrap();
    assert!(output.status.success(), "{}", text(&output));
    serde_json::from_str(&std::fs::read_to_string(json).unwrap()).unwrap()
}

#[test]
fn held_state_equals_real_runs_of_every_strategy_at_1_2_and_4_ranks() {
    let dir = tempfile::tempdir().unwrap();
    let [config, train_file, tokenizer] = common::demo_files(dir.path());
    let mut plans: HashMap<String, Value> = HashMap::new();
    // At 2 ranks the state is offloaded (held on the host); at 4 hybrid
    // sharding runs as 2 shard groups x 2 replicas.
    let mut cases: Vec<(usize, &str, &str, Vec<&str>)> = [1, 2, 4]
        .into_iter()
        .flat_map(|ranks| STRATEGIES.map(|strategy| (ranks, strategy)))
        .map(|(ranks, strategy)| {
            let extra = if ranks == 4 && strategy == "hybrid_shard" { vec!["--shard-group-size", "2"] } else { vec![] };
            (ranks, strategy, if ranks == 2 { "cpu" } else { "none" }, extra)
        })
        .collect();
    // LoRA's frozen base and adapters, and QLoRA's 4-bit blocks: packed and
    // sharded with the adapters' state offloaded, packed and whole.
    let qlora = vec!["--lora-r", "4", "--lora-targets", "q,o,up,down", "--quantize", "nf4"];
    cases.extend([(2, "full_shard", "cpu", qlora.clone()), (2, "ddp", "none", qlora), (2, "zero1", "none", vec!["--lora-r", "4"])]);
    for (ranks, strategy, offload, extra) in cases {
        let name = format!("{strategy}-{offload}-{ranks}{}", extra.join(""));
        let output_dir = dir.path().join(&name);
        let output = ft()
            .args(["train", "--model", config.to_str().unwrap(), "--train-file", train_file.to_str().unwrap()])
            // One step of 2 examples per rank.
            .args(["--tokenizer", tokenizer.to_str().unwrap(), "--max-seq-len", "32", "--epochs", "1", "--train-samples", &(2 * ranks).to_string()])
            .args(["--batch-size", "2", "--dtype", "f32", "--set", "output.report_to=[]", "--output-dir", output_dir.to_str().unwrap()])
            .args(["--nproc-per-node", &ranks.to_string(), "--strategy", strategy, "--offload", offload])
            .args(&extra)
            .output()
            .unwrap();
        assert!(output.status.success(), "{name}: {}", text(&output));
        let summary: Value = serde_json::from_str(&std::fs::read_to_string(output_dir.join("summary.json")).unwrap()).unwrap();
        let plan = plans.entry(format!("{ranks} {extra:?}")).or_insert_with(|| plan_json(dir.path(), &config, ranks, &extra));
        let predicted = plan["rows"]
            .as_array()
            .unwrap()
            .iter()
            .find(|r| r["strategy"] == strategy && r["offload"] == offload)
            .unwrap_or_else(|| panic!("{name}: no row"));
        let held = summary["state_per_rank"].as_array().unwrap();
        assert_eq!(held.len(), ranks);
        for (rank, measured) in held.iter().enumerate() {
            for what in ["params", "grads", "optimizer_state", "host", "gathered_peak", "frozen"] {
                assert_eq!(predicted["state"][what], measured[what], "{name} rank {rank}: {what}");
            }
        }
        assert_eq!(predicted["shard_group_size"], summary["shard_group_size"], "{name}");
    }
}

/// A DPO run's reference model as the trainer keeps it, against `ft plan
/// --task dpo`: under full_shard at 2 ranks, a frozen copy sharded on the
/// devices or (`--offload cpu`) in host memory, and LoRA's base, are what
/// the plan says each rank holds for it (the summary's `reference`), beside
/// the trainer's own state — its gathered peak too, which counts the units
/// gathered for the reference's forward; that forward is in the plan's
/// step, and the plan lists every way to keep the reference.
#[test]
fn a_dpo_reference_is_planned_as_the_trainer_holds_it() {
    let dir = tempfile::tempdir().unwrap();
    let [config, _, tokenizer] = common::demo_files(dir.path());
    let pairs = [("The capital of France is", " Paris.", " Berlin."), ("Two plus two is", " four.", " five."), ("The sky is", " blue.", " green."), ("Ice is", " cold.", " hot.")];
    let pairs: String = pairs.iter().map(|(p, c, r)| serde_json::json!({"prompt": p, "chosen": c, "rejected": r}).to_string() + "\n").collect();
    let train_file = dir.path().join("pairs.jsonl");
    std::fs::write(&train_file, pairs).unwrap();
    let row = |plan: &Value, offload: &str| plan["rows"].as_array().unwrap().iter().find(|r| r["strategy"] == "full_shard" && r["offload"] == offload).unwrap().clone();
    let lora = ["--lora-r", "4"];
    for (offload, extra, kind) in [("none", &[][..], "a frozen copy"), ("cpu", &[], "a frozen copy"), ("none", &lora, "LoRA's base")] {
        let name = format!("{offload}{}", extra.join(""));
        let each_step = plan_json(dir.path(), &config, 2, &[&["--task", "dpo", "--reference", "each-step"][..], extra].concat());
        let precomputed = plan_json(dir.path(), &config, 2, &[&["--task", "dpo"][..], extra].concat());
        let output_dir = dir.path().join(&name);
        let output = ft()
            .args(["train", "--task", "dpo", "--model", config.to_str().unwrap(), "--train-file", train_file.to_str().unwrap(), "--tokenizer", tokenizer.to_str().unwrap()])
            .args(["--max-seq-len", "32", "--max-steps", "1", "--batch-size", "2", "--dtype", "f32", "--set", "output.report_to=[]"])
            .args(["--output-dir", output_dir.to_str().unwrap(), "--nproc-per-node", "2", "--strategy", "full_shard", "--offload", offload])
            .args(["--set", "task.precompute_ref=false"])
            .args(extra)
            .output()
            .unwrap();
        assert!(output.status.success(), "{name}: {}", text(&output));
        let summary = common::summary(&output_dir);
        let (planned, measured) = (row(&each_step, offload), &summary["reference"]);
        assert!(planned["reference"]["kind"].as_str().unwrap().starts_with(kind), "{name}: {planned}");
        for rank in 0..2 {
            assert_eq!(planned["reference"]["device_bytes"], measured["device_bytes_per_rank"][rank], "{name} rank {rank}: {measured}");
            assert_eq!(planned["reference"]["host_bytes"], measured["host_bytes_per_rank"][rank], "{name} rank {rank}: {measured}");
            for what in ["params", "grads", "optimizer_state", "host", "gathered_peak", "frozen"] {
                assert_eq!(planned["state"][what], summary["state_per_rank"][rank][what], "{name} rank {rank}: {what}");
            }
        }
        // A copy costs its parameters; LoRA's base, nothing.
        let held = planned["reference"]["device_bytes"].as_f64().unwrap() + planned["reference"]["host_bytes"].as_f64().unwrap();
        assert_eq!(held > 0.0, kind == "a frozen copy", "{name}: {planned}");
        // The reference's forward is part of the step, which it makes longer than the precomputed reference's.
        let time = &planned["time"];
        let parts: f64 = time.as_object().unwrap().values().map(|v| v.as_f64().unwrap()).sum();
        assert!(time["reference"].as_f64().unwrap() > 0.0 && (parts - planned["step_seconds"].as_f64().unwrap()).abs() < 1e-12, "{name}: {time}");
        let before = row(&precomputed, offload);
        assert!(planned["step_seconds"].as_f64().unwrap() > before["step_seconds"].as_f64().unwrap(), "{name}: {planned} vs {before}");
        assert_eq!((before["reference"]["device_bytes"].as_f64(), before["reference"]["host_bytes_per_pair"].as_f64()), (Some(0.0), Some(16.0)), "{before}");
        // `ft train --strategy auto` plans the reference the task keeps.
        if (offload, extra.is_empty()) == ("none", true) {
            let output = ft()
                .args(["train", "--task", "dpo", "--model", config.to_str().unwrap(), "--train-file", train_file.to_str().unwrap(), "--tokenizer", tokenizer.to_str().unwrap()])
                .args(["--max-seq-len", "32", "--max-steps", "1", "--batch-size", "2", "--set", "output.report_to=[]", "--set", "task.precompute_ref=false"])
                .args(["--output-dir", dir.path().join("auto").to_str().unwrap(), "--nproc-per-node", "2", "--strategy", "auto"])
                .output()
                .unwrap();
            let log = text(&output);
            assert!(output.status.success() && log.contains("s per step; its reference model: a frozen copy"), "auto: {log}");
        }
        // Both ways of keeping it, under the recommended configuration.
        let options = each_step["reference_options"].as_array().unwrap();
        let kinds: Vec<&str> = options.iter().map(|option| option[1]["kind"].as_str().unwrap()).collect();
        assert!(kinds.len() == 2 && kinds[0].starts_with("log-probabilities precomputed") && kinds[1].starts_with(kind), "{name}: {kinds:?}");
    }
}

#[test]
fn model_state_follows_the_zero_paper_for_llama2_70b_on_64_gpus() {
    let config = serde_json::json!({
        "model_type": "llama", "hidden_size": 8192, "intermediate_size": 28672, "num_hidden_layers": 80,
        "num_attention_heads": 64, "num_key_value_heads": 8, "vocab_size": 32000, "rms_norm_eps": 1e-5
    });
    let model = hf::model_from_config(config).unwrap();
    let psi = model.numel() as f64;
    assert!((psi / 1e9 - 68.98).abs() < 0.01, "Llama-2-70B has 68.98B parameters, this config {psi}");
    let (gpus, n) = (64, 64.0);
    let plan = Plan::new(&workload(model.as_ref(), 1, 4096), &h100s(gpus, 8), &Registry::builtin(), Checkpointing::Off).unwrap();
    // ZeRO (Rajbhandari et al. 2020), mixed-precision Adam per GPU: fp16 parameters 2Ψ,
    // fp16 gradients 2Ψ, and K = 12 bytes of optimizer state (fp32 master,
    // momentum, variance) per parameter, each divided by N where the stage shards it:
    // stage 0 nothing, 1 the optimizer state, 2 the gradients too, 3 the parameters too.
    let zero = |parameters: f64, gradients: f64, optimizer: f64| 2.0 * psi / parameters + 2.0 * psi / gradients + 12.0 * psi / optimizer;
    // ft per GPU: `optimizer_state` is the two fp32 moments (8 of K's 12 bytes) and
    // `params` the fp32 master (K's other 4) plus, where parameters are replicated,
    // the whole bf16 compute copy (ZeRO's 2Ψ); gradients are fp32, 4Ψ where ZeRO's are
    // fp16. So ft = ZeRO + (4 - 2)Ψ/N_gradients - 2Ψ/N_parameters + (2Ψ where ft keeps
    // the compute copy whole).
    let cases = [
        // (strategy, ZeRO stage's divisors for parameters / gradients / optimizer state, ft's compute copy)
        ("ddp", [1.0, 1.0, 1.0], 2.0 * psi),
        ("zero1", [1.0, 1.0, n], 2.0 * psi),
        // shard_grad_op is FSDP's SHARD_GRAD_OP: parameters sharded between uses, unlike ZeRO-2.
        ("shard_grad_op", [1.0, n, n], 0.0),
        ("full_shard", [n, n, n], 0.0),
        // hybrid_shard: ZeRO-3 within a node of 8.
        ("hybrid_shard", [8.0, 8.0, 8.0], 0.0),
    ];
    for (strategy, [parameters, gradients, optimizer], compute_copy) in cases {
        let held = row(&plan, strategy, "none", false).state;
        let ft_from_zero = zero(parameters, gradients, optimizer) + 2.0 * psi / gradients - 2.0 * psi / parameters + compute_copy;
        let total = held.params + held.grads + held.optimizer_state;
        // Padding every unit to a multiple of the shard group adds at most 63 elements per unit.
        assert!((total - ft_from_zero).abs() / ft_from_zero < 1e-6, "{strategy}: ft holds {total:e}, ZeRO's form gives {ft_from_zero:e}");
        assert!((held.optimizer_state - 8.0 * psi / optimizer).abs() / held.optimizer_state < 1e-6, "{strategy}: moments");
        assert!((held.grads - 4.0 * psi / gradients).abs() / held.grads < 1e-6, "{strategy}: fp32 gradients");
    }
    // Stage 3's 16Ψ/N is ft's full_shard to the byte but for padding: 17.2 GB per GPU.
    let full_shard = row(&plan, "full_shard", "none", false).state;
    assert!(((full_shard.params + full_shard.grads + full_shard.optimizer_state) / (16.0 * psi / n) - 1.0).abs() < 1e-6);
}

#[test]
fn multi_node_plans_shard_hybrid_within_a_node_and_pay_for_the_network() {
    if skipped_without_configs(&["codellama-7b"]) {
        return;
    }
    let model = model(&shared_config("codellama-7b"));
    let registry = Registry::builtin();
    let full_shard = setup(&registry, "full_shard", "none", false);
    let hybrid = setup(&registry, "hybrid_shard", "none", false);
    for gpus in [8, 64, 1024] {
        let nodes = gpus / 8;
        let cluster = h100s(gpus, nodes);
        let work = workload(model.as_ref(), 4, 2048);
        let (sharded, grouped) = (plan::predict(&work, &cluster, &full_shard).unwrap(), plan::predict(&work, &cluster, &hybrid).unwrap());
        assert_eq!((sharded.shard_group_size, grouped.shard_group_size), (gpus, 8), "{gpus} GPUs");
        if nodes > 1 {
            // Gathers and reduce-scatters over every node's network, against a node's NVLink.
            assert!(sharded.time.communication > grouped.time.communication, "{gpus} GPUs: {:?} vs {:?}", sharded.time, grouped.time);
            assert!(sharded.state.optimizer_state < grouped.state.optimizer_state);
            let mut slower = cluster.clone();
            slower.inter_node_bus_bandwidth /= 4.0;
            assert!(plan::predict(&work, &slower, &full_shard).unwrap().step_seconds > sharded.step_seconds);
        }
    }
}

/// A comm-test report's bus bandwidth replaces the table's: the mean over
/// the reductions and gathers at the largest size.
#[test]
fn a_comm_test_report_replaces_the_tables_bus_bandwidth() {
    let mut cluster = h100s(8, 1);
    let row = |op: &str, bytes: usize, busbw: f64| {
        serde_json::json!({"op": op, "group": "world", "group_size": 8, "bytes": bytes, "elements": bytes / 2, "dtype": "bf16",
            "time_us": 1.0, "algbw_gbps": busbw, "busbw_gbps": busbw, "correct": true})
    };
    let report = |rows: Vec<Value>| serde_json::from_value::<CommTestReport>(serde_json::json!({"nodes": 1, "rows": rows})).unwrap();
    let measured = report(vec![row("all_gather", 1 << 20, 1.0), row("all_gather", 1 << 28, 100.0), row("reduce_scatter", 1 << 28, 200.0), row("broadcast", 1 << 28, 900.0)]);
    cluster.use_comm_test(&measured).unwrap();
    assert_eq!(cluster.node_bus_bandwidth, 150e9);
    assert!(cluster.use_comm_test(&report(vec![])).is_err());
}

#[test]
fn recorded_h200_rows_are_within_the_calibration_bounds() {
    if skipped_without_configs(&SHARED_DECODERS) {
        return;
    }
    // tests/fixtures/plan/h200-bench-rows.json: `ft bench` rows on H200s,
    // transcribed from bench/results/2026-11-22-h200x2-performance.md (tokens/s
    // and peak allocated of calls A, C1 and C2; step_ms = batch x seq / tokens/s).
    let fixture = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/plan/h200-bench-rows.json");
    let output = ft()
        .args(["bench", "--from-json", fixture.to_str().unwrap(), "--plan-check", "--gpu", "h200"])
        .args(["--config", shared_config("bloom-560m").to_str().unwrap(), "--config", shared_config("opt-1.3b").to_str().unwrap()])
        .args(["--config", shared_config("codellama-7b").to_str().unwrap()])
        .output()
        .unwrap();
    let log = text(&output);
    assert!(output.status.success(), "{log}");
    assert!(log.contains("plan check: 7 of 7 rows within ±10% peak memory and ±25% step time"), "{log}");
}

/// Mixture-of-experts rows on H200s, each checked at the degree it ran at:
/// every peak within ±10% and step time within ±25%. OLMoE's shape, 8 of
/// its 16 layers, on 1 GPU, on 2 holding every expert, on 2 at
/// expert-parallel degree 2 and on 4 at degree 4
/// (bench/results/2026-11-28-h200x4-moe-ep/; its full_shard row at degree
/// 2 on 4 GPUs held each expert whole on both its holders, which now split
/// its state, so it no longer describes a run); Qwen3-30B-A3B whole on 4 at
/// degree 4 under full_shard, every block recomputed, or the first 24, 12
/// or 10 (2026-11-28-h200x4-moe-row5/) — where the plan recommends
/// recomputing some blocks, not all, nor none (which ran out of memory).
/// And LoRA r16 on its attention and experts on 1 GPU, over a bf16 and an
/// NF4 base, with and without offload (2026-11-28-h200-moe-lora/).
#[test]
fn recorded_expert_parallel_rows_are_checked_at_their_degree() {
    let fixture = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/plan/h200-moe-rows.json");
    let config = Path::new(env!("CARGO_MANIFEST_DIR")).join("bench/configs/olmoe-1b-7b-8layers.json");
    let output = ft()
        .args(["bench", "--from-json", fixture.to_str().unwrap(), "--plan-check", "--gpu", "h200", "--config", config.to_str().unwrap()])
        .output()
        .unwrap();
    let log = text(&output);
    assert!(output.status.success(), "{log}");
    assert!(log.contains("| ddp ep2 | none | off | 2 | 2x2048 | 35.54 / "), "{log}");
    // | model | strategy | offload | ckpt | GPUs | batch x seq | peak GB | error | step ms | error | within |
    let checked = |line: &&str| line.starts_with("| olmoe") && line.matches(" / ").count() == 2;
    let rows: Vec<Vec<&str>> = log.lines().filter(checked).map(|l| l.split('|').map(str::trim).collect()).collect();
    assert_eq!(rows.len(), 5, "{log}");
    let percent = |cell: &str| cell.trim_end_matches('%').parse::<f64>().unwrap();
    for row in rows {
        assert!(percent(row[10]).abs() <= 25.0 && percent(row[8]).abs() <= 10.0, "{row:?}");
    }
    let results = Path::new(env!("CARGO_MANIFEST_DIR")).join("bench/results");
    let config = Path::new(env!("CARGO_MANIFEST_DIR")).join("bench/configs/qwen3-30b-a3b.json");
    let rows = ["2026-11-28-h200x4-moe-ep/ft-full_shard-ep4-ckpt-on.json"]
        .into_iter()
        .chain([24, 12, 10].map(|layers| format!("2026-11-28-h200x4-moe-row5/ft-full_shard-ep4-ckpt-{layers}.json")).iter().map(String::as_str))
        .flat_map(|row| ["--from-json".to_string(), results.join(row).to_str().unwrap().to_string()])
        .collect::<Vec<_>>();
    let output = ft().args(["bench", "--plan-check", "--gpu", "h200", "--config", config.to_str().unwrap()]).args(&rows).output().unwrap();
    let log = text(&output);
    assert!(output.status.success() && log.contains("| full_shard ep4 | none | 10 blk | 4 | 2x2048 | 143.26 / "), "{log}");
    assert!(log.contains("plan check: 4 of 4 rows within ±10% peak memory and ±25% step time"), "{log}");
    let json = tempfile::NamedTempFile::new().unwrap();
    let output = ft()
        .args(["plan", "--model", config.to_str().unwrap(), "--gpus", "4", "--gpu", "h200", "--batch", "2", "--seq", "2048", "--json", json.path().to_str().unwrap()])
        .output()
        .unwrap();
    assert!(output.status.success(), "{}", text(&output));
    let plan: Value = serde_json::from_str(&std::fs::read_to_string(json.path()).unwrap()).unwrap();
    let recommended = &plan["recommended"];
    let layers = recommended["checkpoint_layers"].as_u64().unwrap_or(0);
    assert!(recommended["expert_parallel"] == 4 && (1..48).contains(&layers), "{recommended}");
    for base in ["bf16", "nf4"] {
        let rows = [base.to_string(), format!("{base}-offload")].map(|row| results.join(format!("2026-11-28-h200-moe-lora/ft-{row}.json")));
        let output = ft()
            .args(["bench", "--plan-check", "--gpu", "h200", "--config", config.to_str().unwrap(), "--lora-r", "16", "--lora-alpha", "32", "--lora-targets", "q,k,v,o,experts"])
            .args(if base == "nf4" { &["--quantize", "nf4"][..] } else { &[] })
            .args(rows.iter().flat_map(|row| ["--from-json", row.to_str().unwrap()]))
            .output()
            .unwrap();
        let log = text(&output);
        assert!(log.contains("plan check: 2 of 2 rows within ±10% peak memory and ±25% step time"), "{base}: {log}");
    }
}

/// LoRA r16 on every linear layer over an NF4 base, as bench/gpu/qlora_7b.sh and qlora_70b_2gpu.sh ran it.
const QLORA: [&str; 8] = ["--lora-r", "16", "--lora-alpha", "32", "--lora-targets", "q,k,v,o,gate,up,down", "--quantize", "nf4"];

fn llama_70b() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("bench/configs/llama-2-70b.json")
}

#[test]
fn qlora_rows_measured_on_h100s_are_predicted_and_a_70b_run_fits_two_gpus_only_in_4_bits() {
    if skipped_without_configs(&["codellama-7b"]) {
        return;
    }
    // tests/fixtures/plan/h100-qlora-bench-rows.json: the `ft bench` rows of
    // bench/results/2026-11-26-qlora.md (Llama-7B on one H100; Llama-2-70B
    // full_shard on two, with and without offload).
    let fixture = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/plan/h100-qlora-bench-rows.json");
    let output = ft()
        .args(["bench", "--from-json", fixture.to_str().unwrap(), "--plan-check", "--gpu", "h100"])
        .args(["--config", shared_config("codellama-7b").to_str().unwrap(), "--config", llama_70b().to_str().unwrap()])
        .args(QLORA)
        .output()
        .unwrap();
    let log = text(&output);
    assert!(output.status.success(), "{log}");
    assert!(log.contains("plan check: 3 of 3 rows within ±10% peak memory and ±25% step time"), "{log}");

    // Llama-2-70B on two 80 GB GPUs: a bf16 base held whole (ddp) cannot
    // fit; in 4 bits it does, and `--strategy auto` has a choice that fits.
    let dir = tempfile::tempdir().unwrap();
    let plan = |quantize: bool| -> Value {
        let json = dir.path().join(format!("plan-{quantize}.json"));
        let lora = if quantize { &QLORA[..] } else { &QLORA[..6] };
        let output = ft()
            .args(["plan", "--model", llama_70b().to_str().unwrap(), "--gpus", "2", "--gpu", "h100", "--batch", "1", "--seq", "2048"])
            .args(["--host-memory", "2TB", "--json", json.to_str().unwrap()])
            .args(lora)
            .output()
            .unwrap();
        assert!(output.status.success(), "{}", text(&output));
        serde_json::from_str(&std::fs::read_to_string(json).unwrap()).unwrap()
    };
    let ddp_fits = |plan: &Value| plan["rows"].as_array().unwrap().iter().any(|r| r["strategy"] == "ddp" && r["fits"] == true);
    let (bf16, nf4) = (plan(false), plan(true));
    assert!(!ddp_fits(&bf16) && ddp_fits(&nf4), "ddp holds the base whole: {} GB of bf16", bf16["rows"][0]["state"]["frozen"]);
    let chosen = &nf4["recommended"];
    assert!(chosen["fits"] == true && chosen["peak_gpu_bytes"].as_f64().unwrap() <= 80e9, "{chosen}");
    // The 4-bit base is 36.4 GB: each rank of a sharding strategy holds half of it.
    let full_shard = nf4["rows"].as_array().unwrap().iter().find(|r| r["strategy"] == "full_shard" && r["offload"] == "none").unwrap();
    let frozen = full_shard["state"]["frozen"].as_f64().unwrap();
    assert!((frozen / 18.2e9 - 1.0).abs() < 0.01, "{frozen}");
}

#[test]
fn strategy_auto_trains_with_the_plans_choice() {
    let dir = tempfile::tempdir().unwrap();
    let [config, train_file, tokenizer] = common::demo_files(dir.path());
    let output_dir = dir.path().join("auto");
    let output = ft()
        .args(["train", "--model", config.to_str().unwrap(), "--train-file", train_file.to_str().unwrap()])
        .args(["--tokenizer", tokenizer.to_str().unwrap(), "--max-seq-len", "32", "--epochs", "1", "--train-samples", "8"])
        .args(["--batch-size", "2", "--set", "output.report_to=[]", "--output-dir", output_dir.to_str().unwrap()])
        .args(["--nproc-per-node", "2", "--strategy", "auto", "--activation-checkpointing"])
        .output()
        .unwrap();
    let log = text(&output);
    assert!(output.status.success(), "{log}");
    assert!(log.contains("--strategy auto: ") && log.contains("+ activation checkpointing (ft plan: "), "checkpointing the run asked for is kept: {log}");
    let summary: Value = serde_json::from_str(&std::fs::read_to_string(output_dir.join("summary.json")).unwrap()).unwrap();
    assert!(STRATEGIES.contains(&summary["strategy"].as_str().unwrap()), "{}", summary["strategy"]);
}

#[test]
fn out_of_memory_is_reported_with_the_prediction_and_what_fits() {
    if skipped_without_configs(&["codellama-7b"]) {
        return;
    }
    let model = model(&shared_config("codellama-7b"));
    let plan = Plan::new(&workload(model.as_ref(), 8, 512), &h100s(8, 1), &Registry::builtin(), Checkpointing::Auto).unwrap();
    let oom = anyhow::anyhow!("CUDA out of memory. Tried to allocate 1.96 GiB. GPU 0 has a total capacity of 79.10 GiB");
    let message = format!("{:#}", plan::explain_out_of_memory(oom, &plan, "ddp", "none", &TrainConfig::default()));
    let (ddp, memory) = (row(&plan, "ddp", "none", false), plan.cluster.gpu_memory.unwrap() / 1e9);
    assert!(message.contains(&format!("ft plan predicted ddp needs {:.0} GB of {memory:.0} GB", ddp.peak_gpu_bytes / 1e9)), "{message}");
    let fastest = plan.recommended.as_ref().unwrap();
    assert!(message.contains(&format!("{} would need {:.0} GB of {memory:.0} GB", fastest.label(), fastest.peak_gpu_bytes / 1e9)), "{message}");
    assert!(message.ends_with("GPU 0 has a total capacity of 79.10 GiB"), "{message}");
    let other = plan::explain_out_of_memory(anyhow::anyhow!("connection reset"), &plan, "ddp", "none", &TrainConfig::default());
    assert_eq!(format!("{other:#}"), "connection reset");
}

/// The tiny OPT of tests/fixtures, whose GEMMs time in milliseconds on a CPU.
fn tiny_opt() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/opt/config.json")
}

/// `ft calibrate`'s measurement of `model` at 2 x 16 tokens in fp32 on this CPU.
fn calibrated_on_cpu(model: &dyn Model) -> plan::Calibration {
    calibrate_on_cpu(model, false).unwrap()
}

fn calibrate_on_cpu(model: &dyn Model, float8: bool) -> anyhow::Result<plan::Calibration> {
    let options = plan::CalibrateOptions { models: &[model], tokens: 32, loss_chunk_tokens: 1024, dtype: Kind::Float, device: tch::Device::Cpu, host_elements: 1 << 20, float8 };
    plan::calibrate(&options, &Registry::builtin())
}

fn tiny_workload(model: &dyn Model) -> Workload<'_> {
    Workload { dtype: Kind::Float, ..workload(model, 2, 16) }
}

#[test]
fn calibration_measures_this_machines_rates() {
    let model = model(&tiny_opt());
    let calibration = calibrated_on_cpu(model.as_ref());
    assert_eq!((calibration.device.as_str(), calibration.dtype.as_str()), ("cpu", "Float"));
    // Every 2-D weight of a block is a shape class, at the micro-batch's 32 tokens.
    let block = &model.units()[model.stages().iter().find(|s| s.kind == ft_core::model::StageKind::Block).unwrap().unit];
    for weight in block.params.iter().filter(|p| p.shape.len() == 2) {
        let gemm = plan::Gemm { m: 32, n: weight.shape[0], k: weight.shape[1] };
        assert!(calibration.gemms.iter().any(|g| g.gemm == gemm), "{gemm:?} in {:?}", calibration.gemms);
    }
    let rates = calibration.gemms.iter().map(|g| g.flops_per_second).chain(calibration.host_optimizer_elements_per_second.values().copied());
    assert!(rates.clone().all(|rate| rate.is_finite() && rate > 0.0), "{calibration:?}");
    assert!(calibration.host_optimizer_elements_per_second.contains_key("cpu"), "the cpu offload's own AdamW is timed");
    assert_eq!((calibration.host_to_device_bytes_per_second, calibration.device_to_host_bytes_per_second), (None, None), "no device, no link");
    assert!(calibration.gemms.iter().all(|g| g.float8_flops_per_second.is_none()), "float8 is timed only when asked");
    let refused = format!("{:#}", calibrate_on_cpu(model.as_ref(), true).unwrap_err());
    assert!(refused.contains("ft calibrate --fp8 times float8 GEMMs") && refused.contains("compute capability 8.9"), "{refused}");
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("calibration.json");
    calibration.save(&path).unwrap();
    // serde_json reads a float back to within an ulp, not always exactly.
    let loaded = plan::Calibration::load(&path).unwrap();
    let close = |a: f64, b: f64| (a - b).abs() <= 1e-12 * b;
    assert_eq!((&loaded.device, &loaded.dtype, loaded.gemms.len()), (&calibration.device, &calibration.dtype, calibration.gemms.len()));
    assert!(loaded.gemms.iter().zip(&calibration.gemms).all(|(a, b)| a.gemm == b.gemm && close(a.flops_per_second, b.flops_per_second)), "{loaded:?}");
    assert!(close(loaded.host_optimizer_elements_per_second["cpu"], calibration.host_optimizer_elements_per_second["cpu"]), "{loaded:?}");
}

#[test]
fn a_calibrated_plan_takes_the_measured_rates() {
    let model = model(&tiny_opt());
    let tiny = tiny_workload(model.as_ref());
    let registry = Registry::builtin();
    let mut measured = calibrated_on_cpu(model.as_ref());
    // Rates of our choosing, so that each term's relation to them is exact.
    let (gemm, host, link) = (1e12, 1e9, 1e30);
    measured.gemms.iter_mut().for_each(|g| g.flops_per_second = gemm);
    measured.host_optimizer_elements_per_second.insert("cpu".into(), host);
    (measured.host_to_device_bytes_per_second, measured.device_to_host_bytes_per_second) = (Some(link), Some(link));
    let predict = |calibration: &plan::Calibration| {
        let mut cluster = h100s(1, 1);
        cluster.use_calibration(calibration, &tiny).unwrap();
        plan::predict(&tiny, &cluster, &setup(&registry, "ddp", "cpu", false)).unwrap()
    };
    let row = predict(&measured);
    let flops = 32.0 * model.train_flops_per_token(16);
    let close = |a: f64, b: f64| (a - b).abs() <= 1e-9 * b.abs();
    // The products at the measured rate, the memory-bound kernels at the table's bandwidth.
    let dims = model.dims();
    let memory_bound = 32.0 * (plan::BLOCK_BYTES_PER_TOKEN_AND_HIDDEN * (dims.layers * dims.hidden) as f64 + plan::HEAD_BYTES_PER_TOKEN_AND_VOCAB * dims.vocab as f64);
    let bandwidth = h100s(1, 1).memory_bandwidth;
    assert!(close(row.time.compute, flops / gemm + memory_bound / bandwidth), "{:?}", row.time);
    // One rank's host steps every element at the measured rate; the links are too fast to count.
    let elements = model.numel() as f64;
    assert!(close(row.time.offload, elements / host), "{:?}", row.time);

    let mut faster = measured.clone();
    faster.gemms.iter_mut().for_each(|g| g.flops_per_second *= 2.0);
    faster.host_optimizer_elements_per_second.insert("cpu".into(), 2.0 * host);
    let twice = predict(&faster);
    assert!(close(twice.time.compute, flops / (2.0 * gemm) + memory_bound / bandwidth) && close(twice.time.offload, row.time.offload / 2.0), "{:?} vs {:?}", twice.time, row.time);

    // A slow link to the device: uploading the fp32 masters is the step's offload time.
    let mut slow = measured.clone();
    (slow.host_optimizer_elements_per_second, slow.host_to_device_bytes_per_second) = ([("cpu".into(), 1e30)].into(), Some(1e6));
    assert!(close(predict(&slow).time.offload, elements * 4.0 / 1e6), "{:?}", predict(&slow).time);

    // Another micro-batch's GEMMs were not measured; nor were another dtype's.
    let mut cluster = h100s(1, 1);
    let error = cluster.use_calibration(&measured, &Workload { batch: 4, ..tiny_workload(model.as_ref()) }).unwrap_err().to_string();
    assert!(error.contains("no rate for the 64x") && error.contains("--batch 4 and --seq 16"), "{error}");
    let error = cluster.use_calibration(&measured, &workload(model.as_ref(), 2, 16)).unwrap_err().to_string();
    assert!(error.contains("Float GEMMs") && error.contains("BFloat16"), "{error}");
}

/// `--fp8` in the plan: the block layers a calibration measured faster in
/// float8 take its float8 rate, the others (and the head) keep the compute
/// dtype's, as `ft train` with that file keeps them; what a rank holds is
/// the same, the step's peak adds the casts; float8 gathers move fewer
/// bytes than the compute dtype's; a float8 layer without a float8 rate is
/// refused by name.
#[test]
fn float8_layers_take_their_measured_rates_and_float8_gathers_move_fewer_bytes() {
    let model = model(&tiny_opt());
    let registry = Registry::builtin();
    let tensorwise = ft_sys::float8::Float8 { recipe: ft_sys::float8::Recipe::Tensorwise, emulate: false };
    // The fixture's MLP input layer (ffn_dim 64 x hidden_size 32) 4x as fast in float8, every other block layer slower.
    let fc1 = [64, 32];
    let blocks: Vec<usize> = model.stages().iter().filter(|s| s.kind == ft_core::model::StageKind::Block).map(|s| s.unit).collect();
    let block_shapes: std::collections::BTreeSet<[i64; 2]> = blocks.iter().flat_map(|&u| &model.units()[u].params).filter(|p| p.shape.len() == 2).map(|p| [p.shape[0], p.shape[1]]).collect();
    // A calibration of 2 x 16 tokens: every GEMM class at 1 TFLOP/s; the block layers' also as float8 layers.
    let gemm = |n: i64, k: i64, float8: Option<f64>| plan::GemmRate { gemm: plan::Gemm { m: 32, n, k }, flops_per_second: 1e12, float8_flops_per_second: float8 };
    let mut gemms: Vec<plan::GemmRate> = block_shapes.iter().map(|&shape| gemm(shape[0], shape[1], Some(if shape == fc1 { 4e12 } else { 5e11 }))).collect();
    gemms.push(gemm(model.dims().vocab, model.dims().hidden, None));
    let measured = plan::Calibration {
        version: plan::CALIBRATION_VERSION,
        device: "fixture".into(),
        dtype: "Float".into(),
        host_optimizer_elements_per_second: Default::default(),
        host_to_device_bytes_per_second: None,
        device_to_host_bytes_per_second: None,
        gemms,
    };
    let kept = measured.float8_kept(model.as_ref(), 32, Path::new("fixture")).unwrap();
    let layers = ft_core::train::float8_layers(model.as_ref(), tensorwise, Some(&kept));
    let predict = |workload: &Workload, strategy: &str, gpus: usize, calibration: Option<&plan::Calibration>| {
        let mut cluster = h100s(gpus, 1);
        if let Some(calibration) = calibration {
            cluster.use_calibration(calibration, workload).unwrap();
        }
        plan::predict(workload, &cluster, &setup(&registry, strategy, "none", false)).unwrap()
    };
    let bf16 = tiny_workload(model.as_ref());
    let float8 = Workload { float8: Some(&layers), ..tiny_workload(model.as_ref()) };
    let (plain, cast) = (predict(&bf16, "ddp", 1, Some(&measured)), predict(&float8, "ddp", 1, Some(&measured)));
    // The products' time shrinks by the float8 layer's share of their FLOPs, three quarters of it saved.
    let numel = |shapes: &mut dyn Iterator<Item = &Vec<i64>>| shapes.map(|s| s.iter().product::<i64>()).sum::<i64>() as f64;
    let fc1_flops = numel(&mut blocks.iter().flat_map(|&u| &model.units()[u].params).map(|p| &p.shape).filter(|s| s[..] == fc1[..]));
    let matrices = numel(&mut blocks.iter().flat_map(|&u| &model.units()[u].params).map(|p| &p.shape).filter(|s| s.len() == 2));
    let outside = numel(&mut (0..model.units().len()).filter(|u| !blocks.contains(u)).flat_map(|u| &model.units()[u].params).map(|p| &p.shape));
    let dims = model.dims();
    let memory_bound = 32.0 * (plan::BLOCK_BYTES_PER_TOKEN_AND_HIDDEN * (dims.layers * dims.hidden) as f64 + plan::HEAD_BYTES_PER_TOKEN_AND_VOCAB * dims.vocab as f64);
    let bandwidth = h100s(1, 1).memory_bandwidth;
    let products = |row: &PlanRow| row.time.compute - memory_bound / bandwidth;
    let expected = 1.0 - 0.75 * fc1_flops / (matrices + outside);
    assert!((products(&cast) / products(&plain) - expected).abs() < 1e-9, "{:?} vs {:?}: expected {expected}", cast.time, plain.time);
    assert_eq!(cast.state, plain.state, "float8 layers keep what the compute dtype's keep");
    assert!(cast.peak_allocated_bytes > plain.peak_allocated_bytes, "the casts: {:?} vs {:?}", cast.peak, plain.peak);
    // Every layer in float8 where the calibration has no float8 rate: refused, naming what to do.
    let all = ft_core::model::Float8Layers::all(tensorwise);
    let mut cluster = h100s(1, 1);
    let mut unmeasured = measured.clone();
    unmeasured.gemms.iter_mut().for_each(|g| g.float8_flops_per_second = None);
    let error = cluster.use_calibration(&unmeasured, &Workload { float8: Some(&all), ..tiny_workload(model.as_ref()) }).unwrap_err().to_string();
    assert!(error.contains("no float8 rate for the 32x") && error.contains("calibrate with --fp8"), "{error}");
    // full_shard at 2 GPUs: blocks gathered as float8 bytes (and their vectors all-reduced) take less time than in bf16.
    let bf16 = workload(model.as_ref(), 2, 16);
    let gathered = Workload { float8: Some(&all), float8_gathers: true, ..workload(model.as_ref(), 2, 16) };
    let (plain, cast) = (predict(&Workload { float8: Some(&all), ..bf16 }, "full_shard", 2, None), predict(&gathered, "full_shard", 2, None));
    assert!(cast.time.communication < plain.time.communication && cast.state == plain.state, "{:?} vs {:?}", cast.time, plain.time);
}

/// An emulated float8 run with float8 gathers under full_shard at 2 ranks
/// holds what `ft plan --fp8 tensorwise --fp8-gathers true` says: float8
/// changes no held state (a float8 layer keeps its input and weight in the
/// compute dtype; a float8 gather fills the unit's buffer).
#[test]
fn an_emulated_float8_run_holds_what_the_plan_says() {
    let dir = tempfile::tempdir().unwrap();
    let [config, train_file, tokenizer] = common::demo_files(dir.path());
    let output_dir = dir.path().join("run");
    let output = ft()
        .args(["train", "--model", config.to_str().unwrap(), "--train-file", train_file.to_str().unwrap(), "--tokenizer", tokenizer.to_str().unwrap()])
        .args(["--max-seq-len", "32", "--epochs", "1", "--train-samples", "4", "--batch-size", "2", "--dtype", "f32", "--set", "output.report_to=[]"])
        .args(["--output-dir", output_dir.to_str().unwrap(), "--nproc-per-node", "2", "--strategy", "full_shard"])
        .args(["--fp8", "tensorwise", "--set", "train.fp8_emulate=true", "--set", "train.fp8_gathers=true"])
        .output()
        .unwrap();
    assert!(output.status.success(), "{}", text(&output));
    assert!(text(&output).contains("sharded blocks gathered as float8"), "{}", text(&output));
    let plan = plan_json(dir.path(), &config, 2, &["--fp8", "tensorwise", "--fp8-layers", "all", "--fp8-gathers", "true"]);
    assert_eq!(plan["float8"], "float8 tensorwise block layers, sharded blocks gathered in float8");
    let predicted = plan["rows"].as_array().unwrap().iter().find(|r| r["strategy"] == "full_shard" && r["offload"] == "none").unwrap();
    let summary = common::summary(&output_dir);
    for rank in 0..2 {
        for what in ["params", "grads", "optimizer_state", "host", "gathered_peak", "frozen"] {
            assert_eq!(predicted["state"][what], summary["state_per_rank"][rank][what], "rank {rank}: {what}");
        }
    }
}

#[test]
fn bad_calibration_files_are_refused_by_name() {
    let dir = tempfile::tempdir().unwrap();
    let model = model(&tiny_opt());
    let good = serde_json::to_value(calibrated_on_cpu(model.as_ref())).unwrap();
    let mut negative = good.clone();
    negative["gemms"][0]["flops_per_second"] = (-1.0).into();
    let mut newer = good.clone();
    newer["version"] = 2.into();
    let mut missing = good.clone();
    missing.as_object_mut().unwrap().remove("gemms");
    let cases = [
        ("garbage.json", "{not json".to_string(), "is not an `ft calibrate` file"),
        ("newer.json", newer.to_string(), "is calibration format 2, this ft reads format 1"),
        ("missing.json", missing.to_string(), "missing field `gemms`"),
        ("negative.json", negative.to_string(), "holds a rate that is not a positive number"),
    ];
    for (name, text, expected) in cases {
        let path = dir.path().join(name);
        std::fs::write(&path, text).unwrap();
        let error = format!("{:#}", plan::Calibration::load(&path).unwrap_err());
        assert!(error.contains(&path.display().to_string()) && error.contains(expected) && error.contains("ft calibrate"), "{name}: {error}");
    }
    let absent = dir.path().join("absent.json");
    let error = format!("{:#}", plan::Calibration::load(&absent).unwrap_err());
    assert!(error.contains(&absent.display().to_string()) && error.contains("cannot read"), "{error}");
}

#[test]
fn ft_calibrate_writes_what_ft_plan_and_the_plan_check_read() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("calibration.json");
    let config = tiny_opt();
    let shape = ["--batch", "2", "--seq", "16", "--dtype", "f32"];
    let output = ft()
        .args(["calibrate", "--config", config.to_str().unwrap(), "--device", "cpu", "--host-elements", "1000000", "--out", path.to_str().unwrap()])
        .args(shape)
        .output()
        .unwrap();
    assert!(output.status.success(), "{}", text(&output));
    assert!(text(&output).contains("host optimizer of offload cpu"), "{}", text(&output));
    let output = ft().args(["plan", "--model", config.to_str().unwrap(), "--gpu", "h100", "--calibration", path.to_str().unwrap()]).args(shape).output().unwrap();
    assert!(output.status.success() && text(&output).contains("rates measured on cpu by ft calibrate"), "{}", text(&output));
    // A bench row of the same shape beside the calibrated prediction.
    let output = ft()
        .args(["bench", "--config", config.to_str().unwrap(), "--device", "cpu", "--warmup", "1", "--steps", "2", "--gpu", "h100"])
        .args(["--plan-check", "--calibration", path.to_str().unwrap()])
        .args(shape)
        .output()
        .unwrap();
    let log = text(&output);
    assert!(output.status.success() && log.contains(&format!("plan check with the rates measured on cpu ({})", path.display())), "{log}");
    assert!(log.contains("| opt 0.0M | ddp | none | off | 1 | 2x16 |"), "{log}");
}

/// A LoRA step on a mixture of experts does the FLOPs of what a token runs:
/// the frozen weights of its k experts (forward and the input's gradient)
/// and the adapters of those experts, not of all E — so every row's step
/// takes time, and fewer FLOPs than the full fine-tune's.
#[test]
fn lora_on_a_mixture_of_experts_is_planned_by_the_parameters_a_token_runs() {
    let dir = tempfile::tempdir().unwrap();
    let config = Path::new(env!("CARGO_MANIFEST_DIR")).join("bench/configs/qwen3-30b-a3b.json");
    let plan = |extra: &[&str]| {
        let json = dir.path().join(format!("plan{}.json", extra.len()));
        let output = ft()
            .args(["plan", "--model", config.to_str().unwrap(), "--gpu", "h200", "--batch", "2", "--seq", "2048", "--json", json.to_str().unwrap()])
            .args(extra)
            .output()
            .unwrap();
        assert!(output.status.success(), "{}", text(&output));
        let plan: Value = serde_json::from_str(&std::fs::read_to_string(json).unwrap()).unwrap();
        plan["rows"].as_array().unwrap().clone()
    };
    let full = plan(&[]);
    let lora = plan(&["--lora-r", "16", "--lora-targets", "q,k,v,o,experts"]);
    let seconds = |row: &Value| row["step_seconds"].as_f64().unwrap();
    for row in lora.iter().filter(|r| r["offload"] == "none") {
        let same = full.iter().find(|f| f["strategy"] == row["strategy"] && f["offload"] == row["offload"] && f["activation_checkpointing"] == row["activation_checkpointing"]).unwrap();
        assert!(seconds(row) > 0.0 && seconds(row) < seconds(same), "LoRA {row} against the full fine-tune's {same}");
    }
}

#[test]
fn online_rls_rollout_holds_the_policy_whole_and_its_kv_cache_beside_the_state() {
    if skipped_without_configs(&["codellama-7b"]) {
        return;
    }
    let model = model(&shared_config("codellama-7b"));
    let registry = Registry::builtin();
    let cluster = h100s(1, 1);
    let plain = workload(model.as_ref(), 4, 576);
    // 32 completions a generation (4 x 8 micro-batches of one step), 512 new tokens after prompts of at most 64.
    let rollout = plan::RolloutShape { rows: 32, new_tokens: 512, positions: 576, steps: 1, gather: RolloutGather::Auto };
    let with_rollout = Workload { rollout: Some(rollout), ..plain };
    let setup = setup(&registry, "ddp", "none", true);
    let (without, with) = (plan::predict(&plain, &cluster, &setup).unwrap(), plan::predict(&with_rollout, &cluster, &setup).unwrap());
    // CodeLlama-7B: 6.738e9 parameters in bf16; its cache keeps 32 layers x (key + value) x 4096 bf16 values a token.
    let parameters: i64 = model.units().iter().map(|unit| unit.numel()).sum();
    assert!((parameters as f64 - 6.738e9).abs() < 1e7, "{parameters}");
    let kv_cache = 32.0 * 576.0 * 32.0 * 2.0 * 4096.0 * 2.0;
    let sampling = 32.0 * 32016.0 * 13.0;
    let rollout_bytes = with.rollout_bytes.expect("a rollout is planned");
    let expected = without.peak.state + parameters as f64 * 2.0 + kv_cache + sampling;
    assert!((rollout_bytes - expected).abs() < 1e6, "{rollout_bytes} vs {expected}");
    assert_eq!(with.peak_allocated_bytes, without.peak_allocated_bytes.max(rollout_bytes));
    // Its time: each of the 512 decoding steps reads the policy and the cache at the mean context (320
    // positions), and pays its 32 blocks' small kernels, more with each of the 32 rows.
    let bytes_per_token = (parameters as f64 + 32.0 * 320.0 * 32.0 * 2.0 * 4096.0) * 2.0;
    let seconds = 512.0 * (bytes_per_token / cluster.memory_bandwidth + 32.0 * (70.5e-6 + 32.0 * 0.329e-6));
    assert!((with.time.rollout - seconds).abs() < 1e-9 && (with.step_seconds - without.step_seconds - seconds).abs() < 1e-9, "{:?}", with.time);
    assert!(without.rollout_bytes.is_none() && without.time.rollout == 0.0);
}

/// ft's rollouts measured on an H200 (bench/results/2026-11-29-h200-grpo-kernel-cache/rows.json:
/// Qwen2.5-1.5B's shape at 32 and 64 completions, CodeLlama-7B's blocks with LoRA r16 on
/// every linear layer) are predicted within 25%: the roofline alone said 3-5 times faster.
#[test]
fn recorded_rollouts_are_predicted_within_a_quarter() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let recorded: Value = serde_json::from_str(&std::fs::read_to_string(root.join("bench/results/2026-11-29-h200-grpo-kernel-cache/rows.json")).unwrap()).unwrap();
    let registry = Registry::builtin();
    let cluster = Cluster::new(ft_core::gpu::GpuSpec::find(recorded["gpu"].as_str().unwrap()).unwrap(), 1, 1, Kind::BFloat16).unwrap();
    for row in recorded["rows"].as_array().unwrap() {
        let base = model(&root.join(row["config"].as_str().unwrap()));
        let model: Box<dyn Model> = match row["lora"].as_object() {
            None => base,
            Some(lora) => {
                let targets = lora["targets"].as_array().unwrap().iter().map(|t| t.as_str().unwrap().to_string()).collect();
                let config = ft_core::config::LoraConfig { r: lora["r"].as_u64().unwrap() as usize, alpha: lora["alpha"].as_f64(), dropout: 0.0, targets };
                Box::new(ft_core::lora::LoraModel::new(base, &config).unwrap())
            }
        };
        let (rows, new_tokens, positions) = (row["completions"].as_i64().unwrap(), row["new_tokens"].as_i64().unwrap(), row["positions"].as_i64().unwrap());
        let rollout = plan::RolloutShape { rows, new_tokens, positions, steps: 1, gather: RolloutGather::Whole };
        let planned = plan::predict(&Workload { rollout: Some(rollout), ..workload(model.as_ref(), 8, positions) }, &cluster, &setup(&registry, "ddp", "none", false)).unwrap();
        let measured = row["rollout_seconds"].as_f64().unwrap();
        let error = planned.time.rollout / measured - 1.0;
        eprintln!("{}: rollout planned {:.3} s, measured {measured} s ({:+.1}%)", row["row"], planned.time.rollout, 100.0 * error);
        assert!(error.abs() <= 0.25, "{}: ft plan's rollout {} s against {measured} s measured", row["row"], planned.time.rollout);
    }
}

/// Where the policy whole and its KV cache do not fit beside full_shard's
/// state but each stage's units gathered in turn do, `train.rollout_gather=auto`
/// plans the row per unit: it fits, its rollout holds the two largest
/// stages' units instead of the policy, and each of its decoding's 512
/// forwards gathers every unit over the 2 GPUs' NVLink. With room for the
/// policy whole, auto plans whole, as `whole` does; one GPU, which gathers
/// nothing, plans whole even when asked per unit.
#[test]
fn online_rls_rollout_is_planned_per_unit_where_the_whole_policy_does_not_fit() {
    if skipped_without_configs(&["codellama-7b"]) {
        return;
    }
    let model = model(&shared_config("codellama-7b"));
    let registry = Registry::builtin();
    let mut cluster = h100s(2, 1);
    let rollout = |gather| Some(plan::RolloutShape { rows: 16, new_tokens: 512, positions: 2048, steps: 1, gather });
    let plain = workload(model.as_ref(), 1, 576);
    let planned = |gather, cluster: &Cluster, strategy| plan::predict(&Workload { rollout: rollout(gather), ..plain }, cluster, &setup(&registry, strategy, "none", true)).unwrap();
    let (whole, per_unit) = (planned(RolloutGather::Whole, &cluster, "full_shard"), planned(RolloutGather::PerUnit, &cluster, "full_shard"));
    assert_eq!((whole.rollout_gather, per_unit.rollout_gather), (Some(RolloutGather::Whole), Some(RolloutGather::PerUnit)));
    let parameters: i64 = model.units().iter().map(|unit| unit.numel()).sum();
    let largest_unit = model.units().iter().map(|unit| unit.numel()).max().unwrap();
    let (whole_bytes, per_unit_bytes) = (whole.rollout_bytes.unwrap(), per_unit.rollout_bytes.unwrap());
    // The same state, cache and sampling buffers: the policy whole (bf16) against two blocks of it.
    assert!((whole_bytes - per_unit_bytes - (parameters - 2 * largest_unit) as f64 * 2.0).abs() < 1e6, "{whole_bytes} vs {per_unit_bytes}");
    // 512 forwards, each gathering every unit's bf16 values, half of them from the other GPU.
    let gathers = 512.0 * parameters as f64 * 2.0 * 0.5 / cluster.node_bus_bandwidth;
    assert!((per_unit.time.rollout - whole.time.rollout - gathers).abs() < 1e-3 * gathers, "{:?} vs {:?}", per_unit.time, whole.time);

    // A GPU between the two: auto samples per unit, and fits.
    assert!(per_unit.peak_gpu_bytes < whole.peak_gpu_bytes && whole.peak_gpu_bytes > whole.peak.total() * 1.05, "{per_unit:?}");
    cluster.gpu_memory = Some((whole.peak_gpu_bytes + per_unit.peak_gpu_bytes) / 2.0);
    let auto = planned(RolloutGather::Auto, &cluster, "full_shard");
    assert!(auto.fits && auto.rollout_gather == Some(RolloutGather::PerUnit) && auto.rollout_bytes == Some(per_unit_bytes), "{auto:?}");
    assert!(!planned(RolloutGather::Whole, &cluster, "full_shard").fits);
    cluster.gpu_memory = Some(whole.peak_gpu_bytes);
    let auto = planned(RolloutGather::Auto, &cluster, "full_shard");
    assert!(auto.fits && auto.rollout_gather == Some(RolloutGather::Whole) && auto.rollout_bytes == Some(whole_bytes), "{auto:?}");
    let one = h100s(1, 1);
    assert_eq!(planned(RolloutGather::PerUnit, &one, "ddp").rollout_gather, Some(RolloutGather::Whole));
}

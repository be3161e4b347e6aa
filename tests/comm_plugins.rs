//! Communication plug-ins built and loaded as a third party's are
//! (`cdylib`s of the workspace, `--plugin libX.so --comm X`), over real
//! processes and Gloo: an identity hook equals the built-in bit for bit;
//! PowerSGD at full rank equals the exact all-reduce, at rank 2 sends an
//! eighth of the bytes and trains about as well, and its state survives a
//! killed rank; bad choices are refused in one line.

use serde_json::Value;
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use tch::Tensor;

use crate::common;
use common::{ft, losses, summary, text};

/// Where cargo put the workspace's cdylibs (next to the test's deps/ directory).
fn library(name: &str) -> PathBuf {
    let exe = std::env::current_exe().unwrap();
    let path = exe.parent().unwrap().parent().unwrap().join(format!("lib{name}.so"));
    assert!(path.is_file(), "{} missing: run `cargo build --workspace` first (scripts/test.sh does)", path.display());
    path
}

/// `ft` with the in-tree communication plug-ins loaded.
fn ft_with_plugins() -> std::process::Command {
    let mut command = ft();
    for name in ["powersgd", "int8", "bf16", "ft_test_plugin_identity"] {
        command.args(["--plugin", library(name).to_str().unwrap()]);
    }
    command
}

/// Trains the demo BLOOM on `ranks` CPU ranks for 20 steps of a global
/// batch of `2 * ranks`, in fp32 unless `extra` says; returns the output directory.
fn train(scratch: &Path, name: &str, ranks: usize, extra: &[&str]) -> PathBuf {
    train_steps(scratch, name, ranks, 20, extra)
}

/// Steps enough to compare runs that must be equal (bit for bit, or to
/// rounding): a hook that changes a sum shows at its first steps, and each
/// run's cost is mostly its processes' start.
const EXACT_STEPS: usize = 6;

fn train_steps(scratch: &Path, name: &str, ranks: usize, steps: usize, extra: &[&str]) -> PathBuf {
    let dir = scratch.join(name);
    let dtype = if extra.contains(&"--dtype") { &[][..] } else { &["--dtype", "f32"][..] };
    let output = ft_with_plugins()
        .args(["train", "--output-dir", dir.to_str().unwrap(), "--epochs", "1", "--seed", "3"])
        .args(dtype)
        .args(["--train-samples", &(steps * 2 * ranks).to_string(), "--eval-samples", "4", "--batch-size", "2"])
        .args(["--nproc-per-node", &ranks.to_string(), "--report-to", "jsonl"])
        .args(extra)
        .output()
        .unwrap();
    assert!(output.status.success(), "{name}: {}", text(&output));
    dir
}

fn final_params(dir: &Path) -> HashMap<String, Tensor> {
    Tensor::read_safetensors(dir.join("final/model.safetensors")).unwrap().into_iter().collect()
}

/// The largest difference between the runs' final parameters, relative to each tensor's norm.
fn params_difference(a: &Path, b: &Path) -> f64 {
    let (a, b) = (final_params(a), final_params(b));
    assert_eq!(a.len(), b.len());
    a.iter()
        .map(|(key, x)| (x - &b[key]).norm().double_value(&[]) / b[key].norm().double_value(&[]).max(1e-12))
        .fold(0.0, f64::max)
}

#[test]
fn an_out_of_tree_identity_hook_equals_the_builtin_collectives_bit_for_bit() {
    let scratch = tempfile::tempdir().unwrap();
    // Three ranks, whose shards are uneven; `ft plugin check` (below) runs the hook at two.
    for ranks in [3] {
        for strategy in ["ddp", "full_shard"] {
            let builtin = train_steps(scratch.path(), &format!("{strategy}-{ranks}"), ranks, EXACT_STEPS, &["--strategy", strategy]);
            let hooked = train_steps(scratch.path(), &format!("{strategy}-{ranks}-identity"), ranks, EXACT_STEPS, &["--strategy", strategy, "--comm", "identity"]);
            assert_eq!(losses(&hooked), losses(&builtin), "{strategy} at {ranks} ranks");
            assert_eq!(losses(&hooked).len(), EXACT_STEPS);
            assert_eq!(params_difference(&hooked, &builtin), 0.0, "{strategy} at {ranks} ranks: final parameters");
            assert_eq!(summary(&hooked)["comm_bytes_per_step"], summary(&builtin)["comm_bytes_per_step"]);
        }
    }
}

#[test]
fn powersgd_at_full_rank_equals_the_exact_all_reduce() {
    let scratch = tempfile::tempdir().unwrap();
    // Every matrix compressed (no minimum rate), from the first step, at a
    // rank no gradient matrix exceeds: the factors span the whole sum.
    let full_rank = ["--set", "comm.powersgd.rank=100000", "--set", "comm.powersgd.start_iter=0", "--set", "comm.powersgd.min_compression_rate=0"];
    let hybrid = ["--strategy", "hybrid_shard", "--shard-group-size", "2"];
    let runs = [
        ("ddp", 2, &["--strategy", "ddp"][..]),
        // The replica stage across the 2 shard groups is what PowerSGD compresses.
        ("hybrid_2x2", 4, &hybrid[..]),
        // Offloaded, the replica stage runs every micro-batch on the gradient's way to the host.
        ("hybrid_2x2_offload", 4, &[&hybrid[..], &["--offload", "cpu"]].concat()),
    ];
    for (name, ranks, strategy) in runs {
        let exact = train_steps(scratch.path(), name, ranks, EXACT_STEPS, strategy);
        let compressed = train_steps(scratch.path(), &format!("{name}-powersgd"), ranks, EXACT_STEPS, &[strategy, &["--comm", "powersgd"], &full_rank[..]].concat());
        assert_eq!(losses(&compressed).len(), EXACT_STEPS);
        for (step, (x, y)) in losses(&compressed).iter().zip(losses(&exact)).enumerate() {
            assert!((x - y).abs() <= 1e-5 * y.abs(), "{name} step {}: {x} vs exact {y}", step + 1);
        }
        let difference = params_difference(&compressed, &exact);
        assert!(difference <= 1e-4, "{name}: final parameters differ by {difference:e}");
        let bytes = |dir: &Path| summary(dir)["comm_bytes_per_step"]["all_reduce"].as_f64().unwrap();
        assert!(bytes(&compressed) > bytes(&exact), "{name}: full-rank factors send more than the matrices themselves");
    }
}

#[test]
fn powersgd_at_rank_2_sends_an_eighth_of_ddps_bytes_and_trains_about_as_well() {
    let scratch = tempfile::tempdir().unwrap();
    let run = |name: &str, extra: &[&str]| {
        let dir = scratch.path().join(name);
        let output = ft_with_plugins()
            .args(["train", "--output-dir", dir.to_str().unwrap(), "--epochs", "3", "--report-to", "jsonl"])
            .args(extra)
            .output()
            .unwrap();
        assert!(output.status.success(), "{name}: {}", text(&output));
        summary(&dir)
    };
    // The demo (its preset: 2 CPU ranks, ddp), three of its seven epochs.
    let ddp = run("ddp", &[]);
    let powersgd = run("powersgd", &["--comm", "powersgd", "--set", "comm.powersgd.rank=2"]);
    let eval_loss = |s: &Value| s["epochs"].as_array().unwrap().last().unwrap()["eval_loss"].as_f64().unwrap();
    let (compressed, exact) = (eval_loss(&powersgd), eval_loss(&ddp));
    // Within 8%: a rank-2 compression of every gradient is not the exact sum, and how far three epochs
    // carry that apart depends on the processor's rounding (within 5% on CI's; 5.4% on a Sapphire
    // Rapids-class one, 2026-11-27). And it learns: each epoch's evaluation below the one before.
    assert!((compressed - exact).abs() <= 0.08 * exact, "eval loss {compressed} with powersgd vs {exact} with ddp");
    let epochs: Vec<f64> = powersgd["epochs"].as_array().unwrap().iter().map(|e| e["eval_loss"].as_f64().unwrap()).collect();
    assert!(epochs.windows(2).all(|pair| pair[1] < pair[0]), "powersgd's evaluation losses by epoch: {epochs:?}");
    let bytes = |s: &Value| s["comm_bytes_per_step"]["all_reduce"].as_f64().unwrap();
    let ratio = bytes(&powersgd) / bytes(&ddp);
    eprintln!("powersgd rank 2 / ddp all-reduce bytes per step: {ratio:.4}; eval loss {compressed:.4} vs {exact:.4}");
    assert!(ratio <= 1.0 / 8.0, "powersgd sends {ratio:.3} of ddp's all-reduce bytes");
}

#[test]
fn int8_gathers_track_full_shard_within_a_percent_at_about_half_the_bytes_of_bf16() {
    let scratch = tempfile::tempdir().unwrap();
    let gathered = |dir: &Path| summary(dir)["comm_bytes_per_step"]["all_gather"].as_f64().unwrap();
    for dtype in ["f32", "bf16"] {
        let exact = train_steps(scratch.path(), &format!("full_shard-{dtype}"), 2, 50, &["--strategy", "full_shard", "--dtype", dtype]);
        let quantized = train_steps(scratch.path(), &format!("int8-{dtype}"), 2, 50, &["--strategy", "full_shard", "--dtype", dtype, "--comm", "int8"]);
        let (a, b) = (losses(&quantized), losses(&exact));
        assert_eq!(a.len(), 50);
        for (step, (x, y)) in a.iter().zip(&b).enumerate() {
            assert!((x - y).abs() <= 0.01 * y.abs(), "{dtype} step {}: int8 {x} vs full_shard {y}", step + 1);
        }
        assert!(a != b, "{dtype}: int8 gathers are lossy, so some loss must differ");
        // What the same gathers would send in bf16: the f32 run's, halved.
        let bf16_gathers = gathered(&exact) * if dtype == "f32" { 0.5 } else { 1.0 };
        let ratio = gathered(&quantized) / bf16_gathers;
        eprintln!("{dtype}: int8 all-gather bytes per step / bf16 gathers': {ratio:.4}");
        assert!(ratio <= 0.55, "{dtype}: int8 gathers send {ratio:.3} of bf16 gathers' bytes");
    }
    // Quantized gradient reduce-scatters (all-to-all of int8 blocks) too.
    let exact = train(scratch.path(), "zero2", 2, &["--strategy", "shard_grad_op"]);
    let quantized = train(scratch.path(), "zero2-int8-grads", 2, &["--strategy", "shard_grad_op", "--comm", "int8", "--set", "comm.int8.grads=true"]);
    for (step, (x, y)) in losses(&quantized).iter().zip(losses(&exact)).enumerate() {
        assert!((x - y).abs() <= 0.01 * y.abs(), "int8 grads step {}: {x} vs {y}", step + 1);
    }
    let all_to_all = summary(&quantized)["comm_bytes_per_step"]["all_to_all"].as_f64().unwrap();
    let reduce_scatter = summary(&exact)["comm_bytes_per_step"]["reduce_scatter"].as_f64().unwrap();
    assert!(all_to_all > 0.0 && all_to_all <= 0.3 * reduce_scatter, "int8 all-to-all {all_to_all} vs fp32 reduce-scatter {reduce_scatter}");
}

#[test]
fn a_killed_powersgd_rank_resumes_to_the_uninterrupted_losses() {
    let scratch = tempfile::tempdir().unwrap();
    let flags = ["--comm", "powersgd", "--set", "comm.powersgd.start_iter=2", "--set", "comm.powersgd.rank=2", "--save-every", "3", "--save-total-limit", "0"];
    let whole = train(scratch.path(), "whole", 2, &flags);
    let expected = losses(&whole);

    // Rank 1 dies after step 7; rank 0 finds its peer gone and fails too.
    let killed = scratch.path().join("killed");
    let args = |resume: bool| {
        let mut command = ft_with_plugins();
        command
            .args(["train", "--output-dir", killed.to_str().unwrap(), "--epochs", "1", "--seed", "3", "--dtype", "f32"])
            .args(["--train-samples", "80", "--eval-samples", "4", "--batch-size", "2", "--nproc-per-node", "2", "--report-to", "jsonl"])
            .args(flags);
        if resume {
            command.args(["--resume", "latest"]);
        }
        command
    };
    let output = args(false).env("FT_FAULT_INJECT", "after-step:7@1").output().unwrap();
    assert!(!output.status.success() && text(&output).contains("FT_FAULT_INJECT: aborting"), "{}", text(&output));
    let latest = ft_core::checkpoint::list(&killed).unwrap();
    let from = ft_core::checkpoint::read_manifest(latest.last().unwrap()).unwrap();
    assert!(from.step == 6 || from.step == 3, "resuming from step {}", from.step);
    assert_eq!(from.comm.as_ref().unwrap().name, "powersgd");

    let output = args(true).output().unwrap();
    assert!(output.status.success(), "{}", text(&output));
    // The log repeats what the hook's load_state says it kept.
    assert!(text(&output).contains("comm `powersgd`: restored its state: ") && text(&output).contains("Q matrices"), "{}", text(&output));
    let all = losses(&killed);
    assert_eq!(&all[all.len() - (20 - from.step)..], &expected[from.step..], "resumed losses differ from the uninterrupted run");

    // Resumed with other options, the state starts afresh, and the log says so.
    let output = args(true).args(["--set", "comm.powersgd.rank=3", "--epochs", "2"]).output().unwrap();
    assert!(output.status.success(), "{}", text(&output));
    assert!(text(&output).contains("holds the state of comm `powersgd`") && text(&output).contains("starts afresh"), "{}", text(&output));

    // The same options with a default written out (min_compression_rate is 2,
    // as 2.0) are the same options: the state saved without it is restored.
    let output = args(true).args(["--set", "comm.powersgd.rank=3", "--set", "comm.powersgd.min_compression_rate=2.0", "--epochs", "3"]).output().unwrap();
    assert!(output.status.success(), "{}", text(&output));
    assert!(text(&output).contains("comm `powersgd`: restored its state: ") && !text(&output).contains("starts afresh"), "{}", text(&output));
}

#[test]
fn bad_communication_choices_are_refused_in_one_line() {
    let scratch = tempfile::tempdir().unwrap();
    // Each attempt is a run of its own: a failed one may leave outputs that a fresh run into its directory is refused over.
    let attempts = std::cell::Cell::new(0);
    let refused = |extra: &[&str]| {
        attempts.set(attempts.get() + 1);
        let dir = scratch.path().join(format!("refused-{}", attempts.get()));
        let output = ft_with_plugins()
            .args(["train", "--output-dir", dir.to_str().unwrap(), "--epochs", "1", "--train-samples", "8", "--eval-samples", "4"])
            .args(extra)
            .output()
            .unwrap();
        assert!(!output.status.success(), "{extra:?} was accepted");
        text(&output)
    };
    let message = refused(&["--comm", "powersdg"]);
    assert!(message.contains("unknown comm plug-in `powersdg`; did you mean `powersgd`?"), "{message}");
    let message = refused(&["--comm", "powersgd", "--set", "comm.powersgd.rnak=4"]);
    assert!(message.contains("unknown option comm.powersgd.rnak; did you mean `rank`?") && message.contains("valid: rank, start_iter"), "{message}");
    let message = refused(&["--comm", "powersgd", "--set", "comm.powersgd.rank=0"]);
    assert!(message.contains("comm.powersgd.rank must be at least 1"), "{message}");
    let message = refused(&["--comm", "powersgd", "--set", "comm.powersgd.rank=\"four\""]);
    assert!(message.contains("comm.powersgd.rank = \"four\""), "{message}");
    let message = refused(&["--comm", "powersgd", "--strategy", "full_shard"]);
    assert!(message.contains("comm `powersgd` cannot serve this run") && message.contains("reduce-scatters every gradient"), "{message}");
    let message = refused(&["--set", "comm.nosuch.x=1"]);
    assert!(message.contains("unknown comm plug-in `nosuch`"), "{message}");
    // A hook that fails, or panics, stops the run with its name and message on every rank.
    let message = refused(&["--comm", "identity", "--set", "comm.identity.fault=\"error\""]);
    assert!(message.contains("comm `identity`: world all-reduce of unit") && message.contains("fails on purpose at step 1"), "{message}");
    let message = refused(&["--comm", "identity", "--set", "comm.identity.fault=\"panic\""]);
    assert!(message.contains("comm `identity`") && message.contains("the reduction panicked: the identity fixture panics on purpose"), "{message}");
    // `--dry-run` asks the hook too: a strategy it refuses is refused before anything runs.
    let message = refused(&["--comm", "powersgd", "--strategy", "full_shard", "--dry-run"]);
    assert!(message.contains("comm `powersgd` cannot serve this run") && message.contains("reduce-scatters every gradient"), "{message}");
    let output = ft_with_plugins().args(["train", "--comm", "powersgd", "--strategy", "ddp", "--dry-run"]).output().unwrap();
    assert!(output.status.success() && text(&output).contains("comm `powersgd` serves this run"), "{}", text(&output));
    // Without the plug-in loaded, the name is unknown and the message says what is registered.
    let output = ft().args(["train", "--comm", "powersgd", "--dry-run"]).output().unwrap();
    assert!(!output.status.success() && text(&output).contains("registered: builtin"), "{}", text(&output));
}

#[test]
fn ft_plugin_check_passes_the_in_tree_plugins_and_catches_broken_ones() {
    // Where the kit keeps its runs and the logs of failed ones.
    let scratch = tempfile::tempdir().unwrap();
    // The built-in runs are the same for every check of a strategy (neither the hook's library nor its
    // comm.* settings enter them): made once, by the first check that needs them, then reused.
    let cache = scratch.path().join("builtin-runs");
    // The faults are the hook's whatever the strategy: they are checked under ddp alone.
    let check_under = |strategies: &str, name: &str, extra: &[&str]| {
        let output = ft()
            .args(["plugin", "check", library(name).to_str().unwrap(), "--strategy", strategies, "--steps", "6"])
            .args(["--cache", cache.to_str().unwrap()])
            .args(extra)
            .env("TMPDIR", scratch.path())
            .output()
            .unwrap();
        (output.status.success(), text(&output))
    };
    let check = |name: &str, extra: &[&str]| check_under("ddp", name, extra);
    // Each plug-in under the strategies its hook changes: powersgd's all-reduce (and its refusal of full_shard),
    // int8's gathers, bf16's reductions. The identity hook's runs are the test above's, and its faults' below.
    for (name, strategies, extra) in [
        ("powersgd", "ddp,full_shard", &["--set", "comm.powersgd.start_iter=2"][..]),
        ("int8", "full_shard", &[][..]),
        ("bf16", "ddp", &[][..]),
    ] {
        let (passed, table) = check_under(strategies, name, extra);
        assert!(passed && table.contains(" 0 failed"), "{name}:\n{table}");
        // Both runs' losses, step by step, under each compared row: the built-in's, the plug-in's, the gap, what is allowed.
        let steps: Vec<Vec<&str>> = table.lines().map(|l| l.split_whitespace().collect::<Vec<_>>()).filter(|w| w.len() == 5 && w[0].parse::<usize>().is_ok()).collect();
        assert!(steps.iter().filter(|w| w[0] == "6").count() >= 2 && steps.iter().all(|w| w[1].parse::<f64>().is_ok() && w[2].parse::<f64>().is_ok()), "{name}:\n{table}");
        let resumed = table.lines().find(|l| l.contains("save, kill rank 1 after step 5, resume")).unwrap_or_default();
        assert!(resumed.contains(" ok ") && resumed.contains("equal bit for bit"), "{name}:\n{table}");
        let exchanged = table.lines().find(|l| l.contains("all-to-all at 2 and 3 ranks")).unwrap_or_default();
        assert!(exchanged.contains(" ok ") && exchanged.contains("every rank received what the others sent it"), "{name}:\n{table}");
        // At 3 ranks powersgd keeps its Q matrices (its `reshard_state`); the others keep no state.
        let wider = table.lines().find(|l| l.contains("resume at 3 ranks")).unwrap_or_default();
        let declared = if name == "powersgd" { "it re-shards:" } else { "it keeps no state" };
        assert!(wider.contains(" ok ") && wider.contains(declared), "{name}:\n{table}");
        if name == "powersgd" {
            assert!(table.contains("full_shard at 2 ranks") && table.contains("skip  the hook refuses it"), "{table}");
        }
        // ddp's built-in runs were made by powersgd's check, full_shard's by int8's.
        let reused = table.matches("the built-in's losses reused from").count();
        assert_eq!(reused, if name == "bf16" { 2 } else { 0 }, "{name}:\n{table}");
    }

    // Ranks that send different sizes: reported by unit and call, not a hang.
    let (passed, table) = check("ft_test_plugin_identity", &["--set", "comm.identity.fault=\"sizes\""]);
    assert!(!passed && table.contains("FAIL") && table.contains("ranks issue different collectives"), "{table}");
    assert!(table.contains("reduced unit") && table.contains("all_reduce of"), "{table}");
    let (passed, table) = check("ft_test_plugin_identity", &["--set", "comm.identity.fault=\"error\""]);
    assert!(!passed && table.contains("comm `identity`") && table.contains("fails on purpose at step 1"), "{table}");
    // Failed at 2 ranks, it is not run again at 3.
    assert!(table.lines().any(|l| l.contains("ddp at 3 ranks") && l.contains("skip") && l.contains("its run failed at 2 ranks")), "{table}");
    // The failing run's whole output is kept in a log the row names, and its last lines are shown under it.
    let log = table.split("every rank's output: ").nth(1).and_then(|rest| rest.split(')').next()).unwrap_or_else(|| panic!("no log named:\n{table}"));
    let kept = std::fs::read_to_string(log).unwrap();
    assert!(kept.contains("fails on purpose at step 1") && kept.contains("[rank 1]"), "{log}:\n{kept}");
    assert!(table.lines().any(|l| l.trim_start().starts_with("| ") && l.contains("fails on purpose")), "{table}");
    // Losses off the built-in's fail their rows, yet the resume is judged on its own: against the plug-in's uninterrupted run.
    let (passed, table) = check("ft_test_plugin_identity", &["--set", "comm.identity.fault=\"drift\""]);
    assert!(!passed && table.contains("declared exact, but step "), "{table}");
    let resumed = table.lines().find(|l| l.contains("save, kill rank 1 after step 5, resume")).unwrap_or_default();
    assert!(resumed.contains(" ok ") && resumed.contains("equal bit for bit"), "{table}");
    let (passed, table) = check("ft_test_plugin_identity", &["--set", "comm.identity.fault=\"panic\""]);
    assert!(!passed && table.contains("panicked: the identity fixture panics on purpose"), "{table}");
    let (passed, table) = check("ft_test_plugin_abi", &[]);
    assert!(!passed && table.contains("loads") && table.contains(&format!("ABI major 999, this ft loads {}", ft_core::abi::ABI_MAJOR)), "{table}");
}

/// A hook's all-to-all (expert parallelism's token exchange) goes through
/// the plug-in: `ft comm-test --comm` sends uneven rows between 3 ranks
/// through the identity hook and gets the values expected, and the same
/// hook sending its rows in the wrong order is caught.
#[test]
fn a_plugin_serves_the_all_to_all_and_a_wrong_one_is_caught() {
    let exchange = |fault: &str| {
        let output = ft()
            .args(["launch", "--nproc-per-node", "3", "--", "--plugin", library("ft_test_plugin_identity").to_str().unwrap()])
            .args(["comm-test", "--backend", "gloo", "--comm", "identity", "--ops", "all_to_all", "--min-bytes", "4K", "--max-bytes", "4K"])
            .args(["--warmup", "0", "--iters", "1", "--set", &format!("comm.identity.fault=\"{fault}\"")])
            .output()
            .unwrap();
        (output.status.success(), text(&output))
    };
    let (passed, log) = exchange("none");
    assert!(passed && log.contains("all collectives gave the expected values on all 3 ranks"), "{log}");
    // Rank 0 sends 340, 342 and 341 elements to ranks 0, 1 and 2: the splits differ by rank.
    assert!(log.contains("all_to_all") && log.contains(" 1023 "), "{log}");
    let (passed, log) = exchange("rows");
    assert!(!passed && log.contains("collective check(s) failed across the ranks"), "{log}");
}

/// A copy of the template (its Cargo.lock and build.sh too) in `scratch`,
/// its ft-core pointed at this checkout's.
fn template_copy(scratch: &Path) -> PathBuf {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let template = root.join("examples/comm-plugin-template");
    let copy = scratch.join("my-plugin");
    std::fs::create_dir_all(copy.join("src")).unwrap();
    let manifest = std::fs::read_to_string(template.join("Cargo.toml")).unwrap();
    let core = root.join("core");
    std::fs::write(copy.join("Cargo.toml"), manifest.replace("path = \"../../core\"", &format!("path = {:?}", core.to_str().unwrap()))).unwrap();
    for file in ["src/lib.rs", "Cargo.lock", "build.sh"] {
        std::fs::copy(template.join(file), copy.join(file)).unwrap();
    }
    copy
}

/// The template a plug-in author copies builds outside ft's workspace with
/// the one command PLUGINS.md gives, `./build.sh`, from a shell without
/// ft's environment, and passes `ft plugin check`.
#[test]
fn the_template_builds_with_its_one_command_and_passes_the_check() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let scratch = tempfile::tempdir().unwrap();
    let copy = template_copy(scratch.path());
    // What scripts/env.sh sets, unset: build.sh must set it itself.
    let path = std::env::var("PATH").unwrap_or_default();
    let path: Vec<&str> = path.split(':').filter(|dir| !dir.contains(".venv")).collect();
    let output = std::process::Command::new(copy.join("build.sh"))
        .env_remove("LIBTORCH_USE_PYTORCH")
        .env_remove("LIBTORCH")
        .env_remove("RUSTFLAGS")
        .env_remove("VIRTUAL_ENV")
        // What scripts/test.sh gives the test processes (for libtest's --report-time): cargo rebuilds every crate under it.
        .env_remove("RUSTC_BOOTSTRAP")
        .env("PATH", path.join(":"))
        // ft's own build directory, so the dependencies ft was built with are reused (a fresh one compiles libtorch's bindings for minutes).
        .env("CARGO_TARGET_DIR", root.join("target"))
        .env("CARGO_NET_OFFLINE", "true")
        .output()
        .unwrap();
    assert!(output.status.success(), "{}", text(&output));
    // ft's compiled dependencies are reused: below ft-core every crate is built with the features ft's workspace
    // unifies (core/unified-features), so only ft's own path crates compile again (cargo hashes a path crate by
    // its path from the workspace that builds it) — not tch's bindings, nor anything else from crates.io.
    let log = text(&output);
    let ours = ["ft-comm-template", "ft-sys", "ft-core", "ft-unified-features"];
    let recompiled: Vec<&str> = log.lines().map(str::trim).filter(|l| l.starts_with("Compiling ") && !ours.iter().any(|c| l.starts_with(&format!("Compiling {c} ")))).collect();
    assert!(recompiled.is_empty(), "the template's build compiled dependencies ft's had: their features differ outside the workspace (`cargo hakari generate`, core/Cargo.toml), or ft was built in another environment (RUSTC_BOOTSTRAP, RUSTFLAGS): {recompiled:?}");
    let library = root.join("target/debug/libtemplate.so");
    let output = ft().args(["plugin", "check", library.to_str().unwrap(), "--strategy", "ddp", "--steps", "6"]).output().unwrap();
    assert!(output.status.success() && text(&output).contains(" 0 failed"), "{}", text(&output));
}

/// The template's Cargo.lock, which a plug-in starts from, holds the
/// versions ft's own lock does: the crates that cross the boundary (what
/// the loader checks) and the rest (what ft was built and tested with).
#[test]
fn the_template_lock_pins_the_versions_ft_is_built_with() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let packages = |path: &Path| -> Vec<(String, String)> {
        let text = std::fs::read_to_string(path).unwrap();
        text.split("[[package]]").skip(1).map(|p| {
            let field = |key: &str| p.lines().find_map(|l| l.strip_prefix(&format!("{key} = \""))).unwrap().trim_end_matches('"').to_string();
            (field("name"), field("version"))
        }).collect()
    };
    let ours = packages(&root.join("Cargo.lock"));
    let template = packages(&root.join("examples/comm-plugin-template/Cargo.lock"));
    for (name, version) in template.iter().filter(|(name, _)| name != "ft-comm-template") {
        assert!(ours.contains(&(name.clone(), version.clone())), "the template's Cargo.lock has {name} {version}, which ft's Cargo.lock does not");
    }
    for shared in ft_core::abi::SHARED_CRATES.split(", ") {
        let (name, version) = shared.split_once(' ').unwrap();
        assert!(template.contains(&(name.to_string(), version.to_string())), "the template's Cargo.lock lacks {shared}");
    }
}

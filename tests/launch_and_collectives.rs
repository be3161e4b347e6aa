//! Real processes over c10d Gloo and over shared memory between the ranks
//! of a host: collective values on 2 and 4 ranks (with hybrid sub-groups
//! and as two "nodes"), training through either, failure propagation, dead
//! peers, and bad input rejected with clear messages.

use serde_json::Value;
use std::io::{BufRead, BufReader};
use std::path::Path;
use std::os::unix::process::CommandExt;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use crate::common;
use common::{text, without_launcher_env, FT};

fn ft(args: &[&str]) -> Command {
    let mut command = common::ft();
    command.args(args).env("RUST_LOG", "info");
    command
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

/// A comm-test over Gloo small enough for CI, checking f32 and bf16 values.
const SMALL_SWEEP: &[&str] = &[
    "comm-test", "--backend", "gloo", "--timeout-secs", "60", "--min-bytes", "4K", "--max-bytes", "16K",
    "--dtype", "f32,bf16", "--warmup", "0", "--iters", "1",
];

fn rows(json: &Path) -> Vec<Value> {
    let report: Value = serde_json::from_str(&std::fs::read_to_string(json).unwrap()).unwrap();
    report["rows"].as_array().unwrap().clone()
}

/// Every (collective, size, dtype) of the sweep appears for each group and is correct.
fn assert_all_checked(rows: &[Value], groups: &[&str]) {
    let per_group = 5 * 2 * 2; // collectives × sizes (4K, 16K) × dtypes
    assert_eq!(rows.len(), per_group * groups.len(), "{rows:#?}");
    for row in rows {
        assert_eq!(row["correct"], Value::Bool(true), "{row}");
        assert!(groups.contains(&row["group"].as_str().unwrap()), "{row}");
    }
}

/// ft links no CUDA library: where the host has no NVIDIA device nodes none
/// loads (they were 40% of each process's start), and where it has them ft
/// opens them first thing (core/sys/src/cuda.rs).
#[test]
fn cuda_libraries_load_only_where_there_are_gpus() {
    let output = ft(&["--version"]).env("LD_DEBUG", "files").output().unwrap();
    assert!(output.status.success(), "{}", text(&output));
    let loader = String::from_utf8_lossy(&output.stderr);
    let gpus = ft_sys::cuda::host_has_gpus();
    for library in ["libtorch_cuda.so", "libc10_cuda.so", "libcublas.so", "libnccl.so"] {
        assert_eq!(loader.contains(library), gpus, "{library} loaded: {}; GPUs here: {gpus}", loader.contains(library));
    }
    assert!(loader.contains("libtorch_cpu.so"), "the loader's trace names what it loads:\n{loader}");
}

/// What `ft comm-test` says of a group of ranks on one host that exchange through shared memory.
const THROUGH_SHARED_MEMORY: &str = "backend gloo (shared memory within this host)";

#[test]
fn collectives_are_correct_on_2_ranks_through_shared_memory_and_through_gloo() {
    for shared_memory in [true, false] {
        let dir = tempfile::tempdir().unwrap();
        let json = dir.path().join("out.json");
        let setting = format!("dist.shared_memory={shared_memory}");
        let mut args = vec!["launch", "--nproc-per-node", "2", "--"];
        args.extend_from_slice(SMALL_SWEEP);
        args.extend_from_slice(&["--set", &setting, "--json", json.to_str().unwrap()]);
        let output = ft(&args).output().unwrap();
        assert!(output.status.success(), "{}", text(&output));
        assert!(text(&output).contains("all collectives gave the expected values on all 2 ranks"));
        assert_eq!(text(&output).contains(THROUGH_SHARED_MEMORY), shared_memory, "{}", text(&output));
        assert_all_checked(&rows(&json), &["world"]);
    }
}

/// Two ranks sum in either order to the same bits: a run through shared
/// memory is the run through Gloo's sockets, loss for loss and weight for weight.
#[test]
fn training_through_shared_memory_equals_training_through_gloo() {
    let dir = tempfile::tempdir().unwrap();
    let run = |name: &str, shared_memory: bool| {
        let out = dir.path().join(name);
        let output = common::ft()
            .args(["train", "--output-dir", out.to_str().unwrap(), "--train-samples", "48", "--eval-samples", "4", "--epochs", "1"])
            .args(["--nproc-per-node", "2", "--batch-size", "4", "--set", &format!("dist.shared_memory={shared_memory}")])
            .output()
            .unwrap();
        assert!(output.status.success(), "{}", text(&output));
        out
    };
    let (shared, sockets) = (run("shared", true), run("sockets", false));
    let losses = common::losses(&shared);
    assert!(losses.len() >= 6, "{losses:?}");
    assert_eq!(losses, common::losses(&sockets));
    let weights = |dir: &Path| std::fs::read(dir.join("final/model.safetensors")).unwrap();
    assert!(weights(&shared) == weights(&sockets), "the final weights differ");
}

#[test]
fn collectives_are_correct_on_4_ranks_with_hybrid_subgroups() {
    let dir = tempfile::tempdir().unwrap();
    let json = dir.path().join("out.json");
    let mut args = vec!["launch", "--nproc-per-node", "4", "--"];
    args.extend_from_slice(SMALL_SWEEP);
    args.extend_from_slice(&["--group-size", "2", "--json", json.to_str().unwrap()]);
    let output = ft(&args).output().unwrap();
    assert!(output.status.success(), "{}", text(&output));
    let rows = rows(&json);
    assert_all_checked(&rows, &["world", "shard0", "replica0"]);
    let sizes: Vec<u64> = rows.iter().map(|r| r["group_size"].as_u64().unwrap()).collect();
    assert!(sizes.contains(&4) && sizes.contains(&2));
}

#[test]
fn two_nodes_rendezvous_and_split_by_node() {
    let dir = tempfile::tempdir().unwrap();
    let json = dir.path().join("out.json");
    let port = free_port().to_string();
    let nodes: Vec<_> = (0..2)
        .map(|node| {
            let node_rank = node.to_string();
            let mut args = vec![
                "launch", "--nnodes", "2", "--node-rank", &node_rank, "--nproc-per-node", "2", "--master-addr",
                "127.0.0.1", "--master-port", &port, "--",
            ];
            args.extend_from_slice(SMALL_SWEEP);
            args.extend_from_slice(&["--group-size", "2", "--json", json.to_str().unwrap()]);
            ft(&args).stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().unwrap()
        })
        .collect();
    for node in nodes {
        let output = node.wait_with_output().unwrap();
        assert!(output.status.success(), "{}", text(&output));
    }
    let report: Value = serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    assert_eq!(report["nodes"], 2);
    assert_all_checked(report["rows"].as_array().unwrap(), &["world", "shard0", "replica0"]);
}

#[test]
fn launch_sets_torchrun_environment_and_prefixes_output() {
    let output = ft(&[
        "launch", "--nproc-per-node", "2", "--exec", "--", "sh", "-c",
        "echo \"$RANK/$WORLD_SIZE/$LOCAL_RANK/$LOCAL_WORLD_SIZE/$MASTER_ADDR\"",
    ])
    .output()
    .unwrap();
    assert!(output.status.success(), "{}", text(&output));
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(stdout.contains("[rank 0] 0/2/0/2/127.0.0.1"), "{stdout}");
    assert!(stdout.contains("[rank 1] 1/2/1/2/127.0.0.1"), "{stdout}");
}

#[test]
fn launch_stops_the_others_and_propagates_a_failing_exit_code() {
    let started = Instant::now();
    let output = ft(&[
        "launch", "--nproc-per-node", "3", "--grace-secs", "2", "--exec", "--", "sh", "-c",
        "if [ \"$RANK\" = 1 ]; then exit 3; fi; sleep 60",
    ])
    .output()
    .unwrap();
    assert_eq!(output.status.code(), Some(3), "{}", text(&output));
    assert!(started.elapsed() < Duration::from_secs(20), "the sleeping ranks were not stopped");
    assert!(text(&output).contains("rank 1 exited with code 3; stopping the other ranks"), "{}", text(&output));
}

/// Starts one comm-test worker by hand (as torchrun would) with a long timed loop.
fn worker(rank: usize, port: u16, timeout_secs: &str, shared_memory: bool) -> std::process::Child {
    ft(&[
        "comm-test", "--backend", "gloo", "--timeout-secs", timeout_secs, "--min-bytes", "1M", "--max-bytes", "1M",
        "--ops", "all_reduce", "--iters", "100000000", "--set", &format!("dist.shared_memory={shared_memory}"),
    ])
    .env("RANK", rank.to_string())
    .env("WORLD_SIZE", "2")
    .env("MASTER_ADDR", "127.0.0.1")
    .env("MASTER_PORT", port.to_string())
    .stdout(Stdio::piped())
    .stderr(Stdio::piped())
    .spawn()
    .unwrap()
}

#[test]
fn a_killed_rank_makes_the_others_fail_with_a_clear_error_not_hang() {
    // Gloo finds the closed socket; through shared memory, the peer's process gone.
    for (shared_memory, within) in [(false, 20), (true, 2)] {
        a_killed_rank_is_found(shared_memory, Duration::from_secs(within));
    }
}

fn a_killed_rank_is_found(shared_memory: bool, within: Duration) {
    let port = free_port();
    let timeout_secs = 10;
    let survivor = worker(0, port, &timeout_secs.to_string(), shared_memory);
    let mut victim = worker(1, port, &timeout_secs.to_string(), shared_memory);
    // Kill the victim once it is inside the collectives loop.
    let mut victim_log = BufReader::new(victim.stderr.take().unwrap());
    let mut line = String::new();
    while !line.contains("rendezvous complete") {
        line.clear();
        assert!(victim_log.read_line(&mut line).unwrap() > 0, "rank 1 ended before rendezvous");
    }
    assert_eq!(line.contains(THROUGH_SHARED_MEMORY), shared_memory, "{line}");
    std::thread::sleep(Duration::from_millis(500));
    victim.kill().unwrap();
    victim.wait().unwrap();
    let killed_at = Instant::now();
    let output = survivor.wait_with_output().unwrap();
    let waited = killed_at.elapsed();
    assert!(!output.status.success());
    assert!(waited < within, "rank 0 took {waited:?} to notice");
    let message = String::from_utf8_lossy(&output.stderr);
    assert!(message.contains("on group 'world' failed on rank 0 of 2"), "{message}");
    if shared_memory {
        assert!(message.contains("group rank 1 (process ") && message.contains(") ended while the others waited for it in shared memory"), "{message}");
    }
}

#[test]
fn a_missing_rank_fails_rendezvous_within_the_timeout() {
    let started = Instant::now();
    let mut lonely = worker(0, free_port(), "3", true);
    let status = lonely.wait().unwrap();
    let mut stderr = String::new();
    std::io::Read::read_to_string(&mut lonely.stderr.take().unwrap(), &mut stderr).unwrap();
    assert!(!status.success());
    assert!(started.elapsed() < Duration::from_secs(30), "{:?}", started.elapsed());
    assert!(stderr.contains("rendezvous at 127.0.0.1:"), "{stderr}");
    assert!(stderr.contains("rank 0 of 2 (timeout 3 s)"), "{stderr}");
}

#[test]
fn bad_input_is_rejected_with_clear_messages() {
    let output = ft(&["comm-test", "--dtype", "f8"]).output().unwrap();
    assert!(!output.status.success());
    assert!(text(&output).contains("unknown dtype \"f8\": expected auto, f32 (fp32, float32), bf16 (bfloat16) or f16 (fp16, float16)"), "{}", text(&output));

    let output = ft(&["comm-test", "--ops", "all_gatter"]).output().unwrap();
    assert!(
        text(&output).contains("unknown collective \"all_gatter\": expected one of all_reduce, all_gather, reduce_scatter, all_to_all, broadcast"),
        "{}",
        text(&output)
    );

    let output = ft(&["comm-test"]).env("RANK", "3").env("WORLD_SIZE", "2").env("MASTER_PORT", "1").output().unwrap();
    assert!(text(&output).contains("RANK=3 must be below WORLD_SIZE=2"), "{}", text(&output));

    let output = ft(&["launch", "--nproc-per-node", "0", "--", "list"]).output().unwrap();
    assert!(text(&output).contains("--nproc-per-node and --nnodes must be at least 1"), "{}", text(&output));

    let output = ft(&["launch", "--nnodes", "2", "--node-rank", "2", "--", "list"]).output().unwrap();
    assert!(text(&output).contains("--node-rank 2 must be below --nnodes 2"), "{}", text(&output));

    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("ft.toml");
    std::fs::write(&config, "[dist]\nbackend = 'gloo'\ntimeout_sec = 5\n").unwrap();
    let output = ft(&["list", "--config", config.to_str().unwrap()]).output().unwrap();
    assert!(!output.status.success());
    let message = text(&output);
    assert!(message.contains("unknown config key `dist.timeout_sec`"), "{message}");
    assert!(message.contains("did you mean `timeout_secs`?"), "{message}");

    let output = ft(&["list"]).env("FT_DIST__BAKEND", "gloo").output().unwrap();
    assert!(text(&output).contains("unknown config key `dist.bakend`"), "{}", text(&output));
}

#[test]
fn list_shows_the_registry() {
    let output = ft(&["list"]).output().unwrap();
    assert!(output.status.success(), "{}", text(&output));
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(stdout.contains("strategies:") && stdout.contains("jsonl"), "{stdout}");
}

#[test]
fn torchrun_no_python_launches_ft_workers() {
    let torchrun = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join(".venv/bin/torchrun");
    let run = || {
        let mut command = Command::new(&torchrun);
        command.args(["--nproc-per-node", "2", "--master-port", &free_port().to_string(), "--no-python", FT]);
        command.args(["comm-test", "--backend", "gloo", "--min-bytes", "4K", "--max-bytes", "4K", "--iters", "1", "--warmup", "0"]);
        let output = without_launcher_env(&mut command).output().unwrap();
        (output.status.success(), text(&output))
    };
    // The free port can be taken by a test running beside this one before
    // torchrun binds it: that (and only that) earns another try.
    let (mut success, mut log) = run();
    for _ in 0..2 {
        if success || !log.contains("EADDRINUSE") {
            break;
        }
        (success, log) = run();
    }
    assert!(success, "{log}");
    assert!(log.contains("all collectives gave the expected values on all 2 ranks"), "{log}");
    // Ranks join torchrun's own store instead of trying to host a second one on its port.
    assert!(!log.contains("failed to bind"), "{log}");
}

/// `ft launch` of two workers running `script`, started once each printed
/// "ready". It is started as a script's background job (`&`) is, with
/// SIGINT ignored, which its workers must not inherit.
fn launched_until_ready(extra: &[&str], script: &str) -> std::process::Child {
    let mut command = ft(&[&["launch", "--nproc-per-node", "2"], extra, &["--exec", "--", "sh", "-c", script]].concat());
    // SAFETY: signal is async-signal-safe; an ignored disposition survives exec.
    unsafe {
        command.pre_exec(|| {
            for signal in [libc::SIGINT, libc::SIGQUIT] {
                libc::signal(signal, libc::SIG_IGN);
            }
            Ok(())
        });
    }
    let mut child = command.stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().unwrap();
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    let mut ready = 0;
    while ready < 2 {
        let line = lines.next().expect("the workers printed ready").unwrap();
        ready += usize::from(line.ends_with("] ready"));
    }
    // The rest of stdout is drained so no worker blocks on a full pipe.
    std::thread::spawn(move || lines.for_each(drop));
    child
}

fn signal(child: &std::process::Child, name: &str) {
    assert!(Command::new("kill").args([&format!("-{name}"), &child.id().to_string()]).status().unwrap().success());
}

/// The launcher's exit code as README's table gives it: 75 when the
/// workers saved and stopped on the signal; 128 + N when it had to stop
/// them — N the user's second signal, or SIGKILL for workers that would
/// not stop within the grace periods.
#[test]
fn launch_exit_codes_tell_a_scheduler_whether_the_workers_saved_or_were_stopped() {
    let saving = "trap 'echo saving; exit 75' TERM; echo ready; while :; do sleep 0.1; done";
    let child = launched_until_ready(&[], saving);
    signal(&child, "TERM");
    let output = child.wait_with_output().unwrap();
    assert_eq!(output.status.code(), Some(75), "{}", text(&output));

    // A second signal (another one: identical pending signals merge) stops them at once.
    let slow = "trap 'echo saving' TERM; echo ready; while :; do sleep 0.1; done";
    let child = launched_until_ready(&[], slow);
    signal(&child, "TERM");
    std::thread::sleep(Duration::from_millis(300));
    signal(&child, "INT");
    let output = child.wait_with_output().unwrap();
    let log = text(&output);
    assert_eq!(output.status.code(), Some(128 + 2), "{log}");
    assert!(log.contains("ft launch: SIGINT again: the ranks stop at once"), "{log}");

    // Workers that ignore the signal are stopped when --save-grace-secs runs out, then killed after --grace-secs.
    let started = Instant::now();
    let deaf = "trap '' TERM; echo ready; while :; do sleep 0.1; done";
    let child = launched_until_ready(&["--save-grace-secs", "1", "--grace-secs", "1"], deaf);
    signal(&child, "TERM");
    let output = child.wait_with_output().unwrap();
    let log = text(&output);
    assert_eq!(output.status.code(), Some(128 + 9), "{log}");
    assert!(log.contains("the ranks did not stop within 1 s of the signal (--save-grace-secs); stopping them"), "{log}");
    assert!(started.elapsed() < Duration::from_secs(20), "the workers were not stopped");
}

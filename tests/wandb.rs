//! The `wandb` sink read back by W&B's own reader: `ft train --report-to
//! wandb,jsonl` on the demo with wandb offline (WANDB_MODE=offline, WANDB_DIR
//! in a temp dir), then the run's .wandb file scanned with wandb's DataStore.
//! wandb 0.2x reads that file only in its Go core, so the DataStore comes out
//! of the wandb 0.19 wheel scripts/setup.sh keeps in .venv/reference, over
//! the installed wandb's own protobuf records.

use serde_json::Value;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use crate::common;
use common::{ft, text};

/// The demo's 96 examples make 6 optimizer steps an epoch (2 ranks of 8).
const DEMO: &[&str] = &["train", "--epochs", "2", "--train-samples", "96", "--batch-size", "8", "--eval-samples", "8", "--report-to", "wandb,jsonl"];

fn venv_bin() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join(".venv/bin")
}

/// `ft train` on the demo into `dir/out`, W&B offline in `dir`, with `bin` first on PATH (where python3 is).
fn train_command(dir: &Path, bin: &Path) -> Command {
    let path = format!("{}:{}", bin.display(), std::env::var("PATH").unwrap_or_default());
    let mut command = ft();
    command.args(DEMO).arg("--output-dir").arg(dir.join("out")).env("PATH", path);
    for var in ["WANDB_RUN_ID", "WANDB_RESUME", "WANDB_ENTITY", "WANDB_API_KEY", "WANDB_BASE_URL"] {
        command.env_remove(var);
    }
    command.envs([("WANDB_MODE", "offline"), ("WANDB_PROJECT", "ft-tests"), ("WANDB_SILENT", "true")]).env("WANDB_DIR", dir);
    command
}

/// The processes descended from `pid` (from /proc's parent links).
fn descendants(pid: u32) -> Vec<(u32, String)> {
    let processes: Vec<(u32, u32, String)> = std::fs::read_dir("/proc")
        .unwrap()
        .filter_map(|entry| {
            let pid: u32 = entry.ok()?.file_name().to_str()?.parse().ok()?;
            let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
            // The parent is the second field after the command's closing parenthesis.
            let parent = stat[stat.rfind(')')? + 2..].split(' ').nth(1)?.parse().ok()?;
            let command = std::fs::read_to_string(format!("/proc/{pid}/cmdline")).ok()?.replace('\0', " ");
            Some((pid, parent, command))
        })
        .collect();
    let mut found: Vec<(u32, String)> = vec![];
    let mut parents = vec![pid];
    while let Some(parent) = parents.pop() {
        for (child, _, command) in processes.iter().filter(|(_, p, _)| *p == parent) {
            found.push((*child, command.clone()));
            parents.push(*child);
        }
    }
    found
}

/// The offline run in `dir` as W&B's reader sees it (tests/python/wandb_reference.py,
/// in the binary's one process of it), over every file it was written in: the run
/// record, the config, each history row, the summary's last values, the last exit
/// code and the number of files.
fn run_as_wandb_reads_it(dir: &Path) -> Value {
    let reference = Path::new(env!("CARGO_MANIFEST_DIR")).join(".venv/reference");
    let printed = common::reference_job("wandb_reference.py", &[reference.as_os_str(), dir.as_os_str()]);
    serde_json::from_str(&printed).unwrap_or_else(|e| panic!("{e}: {printed}"))
}

/// Every value ft logged (metrics.jsonl in `out`), at its step: a W&B history row of that step holds each record's values.
fn check_history(out: &Path, run: &Value) {
    let history = run["history"].as_array().unwrap();
    let records: Vec<Value> = std::fs::read_to_string(out.join("metrics.jsonl")).unwrap().lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    for record in &records {
        // As numbers: W&B writes a whole float as an integer (0.0 as 0).
        let holds = |row: &Value| record.as_object().unwrap().iter().filter(|(k, _)| *k != "step").all(|(k, v)| row[k].as_f64() == v.as_f64());
        // A step logged again (a resumed run's) has a row in each file.
        let rows: Vec<&Value> = history.iter().filter(|row| row["_step"] == record["step"]).collect();
        assert!(rows.iter().any(|row| holds(row)), "W&B's rows {rows:?} lack {record}");
    }
    let steps: Vec<&Value> = records.iter().map(|r| &r["step"]).collect();
    assert!(history.iter().all(|row| steps.contains(&&row["_step"])), "W&B has rows ft did not log: {history:?}");
}

#[test]
fn wandbs_reader_reads_the_offline_run_ft_made() {
    let dir = tempfile::tempdir().unwrap();
    // W&B's settings are the client's own: the project and the run's id here.
    let output = train_command(dir.path(), &venv_bin()).env("WANDB_RUN_ID", "ft-test-run").output().unwrap();
    assert!(output.status.success(), "{}", text(&output));
    let run = run_as_wandb_reads_it(dir.path());
    let out = dir.path().join("out");
    assert_eq!((&run["project"], &run["name"], &run["id"]), (&"ft-tests".into(), &"out".into(), &"ft-test-run".into()));
    assert_eq!(std::fs::read_to_string(out.join(".ft-wandb-run-id")).unwrap(), "ft-test-run");
    assert_eq!(run["exit_code"], 0);

    assert_eq!(std::fs::read_to_string(out.join("metrics.jsonl")).unwrap().matches("\"loss\"").count(), 12);
    check_history(&out, &run);
    let config = &run["config"];
    assert!(config["train.lr"].as_f64().unwrap() > 0.0, "{config}");
    assert_eq!((&config["train.epochs"], &config["data.train_samples"]), (&2.into(), &96.into()));
    assert_eq!(config["output.report_to"], serde_json::json!(["wandb", "jsonl"]));
    let summary: Value = serde_json::from_str(&std::fs::read_to_string(out.join("summary.json")).unwrap()).unwrap();
    for (key, value) in summary.as_object().unwrap() {
        assert_eq!(&run["summary"][key], value, "summary {key}");
    }
}

#[test]
fn a_python_without_wandb_is_one_clear_error_at_the_start() {
    let dir = tempfile::tempdir().unwrap();
    // A python3 of its own, without wandb: a venv with no packages.
    let bare = dir.path().join("bare");
    let made = Command::new("python3").args(["-m", "venv", "--without-pip"]).arg(&bare).output().unwrap();
    assert!(made.status.success(), "{}", text(&made));
    let output = train_command(dir.path(), &bare.join("bin")).output().unwrap();
    let log = text(&output);
    assert!(!output.status.success(), "{log}");
    assert!(log.contains("pip install wandb") && !log.contains("panicked"), "{log}");
    assert!(!dir.path().join("out/metrics.jsonl").exists() || std::fs::read_to_string(dir.path().join("out/metrics.jsonl")).unwrap().is_empty(), "stopped before the first step");
}

#[test]
fn training_outlives_a_wandb_client_that_dies() {
    let dir = tempfile::tempdir().unwrap();
    let mut training = train_command(dir.path(), &venv_bin()).stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().unwrap();
    let metrics = dir.path().join("out/metrics.jsonl");
    let started = Instant::now();
    while std::fs::read_to_string(&metrics).unwrap_or_default().lines().count() < 3 {
        assert!(started.elapsed() < Duration::from_secs(120) && training.try_wait().unwrap().is_none(), "training ended before 3 steps");
        std::thread::sleep(Duration::from_millis(20));
    }
    // The client ft started: the python running ft's driver, under this test's ft.
    let clients: Vec<u32> = descendants(training.id()).into_iter().filter(|(_, c)| c.contains("wandb_driver") || c.contains("ft's wandb sink")).map(|(pid, _)| pid).collect();
    let [client] = clients.as_slice() else { panic!("one wandb client expected: {clients:?}") };
    assert!(Command::new("kill").args(["-KILL", &client.to_string()]).status().unwrap().success());
    let output = training.wait_with_output().unwrap();
    let log = text(&output);
    assert!(output.status.success(), "training stops for a W&B client that died:\n{log}");
    assert_eq!(log.matches("WARN").count(), 1, "one warning when the client dies:\n{log}");
    assert!(log.contains("W&B's client ended") && log.contains("started again"), "{log}");

    // The second client continued the run with what the first had not handled: nothing is lost.
    let run = run_as_wandb_reads_it(dir.path());
    assert_eq!((run["files"].as_u64(), &run["exit_code"]), (Some(2), &0.into()), "{run}");
    check_history(&dir.path().join("out"), &run);
}

#[test]
fn a_resumed_run_continues_the_same_wandb_run() {
    let dir = tempfile::tempdir().unwrap();
    let output = train_command(dir.path(), &venv_bin()).args(["--save-every", "3"]).env("FT_FAULT_INJECT", "after-step:7").output().unwrap();
    assert!(!output.status.success() && text(&output).contains("FT_FAULT_INJECT: aborting"), "{}", text(&output));
    let killed = run_as_wandb_reads_it(dir.path());
    assert_eq!(killed["exit_code"], 1, "the client marks a run ft left without finishing as failed: {killed}");

    // From the checkpoint of step 6: steps 7 to 12 again, in the same W&B run.
    let output = train_command(dir.path(), &venv_bin()).args(["--save-every", "3", "--resume", "latest"]).output().unwrap();
    assert!(output.status.success(), "{}", text(&output));
    let run = run_as_wandb_reads_it(dir.path());
    assert_eq!((&run["id"], run["files"].as_u64(), &run["exit_code"]), (&killed["id"], Some(2), &0.into()), "{run}");
    check_history(&dir.path().join("out"), &run);
}

//! The `wandb` sink read back by W&B's own reader: `ft train --report-to
//! wandb,jsonl` on the demo with wandb offline (WANDB_MODE=offline, WANDB_DIR
//! in a temp dir), then the run's .wandb file scanned with wandb's DataStore.
//! wandb 0.2x reads that file only in its Go core, so the DataStore comes out
//! of the wandb 0.19 wheel scripts/setup.sh keeps in .venv/reference, over
//! the installed wandb's own protobuf records.

use serde_json::Value;
use std::path::{Path, PathBuf};
use std::process::Command;

mod common;
use common::{ft, text};

/// The demo's 96 examples make 6 optimizer steps an epoch (2 ranks of 8).
const DEMO: &[&str] = &["train", "--epochs", "2", "--train-samples", "96", "--batch-size", "8", "--eval-samples", "8", "--report-to", "wandb,jsonl"];

fn venv_bin() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join(".venv/bin")
}

/// `ft train` on the demo into `dir/out`, W&B offline in `dir`, with `bin` first on PATH (where python3 is).
fn train(dir: &Path, bin: &Path) -> std::process::Output {
    let path = format!("{}:{}", bin.display(), std::env::var("PATH").unwrap_or_default());
    let mut command = ft();
    command.args(DEMO).arg("--output-dir").arg(dir.join("out")).env("PATH", path);
    for var in ["WANDB_RUN_ID", "WANDB_RESUME", "WANDB_ENTITY", "WANDB_API_KEY", "WANDB_BASE_URL"] {
        command.env_remove(var);
    }
    command.envs([("WANDB_MODE", "offline"), ("WANDB_PROJECT", "ft-tests"), ("WANDB_SILENT", "true")]).env("WANDB_DIR", dir);
    command.output().unwrap()
}

/// The offline run in `dir` as W&B's reader sees it: the run record, the
/// config, each history row, the summary's last values and the exit code.
fn run_as_wandb_reads_it(dir: &Path) -> Value {
    let script = r#"
import glob, json, sys, types, zipfile
import wandb
from wandb.proto import wandb_internal_pb2 as pb
[wheel] = glob.glob(sys.argv[1] + "/wandb-0.19.11-*.whl")
datastore = types.ModuleType("datastore")
exec(compile(zipfile.ZipFile(wheel).read("wandb/sdk/internal/datastore.py"), "datastore.py", "exec"), datastore.__dict__)
# DataStore checks it runs in wandb's internal process, which 0.2x no longer has.
wandb._assert_is_internal_process = lambda: None
[path] = glob.glob(sys.argv[2] + "/wandb/offline-run-*/run-*.wandb")
store = datastore.DataStore()
store.open_for_scan(path)
run = {"history": [], "summary": {}, "config": {}}
def key(item):
    return item.key or "/".join(item.nested_key)
while (data := store.scan_data()) is not None:
    record = pb.Record()
    record.ParseFromString(data)
    kind = record.WhichOneof("record_type")
    if kind == "run":
        run.update(id=record.run.run_id, project=record.run.project, name=record.run.display_name)
        run["config"].update({key(i): json.loads(i.value_json) for i in record.run.config.update})
    elif kind == "config":
        run["config"].update({key(i): json.loads(i.value_json) for i in record.config.update})
    elif kind == "history":
        run["history"].append({key(i): json.loads(i.value_json) for i in record.history.item})
    elif kind == "summary":
        run["summary"].update({key(i): json.loads(i.value_json) for i in record.summary.update})
    elif kind == "exit":
        run["exit_code"] = record.exit.exit_code
print(json.dumps(run))
"#;
    let reference = Path::new(env!("CARGO_MANIFEST_DIR")).join(".venv/reference");
    let output = Command::new(venv_bin().join("python")).args(["-c", script]).arg(reference).arg(dir).output().unwrap();
    let log = text(&output);
    assert!(output.status.success(), "W&B's reader failed (scripts/setup.sh installs wandb and keeps the 0.19 wheel in .venv/reference):\n{log}");
    serde_json::from_slice(&output.stdout).unwrap_or_else(|e| panic!("{e}: {log}"))
}

#[test]
fn wandbs_reader_reads_the_offline_run_ft_made() {
    let dir = tempfile::tempdir().unwrap();
    let output = train(dir.path(), &venv_bin());
    assert!(output.status.success(), "{}", text(&output));
    let run = run_as_wandb_reads_it(dir.path());
    let out = dir.path().join("out");
    assert_eq!((&run["project"], &run["name"]), (&"ft-tests".into(), &"out".into()));
    assert_eq!(std::fs::read_to_string(out.join(".ft-wandb-run-id")).unwrap(), run["id"].as_str().unwrap());
    assert_eq!(run["exit_code"], 0);

    // Every value ft logged, at its step: W&B's history row of that step holds each record's values.
    let history = run["history"].as_array().unwrap();
    let records: Vec<Value> = std::fs::read_to_string(out.join("metrics.jsonl")).unwrap().lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    assert_eq!(records.iter().filter(|r| r.get("loss").is_some()).count(), 12);
    for record in &records {
        let row = history.iter().find(|row| row["_step"] == record["step"]).unwrap_or_else(|| panic!("no W&B row for {record}"));
        for (key, value) in record.as_object().unwrap().iter().filter(|(k, _)| *k != "step") {
            // As numbers: W&B writes a whole float as an integer (0.0 as 0).
            assert_eq!(row[key].as_f64(), Some(value.as_f64().unwrap()), "{key} at step {}: W&B's row {row}", record["step"]);
        }
    }
    let steps: Vec<&Value> = records.iter().map(|r| &r["step"]).collect();
    assert!(history.iter().all(|row| steps.contains(&&row["_step"])), "W&B has rows ft did not log: {history:?}");

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
    let output = train(dir.path(), &bare.join("bin"));
    let log = text(&output);
    assert!(!output.status.success(), "{log}");
    assert!(log.contains("pip install wandb") && !log.contains("panicked"), "{log}");
    assert!(!dir.path().join("out/metrics.jsonl").exists() || std::fs::read_to_string(dir.path().join("out/metrics.jsonl")).unwrap().is_empty(), "stopped before the first step");
}

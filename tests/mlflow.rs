//! The `mlflow` sink read back by MLflow's own client: `ft train --report-to
//! mlflow,jsonl` on the demo, then `MlflowClient` over OUTPUT_DIR/mlruns with
//! the venv's python (mlflow-skinny, installed by scripts/setup.sh).

use serde_json::Value;
use std::path::Path;
use std::process::Command;

mod common;
use common::{ft, text};

/// The demo's 96 examples make 6 optimizer steps an epoch (2 ranks of 8).
const DEMO: &[&str] = &["train", "--epochs", "2", "--train-samples", "96", "--batch-size", "8", "--eval-samples", "8", "--report-to", "mlflow,jsonl"];

fn train_command(dir: &Path, extra: &[&str]) -> Command {
    let mut command = ft();
    command.args(DEMO).args(["--output-dir", dir.to_str().unwrap()]).args(extra);
    command
}

fn train(dir: &Path, extra: &[&str]) {
    let output = train_command(dir, extra).output().unwrap();
    assert!(output.status.success(), "{}", text(&output));
}

/// Every run of the experiment "ft" in `dir/mlruns` as MLflow's client reads
/// it: status, times, params, tags, metric names, artifacts, the summary
/// artifact's contents, and the `loss` and `eval_loss` histories as [step, value].
fn runs_as_mlflow_reads_them(dir: &Path) -> Vec<Value> {
    let script = r#"
import json, sys, tempfile
from mlflow import MlflowClient
client = MlflowClient(tracking_uri="file://" + sys.argv[1])
experiment = client.get_experiment_by_name("ft")
def history(run, key):
    return [[m.step, m.value] for m in client.get_metric_history(run.info.run_id, key)]
def summary(run):
    if not any(a.path == "summary.json" for a in client.list_artifacts(run.info.run_id)):
        return None
    return json.load(open(client.download_artifacts(run.info.run_id, "summary.json", tempfile.mkdtemp())))
print(json.dumps([{
    "id": run.info.run_id, "status": run.info.status, "start": run.info.start_time, "end": run.info.end_time,
    "params": run.data.params, "tags": run.data.tags, "metrics": sorted(run.data.metrics),
    "artifacts": [a.path for a in client.list_artifacts(run.info.run_id)], "summary": summary(run),
    "loss": history(run, "loss"), "eval_loss": history(run, "eval_loss"),
} for run in client.search_runs([experiment.experiment_id])]))
"#;
    let python = Path::new(env!("CARGO_MANIFEST_DIR")).join(".venv/bin/python");
    let store = std::fs::canonicalize(dir.join("mlruns")).unwrap();
    let output = Command::new(&python)
        .args(["-c", script, store.to_str().unwrap()])
        // MLflow 3 reads a file store only when asked to (it prefers a database now).
        .env("MLFLOW_ALLOW_FILE_STORE", "true")
        .output()
        .unwrap_or_else(|e| panic!("cannot run {}: {e}; scripts/setup.sh makes the venv", python.display()));
    let log = text(&output);
    assert!(!log.contains("No module named 'mlflow'"), "this test reads ft's store with MLflow's client: run scripts/setup.sh to install mlflow-skinny into .venv\n{log}");
    assert!(output.status.success(), "{log}");
    serde_json::from_slice(&output.stdout).unwrap_or_else(|e| panic!("{e}: {log}"))
}

/// metrics.jsonl's `key` values as [step, value].
fn jsonl_history(dir: &Path, key: &str) -> Vec<Value> {
    let metrics = std::fs::read_to_string(dir.join("metrics.jsonl")).unwrap();
    metrics
        .lines()
        .map(|line| serde_json::from_str::<Value>(line).unwrap())
        .filter(|record| record.get(key).is_some())
        .map(|record| serde_json::json!([record["step"], record[key]]))
        .collect()
}

#[test]
fn mlflows_client_reads_the_run_ft_recorded() {
    let dir = tempfile::tempdir().unwrap();
    train(dir.path(), &[]);
    let runs = runs_as_mlflow_reads_them(dir.path());
    let [run] = runs.as_slice() else { panic!("one run expected: {runs:?}") };
    assert_eq!(run["status"], "FINISHED");
    assert!(run["end"].as_u64() >= run["start"].as_u64(), "{run}");
    let losses = jsonl_history(dir.path(), "loss");
    assert_eq!(losses.len(), 12);
    assert_eq!(run["loss"].as_array().unwrap(), &losses, "MLflow's loss history differs from metrics.jsonl");
    assert_eq!(run["eval_loss"].as_array().unwrap(), &jsonl_history(dir.path(), "eval_loss"));
    let metrics = run["metrics"].as_array().unwrap();
    for name in ["loss", "lr", "grad_norm", "eval_loss", "eval_f1"] {
        assert!(metrics.contains(&name.into()), "no metric {name}: {metrics:?}");
    }
    let params = &run["params"];
    assert!(params["train.lr"].as_str().unwrap().parse::<f64>().unwrap() > 0.0, "{params}");
    assert_eq!((&params["train.epochs"], &params["data.train_samples"]), (&"2".into(), &"96".into()));
    assert_eq!(params["output.report_to"], r#"["mlflow","jsonl"]"#);
    let tags = &run["tags"];
    assert_eq!(tags["mlflow.source.name"], "ft");
    assert_eq!(tags["mlflow.runName"], dir.path().file_name().unwrap().to_str().unwrap());
    assert_eq!(tags["ft.version"], env!("CARGO_PKG_VERSION"));
    let summary: Value = serde_json::from_str(&std::fs::read_to_string(dir.path().join("summary.json")).unwrap()).unwrap();
    assert_eq!(run["summary"], summary, "the summary artifact is summary.json");
}

#[test]
fn a_resumed_run_continues_the_same_mlflow_run() {
    let dir = tempfile::tempdir().unwrap();
    let output = train_command(dir.path(), &["--save-every", "3"]).env("FT_FAULT_INJECT", "after-step:7").output().unwrap();
    assert!(!output.status.success() && text(&output).contains("FT_FAULT_INJECT: aborting"), "{}", text(&output));
    let runs = runs_as_mlflow_reads_them(dir.path());
    let [killed] = runs.as_slice() else { panic!("one run expected: {runs:?}") };
    assert_eq!(killed["status"], "RUNNING", "a killed run stays running, as in MLflow");
    assert_eq!(killed["loss"].as_array().unwrap().len(), 7);

    // From the checkpoint of step 6: steps 7 to 12 again, in the same MLflow run.
    train(dir.path(), &["--save-every", "3", "--resume", "latest"]);
    let runs = runs_as_mlflow_reads_them(dir.path());
    let [resumed] = runs.as_slice() else { panic!("one run expected: {runs:?}") };
    assert_eq!((&resumed["id"], &resumed["status"]), (&killed["id"], &"FINISHED".into()));
    let losses = resumed["loss"].as_array().unwrap();
    assert_eq!(losses, &jsonl_history(dir.path(), "loss"));
    assert_eq!(losses.len(), 13);
    assert_eq!(&losses[..7], killed["loss"].as_array().unwrap().as_slice(), "the history is extended");
    assert_eq!(resumed["params"]["train.resume"], "latest");
}

//! The `mlflow` sink read back by MLflow's own client: `ft train --report-to
//! mlflow,jsonl` on the demo, then `MlflowClient` over OUTPUT_DIR/mlruns, or
//! over a real `mlflow server` the test starts on 127.0.0.1, with the venv's
//! python (mlflow, installed by scripts/setup.sh).

use serde_json::Value;
use std::io::{Read, Write};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use crate::common;
use common::{ft, text};

/// The demo's 96 examples make 6 optimizer steps an epoch (2 ranks of 8).
const DEMO: &[&str] = &["train", "--epochs", "2", "--train-samples", "96", "--batch-size", "8", "--eval-samples", "8", "--report-to", "mlflow,jsonl"];

/// `ft train` on the demo into `dir`, to `server` or else to the file store.
fn train_command(dir: &Path, server: Option<&MlflowServer>, extra: &[&str]) -> Command {
    let mut command = ft();
    command.args(DEMO).args(["--output-dir", dir.to_str().unwrap()]).args(extra);
    match server {
        Some(server) => command.env("MLFLOW_TRACKING_URI", &server.url),
        None => command.env_remove("MLFLOW_TRACKING_URI"),
    };
    command
}

fn train(dir: &Path, server: Option<&MlflowServer>, extra: &[&str]) -> String {
    let output = train_command(dir, server, extra).output().unwrap();
    assert!(output.status.success(), "{}", text(&output));
    text(&output)
}

/// The runs of `ft train … --output-dir dir` (named after it) where it logged: the server, or `dir`'s file store.
fn runs_of(dir: &Path, server: Option<&MlflowServer>) -> Vec<Value> {
    let runs = runs_as_mlflow_reads_them(&server.map_or_else(|| file_store(dir), |s| s.url.clone()));
    runs.into_iter().filter(|run| run["tags"]["mlflow.runName"] == dir.file_name().unwrap().to_str().unwrap()).collect()
}

/// A real `mlflow server` on a free port of 127.0.0.1, as MLflow's docs start
/// one: a SQLite database and proxied artifacts (`--serve-artifacts`) in
/// `dir`. Killed, with the workers it starts, when dropped.
struct MlflowServer {
    child: Child,
    url: String,
    dir: PathBuf,
    port: u16,
}

impl MlflowServer {
    fn start(dir: &Path) -> MlflowServer {
        let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
        MlflowServer::start_on(dir, port)
    }

    /// Starts on `port` and waits until it answers /health.
    fn start_on(dir: &Path, port: u16) -> MlflowServer {
        let mlflow = python().with_file_name("mlflow");
        let log = std::fs::OpenOptions::new().create(true).append(true).open(dir.join("server.log")).unwrap();
        let child = Command::new(&mlflow)
            .args(["server", "--host", "127.0.0.1", "--port", &port.to_string(), "--workers", "1"])
            .arg("--backend-store-uri")
            .arg(format!("sqlite:///{}", dir.join("mlflow.db").display()))
            .args(["--serve-artifacts", "--artifacts-destination"])
            .arg(dir.join("artifacts"))
            // Without MLflow 3's job runner (GenAI jobs, nothing a tracking client asks for): three more pythons importing MLflow.
            .env("MLFLOW_SERVER_ENABLE_JOB_EXECUTION", "false")
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            // Its own process group, so that killing it kills its workers too.
            .process_group(0)
            .spawn()
            .unwrap_or_else(|e| panic!("cannot run {}: {e}; scripts/setup.sh installs mlflow into .venv", mlflow.display()));
        let server = MlflowServer { child, url: format!("http://127.0.0.1:{port}"), dir: dir.to_path_buf(), port };
        let started = Instant::now();
        while !server.healthy() {
            assert!(started.elapsed() < Duration::from_secs(120), "mlflow server did not start:\n{}", server.log());
            std::thread::sleep(Duration::from_millis(250));
        }
        server
    }

    fn healthy(&self) -> bool {
        let Ok(mut stream) = std::net::TcpStream::connect(("127.0.0.1", self.port)) else { return false };
        let mut answer = String::new();
        stream.write_all(b"GET /health HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n").is_ok() && stream.read_to_string(&mut answer).is_ok() && answer.starts_with("HTTP/1.1 200")
    }

    fn log(&self) -> String {
        std::fs::read_to_string(self.dir.join("server.log")).unwrap_or_default()
    }

    /// Sends `signal` to the server and its workers.
    fn signal(&self, signal: &str) {
        let _ = Command::new("kill").args([signal, "--", &format!("-{}", self.child.id())]).status();
    }

    /// Kills the server and its workers now (unless it is already dead and reaped).
    fn kill(&mut self) {
        if matches!(self.child.try_wait(), Ok(Some(_))) {
            return;
        }
        self.signal("-KILL");
        let _ = self.child.wait();
    }
}

impl Drop for MlflowServer {
    fn drop(&mut self) {
        self.kill();
    }
}


fn python() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join(".venv/bin/python")
}

/// `dir/mlruns` as a tracking URI.
fn file_store(dir: &Path) -> String {
    format!("file://{}", std::fs::canonicalize(dir.join("mlruns")).unwrap().display())
}

/// Every run of the experiment "ft" at `tracking_uri` as MLflow's client reads
/// it (tests/python/mlflow_reference.py, in the binary's one process of it):
/// status, times, params, tags, metric names, artifacts, the summary
/// artifact's contents, and the `loss` and `eval_loss` histories as [step, value].
fn runs_as_mlflow_reads_them(tracking_uri: &str) -> Vec<Value> {
    let printed = common::reference_job("mlflow_reference.py", &[tracking_uri.as_ref()]);
    serde_json::from_str(&printed).unwrap_or_else(|e| panic!("{e}: {printed}"))
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

/// A metric's history as a resumed run leaves it, [step, value] in order:
/// MLflow keeps the steps the run logged after its checkpoint and again
/// after the resume; metrics.jsonl only the second time.
fn without_repeated_steps(history: &[Value]) -> Vec<Value> {
    let mut kept: Vec<Value> = vec![];
    for point in history {
        if let Some(repeated) = kept.iter().position(|p| p[0] == point[0]) {
            kept.truncate(repeated);
        }
        kept.push(point.clone());
    }
    kept
}

/// Checks a finished run as MLflow reads it against what ft wrote in `dir`:
/// the loss histories of metrics.jsonl, the params, tags and summary.json.
fn check_finished_run(dir: &Path, run: &Value) {
    assert_eq!(run["status"], "FINISHED");
    assert!(run["end"].as_u64() >= run["start"].as_u64(), "{run}");
    let history = |metric: &str| without_repeated_steps(run[metric].as_array().unwrap());
    assert_eq!(history("loss"), jsonl_history(dir, "loss"), "MLflow's loss history differs from metrics.jsonl");
    assert_eq!(history("eval_loss"), jsonl_history(dir, "eval_loss"));
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
    assert_eq!(tags["mlflow.runName"], dir.file_name().unwrap().to_str().unwrap());
    assert_eq!(tags["ft.version"], env!("CARGO_PKG_VERSION"));
    let summary: Value = serde_json::from_str(&std::fs::read_to_string(dir.join("summary.json")).unwrap()).unwrap();
    assert_eq!(run["summary"], summary, "the summary artifact is summary.json");
}

/// Trains to step 7 and aborts, then resumes from the checkpoint of step 6:
/// MLflow shows the killed run running with 7 losses, then the same run
/// finished with 13, the history extended (step 7 twice), where
/// metrics.jsonl keeps each step once.
fn check_resume(server: Option<&MlflowServer>) {
    let dir = tempfile::tempdir().unwrap();
    let output = train_command(dir.path(), server, &["--save-every", "3"]).env("FT_FAULT_INJECT", "after-step:7").output().unwrap();
    assert!(!output.status.success() && text(&output).contains("FT_FAULT_INJECT: aborting"), "{}", text(&output));
    let runs = runs_of(dir.path(), server);
    let [killed] = runs.as_slice() else { panic!("one run expected: {runs:?}") };
    assert_eq!(killed["status"], "RUNNING", "a killed run stays running, as in MLflow");
    assert_eq!(killed["loss"].as_array().unwrap().len(), 7);

    train(dir.path(), server, &["--save-every", "3", "--resume", "latest"]);
    let runs = runs_of(dir.path(), server);
    let [resumed] = runs.as_slice() else { panic!("one run expected: {runs:?}") };
    assert_eq!(resumed["id"], killed["id"]);
    check_finished_run(dir.path(), resumed);
    let losses = resumed["loss"].as_array().unwrap();
    assert_eq!(losses.len(), 13);
    assert_eq!(&losses[..7], killed["loss"].as_array().unwrap().as_slice(), "the history is extended");
    assert_eq!(resumed["params"]["train.resume"], "latest");
}

#[test]
fn mlflows_client_reads_the_run_ft_recorded() {
    let dir = tempfile::tempdir().unwrap();
    train(dir.path(), None, &[]);
    let runs = runs_as_mlflow_reads_them(&file_store(dir.path()));
    let [run] = runs.as_slice() else { panic!("one run expected: {runs:?}") };
    assert_eq!(jsonl_history(dir.path(), "loss").len(), 12);
    check_finished_run(dir.path(), run);
}

#[test]
fn a_resumed_run_continues_the_same_mlflow_run() {
    check_resume(None);
}

#[test]
fn a_tracking_server_gets_the_run_and_a_resumed_run_continues_it() {
    let server_dir = tempfile::tempdir().unwrap();
    let server = MlflowServer::start(server_dir.path());
    let dir = tempfile::tempdir().unwrap();
    let log = train(dir.path(), Some(&server), &[]);
    assert!(!log.contains("WARN"), "{log}");
    let runs = runs_as_mlflow_reads_them(&server.url);
    let [run] = runs.as_slice() else { panic!("one run expected: {runs:?}") };
    check_finished_run(dir.path(), run);
    assert!(server_dir.path().join("artifacts").read_dir().unwrap().next().is_some(), "the summary went through the artifact proxy");
    // The file store is not written when a server is named.
    assert!(!dir.path().join("mlruns").exists());

    // A second run on the same server: a run of its own, resumed in place.
    check_resume(Some(&server));
}

/// Starts `ft train` on the demo for 6 epochs (36 steps) to `server`, with `env`, and returns it once it has logged 3 steps.
fn start_training(dir: &Path, server: &MlflowServer, env: &[(&str, &str)]) -> Child {
    let mut training = train_command(dir, Some(server), &["--epochs", "6"]).envs(env.iter().copied()).stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().unwrap();
    let started = Instant::now();
    while std::fs::read_to_string(dir.join("metrics.jsonl")).unwrap_or_default().matches("\"loss\"").count() < 3 {
        assert!(started.elapsed() < Duration::from_secs(120) && training.try_wait().unwrap().is_none(), "training ended before 3 steps");
        std::thread::sleep(Duration::from_millis(20));
    }
    training
}

#[test]
fn a_tracking_server_that_stalls_gets_everything_when_it_answers_again() {
    let server_dir = tempfile::tempdir().unwrap();
    let server = MlflowServer::start(server_dir.path());
    let dir = tempfile::tempdir().unwrap();
    let training = start_training(dir.path(), &server, &[("MLFLOW_HTTP_REQUEST_TIMEOUT", "2")]);
    // Stopped past the request timeout MLflow's variable sets (2 s), so a request fails and what it carried waits.
    server.signal("-STOP");
    std::thread::sleep(Duration::from_secs(4));
    server.signal("-CONT");
    let output = training.wait_with_output().unwrap();
    let log = text(&output);
    assert!(output.status.success(), "{log}");
    assert_eq!(log.matches("failed (").count(), 1, "one warning when the server stalls:\n{log}");
    assert!(log.contains("answers again") && !log.contains("never got"), "{log}");
    let runs = runs_as_mlflow_reads_them(&server.url);
    let [run] = runs.as_slice() else { panic!("one run expected: {runs:?}") };
    assert_eq!(run["status"], "FINISHED");
    assert_eq!(run["loss"].as_array().unwrap(), &jsonl_history(dir.path(), "loss"), "every loss reached the server once it answered");
    assert_eq!(run["eval_loss"].as_array().unwrap(), &jsonl_history(dir.path(), "eval_loss"));
    // A timeout that is no number of seconds is refused at the start, by name.
    let elsewhere = tempfile::tempdir().unwrap();
    let output = train_command(elsewhere.path(), Some(&server), &[]).env("MLFLOW_HTTP_REQUEST_TIMEOUT", "soon").output().unwrap();
    assert!(!output.status.success() && text(&output).contains("MLFLOW_HTTP_REQUEST_TIMEOUT=soon: a request's timeout is a positive number of seconds"), "{}", text(&output));
}

#[test]
fn training_outlives_a_tracking_server_that_goes_away() {
    let server_dir = tempfile::tempdir().unwrap();
    let mut server = MlflowServer::start(server_dir.path());
    let dir = tempfile::tempdir().unwrap();
    let training = start_training(dir.path(), &server, &[]);
    server.kill();
    let output = training.wait_with_output().unwrap();
    let log = text(&output);
    assert!(output.status.success(), "training stops for a tracking server that went away:\n{log}");
    let losses = jsonl_history(dir.path(), "loss");
    assert_eq!(losses.len(), 36, "{log}");
    assert_eq!(log.matches("failed (").count(), 1, "one warning when the server goes away:\n{log}");
    assert_eq!(log.matches("never got").count(), 1, "one warning of what never arrived:\n{log}");
    assert!(log.contains("the summary artifact, the run's end status FINISHED"), "{log}");

    // What reached the server before it went away is there, a prefix of
    // metrics.jsonl; the warning names the rest.
    let restarted = MlflowServer::start_on(server_dir.path(), server.port);
    let runs = runs_as_mlflow_reads_them(&restarted.url);
    let [run] = runs.as_slice() else { panic!("one run expected: {runs:?}") };
    assert_eq!(run["status"], "RUNNING");
    let sent = run["loss"].as_array().unwrap();
    assert!(sent.len() >= 3 && sent.len() < losses.len() && sent[..] == losses[..sent.len()], "{sent:?}");
    let first_lost = losses[sent.len()][0].as_u64().unwrap();
    assert!(log.contains(&format!(" metric values of steps {first_lost}–36")), "the steps never sent are {first_lost}–36:\n{log}");
}

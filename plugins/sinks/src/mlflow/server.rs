//! An MLflow run on a tracking server (`MLFLOW_TRACKING_URI=http(s)://…`),
//! through MLflow's REST API (the 2.0 endpoints of mlflow/server/handlers.py):
//! `experiments/get-by-name` and `create`, `runs/create`, `get` and `update`,
//! `runs/log-batch` for params, tags and metrics within MLflow's batch limits,
//! and the summary as an artifact through the server's artifact proxy
//! (`mlflow-artifacts`, served by `mlflow server --serve-artifacts`).
//!
//! The server is reached at the start: an unreachable server or a refused
//! experiment is an error before the first step. After that, training never
//! stops for it: what a request could not deliver (the server gone, a
//! timeout, a 5xx) stays queued and goes with the next request — after a
//! failure, retried no sooner than a back-off, so a hung server does not hold
//! every step for a timeout — with one warning when it first fails, and at
//! the end a warning that says what never reached it. A request that timed
//! out may still have been stored: its metrics go again with the timestamps
//! they were queued with, and MLflow's store keeps a metric it already has
//! (same key, step, timestamp, value) once. What the server refuses (a 4xx)
//! is reported and dropped, as sending it again would fail again.
//!
//! The run's id and its server are kept in `OUTPUT_DIR/.ft-mlflow-run.json`,
//! so a resumed run continues it on the same server.

use super::{now_ms, RunIdentity, EXPERIMENT_KEY, EXPERIMENT_KEY_DEFAULT};
use crate::json_metric_value;
use anyhow::{bail, Context, Result};
use ft_core::metrics::{MetricsSink, Record};
use serde_json::{json, Value};
use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

const RUN_FILE: &str = ".ft-mlflow-run.json";
/// A request's whole time unless `MLFLOW_HTTP_REQUEST_TIMEOUT` says (MLflow's
/// client waits 120 s), and a connection's: short, as training waits for them.
const TIMEOUT: Duration = Duration::from_secs(10);
const CONNECT_TIMEOUT: Duration = Duration::from_secs(3);
/// After a failed request the next waits this long, doubling per failure up to the last.
const RETRY_AFTER: Duration = Duration::from_secs(5);
const RETRY_AFTER_MAX: Duration = Duration::from_secs(300);
// MLflow's limits (mlflow/utils/validation.py): per log-batch request, and a param's value.
const MAX_METRICS_PER_BATCH: usize = 1000;
const MAX_PARAMS_TAGS_PER_BATCH: usize = 100;
const MAX_PARAM_VAL_LENGTH: usize = 6000;
/// The scheme of the artifact locations a server with `--serve-artifacts` gives its runs.
const PROXIED_ARTIFACTS: &str = "mlflow-artifacts";

/// The tracking server `MLFLOW_TRACKING_URI` names, or None for the file store
/// (unset, a path, or a `file:` URI, as MLflow's client reads it).
pub(super) fn tracking_server() -> Result<Option<String>> {
    let uri = match std::env::var("MLFLOW_TRACKING_URI") {
        Ok(uri) if !uri.trim().is_empty() => uri.trim().to_string(),
        _ => return Ok(None),
    };
    match url::Url::parse(&uri) {
        Ok(url) if matches!(url.scheme(), "http" | "https") => Ok(Some(uri.trim_end_matches('/').to_string())),
        Ok(url) if url.scheme() == "file" => Ok(None),
        Err(url::ParseError::RelativeUrlWithoutBase) => Ok(None),
        Ok(url) => bail!("MLFLOW_TRACKING_URI={uri}: ft's mlflow sink logs to an http(s):// tracking server or to its file store (unset, or file:), not to a {}: URI", url.scheme()),
        Err(e) => bail!("MLFLOW_TRACKING_URI={uri} is not a URI: {e}"),
    }
}

/// A request's whole time: `MLFLOW_HTTP_REQUEST_TIMEOUT` (seconds, as MLflow's client reads it), else [`TIMEOUT`].
pub(super) fn request_timeout() -> Result<Duration> {
    match std::env::var("MLFLOW_HTTP_REQUEST_TIMEOUT") {
        Err(_) => Ok(TIMEOUT),
        Ok(value) => match value.trim().parse::<f64>() {
            Ok(seconds) if seconds > 0.0 && seconds.is_finite() => Ok(Duration::from_secs_f64(seconds)),
            _ => bail!("MLFLOW_HTTP_REQUEST_TIMEOUT={value}: a request's timeout is a positive number of seconds"),
        },
    }
}

/// Why a request failed: the server did not answer (worth retrying), or it
/// answered with a refusal (not).
enum Failure {
    Unreachable(String),
    Refused(String),
}

impl std::fmt::Display for Failure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Failure::Unreachable(why) | Failure::Refused(why) => f.write_str(why),
        }
    }
}

struct Server {
    url: String,
    agent: ureq::Agent,
}

impl Server {
    fn new(url: String, timeout: Duration) -> Server {
        let agent = ureq::Agent::config_builder()
            .timeout_global(Some(timeout))
            .timeout_connect(Some(CONNECT_TIMEOUT))
            // MLflow explains a refusal in the body of a 4xx, which ft reports.
            .http_status_as_error(false)
            .build()
            .into();
        Server { url, agent }
    }

    /// A REST call: `GET endpoint?query` when `body` is None, else a POST of `body`.
    fn call(&self, endpoint: &str, query: &[(&str, &str)], body: Option<&Value>) -> Result<Value, Failure> {
        let url = format!("{}/api/2.0/mlflow/{endpoint}", self.url);
        let response = match body {
            None => self.agent.get(&url).query_pairs(query.iter().copied()).call(),
            Some(body) => self.agent.post(&url).send_json(body),
        };
        Server::answer(&url, response)
    }

    /// Uploads `contents` as the artifact at `path` through the server's artifact proxy.
    fn upload(&self, path: &str, contents: &[u8]) -> Result<Value, Failure> {
        let url = format!("{}/api/2.0/{PROXIED_ARTIFACTS}/artifacts/{}", self.url, path.trim_start_matches('/'));
        Server::answer(&url, self.agent.put(&url).header("Content-Type", "application/json").send(contents))
    }

    fn answer(url: &str, response: Result<ureq::http::Response<ureq::Body>, ureq::Error>) -> Result<Value, Failure> {
        let mut response = response.map_err(|e| Failure::Unreachable(format!("{url}: {e}")))?;
        let status = response.status();
        let text = response.body_mut().read_to_string().map_err(|e| Failure::Unreachable(format!("{url}: {e}")))?;
        if status.is_success() {
            // Some endpoints answer nothing at all.
            return Ok(serde_json::from_str(&text).unwrap_or(Value::Null));
        }
        let why = format!("{url}: {status}: {}", text.trim());
        // A 429 or 5xx is the server's trouble, not the data's: sent again later.
        match status.as_u16() {
            429 | 500.. => Err(Failure::Unreachable(why)),
            _ => Err(Failure::Refused(why)),
        }
    }
}

/// The run ft logs to: where it is and where its artifacts go.
struct Run {
    id: String,
    artifact_uri: String,
}

/// What has not reached the server yet.
#[derive(Default)]
struct Queue {
    params: Vec<Value>,
    tags: Vec<Value>,
    metrics: Vec<Value>,
    /// Steps of the queued metrics, to say which never arrived.
    steps: BTreeSet<u64>,
    summary: Option<Vec<u8>>,
    /// The run's end status and time, sent last.
    end: Option<(&'static str, u64)>,
}

impl Queue {
    fn is_empty(&self) -> bool {
        self.params.is_empty() && self.tags.is_empty() && self.metrics.is_empty() && self.summary.is_none() && self.end.is_none()
    }

    /// What is queued, in words, for the warning that it never arrived.
    fn describe(&self) -> String {
        let mut parts = vec![];
        if let (Some(first), Some(last)) = (self.steps.first(), self.steps.last()) {
            parts.push(format!("{} metric values of steps {first}–{last}", self.metrics.len()));
        }
        if !self.params.is_empty() {
            parts.push(format!("{} params", self.params.len()));
        }
        if !self.tags.is_empty() {
            parts.push(format!("{} tags", self.tags.len()));
        }
        if self.summary.is_some() {
            parts.push("the summary artifact".into());
        }
        if let Some((status, _)) = self.end {
            parts.push(format!("the run's end status {status}"));
        }
        parts.join(", ")
    }
}

/// One MLflow run per training run on the tracking server (continued when
/// the run resumes), started when the first params or record arrive.
pub(super) struct MlflowServerSink {
    server: Server,
    output: PathBuf,
    resume: bool,
    experiment: String,
    run: Option<Run>,
    /// The params a resumed run already has: MLflow refuses to change them.
    logged_params: BTreeSet<String>,
    queue: Queue,
    /// While the server is failing: when to try again, and the back-off after that.
    retry: Option<(Instant, Duration)>,
    /// Whether the failure has been reported (once per run).
    warned: bool,
}

impl MlflowServerSink {
    pub(super) fn new(url: String, timeout: Duration, output: &Path, resume: bool) -> MlflowServerSink {
        MlflowServerSink {
            server: Server::new(url, timeout),
            output: output.to_path_buf(),
            resume,
            experiment: EXPERIMENT_KEY_DEFAULT.into(),
            run: None,
            logged_params: BTreeSet::new(),
            queue: Queue::default(),
            retry: None,
            warned: false,
        }
    }

    /// A failure at the start, which stops the run before its first step.
    fn at_start(&self, failure: Failure) -> anyhow::Error {
        anyhow::anyhow!("MLflow tracking server {} (MLFLOW_TRACKING_URI): {failure}", self.server.url)
    }

    /// Starts the run, or continues the one this output directory recorded, once.
    fn start(&mut self) -> Result<()> {
        if self.run.is_some() {
            return Ok(());
        }
        let run = match self.resume.then(|| self.recorded_run()).transpose()?.flatten() {
            Some(run) => run,
            None => self.create_run()?,
        };
        let record = json!({"tracking_uri": self.server.url, "run_id": run.id});
        let path = self.output.join(RUN_FILE);
        std::fs::create_dir_all(&self.output).with_context(|| format!("cannot create {}", self.output.display()))?;
        std::fs::write(&path, record.to_string()).with_context(|| format!("cannot write {}", path.display()))?;
        self.run = Some(run);
        Ok(())
    }

    fn experiment_id(&self) -> Result<String> {
        let found = self.server.call("experiments/get-by-name", &[("experiment_name", &self.experiment)], None);
        let experiment = match found {
            Ok(answer) => answer["experiment"].clone(),
            // MLflow answers an unknown name with 404 RESOURCE_DOES_NOT_EXIST.
            Err(Failure::Refused(why)) if why.contains("RESOURCE_DOES_NOT_EXIST") => {
                let created = self.server.call("experiments/create", &[], Some(&json!({"name": self.experiment}))).map_err(|f| self.at_start(f))?;
                return string_field(&created, "experiment_id");
            }
            Err(failure) => return Err(self.at_start(failure)),
        };
        if experiment["lifecycle_stage"] == "deleted" {
            bail!("the MLflow experiment {:?} is deleted on {}: restore it, or choose another name with output.mlflow_experiment", self.experiment, self.server.url);
        }
        string_field(&experiment, "experiment_id")
    }

    fn create_run(&mut self) -> Result<Run> {
        let experiment_id = self.experiment_id()?;
        let identity = RunIdentity::of(&self.output);
        let tags: Vec<Value> = identity.tags().iter().map(|(key, value)| json!({"key": key, "value": value})).collect();
        let body = json!({"experiment_id": experiment_id, "user_id": identity.user, "run_name": identity.name, "start_time": now_ms(), "tags": tags});
        let created = self.server.call("runs/create", &[], Some(&body)).map_err(|f| self.at_start(f))?;
        run_of(&created["run"]["info"])
    }

    /// The run `RUN_FILE` names, running again, if it is on this server and not deleted.
    fn recorded_run(&mut self) -> Result<Option<Run>> {
        let path = self.output.join(RUN_FILE);
        let Ok(text) = std::fs::read_to_string(&path) else { return Ok(None) };
        let recorded: Value = serde_json::from_str(&text).with_context(|| format!("{} is not ft's record of an MLflow run: delete it to start a new run", path.display()))?;
        let Some(id) = recorded["run_id"].as_str().filter(|_| recorded["tracking_uri"] == self.server.url.as_str()) else { return Ok(None) };
        let answer = match self.server.call("runs/get", &[("run_id", id)], None) {
            Ok(answer) => answer,
            Err(Failure::Refused(why)) if why.contains("RESOURCE_DOES_NOT_EXIST") => return Ok(None),
            Err(failure) => return Err(self.at_start(failure)),
        };
        let run = &answer["run"];
        if run["info"]["lifecycle_stage"] == "deleted" {
            return Ok(None);
        }
        let params = run["data"]["params"].as_array().map(Vec::as_slice).unwrap_or_default();
        self.logged_params = params.iter().filter_map(|p| p["key"].as_str().map(str::to_string)).collect();
        self.server.call("runs/update", &[], Some(&json!({"run_id": id, "status": "RUNNING"}))).map_err(|f| self.at_start(f))?;
        run_of(&run["info"]).map(Some)
    }

    /// Sends what is queued unless the server is in its back-off (`force`: regardless).
    fn flush(&mut self, force: bool) {
        if !force && self.retry.is_some_and(|(at, _)| Instant::now() < at) {
            return;
        }
        match self.send_queued() {
            Ok(()) => {
                if self.retry.take().is_some() {
                    tracing::info!("MLflow tracking server {} answers again: what was queued is sent", self.server.url);
                }
            }
            Err(why) => {
                if !self.warned {
                    tracing::warn!("MLflow tracking server {} failed ({why}); training goes on, ft keeps what it could not send and sends it when the server answers again", self.server.url);
                    self.warned = true;
                }
                let backoff = self.retry.map_or(RETRY_AFTER, |(_, b)| (b * 2).min(RETRY_AFTER_MAX));
                self.retry = Some((Instant::now() + backoff, backoff));
            }
        }
    }

    /// Sends the queue in order: params, tags and metrics in batches MLflow
    /// takes, the summary, then the end status. Returns why the server could
    /// not be reached; what it refused is reported and dropped.
    fn send_queued(&mut self) -> Result<(), String> {
        let Some(run) = &self.run else { return Ok(()) };
        let queue = &mut self.queue;
        while !queue.params.is_empty() || !queue.tags.is_empty() || !queue.metrics.is_empty() {
            let params = queue.params.len().min(MAX_PARAMS_TAGS_PER_BATCH);
            let tags = queue.tags.len().min(MAX_PARAMS_TAGS_PER_BATCH - params);
            let metrics = queue.metrics.len().min(MAX_METRICS_PER_BATCH);
            let body = json!({"run_id": run.id, "params": queue.params[..params], "tags": queue.tags[..tags], "metrics": queue.metrics[..metrics]});
            match self.server.call("runs/log-batch", &[], Some(&body)) {
                Err(Failure::Unreachable(why)) => return Err(why),
                Err(Failure::Refused(why)) => tracing::warn!("MLflow tracking server refused {params} params, {tags} tags and {metrics} metric values, which are dropped: {why}"),
                Ok(_) => {}
            }
            queue.params.drain(..params);
            queue.tags.drain(..tags);
            queue.metrics.drain(..metrics);
        }
        queue.steps.clear();
        if let Some(summary) = &queue.summary {
            match proxied_artifact_path(&run.artifact_uri) {
                Some(dir) => match self.server.upload(&format!("{dir}/summary.json"), summary) {
                    Err(Failure::Unreachable(why)) => return Err(why),
                    Err(Failure::Refused(why)) => tracing::warn!("MLflow tracking server refused the summary artifact (is it started with --serve-artifacts?): {why}"),
                    Ok(_) => {}
                },
                None => tracing::warn!(
                    "the summary is not uploaded to MLflow: the run's artifacts go to {}, which ft writes only through the tracking server's artifact proxy (mlflow server --serve-artifacts)",
                    run.artifact_uri
                ),
            }
            queue.summary = None;
        }
        if let Some((status, end_time)) = queue.end {
            match self.server.call("runs/update", &[], Some(&json!({"run_id": run.id, "status": status, "end_time": end_time}))) {
                Err(Failure::Unreachable(why)) => return Err(why),
                Err(Failure::Refused(why)) => tracing::warn!("MLflow tracking server refused the run's end status {status}: {why}"),
                Ok(_) => {}
            }
            queue.end = None;
        }
        Ok(())
    }

    /// Ends the run with `status`: one last try to send everything, and a
    /// warning naming what never arrived.
    fn end(&mut self, status: &'static str) {
        if self.run.is_none() {
            return;
        }
        self.queue.end = Some((status, now_ms()));
        self.flush(true);
        if !self.queue.is_empty() {
            tracing::warn!(
                "MLflow tracking server {} never got {} of run {}: it is only in ft's own outputs (metrics.jsonl with --report-to jsonl, summary.json)",
                self.server.url,
                self.queue.describe(),
                self.run.as_ref().map_or("", |r| r.id.as_str())
            );
        }
        self.run = None;
    }
}

/// A run's id and artifact location from MLflow's `RunInfo`.
fn run_of(info: &Value) -> Result<Run> {
    Ok(Run { id: string_field(info, "run_id")?, artifact_uri: info["artifact_uri"].as_str().unwrap_or_default().to_string() })
}

fn string_field(value: &Value, key: &str) -> Result<String> {
    value[key].as_str().map(str::to_string).with_context(|| format!("the MLflow tracking server's answer has no {key}: {value}"))
}

/// The path under the server's artifact proxy of `mlflow-artifacts:/<experiment>/<run>/artifacts`
/// (a host in the URI names the same proxy); None for a location the server does not proxy.
fn proxied_artifact_path(artifact_uri: &str) -> Option<String> {
    let url = url::Url::parse(artifact_uri).ok().filter(|u| u.scheme() == PROXIED_ARTIFACTS)?;
    Some(url.path().trim_matches('/').to_string())
}

/// `value` cut to MLflow's longest param value (on a character boundary), and whether it was cut.
fn param_value(value: &str) -> (&str, bool) {
    match value.char_indices().nth(MAX_PARAM_VAL_LENGTH) {
        Some((end, _)) => (&value[..end], true),
        None => (value, false),
    }
}

impl MetricsSink for MlflowServerSink {
    fn name(&self) -> &str {
        "mlflow"
    }

    fn params(&mut self, params: &BTreeMap<String, String>) -> Result<()> {
        if let Some(experiment) = params.get(EXPERIMENT_KEY) {
            self.experiment = experiment.clone();
        }
        self.start()?;
        let mut cut = vec![];
        // A resumed run keeps the values it started with, as MLflow's params never change.
        for (key, value) in params.iter().filter(|(key, _)| !self.logged_params.contains(*key)) {
            let (value, was_cut) = param_value(value);
            if was_cut {
                cut.push(key.as_str());
            }
            self.queue.params.push(json!({"key": key, "value": value}));
        }
        if !cut.is_empty() {
            tracing::warn!("MLflow keeps at most {MAX_PARAM_VAL_LENGTH} characters of a param's value: {} cut", cut.join(", "));
        }
        self.flush(false);
        Ok(())
    }

    fn record(&mut self, record: &Record) -> Result<()> {
        self.start()?;
        let timestamp = now_ms();
        for (key, value) in &record.values {
            self.queue.metrics.push(json!({"key": key, "value": json_metric_value(*value), "timestamp": timestamp, "step": record.step}));
        }
        self.queue.steps.insert(record.step);
        self.flush(false);
        Ok(())
    }

    fn summary(&mut self, summary: &serde_json::Value) -> Result<()> {
        self.start()?;
        self.queue.summary = Some(serde_json::to_vec_pretty(summary)?);
        self.flush(false);
        Ok(())
    }

    fn finish(&mut self) -> Result<()> {
        self.end("FINISHED");
        Ok(())
    }
}

impl Drop for MlflowServerSink {
    /// A run that ends without `finish` stopped on an error: marked failed, as
    /// MLflow's own client marks a run whose block raised.
    fn drop(&mut self) {
        self.end("FAILED");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn param_values_and_artifact_locations_are_what_mlflow_takes() {
        let long = "é".repeat(MAX_PARAM_VAL_LENGTH + 1);
        assert_eq!(param_value(&long), ("é".repeat(MAX_PARAM_VAL_LENGTH).as_str(), true));
        assert_eq!(param_value("5e-5"), ("5e-5", false));
        assert_eq!(proxied_artifact_path("mlflow-artifacts:/1/abc/artifacts").as_deref(), Some("1/abc/artifacts"));
        assert_eq!(proxied_artifact_path("mlflow-artifacts://host:5000/1/abc/artifacts").as_deref(), Some("1/abc/artifacts"));
        assert_eq!(proxied_artifact_path("/srv/mlruns/1/abc/artifacts"), None);
        assert_eq!(proxied_artifact_path("s3://bucket/1/abc/artifacts"), None);
    }
}

//! An MLflow run in MLflow's file store, the layout its client reads from a
//! `file:` tracking URI (`MlflowClient(tracking_uri="file://OUTPUT_DIR/mlruns")`,
//! `mlflow ui --backend-store-uri OUTPUT_DIR/mlruns`); the files and meta.yaml
//! fields are those of MLflow's FileStore (mlflow/store/tracking/file_store.py):
//!
//! ```text
//! mlruns/<experiment id>/meta.yaml               the experiment: id, name, artifact location
//! mlruns/<experiment id>/<run id>/meta.yaml      the run: name, status, start and end times
//! mlruns/<experiment id>/<run id>/params/<key>   the run's configuration, one value per file
//! mlruns/<experiment id>/<run id>/tags/<key>     mlflow.runName, mlflow.source.name, ft.version, …
//! mlruns/<experiment id>/<run id>/metrics/<key>  one `<timestamp ms> <value> <step>` line per record
//! mlruns/<experiment id>/<run id>/artifacts/     summary.json
//! ```
//!
//! The run's id is kept in `mlruns/.ft-run-id`, so a resumed run continues it.
//!
//! `MLFLOW_TRACKING_URI` chooses the store, as it does for MLflow's client:
//! unset, a path or a `file:` URI keeps this file store under the output
//! directory; `http(s)://…` logs to a tracking server instead (`server.rs`).

use anyhow::{anyhow, bail, Context, Result};
use ft_core::metrics::{MetricsSink, Record, SinkRegistration};
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::io::Write;
use std::path::{Path, PathBuf};

mod server;

/// The configuration key naming the experiment, read from the run's params, and its default.
const EXPERIMENT_KEY: &str = "output.mlflow_experiment";
const EXPERIMENT_KEY_DEFAULT: &str = "ft";
/// In the store's root, beside the experiments' directories (MLflow reads only directories there).
const RUN_ID_FILE: &str = ".ft-run-id";
const TEMP_FILE: &str = ".ft-write.tmp";
const META_FILE: &str = "meta.yaml";
/// Where MLflow moves deleted experiments.
const TRASH_DIR: &str = ".trash";
/// MLflow's default experiment, which its client creates in a new store.
const MLFLOW_DEFAULT_EXPERIMENT: (&str, &str) = ("0", "Default");

// MLflow's `RunStatus` and `SourceType` as meta.yaml holds them, and its lifecycle stage.
const RUNNING: u8 = 1;
const FINISHED: u8 = 3;
const FAILED: u8 = 4;
const SOURCE_TYPE_LOCAL: u8 = 4;
const ACTIVE: &str = "active";

/// An experiment's meta.yaml (MLflow's `Experiment` without its tags, which are files).
/// Fields in MLflow's order (sorted), as are the run's.
#[derive(Serialize, Deserialize, Default)]
#[serde(default)]
struct ExperimentMeta {
    artifact_location: String,
    creation_time: u64,
    experiment_id: String,
    last_update_time: u64,
    lifecycle_stage: String,
    name: String,
}

/// A run's meta.yaml: MLflow's `RunInfo` and the fields its FileStore adds.
#[derive(Serialize, Deserialize)]
struct RunMeta {
    artifact_uri: String,
    end_time: Option<u64>,
    entry_point_name: String,
    experiment_id: String,
    lifecycle_stage: String,
    run_id: String,
    run_name: String,
    /// The id again: MLflow 2.x reads it from here.
    run_uuid: String,
    source_name: String,
    source_type: u8,
    source_version: String,
    start_time: u64,
    status: u8,
    /// Always empty (tags are files); MLflow keeps the field for old readers.
    tags: Vec<String>,
    user_id: String,
}

/// The store's root directory, `OUTPUT_DIR/mlruns`.
struct Store {
    root: PathBuf,
}

impl Store {
    /// Creates the store with MLflow's default experiment unless it has one.
    fn open(output: &Path) -> Result<Store> {
        let root = output.join("mlruns");
        std::fs::create_dir_all(&root).with_context(|| format!("cannot create {}", root.display()))?;
        // Absolute, for the file URIs MLflow finds artifacts by.
        let root = std::fs::canonicalize(&root).with_context(|| format!("cannot resolve {}", root.display()))?;
        let store = Store { root };
        let (default_id, default_name) = MLFLOW_DEFAULT_EXPERIMENT;
        if !store.root.join(default_id).exists() {
            store.create_experiment(default_id, default_name)?;
        }
        Ok(store)
    }

    /// Writes `path` whole: a temporary file renamed into place, so a crash
    /// never leaves half a file where MLflow reads.
    fn write(&self, path: &Path, contents: &[u8]) -> Result<()> {
        let temp = self.root.join(TEMP_FILE);
        std::fs::write(&temp, contents).with_context(|| format!("cannot write {}", temp.display()))?;
        std::fs::rename(&temp, path).with_context(|| format!("cannot write {}", path.display()))
    }

    fn write_yaml(&self, path: &Path, value: &impl Serialize) -> Result<()> {
        self.write(path, serde_yaml::to_string(value)?.as_bytes())
    }

    /// The experiments whose directories are in `dir` (the root, or its trash).
    fn experiments_in(dir: &Path) -> Result<Vec<ExperimentMeta>> {
        let entries = match std::fs::read_dir(dir) {
            Ok(entries) => entries,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(vec![]),
            Err(e) => return Err(e).with_context(|| format!("cannot list {}", dir.display())),
        };
        let mut experiments = vec![];
        for entry in entries {
            let meta = entry.with_context(|| format!("cannot list {}", dir.display()))?.path().join(META_FILE);
            // As MLflow does, directories without an experiment's meta.yaml are not experiments.
            if let Ok(experiment) = read_yaml::<ExperimentMeta>(&meta) {
                experiments.push(experiment);
            }
        }
        Ok(experiments)
    }

    /// The id of the active experiment named `name`, created when there is none.
    fn experiment_id(&self, name: &str) -> Result<String> {
        if let Some(experiment) = Store::experiments_in(&self.root)?.into_iter().find(|e| e.name == name) {
            return Ok(experiment.experiment_id);
        }
        let trash = self.root.join(TRASH_DIR);
        if Store::experiments_in(&trash)?.iter().any(|e| e.name == name) {
            bail!("the MLflow experiment {name:?} is deleted (in {}): restore it, or choose another name with output.mlflow_experiment", trash.display());
        }
        // An 18-digit number, as MLflow's experiment ids are.
        let id = (u64::from_le_bytes(random_bytes()?) % 900_000_000_000_000_000 + 100_000_000_000_000_000).to_string();
        self.create_experiment(&id, name)?;
        Ok(id)
    }

    fn create_experiment(&self, id: &str, name: &str) -> Result<()> {
        let dir = self.root.join(id);
        std::fs::create_dir_all(&dir).with_context(|| format!("cannot create {}", dir.display()))?;
        let now = now_ms();
        let meta = ExperimentMeta {
            artifact_location: file_uri(&dir)?,
            creation_time: now,
            experiment_id: id.into(),
            last_update_time: now,
            lifecycle_stage: ACTIVE.into(),
            name: name.into(),
        };
        self.write_yaml(&dir.join(META_FILE), &meta)
    }

    /// The directory and meta.yaml of the run `.ft-run-id` names, if it is still there.
    fn recorded_run(&self) -> Result<Option<(PathBuf, RunMeta)>> {
        let path = self.root.join(RUN_ID_FILE);
        let id = match std::fs::read_to_string(&path) {
            Ok(id) => id,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(e).with_context(|| format!("cannot read {}", path.display())),
        };
        let id = id.trim();
        if id.is_empty() || !id.chars().all(|c| c.is_ascii_alphanumeric()) {
            bail!("{} holds {id:?}, not an MLflow run id: delete it to start a new run", path.display());
        }
        for experiment in Store::experiments_in(&self.root)? {
            let dir = self.root.join(&experiment.experiment_id).join(id);
            if dir.join(META_FILE).exists() {
                let meta = read_yaml(&dir.join(META_FILE))?;
                return Ok(Some((dir, meta)));
            }
        }
        Ok(None)
    }
}

fn read_yaml<T: DeserializeOwned>(path: &Path) -> Result<T> {
    let text = std::fs::read_to_string(path).with_context(|| format!("cannot read {}", path.display()))?;
    serde_yaml::from_str(&text).with_context(|| format!("{} is not MLflow's meta.yaml", path.display()))
}

/// An open run: its directory and its meta.yaml.
struct Run {
    store: Store,
    dir: PathBuf,
    meta: RunMeta,
}

impl Run {
    /// When `resume`, the run `.ft-run-id` names, running again; otherwise (or
    /// when that run is gone) a new run in `experiment`, named after the output directory.
    fn open(output: &Path, experiment: &str, resume: bool) -> Result<Run> {
        let store = Store::open(output)?;
        let recorded = if resume { store.recorded_run()? } else { None };
        let Some((dir, meta)) = recorded else {
            return Run::create(store, experiment);
        };
        let mut run = Run { store, dir, meta };
        run.set_status(RUNNING, None)?;
        Ok(run)
    }

    fn create(store: Store, experiment: &str) -> Result<Run> {
        let experiment_id = store.experiment_id(experiment)?;
        let id: String = random_bytes::<16>()?.iter().map(|b| format!("{b:02x}")).collect();
        let dir = store.root.join(&experiment_id).join(&id);
        for part in ["metrics", "params", "tags", "artifacts"] {
            let part = dir.join(part);
            std::fs::create_dir_all(&part).with_context(|| format!("cannot create {}", part.display()))?;
        }
        let identity = RunIdentity::of(store.root.parent().unwrap_or(&store.root));
        let meta = RunMeta {
            artifact_uri: file_uri(&dir.join("artifacts"))?,
            end_time: None,
            entry_point_name: String::new(),
            experiment_id,
            lifecycle_stage: ACTIVE.into(),
            run_id: id.clone(),
            run_name: identity.name.clone(),
            run_uuid: id.clone(),
            source_name: String::new(),
            source_type: SOURCE_TYPE_LOCAL,
            source_version: String::new(),
            start_time: now_ms(),
            status: RUNNING,
            tags: vec![],
            user_id: identity.user.clone(),
        };
        store.write_yaml(&dir.join(META_FILE), &meta)?;
        for (key, value) in identity.tags() {
            store.write(&entry_path(&dir.join("tags"), key)?, value.as_bytes())?;
        }
        store.write(&store.root.join(RUN_ID_FILE), id.as_bytes())?;
        Ok(Run { store, dir, meta })
    }

    fn set_status(&mut self, status: u8, end_time: Option<u64>) -> Result<()> {
        (self.meta.status, self.meta.end_time) = (status, end_time);
        self.store.write_yaml(&self.dir.join(META_FILE), &self.meta)
    }

    fn log_metric(&self, key: &str, value: f64, step: u64, timestamp: u64) -> Result<()> {
        let path = entry_path(&self.dir.join("metrics"), key)?;
        let mut file = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&path)
            .with_context(|| format!("cannot open {}", path.display()))?;
        // The whole line in one append, so an interrupted run leaves no half line.
        file.write_all(format!("{timestamp} {value} {step}\n").as_bytes()).with_context(|| format!("cannot write {}", path.display()))
    }
}

/// Refuses a param, tag or metric name MLflow would refuse: names hold
/// alphanumerics, `_ - . : /` and spaces, and no empty, `.` or `..` part
/// between slashes.
fn check_name(key: &str) -> Result<()> {
    let allowed = |c: char| c.is_alphanumeric() || "_-.: /".contains(c);
    let normal = key.split('/').all(|part| !part.is_empty() && part != "." && part != "..");
    if !key.chars().all(allowed) || !normal {
        bail!("{key:?} cannot be an MLflow param, tag or metric name: those hold alphanumerics, `_ - . : /` and spaces, with no empty, `.` or `..` part");
    }
    Ok(())
}

/// `dir/key` for a param, tag or metric named `key` (`check_name`).
fn entry_path(dir: &Path, key: &str) -> Result<PathBuf> {
    check_name(key)?;
    let path = dir.join(key);
    if let Some(parent) = path.parent() {
        std::fs::create_dir_all(parent).with_context(|| format!("cannot create {}", parent.display()))?;
    }
    Ok(path)
}

/// An absolute path as a file URI, percent-encoded as Python's `pathlib.Path.as_uri` does.
/// `path` (absolute: the store's root is canonical) as a file URI, as MLflow records artifact locations.
fn file_uri(path: &Path) -> Result<String> {
    Ok(url::Url::from_file_path(path).map_err(|()| anyhow!("{} is not an absolute path", path.display()))?.into())
}

/// Who and what a new run is, in either store.
struct RunIdentity {
    name: String,
    user: String,
}

impl RunIdentity {
    fn of(output: &Path) -> RunIdentity {
        let name = crate::run_name(output);
        let user = std::env::var("LOGNAME").or_else(|_| std::env::var("USER")).unwrap_or_else(|_| "unknown".into());
        RunIdentity { name, user }
    }

    /// The tags MLflow's client sets on a run it starts, and ft's version.
    fn tags(&self) -> [(&'static str, &str); 5] {
        [
            ("mlflow.runName", self.name.as_str()),
            ("mlflow.source.name", "ft"),
            ("mlflow.source.type", "LOCAL"),
            ("mlflow.user", self.user.as_str()),
            ("ft.version", env!("CARGO_PKG_VERSION")),
        ]
    }
}

fn now_ms() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default().as_millis() as u64
}

fn random_bytes<const N: usize>() -> Result<[u8; N]> {
    let mut bytes = [0; N];
    getrandom::fill(&mut bytes).map_err(|e| anyhow!("no random bytes for an MLflow id: {e}"))?;
    Ok(bytes)
}

/// One MLflow run per training run (continued when the run resumes), opened
/// when the first params or record arrive.
pub struct MlflowSink {
    output: PathBuf,
    resume: bool,
    experiment: String,
    run: Option<Run>,
}

impl MlflowSink {
    pub fn new(output: &Path, resume: bool) -> MlflowSink {
        MlflowSink { output: output.to_path_buf(), resume, experiment: EXPERIMENT_KEY_DEFAULT.into(), run: None }
    }

    fn run(&mut self) -> Result<&mut Run> {
        let run = match self.run.take() {
            Some(run) => run,
            None => Run::open(&self.output, &self.experiment, self.resume)?,
        };
        Ok(self.run.insert(run))
    }
}

impl MetricsSink for MlflowSink {
    fn name(&self) -> &str {
        "mlflow"
    }

    fn params(&mut self, params: &BTreeMap<String, String>) -> Result<()> {
        if let Some(experiment) = params.get(EXPERIMENT_KEY) {
            self.experiment = experiment.clone();
        }
        let run = self.run()?;
        for (key, value) in params {
            let path = entry_path(&run.dir.join("params"), key)?;
            // MLflow's params never change: a resumed run keeps the values it started with.
            if !path.exists() {
                run.store.write(&path, value.as_bytes())?;
            }
        }
        Ok(())
    }

    fn record(&mut self, record: &Record) -> Result<()> {
        let run = self.run()?;
        let timestamp = now_ms();
        for (key, value) in &record.values {
            run.log_metric(key, *value, record.step, timestamp)?;
        }
        Ok(())
    }

    fn summary(&mut self, summary: &serde_json::Value) -> Result<()> {
        let run = self.run()?;
        run.store.write(&run.dir.join("artifacts/summary.json"), serde_json::to_string_pretty(summary)?.as_bytes())
    }

    fn finish(&mut self) -> Result<()> {
        match self.run.take() {
            Some(mut run) => run.set_status(FINISHED, Some(now_ms())),
            None => Ok(()),
        }
    }
}

impl Drop for MlflowSink {
    /// A run that ends without `finish` stopped on an error: marked failed, as
    /// MLflow's own client marks a run whose block raised. Drop cannot report
    /// a failure to write that.
    fn drop(&mut self) {
        if let Some(mut run) = self.run.take() {
            let _ = run.set_status(FAILED, Some(now_ms()));
        }
    }
}

inventory::submit! {
    SinkRegistration {
        name: "mlflow",
        summary: "an MLflow run: on the tracking server MLFLOW_TRACKING_URI=http(s)://… names, else in <output>/mlruns/ (file store); experiment: output.mlflow_experiment",
        create: |dir, resumed| match server::tracking_server()? {
            Some(url) => Ok(Box::new(server::MlflowServerSink::new(url, server::request_timeout()?, dir, resumed.is_some()))),
            None => Ok(Box::new(MlflowSink::new(dir, resumed.is_some()))),
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn params(experiment: &str, lr: &str) -> BTreeMap<String, String> {
        BTreeMap::from([(EXPERIMENT_KEY.to_string(), experiment.to_string()), ("train.lr".to_string(), lr.to_string())])
    }

    fn record(step: u64, loss: f64) -> Record {
        Record { step, values: BTreeMap::from([("loss".to_string(), loss)]) }
    }

    fn yaml(path: &Path) -> serde_yaml::Value {
        serde_yaml::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
    }

    /// The run directories of the experiment named `name` in `output`'s store.
    fn runs(output: &Path, name: &str) -> Vec<PathBuf> {
        let store = output.join("mlruns");
        let experiment = Store::experiments_in(&store).unwrap().into_iter().find(|e| e.name == name).unwrap();
        let dir = store.join(&experiment.experiment_id);
        std::fs::read_dir(&dir).unwrap().map(|e| e.unwrap().path()).filter(|p| p.is_dir()).collect()
    }

    fn read(path: PathBuf) -> String {
        std::fs::read_to_string(path).unwrap()
    }

    /// Each line of a metric file as (value, step), after checking its timestamp.
    fn history(run: &Path, key: &str) -> Vec<(String, String)> {
        read(run.join("metrics").join(key))
            .lines()
            .map(|line| {
                let fields: Vec<&str> = line.split(' ').collect();
                assert!(fields.len() == 3 && fields[0].parse::<u64>().unwrap() > 1_700_000_000_000, "{line:?}");
                (fields[1].to_string(), fields[2].to_string())
            })
            .collect()
    }

    #[test]
    fn a_run_is_written_in_mlflows_file_store_layout() {
        let dir = tempfile::tempdir().unwrap();
        let mut sink = MlflowSink::new(dir.path(), false);
        sink.params(&params("tests", "5e-5")).unwrap();
        sink.record(&record(1, 2.5)).unwrap();
        sink.record(&record(2, 0.1 + 0.2)).unwrap();
        sink.summary(&serde_json::json!({"world_size": 2})).unwrap();
        sink.finish().unwrap();

        let store = dir.path().join("mlruns");
        assert_eq!(yaml(&store.join("0/meta.yaml"))["name"], "Default");
        let [run] = runs(dir.path(), "tests").try_into().unwrap();
        let experiment = yaml(&run.parent().unwrap().join("meta.yaml"));
        let meta = yaml(&run.join("meta.yaml"));
        let run_id = read(store.join(RUN_ID_FILE));
        assert_eq!(meta["run_id"].as_str(), Some(run_id.as_str()));
        assert_eq!(run.file_name().unwrap().to_str(), Some(run_id.as_str()));
        // Ids are strings in YAML even when they are digits.
        assert!(experiment["experiment_id"].is_string() && meta["experiment_id"] == experiment["experiment_id"]);
        assert_eq!((meta["status"].as_u64(), meta["lifecycle_stage"].as_str()), (Some(FINISHED as u64), Some(ACTIVE)));
        assert!(meta["end_time"].as_u64() >= meta["start_time"].as_u64());
        assert_eq!(meta["artifact_uri"].as_str().unwrap(), file_uri(&std::fs::canonicalize(run.join("artifacts")).unwrap()).unwrap());
        assert_eq!(history(&run, "loss"), [("2.5".into(), "1".into()), ("0.30000000000000004".into(), "2".into())]);
        assert_eq!(read(run.join("params/train.lr")), "5e-5");
        assert_eq!(read(run.join("tags/mlflow.source.name")), "ft");
        assert_eq!(read(run.join("tags/mlflow.runName")), dir.path().file_name().unwrap().to_string_lossy());
        let summary: serde_json::Value = serde_json::from_str(&read(run.join("artifacts/summary.json"))).unwrap();
        assert_eq!(summary["world_size"], 2);
    }

    #[test]
    fn a_resumed_run_continues_its_mlflow_run_and_a_new_run_starts_another() {
        let dir = tempfile::tempdir().unwrap();
        let mut first = MlflowSink::new(dir.path(), false);
        first.params(&params("tests", "5e-5")).unwrap();
        first.record(&record(1, 2.5)).unwrap();
        first.finish().unwrap();

        let mut resumed = MlflowSink::new(dir.path(), true);
        let mut changed = params("tests", "1e-4");
        changed.insert("train.resume".into(), "latest".into());
        resumed.params(&changed).unwrap();
        let [run] = runs(dir.path(), "tests").try_into().unwrap();
        assert_eq!((yaml(&run.join("meta.yaml"))["status"].as_u64(), yaml(&run.join("meta.yaml"))["end_time"].as_u64()), (Some(RUNNING as u64), None));
        resumed.record(&record(2, 2.25)).unwrap();
        resumed.finish().unwrap();
        assert_eq!(history(&run, "loss"), [("2.5".into(), "1".into()), ("2.25".into(), "2".into())]);
        assert_eq!(read(run.join("params/train.lr")), "5e-5", "params keep their first values");
        assert_eq!(read(run.join("params/train.resume")), "latest");
        assert_eq!(yaml(&run.join("meta.yaml"))["status"].as_u64(), Some(FINISHED as u64));

        let mut fresh = MlflowSink::new(dir.path(), false);
        fresh.params(&params("tests", "5e-5")).unwrap();
        fresh.finish().unwrap();
        assert_eq!(runs(dir.path(), "tests").len(), 2);
    }

    #[test]
    fn a_run_that_stops_without_finishing_is_failed() {
        let dir = tempfile::tempdir().unwrap();
        let mut sink = MlflowSink::new(dir.path(), false);
        sink.record(&record(1, 2.5)).unwrap();
        drop(sink);
        let [run] = runs(dir.path(), EXPERIMENT_KEY_DEFAULT).try_into().unwrap();
        let meta = yaml(&run.join("meta.yaml"));
        assert_eq!(meta["status"].as_u64(), Some(FAILED as u64));
        assert!(meta["end_time"].as_u64().is_some());
    }

    #[test]
    fn names_mlflow_refuses_are_refused_and_paths_become_file_uris() {
        let dir = tempfile::tempdir().unwrap();
        for good in ["train.lr", "eval/f1", "a b:c-d_e"] {
            assert_eq!(entry_path(dir.path(), good).unwrap(), dir.path().join(good));
        }
        for bad in ["", "../x", "a//b", "/x", "./x", "a\"b", "x\n"] {
            assert!(entry_path(dir.path(), bad).is_err(), "{bad:?}");
        }
        assert_eq!(file_uri(Path::new("/tmp/a b/ü~x")).unwrap(), "file:///tmp/a%20b/%C3%BC~x");
    }
}

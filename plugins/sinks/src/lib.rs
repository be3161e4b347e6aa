//! ft's built-in metrics sinks, each registered beside itself: one JSON
//! object per step (`metrics.jsonl`), one CSV row per step (`metrics.csv`),
//! TensorBoard event files (`tensorboard/`), an MLflow run (in MLflow's file
//! store `mlruns/`, or on a tracking server), and a Weights & Biases run.

mod mlflow;
mod tensorboard;
mod wandb;

use anyhow::{Context, Result};
use ft_core::metrics::{MetricsSink, Record, SinkRegistration};
use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};

/// A metric's value in JSON for a tracker: protobuf's JSON names the
/// non-finite doubles (a diverged loss), which JSON numbers cannot hold, and
/// MLflow's server and Python's `float()` both read those names.
fn json_metric_value(value: f64) -> serde_json::Value {
    match value {
        v if v.is_nan() => "NaN".into(),
        v if v.is_infinite() => (if v > 0.0 { "Infinity" } else { "-Infinity" }).into(),
        v => v.into(),
    }
}

/// A tracker's name for the run writing into `output`: the directory's own
/// name, as ft's runs are told apart by it.
fn run_name(output: &Path) -> String {
    output.file_name().map_or("ft".into(), |n| n.to_string_lossy().into_owned())
}

/// One JSON object per line: `{"step": 3, "loss": 2.31, "run_id": "…", …}`.
pub struct JsonlSink {
    path: PathBuf,
    out: BufWriter<File>,
    /// The run's id (from its params), in every line.
    run_id: Option<String>,
}

/// Reads the step a line of a metrics file records (None: no step, a torn line).
type StepOf = fn(index: usize, line: &str) -> Option<u64>;

/// Opens `dir/name` for a sink: new for a fresh run; for a run continuing
/// from step `resumed`, its lines up to that step kept and appended to.
fn open_metrics_file(dir: &Path, name: &str, resumed: Option<u64>, step_of: StepOf) -> Result<(PathBuf, File)> {
    std::fs::create_dir_all(dir).with_context(|| format!("cannot create metrics directory {}", dir.display()))?;
    let path = dir.join(name);
    if let Some(step) = resumed {
        keep_through(&path, step, step_of)?;
    }
    let file = std::fs::OpenOptions::new()
        .create(true)
        .write(true)
        .append(resumed.is_some())
        .truncate(resumed.is_none())
        .open(&path)
        .with_context(|| format!("cannot create {}", path.display()))?;
    Ok((path, file))
}

/// Drops `path`'s lines of steps after `step` — what a run wrote after the
/// checkpoint a resumed run continues from, and a torn last line — replacing
/// the file atomically; no file, nothing to drop.
fn keep_through(path: &Path, step: u64, step_of: StepOf) -> Result<()> {
    let text = match std::fs::read_to_string(path) {
        Err(error) if error.kind() == std::io::ErrorKind::NotFound => return Ok(()),
        read => read.with_context(|| format!("cannot read {}", path.display()))?,
    };
    let kept: String = text.lines().enumerate().filter(|(index, line)| step_of(*index, line).is_some_and(|s| s <= step)).map(|(_, line)| format!("{line}\n")).collect();
    if kept == text {
        return Ok(());
    }
    let temporary = path.with_file_name(format!(".{}.tmp", path.file_name().unwrap_or_default().to_string_lossy()));
    std::fs::write(&temporary, kept).with_context(|| format!("cannot write {}", temporary.display()))?;
    std::fs::rename(&temporary, path).with_context(|| format!("cannot move {} to {}", temporary.display(), path.display()))
}

impl JsonlSink {
    pub fn create(dir: &Path, resumed: Option<u64>) -> Result<JsonlSink> {
        let step_of: StepOf = |_, line| serde_json::from_str::<serde_json::Value>(line).ok()?.get("step")?.as_u64();
        let (path, file) = open_metrics_file(dir, "metrics.jsonl", resumed, step_of)?;
        Ok(JsonlSink { path, out: BufWriter::new(file), run_id: None })
    }
}

impl MetricsSink for JsonlSink {
    fn name(&self) -> &str {
        "jsonl"
    }

    fn params(&mut self, params: &std::collections::BTreeMap<String, String>) -> Result<()> {
        self.run_id = params.get("run_id").cloned();
        Ok(())
    }

    fn record(&mut self, record: &Record) -> Result<()> {
        let mut line = serde_json::Map::new();
        line.insert("step".into(), record.step.into());
        for (key, value) in &record.values {
            line.insert(key.clone(), serde_json::Value::from(*value));
        }
        if let Some(id) = &self.run_id {
            line.insert("run_id".into(), id.clone().into());
        }
        serde_json::to_writer(&mut self.out, &line)?;
        writeln!(self.out).with_context(|| format!("cannot write {}", self.path.display()))?;
        // Each record reaches the file at once, so a crash loses none.
        self.out.flush().with_context(|| format!("cannot write {}", self.path.display()))
    }

    fn finish(&mut self) -> Result<()> {
        self.out.flush().with_context(|| format!("cannot write {}", self.path.display()))
    }
}

/// One row per record in `<output>/metrics.csv`; the columns are the first
/// record's keys (later keys that were not there are dropped).
pub struct CsvSink {
    path: PathBuf,
    out: BufWriter<File>,
    columns: Option<Vec<String>>,
}

impl CsvSink {
    pub fn create(dir: &Path, resumed: Option<u64>) -> Result<CsvSink> {
        // The header comes before every step.
        let step_of: StepOf = |index, line| if index == 0 { Some(0) } else { line.split(',').next()?.parse().ok() };
        let (path, file) = open_metrics_file(dir, "metrics.csv", resumed, step_of)?;
        Ok(CsvSink { path, out: BufWriter::new(file), columns: None })
    }
}

impl MetricsSink for CsvSink {
    fn name(&self) -> &str {
        "csv"
    }

    fn record(&mut self, record: &Record) -> Result<()> {
        let columns = self.columns.get_or_insert_with(|| record.values.keys().cloned().collect());
        if self.out.get_ref().metadata().map(|m| m.len()).unwrap_or(0) == 0 {
            writeln!(self.out, "step,{}", columns.join(","))?;
        }
        let cells: Vec<String> =
            columns.iter().map(|c| record.values.get(c).map(|v| v.to_string()).unwrap_or_default()).collect();
        writeln!(self.out, "{},{}", record.step, cells.join(",")).with_context(|| format!("cannot write {}", self.path.display()))?;
        self.out.flush().with_context(|| format!("cannot write {}", self.path.display()))
    }

    fn finish(&mut self) -> Result<()> {
        self.out.flush().with_context(|| format!("cannot write {}", self.path.display()))
    }
}

inventory::submit! {
    SinkRegistration {
        name: "csv",
        summary: "one row per step in <output>/metrics.csv",
        create: |dir, resumed| Ok(Box::new(CsvSink::create(dir, resumed)?)),
    }
}

inventory::submit! {
    SinkRegistration {
        name: "jsonl",
        summary: "one JSON object per step in <output>/metrics.jsonl",
        create: |dir, resumed| Ok(Box::new(JsonlSink::create(dir, resumed)?)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeMap;

    #[test]
    fn csv_has_a_header_and_a_row_per_record() {
        let dir = tempfile::tempdir().unwrap();
        let mut sink = CsvSink::create(dir.path(), None).unwrap();
        for step in 1..=2 {
            let values = BTreeMap::from([("loss".to_string(), step as f64), ("lr".to_string(), 0.5)]);
            sink.record(&Record { step, values }).unwrap();
        }
        sink.finish().unwrap();
        let text = std::fs::read_to_string(dir.path().join("metrics.csv")).unwrap();
        assert_eq!(text, "step,loss,lr\n1,1,0.5\n2,2,0.5\n");
    }

    #[test]
    fn non_finite_metric_values_are_named() {
        assert_eq!(json_metric_value(2.5), serde_json::json!(2.5));
        let named = [f64::NAN, f64::INFINITY, f64::NEG_INFINITY].map(json_metric_value);
        assert_eq!(named, ["NaN", "Infinity", "-Infinity"].map(serde_json::Value::from));
    }

    #[test]
    fn jsonl_writes_one_object_per_record() {
        let dir = tempfile::tempdir().unwrap();
        let mut sink = JsonlSink::create(dir.path(), None).unwrap();
        for step in 1..=2 {
            let values = BTreeMap::from([("loss".to_string(), 1.5 / step as f64)]);
            sink.record(&Record { step, values }).unwrap();
        }
        sink.finish().unwrap();
        let text = std::fs::read_to_string(dir.path().join("metrics.jsonl")).unwrap();
        let lines: Vec<serde_json::Value> = text.lines().map(|l| serde_json::from_str(l).unwrap()).collect();
        assert_eq!(lines.len(), 2);
        assert_eq!(lines[1]["step"], 2);
        assert_eq!(lines[1]["loss"], 0.75);
    }

    #[test]
    fn a_resumed_run_keeps_the_records_up_to_its_checkpoint_and_repeats_none() {
        let dir = tempfile::tempdir().unwrap();
        let record = |step: u64| Record { step, values: BTreeMap::from([("loss".to_string(), step as f64)]) };
        let mut jsonl = JsonlSink::create(dir.path(), None).unwrap();
        let mut csv = CsvSink::create(dir.path(), None).unwrap();
        jsonl.params(&BTreeMap::from([("run_id".to_string(), "run-a".to_string())])).unwrap();
        for step in 1..=5 {
            jsonl.record(&record(step)).unwrap();
            csv.record(&record(step)).unwrap();
        }
        drop((jsonl, csv));
        // A torn last line, as a killed run may leave.
        std::fs::OpenOptions::new().append(true).open(dir.path().join("metrics.jsonl")).unwrap().write_all(b"{\"step\": 6, \"lo").unwrap();
        let mut jsonl = JsonlSink::create(dir.path(), Some(3)).unwrap();
        let mut csv = CsvSink::create(dir.path(), Some(3)).unwrap();
        for step in 4..=6 {
            jsonl.record(&record(step)).unwrap();
            csv.record(&record(step)).unwrap();
        }
        let steps: Vec<u64> = std::fs::read_to_string(dir.path().join("metrics.jsonl"))
            .unwrap()
            .lines()
            .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap()["step"].as_u64().unwrap())
            .collect();
        assert_eq!(steps, [1, 2, 3, 4, 5, 6]);
        assert!(std::fs::read_to_string(dir.path().join("metrics.jsonl")).unwrap().lines().next().unwrap().contains(r#""run_id":"run-a""#));
        let csv_text = std::fs::read_to_string(dir.path().join("metrics.csv")).unwrap();
        assert_eq!(csv_text, "step,loss\n1,1\n2,2\n3,3\n4,4\n5,5\n6,6\n");
    }
}

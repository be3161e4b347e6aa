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

/// One JSON object per line: `{"step": 3, "loss": 2.31, …}`.
pub struct JsonlSink {
    path: PathBuf,
    out: BufWriter<File>,
}

/// Opens `dir/name` for a sink: appended to when a run resumes, else new.
fn open_metrics_file(dir: &Path, name: &str, append: bool) -> Result<(PathBuf, File)> {
    std::fs::create_dir_all(dir).with_context(|| format!("cannot create metrics directory {}", dir.display()))?;
    let path = dir.join(name);
    let file = std::fs::OpenOptions::new()
        .create(true)
        .write(true)
        .append(append)
        .truncate(!append)
        .open(&path)
        .with_context(|| format!("cannot create {}", path.display()))?;
    Ok((path, file))
}

impl JsonlSink {
    pub fn create(dir: &Path, append: bool) -> Result<JsonlSink> {
        let (path, file) = open_metrics_file(dir, "metrics.jsonl", append)?;
        Ok(JsonlSink { path, out: BufWriter::new(file) })
    }
}

impl MetricsSink for JsonlSink {
    fn name(&self) -> &str {
        "jsonl"
    }

    fn record(&mut self, record: &Record) -> Result<()> {
        let mut line = serde_json::Map::new();
        line.insert("step".into(), record.step.into());
        for (key, value) in &record.values {
            line.insert(key.clone(), serde_json::Value::from(*value));
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
    pub fn create(dir: &Path, append: bool) -> Result<CsvSink> {
        let (path, file) = open_metrics_file(dir, "metrics.csv", append)?;
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
        create: |dir, append| Ok(Box::new(CsvSink::create(dir, append)?)),
    }
}

inventory::submit! {
    SinkRegistration {
        name: "jsonl",
        summary: "one JSON object per step in <output>/metrics.jsonl",
        create: |dir, append| Ok(Box::new(JsonlSink::create(dir, append)?)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeMap;

    #[test]
    fn csv_has_a_header_and_a_row_per_record() {
        let dir = tempfile::tempdir().unwrap();
        let mut sink = CsvSink::create(dir.path(), false).unwrap();
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
        let mut sink = JsonlSink::create(dir.path(), false).unwrap();
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
}


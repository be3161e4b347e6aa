//! Metrics go to sinks: each step's values (loss, throughput, memory, …) and
//! the run's final summary. Built-in sinks register themselves in the registry.

use anyhow::{Context, Result};
use std::collections::BTreeMap;
use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};

/// Named values at one step, e.g. {"loss": 2.31, "tokens_per_s": 41000.0}.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct Record {
    pub step: u64,
    pub values: BTreeMap<String, f64>,
}

pub trait MetricsSink: Send {
    fn name(&self) -> &str;
    fn record(&mut self, record: &Record) -> Result<()>;
    /// Flushes everything; called once at the end of the run.
    fn finish(&mut self) -> Result<()>;
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
    crate::registry::SinkRegistration {
        name: "csv",
        summary: "one row per step in <output>/metrics.csv",
        create: |dir, append| Ok(Box::new(CsvSink::create(dir, append)?)),
    }
}

inventory::submit! {
    crate::registry::SinkRegistration {
        name: "jsonl",
        summary: "one JSON object per step in <output>/metrics.jsonl",
        create: |dir, append| Ok(Box::new(JsonlSink::create(dir, append)?)),
    }
}

/// This process's resident memory now and at its peak (Linux), in bytes.
pub fn process_memory() -> Option<(u64, u64)> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let field = |name: &str| -> Option<u64> {
        let line = status.lines().find(|l| l.starts_with(name))?;
        Some(line.split_whitespace().nth(1)?.parse::<u64>().ok()? * 1024)
    };
    Some((field("VmRSS:")?, field("VmHWM:")?))
}

#[cfg(test)]
mod tests {
    use super::*;

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
        let (now, peak) = process_memory().unwrap();
        assert!(now > 0 && peak >= now);
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

/// TensorBoard event files (`<output>/tensorboard/events.out.tfevents.*`):
/// TFRecord framing (length, masked CRC-32C of the length, an `Event`
/// protobuf, its masked CRC) with one scalar summary per value.
pub struct TensorBoardSink {
    path: PathBuf,
    out: BufWriter<File>,
}

/// Protocol-buffer encoding of the three messages TensorBoard reads.
mod proto {
    pub fn varint(out: &mut Vec<u8>, mut value: u64) {
        while value >= 0x80 {
            out.push((value as u8) | 0x80);
            value >>= 7;
        }
        out.push(value as u8);
    }

    fn key(out: &mut Vec<u8>, field: u32, wire_type: u32) {
        varint(out, ((field << 3) | wire_type) as u64);
    }

    pub fn double(out: &mut Vec<u8>, field: u32, value: f64) {
        key(out, field, 1);
        out.extend_from_slice(&value.to_le_bytes());
    }

    pub fn float(out: &mut Vec<u8>, field: u32, value: f32) {
        key(out, field, 5);
        out.extend_from_slice(&value.to_le_bytes());
    }

    pub fn int(out: &mut Vec<u8>, field: u32, value: i64) {
        key(out, field, 0);
        varint(out, value as u64);
    }

    pub fn bytes(out: &mut Vec<u8>, field: u32, value: &[u8]) {
        key(out, field, 2);
        varint(out, value.len() as u64);
        out.extend_from_slice(value);
    }
}

fn masked_crc(data: &[u8]) -> u32 {
    let crc = crc32c::crc32c(data);
    crc.rotate_right(15).wrapping_add(0xa282_ead8)
}

impl TensorBoardSink {
    pub fn create(dir: &Path, _append: bool) -> Result<TensorBoardSink> {
        let dir = dir.join("tensorboard");
        std::fs::create_dir_all(&dir).with_context(|| format!("cannot create {}", dir.display()))?;
        let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default();
        let host = std::fs::read_to_string("/proc/sys/kernel/hostname").unwrap_or_else(|_| "localhost".into());
        // A new file per run (resumes too): TensorBoard reads all files of a directory in order.
        let path = dir.join(format!("events.out.tfevents.{}.{}.{}", now.as_secs(), host.trim(), std::process::id()));
        let file = File::create(&path).with_context(|| format!("cannot create {}", path.display()))?;
        let mut sink = TensorBoardSink { path, out: BufWriter::new(file) };
        let mut event = vec![];
        proto::double(&mut event, 1, now.as_secs_f64());
        proto::bytes(&mut event, 3, b"brain.Event:2");
        sink.write_record(&event)?;
        Ok(sink)
    }

    fn write_record(&mut self, data: &[u8]) -> Result<()> {
        let length = (data.len() as u64).to_le_bytes();
        self.out.write_all(&length)?;
        self.out.write_all(&masked_crc(&length).to_le_bytes())?;
        self.out.write_all(data)?;
        self.out.write_all(&masked_crc(data).to_le_bytes())?;
        self.out.flush().with_context(|| format!("cannot write {}", self.path.display()))
    }
}

impl MetricsSink for TensorBoardSink {
    fn name(&self) -> &str {
        "tensorboard"
    }

    fn record(&mut self, record: &Record) -> Result<()> {
        let mut summary = vec![];
        for (tag, value) in &record.values {
            let mut entry = vec![];
            proto::bytes(&mut entry, 1, tag.as_bytes());
            proto::float(&mut entry, 2, *value as f32);
            proto::bytes(&mut summary, 1, &entry);
        }
        let mut event = vec![];
        let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default();
        proto::double(&mut event, 1, now.as_secs_f64());
        proto::int(&mut event, 2, record.step as i64);
        proto::bytes(&mut event, 5, &summary);
        self.write_record(&event)
    }

    fn finish(&mut self) -> Result<()> {
        self.out.flush().with_context(|| format!("cannot write {}", self.path.display()))
    }
}

inventory::submit! {
    crate::registry::SinkRegistration {
        name: "tensorboard",
        summary: "TensorBoard event files in <output>/tensorboard/",
        create: |dir, append| Ok(Box::new(TensorBoardSink::create(dir, append)?)),
    }
}

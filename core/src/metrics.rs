//! Metrics go to sinks: each step's values (loss, throughput, memory, …) and
//! each epoch's evaluation. The built-in sinks are a plugins crate
//! (`plugins/sinks`); each registers beside its implementation.

use anyhow::Result;
use std::collections::BTreeMap;
use std::path::Path;

/// Named values at one step, e.g. {"loss": 2.31, "tokens_per_s": 41000.0}.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct Record {
    pub step: u64,
    pub values: BTreeMap<String, f64>,
}

pub trait MetricsSink: Send {
    fn name(&self) -> &str;
    /// The run's resolved configuration as dotted keys (`train.lr` → "0.00005");
    /// called once, before the first record.
    fn params(&mut self, _params: &BTreeMap<String, String>) -> Result<()> {
        Ok(())
    }
    fn record(&mut self, record: &Record) -> Result<()>;
    /// The run's summary (what `summary.json` holds); called once, before `finish`.
    fn summary(&mut self, _summary: &serde_json::Value) -> Result<()> {
        Ok(())
    }
    /// Flushes everything; called once at the end of the run.
    fn finish(&mut self) -> Result<()>;
}

/// A metrics sink's registration (`output.report_to`); `create` gets the run's
/// output directory and, when the run continues one (`train.resume`), the
/// step it continues from: what the sink holds of later steps belongs to
/// no run any more, so a resumed run repeats no step.
pub struct SinkRegistration {
    pub name: &'static str,
    pub summary: &'static str,
    pub create: fn(&Path, Option<u64>) -> Result<Box<dyn MetricsSink>>,
}
inventory::collect!(SinkRegistration);

/// This process's resident memory now and at its peak (Linux), in bytes.
pub fn process_memory() -> Option<(u64, u64)> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let field = |name: &str| -> Option<u64> {
        let line = status.lines().find(|l| l.starts_with(name))?;
        Some(line.split_whitespace().nth(1)?.parse::<u64>().ok()? * 1024)
    };
    Some((field("VmRSS:")?, field("VmHWM:")?))
}

/// This machine's memory (Linux's MemTotal), in bytes.
pub fn host_memory() -> Option<f64> {
    let meminfo = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = meminfo.lines().find(|l| l.starts_with("MemTotal:"))?;
    Some(line.split_whitespace().nth(1)?.parse::<f64>().ok()? * 1024.0)
}

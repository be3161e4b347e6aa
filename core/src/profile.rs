//! A few training steps under PyTorch's profiler (Kineto, through the shim):
//! a Chrome trace to open in chrome://tracing or Perfetto, and the time per
//! CUDA kernel (per host op on a CPU run), largest first. `ft train
//! --profile-steps` and `ft bench --profile` both write these.

use anyhow::{Context, Result};
use std::path::{Path, PathBuf};

/// Starts recording on this thread: CUDA kernels, copies and memsets when
/// `cuda`, else the host-side ATen ops.
pub fn start(cuda: bool) -> Result<()> {
    ft_sys::profiler_start(cuda).map_err(anyhow::Error::msg)
}

/// What `stop` wrote.
pub struct Report {
    pub trace: PathBuf,
    pub table: PathBuf,
    /// GPU (or host) time per step summed over every event kind, ms.
    pub ms_per_step: f64,
    /// The table's text: ms per step, share, calls per step, name.
    pub tsv: String,
}

impl Report {
    /// The first `rows` rows of the table under a one-line header, for a log.
    pub fn top(&self, rows: usize) -> String {
        let mut out = format!("{:.1} ms per step; trace {}, table {}\n", self.ms_per_step, self.trace.display(), self.table.display());
        for line in self.tsv.lines().take(rows + 1) {
            out += &format!("  {}\n", line.chars().take(160).collect::<String>());
        }
        out
    }
}

/// Runs `work` as one step, recorded with the profiler into `dir` as
/// `<label>.*` where a directory is given (`ft eval --profile`), its top
/// kernels logged.
pub fn recorded<T>(dir: Option<&Path>, label: &str, cuda: bool, work: impl FnOnce() -> Result<T>) -> Result<T> {
    let Some(dir) = dir else { return work() };
    start(cuda)?;
    let result = work()?;
    let report = stop(dir, label, cuda, 1)?;
    tracing::info!("profile of {label} ({}): {}", dir.display(), report.top(25));
    Ok(result)
}

/// Stops the recording `start` began over `steps` steps and writes
/// `<dir>/<label>.trace.json` and `<dir>/<label>.kernels.tsv`.
pub fn stop(dir: &Path, label: &str, cuda: bool, steps: usize) -> Result<Report> {
    std::fs::create_dir_all(dir).with_context(|| format!("cannot create {}", dir.display()))?;
    let trace = dir.join(format!("{label}.trace.json"));
    let mut events: Vec<_> = ft_sys::profiler_stop(&trace).map_err(anyhow::Error::msg)?.into_iter().filter(|e| e.on_device == cuda).collect();
    events.sort_by_key(|e| std::cmp::Reverse(e.total_ns));
    let total: u64 = events.iter().map(|e| e.total_ns).sum();
    let steps = steps.max(1);
    let mut tsv = String::from("ms_per_step\tshare\tcalls_per_step\tname\n");
    for e in &events {
        let ms = e.total_ns as f64 / 1e6 / steps as f64;
        tsv += &format!("{ms:.3}\t{:.4}\t{}\t{}\n", e.total_ns as f64 / total.max(1) as f64, e.calls / steps as i64, e.name);
    }
    let table = dir.join(format!("{label}.kernels.tsv"));
    std::fs::write(&table, &tsv).with_context(|| format!("cannot write {}", table.display()))?;
    Ok(Report { trace, table, ms_per_step: total as f64 / 1e6 / steps as f64, tsv })
}

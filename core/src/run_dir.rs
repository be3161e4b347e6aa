//! A run's output directory holds one run at a time, and only its outputs:
//! rank 0 holds a lock in it for the run (an advisory `flock` the kernel
//! releases however the process ends), and a run that does not resume is
//! refused where another run's metrics or checkpoints are, unless it
//! replaces them (`output.overwrite`). Each run has an id, which checkpoints
//! and metrics record and which a resumed run continues. What a finished
//! `ft train` or `ft eval` leaves there besides is written here too.

use anyhow::{bail, Context, Result};
use serde::{Deserialize, Serialize};
use std::fs::{File, OpenOptions};
use std::io::{Read, Seek, Write};
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};

/// The lock file, in the output directory.
pub const LOCK_FILE: &str = ".ft-run.lock";

/// A new run's id: when it started (UTC) and a random suffix, e.g. `20261126-043845-3fa9c1`.
pub fn new_run_id() -> String {
    format!("{}-{:06x}", chrono::Utc::now().format("%Y%m%d-%H%M%S"), rand::random::<u32>() & 0xff_ffff)
}

/// Who holds the lock, as its file records it (for the message another run gets).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
struct Holder {
    pid: u32,
    host: String,
    started: String,
}

impl Holder {
    fn this_process() -> Holder {
        Holder { pid: std::process::id(), host: hostname(), started: chrono::Utc::now().format("%Y-%m-%d %H:%M:%S UTC").to_string() }
    }

    fn describe(&self) -> String {
        format!("pid {} on host {}, started {}", self.pid, self.host, self.started)
    }

    /// Whether the process is running (this host only: another host's pids cannot be checked).
    fn alive_here(&self) -> bool {
        // SAFETY: kill with signal 0 only checks that the process exists.
        let exists = unsafe { libc::kill(self.pid as i32, 0) } == 0 || std::io::Error::last_os_error().raw_os_error() == Some(libc::EPERM);
        self.host == hostname() && exists
    }
}

fn hostname() -> String {
    let mut buffer = [0u8; 256];
    // SAFETY: gethostname writes at most the buffer's length.
    if unsafe { libc::gethostname(buffer.as_mut_ptr().cast(), buffer.len()) } != 0 {
        return "unknown".into();
    }
    let end = buffer.iter().position(|&b| b == 0).unwrap_or(buffer.len());
    String::from_utf8_lossy(&buffer[..end]).into_owned()
}

/// The output directory's lock, held until dropped (or the process ends).
pub struct RunLock {
    file: File,
}

impl RunLock {
    /// Takes `output`'s lock (creating the directory), or says which run
    /// holds it. A lock whose holder ended without releasing it (killed) is
    /// taken over, with a log line naming it. Where the filesystem has no
    /// `flock`, the recorded holder decides: a live process on this host, or
    /// any on another host, keeps it.
    pub fn acquire(output: &Path) -> Result<RunLock> {
        std::fs::create_dir_all(output).with_context(|| format!("cannot create {}", output.display()))?;
        let path = output.join(LOCK_FILE);
        let mut file = OpenOptions::new().read(true).write(true).create(true).truncate(false).open(&path).with_context(|| format!("cannot open {}", path.display()))?;
        let mut recorded = String::new();
        file.read_to_string(&mut recorded).with_context(|| format!("cannot read {}", path.display()))?;
        let holder: Option<Holder> = serde_json::from_str(&recorded).ok();
        let in_use = |holder: Option<&Holder>| {
            let who = holder.map_or("another ft run".to_string(), Holder::describe);
            anyhow::anyhow!("{} is in use by another run ({who}): wait for it to end, or give this run another --output-dir", output.display())
        };
        // SAFETY: flock on a descriptor this function owns.
        if unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } != 0 {
            let error = std::io::Error::last_os_error();
            match error.raw_os_error() {
                Some(libc::EWOULDBLOCK) => return Err(in_use(holder.as_ref())),
                Some(libc::ENOLCK | libc::EOPNOTSUPP | libc::ENOSYS) => {
                    if let Some(holder) = holder.as_ref().filter(|h| h.alive_here() || h.host != hostname()) {
                        return Err(in_use(Some(holder)).context(format!(
                            "the filesystem of {} has no file locks, so its lock file names the run: delete {} if that run is gone",
                            output.display(),
                            path.display()
                        )));
                    }
                }
                _ => bail!("cannot lock {}: {error}", path.display()),
            }
        }
        if let Some(stale) = &holder {
            tracing::warn!("took over the lock of {} ({}): that run ended without releasing it", output.display(), stale.describe());
        }
        let record = serde_json::to_string(&Holder::this_process())?;
        (|| -> std::io::Result<()> {
            file.set_len(0)?;
            file.rewind()?;
            file.write_all(record.as_bytes())?;
            file.sync_all()
        })()
        .with_context(|| format!("cannot write {}", path.display()))?;
        Ok(RunLock { file })
    }
}

impl Drop for RunLock {
    /// A run that ends leaves no holder recorded; the kernel releases the lock with the file.
    fn drop(&mut self) {
        let _ = self.file.set_len(0);
    }
}

/// What ft writes into an output directory for one run: a run that does
/// not resume would mix its outputs with these. Of a directory named with
/// a filter, only the entries it passes are ft's (a user's own files stay).
const RUN_OUTPUTS: [(&str, Option<fn(&str) -> bool>); 8] = [
    ("metrics.jsonl", None),
    ("metrics.csv", None),
    ("summary.json", None),
    ("predictions.json", None),
    ("null_odds.json", None),
    ("final", None),
    ("tensorboard", Some(is_event_file)),
    ("checkpoints", Some(is_checkpoint_entry)),
];

fn is_event_file(name: &str) -> bool {
    name.starts_with("events.out.tfevents.")
}

/// A checkpoint, a save in progress, or the list of the best ones.
fn is_checkpoint_entry(name: &str) -> bool {
    name.starts_with("step-") || name.starts_with(".step-") || name.starts_with("best.json")
}

/// The previous run's outputs in `output`. An empty file is none: a run
/// that failed before its first step leaves its metrics files empty.
fn previous_outputs(output: &Path) -> Result<Vec<PathBuf>> {
    let mut found = vec![];
    for (name, filter) in RUN_OUTPUTS {
        let path = output.join(name);
        match filter {
            Some(ours) if path.is_dir() => {
                let entries = std::fs::read_dir(&path).with_context(|| format!("cannot list {}", path.display()))?;
                found.extend(entries.flatten().filter(|e| ours(&e.file_name().to_string_lossy())).map(|e| e.path()));
            }
            None if path.exists() => found.push(path),
            _ => {}
        }
    }
    found.retain(|path| path.is_dir() || path.metadata().is_ok_and(|m| m.len() > 0));
    Ok(found)
}

/// Makes `output` ready for a run: a run that resumes continues what is
/// there; a fresh one is refused where another run's outputs are, or
/// removes them when `overwrite` (only what ft wrote; the log names it).
pub fn claim(output: &Path, resumes: bool, overwrite: bool) -> Result<()> {
    if resumes {
        return Ok(());
    }
    let found = previous_outputs(output)?;
    if found.is_empty() {
        return Ok(());
    }
    let mut names: Vec<String> = found.iter().map(|p| p.strip_prefix(output).unwrap_or(p).components().next().map_or(String::new(), |c| c.as_os_str().to_string_lossy().into_owned())).collect();
    names.dedup();
    if !overwrite {
        // Only a run that saved a checkpoint can be continued.
        let checkpoints = output.join("checkpoints");
        let saved = found.iter().any(|path| path.parent() == Some(checkpoints.as_path()) && path.is_dir());
        bail!(
            "{} holds another run's outputs ({}): {}replace them with --overwrite-output-dir (output.overwrite), or give this run \
             another --output-dir",
            output.display(),
            names.join(", "),
            if saved { "continue that run with --resume latest, " } else { "" }
        );
    }
    for path in &found {
        let removed = if path.is_dir() { std::fs::remove_dir_all(path) } else { std::fs::remove_file(path) };
        removed.with_context(|| format!("cannot remove {} (output.overwrite)", path.display()))?;
    }
    tracing::info!("output.overwrite: removed the previous run's outputs from {}: {}", output.display(), names.join(", "));
    Ok(())
}

/// Rank 0's hold on the output directory for the run, taken before any
/// rank writes there: its lock, and the step the run continues its
/// metrics from (None: a fresh run, for which the directory is made ready).
/// The other ranks hold nothing: rank 0's claim is the run's.
pub fn claim_for_run(config: &crate::Config, rank: usize) -> Result<(Option<RunLock>, Option<u64>)> {
    if rank != 0 {
        return Ok((None, None));
    }
    let output = &config.output.dir;
    let lock = RunLock::acquire(output)?;
    let resume = config.train.resume.as_deref();
    claim(output, resume.is_some(), config.output.overwrite)?;
    let resumed_step = match resume.map(|spec| crate::checkpoint::resume_from(spec, output)).transpose()? {
        None => None,
        Some(None) => Some(0), // `--resume auto` with nothing to resume: step 0 of the directory's run
        Some(Some(dir)) => Some(crate::checkpoint::read_manifest(&dir)?.step as u64),
    };
    Ok((Some(lock), resumed_step))
}

/// Ends a finished run, on rank 0: writes OUTPUT/summary.json, prints the
/// summary's table, a line naming the outputs (`written`, then the summary
/// and the `sinks`' metrics), and how to train on from its last checkpoint.
pub fn finish(output: &Path, summary: &crate::fit::Summary, mut written: Vec<String>, sinks: &[String]) -> Result<()> {
    let path = output.join("summary.json");
    std::fs::write(&path, serde_json::to_string_pretty(summary)?).with_context(|| format!("cannot write {}", path.display()))?;
    written.push("summary.json".into());
    if !sinks.is_empty() {
        written.push(format!("metrics ({})", sinks.join(", ")));
    }
    print!("{}", summary.table());
    println!("outputs in {}: {}", output.display(), written.join(", "));
    if let Some(checkpoint) = &summary.last_checkpoint {
        println!("the last checkpoint is {}; to train on from it (more epochs, the next data.range): {}", checkpoint.display(), resume_command(std::env::args()));
    }
    Ok(())
}

/// Ends `ft eval`, on rank 0: writes the task's predictions into `output`,
/// prints the evaluation of `data` and writes OUTPUT/eval_results.json,
/// every figure at full precision, named as a training run's evaluation
/// records them (and Hugging Face's eval_results.json).
pub fn finish_eval(output: &Path, data: &Path, evaluation: &crate::fit::Evaluation, task: &dyn crate::task::Task) -> Result<()> {
    std::fs::create_dir_all(output).with_context(|| format!("cannot create {}", output.display()))?;
    task.write_predictions(output)?;
    let loss = evaluation.loss.map_or("n/a".into(), |l| format!("{l:.4}"));
    let scores: String = evaluation.scores.values.iter().map(|(k, v)| format!(", {k} {v:.4}")).collect();
    let examples = evaluation.examples;
    println!("{}: eval loss {loss} over {examples} examples{scores}", data.display());
    let per_second = examples as f64 / evaluation.seconds.max(f64::MIN_POSITIVE);
    // Every figure at full precision, named as a training run's evaluation records them (and Hugging Face's eval_results.json).
    let mut results = serde_json::Map::new();
    if let Some(loss) = evaluation.loss {
        results.insert("eval_loss".into(), loss.into());
    }
    results.extend(evaluation.scores.values.iter().map(|(k, v)| (format!("eval_{k}"), (*v).into())));
    results.insert("eval_samples".into(), examples.into());
    results.insert("eval_samples_per_second".into(), per_second.into());
    let path = output.join("eval_results.json");
    std::fs::write(&path, serde_json::to_string_pretty(&results)?).with_context(|| format!("cannot write {}", path.display()))?;
    // The task's own scoring (generation, span decoding), where it has one.
    let scoring = match evaluation.scores.examples {
        0 => String::new(),
        _ => format!("; its scoring {:.2} s", evaluation.scoring_seconds),
    };
    println!("evaluated {examples} examples in {:.2} s ({per_second:.1} examples/s{scoring})", evaluation.seconds);
    Ok(())
}

/// The command that continues a run started with `arguments` (the
/// program's own first): the same, with `--resume latest`, quoted for a shell.
pub fn resume_command(arguments: impl IntoIterator<Item = String>) -> String {
    let mut words = vec![];
    let mut arguments = arguments.into_iter();
    while let Some(word) = arguments.next() {
        match word.as_str() {
            "--resume" => {
                arguments.next();
            }
            "--overwrite-output-dir" => {}
            _ if word.starts_with("--resume=") => {}
            _ => words.push(word),
        }
    }
    words.extend(["--resume".into(), "latest".into()]);
    let quoted = |word: String| match word.chars().all(|c| c.is_ascii_alphanumeric() || "-_./=:,@%+".contains(c)) {
        true => word,
        false => format!("'{}'", word.replace('\'', r"'\''")),
    };
    words.into_iter().map(quoted).collect::<Vec<_>>().join(" ")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_resume_command_is_the_runs_own_with_resume_latest_quoted_for_a_shell() {
        let arguments = ["ft", "train", "--resume", "auto", "--overwrite-output-dir", "--output-dir", "my run", "--resume=x", "--lr", "1e-4"];
        assert_eq!(resume_command(arguments.map(String::from)), "ft train --output-dir 'my run' --lr 1e-4 --resume latest");
    }

    #[test]
    fn a_held_lock_names_its_holder_and_a_released_one_is_taken() {
        let dir = tempfile::tempdir().unwrap();
        let first = RunLock::acquire(dir.path()).unwrap();
        // flock locks belong to the open file: a second open in this process conflicts as another process would.
        let error = RunLock::acquire(dir.path()).err().unwrap().to_string();
        assert!(error.contains(&format!("is in use by another run (pid {} on host {}", std::process::id(), hostname())), "{error}");
        drop(first);
        assert_eq!(std::fs::read_to_string(dir.path().join(LOCK_FILE)).unwrap(), "", "a released lock names no holder");
        let _again = RunLock::acquire(dir.path()).unwrap();
    }

    #[test]
    fn a_fresh_run_is_refused_where_another_ran_and_overwrite_removes_only_fts_files() {
        let dir = tempfile::tempdir().unwrap();
        let output = dir.path();
        claim(output, false, false).unwrap();
        std::fs::write(output.join("metrics.csv"), "").unwrap();
        claim(output, false, false).expect("an empty metrics file is no run's output");
        std::fs::create_dir_all(output.join("checkpoints/step-00000004")).unwrap();
        std::fs::create_dir_all(output.join("tensorboard")).unwrap();
        for file in ["metrics.jsonl", "tensorboard/events.out.tfevents.1.host.2", "tensorboard/notes.txt", "checkpoints/best.json", "mine.txt"] {
            std::fs::write(output.join(file), "x").unwrap();
        }
        let error = claim(output, false, false).unwrap_err().to_string();
        assert!(error.contains("holds another run's outputs (metrics.jsonl, tensorboard, checkpoints)") && error.contains("--overwrite-output-dir"), "{error}");
        assert!(error.contains("--resume latest"), "a run that saved a checkpoint can be continued: {error}");
        std::fs::rename(output.join("checkpoints/step-00000004"), dir.path().join("elsewhere")).unwrap();
        let error = claim(output, false, false).unwrap_err().to_string();
        assert!(error.contains("holds another run's outputs") && !error.contains("--resume"), "nothing to continue: {error}");
        std::fs::rename(dir.path().join("elsewhere"), output.join("checkpoints/step-00000004")).unwrap();
        claim(output, true, false).unwrap();
        assert!(output.join("metrics.jsonl").exists(), "a resumed run keeps them");
        claim(output, false, true).unwrap();
        for gone in ["metrics.jsonl", "tensorboard/events.out.tfevents.1.host.2", "checkpoints/step-00000004", "checkpoints/best.json"] {
            assert!(!output.join(gone).exists(), "{gone}");
        }
        assert!(output.join("tensorboard/notes.txt").exists() && output.join("mine.txt").exists(), "the user's files stay");
        claim(output, false, false).unwrap();
    }
}

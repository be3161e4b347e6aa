//! A Weights & Biases run (`--report-to wandb`), made by the user's own
//! `wandb` client. Design choice: ft drives that client as a child process —
//! `python3` (the first on PATH) running `wandb_driver.py`, fed JSON lines over
//! a pipe: init with the config, log with the step, the summary, finish with
//! the exit code — rather than writing W&B's run format itself. That format
//! is wandb-core's internal protobuf log and changes with it; the client is
//! what W&B supports, and it does everything a run needs: it reads every
//! WANDB_* setting (WANDB_PROJECT — else `ft` —, WANDB_ENTITY, WANDB_MODE
//! with offline, WANDB_DIR, WANDB_RUN_ID, WANDB_RESUME, WANDB_API_KEY),
//! uploads, retries a flaky network and keeps the run on disk until it is synced.
//!
//! The client is started when the configuration arrives, before the first
//! step: no python3, or no `wandb` in it, is one error then that says to
//! `pip install wandb`. If the client dies later, training goes on: one
//! warning then, and at the end one that says what never reached it. The
//! run's id is kept in `OUTPUT_DIR/.ft-wandb-run-id`, so a resumed run continues it.

use crate::json_metric_value;
use anyhow::{bail, Context, Result};
use ft_core::metrics::{MetricsSink, Record, SinkRegistration};
use serde_json::{json, Value};
use std::collections::{BTreeMap, BTreeSet};
use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::time::{Duration, Instant};

const DRIVER: &str = include_str!("wandb_driver.py");
const RUN_ID_FILE: &str = ".ft-wandb-run-id";
/// The longest ft waits for the client to finish (an online run uploads what is left then).
const FINISH_TIMEOUT: Duration = Duration::from_secs(600);

/// The running client: the child and the pipe to it.
struct Client {
    child: Child,
    stdin: ChildStdin,
}

impl Client {
    /// Starts the client and its run (`init`), and returns it with the run's id.
    fn start(init: &Value) -> Result<(Client, String)> {
        let mut child = Command::new("python3")
            .args(["-u", "-c", DRIVER])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .context("cannot start python3 for the wandb sink, which runs W&B's Python client: install Python 3, then `pip install wandb`")?;
        let (Some(mut stdin), Some(stdout)) = (child.stdin.take(), child.stdout.take()) else { bail!("python3 for the wandb sink has no pipes") };
        let mut answer = String::new();
        let answered = writeln!(stdin, "{}", json!({ "init": init })).is_ok() && BufReader::new(stdout).read_line(&mut answer).is_ok_and(|n| n > 0);
        let answer: Value = serde_json::from_str(&answer).unwrap_or(Value::Null);
        if let Some(id) = answer["id"].as_str().filter(|_| answered) {
            return Ok((Client { child, stdin }, id.to_string()));
        }
        drop(stdin);
        let status = child.wait();
        if let Some(missing) = answer["missing"].as_str() {
            bail!("--report-to wandb needs W&B's Python client in python3 (the first on PATH): `pip install wandb` ({missing})");
        }
        match answer["error"].as_str() {
            Some(error) => bail!("W&B could not start the run: {error}"),
            None => bail!("W&B's client ended before its run started ({status:?}); its messages are above"),
        }
    }

    /// Writes one message; false when the client is gone.
    fn send(&mut self, message: &Value) -> bool {
        writeln!(self.stdin, "{message}").and_then(|()| self.stdin.flush()).is_ok()
    }

    /// Ends the run with `exit_code` and waits for the client (uploading, if
    /// online), at most FINISH_TIMEOUT. Returns why it did not end well.
    fn finish(mut self, exit_code: i32) -> Result<(), String> {
        if !self.send(&json!({"finish": {"exit_code": exit_code}})) {
            return Err("the client was gone".into());
        }
        drop(self.stdin);
        let deadline = Instant::now() + FINISH_TIMEOUT;
        loop {
            match self.child.try_wait() {
                Ok(Some(status)) if status.success() => return Ok(()),
                Ok(Some(status)) => return Err(format!("the client ended with {status}")),
                Ok(None) if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(100)),
                Ok(None) => {
                    let _ = self.child.kill();
                    let _ = self.child.wait();
                    return Err(format!("the client did not finish in {FINISH_TIMEOUT:?} and was stopped"));
                }
                Err(e) => return Err(e.to_string()),
            }
        }
    }
}

/// One W&B run per training run, continued when the run resumes.
pub struct WandbSink {
    output: PathBuf,
    resume: bool,
    client: Option<Client>,
    /// Whether the client ran and is gone.
    lost: bool,
    /// The steps of the records that never reached the client.
    unsent_steps: BTreeSet<u64>,
    summary_unsent: bool,
}

impl WandbSink {
    pub fn new(output: &Path, resume: bool) -> WandbSink {
        WandbSink { output: output.to_path_buf(), resume, client: None, lost: false, unsent_steps: BTreeSet::new(), summary_unsent: false }
    }

    /// Starts the client with the run's configuration, once.
    fn start(&mut self, config: &BTreeMap<String, String>) -> Result<()> {
        if self.client.is_some() || self.lost {
            return Ok(());
        }
        let path = self.output.join(RUN_ID_FILE);
        let recorded = if self.resume { std::fs::read_to_string(&path).ok().map(|id| id.trim().to_string()) } else { None };
        let name = self.output.file_name().map_or("ft".into(), |n| n.to_string_lossy().into_owned());
        let init = json!({"name": name, "id": recorded, "resume": recorded.is_some(), "config": config});
        let (client, id) = Client::start(&init)?;
        self.client = Some(client);
        std::fs::create_dir_all(&self.output).with_context(|| format!("cannot create {}", self.output.display()))?;
        std::fs::write(&path, id).with_context(|| format!("cannot write {}", path.display()))
    }

    /// Sends `message` to the client; false (with a warning the first time) when it is gone.
    fn send(&mut self, message: &Value) -> bool {
        let Some(client) = &mut self.client else { return false };
        if client.send(message) {
            return true;
        }
        let status = client.child.wait().map_or_else(|e| e.to_string(), |s| s.to_string());
        tracing::warn!("W&B's client ended ({status}; its messages are above): training goes on without it");
        (self.client, self.lost) = (None, true);
        false
    }

    /// Ends the run with `exit_code`, and says what never reached W&B.
    fn end(&mut self, exit_code: i32) {
        let ended = match self.client.take() {
            Some(client) => client.finish(exit_code),
            None if self.lost => Err("the client was gone".into()),
            None => return,
        };
        let mut unsent = vec![];
        if let (Some(first), Some(last)) = (self.unsent_steps.first(), self.unsent_steps.last()) {
            unsent.push(format!("{} records of steps {first}–{last}", self.unsent_steps.len()));
        }
        if self.summary_unsent {
            unsent.push("the summary".into());
        }
        match ended {
            Ok(()) if unsent.is_empty() => {}
            Ok(()) => tracing::warn!("W&B never got {} (they are in metrics.jsonl with --report-to jsonl, and summary.json)", unsent.join(", ")),
            Err(why) => {
                unsent.push(format!("the run's end (exit code {exit_code})"));
                tracing::warn!("W&B never got {} ({why}); the rest of the run is in metrics.jsonl with --report-to jsonl, and summary.json", unsent.join(", "));
            }
        }
        // Reported once: Drop after finish has nothing left to end.
        self.lost = false;
    }
}

impl MetricsSink for WandbSink {
    fn name(&self) -> &str {
        "wandb"
    }

    fn params(&mut self, params: &BTreeMap<String, String>) -> Result<()> {
        self.start(params)
    }

    fn record(&mut self, record: &Record) -> Result<()> {
        self.start(&BTreeMap::new())?;
        let values: serde_json::Map<String, Value> = record.values.iter().map(|(k, v)| (k.clone(), json_metric_value(*v))).collect();
        if !self.send(&json!({"log": {"step": record.step, "values": values}})) {
            self.unsent_steps.insert(record.step);
        }
        Ok(())
    }

    fn summary(&mut self, summary: &Value) -> Result<()> {
        self.start(&BTreeMap::new())?;
        self.summary_unsent = !self.send(&json!({ "summary": summary }));
        Ok(())
    }

    fn finish(&mut self) -> Result<()> {
        self.end(0);
        Ok(())
    }
}

impl Drop for WandbSink {
    /// A run that ends without `finish` stopped on an error: W&B marks it failed.
    fn drop(&mut self) {
        self.end(1);
    }
}

inventory::submit! {
    SinkRegistration {
        name: "wandb",
        summary: "a Weights & Biases run through the wandb Python client (WANDB_PROJECT, WANDB_MODE, WANDB_DIR, …)",
        create: |dir, append| Ok(Box::new(WandbSink::new(dir, append))),
    }
}

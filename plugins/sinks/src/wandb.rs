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
//! `pip install wandb`. If the client dies later, training goes on with one
//! warning, and a new client continues the same run with everything again
//! (`WandbSink`); if none will finish the run, the end says what W&B may
//! lack. The run's id is kept in `OUTPUT_DIR/.ft-wandb-run-id`, so a resumed
//! run continues it.

use crate::{json_metric_value, run_name};
use anyhow::{bail, Context, Result};
use ft_core::metrics::{MetricsSink, Record, SinkRegistration};
use serde_json::{json, Value};
use std::collections::{BTreeMap, BTreeSet};
use std::io::{BufRead, BufReader, Write};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::time::{Duration, Instant};

const DRIVER: &str = include_str!("wandb_driver.py");
const RUN_ID_FILE: &str = ".ft-wandb-run-id";
/// The longest ft waits for the client to finish (an online run uploads what is left then).
const FINISH_TIMEOUT: Duration = Duration::from_secs(600);
/// After a second failure to keep a client, the next start waits this long, doubling up to the last.
const RETRY_AFTER: Duration = Duration::from_secs(30);
const RETRY_AFTER_MAX: Duration = Duration::from_secs(600);

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
            // Its own process group: a signal that stops ft's (a launcher
            // stopping a failed job, Ctrl-C) leaves the client to see the
            // pipe close and mark the run failed, with all it got kept.
            .process_group(0)
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

    /// Closes the pipe and waits for the client (uploading, if online) at most
    /// FINISH_TIMEOUT; returns why it did not end well.
    fn close(mut self) -> Result<(), String> {
        drop(self.stdin);
        let deadline = Instant::now() + FINISH_TIMEOUT;
        loop {
            match self.child.try_wait() {
                Ok(Some(status)) if status.success() => break Ok(()),
                Ok(Some(status)) => break Err(format!("the client ended with {status}")),
                Ok(None) if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(100)),
                Ok(None) => {
                    let _ = self.child.kill();
                    let _ = self.child.wait();
                    break Err(format!("the client did not finish in {FINISH_TIMEOUT:?} and was stopped"));
                }
                Err(e) => break Err(e.to_string()),
            }
        }
    }
}

/// One W&B run per training run, continued when the run resumes.
///
/// A client that dies loses nothing: what it got is not known to be on disk
/// or uploaded (wandb-core buffers it), so ft keeps every message until the
/// run finishes (a few hundred bytes a logged step), and the next record
/// starts a new client on the same run (W&B's resume), which gets them all
/// again — the driver skips steps W&B already has — at once the first time,
/// then no sooner than a back-off, since starting a client holds training for seconds.
pub struct WandbSink {
    output: PathBuf,
    resume: bool,
    /// The run's configuration and id, to start the client again on the same run.
    config: BTreeMap<String, String>,
    id: Option<String>,
    client: Option<Client>,
    /// The run's messages, oldest first; the first `written` went to the current client.
    queue: Vec<Value>,
    written: usize,
    /// After the client died: when to start another, and the back-off after that.
    retry: Option<(Instant, Duration)>,
    warned: bool,
}

impl WandbSink {
    pub fn new(output: &Path, resume: bool) -> WandbSink {
        WandbSink {
            output: output.to_path_buf(),
            resume,
            config: BTreeMap::new(),
            id: None,
            client: None,
            queue: vec![],
            written: 0,
            retry: None,
            warned: false,
        }
    }

    /// Starts the client with the run's configuration, once; an error then stops the run.
    fn start(&mut self, config: &BTreeMap<String, String>) -> Result<()> {
        if self.id.is_some() {
            return Ok(());
        }
        let path = self.output.join(RUN_ID_FILE);
        self.config = config.clone();
        let recorded = if self.resume { std::fs::read_to_string(&path).ok().map(|id| id.trim().to_string()) } else { None };
        let (client, id) = Client::start(&self.init(recorded.as_deref()))?;
        self.client = Some(client);
        std::fs::create_dir_all(&self.output).with_context(|| format!("cannot create {}", self.output.display()))?;
        std::fs::write(&path, &id).with_context(|| format!("cannot write {}", path.display()))?;
        self.id = Some(id);
        Ok(())
    }

    /// The client's first message: a new run, or the run `id` continued.
    fn init(&self, id: Option<&str>) -> Value {
        json!({"name": run_name(&self.output), "id": id, "resume": id.is_some(), "config": self.config})
    }

    /// Queues `message` and sends what the client has not got.
    fn send(&mut self, message: Value) {
        self.queue.push(message);
        self.deliver(false);
    }

    /// Writes what the client has not got; when the client is gone, starts
    /// another unless in the back-off (`force`: regardless).
    fn deliver(&mut self, force: bool) {
        if self.client.is_none() && (force || self.retry.is_some_and(|(at, _)| Instant::now() >= at)) {
            self.restart();
        }
        let Some(client) = &mut self.client else { return };
        while self.written < self.queue.len() {
            if !client.send(&self.queue[self.written]) {
                let status = client.child.wait().map_or_else(|e| e.to_string(), |s| s.to_string());
                self.lost(&format!("W&B's client ended ({status})"));
                return;
            }
            self.written += 1;
        }
    }

    /// The client is gone: the next one gets every message again.
    fn lost(&mut self, why: &str) {
        if let Some(client) = self.client.take() {
            let _ = client.close();
        }
        self.written = 0;
        if !self.warned {
            tracing::warn!("{why}: training goes on; ft keeps what W&B has not got and starts the client again on the same run");
            self.warned = true;
        }
        let backoff = self.retry.map_or(Duration::ZERO, |(_, b)| (b * 2).clamp(RETRY_AFTER, RETRY_AFTER_MAX));
        self.retry = Some((Instant::now() + backoff, backoff));
    }

    fn restart(&mut self) {
        match Client::start(&self.init(self.id.as_deref())) {
            Ok((client, _)) => {
                tracing::info!("W&B's client started again on run {}: sending the run's {} messages again", self.id.as_deref().unwrap_or(""), self.queue.len());
                (self.client, self.retry) = (Some(client), None);
            }
            Err(e) => self.lost(&format!("W&B's client did not start again: {e:#}")),
        }
    }

    /// Ends the run with `exit_code`, and says what never reached W&B.
    fn end(&mut self, exit_code: i32) {
        if self.id.is_none() {
            return;
        }
        self.send(json!({"finish": {"exit_code": exit_code}}));
        self.deliver(true);
        let ended = match self.client.take() {
            Some(client) => client.close(),
            None => Err("no client would start".into()),
        };
        if let Err(why) = ended {
            let steps: BTreeSet<u64> = self.queue.iter().filter_map(|m| m["log"]["step"].as_u64()).collect();
            let mut unsent = vec![];
            if let (Some(first), Some(last)) = (steps.first(), steps.last()) {
                unsent.push(format!("{} records of steps {first}–{last}", steps.len()));
            }
            if self.queue.iter().any(|m| m.get("summary").is_some()) {
                unsent.push("the summary".into());
            }
            unsent.push(format!("the run's end (exit code {exit_code})"));
            tracing::warn!("W&B's client did not finish the run ({why}): W&B may lack {}; they are in metrics.jsonl with --report-to jsonl, and summary.json", unsent.join(", "));
        }
        // Ended once: Drop after finish has nothing left to end.
        self.id = None;
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
        self.send(json!({"log": {"step": record.step, "values": values}}));
        Ok(())
    }

    fn summary(&mut self, summary: &Value) -> Result<()> {
        self.start(&BTreeMap::new())?;
        self.send(json!({ "summary": summary }));
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
        create: |dir, resumed| Ok(Box::new(WandbSink::new(dir, resumed.is_some()))),
    }
}

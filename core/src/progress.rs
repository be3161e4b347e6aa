//! Rank 0's training progress, wherever the user reads it: on a terminal an
//! indicatif bar — drawn by rank 0 itself, or, when a launcher started the
//! ranks (their output is its pipes), by the launcher from the lines rank 0
//! writes for it (`LAUNCHER_DRAWS`, [`Update`]); where stderr is no terminal
//! (a file, a Slurm log, a notebook), one plain line for the first step,
//! each epoch's end and the last step, and between them at most every
//! `train.log_seconds` (30 s by default, as a tqdm bar refreshes a file
//! rarely), so a log stays readable however fast steps go; `train.log_every`
//! sets only what the metrics files get.
//!
//! Nothing here communicates: a line between logged steps shows rank 0's own
//! figures and the loss of the last logged step, so no rank ever waits on a
//! reduction the others skip.

use indicatif::{FormattedDuration, HumanBytes, ProgressBar, ProgressDrawTarget, ProgressStyle};
use serde::{Deserialize, Serialize};
use std::io::{IsTerminal, Write};
use std::time::{Duration, Instant};

/// Set by a launcher whose stderr is a terminal, in its workers'
/// environment: it draws rank 0's progress from the [`Update`] lines rank
/// 0 writes to its stderr.
pub const LAUNCHER_DRAWS: &str = "FT_LAUNCHER_DRAWS_PROGRESS";

/// What starts a line meant for the launcher, never for the user (ASCII's
/// record separator cannot begin a line of text a run prints).
const UPDATE_PREFIX: &str = "\x1eft-progress ";

/// One step of progress, as rank 0 sends it to the launcher.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Update {
    /// Optimizer steps done, and the step the run ends at.
    pub step: u64,
    pub total: u64,
    /// Loss and learning rate of the last logged step, as the bar shows them.
    pub message: String,
    /// Training is over: the bar goes.
    #[serde(default)]
    pub done: bool,
}

impl Update {
    /// The line rank 0 writes for the launcher.
    pub fn encode(&self) -> String {
        format!("{UPDATE_PREFIX}{}", serde_json::to_string(self).unwrap_or_default())
    }

    /// An update if `line` is one (a line of a worker's stderr).
    pub fn decode(line: &str) -> Option<Update> {
        serde_json::from_str(line.strip_prefix(UPDATE_PREFIX)?).ok()
    }
}

/// The bar, `total` steps long, drawn to `target` (the same on rank 0 and in the launcher).
pub fn bar(total: u64, target: ProgressDrawTarget) -> ProgressBar {
    let bar = ProgressBar::with_draw_target(Some(total), target);
    if let Ok(style) = ProgressStyle::with_template("{bar:30} {pos}/{len} steps {msg} [{elapsed} < {eta}]") {
        bar.set_style(style);
    }
    bar
}

/// A step as progress reports it.
pub(crate) struct Step {
    pub step: usize,
    /// Epochs done, fractional (1.5: half way through the second).
    pub epoch: f64,
    /// The loss over every rank, on a logged step (None between them).
    pub loss: Option<f64>,
    pub lr: f64,
    /// Non-padding tokens this rank computed in the step, and the step's seconds.
    pub tokens: usize,
    pub seconds: f64,
    /// Bytes in use on this rank's device.
    pub memory: f64,
    /// The step ends an epoch.
    pub epoch_end: bool,
}

enum Shown {
    /// Not rank 0.
    Nothing,
    Bar(ProgressBar),
    Launcher,
    Lines,
}

/// Rank 0's progress through a run ending at step `total`.
pub(crate) struct Progress {
    shown: Shown,
    total: usize,
    /// The least time between two lines without a terminal, outside the first step, an epoch's end and the last.
    line_every: Duration,
    started: Instant,
    steps_run: usize,
    last_line: Instant,
    /// The last logged step and its loss.
    last_loss: Option<(usize, f64)>,
    /// This rank's tokens and training seconds since the last line.
    tokens: usize,
    seconds: f64,
    message: String,
}

impl Progress {
    pub fn new(rank: usize, total: usize, line_every: Duration) -> Progress {
        let shown = if rank != 0 {
            Shown::Nothing
        } else if std::env::var_os(LAUNCHER_DRAWS).is_some() {
            Shown::Launcher
        } else if std::io::stderr().is_terminal() {
            Shown::Bar(bar(total as u64, ProgressDrawTarget::stderr()))
        } else {
            Shown::Lines
        };
        let now = Instant::now();
        Progress { shown, total, line_every, started: now, steps_run: 0, last_line: now, last_loss: None, tokens: 0, seconds: 0.0, message: String::new() }
    }

    pub fn after_step(&mut self, step: Step) {
        self.steps_run += 1;
        self.tokens += step.tokens;
        self.seconds += step.seconds;
        if let Some(loss) = step.loss {
            self.last_loss = Some((step.step, loss));
            self.message = format!("loss {loss:.4} lr {:.2e}", step.lr);
        }
        match &self.shown {
            Shown::Nothing => {}
            Shown::Bar(bar) => {
                bar.set_position(step.step as u64);
                bar.set_message(self.message.clone());
            }
            Shown::Launcher => self.send(step.step, false),
            Shown::Lines => {
                if self.line_due(&step) {
                    let line = self.line(&step);
                    tracing::info!("{line}");
                    (self.last_line, self.tokens, self.seconds) = (Instant::now(), 0, 0.0);
                }
            }
        }
    }

    /// The first step this process ran, an epoch's end, the run's last
    /// step, or `line_every` since the last line (`after_step` counted `step`).
    fn line_due(&self, step: &Step) -> bool {
        self.steps_run == 1 || step.epoch_end || step.step >= self.total || self.last_line.elapsed() >= self.line_every
    }

    fn send(&self, step: usize, done: bool) {
        let update = Update { step: step as u64, total: self.total as u64, message: self.message.clone(), done };
        let _ = writeln!(std::io::stderr().lock(), "{}", update.encode());
    }

    /// `step 40/120 (33%), epoch 1.33, loss 2.3456, lr 1.00e-04, 1234 tokens/s/rank, memory 1.20 GiB, elapsed 00:01:05, ETA 00:02:10`.
    fn line(&self, step: &Step) -> String {
        let loss = match self.last_loss {
            Some((at, loss)) if at == step.step => format!("{loss:.4}"),
            Some((at, loss)) => format!("{loss:.4} (step {at})"),
            None => "not yet logged".into(),
        };
        let elapsed = self.started.elapsed();
        let remaining = self.total.saturating_sub(step.step) as f64 * elapsed.as_secs_f64() / self.steps_run.max(1) as f64;
        format!(
            "step {}/{} ({:.0}%), epoch {:.2}, loss {loss}, lr {:.2e}, {:.0} tokens/s/rank, memory {}, elapsed {}, ETA {}",
            step.step,
            self.total,
            100.0 * step.step as f64 / self.total.max(1) as f64,
            step.epoch,
            step.lr,
            self.tokens as f64 / self.seconds.max(f64::MIN_POSITIVE),
            HumanBytes(step.memory as u64),
            FormattedDuration(elapsed),
            FormattedDuration(Duration::from_secs_f64(remaining)),
        )
    }

    /// Training is over: the bar goes (rank 0's own, or the launcher's).
    pub fn finish(&self) {
        match &self.shown {
            Shown::Bar(bar) => bar.finish_and_clear(),
            Shown::Launcher => self.send(self.total, true),
            Shown::Nothing | Shown::Lines => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn step(step: usize, loss: Option<f64>, epoch_end: bool) -> Step {
        Step { step, epoch: step as f64 / 10.0, loss, lr: 1e-3, tokens: 500, seconds: 0.5, memory: 2e9, epoch_end }
    }

    #[test]
    fn lines_come_at_the_first_step_each_epochs_end_the_last_step_and_else_at_most_every_line_every() {
        let line_every = Duration::from_secs(30);
        let mut progress = Progress::new(0, 10, line_every);
        progress.shown = Shown::Lines;
        // The first step this process runs (a resumed run's too, whatever its number).
        progress.steps_run = 1;
        assert!(progress.line_due(&step(4, Some(2.5), false)));
        progress.after_step(step(4, Some(2.5), false));
        progress.steps_run = 2;
        assert!(!progress.line_due(&step(5, Some(2.4), false)), "a logged step is no reason for a line");
        assert!(progress.line_due(&step(5, Some(2.4), true)), "an epoch's end");
        assert!(progress.line_due(&step(10, Some(2.4), false)), "the last step");
        progress.after_step(step(5, None, false));
        progress.last_line -= line_every;
        progress.steps_run = 3;
        assert!(progress.line_due(&step(6, None, false)), "line_every passed");
        // Between logged steps: the last logged loss, and its step.
        let line = progress.line(&step(6, None, false));
        assert!(line.starts_with("step 6/10 (60%), epoch 0.60, loss 2.5000 (step 4), lr 1.00e-3, 1000 tokens/s/rank, memory 1.86 GiB, elapsed "), "{line}");
        assert!(line.contains(", ETA "), "{line}");
    }

    #[test]
    fn updates_cross_as_lines_and_only_they_decode() {
        let update = Update { step: 3, total: 10, message: "loss 1.2345 lr 1.00e-03".into(), done: false };
        assert_eq!(Update::decode(&update.encode()), Some(update));
        assert_eq!(Update::decode("step 3/10 loss 1.2"), None);
        assert_eq!(Update::decode(r#"ft-progress {"step":3,"total":10,"message":""}"#), None);
    }
}

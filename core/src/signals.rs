//! The signals that stop a run cleanly: SIGINT, SIGTERM, SIGUSR1, SIGUSR2
//! and `train.save_signal` (SIGUSR1 by default: what Slurm's `--signal`
//! sends before a job's time ends; the one that requeues with
//! `train.requeue`; SIGHUP only when named there, so `nohup` still guards a
//! run) make every rank finish its optimizer step, save a checkpoint and
//! exit with [`SAVED_AND_STOPPED`], whatever bounds the run; a second signal
//! ends the process at once with 128 + its number. A launcher passes them
//! on to its workers.

use anyhow::{bail, Result};
use signal_hook::consts::{SIGHUP, SIGINT, SIGTERM, SIGUSR1, SIGUSR2};
use std::sync::atomic::{AtomicI32, Ordering};
use std::sync::Arc;

/// The exit code of a run that saved a checkpoint on a signal and stopped:
/// sysexits' EX_TEMPFAIL, "try again later" — with `--resume latest`.
pub const SAVED_AND_STOPPED: i32 = 75;

/// The signals `train.save_signal` may name.
const SAVE_SIGNALS: [(&str, i32); 3] = [("SIGUSR1", SIGUSR1), ("SIGUSR2", SIGUSR2), ("SIGHUP", SIGHUP)];

/// Every signal a run may save and stop on: what a launcher passes on to its workers.
pub const STOPPING: [i32; 5] = [SIGINT, SIGTERM, SIGUSR1, SIGUSR2, SIGHUP];

/// The signals a run saves and stops on, `save_signal` first (it alone
/// requeues a Slurm job): SIGUSR1, SIGUSR2, SIGTERM and SIGINT, and SIGHUP
/// when it is `save_signal`.
pub fn caught(save_signal: i32) -> Vec<i32> {
    let mut signals = vec![save_signal];
    signals.extend([SIGUSR1, SIGUSR2, SIGTERM, SIGINT].into_iter().filter(|&signal| signal != save_signal));
    signals
}

/// `train.save_signal`'s number: SIGUSR1, USR1 (as Slurm's `--signal` writes it), SIGUSR2 or SIGHUP.
pub fn parse(name: &str) -> Result<i32> {
    match number(name).filter(|signal| SAVE_SIGNALS.iter().any(|(_, s)| s == signal)) {
        Some(signal) => Ok(signal),
        None => bail!(
            "train.save_signal {name:?} is not a signal a run saves on: use {} (SIGINT and SIGTERM always save and stop)",
            SAVE_SIGNALS.map(|(known, _)| known).join(", ")
        ),
    }
}

/// A stopping signal's number by its name (`SIGTERM`, `TERM`, `SIGUSR1`, …).
pub fn number(name: &str) -> Option<i32> {
    let upper = name.trim().to_ascii_uppercase();
    let full = if upper.starts_with("SIG") { upper } else { format!("SIG{upper}") };
    STOPPING.into_iter().find(|&signal| self::name(signal) == full)
}

/// A signal's name, for the log.
pub fn name(signal: i32) -> String {
    match signal {
        SIGINT => "SIGINT".into(),
        SIGTERM => "SIGTERM".into(),
        other => SAVE_SIGNALS.iter().find(|(_, s)| *s == other).map_or(format!("signal {other}"), |(known, _)| known.to_string()),
    }
}

/// The stopping signals this process has received, from [`StopSignals::install`]
/// on, for the rest of the process.
pub struct StopSignals {
    received: Arc<AtomicI32>,
}

impl StopSignals {
    /// Catches the stopping signals ([`caught`]): the first is recorded for
    /// the loop to act on; a second ends the process at once (128 + its number).
    pub fn install(save_signal: i32) -> Result<StopSignals> {
        let received = Arc::new(AtomicI32::new(0));
        for signal in caught(save_signal) {
            let first = Arc::clone(&received);
            // SAFETY: the action only swaps an atomic and calls _exit, both async-signal-safe.
            unsafe {
                signal_hook::low_level::register(signal, move || {
                    if first.swap(signal, Ordering::SeqCst) != 0 {
                        signal_hook::low_level::exit(128 + signal);
                    }
                })?;
            }
        }
        Ok(StopSignals { received })
    }

    /// The first stopping signal received, if any.
    pub fn received(&self) -> Option<i32> {
        Some(self.received.load(Ordering::SeqCst)).filter(|&signal| signal != 0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn save_signals_are_named_as_slurm_or_kill_write_them() {
        for text in ["SIGUSR1", "USR1", "usr1", " sigusr1 "] {
            assert_eq!(parse(text).unwrap(), SIGUSR1, "{text}");
        }
        assert_eq!((parse("USR2").unwrap(), parse("HUP").unwrap()), (SIGUSR2, SIGHUP));
        let error = parse("SIGKILL").unwrap_err().to_string();
        assert!(error.contains("train.save_signal \"SIGKILL\" is not a signal a run saves on: use SIGUSR1, SIGUSR2, SIGHUP"), "{error}");
        assert_eq!((name(SIGTERM), name(SIGUSR1), name(SIGINT)), ("SIGTERM".into(), "SIGUSR1".into(), "SIGINT".into()));
    }
}

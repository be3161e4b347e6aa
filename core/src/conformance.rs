//! `ft plugin check`: the conformance kit for communication plug-ins
//! (docs/PLUGINS.md, "Checking a plug-in"). It trains the embedded demo on
//! 2 and 3 local CPU ranks over Gloo with and without a plug-in's hook, and
//! checks what an author must never break. A check that fails says why in
//! one line (the run's own error: the plug-in's name and message, or which
//! ranks issued which collective), never a hang. The checks:
//! - an exact hook (tolerance 0) gives the built-in's losses bit for bit,
//!   and a lossy one stays within its declared tolerance;
//! - every rank issues the same collectives (`dist.verify_collectives`);
//! - a killed rank, resumed, gives the uninterrupted losses;
//! - a resume at another world size does what the contract says: the
//!   hook's state is re-sharded or starts afresh, as the hook decides, and the log says which.

use crate::config::{CommConfig, Config};
use crate::registry::{Origin, Registry};
use anyhow::{bail, Context, Result};
use std::path::{Path, PathBuf};
use std::process::Command;

/// What to check, and how.
pub struct CheckRequest {
    /// The `ft` binary that runs the training (`std::env::current_exe`).
    pub ft: PathBuf,
    /// The plug-in under test.
    pub library: PathBuf,
    /// Every plug-in to load (the one under test among them).
    pub plugins: Vec<PathBuf>,
    /// The hook to check (None: every hook the library registers).
    pub comm: Option<String>,
    pub strategies: Vec<String>,
    /// `--set KEY=VALUE` for every run, as given and parsed.
    pub settings: Vec<crate::config::Assignment>,
    pub raw_settings: Vec<String>,
    /// Optimizer steps per run.
    pub steps: usize,
    /// Where the runs write (removed after).
    pub scratch: PathBuf,
}

#[derive(Debug, Clone, PartialEq)]
pub enum Outcome {
    Pass(String),
    Fail(String),
    /// Not run, and why (a strategy the hook refuses, as it may).
    Skipped(String),
}

/// One line of the table.
#[derive(Debug, Clone)]
pub struct Row {
    pub hook: String,
    pub check: String,
    pub outcome: Outcome,
}

/// One training run's result.
struct Run {
    succeeded: bool,
    log: String,
    losses: Vec<f64>,
}

impl Run {
    /// The lines that say why the run failed.
    fn why(&self) -> String {
        let lines: Vec<&str> = self.log.lines().filter(|l| l.contains("error") || l.contains("panicked")).collect();
        let last = lines.last().copied().unwrap_or("it failed without an error line");
        // A worker's line is prefixed by the launcher with its rank and a timestamp.
        last.split_once("error: ").map_or(last, |(_, message)| message).trim().to_string()
    }
}

impl CheckRequest {
    /// Trains the demo under `strategy` on `ranks` ranks into `dir`, through
    /// `comm` when given, with `extra` flags and `env` variables.
    fn train(&self, dir: &Path, ranks: usize, strategy: &str, comm: Option<&str>, extra: &[&str], env: &[(&str, &str)]) -> Result<Run> {
        let mut command = Command::new(&self.ft);
        for plugin in &self.plugins {
            command.arg("--plugin").arg(plugin);
        }
        let samples = (self.steps * 2 * ranks).to_string();
        command
            .args(["train", "--output-dir"])
            .arg(dir)
            .args(["--epochs", "1", "--train-samples", &samples, "--eval-samples", "4", "--batch-size", "2", "--seed", "3"])
            .args(["--dtype", "f32", "--device", "cpu", "--report-to", "jsonl", "--nproc-per-node", &ranks.to_string()])
            .args(["--strategy", strategy, "--set", "dist.verify_collectives=true", "--set", "dist.timeout_secs=60"]);
        if let Some(comm) = comm {
            command.args(["--comm", comm]);
        }
        for setting in &self.raw_settings {
            command.args(["--set", setting]);
        }
        command.args(extra);
        // A check run is no launcher's worker, whatever started `ft plugin check`.
        for var in ["RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "FT_FAULT_INJECT"] {
            command.env_remove(var);
        }
        command.envs(env.iter().copied());
        let output = command.output().with_context(|| format!("cannot run {}", self.ft.display()))?;
        let log = format!("{}{}", String::from_utf8_lossy(&output.stdout), String::from_utf8_lossy(&output.stderr));
        Ok(Run { succeeded: output.status.success(), log, losses: losses(dir) })
    }
}

/// Each logged step's loss in a run's metrics.jsonl (none if it has none).
fn losses(dir: &Path) -> Vec<f64> {
    let Ok(text) = std::fs::read_to_string(dir.join("metrics.jsonl")) else { return vec![] };
    text.lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok()?.get("loss")?.as_f64())
        .collect()
}

/// Whether `hooked` matches `builtin` as a hook of `tolerance` must.
fn compare(hooked: &[f64], builtin: &[f64], tolerance: f64) -> Outcome {
    if hooked.len() != builtin.len() || hooked.is_empty() {
        return Outcome::Fail(format!("{} losses logged against the built-in's {}", hooked.len(), builtin.len()));
    }
    let relative: Vec<f64> = hooked.iter().zip(builtin).map(|(h, b)| (h - b).abs() / b.abs().max(1e-12)).collect();
    let (worst, largest) = relative.iter().enumerate().fold((0, 0.0), |best, (i, r)| if *r > best.1 { (i, *r) } else { best });
    match (tolerance == 0.0, largest <= tolerance) {
        (true, true) => Outcome::Pass(format!("bit for bit over {} steps", hooked.len())),
        (false, true) => Outcome::Pass(format!("within {:.2}% (largest {:.3}%)", tolerance * 100.0, largest * 100.0)),
        (true, false) => Outcome::Fail(format!("declared exact, but step {} has loss {} against {}", worst + 1, hooked[worst], builtin[worst])),
        (false, false) => Outcome::Fail(format!(
            "step {} differs by {:.3}% (declared tolerance {:.2}%): {} against {}",
            worst + 1,
            largest * 100.0,
            tolerance * 100.0,
            hooked[worst],
            builtin[worst]
        )),
    }
}

/// Runs every check on the hooks `request.library` registered into
/// `registry`; returns the table's rows.
pub fn check(request: &CheckRequest, registry: &Registry) -> Result<Vec<Row>> {
    let canonical = request.library.canonicalize().unwrap_or_else(|_| request.library.clone());
    let ours: Vec<&str> = registry.comms().iter().filter(|c| c.origin == Origin::Plugin(canonical.clone())).map(|c| c.name.as_str()).collect();
    let hooks: Vec<String> = match &request.comm {
        Some(name) if ours.contains(&name.as_str()) => vec![name.clone()],
        Some(name) => bail!("{} registers no communication hook `{name}` (it registers: {})", request.library.display(), list(&ours)),
        None if ours.is_empty() => bail!("{} registers no communication hook: nothing to check", request.library.display()),
        None => ours.iter().map(|s| s.to_string()).collect(),
    };
    let config = Config::load(None, &[], &request.settings)?;
    let mut rows = vec![];
    for name in hooks {
        rows.extend(check_hook(request, registry, &name, &config.comm)?);
    }
    let _ = std::fs::remove_dir_all(&request.scratch);
    Ok(rows)
}

fn list(names: &[&str]) -> String {
    if names.is_empty() { "none".into() } else { names.join(", ") }
}

fn check_hook(request: &CheckRequest, registry: &Registry, name: &str, comm: &CommConfig) -> Result<Vec<Row>> {
    let mut rows = vec![];
    let mut row = |check: String, outcome: Outcome| rows.push(Row { hook: name.to_string(), check, outcome });
    let config = CommConfig { name: Some(name.to_string()), options: comm.options.clone() };
    let ddp = (registry.strategy("ddp")?.create)();
    let hook = match registry.comm_hook(&config, ddp.as_ref()) {
        Ok((hook, _)) => hook,
        Err(e) => {
            row("made with its options".into(), Outcome::Fail(format!("{e:#}")));
            return Ok(rows);
        }
    };
    row(
        format!("loads: ABI major {}, minor ≤ {}, boundary types and rustc match", crate::abi::ABI_MAJOR, crate::abi::ABI_MINOR),
        Outcome::Pass(format!("tolerance {}", if hook.tolerance() == 0.0 { "0 (exact)".to_string() } else { hook.tolerance().to_string() })),
    );
    let dir = request.scratch.join(name);
    // The first strategy the hook serves at 2 ranks hosts the resume checks.
    let mut resumable = None;
    for strategy in &request.strategies {
        let policy = (registry.strategy(strategy)?.create)().policy();
        for ranks in [2, 3] {
            let label = format!("{strategy} at {ranks} ranks: same collectives on every rank, losses as the built-in's");
            let shard_size = policy.shard_group_size(strategy, ranks, ranks, None)?;
            if let Err(why) = hook.check(&policy.comm_plan(strategy, ranks, shard_size, false)) {
                row(label, Outcome::Skipped(format!("the hook refuses it: {why:#}")));
                continue;
            }
            let builtin = request.train(&dir.join(format!("{strategy}-{ranks}-builtin")), ranks, strategy, None, &[], &[])?;
            if !builtin.succeeded {
                bail!("the built-in run of {strategy} at {ranks} ranks failed, so nothing can be compared: {}", builtin.why());
            }
            let hooked = request.train(&dir.join(format!("{strategy}-{ranks}")), ranks, strategy, Some(name), &[], &[])?;
            let outcome = if hooked.succeeded { compare(&hooked.losses, &builtin.losses, hook.tolerance()) } else { Outcome::Fail(hooked.why()) };
            if ranks == 2 && resumable.is_none() && matches!(outcome, Outcome::Pass(_)) {
                resumable = Some((strategy.clone(), hooked.losses.clone()));
            }
            row(label, outcome);
        }
    }
    let Some((strategy, uninterrupted)) = resumable else {
        row("save, kill a rank, resume".into(), Outcome::Skipped("no strategy passed at 2 ranks".into()));
        return Ok(rows);
    };
    // Rank 1 dies after step 5, with checkpoints every 3 steps.
    let killed = dir.join("killed");
    let saving = ["--save-every", "3", "--save-total-limit", "0"];
    let crash = request.train(&killed, 2, &strategy, Some(name), &saving, &[("FT_FAULT_INJECT", "after-step:5@1")])?;
    // The latest checkpoint the crash left (step 3; 6 is never reached).
    let saved = crate::checkpoint::list(&killed)?.last().map(|dir| crate::checkpoint::read_manifest(dir)).transpose()?;
    let resumed = request.train(&killed, 2, &strategy, Some(name), &[&saving[..], &["--resume", "latest"]].concat(), &[])?;
    let outcome = match (crash.succeeded, saved, resumed.succeeded) {
        (true, _, _) => Outcome::Fail("the injected kill did not happen".into()),
        (false, None, _) => Outcome::Fail("the killed run left no checkpoint".into()),
        (false, Some(_), false) => Outcome::Fail(resumed.why()),
        (false, Some(saved), true) => {
            // The resumed run's losses follow the killed run's in metrics.jsonl.
            let all = losses(&killed);
            let expected = &uninterrupted[saved.step.min(uninterrupted.len())..];
            let got = &all[all.len().saturating_sub(expected.len())..];
            match got == expected && !expected.is_empty() {
                true => Outcome::Pass(format!("resumed from step {}: steps {}..{} equal bit for bit", saved.step, saved.step + 1, uninterrupted.len())),
                false => Outcome::Fail(format!("resumed from step {}: losses {got:?} against the uninterrupted {expected:?}", saved.step)),
            }
        }
    };
    row(format!("{strategy}: save, kill rank 1 after step 5, resume: the uninterrupted losses"), outcome);
    // The same checkpoint resumed at 3 ranks: the hook re-shards its state or starts it afresh, and the log says which.
    let wider = request.train(&killed, 3, &strategy, Some(name), &["--resume", "latest", "--epochs", "2"], &[])?;
    let declared = wider.log.lines().find(|l| l.contains("its state was saved at 2 ranks"));
    let outcome = match (wider.succeeded, declared) {
        (false, _) => Outcome::Fail(wider.why()),
        (true, Some(line)) if line.contains("re-sharded, kept") => Outcome::Pass(format!("it re-shards: {}", line.split("kept ").last().unwrap_or(line))),
        (true, Some(line)) if line.contains("starts afresh") => Outcome::Pass("its state starts afresh, and the log says so".into()),
        (true, Some(line)) => Outcome::Fail(format!("the log neither says it re-sharded nor that it starts afresh: {line}")),
        (true, None) => Outcome::Pass("it keeps no state; the run resumes".into()),
    };
    row(format!("{strategy}: resume at 3 ranks"), outcome);
    Ok(rows)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn losses_are_compared_as_the_hook_declares() {
        assert_eq!(compare(&[1.0, 2.0], &[1.0, 2.0], 0.0), Outcome::Pass("bit for bit over 2 steps".into()));
        assert!(matches!(compare(&[1.0, 2.000001], &[1.0, 2.0], 0.0), Outcome::Fail(m) if m.contains("declared exact, but step 2")));
        assert!(matches!(compare(&[1.0, 2.01], &[1.0, 2.0], 0.01), Outcome::Pass(m) if m.contains("largest 0.500%")));
        assert!(matches!(compare(&[1.0, 2.1], &[1.0, 2.0], 0.01), Outcome::Fail(m) if m.contains("step 2 differs by 5.000%")));
        assert!(matches!(compare(&[1.0], &[1.0, 2.0], 0.0), Outcome::Fail(m) if m.contains("1 losses logged against the built-in's 2")));
    }
}

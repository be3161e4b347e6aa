//! `ft plugin check`: the conformance kit for communication plug-ins
//! (docs/PLUGINS.md, "Checking a plug-in"). It trains the embedded demo on
//! 2 and 3 local CPU ranks over Gloo with and without a plug-in's hook, and
//! checks what an author must never break. A check that fails says why in
//! one line (the run's own error: the plug-in's name and message, or which
//! ranks issued which collective), never a hang. The checks:
//! - an exact hook (tolerance 0) gives the built-in's losses bit for bit,
//!   and a lossy one stays within its declared tolerance at every step (a
//!   curve: `CommHook::tolerance(step)`); both runs' losses are shown step by step;
//! - every rank issues the same collectives (`dist.verify_collectives`);
//! - the hook's all-to-all (`CommHook::all_to_all`) delivers rows of
//!   uneven splits exactly (`ft comm-test --comm` at 2 and 3 ranks);
//! - a killed rank, resumed, gives the plug-in's own uninterrupted losses
//!   bit for bit (whatever the comparison with the built-in found);
//! - a resume at another world size does what the contract says: the
//!   hook's state is re-sharded or starts afresh, as the hook decides, and the log says which.
//!
//! A failed run's whole output (every rank's, through the launcher) is kept
//! in a log file its row names, and its last lines are shown under the row.

use crate::config::{CommConfig, Config};
use crate::distributed::comm_hook::CommHook;
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
    /// Where a failed run's output is kept (removed if none failed).
    pub logs: PathBuf,
    /// Where the built-in runs' losses are kept for later checks (`--cache`), if anywhere.
    pub cache: Option<PathBuf>,
}

#[derive(Debug, Clone, PartialEq)]
pub enum Outcome {
    Pass(String),
    Fail(String),
    /// Not run, and why (a strategy the hook refuses, as it may).
    Skipped(String),
}

/// One line of the table, and what is shown under it.
#[derive(Debug, Clone)]
pub struct Row {
    pub hook: String,
    pub check: String,
    pub outcome: Outcome,
    /// Per-step losses of the runs compared; a failed run's last lines.
    pub details: Vec<String>,
}

/// `ft plugin check LIBRARY`: loads it beside `plugins` (a failure to load
/// is the table's one row), runs [`check`] with these settings (`--set`,
/// as given) in a scratch directory, and prints the table. Returns the
/// exit code: 1 if a check failed.
pub fn run(library: PathBuf, plugins: &[PathBuf], comm: Option<String>, strategies: Vec<String>, raw_settings: Vec<String>, steps: usize, cache: Option<PathBuf>) -> Result<i32> {
    println!("ft plugin check {}", library.display());
    let mut all = plugins.to_vec();
    if !all.contains(&library) {
        all.push(library.clone());
    }
    let registry = match Registry::with_plugins(&all) {
        Ok(registry) => registry,
        Err(error) => {
            print!("{}", table(&[Row { hook: "-".into(), check: "loads".into(), outcome: Outcome::Fail(format!("{error:#}")), details: vec![] }]));
            return Ok(1);
        }
    };
    let settings = raw_settings.iter().map(|s| crate::config::parse_assignment(s).map_err(anyhow::Error::msg)).collect::<Result<_>>()?;
    let work = std::env::temp_dir().join(format!("ft-plugin-check-{}", std::process::id()));
    let request = CheckRequest {
        ft: std::env::current_exe()?,
        library,
        plugins: all,
        comm,
        strategies,
        settings,
        raw_settings,
        steps: steps.max(6),
        scratch: work.join("runs"),
        logs: work.join("logs"),
        cache,
    };
    let rows = check(&request, &registry)?;
    // Gone unless it keeps a failed run's log.
    let _ = std::fs::remove_dir(&work);
    print!("{}", table(&rows));
    Ok(if rows.iter().any(|r| matches!(r.outcome, Outcome::Fail(_))) { 1 } else { 0 })
}

/// The rows as `ft plugin check` prints them: one line each (hook, check,
/// ok/FAIL/skip, detail) with its details under it, then the counts.
pub fn table(rows: &[Row]) -> String {
    let width = rows.iter().map(|r| r.check.len()).max().unwrap_or(0);
    let mut out = String::new();
    for row in rows {
        let (mark, detail) = match &row.outcome {
            Outcome::Pass(detail) => ("ok", detail),
            Outcome::Fail(detail) => ("FAIL", detail),
            Outcome::Skipped(detail) => ("skip", detail),
        };
        out += &format!("  {:<10} {:<width$}  {mark:<4}  {detail}\n", row.hook, row.check);
        for line in &row.details {
            out += &format!("      {line}\n");
        }
    }
    let count = |kind: fn(&Outcome) -> bool| rows.iter().filter(|r| kind(&r.outcome)).count();
    out += &format!(
        "{} passed, {} failed, {} skipped\n",
        count(|o| matches!(o, Outcome::Pass(_))),
        count(|o| matches!(o, Outcome::Fail(_))),
        count(|o| matches!(o, Outcome::Skipped(_)))
    );
    out
}

/// Lines of a failed run's output shown under its row.
const LOG_TAIL: usize = 15;

/// One training run's result.
struct Run {
    succeeded: bool,
    log: String,
    losses: Vec<f64>,
    /// Where its output is kept if it fails a check.
    log_file: PathBuf,
}

impl Run {
    /// The line that says why the run failed.
    fn why(&self) -> String {
        let lines: Vec<&str> = self.log.lines().filter(|l| l.contains("error") || l.contains("panicked")).collect();
        let last = lines.last().copied().unwrap_or("it failed without an error line");
        // A worker's line is prefixed by the launcher with its rank and a timestamp.
        last.split_once("error: ").map_or(last, |(_, message)| message).trim().to_string()
    }

    /// Why it failed and where its whole output is kept (written now).
    fn why_kept(&self) -> String {
        let kept = self.log_file.parent().map_or(Ok(()), std::fs::create_dir_all).and_then(|_| std::fs::write(&self.log_file, &self.log));
        match kept {
            Ok(()) => format!("{} (every rank's output: {})", self.why(), self.log_file.display()),
            Err(e) => format!("{} (its output could not be kept in {}: {e})", self.why(), self.log_file.display()),
        }
    }

    /// Its last lines, to show under its row.
    fn tail(&self) -> Vec<String> {
        let lines: Vec<&str> = self.log.lines().collect();
        lines[lines.len().saturating_sub(LOG_TAIL)..].iter().map(|l| format!("| {l}")).collect()
    }

    /// A failed check: why, where its output is kept, and its last lines.
    fn failed(&self) -> (Outcome, Vec<String>) {
        (Outcome::Fail(self.why_kept()), self.tail())
    }
}

impl CheckRequest {
    /// Trains the demo under `strategy` on `ranks` ranks into `dir`, through
    /// `comm` when given, with `extra` flags and `env` variables.
    fn train(&self, dir: &Path, ranks: usize, strategy: &str, comm: Option<&str>, extra: &[&str], env: &[(&str, &str)]) -> Result<Run> {
        let command = self.command(&self.plugins, &self.raw_settings, dir, ranks, strategy, comm, extra, env);
        self.run(command, dir, ranks, extra)
    }

    /// The built-in's run of `strategy` at `ranks` ranks into `dir`: ft's own
    /// collectives, so neither a hook's `comm.*` settings nor the library under
    /// test unless the strategy is its own. With a cache, a run made before
    /// from the same inputs (`builtin_run_key`) is reused, and the row says so.
    fn builtin(&self, registry: &Registry, dir: &Path, ranks: usize, strategy: &str) -> Result<(Run, Option<PathBuf>)> {
        let under_test = Origin::Plugin(self.library.canonicalize().unwrap_or_else(|_| self.library.clone()));
        let strategy_is_its_own = registry.strategy(strategy)?.origin == under_test;
        let plugins: Vec<PathBuf> = self.plugins.iter().filter(|p| strategy_is_its_own || **p != self.library).cloned().collect();
        let settings: Vec<String> = self.raw_settings.iter().filter(|s| !s.trim_start().starts_with("comm.")).cloned().collect();
        let command = self.command(&plugins, &settings, dir, ranks, strategy, None, &[], &[]);
        // Another setting may name a file whose contents the key cannot see: such runs are made every time.
        let cached = match &self.cache {
            Some(cache) if settings.is_empty() => Some(cache.join(format!("builtin-{}.json", builtin_run_key(&command, &plugins, &self.plugins, dir)?))),
            _ => None,
        };
        if let Some(losses) = cached.as_ref().and_then(|file| std::fs::read(file).ok()).and_then(|json| serde_json::from_slice::<Vec<f64>>(&json).ok()) {
            return Ok((Run { succeeded: true, log: String::new(), losses, log_file: PathBuf::new() }, cached));
        }
        let run = self.run(command, dir, ranks, &[])?;
        if let (Some(file), true) = (&cached, run.succeeded) {
            // Written whole under another name, then renamed: a check reading it at the same time sees all of it or nothing.
            let partial = file.with_extension(format!("partial-{}", std::process::id()));
            std::fs::create_dir_all(file.parent().unwrap_or(Path::new(".")))
                .and_then(|_| std::fs::write(&partial, serde_json::to_vec(&run.losses)?))
                .and_then(|_| std::fs::rename(&partial, file))
                .with_context(|| format!("cannot write the built-in run's losses into the cache {}", file.display()))?;
        }
        Ok((run, None))
    }

    /// The hook's all-to-all (`CommHook::all_to_all`), through `ft
    /// comm-test --comm` at 2 and 3 ranks, each rank's splits its own.
    fn all_to_all(&self, name: &str) -> (Outcome, Vec<String>) {
        for ranks in [2, 3] {
            let mut command = Command::new(&self.ft);
            command.args(["launch", "--nproc-per-node", &ranks.to_string(), "--"]);
            for plugin in &self.plugins {
                command.arg("--plugin").arg(plugin);
            }
            command.args(["comm-test", "--backend", "gloo", "--comm", name, "--ops", "all_to_all", "--min-bytes", "4K", "--max-bytes", "4K"]);
            command.args(["--warmup", "0", "--iters", "1", "--timeout-secs", "60", "--set", "dist.verify_collectives=true"]);
            for setting in self.raw_settings.iter().filter(|s| s.trim_start().starts_with("comm.")) {
                command.args(["--set", setting]);
            }
            for var in ["RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"] {
                command.env_remove(var);
            }
            let output = match command.output() {
                Ok(output) => output,
                Err(e) => return (Outcome::Fail(format!("cannot run {}: {e}", self.ft.display())), vec![]),
            };
            let log = format!("{}{}", String::from_utf8_lossy(&output.stdout), String::from_utf8_lossy(&output.stderr));
            let run = Run { succeeded: output.status.success(), log, losses: vec![], log_file: self.logs.join(format!("{name}-all-to-all-at-{ranks}.log")) };
            if !run.succeeded {
                return run.failed();
            }
        }
        (Outcome::Pass("every rank received what the others sent it".into()), vec![])
    }

    /// `ft [--plugin P]… train` of the demo into `dir`, with `settings` (`--set`) and the check's fixed flags.
    #[allow(clippy::too_many_arguments)]
    fn command(&self, plugins: &[PathBuf], settings: &[String], dir: &Path, ranks: usize, strategy: &str, comm: Option<&str>, extra: &[&str], env: &[(&str, &str)]) -> Command {
        let mut command = Command::new(&self.ft);
        for plugin in plugins {
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
        for setting in settings {
            command.args(["--set", setting]);
        }
        command.args(extra);
        // A check run is no launcher's worker, whatever started `ft plugin check`.
        for var in ["RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "FT_FAULT_INJECT"] {
            command.env_remove(var);
        }
        command.envs(env.iter().copied());
        command
    }

    /// Runs `command`, which trains into `dir` on `ranks` ranks with `extra` flags.
    fn run(&self, mut command: Command, dir: &Path, ranks: usize, extra: &[&str]) -> Result<Run> {
        let output = command.output().with_context(|| format!("cannot run {}", self.ft.display()))?;
        let log = format!("{}{}", String::from_utf8_lossy(&output.stdout), String::from_utf8_lossy(&output.stderr));
        // Named after the run's directory under the scratch space (hook, strategy), its ranks and whether it resumed.
        let name = dir.strip_prefix(&self.scratch).unwrap_or(dir).to_string_lossy().replace('/', "-");
        let resumed = if extra.contains(&"--resume") { "-resumed" } else { "" };
        let log_file = self.logs.join(format!("{name}-at-{ranks}{resumed}.log"));
        Ok(Run { succeeded: output.status.success(), log, losses: losses(dir), log_file })
    }
}

/// What a built-in run's losses follow from, as a SHA-256 in hex: the
/// contents of the `ft` binary and of the `plugins` it loads, every other
/// shared library this process has mapped but the plug-ins it loaded
/// (`loaded_here`): libtorch and its kin, by path, size and modification
/// time, which the run's `ft` loads too; its arguments but the output
/// directory `dir`, and its whole environment. The run trains the demo
/// embedded in `ft`, so no other file enters.
fn builtin_run_key(command: &Command, plugins: &[PathBuf], loaded_here: &[PathBuf], dir: &Path) -> Result<String> {
    use sha2::{Digest, Sha256};
    let mut key = Sha256::new();
    let mut field = |bytes: &[u8]| {
        // Each field's length first, so that no two lists of fields hash alike.
        key.update((bytes.len() as u64).to_le_bytes());
        key.update(bytes);
    };
    for file in std::iter::once(Path::new(command.get_program())).chain(plugins.iter().map(PathBuf::as_path)) {
        let mut contents = std::fs::File::open(file).with_context(|| format!("cannot read {} to key the cache", file.display()))?;
        let mut hash = Sha256::new();
        std::io::copy(&mut contents, &mut hash)?;
        field(&hash.finalize());
    }
    let maps = std::fs::read_to_string("/proc/self/maps").unwrap_or_default();
    let plugins_here: Vec<PathBuf> = loaded_here.iter().filter_map(|p| p.canonicalize().ok()).collect();
    let libraries: std::collections::BTreeSet<&str> = maps.lines().filter_map(|l| l.split_whitespace().nth(5)).filter(|p| p.contains(".so")).collect();
    for library in libraries.into_iter().filter(|l| !plugins_here.iter().any(|p| p == Path::new(l))) {
        let modified = std::fs::metadata(library).and_then(|m| Ok((m.len(), m.modified()?))).ok();
        field(format!("{library} {modified:?}").as_bytes());
    }
    for arg in command.get_args().filter(|arg| *arg != dir.as_os_str()) {
        field(arg.as_encoded_bytes());
    }
    let mut environment: std::collections::BTreeMap<_, _> = std::env::vars_os().map(|(k, v)| (k, Some(v))).collect();
    for (name, value) in command.get_envs() {
        environment.insert(name.to_owned(), value.map(ToOwned::to_owned));
    }
    for (name, value) in environment.iter().filter_map(|(k, v)| Some((k, v.as_ref()?))) {
        field(name.as_encoded_bytes());
        field(value.as_encoded_bytes());
    }
    Ok(key.finalize().iter().map(|b| format!("{b:02x}")).collect())
}

/// Each logged step's loss in a run's metrics.jsonl (none if it has none).
fn losses(dir: &Path) -> Vec<f64> {
    let Ok(text) = std::fs::read_to_string(dir.join("metrics.jsonl")) else { return vec![] };
    text.lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok()?.get("loss")?.as_f64())
        .collect()
}

/// Whether `hooked` matches `builtin` as a hook whose tolerance at step s
/// (1 for the first) is `tolerance(s)` must: steps of tolerance 0 bit for
/// bit. Also the table of both runs' losses, step by step.
fn compare(hooked: &[f64], builtin: &[f64], tolerance: impl Fn(usize) -> f64) -> (Outcome, Vec<String>) {
    let mut table = vec![format!("{:>5}  {:>12}  {:>12}  {:>10}  {:>10}", "step", "built-in", "plug-in", "gap", "allowed")];
    for step in 1..=hooked.len().max(builtin.len()) {
        let loss = |losses: &[f64]| losses.get(step - 1).map_or("-".to_string(), |l| format!("{l:.6}"));
        let gap = match (hooked.get(step - 1), builtin.get(step - 1)) {
            (Some(h), Some(b)) => format!("{:.4}%", relative(*h, *b) * 100.0),
            _ => "-".into(),
        };
        table.push(format!("{step:>5}  {:>12}  {:>12}  {gap:>10}  {:>9.4}%", loss(builtin), loss(hooked), tolerance(step) * 100.0));
    }
    if hooked.len() != builtin.len() || hooked.is_empty() {
        return (Outcome::Fail(format!("{} losses logged against the built-in's {}", hooked.len(), builtin.len())), table);
    }
    let exact = (1..=hooked.len()).all(|step| tolerance(step) == 0.0);
    // The first step over its tolerance (a step of tolerance 0 must be equal).
    let over = hooked.iter().zip(builtin).enumerate().find(|(i, (h, b))| {
        let allowed = tolerance(i + 1);
        if allowed == 0.0 { h != b } else { relative(**h, **b) > allowed }
    });
    let largest = hooked.iter().zip(builtin).enumerate().map(|(i, (h, b))| (i + 1, relative(*h, *b))).fold((0, 0.0), |a, b| if b.1 > a.1 { b } else { a });
    let outcome = match (over, exact) {
        (None, true) => Outcome::Pass(format!("bit for bit over {} steps", hooked.len())),
        (None, false) => Outcome::Pass(format!(
            "within the declared tolerance at every step (largest gap {:.3}% at step {}, where {:.2}% is allowed)",
            largest.1 * 100.0,
            largest.0,
            tolerance(largest.0) * 100.0
        )),
        (Some((i, (h, b))), _) if tolerance(i + 1) == 0.0 => Outcome::Fail(format!("declared exact, but step {} has loss {h} against {b}", i + 1)),
        (Some((i, (h, b))), _) => Outcome::Fail(format!(
            "step {} differs by {:.3}% (declared tolerance at that step {:.2}%): {h} against {b}",
            i + 1,
            relative(*h, *b) * 100.0,
            tolerance(i + 1) * 100.0
        )),
    };
    (outcome, table)
}

/// `hooked`'s difference from `builtin`, relative to it.
fn relative(hooked: f64, builtin: f64) -> f64 {
    (hooked - builtin).abs() / builtin.abs().max(1e-12)
}

/// The hook's tolerance curve in a few words: "0 (exact)", "1%", "1% at step 1 to 4% at step 8".
fn describe_tolerance(hook: &dyn CommHook, steps: usize) -> String {
    let (first, last) = (hook.tolerance(1), hook.tolerance(steps));
    match (first == 0.0 && last == 0.0, first == last) {
        (true, _) => "0 (exact)".into(),
        (false, true) => format!("{}%", first * 100.0),
        (false, false) => format!("{}% at step 1 to {}% at step {steps}", first * 100.0, last * 100.0),
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
    // Kept only when a run failed (a directory with logs is not removed).
    let _ = std::fs::remove_dir(&request.logs);
    Ok(rows)
}

fn list(names: &[&str]) -> String {
    if names.is_empty() { "none".into() } else { names.join(", ") }
}

fn check_hook(request: &CheckRequest, registry: &Registry, name: &str, comm: &CommConfig) -> Result<Vec<Row>> {
    let mut rows = vec![];
    let mut row = |check: String, (outcome, details): (Outcome, Vec<String>)| rows.push(Row { hook: name.to_string(), check, outcome, details });
    let config = CommConfig { name: Some(name.to_string()), options: comm.options.clone() };
    let ddp = (registry.strategy("ddp")?.create)();
    let hook = match registry.comm_hook(&config, ddp.as_ref()) {
        Ok((hook, _)) => hook,
        Err(e) => {
            row("made with its options".into(), (Outcome::Fail(format!("{e:#}")), vec![]));
            return Ok(rows);
        }
    };
    row(
        format!("loads: ABI major {}, minor ≤ {}, rustc and the boundary (shared crates, types) match", crate::abi::ABI_MAJOR, crate::abi::ABI_MINOR),
        (Outcome::Pass(format!("tolerance {}", describe_tolerance(hook.as_ref(), request.steps))), vec![]),
    );
    row("all-to-all at 2 and 3 ranks: uneven splits, the values expected".into(), request.all_to_all(name));
    let dir = request.scratch.join(name);
    // The first strategy whose run through the hook completes at 2 ranks
    // hosts the resume checks, whatever its losses against the built-in:
    // a resume is judged against the plug-in's own uninterrupted run.
    let mut resumable = None;
    for strategy in &request.strategies {
        let policy = (registry.strategy(strategy)?.create)().policy();
        // A hook whose run fails at 2 ranks is not run again at 3: its failure is already the row to read.
        let mut failed_at_2 = false;
        for ranks in [2, 3] {
            let label = format!("{strategy} at {ranks} ranks: same collectives on every rank, losses as the built-in's");
            if failed_at_2 {
                row(label, (Outcome::Skipped("its run failed at 2 ranks".into()), vec![]));
                continue;
            }
            let shard_size = policy.shard_group_size(strategy, ranks, ranks, None)?;
            if let Err(why) = hook.check(&policy.comm_plan(strategy, ranks, shard_size, false)) {
                row(label, (Outcome::Skipped(format!("the hook refuses it: {why:#}")), vec![]));
                continue;
            }
            let (builtin, reused) = request.builtin(registry, &dir.join(format!("{strategy}-{ranks}-builtin")), ranks, strategy)?;
            if !builtin.succeeded {
                bail!("the built-in run of {strategy} at {ranks} ranks failed, so nothing can be compared: {}", builtin.why_kept());
            }
            let hooked = request.train(&dir.join(format!("{strategy}-{ranks}")), ranks, strategy, Some(name), &[], &[])?;
            if !hooked.succeeded {
                failed_at_2 = ranks == 2;
                row(label, hooked.failed());
                continue;
            }
            if ranks == 2 && resumable.is_none() {
                resumable = Some((strategy.clone(), hooked.losses.clone()));
            }
            let (outcome, mut table) = compare(&hooked.losses, &builtin.losses, |step| hook.tolerance(step));
            if let Some(file) = reused {
                table.insert(0, format!("(the built-in's losses reused from {})", file.display()));
            }
            row(label, (outcome, table));
        }
    }
    let Some((strategy, uninterrupted)) = resumable else {
        row("save, kill a rank, resume".into(), (Outcome::Skipped("no run through the hook completed at 2 ranks".into()), vec![]));
        return Ok(rows);
    };
    // Rank 1 dies after step 5, with checkpoints every 2 steps: step 4's save first finishes step 2's, whose files
    // are written in the background, so at least that one is complete whatever the disk's speed.
    let killed = dir.join("killed");
    let saving = ["--save-every", "2", "--save-total-limit", "0"];
    let crash = request.train(&killed, 2, &strategy, Some(name), &saving, &[("FT_FAULT_INJECT", "after-step:5@1")])?;
    // The latest checkpoint the crash left (step 2, or 4 when its files were written in time; 6 is never reached).
    let saved = crate::checkpoint::list(&killed)?.last().map(|dir| crate::checkpoint::read_manifest(dir)).transpose()?;
    let resumed = request.train(&killed, 2, &strategy, Some(name), &[&saving[..], &["--resume", "latest"]].concat(), &[])?;
    let outcome = match (crash.succeeded, saved, resumed.succeeded) {
        (true, _, _) => (Outcome::Fail("the injected kill did not happen".into()), vec![]),
        (false, None, _) => (Outcome::Fail(format!("the killed run left no checkpoint: {}", crash.why_kept())), crash.tail()),
        (false, Some(_), false) => resumed.failed(),
        (false, Some(saved), true) => {
            // metrics.jsonl continues from the checkpoint (the killed run's later steps are dropped): its tail is the resumed run.
            let all = losses(&killed);
            let expected = &uninterrupted[saved.step.min(uninterrupted.len())..];
            let got = &all[all.len().saturating_sub(expected.len())..];
            match got == expected && !expected.is_empty() {
                true => (Outcome::Pass(format!("resumed from step {}: steps {}..{} equal bit for bit", saved.step, saved.step + 1, uninterrupted.len())), vec![]),
                false => (Outcome::Fail(format!("resumed from step {}: losses {got:?} against the uninterrupted {expected:?}", saved.step)), vec![]),
            }
        }
    };
    row(format!("{strategy}: save, kill rank 1 after step 5, resume: the plug-in's uninterrupted losses"), outcome);
    // The same checkpoint resumed at 3 ranks: the hook re-shards its state or starts it afresh, and the log says which.
    let wider = request.train(&killed, 3, &strategy, Some(name), &["--resume", "latest", "--epochs", "2"], &[])?;
    let declared = wider.log.lines().find(|l| l.contains("its state was saved at 2 ranks"));
    let outcome = match (wider.succeeded, declared) {
        (false, _) => wider.failed(),
        (true, Some(line)) if line.contains("re-sharded, kept") => (Outcome::Pass(format!("it re-shards: {}", line.split("kept ").last().unwrap_or(line))), vec![]),
        (true, Some(line)) if line.contains("starts afresh") => (Outcome::Pass("its state starts afresh, and the log says so".into()), vec![]),
        (true, Some(line)) => (Outcome::Fail(format!("the log neither says it re-sharded nor that it starts afresh: {line}")), vec![]),
        (true, None) => (Outcome::Pass("it keeps no state; the run resumes".into()), vec![]),
    };
    row(format!("{strategy}: resume at 3 ranks"), outcome);
    Ok(rows)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn losses_are_compared_as_the_hook_declares() {
        let outcome = |hooked: &[f64], builtin: &[f64], tolerance: f64| compare(hooked, builtin, |_| tolerance).0;
        assert_eq!(outcome(&[1.0, 2.0], &[1.0, 2.0], 0.0), Outcome::Pass("bit for bit over 2 steps".into()));
        assert!(matches!(outcome(&[1.0, 2.000001], &[1.0, 2.0], 0.0), Outcome::Fail(m) if m.contains("declared exact, but step 2")));
        assert!(matches!(outcome(&[1.0, 2.01], &[1.0, 2.0], 0.01), Outcome::Pass(m) if m.contains("largest gap 0.500% at step 2")));
        assert!(matches!(outcome(&[1.0, 2.1], &[1.0, 2.0], 0.01), Outcome::Fail(m) if m.contains("step 2 differs by 5.000%")));
        assert!(matches!(outcome(&[1.0], &[1.0, 2.0], 0.0), Outcome::Fail(m) if m.contains("1 losses logged against the built-in's 2")));
    }

    #[test]
    fn a_cached_builtin_run_is_keyed_by_its_arguments_and_environment_but_not_its_directory() {
        // Any file stands for ft: this test's own binary.
        let command = |dir: &str, strategy: &str, env: Option<&str>| {
            let mut command = Command::new(std::env::current_exe().unwrap());
            command.args(["train", "--output-dir", dir, "--strategy", strategy]);
            if let Some(value) = env {
                command.env("FT_CHECK_KEY_TEST", value);
            }
            command
        };
        let key = |c: Command, dir: &str| builtin_run_key(&c, &[], &[], Path::new(dir)).unwrap();
        let reference = key(command("a", "ddp", None), "a");
        assert_eq!(key(command("b", "ddp", None), "b"), reference, "the output directory is no input");
        assert_ne!(key(command("a", "full_shard", None), "a"), reference);
        assert_ne!(key(command("a", "ddp", Some("1")), "a"), reference);
        assert_ne!(key(command("a", "ddp", Some("2")), "a"), key(command("a", "ddp", Some("1")), "a"));
        assert_ne!(builtin_run_key(&command("a", "ddp", None), &[std::env::current_exe().unwrap()], &[], Path::new("a")).unwrap(), reference, "the plug-ins loaded");
    }

    #[test]
    fn a_tolerance_may_grow_with_steps_and_both_runs_are_shown_per_step() {
        let growing = crate::distributed::comm_hook::Tolerance { base: 0.01, per_step: 0.01 };
        // 3.75% apart at step 4 is within 1% + 3 × 1%; 4% at step 2 is not within 2%.
        let (outcome, table) = compare(&[1.0, 2.0, 3.0, 4.15], &[1.0, 2.0, 3.0, 4.0], |s| growing.at(s));
        assert!(matches!(outcome, Outcome::Pass(ref m) if m.contains("largest gap 3.750% at step 4, where 4.00% is allowed")), "{outcome:?}");
        assert_eq!(table.len(), 5, "a header and one line a step");
        assert!(table[4].contains("4.000000") && table[4].contains("4.150000") && table[4].contains("3.7500%") && table[4].contains("4.0000%"), "{}", table[4]);
        let (outcome, _) = compare(&[1.0, 2.08], &[1.0, 2.0], |s| growing.at(s));
        assert!(matches!(outcome, Outcome::Fail(ref m) if m.contains("step 2 differs by 4.000% (declared tolerance at that step 2.00%)")), "{outcome:?}");
    }
}

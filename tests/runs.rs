//! Runs you can trust with their output directory and with a signal, over
//! real `ft` processes on the embedded demo (CPU, Gloo): one run at a time
//! in a directory (the second names the first; a killed run's lock is taken
//! over), a fresh run never mixed into another's outputs, rotation and
//! `latest` within the run's own lineage, and SIGTERM or SIGUSR1 saving the
//! step every rank agrees on — resumed to the uninterrupted losses with no
//! repeated step, and requeued under Slurm.

use serde_json::Value;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use crate::common;
use common::{ft, losses, summary, text};

/// The exit code of a run that saved on a signal and stopped (README, "Runs: locks, signals, requeueing").
const SAVED_AND_STOPPED: i32 = 75;

fn run(dir: &Path, extra: &[&str]) -> Output {
    common::train_command(dir, extra).output().unwrap()
}

fn succeeded(output: Output) -> String {
    let log = text(&output);
    assert!(output.status.success(), "{log}");
    log
}

/// One rank, 12 steps.
const ONE_RANK: &[&str] = &["--nproc-per-node", "1", "--batch-size", "8"];
/// Two ranks, `STEPS` steps: long enough to signal mid-epoch.
const TWO_RANKS: &[&str] = &["--nproc-per-node", "2", "--batch-size", "4", "--train-samples", "240", "--save-total-limit", "0"];
const STEPS: u64 = 30;

/// The steps of the training records in `dir`'s metrics.jsonl, in file order.
fn steps(dir: &Path) -> Vec<u64> {
    std::fs::read_to_string(dir.join("metrics.jsonl"))
        .unwrap_or_default()
        .lines()
        .filter_map(|l| serde_json::from_str::<Value>(l).ok())
        .filter(|record| record.get("loss").is_some())
        .map(|record| record["step"].as_u64().unwrap())
        .collect()
}

/// Starts a run in the background, its output kept for `finish`.
fn start(command: &mut Command) -> Child {
    command.stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().unwrap()
}

/// Waits until `condition` holds (the run started, or trained some steps).
fn wait_until(what: &str, child: &mut Child, condition: impl Fn() -> bool) {
    let started = Instant::now();
    while !condition() {
        assert!(child.try_wait().unwrap().is_none(), "the run ended before {what}");
        assert!(started.elapsed() < Duration::from_secs(120), "timed out waiting until {what}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn send(signal: &str, pid: u32) {
    assert!(Command::new("kill").args([&format!("-{signal}"), &pid.to_string()]).status().unwrap().success());
}

/// Whether process `pid` has ended (gone, or a zombie: its files are closed, its locks released).
fn ended(pid: u64) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat")).map_or(true, |stat| stat.rsplit_once(')').unwrap().1.trim_start().starts_with('Z'))
}

/// The output directory's lock record: who holds it.
fn lock_holder(dir: &Path) -> Option<Value> {
    serde_json::from_str(&std::fs::read_to_string(dir.join(".ft-run.lock")).ok()?).ok()
}

fn hostname() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname").unwrap().trim().to_string()
}

/// A process's parent (Linux).
fn parent_of(pid: u64) -> u64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap();
    // pid (comm) state ppid …: the name may hold spaces, the last ')' ends it.
    stat.rsplit_once(')').unwrap().1.split_whitespace().nth(1).unwrap().parse().unwrap()
}

fn manifest(checkpoint: &Path) -> Value {
    serde_json::from_str(&std::fs::read_to_string(checkpoint.join("manifest.json")).unwrap()).unwrap()
}

/// Complete checkpoints under `dir`, by step.
fn checkpoints(dir: &Path) -> Vec<(u64, PathBuf)> {
    let mut found: Vec<(u64, PathBuf)> = std::fs::read_dir(dir.join("checkpoints"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.join("manifest.json").is_file())
        .map(|p| (manifest(&p)["step"].as_u64().unwrap(), p))
        .collect();
    found.sort();
    found
}

#[test]
fn a_second_run_in_a_directory_in_use_is_refused_naming_the_first_and_a_killed_runs_lock_is_taken_over() {
    let dir = tempfile::tempdir().unwrap();
    let mut first = start(&mut common::train_command(dir.path(), TWO_RANKS));
    wait_until("the first run holds the lock", &mut first, || lock_holder(dir.path()).is_some());
    let holder = lock_holder(dir.path()).unwrap();
    let pid = holder["pid"].as_u64().unwrap();
    assert_eq!(parent_of(pid), first.id() as u64, "the lock is held by the first run's rank 0, a worker of its launcher");
    assert_eq!(holder["host"], hostname());

    let second = run(dir.path(), ONE_RANK);
    let log = text(&second);
    assert!(!second.status.success(), "{log}");
    assert!(log.contains(&format!("is in use by another run (pid {pid} on host {}, started ", hostname())), "{log}");
    assert!(log.contains("give this run another --output-dir"), "{log}");

    // Killed outright, the first run cannot release its lock: the next run takes it over and says so.
    wait_until("the first run trained a step", &mut first, || !steps(dir.path()).is_empty());
    send("KILL", first.id());
    first.wait().unwrap();
    let since = Instant::now();
    while !ended(pid) {
        assert!(since.elapsed() < Duration::from_secs(30), "rank 0 outlived its killed launcher");
        std::thread::sleep(Duration::from_millis(20));
    }
    let log = succeeded(run(dir.path(), &[ONE_RANK, &["--overwrite-output-dir"]].concat()));
    let takeover = format!("took over the lock of {} (pid {pid} on host {}", dir.path().display(), hostname());
    assert!(log.contains(&takeover) && log.contains("that run ended without releasing it"), "{log}");
    assert_eq!(std::fs::read_to_string(dir.path().join(".ft-run.lock")).unwrap(), "", "a finished run leaves the lock free");
}

#[test]
fn a_fresh_run_into_a_finished_runs_directory_is_refused_and_overwrite_starts_it_clean() {
    let dir = tempfile::tempdir().unwrap();
    succeeded(run(dir.path(), ONE_RANK));
    let first_id = summary(dir.path())["run_id"].as_str().unwrap().to_string();
    // The run's id is in its checkpoint (the epoch's end, saved by default) and in every record.
    let saved = checkpoints(dir.path());
    assert_eq!(saved.iter().map(|(step, _)| *step).collect::<Vec<_>>(), [12], "an epoch's end is saved by default");
    assert_eq!(manifest(&saved[0].1)["run_id"], first_id.as_str());
    let records = std::fs::read_to_string(dir.path().join("metrics.jsonl")).unwrap();
    assert!(records.lines().all(|l| serde_json::from_str::<Value>(l).unwrap()["run_id"] == first_id.as_str()), "{records}");

    let refused = run(dir.path(), ONE_RANK);
    let log = text(&refused);
    assert_eq!(refused.status.code(), Some(1), "{log}");
    let message = format!("{} holds another run's outputs (metrics.jsonl, metrics.csv, summary.json, predictions.json, final, tensorboard, checkpoints)", dir.path().display());
    assert!(log.contains(&message), "{log}");
    assert!(log.contains("continue that run with --resume latest, replace them with --overwrite-output-dir (output.overwrite)"), "{log}");
    assert_eq!(steps(dir.path()).len(), 12, "the refused run wrote nothing");

    let log = succeeded(run(dir.path(), &[ONE_RANK, &["--overwrite-output-dir"]].concat()));
    assert!(log.contains("output.overwrite: removed the previous run's outputs from"), "{log}");
    let second_id = summary(dir.path())["run_id"].as_str().unwrap().to_string();
    assert_ne!(second_id, first_id);
    assert_eq!(steps(dir.path()), (1..=12).collect::<Vec<_>>(), "only the new run's records");
    let events: Vec<_> = std::fs::read_dir(dir.path().join("tensorboard")).unwrap().collect();
    assert_eq!(events.len(), 1, "only the new run's event file");
    assert!(checkpoints(dir.path()).iter().all(|(_, c)| manifest(c)["run_id"] == second_id.as_str()));
}

/// The case: another lineage's checkpoints at higher steps in the
/// same directory. Rotation deletes only the current run's old ones, and
/// `latest` is the current run's newest, not the highest step.
#[test]
fn rotation_and_latest_keep_to_the_current_runs_lineage() {
    let (other, dir) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    succeeded(run(other.path(), &[ONE_RANK, &["--save-every", "3", "--save-total-limit", "0"]].concat()));
    let other_id = summary(other.path())["run_id"].as_str().unwrap().to_string();
    // A first run in `dir`: steps 7, 14, 21 and its end, 24.
    succeeded(run(dir.path(), &[ONE_RANK, &["--epochs", "2", "--save-every", "7", "--save-total-limit", "0", "--set", "train.save_each_epoch=false"]].concat()));
    let first_id = summary(dir.path())["run_id"].as_str().unwrap().to_string();
    // Into `dir`, a run continuing the other lineage from its step 3, keeping 2 of its checkpoints (saved at 6, 9, 12).
    let from = other.path().join("checkpoints/step-00000003");
    let log = succeeded(run(dir.path(), &[ONE_RANK, &["--save-every", "3", "--save-total-limit", "2", "--resume", from.to_str().unwrap()]].concat()));
    assert!(log.contains("at step 3"), "{log}");
    assert_eq!(summary(dir.path())["run_id"], other_id.as_str(), "a resumed run continues its checkpoint's run");
    let kept: Vec<(u64, String)> = checkpoints(dir.path()).into_iter().map(|(step, c)| (step, manifest(&c)["run_id"].as_str().unwrap().to_string())).collect();
    let expected: Vec<(u64, String)> =
        [(7, &first_id), (9, &other_id), (12, &other_id), (14, &first_id), (21, &first_id), (24, &first_id)].map(|(s, id)| (s, id.clone())).to_vec();
    assert_eq!(kept, expected);
    let exported = ft()
        .args(["export", "--checkpoint", "latest", "--output-dir", dir.path().to_str().unwrap(), "--out", dir.path().join("exported").to_str().unwrap()])
        .output()
        .unwrap();
    assert!(text(&exported).contains("exported step 12"), "latest is the newest save: {}", text(&exported));
}

/// TensorBoard's own reader: each step's loss as it shows them, [step, value].
fn tensorboard_losses(dir: &Path) -> Vec<(u64, f64)> {
    let python = Path::new(env!("CARGO_MANIFEST_DIR")).join(".venv/bin/python");
    let script = "import json, sys\n\
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator\n\
ea = EventAccumulator(sys.argv[1]); ea.Reload()\n\
print(json.dumps([[e.step, e.value] for e in ea.Scalars('loss')]))";
    let output = Command::new(python).args(["-c", script, dir.join("tensorboard").to_str().unwrap()]).output().unwrap();
    assert!(output.status.success(), "{}", text(&output));
    serde_json::from_slice(&output.stdout).unwrap()
}

#[test]
fn sigterm_to_the_launcher_saves_the_step_every_rank_agrees_on_and_the_resumed_run_repeats_none() {
    let whole = tempfile::tempdir().unwrap();
    succeeded(run(whole.path(), TWO_RANKS));
    let expected = losses(whole.path());
    assert_eq!(expected.len() as u64, STEPS);

    let dir = tempfile::tempdir().unwrap();
    let mut child = start(&mut common::train_command(dir.path(), TWO_RANKS));
    wait_until("3 steps are logged", &mut child, || steps(dir.path()).len() >= 3);
    send("TERM", child.id());
    let output = child.wait_with_output().unwrap();
    let log = text(&output);
    assert_eq!(output.status.code(), Some(SAVED_AND_STOPPED), "{log}");
    assert!(log.contains("ft launch: SIGTERM: passed on to the ranks, which save a checkpoint and stop"), "{log}");
    let last = *steps(dir.path()).last().unwrap();
    assert!(last < STEPS, "the signal came mid-epoch: {last}");
    let saved = checkpoints(dir.path());
    assert_eq!(saved.last().unwrap().0, last, "the last step trained is saved: {saved:?}");
    let stopped = format!("stopped by SIGTERM after step {last}: saved checkpoint {}", saved.last().unwrap().1.display());
    assert!(log.contains(&stopped) && log.contains("--resume latest"), "{log}");

    succeeded(run(dir.path(), &[TWO_RANKS, &["--resume", "latest"]].concat()));
    assert_eq!(steps(dir.path()), (1..=STEPS).collect::<Vec<_>>(), "every step once");
    assert_eq!(losses(dir.path()), expected, "the interrupted and resumed run trains as the uninterrupted one");
    // TensorBoard drops what the first part wrote after its checkpoint (purge_step): every step once, the same losses.
    let shown = tensorboard_losses(dir.path());
    assert_eq!(shown.iter().map(|(step, _)| *step).collect::<Vec<_>>(), (1..=STEPS).collect::<Vec<_>>());
    for ((step, value), loss) in shown.iter().zip(&expected) {
        assert!((value - loss).abs() <= 1e-6 * loss.abs(), "step {step}: {value} vs {loss}");
    }
}

#[test]
fn sigusr1_with_requeue_under_slurm_saves_and_rank_0_requeues_the_job_once() {
    let dir = tempfile::tempdir().unwrap();
    let bin = dir.path().join("bin");
    std::fs::create_dir_all(&bin).unwrap();
    let calls = dir.path().join("scontrol-calls");
    std::fs::write(bin.join("scontrol"), "#!/bin/sh\necho \"rank $RANK: $*\" >> \"$SCONTROL_CALLS\"\n").unwrap();
    assert!(Command::new("chmod").arg("+x").arg(bin.join("scontrol")).status().unwrap().success());
    let out = dir.path().join("run");
    let mut command = common::train_command(&out, &[TWO_RANKS, &["--set", "train.requeue=true"]].concat());
    command
        .env("PATH", format!("{}:{}", bin.display(), std::env::var("PATH").unwrap()))
        .env("SLURM_JOB_ID", "4242")
        .env("SCONTROL_CALLS", &calls);
    let mut child = start(&mut command);
    wait_until("3 steps are logged", &mut child, || steps(&out).len() >= 3);
    send("USR1", child.id());
    let output = child.wait_with_output().unwrap();
    let log = text(&output);
    assert_eq!(output.status.code(), Some(SAVED_AND_STOPPED), "{log}");
    assert_eq!(std::fs::read_to_string(&calls).unwrap(), "rank 0: requeue 4242\n", "{log}");
    assert!(log.contains("requeued Slurm job 4242 (train.requeue)"), "{log}");
    let last = *steps(&out).last().unwrap();
    assert_eq!(checkpoints(&out).last().unwrap().0, last);
}

/// A stopping signal saves and stops a run (exit 75) whatever sets its
/// length — epochs, `--max-steps` past the default epochs, timed saves, a
/// slice of the file — and `--resume latest` trains every step once. The
/// signal comes from inside at a known step (`FT_FAULT_INJECT`), so the
/// saved step is known too: the step after it, where the loop checks.
#[test]
fn a_signal_saves_and_stops_the_run_whatever_bounds_it_and_the_resume_repeats_no_step() {
    // 32 examples in batches of 8 on one rank: 4 steps an epoch (3 for the slice of 24).
    let cases: [(&[&str], &str, u64, u64); 4] = [
        (&["--epochs", "2"], "SIGTERM", 5, 8),
        (&["--max-steps", "20"], "SIGINT", 14, 20),
        (&["--epochs", "2", "--set", "train.save_minutes=0.001"], "SIGUSR2", 2, 8),
        (&["--epochs", "2", "--set", "data.range=0:24", "--set", "train.schedule_steps=6"], "SIGUSR1", 4, 6),
    ];
    for (bound, signal, at, total) in cases {
        let dir = tempfile::tempdir().unwrap();
        let train = |extra: &[&str]| {
            let mut command = ft();
            command.args(["train", "--output-dir", dir.path().to_str().unwrap(), "--train-samples", "32", "--eval-samples", "8"]);
            command.args(["--nproc-per-node", "1", "--batch-size", "8"]).args(bound).args(extra);
            command
        };
        let output = train(&[]).env("FT_FAULT_INJECT", format!("after-step:{at}:{signal}")).output().unwrap();
        let log = text(&output);
        let case = format!("{bound:?} {signal}");
        assert_eq!(output.status.code(), Some(SAVED_AND_STOPPED), "{case}: {log}");
        let saved = checkpoints(dir.path()).last().unwrap().clone();
        assert_eq!(saved.0, at + 1, "{case}: the step after the signal is saved: {log}");
        assert!(log.contains(&format!("stopped by {signal} after step {}", at + 1)), "{case}: {log}");
        assert!(!log.contains("after the run's last step"), "{case}: {log}");
        succeeded(train(&["--resume", "latest"]).output().unwrap());
        assert_eq!(steps(dir.path()), (1..=total).collect::<Vec<_>>(), "{case}: every step once");
    }
}

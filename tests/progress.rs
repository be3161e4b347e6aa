//! Progress wherever a run is watched: with stderr to a file (Slurm's log,
//! a notebook) rank 0 logs a line for the first step, each epoch's end and
//! the last step (and at most every `train.log_seconds` between them) with
//! the step, loss, learning rate, throughput, memory and ETA, while the
//! metrics files get every `train.log_every`th step; on a terminal at
//! two ranks the launcher draws rank 0's bar (the ranks' own stderr is its
//! pipe) and never prints the lines rank 0 sends it.

use crate::common;

use common::{ft, text, without_launcher_env, FT};
use std::process::{Command, Stdio};

/// The demo, 12 steps at two ranks (96 examples, 2 × 4 a step), a record every 4.
const RUN: &[&str] = &["train", "--epochs", "1", "--train-samples", "96", "--eval-samples", "8", "--batch-size", "4", "--set", "train.log_every=4"];
const TWO_RANKS: &[&str] = &["--nproc-per-node", "2"];

/// The protocol's marker, which must never reach the user.
const UPDATE_MARKER: &str = "ft-progress";

#[test]
fn a_log_file_gets_a_progress_line_at_the_first_step_each_epochs_end_and_the_last() {
    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("stderr.log");
    let output = ft()
        .args(RUN)
        .args(TWO_RANKS)
        .args(["--epochs", "2", "--train-samples", "48"])
        .args(["--output-dir", dir.path().join("run").to_str().unwrap()])
        .stderr(Stdio::from(std::fs::File::create(&log).unwrap()))
        .output()
        .unwrap();
    let log = std::fs::read_to_string(&log).unwrap();
    assert!(output.status.success(), "{}{log}", text(&output));
    assert!(!log.contains(UPDATE_MARKER), "{log}");
    let lines: Vec<&str> = log.lines().filter(|line| line.contains("[rank 0]") && line.contains(" step ") && line.contains("ETA")).collect();
    let mut steps = vec![];
    for line in &lines {
        let after = |key: &str| line.split(key).nth(1).and_then(|rest| rest.split([',', ' ']).find(|word| !word.is_empty())).unwrap_or_else(|| panic!("no {key:?} in {line}"));
        let (step, total) = after(" step ").split_once('/').unwrap_or_else(|| panic!("step N/TOTAL in {line}"));
        assert_eq!(total, "12", "{line}");
        steps.push(step.parse::<usize>().unwrap());
        // The first line comes before the first record (step 4): no loss is reduced for it.
        if step == "1" {
            assert!(line.contains("loss not yet logged"), "{line}");
        } else {
            let loss: f64 = after(" loss ").parse().unwrap_or_else(|_| panic!("a loss in {line}"));
            assert!(loss.is_finite() && loss > 0.0, "{line}");
        }
        for key in [" epoch ", " lr ", " tokens/s/rank", " memory ", " elapsed ", " ETA "] {
            assert!(line.contains(key), "no {key:?} in {line}");
        }
    }
    // 6 steps an epoch; a line 30 s after the last could add one, on a machine slower than any.
    assert_eq!(steps, [1, 6, 12], "{log}");
    // The metrics file keeps its own pace: every 4th step and each epoch's end.
    assert_eq!(common::losses(&dir.path().join("run")).len(), 4, "steps 4, 6, 8 and 12");
}

#[test]
fn a_terminal_shows_the_launchers_bar_at_two_ranks() {
    let quoted = |args: &[&str]| args.iter().map(|arg| format!("'{arg}'")).collect::<Vec<_>>().join(" ");
    // `ft train` starting its own ranks, and `ft launch` starting them.
    let started_by_train = [RUN, TWO_RANKS].concat();
    let launched = [&["launch"], TWO_RANKS, &["--"], RUN].concat();
    for run in [started_by_train, launched] {
        let dir = tempfile::tempdir().unwrap();
        let command = format!("'{FT}' {} --output-dir '{}'", quoted(&run), dir.path().join("run").display());
        // script(1) runs the command on a pseudo-terminal and copies what it shows to stdout.
        let mut script = Command::new("script");
        let output = without_launcher_env(&mut script).args(["-qfec", &command, "/dev/null"]).stdin(Stdio::null()).output().unwrap();
        let shown = text(&output);
        assert!(output.status.success(), "{command}: {shown}");
        assert!(shown.contains("/12 steps") && shown.contains("loss ") && shown.contains('█'), "{command}: no progress bar:\n{shown}");
        assert!(!shown.contains(UPDATE_MARKER), "{shown}");
        // Rank 0 logs for the job (rank 1 has nothing of its own to say here).
        assert!(shown.contains("[rank 0] ") && shown.contains("== ft train summary =="), "the ranks' lines are still shown:\n{shown}");
    }
}

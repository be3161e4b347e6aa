//! `ft train` end to end over real processes: determinism, gradient
//! accumulation and data parallelism against the single-batch baseline, data
//! slices resumed one after another, and the SQuAD loader on the shared real
//! data (the embedded demo's whole run is tests/demo.rs).

use serde_json::Value;
use std::path::{Path, PathBuf};
use std::process::Output;
use std::sync::OnceLock;

use crate::common;
use common::{ft, losses, made_once, shared, text};

/// Runs the demo's data and model with `extra` flags into `dir`; returns each step's loss.
fn train(dir: &Path, extra: &[&str]) -> Vec<f64> {
    let output = common::train_command(dir, extra).output().unwrap();
    assert!(output.status.success(), "{}", text(&output));
    losses(dir)
}

fn assert_close(a: &[f64], b: &[f64], tolerance: f64) {
    assert_eq!(a.len(), b.len(), "{a:?} vs {b:?}");
    assert!(a.len() >= 5, "too few steps to compare: {a:?}");
    for (step, (x, y)) in a.iter().zip(b).enumerate() {
        assert!((x - y).abs() <= tolerance * y.abs(), "step {}: {x} vs {y}", step + 1);
    }
}

/// The demo trained with `flags` into `dir`, trained once however many
/// tests ask (`made` is the caller's cell for those flags); returns each
/// step's loss.
fn trained_once(made: &'static OnceLock<Vec<(PathBuf, Vec<u8>)>>, dir: &Path, flags: &[&str]) -> Vec<f64> {
    made_once(made, dir, |scratch| {
        train(scratch, flags);
    });
    losses(dir)
}

/// Flags of two ranks of 4, saving every 6 steps (the checkpoints change
/// nothing the run computes).
const TWO_RANKS_OF_4: &[&str] = &["--nproc-per-node", "2", "--batch-size", "4", "--save-every", "6"];
/// Flags of one rank with the whole batch of 8, saving every 6 steps.
const ONE_RANK_OF_8: &[&str] = &["--nproc-per-node", "1", "--batch-size", "8", "--save-every", "6"];

/// Two ranks of 4 in `dir`: five tests' run.
fn two_ranks_of_4(dir: &Path) -> Vec<f64> {
    static MADE: OnceLock<Vec<(PathBuf, Vec<u8>)>> = OnceLock::new();
    trained_once(&MADE, dir, TWO_RANKS_OF_4)
}

/// One rank with the whole batch of 8 in `dir`: four tests' run.
fn one_rank_of_8(dir: &Path) -> Vec<f64> {
    static MADE: OnceLock<Vec<(PathBuf, Vec<u8>)>> = OnceLock::new();
    trained_once(&MADE, dir, ONE_RANK_OF_8)
}

/// The losses of `two_ranks_of_4`, or another shared run, for a test that needs no directory of it.
fn losses_of(run: fn(&Path) -> Vec<f64>) -> Vec<f64> {
    run(tempfile::tempdir().unwrap().path())
}

#[test]
fn same_seed_gives_bit_identical_losses() {
    let dir = tempfile::tempdir().unwrap();
    let second = train(dir.path(), TWO_RANKS_OF_4);
    assert_eq!(losses_of(two_ranks_of_4), second);
}

#[test]
fn accumulating_four_micro_batches_equals_one_four_times_larger() {
    let dir = tempfile::tempdir().unwrap();
    let accumulated = train(dir.path(), &["--nproc-per-node", "1", "--batch-size", "2", "--grad-accum", "4"]);
    assert_close(&accumulated, &losses_of(one_rank_of_8), 1e-5);
}

#[test]
fn two_data_parallel_ranks_equal_one_rank_with_the_whole_batch() {
    assert_close(&losses_of(two_ranks_of_4), &losses_of(one_rank_of_8), 1e-5);
}

#[test]
fn bad_training_input_is_rejected_with_clear_messages() {
    let dir = tempfile::tempdir().unwrap();
    let run = |args: &[&str]| {
        let mut all = vec!["train", "--output-dir", dir.path().to_str().unwrap()];
        all.extend_from_slice(args);
        text(&ft().args(&all).output().unwrap())
    };
    assert!(run(&["--model", "some/model"]).contains("set data.train (--train-file)"));
    assert!(run(&["--batch-size", "0"]).contains("must be at least 1"));
    assert!(run(&["--dtype", "fp8"]).contains("unknown dtype \"fp8\": expected auto, f32"));
    let bad = dir.path().join("bad.json");
    std::fs::write(&bad, "[1, 2").unwrap();
    let message = run(&["--train-file", bad.to_str().unwrap(), "--nproc-per-node", "1"]);
    assert!(message.contains("bad.json is not valid JSON"), "{message}");
    let message = run(&["--train-samples", "3", "--nproc-per-node", "1", "--batch-size", "8"]);
    assert!(message.contains("3 training examples do not fill one global batch of 8"), "{message}");
    let plan = run(&["--dry-run", "--grad-accum", "2", "--batch-size", "8"]);
    assert!(plan.contains("global batch 32") && plan.contains("\"source\": \"demo\""), "{plan}");
    assert!(run(&["--profile-steps", "3:2"]).contains("the first comes before or is the last"));
    assert!(run(&["--profile-steps", "two"]).contains("is not FIRST:LAST"));
    // Slices: a malformed range names the key, one outside the file says how
    // many examples the file has, and a slice asks how long the schedule is.
    let message = run(&["--set", "data.range=9:3"]);
    assert!(message.contains("config key `data.range`") && message.contains("END (3) must be greater than START (9)"), "{message}");
    let message = run(&["--set", "data.range=100000:", "--nproc-per-node", "1"]);
    assert!(message.contains("data.range 100000: is not within ") && message.contains("demo-train.json: it has 1597 questions"), "{message}");
    let message = run(&["--set", "data.range=0:48", "--nproc-per-node", "1"]);
    assert!(message.contains("set train.schedule_steps to the optimizer steps of all slices together"), "{message}");

    // Numbers that do not fit together: one line naming the file, the keys and the rule.
    let config = dir.path().join("three-heads.json");
    let json = serde_json::json!({"model_type": "bloom", "hidden_size": 64, "n_layer": 2, "n_head": 3, "vocab_size": 128});
    std::fs::write(&config, json.to_string()).unwrap();
    // Both are refused before any data or tokenizer is read.
    let squad = dir.path().join("squad.json");
    std::fs::write(&squad, r#"{"data": []}"#).unwrap();
    let model_args = ["--train-file", squad.to_str().unwrap(), "--tokenizer", "tokenizer.json", "--nproc-per-node", "1"];
    let message = run(&[&["--model", config.to_str().unwrap()][..], &model_args].concat());
    let expected = format!("error: {} (bloom): hidden_size (64) must be a multiple of n_head (3)\n", config.display());
    assert!(message.contains(&expected) && !message.contains("panicked"), "{message}");
    // A window longer than OPT's learned positions, refused before any data is read.
    let opt = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/opt");
    let message = run(&[&["--model", opt.to_str().unwrap(), "--max-seq-len", "128"][..], &model_args].concat());
    let expected = "data.max_seq_len (128) is longer than this opt model's max_position_embeddings (64, in its config.json)";
    assert!(message.contains(expected), "{message}");
}

#[test]
fn profiled_steps_leave_a_trace_and_a_table_of_op_times() {
    let dir = tempfile::tempdir().unwrap();
    let output = common::train_command(dir.path(), &["--profile-steps", "2:3", "--nproc-per-node", "1"]).output().unwrap();
    assert!(output.status.success(), "{}", text(&output));
    let profile = dir.path().join("profile");
    let trace: Value = serde_json::from_str(&std::fs::read_to_string(profile.join("steps-2-3.trace.json")).unwrap()).unwrap();
    // Exactly steps 2 and 3: one embedding lookup per forward, one AdamW call per parameter group
    // (decayed and not) per step.
    let calls = |name: &str| trace["traceEvents"].as_array().unwrap().iter().filter(|e| e["name"] == name && e["ph"] == "X").count();
    assert_eq!((calls("aten::embedding"), calls("aten::_fused_adamw_")), (2, 4));
    let table = std::fs::read_to_string(profile.join("steps-2-3.kernels.tsv")).unwrap();
    let rows: Vec<Vec<&str>> = table.lines().skip(1).map(|l| l.split('\t').collect()).collect();
    assert!(rows.len() > 10 && rows.iter().all(|r| r.len() == 4), "{table}");
    assert!(text(&output).contains("profile of steps 2-3"), "{}", text(&output));
}

#[test]
fn squad_reader_takes_the_shared_v2_file_and_a_v1_file() {
    if shared::skipped_without(&[shared::SQUAD]) {
        return;
    }
    let squad = shared::path(shared::SQUAD);
    let (examples, stats) = ft_data::squad::read(&squad, false, None).unwrap();
    assert_eq!((stats.articles, stats.questions), (5, 1407));
    assert_eq!(examples.len() + stats.unanswerable_skipped + stats.bad_offsets_skipped, 1407);
    assert_eq!(stats.unanswerable_skipped, 1407 - 705);
    let (with_unanswerable, _) = ft_data::squad::read(&squad, true, None).unwrap();
    assert_eq!(with_unanswerable.len(), 1407 - stats.bad_offsets_skipped);

    // The same data in v1.1's layout: no is_impossible, answerable questions only.
    let mut v1: Value = serde_json::from_str(&std::fs::read_to_string(&squad).unwrap()).unwrap();
    v1["version"] = "1.1".into();
    for article in v1["data"].as_array_mut().unwrap() {
        for paragraph in article["paragraphs"].as_array_mut().unwrap() {
            let qas = paragraph["qas"].as_array_mut().unwrap();
            qas.retain(|qa| !qa["is_impossible"].as_bool().unwrap_or(false));
            for qa in qas.iter_mut() {
                qa.as_object_mut().unwrap().remove("is_impossible");
            }
        }
    }
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("v1.json");
    std::fs::write(&path, v1.to_string()).unwrap();
    let (v1_examples, v1_stats) = ft_data::squad::read(&path, false, None).unwrap();
    assert_eq!(v1_stats.questions, 705);
    assert_eq!(v1_examples, examples);
}

const CHECKPOINTED: &[&str] = &["--nproc-per-node", "2", "--batch-size", "4", "--save-every", "3", "--save-total-limit", "0"];

/// Makes `run` in `dir`, then exports its latest checkpoint to `dir/exported`.
fn train_and_export(dir: &Path, run: fn(&Path) -> Vec<f64>) -> PathBuf {
    run(dir);
    let exported = dir.join("exported");
    let output = export_latest(dir, &exported);
    assert!(output.status.success(), "{}", text(&output));
    exported
}

/// `ft export` of the latest checkpoint in `dir` to `out`.
fn export_latest(dir: &Path, out: &Path) -> Output {
    ft()
        .args(["export", "--checkpoint", "latest", "--output-dir", dir.to_str().unwrap(), "--out", out.to_str().unwrap()])
        .output()
        .unwrap()
}

fn crash(dir: &Path, point: &str) {
    let output = common::train_command(dir, CHECKPOINTED).env("FT_FAULT_INJECT", point).output().unwrap();
    assert!(!output.status.success(), "the injected crash did not happen: {}", text(&output));
    assert!(text(&output).contains("FT_FAULT_INJECT: aborting"), "{}", text(&output));
}

fn steps_saved(dir: &Path) -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(dir.join("checkpoints"))
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    names
}

#[test]
fn a_killed_run_resumes_to_the_same_losses_and_a_crash_mid_save_keeps_the_last_checkpoint() {
    // The uninterrupted run: checkpoints change nothing it computes.
    let expected = losses_of(two_ranks_of_4);
    assert_eq!(expected.len(), 12);

    // Killed right after step 7: the checkpoint of step 6 is the latest — or,
    // when its files (written in the background) were not all done by then,
    // the one of step 3, the last finished, intact either way.
    let killed = tempfile::tempdir().unwrap();
    crash(killed.path(), "after-step:7");
    let finished: Vec<String> = steps_saved(killed.path()).into_iter().filter(|n| !n.starts_with('.')).collect();
    let from = match finished.as_slice() {
        [three, six] if three == "step-00000003" && six == "step-00000006" => 6,
        [three] if three == "step-00000003" => 3,
        other => panic!("checkpoints after the crash: {other:?}"),
    };
    let mut resumed = CHECKPOINTED.to_vec();
    resumed.extend(["--resume", "latest"]);
    let all = train(killed.path(), &resumed);
    // Steps 1 to the checkpoint's from the first run (its records after it dropped), the rest resumed.
    assert_eq!(all, expected, "resumed from step {from}, the losses differ from the uninterrupted run");

    // A crash between writing checkpoint 9 and renaming it into place.
    let torn = tempfile::tempdir().unwrap();
    crash(torn.path(), "checkpoint-before-rename:9");
    let names = steps_saved(torn.path());
    assert!(names.contains(&"step-00000006".to_string()) && !names.contains(&"step-00000009".to_string()), "{names:?}");
    assert!(names.iter().any(|n| n.starts_with(".step-00000009.tmp")), "the partial save stays hidden: {names:?}");
    let exported = torn.path().join("exported");
    let output = export_latest(torn.path(), &exported);
    assert!(text(&output).contains("exported step 6"), "{}", text(&output));
    let all = train(torn.path(), &resumed);
    assert_eq!(all, expected);
}

/// Each optimizer step's number, loss and learning rate in `dir`'s metrics.jsonl.
fn step_records(dir: &Path) -> Vec<(u64, f64, f64)> {
    std::fs::read_to_string(dir.join("metrics.jsonl"))
        .unwrap()
        .lines()
        .map(|line| serde_json::from_str::<Value>(line).unwrap())
        .filter(|record| record.get("loss").is_some())
        .map(|record| (record["step"].as_u64().unwrap(), record["loss"].as_f64().unwrap(), record["lr"].as_f64().unwrap()))
        .collect()
}

/// The issue's slice workflow: `data.range` slices of the training file, each
/// resumed from the last one's checkpoint, train to the same bits as one run
/// over them — losses, learning rates and final weights (CPU, f32).
/// The examples go in file order (`data.shuffle=false`): one run's epoch
/// over 0:96 then visits 0:48 before 48:96, as the slices do, where a
/// shuffle would mix the halves. The schedule (the demo's linear decay with
/// a warm-up ratio) spans both slices (`train.schedule_steps` 12), so it is
/// checked to continue across them. The second slice is also killed and
/// resumed with its own range, which continues it mid-epoch.
#[test]
fn slices_resumed_one_after_the_other_train_as_one_run_over_them() {
    let flags = |range: &str| -> Vec<String> {
        let fixed = ["--nproc-per-node", "2", "--batch-size", "4", "--set", "data.shuffle=false", "--set", "train.schedule_steps=12"];
        let mut flags: Vec<String> = fixed.iter().map(|f| f.to_string()).collect();
        flags.extend(["--set".into(), format!("data.range={range}"), "--save-every".into(), "2".into(), "--save-total-limit".into(), "0".into()]);
        flags
    };
    let command = |dir: &Path, range: &str, extra: &[&str]| {
        let flags = flags(range);
        let mut all: Vec<&str> = flags.iter().map(String::as_str).collect();
        all.extend(extra);
        common::train_command(dir, &all)
    };
    let run = |dir: &Path, range: &str, extra: &[&str]| command(dir, range, extra).output().unwrap();
    let succeeded = |output: Output| {
        let log = text(&output);
        assert!(output.status.success(), "{log}");
        log
    };
    let whole = tempfile::tempdir().unwrap();
    succeeded(run(whole.path(), "0:96", &[]));
    let expected = step_records(whole.path());
    assert_eq!(expected.len(), 12);

    let sliced = tempfile::tempdir().unwrap();
    succeeded(run(sliced.path(), "0:48", &[]));
    assert_eq!(step_records(sliced.path()), expected[..6], "the first slice is the first half of the one run");
    // Resumed with its own range, the finished first slice has nothing left.
    let log = succeeded(run(sliced.path(), "0:48", &["--resume", "latest"]));
    assert!(log.contains("nothing left to train: checkpoint step-00000006 already completed 1 epoch(s)"), "{log}");

    // The second slice starts at its first example, and is killed after step 11.
    let killed = command(sliced.path(), "48:96", &["--resume", "latest"]).env("FT_FAULT_INJECT", "after-step:11").output().unwrap();
    let log = text(&killed);
    assert!(!killed.status.success() && log.contains("FT_FAULT_INJECT: aborting"), "{log}");
    let switched = "this run trains another slice than the checkpoint (data.range 48:96 after 0:48): it starts at the slice's first example, \
                    epoch 1, and continues the weights, optimizer state, step count and learning-rate schedule from step 6";
    assert!(log.contains(switched), "{log}");
    // Checkpoint 8 is finished before checkpoint 10 starts; 10 may still be in flight.
    let finished: Vec<String> = steps_saved(sliced.path()).into_iter().filter(|n| !n.starts_with('.')).collect();
    let from = match finished.last().map(String::as_str) {
        Some("step-00000010") => 10,
        Some("step-00000008") => 8,
        other => panic!("the latest checkpoint after the crash: {other:?} of {finished:?}"),
    };
    let log = succeeded(run(sliced.path(), "48:96", &["--resume", "latest"]));
    assert!(!log.contains("another slice"), "the same range continues mid-slice: {log}");

    // Slice two continues the step count, schedule and training of slice one, and resumed mid-epoch from step `from`, repeats no step.
    assert_eq!(step_records(sliced.path()), expected, "resumed from step {from}");
    let final_weights = |dir: &Path| -> std::collections::HashMap<String, tch::Tensor> {
        tch::Tensor::read_safetensors(dir.join("final/model.safetensors")).unwrap().into_iter().collect()
    };
    let (by_slices, by_one_run) = (final_weights(sliced.path()), final_weights(whole.path()));
    assert_eq!(by_slices.len(), by_one_run.len());
    for (name, weight) in &by_slices {
        assert!(weight.equal(&by_one_run[name]), "{name}: the slices' final weights differ from the one run's");
    }
}

#[test]
fn resuming_a_finished_run_says_so_in_one_line_and_exits_0() {
    let dir = tempfile::tempdir().unwrap();
    assert_eq!(one_rank_of_8(dir.path()).len(), 12);
    let output = common::train_command(dir.path(), &[ONE_RANK_OF_8, &["--resume", "latest"]].concat()).output().unwrap();
    let log = text(&output);
    assert!(output.status.success(), "{log}");
    assert!(log.contains("nothing left to train: checkpoint step-00000012 already completed 1 epoch(s) and train.epochs is 1"), "{log}");
    assert!(!log.contains("ft train summary") && !log.contains("NaN"), "no summary of a run that trained nothing: {log}");
}

#[test]
fn export_and_eval_reproduce_the_run() {
    let dir = tempfile::tempdir().unwrap();
    let exported = train_and_export(dir.path(), two_ranks_of_4);
    // The exported checkpoint of the last step holds the final weights.
    let final_weights = tch::Tensor::read_safetensors(dir.path().join("final/model.safetensors")).unwrap();
    let exported_weights: std::collections::HashMap<String, tch::Tensor> =
        tch::Tensor::read_safetensors(exported.join("model.safetensors")).unwrap().into_iter().collect();
    for (name, tensor) in &final_weights {
        assert!(tensor.equal(&exported_weights[name]), "{name}");
    }

    let summary: Value = serde_json::from_str(&std::fs::read_to_string(dir.path().join("summary.json")).unwrap()).unwrap();
    let last_eval_loss = summary["epochs"][0]["eval_loss"].as_f64().unwrap();
    let eval_file = dir.path().join("demo-data/demo-eval.json");
    let output = ft()
        .args(["eval", "--model", exported.to_str().unwrap(), "--eval-file", eval_file.to_str().unwrap(),
               "--eval-samples", "8", "--max-seq-len", "96", "--nproc-per-node", "2",
               "--output-dir", dir.path().join("eval").to_str().unwrap()])
        .output()
        .unwrap();
    let log = text(&output);
    assert!(output.status.success(), "{log}");
    let reported: f64 = log.split("eval loss ").nth(1).unwrap().split_whitespace().next().unwrap().parse().unwrap();
    assert!((reported - last_eval_loss).abs() < 1e-4, "{reported} vs {last_eval_loss}");
    assert!(log.contains(", em ") && log.contains(", f1 "), "{log}");
    assert!(dir.path().join("eval/predictions.json").exists());

    // Batches of 16 left-padded prompts answer exactly as one prompt at a time.
    let predictions = |batch: &str| -> Value {
        let out = dir.path().join(format!("eval-batch-{batch}"));
        let output = ft()
            .args(["eval", "--model", exported.to_str().unwrap(), "--eval-file", eval_file.to_str().unwrap(), "--eval-samples", "40"])
            .args(["--max-seq-len", "96", "--nproc-per-node", "1", "--batch-size", batch, "--output-dir", out.to_str().unwrap()])
            .output()
            .unwrap();
        assert!(output.status.success(), "{}", text(&output));
        serde_json::from_str(&std::fs::read_to_string(out.join("predictions.json")).unwrap()).unwrap()
    };
    let (one, sixteen) = (predictions("1"), predictions("16"));
    assert_eq!(one.as_object().unwrap().len(), 40);
    assert_eq!(one, sixteen);
}

#[test]
fn an_exported_model_loads_in_transformers_with_equal_logits() {
    let dir = tempfile::tempdir().unwrap();
    let exported = train_and_export(dir.path(), one_rank_of_8);

    let ids: Vec<Vec<i64>> = vec![vec![5, 17, 42, 99, 3, 250, 7, 64, 12, 300]];
    let ids_file = dir.path().join("ids.json");
    std::fs::write(&ids_file, serde_json::to_string(&ids).unwrap()).unwrap();
    let ours = dir.path().join("ft-logits.safetensors");
    let output = ft()
        .args(["forward", "--model", exported.to_str().unwrap(), "--ids", ids_file.to_str().unwrap(), "--out", ours.to_str().unwrap()])
        .output()
        .unwrap();
    assert!(output.status.success(), "{}", text(&output));

    // transformers' logits (fp32, eval mode): peft_reference.py's `--logits`, in the binary's one process of it.
    let theirs = dir.path().join("transformers");
    common::reference_job("peft_reference.py", &["--logits".as_ref(), exported.as_os_str(), ids_file.as_os_str(), theirs.as_os_str()]);
    let logits = |file: &Path| tch::Tensor::read_safetensors(file).unwrap().into_iter().find(|(name, _)| name == "logits").unwrap().1.to_kind(tch::Kind::Float);
    let (ours, theirs) = (logits(&ours), logits(&theirs.join("reference.safetensors")));
    let error = (&ours - &theirs).abs().max().double_value(&[]) / theirs.abs().max().double_value(&[]);
    assert!(error < 1e-5, "transformers' logits differ from ft's by {error:e}");
}

#[test]
fn flags_without_a_command_are_train_and_ft_alone_leads_with_the_demo() {
    let help = text(&ft().output().unwrap());
    assert!(help.starts_with("Start here: `ft train` fine-tunes the embedded demo"), "{help}");
    // The demo's time is README's measured one.
    let readme = std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("README.md")).unwrap();
    let measured = readme.split("`ft-output/`. About ").nth(1).and_then(|rest| rest.split(';').next()).expect("README says how long the demo takes");
    assert!(help.contains(&format!("about {measured})")), "README: about {measured}; ft: {help}");
    let dir = tempfile::tempdir().unwrap();
    let output = ft().args(["--strategy", "hybrid_shard", "--offload", "cpu", "--dry-run", "--output-dir", dir.path().to_str().unwrap()]).output().unwrap();
    let plan = text(&output);
    assert!(output.status.success(), "{plan}");
    assert!(plan.contains("strategy hybrid_shard") && plan.contains("\"offload\": \"cpu\""), "{plan}");
}

#[test]
fn early_stopping_and_the_best_checkpoints_follow_the_monitored_score() {
    let summary = |dir: &Path| -> Value { serde_json::from_str(&std::fs::read_to_string(dir.join("summary.json")).unwrap()).unwrap() };
    // No improvement can reach min_delta: the run stops after patience (1) more evaluation.
    let stopped = tempfile::tempdir().unwrap();
    let monitored = ["--set", "train.monitor=eval_loss", "--set", "train.early_stopping_patience=1"];
    train(stopped.path(), &[&monitored[..], &["--epochs", "5", "--set", "train.early_stopping_min_delta=1000"]].concat());
    let s = summary(stopped.path());
    assert_eq!((s["epochs"].as_array().unwrap().len(), s["stopped_early_after_epoch"].as_u64()), (2, Some(2)), "{s}");

    // The best epoch by eval loss keeps its checkpoint beside the newest one.
    let best = tempfile::tempdir().unwrap();
    let flags = ["--epochs", "4", "--save-every", "3", "--save-total-limit", "1", "--set", "train.monitor=eval_loss", "--set", "train.save_best=1"];
    train(best.path(), &flags);
    let s = summary(best.path());
    let epochs = s["epochs"].as_array().unwrap();
    let eval_losses: Vec<f64> = epochs.iter().map(|e| e["eval_loss"].as_f64().unwrap()).collect();
    let best_epoch = (0..eval_losses.len()).min_by(|&a, &b| eval_losses[a].total_cmp(&eval_losses[b])).unwrap() + 1;
    let kept: Value = serde_json::from_str(&std::fs::read_to_string(best.path().join("checkpoints/best.json")).unwrap()).unwrap();
    assert_eq!(kept[0]["epoch"].as_u64(), Some(best_epoch as u64), "{kept} vs {eval_losses:?}");
    assert_eq!(s["best_checkpoint"]["epoch"], kept[0]["epoch"]);
    let dir = Path::new(kept[0]["dir"].as_str().unwrap());
    assert!(dir.join("manifest.json").is_file(), "the best checkpoint is kept");
    let steps = s["optimizer_steps"].as_u64().unwrap();
    let mut names: Vec<String> = std::fs::read_dir(best.path().join("checkpoints")).unwrap().map(|e| e.unwrap().file_name().into_string().unwrap()).collect();
    names.sort();
    let newest = names.iter().rfind(|n| n.starts_with("step-")).unwrap().clone();
    assert_eq!(newest, format!("step-{steps:08}"), "the run's last step is saved and kept for resuming: {names:?}");
    assert!(names.iter().filter(|n| n.starts_with("step-")).count() <= 2, "save_total_limit 1 plus the best: {names:?}");
    // The learning rate is recorded at every step.
    let records = std::fs::read_to_string(best.path().join("metrics.jsonl")).unwrap();
    assert_eq!(records.lines().filter(|l| l.contains("\"lr\"")).count() as u64, steps);
}

#[test]
fn stray_ft_variables_are_ignored_and_section_keys_are_read() {
    let dir = tempfile::tempdir().unwrap();
    let output = ft()
        .args(["train", "--dry-run", "--output-dir", dir.path().to_str().unwrap()])
        .env("FT_CHART_FONT", "/no/such/font.ttf")
        .env("FT_KERNELS", "aten")
        .env("FT_SOMETHING_ELSE", "1")
        .env("FT_TRAIN__LR", "0.25")
        .output()
        .unwrap();
    let plan = text(&output);
    assert!(output.status.success(), "{plan}");
    assert!(plan.contains("\"lr\": 0.25"), "FT_TRAIN__LR sets train.lr: {plan}");
    let output = ft().arg("list").env("FT_CHART_FONT", "x").env("FT_DIST__BAKEND", "gloo").output().unwrap();
    assert!(!output.status.success() && text(&output).contains("unknown config key `dist.bakend`"), "a misspelt key is still an error");
}

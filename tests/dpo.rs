//! The `dpo` task against TRL 1.16's DPOTrainer (tests/python/dpo_reference.py):
//! on a random tiny Llama with GPT-2's tokenizer and the Llama 3 chat
//! template (f32, CPU), every loss type's loss, gradient norm and TRL's six
//! figures (`rewards/*`, `logps/*`) equal TRL's at each of two steps to
//! 1e-5 (relative above 1), for standard, conversational and implicit-prompt
//! pairs, a list of losses with weights, and TRL's `keep_end` truncation,
//! and so do the evaluation's loss and figures on an evaluation file;
//! a frozen copy of the model as the reference run with each step equals
//! TRL's `ref_model`; padded pairs equal padding-free ones; 2 ranks over
//! Gloo equal 1; LoRA's base run with every step, and the frozen copy
//! sharded or in host memory, equal the precomputed reference; a resumed
//! run reuses its reference log-probabilities, or builds its frozen copy
//! again, which no checkpoint holds; the summary says what each rank holds
//! for the reference; Parquet, Arrow and JSON arrays
//! give the pairs JSON lines give; bad preference rows are errors naming the
//! file and line; `ft eval --task dpo` of a trained model equals the
//! training run's last evaluation.

use crate::common;

use common::{ft, shared, text};
use serde_json::{json, Value};
use std::path::{Path, PathBuf};
use std::process::Command;

/// TRL's default β, which every run here keeps.
const BETA: f64 = 0.1;

const FIGURES: [&str; 8] = ["loss", "grad_norm", "rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen", "logps/rejected"];

fn message(role: &str, content: &str) -> Value {
    json!({"role": role, "content": content})
}

/// Writes `rows` as JSON lines to `dir`/`name`.
fn jsonl(dir: &Path, name: &str, rows: &[Value]) -> PathBuf {
    let path = dir.join(name);
    std::fs::write(&path, rows.iter().map(|row| row.to_string() + "\n").collect::<String>()).unwrap();
    path
}

/// Four pairs of each format: standard strings, conversations with their prompt, and conversations sharing it.
fn preference_files(dir: &Path) -> [PathBuf; 3] {
    let standard = [
        ("The capital of France is", " Paris.", " Berlin, which is in Germany."),
        ("Two plus two equals", " four.", " five"),
        ("The sky is", " blue on a clear day.", " green."),
        ("Water boils at", " 100 degrees Celsius at sea level.", " 50 degrees."),
    ];
    let standard: Vec<Value> = standard.iter().map(|(p, c, r)| json!({"prompt": p, "chosen": c, "rejected": r})).collect();
    let turns = [
        (vec![message("user", "What is the capital of France?")], "Paris.", "Berlin, I think."),
        (vec![message("system", "Be brief."), message("user", "2+2?")], "4", "It is five."),
        (vec![message("user", "Capital of Italy?")], "Rome.", "Milan, surely."),
        (vec![message("user", "Opposite of hot?")], "Cold.", "Warm-ish."),
    ];
    let conversational: Vec<Value> =
        turns.iter().map(|(prompt, c, r)| json!({"prompt": prompt, "chosen": [message("assistant", c)], "rejected": [message("assistant", r)]})).collect();
    let implicit: Vec<Value> = turns
        .iter()
        .map(|(prompt, c, r)| {
            let whole = |answer: &str| [prompt.clone(), vec![message("assistant", answer)]].concat();
            json!({"chosen": whole(c), "rejected": whole(r)})
        })
        .collect();
    [jsonl(dir, "standard.jsonl", &standard), jsonl(dir, "conversational.jsonl", &conversational), jsonl(dir, "implicit.jsonl", &implicit)]
}

/// A training run's logged steps (the records with a loss).
fn steps(out: &Path) -> Vec<Value> {
    let metrics = std::fs::read_to_string(out.join("metrics.jsonl")).unwrap();
    metrics.lines().map(|line| serde_json::from_str::<Value>(line).unwrap()).filter(|record| record.get("loss").is_some()).collect()
}

/// A training run's evaluations (the records with an `eval_loss`).
fn evaluations(out: &Path) -> Vec<Value> {
    let metrics = std::fs::read_to_string(out.join("metrics.jsonl")).unwrap();
    metrics.lines().map(|line| serde_json::from_str::<Value>(line).unwrap()).filter(|record| record.get("eval_loss").is_some()).collect()
}

/// `ft train --task dpo` on `data` from `model`: 4 pairs a step, 2 steps,
/// the learning rate constant, with `extra` flags; the run's directory.
fn train(model: &Path, data: &Path, out: &Path, extra: &[&str]) -> std::process::Output {
    ft().args(["train", "--task", "dpo", "--model", model.to_str().unwrap(), "--train-file", data.to_str().unwrap(), "--device", "cpu"])
        .args(["--batch-size", "4", "--max-steps", "2", "--lr", "1e-2", "--set", "train.schedule=constant", "--report-to", "jsonl"])
        .args(["--output-dir", out.to_str().unwrap()])
        .args(extra)
        .output()
        .unwrap()
}

/// Every figure of every step equal to 1e-5 (relative above 1); a reward,
/// β times a difference of two log-probabilities, to 1e-5 of those.
fn assert_equal_steps(ours: &[Value], theirs: &[Value], what: &str) {
    assert_eq!(ours.len(), theirs.len(), "{what}: steps {ours:?} vs {theirs:?}");
    for (step, (ours, theirs)) in ours.iter().zip(theirs).enumerate() {
        assert_equal_figures(ours, theirs, "", &format!("{what}, step {}", step + 1), 1e-5);
    }
}

/// [`assert_equal_steps`] for one record to `tolerance`, its keys named with `prefix` (evaluations': `eval_`).
fn assert_equal_figures(ours: &Value, theirs: &Value, prefix: &str, what: &str, tolerance: f64) {
    let figure = |record: &Value, key: &str| record[format!("{prefix}{key}")].as_f64().unwrap_or_else(|| panic!("{what}: no {prefix}{key} in {record}"));
    let logps = figure(theirs, "logps/chosen").abs().max(figure(theirs, "logps/rejected").abs());
    for key in FIGURES.iter().filter(|key| prefix.is_empty() || **key != "grad_norm") {
        let (a, b) = (figure(ours, key), figure(theirs, key));
        let scale = if key.starts_with("rewards/") && *key != "rewards/accuracies" { BETA * logps } else { b.abs() };
        assert!((a - b).abs() <= tolerance * scale.max(1.0), "{what}: {prefix}{key} {a} vs {b}");
    }
}

#[test]
fn every_loss_equals_trls_dpo_trainer_in_every_format() {
    if shared::skipped_without(&[shared::GPT2_TOKENIZER]) {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let model = common::tiny_chat_llama(dir.path());
    let [standard, conversational, implicit] = preference_files(dir.path());
    // (data, TRL's loss_type, loss_weights, label_smoothing, max_length, truncation_mode, evaluation file, precompute_ref)
    let mut cases: Vec<(&Path, Vec<&str>, Option<Vec<f64>>, f64, usize, &str, Option<&Path>, bool)> = vec![];
    for loss in ["sigmoid", "hinge", "ipo", "exo_pair", "nca_pair", "robust", "bco_pair", "sppo_hard", "apo_zero", "apo_down", "sft", "sigmoid_norm"] {
        let smoothing = match loss {
            "robust" => 0.1,
            "exo_pair" => 1e-3,
            _ => 0.0,
        };
        cases.push((&standard, vec![loss], None, smoothing, 64, "keep_start", None, true));
    }
    // Evaluated after each step (each an epoch) on the implicit-prompt pairs.
    cases.push((&conversational, vec!["sigmoid"], None, 0.0, 64, "keep_start", Some(&implicit), true));
    cases.push((&conversational, vec!["ipo", "sft"], Some(vec![1.0, 0.5]), 0.0, 64, "keep_start", None, true));
    cases.push((&implicit, vec!["sigmoid"], None, 0.0, 64, "keep_start", None, true));
    // Cut to their last 12 tokens (each prompt shortened from the left).
    cases.push((&conversational, vec!["sigmoid"], None, 0.0, 12, "keep_end", None, true));
    // The reference run with each step: TRL's ref_model, ft's frozen copy.
    cases.push((&standard, vec!["sigmoid"], None, 0.0, 64, "keep_start", Some(&implicit), false));
    // The losses over the micro-batch's pairs sorted (AOT, smoothed and not) and DiscoPOP (τ 0.05, TRL's default).
    cases.push((&standard, vec!["aot"], None, 0.1, 64, "keep_start", None, true));
    cases.push((&standard, vec!["aot_unpaired"], None, 0.0, 64, "keep_start", None, true));
    cases.push((&standard, vec!["discopop"], None, 0.0, 64, "keep_start", None, true));
    let references: Vec<Value> = cases
        .iter()
        .map(|(data, losses, weights, smoothing, max_length, truncation, eval, precompute_ref)| {
            json!({"model": model, "data": data, "loss_type": losses, "loss_weights": weights, "beta": BETA, "label_smoothing": smoothing,
                   "max_length": max_length, "truncation_mode": truncation, "batch_size": 4, "steps": 2, "lr": 1e-2, "eval": eval,
                   "precompute_ref": precompute_ref})
        })
        .collect();
    let cases_file = dir.path().join("cases.json");
    std::fs::write(&cases_file, serde_json::to_string(&references).unwrap()).unwrap();
    let trl_out = dir.path().join("trl.json");
    // TRL trains in the background while ft does.
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/python/dpo_reference.py");
    let trl = Command::new("python").arg(&script).args(["run", cases_file.to_str().unwrap(), trl_out.to_str().unwrap()]).stdout(std::process::Stdio::null()).stderr(std::process::Stdio::piped()).spawn().unwrap();

    let mut ours = vec![];
    let mut our_evals = vec![];
    for (i, (data, losses, weights, smoothing, max_length, truncation, eval, precompute_ref)) in cases.iter().enumerate() {
        let out = dir.path().join(format!("run{i}"));
        let mut flags = vec![
            "--max-seq-len".to_string(),
            max_length.to_string(),
            "--set".to_string(),
            format!("task.loss_type={}", json!(losses)),
            "--set".to_string(),
            format!("task.label_smoothing={smoothing}"),
            "--set".to_string(),
            format!("task.truncation_mode={truncation}"),
            "--set".to_string(),
            format!("task.precompute_ref={precompute_ref}"),
        ];
        if let Some(weights) = weights {
            flags.extend(["--set".to_string(), format!("task.loss_weights={}", json!(weights))]);
        }
        if let Some(eval) = eval {
            flags.extend(["--eval-file".to_string(), eval.display().to_string()]);
        }
        let flags: Vec<&str> = flags.iter().map(String::as_str).collect();
        let output = train(&model, data, &out, &flags);
        assert!(output.status.success(), "{losses:?} on {}: {}", data.display(), text(&output));
        ours.push(steps(&out));
        our_evals.push(evaluations(&out));
    }
    // Padded pairs (TRL's batch), and packed pairs each holding its prompt twice, give what
    // the padding-free rows with shared prompts (the default) give (case 12's).
    for (name, layout) in [("padded", "task.padding_free=false"), ("unshared", "task.share_prompt=false")] {
        let out = dir.path().join(name);
        let output = train(&model, &conversational, &out, &["--max-seq-len", "64", "--set", layout, "--set", "data.truncate=true"]);
        assert!(output.status.success(), "{}", text(&output));
        assert_equal_steps(&steps(&out), &ours[12], &format!("{layout} vs padding-free with shared prompts"));
    }

    let trl = trl.wait_with_output().unwrap();
    assert!(trl.status.success(), "dpo_reference.py: {}", text(&trl));
    let theirs: Vec<Value> = serde_json::from_str(&std::fs::read_to_string(&trl_out).unwrap()).unwrap();
    for (((case, ours), our_evals), theirs) in cases.iter().zip(&ours).zip(&our_evals).zip(&theirs) {
        let what = format!("{:?} on {} ({} {}, precompute_ref {})", case.1, case.0.display(), case.4, case.5, case.7);
        assert_equal_steps(ours, theirs["train"].as_array().unwrap(), &what);
        let their_evals = theirs["eval"].as_array().unwrap();
        assert_eq!(our_evals.len(), their_evals.len(), "{what}: evaluations {our_evals:?} vs {their_evals:?}");
        for (k, (a, b)) in our_evals.iter().zip(their_evals).enumerate() {
            // After a second update, to 1e-4: AdamW's first steps move each weight by about
            // lr whatever its gradient's size, so where a gradient is near 0 the f32 rounding
            // of another computation's order (TRL's, ft's) moves it by up to lr at lr 1e-2; after
            // the first, the evaluation's figures are within 1e-5.
            let tolerance = if k == 0 { 1e-5 } else { 1e-4 };
            assert_equal_figures(a, b, "eval_", &format!("{what}, evaluation {}", k + 1), tolerance);
        }
    }
    assert_eq!(our_evals[12].len(), 2, "the evaluated case: {our_evals:?}");
    // The figures move: the second step's rewards are not the first's zeros.
    assert!(ours[0][1]["rewards/margins"].as_f64().unwrap().abs() > 1e-3, "{:?}", ours[0]);
}

/// 2 ranks over Gloo (2 pairs each) train as 1 rank (4 pairs) does; with
/// LoRA, the base run with every step (adapters off) as the reference
/// equals the precomputed reference; a run with a frozen copy as its
/// reference, resumed from its checkpoint (which holds no more than the
/// precomputed run's), builds the copy again from the starting model and
/// continues as the uninterrupted run; reference-free, each reward is β times its
/// log-probability; `ft eval --task dpo` of the runs' final/ equals their
/// last evaluation ([`ft_eval_equals_the_training_runs_evaluation`]).
#[test]
fn two_ranks_equal_one_lora_base_equals_precomputed_a_resume_rebuilds_the_frozen_copy_and_ft_eval_equals_training() {
    if shared::skipped_without(&[shared::GPT2_TOKENIZER]) {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let model = common::tiny_chat_llama(dir.path());
    let [standard, conversational, _] = preference_files(dir.path());
    let evaluated = ["--eval-file", conversational.to_str().unwrap()];
    let run = |name: &str, extra: &[&str]| {
        let out = dir.path().join(name);
        let output = train(&model, &standard, &out, &[&["--max-seq-len", "64"], extra].concat());
        assert!(output.status.success(), "{name}: {}", text(&output));
        (steps(&out), text(&output))
    };
    let (one, _) = run("one", &[&["--nproc-per-node", "1", "--max-steps", "3"][..], &evaluated].concat());
    let (two, _) = run("two", &["--nproc-per-node", "2", "--batch-size", "2", "--max-steps", "3"]);
    assert_equal_steps(&two, &one, "2 ranks vs 1");
    // LoRA: the reference precomputed from the starting weights (the base: the adapters start at zero) on 1 rank
    // equals the base run with every step (adapters off) on 2 ranks under full_shard.
    let lora = ["--lora-r", "4", "--max-steps", "3"];
    let (precomputed, _) = run("lora-precomputed", &[&lora[..], &["--nproc-per-node", "1"], &evaluated].concat());
    let (base, _) = run("lora-base", &[&lora[..], &["--nproc-per-node", "2", "--batch-size", "2", "--strategy", "full_shard", "--set", "task.precompute_ref=false"]].concat());
    assert_equal_steps(&base, &precomputed, "LoRA's base at every step vs precomputed");
    assert!(precomputed[2]["rewards/margins"].as_f64().unwrap().abs() > 1e-3, "{precomputed:?}");
    // The frozen copy is the starting model again after a resume (a copy of the trained weights would train otherwise).
    let copy = ["--nproc-per-node", "1", "--set", "task.precompute_ref=false"];
    let (first, log) = run("resumed", &[&copy[..], &["--max-steps", "2"]].concat());
    assert_eq!(first.len(), 2);
    assert!(log.contains("reference model: a frozen copy of the starting model") && !log.contains("reference log-probabilities"), "{log}");
    let (resumed, log) = run("resumed", &[&copy[..], &["--max-steps", "3", "--resume", "latest"]].concat());
    assert!(log.contains("reference model: a frozen copy of the starting model"), "{log}");
    assert_equal_steps(&resumed[resumed.len() - 1..], &one[2..], "a frozen copy resumed vs the precomputed reference uninterrupted");
    assert!(!dir.path().join("resumed/reference_logps.json").exists());
    // The checkpoint holds the trained state alone: the bytes of the precomputed run's at the same step.
    let checkpoint_bytes = |run: &str| -> u64 {
        let step = dir.path().join(run).join("checkpoints/step-00000003");
        let files = std::fs::read_dir(&step).unwrap_or_else(|e| panic!("{}: {e}", step.display())).map(|f| f.unwrap().path());
        files.filter(|f| f.extension().is_some_and(|e| e == "safetensors")).map(|f| f.metadata().unwrap().len()).sum()
    };
    assert_eq!(checkpoint_bytes("resumed"), checkpoint_bytes("one"));
    // The summary says what each run's reference is and costs: the copy, the whole model in f32; the precomputed one, 16 bytes a pair.
    let reference = |run: &str| common::summary(&dir.path().join(run))["reference"].clone();
    let (copy, precomputed) = (reference("resumed"), reference("one"));
    let state = common::summary(&dir.path().join("resumed"))["state_per_rank"][0]["params"].as_f64().unwrap();
    assert!(copy["kind"].as_str().unwrap().starts_with("a frozen copy of the starting model"), "{copy}");
    assert_eq!((copy["device_bytes_per_rank"].clone(), copy["host_bytes_per_rank"].clone()), (json!([state]), json!([0.0])), "{copy}");
    assert!(precomputed["kind"].as_str().unwrap().starts_with("log-probabilities precomputed"), "{precomputed}");
    // 4 training and 4 evaluation pairs.
    assert_eq!((precomputed["device_bytes_per_rank"].clone(), precomputed["host_bytes_per_rank"].clone()), (json!([0.0]), json!([128.0])), "{precomputed}");
    // Reference-free: each reward is β times its own log-probability, and no reference is computed.
    let (free, log) = run("free", &["--nproc-per-node", "1", "--max-steps", "2", "--set", "task.reference_free=true"]);
    assert!(!log.contains("reference log-probabilities") && !dir.path().join("free/reference_logps.json").exists(), "{log}");
    for (step, record) in free.iter().enumerate() {
        for side in ["chosen", "rejected"] {
            let (reward, logps) = (record[format!("rewards/{side}")].as_f64().unwrap(), record[format!("logps/{side}")].as_f64().unwrap());
            assert!((reward - BETA * logps).abs() <= 1e-6 * logps.abs().max(1.0), "step {}: {side} reward {reward}, logps {logps}", step + 1);
        }
    }
    ft_eval_equals_the_training_runs_evaluation(dir.path(), &model, &conversational, &dir.path().join("one"), &dir.path().join("lora-precomputed"));
}

/// Every sharding strategy at 2 and 3 ranks equals one rank's DPO steps
/// (the reference log-probabilities computed by the trainer over its units,
/// sharded as the policy is: under full_shard at 3 ranks, the seven
/// evaluation pairs make one rank run two batches and the others one, and
/// their references still equal one rank's, as the evaluation shows), and
/// so does a frozen copy as the reference under full_shard at 2 ranks,
/// sharded as the policy is, or in host memory with `--offload cpu` (the
/// summary says what it costs each rank: a shard of the parameters in the
/// compute dtype); a rank killed after step 3 resumes from step 2's
/// checkpoint to the uninterrupted run's losses.
#[test]
fn every_strategy_at_two_and_three_ranks_equals_one_and_a_killed_run_resumes() {
    if shared::skipped_without(&[shared::GPT2_TOKENIZER]) {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let model = common::tiny_chat_llama(dir.path());
    // Twelve pairs: a global batch of 6 (6 × 1, 3 × 2, 2 × 3 ranks), two steps an epoch.
    let rows: Vec<Value> = std::fs::read_to_string(&preference_files(dir.path())[0]).unwrap().lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    let pairs = jsonl(dir.path(), "twelve.jsonl", &[&rows[..], &rows, &rows].concat());
    let eval_pairs = jsonl(dir.path(), "seven.jsonl", &[&rows[..], &rows[..3]].concat());
    let evaluated = ["--eval-file", eval_pairs.to_str().unwrap()];
    let run = |name: &str, ranks: usize, extra: &[&str], fault: Option<&str>| {
        let out = dir.path().join(name);
        let (ranks, batch) = (ranks.to_string(), (6 / ranks).to_string());
        let flags = [&["--max-seq-len", "64", "--max-steps", "4", "--nproc-per-node", &ranks, "--batch-size", &batch][..], extra].concat();
        let mut command = ft();
        command.args(["train", "--task", "dpo", "--model", model.to_str().unwrap(), "--train-file", pairs.to_str().unwrap(), "--device", "cpu"]);
        command.args(["--lr", "1e-2", "--set", "train.schedule=constant", "--report-to", "jsonl", "--output-dir", out.to_str().unwrap()]).args(&flags);
        if let Some(fault) = fault {
            command.env("FT_FAULT_INJECT", fault);
        }
        let output = command.output().unwrap();
        (output.status.success(), steps(&out), text(&output))
    };
    let (_, one, _) = run("one", 1, &evaluated, None);
    assert_eq!(one.len(), 4);
    for (ranks, strategy, offload, copy) in
        [(2, "zero1", false, false), (2, "full_shard", false, true), (2, "full_shard", true, true), (3, "shard_grad_op", false, false), (3, "full_shard", false, false)]
    {
        let name = format!("{strategy}-{ranks}{}{}", if offload { "-offload" } else { "" }, if copy { "-copy" } else { "" });
        let offload_flags: &[&str] = if offload { &["--offload", "cpu"] } else { &[] };
        let copy_flags: &[&str] = if copy { &["--set", "task.precompute_ref=false"] } else { &[] };
        let eval_flags: &[&str] = if (ranks, strategy) == (3, "full_shard") { &evaluated } else { &[] };
        let (succeeded, sharded, log) = run(&name, ranks, &[&["--strategy", strategy][..], offload_flags, copy_flags, eval_flags].concat(), None);
        assert!(succeeded, "{name}: {log}");
        assert_equal_steps(&sharded, &one, &name);
        if !eval_flags.is_empty() {
            let (ours, theirs) = (evaluations(&dir.path().join(&name)), evaluations(&dir.path().join("one")));
            assert_eq!(ours.len(), theirs.len(), "{name}: {ours:?}");
            for (ours, theirs) in ours.iter().zip(&theirs) {
                assert_equal_figures(ours, theirs, "eval_", &name, 1e-5);
            }
        }
        if copy {
            // Each rank's copy is its shard of the parameters in f32: the policy's master shard (sharded
            // parameters keep no compute copy between uses) or, offloaded, its compute shard on the device.
            let summary = common::summary(&dir.path().join(&name));
            let reference = &summary["reference"];
            for rank in 0..ranks {
                let policy = summary["state_per_rank"][rank]["params"].as_f64().unwrap();
                let shard = if offload { policy / 2.0 } else { policy };
                let held = [&reference["device_bytes_per_rank"][rank], &reference["host_bytes_per_rank"][rank]].map(|b| b.as_f64().unwrap());
                assert_eq!(held, if offload { [0.0, shard] } else { [shard, 0.0] }, "{name}, rank {rank}: {reference}");
            }
        }
    }
    let saving = ["--strategy", "full_shard", "--save-every", "2"];
    let (succeeded, _, log) = run("killed", 2, &saving, Some("after-step:3@1"));
    assert!(!succeeded && log.contains("FT_FAULT_INJECT: aborting"), "{log}");
    let (succeeded, resumed, log) = run("killed", 2, &[&saving[..], &["--resume", "latest"]].concat(), None);
    assert!(succeeded && log.contains("reference log-probabilities reused from"), "{log}");
    // metrics.jsonl continues from step 2's checkpoint: its last two steps are the resumed run's.
    assert_equal_steps(&resumed[resumed.len() - 2..], &one[2..], "resumed after a killed rank vs uninterrupted");
}

/// A row without `rejected`, with an empty completion, or whose prompt the
/// chat template cannot render is an error naming the file and line; the
/// task's keys are checked before any work.
#[test]
fn bad_preference_rows_are_errors_naming_the_file_and_line() {
    if shared::skipped_without(&[shared::GPT2_TOKENIZER]) {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let model = common::tiny_chat_llama(dir.path());
    let good = json!({"prompt": "Hi", "chosen": " there", "rejected": " no"});
    // Mistral's template refuses two user turns in a row.
    let mistral = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/chat/mistral.jinja");
    let cases = [
        (json!({"prompt": "Hi", "chosen": " there"}), vec![], "line 2: no \"rejected\""),
        (json!({"prompt": "Hi", "chosen": "", "rejected": " no"}), vec![], "line 2: \"chosen\" is an empty completion"),
        (
            json!({"prompt": [message("user", "a"), message("user", "b")], "chosen": [message("assistant", "c")], "rejected": [message("assistant", "d")]}),
            vec!["--chat-template", mistral.to_str().unwrap()],
            "line 2: the chat template cannot render the prompt: invalid operation: Conversation roles must alternate",
        ),
        (good.clone(), vec!["--set", "task.loss_type=simpo"], "unknown variant `simpo`"),
        (
            good.clone(),
            vec!["--set", "task.precompute_ref=false", "--set", "task.reference_free=true"],
            "task.precompute_ref=false runs a reference model, which task.reference_free=true leaves out",
        ),
    ];
    for (i, (bad, extra, expected)) in cases.into_iter().enumerate() {
        let data = jsonl(dir.path(), &format!("bad{i}.jsonl"), &[good.clone(), bad]);
        let output = train(&model, &data, &dir.path().join(format!("run{i}")), &extra);
        let log = text(&output);
        assert!(!output.status.success() && log.contains(expected) && !log.contains("panicked"), "{expected}: {log}");
        if i < 3 {
            assert!(log.contains(&format!("bad{i}.jsonl {expected}")), "the file is named: {log}");
        }
    }
}

/// Preference pairs read from every source — Parquet and Arrow as
/// `datasets` writes them (tests/python/data_sources.py), a JSON array —
/// are those of the JSON lines: the same reference log-probabilities;
/// `data.range` takes the file's pairs in order; two files are a mixture of
/// both one's pairs; a mixture source with a format is refused.
#[test]
fn every_source_reads_preference_pairs_and_a_range_takes_them_in_order() {
    if shared::skipped_without(&[shared::GPT2_TOKENIZER]) {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let model = common::tiny_chat_llama(dir.path());
    let [_, conversational, _] = preference_files(dir.path());
    let written = dir.path().join("written");
    std::fs::create_dir(&written).unwrap();
    common::reference_job("data_sources.py", &["write".as_ref(), conversational.as_os_str(), written.as_os_str()]);
    let reference = |name: &str, data: &Path, extra: &[&str]| -> Value {
        let out = dir.path().join(name);
        let output = train(&model, data, &out, &[&["--max-seq-len", "64", "--max-steps", "1", "--batch-size", "2"], extra].concat());
        assert!(output.status.success(), "{name}: {}", text(&output));
        serde_json::from_str(&std::fs::read_to_string(out.join("reference_logps.json")).unwrap()).unwrap()
    };
    let lines = reference("jsonl", &conversational, &[]);
    assert_eq!(lines["train"].as_array().unwrap().len(), 4);
    for source in ["rows.parquet", "saved", "rows.json"] {
        assert_eq!(reference(source, &written.join(source), &[]), lines, "{source}");
    }
    let range = reference("range", &conversational, &["--set", "data.range=1:3"]);
    assert_eq!(range["train"].as_array().unwrap()[..], lines["train"].as_array().unwrap()[1..3]);
    // Two training files are a mixture (each one's pairs once, in a seeded order): the pairs of both.
    let mixed = reference("mixture", &conversational, &["--train-file", written.join("rows.parquet").to_str().unwrap()]);
    let sorted = |pairs: &[Value]| {
        let mut logps: Vec<[f64; 2]> = pairs.iter().map(|pair| serde_json::from_value(pair.clone()).unwrap()).collect();
        logps.sort_by(|a, b| a[0].total_cmp(&b[0]));
        logps
    };
    let twice = sorted(&[lines["train"].as_array().unwrap().as_slice(), lines["train"].as_array().unwrap()].concat());
    let mixed = sorted(mixed["train"].as_array().unwrap());
    assert_eq!(mixed.len(), 8, "{mixed:?}");
    for (ours, expected) in mixed.iter().zip(&twice) {
        assert!((ours[0] - expected[0]).abs() < 1e-4 && (ours[1] - expected[1]).abs() < 1e-4, "mixture {mixed:?} vs each file's {twice:?}");
    }
    // A mixture source's format is refused by name: a preference row has one.
    let out = dir.path().join("mixture-format");
    let mixture = format!(r#"data.mixture=[{{"path": "{}", "format": "chat"}}]"#, conversational.display());
    let output = ft()
        .args(["train", "--task", "dpo", "--model", model.to_str().unwrap(), "--device", "cpu", "--max-seq-len", "64", "--set", &mixture])
        .args(["--output-dir", out.to_str().unwrap()])
        .output()
        .unwrap();
    assert!(!output.status.success() && text(&output).contains("has a format, which preference pairs do not take"), "{}", text(&output));
}

/// `ft eval --task dpo` of `model` on `data` with `extra` flags: its
/// eval_results.json, or the failed run's log.
fn eval(model: &Path, data: &Path, out: &Path, extra: &[&str]) -> Result<Value, String> {
    let output = ft()
        .args(["eval", "--task", "dpo", "--model", model.to_str().unwrap(), "--eval-file", data.to_str().unwrap(), "--device", "cpu"])
        .args(["--max-seq-len", "64", "--output-dir", out.to_str().unwrap()])
        .args(extra)
        .output()
        .unwrap();
    match output.status.success() {
        true => Ok(serde_json::from_str(&std::fs::read_to_string(out.join("eval_results.json")).unwrap()).unwrap()),
        false => Err(text(&output)),
    }
}

/// `ft eval --task dpo` of a run's final/ on `pairs` gives the loss and
/// TRL's figures the training run's last evaluation of them gave for the
/// same weights (so TRL's, which that equals): `full`, a full fine-tune of
/// `model`, against it (`--ref-model`) at 2 ranks (the run's evaluation was
/// one rank's), and `lora`, a LoRA run's adapter, against its base.
/// Reference-free, the figures are the log-probabilities alone. Without a
/// reference, or with one of another architecture or vocabulary, it is a
/// clear error.
fn ft_eval_equals_the_training_runs_evaluation(dir: &Path, model: &Path, pairs: &Path, full: &Path, lora: &Path) {
    let last_evaluation = |run: &Path| evaluations(run).pop().unwrap_or_else(|| panic!("{}: no evaluation", run.display()));
    let (full_eval, lora_eval) = (last_evaluation(full), last_evaluation(lora));
    let (full, lora) = (full.join("final"), lora.join("final"));
    let scratch = |name: &str| dir.join("eval").join(name);
    let ours = eval(&full, pairs, &scratch("full"), &["--ref-model", model.to_str().unwrap(), "--nproc-per-node", "2"]).unwrap();
    assert_equal_figures(&ours, &full_eval, "eval_", "ft eval of a full fine-tune at 2 ranks", 1e-5);
    assert_eq!(ours["eval_samples"], 4, "{ours}");
    assert_eq!(full_eval["eval_samples"], 4.0, "the training run's evaluation counts the pairs too: {full_eval}");
    let ours = eval(&lora, pairs, &scratch("lora"), &[]).unwrap();
    assert_equal_figures(&ours, &lora_eval, "eval_", "ft eval of a LoRA run's adapter on its base", 1e-5);
    // The rewards moved away from the reference's zero: a wrong reference would fail the comparisons.
    for evaluation in [&full_eval, &lora_eval] {
        let moved = ["chosen", "rejected"].map(|side| evaluation[format!("eval_rewards/{side}")].as_f64().unwrap().abs());
        assert!(moved[0].max(moved[1]) > 1e-3, "{evaluation}");
    }

    // Reference-free: the policy's log-probabilities as the training run found them, each reward β times its own.
    let free = eval(&full, pairs, &scratch("free"), &["--set", "task.reference_free=true"]).unwrap();
    for side in ["chosen", "rejected"] {
        let logps = free[format!("eval_logps/{side}")].as_f64().unwrap();
        let trained = full_eval[format!("eval_logps/{side}")].as_f64().unwrap();
        assert!((logps - trained).abs() <= 1e-5 * trained.abs().max(1.0), "{side}: {logps} vs {trained}");
        let reward = free[format!("eval_rewards/{side}")].as_f64().unwrap();
        assert!((reward - BETA * logps).abs() <= 1e-6 * logps.abs().max(1.0), "{side}: reward {reward}, logps {logps}");
    }

    // No reference; a reference of another architecture or vocabulary.
    let one_layer = dir.join("one-layer");
    let config = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/llama/config.json");
    let output = ft()
        .args(["init-model", "--config", config.to_str().unwrap(), "--out", one_layer.to_str().unwrap()])
        .args(["--set", "vocab_size=50304", "--set", "num_hidden_layers=1"])
        .output()
        .unwrap();
    assert!(output.status.success(), "{}", text(&output));
    let other_vocabulary = dir.join("other-vocabulary");
    std::fs::create_dir(&other_vocabulary).unwrap();
    for entry in std::fs::read_dir(model).unwrap() {
        let entry = entry.unwrap();
        std::fs::copy(entry.path(), other_vocabulary.join(entry.file_name())).unwrap();
    }
    let mut tokenizer: Value = serde_json::from_str(&std::fs::read_to_string(model.join("tokenizer.json")).unwrap()).unwrap();
    // One more token than the policy's tokenizer has (an id below the model's 50304).
    tokenizer["model"]["vocab"].as_object_mut().unwrap().insert("<|another|>".into(), json!(50300));
    std::fs::write(other_vocabulary.join("tokenizer.json"), tokenizer.to_string()).unwrap();
    let cases: [(&[&str], &str); 3] = [
        (&[], "has no LoRA adapters whose base would be one: name the model its training started from with --ref-model DIR, or evaluate reference-free (task.reference_free=true)"),
        (&["--ref-model", one_layer.to_str().unwrap()], "a llama of 1 layers, hidden size 32, vocabulary 50304, not the evaluated model's architecture (llama of 2 layers"),
        (&["--ref-model", other_vocabulary.to_str().unwrap()], "has another vocabulary than the one the pairs are encoded with"),
    ];
    for (i, (flags, expected)) in cases.into_iter().enumerate() {
        let log = eval(&full, pairs, &scratch(&format!("refused{i}")), flags).unwrap_err();
        assert!(log.contains(expected) && !log.contains("panicked"), "{expected}: {log}");
    }
}

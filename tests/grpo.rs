//! The `grpo` and `rloo` tasks against TRL 1.16's GRPOTrainer and
//! RLOOTrainer (tests/python/grpo_reference.py): on a random tiny Llama with
//! GPT-2's tokenizer (f32, CPU), ft samples and scores the completions and
//! TRL is fed the same ones in place of its generator; every step's loss,
//! gradient norm and TRL's figures (rewards, advantages' spread, lengths,
//! entropy, clipping, KL) then equal TRL's, for each loss type, GSPO's
//! sequence-level weights, a window trained twice (the sampling policy's
//! log-probabilities kept), batch-scaled rewards, the KL term against a
//! frozen copy, conversational prompts and RLOO. 2 ranks sample the
//! same completions and train the same steps as 1; bad options and reward
//! files are errors naming them.

use crate::common;

use common::{ft, shared, text};
use serde_json::{json, Value};
use std::path::{Path, PathBuf};

/// Reward functions TRL's way: texts or messages in, one float (or None) per completion out.
const REWARDS: &str = r#"
def _text(completion):
    return completion if isinstance(completion, str) else completion[0]["content"]

def odd_tokens(completions, completion_ids, **kwargs):
    assert len(completions) == len(completion_ids)
    return [sum(i % 2 for i in ids) / max(len(ids), 1) for ids in completion_ids]

def vowels(prompts, completions, completion_ids, answer, **kwargs):
    assert len(prompts) == len(completions) == len(answer)
    return [None if ids[0] % 4 == 0 else sum(ch in "aeiou" for ch in _text(c)) / 10 + int(a) / 100 for c, ids, a in zip(completions, completion_ids, answer)]
"#;

/// Figures every case compares (`kl` where β > 0).
const FIGURES: [&str; 11] = [
    "loss",
    "grad_norm",
    "reward",
    "reward_std",
    "frac_reward_zero_std",
    "rewards/odd_tokens/mean",
    "rewards/vowels/mean",
    "completions/mean_length",
    "entropy",
    "clip_ratio/region_mean",
    "clip_ratio/high_mean",
];

fn message(role: &str, content: &str) -> Value {
    json!({"role": role, "content": content})
}

/// Eight prompts (text, or the same as one user message each), with an `answer` column the rewards read.
fn prompt_file(dir: &Path, conversational: bool) -> PathBuf {
    let questions = ["What is two plus two?", "Name a colour.", "Say hello.", "Count to three.", "Spell cat.", "Which is larger, 3 or 5?", "Say yes.", "Name a fruit."];
    let rows: String = questions
        .iter()
        .enumerate()
        .map(|(k, q)| {
            let prompt = if conversational { json!([message("user", q)]) } else { json!(q) };
            json!({"prompt": prompt, "answer": k.to_string()}).to_string() + "\n"
        })
        .collect();
    let path = dir.join(if conversational { "chat-prompts.jsonl" } else { "prompts.jsonl" });
    std::fs::write(&path, rows).unwrap();
    path
}

fn reward_file(dir: &Path) -> PathBuf {
    let path = dir.join("rewards.py");
    std::fs::write(&path, REWARDS).unwrap();
    path
}

/// One configuration trained by ft then by TRL on ft's completions.
struct Case {
    algorithm: &'static str,
    conversational: bool,
    grad_accum: usize,
    /// task.* keys, which are GRPOConfig's (RLOOConfig's) too.
    options: Value,
}

/// `ft train --task ALGORITHM`: 4 completions a micro-batch, 4 per prompt, 2 steps at lr 1e-2.
fn train(model: &Path, prompts: &Path, rewards: &Path, out: &Path, case: &Case, extra: &[&str]) -> std::process::Output {
    let mut command = ft();
    command
        .args(["train", "--task", case.algorithm, "--model", model.to_str().unwrap(), "--train-file", prompts.to_str().unwrap(), "--device", "cpu"])
        .args(["--reward", &format!("{}:odd_tokens", rewards.display()), "--reward", &format!("{}:vowels", rewards.display())])
        .args(["--batch-size", "4", "--grad-accum", &case.grad_accum.to_string(), "--max-steps", "2", "--lr", "1e-2", "--max-seq-len", "64"])
        .args(["--set", "train.schedule=constant", "--set", "data.shuffle=false", "--report-to", "jsonl", "--output-dir", out.to_str().unwrap()])
        .args(["--set", "task.num_generations=4", "--set", "task.max_completion_length=6"]);
    for (key, value) in case.options.as_object().unwrap() {
        command.args(["--set", &format!("task.{key}={value}")]);
    }
    command.args(extra).output().unwrap()
}

/// A run's logged steps.
fn steps(out: &Path) -> Vec<Value> {
    let metrics = std::fs::read_to_string(out.join("metrics.jsonl")).unwrap();
    metrics.lines().map(|line| serde_json::from_str::<Value>(line).unwrap()).filter(|record| record.get("loss").is_some()).collect()
}

fn rollouts(out: &Path) -> Vec<Value> {
    std::fs::read_to_string(out.join("rollouts.jsonl")).unwrap().lines().map(|line| serde_json::from_str(line).unwrap()).collect()
}

/// TRL's steps on the completions of ft's run in `out`.
fn trl_steps(dir: &Path, model: &Path, prompts: &Path, rewards: &Path, out: &Path, case: &Case) -> Vec<Value> {
    let mut options = case.options.clone();
    options["num_generations"] = json!(4);
    options["max_completion_length"] = json!(6);
    let spec = json!({
        "algorithm": case.algorithm, "model": model, "prompts": prompts, "rollouts": out.join("rollouts.jsonl"),
        "rewards": [format!("{}:odd_tokens", rewards.display()), format!("{}:vowels", rewards.display())],
        "batch_size": 4, "grad_accum": case.grad_accum, "steps": 2, "lr": 1e-2, "options": options,
    });
    let (case_file, result) = (dir.join("case.json"), dir.join("trl.json"));
    std::fs::write(&case_file, spec.to_string()).unwrap();
    common::reference_job("grpo_reference.py", &[case_file.as_os_str(), result.as_os_str()]);
    serde_json::from_str(&std::fs::read_to_string(result).unwrap()).unwrap()
}

fn assert_equal_steps(ours: &[Value], theirs: &[Value], figures: &[&str], what: &str) {
    assert_eq!(ours.len(), theirs.len(), "{what}: steps {ours:?} vs {theirs:?}");
    let mut differences = vec![];
    for (step, (ours, theirs)) in ours.iter().zip(theirs).enumerate() {
        for key in figures {
            let (a, b) = (ours.get(*key).and_then(Value::as_f64), theirs.get(*key).and_then(Value::as_f64));
            // A generation's figures are logged at the step that samples it only: absent from both, or equal.
            let equal = match (a, b) {
                (Some(a), Some(b)) => (a - b).abs() <= 1e-5 * b.abs().max(1.0),
                (a, b) => a.is_none() && b.is_none() && *key != "loss",
            };
            if !equal {
                differences.push(format!("step {}: {key} {a:?} vs TRL's {b:?}", step + 1));
            }
        }
    }
    assert!(differences.is_empty(), "{what}:\n{}", differences.join("\n"));
}

/// Each case trained by ft, then by TRL on ft's completions; their steps compared.
fn equal_to_trl(cases: &[Case]) {
    if shared::skipped_without(&[shared::GPT2_TOKENIZER]) {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let model = common::tiny_chat_llama(dir.path());
    let rewards = reward_file(dir.path());
    for (k, case) in cases.iter().enumerate() {
        let what = format!("{} {}", case.algorithm, case.options);
        let prompts = prompt_file(dir.path(), case.conversational);
        let out = dir.path().join(format!("run-{k}"));
        let output = train(&model, &prompts, &rewards, &out, case, &[]);
        assert!(output.status.success(), "{what}: {}", text(&output));
        let mut figures = FIGURES.to_vec();
        // RLOO's default β is TRL's 0.05.
        let beta = case.options.get("beta").and_then(Value::as_f64).unwrap_or(if case.algorithm == "rloo" { 0.05 } else { 0.0 });
        if beta != 0.0 {
            figures.push("kl");
        }
        let ours = steps(&out);
        // The first step samples: it logs every figure.
        let missing: Vec<&&str> = figures.iter().filter(|key| ours[0].get(**key).is_none()).collect();
        assert!(missing.is_empty(), "{what}: step 1 logs no {missing:?}: {}", ours[0]);
        let theirs = trl_steps(dir.path(), &model, &prompts, &rewards, &out, case);
        assert_equal_steps(&ours, &theirs, &figures, &what);
    }
}

#[test]
fn each_grpo_loss_type_equals_trls_grpo_trainer() {
    equal_to_trl(&[
        Case { algorithm: "grpo", conversational: false, grad_accum: 2, options: json!({"loss_type": "grpo", "temperature": 0.7}) },
        Case { algorithm: "grpo", conversational: true, grad_accum: 2, options: json!({"loss_type": "dr_grpo", "scale_rewards": "batch"}) },
        Case { algorithm: "grpo", conversational: false, grad_accum: 1, options: json!({"loss_type": "bnpo", "num_iterations": 2, "importance_sampling_level": "sequence"}) },
    ]);
}

#[test]
fn dapo_with_a_kl_term_a_long_window_and_rloo_equal_trl() {
    equal_to_trl(&[
        Case { algorithm: "grpo", conversational: false, grad_accum: 1, options: json!({"beta": 0.04, "steps_per_generation": 2, "epsilon_high": 0.28, "reward_weights": [1.0, 0.5]}) },
        // TRL's RLOO default β 0.05: the KL penalty in the rewards.
        Case { algorithm: "rloo", conversational: false, grad_accum: 2, options: json!({"normalize_advantages": true}) },
    ]);
}

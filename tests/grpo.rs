//! The `grpo` and `rloo` tasks against TRL 1.16's GRPOTrainer and
//! RLOOTrainer (tests/python/grpo_reference.py): on a random tiny Llama with
//! GPT-2's tokenizer (f32, CPU), ft samples and scores the completions and
//! TRL is fed the same ones in place of its generator; every step's loss,
//! gradient norm and TRL's figures (rewards, advantages' spread, lengths,
//! entropy, clipping, KL) then equal TRL's, for each loss type, GSPO's
//! sequence-level weights, a window trained twice (the sampling policy's
//! log-probabilities kept), batch-scaled rewards, the KL term against a
//! frozen copy, conversational prompts and RLOO. 2 ranks sample the
//! same completions and train the same steps as 1 (under full_shard,
//! offloaded, with LoRA and QLoRA); a killed run resumes to the same steps
//! and rollouts, at and inside a window; a reward that raises, bad prompts
//! and batches are errors naming them. The `arithmetic` preset's reward rises.

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

/// `ft train --task ALGORITHM`: 4 completions a micro-batch (unless `extra` sets --batch-size), 4 per prompt, 2 steps at lr 1e-2.
fn train(model: &Path, prompts: &Path, rewards: &Path, out: &Path, case: &Case, extra: &[&str]) -> std::process::Output {
    train_command(model, prompts, rewards, out, case, extra).output().unwrap()
}

fn train_command(model: &Path, prompts: &Path, rewards: &Path, out: &Path, case: &Case, extra: &[&str]) -> std::process::Command {
    let mut command = ft();
    command
        .args(["train", "--task", case.algorithm, "--model", model.to_str().unwrap(), "--train-file", prompts.to_str().unwrap(), "--device", "cpu"])
        .args(["--reward", &format!("{}:odd_tokens", rewards.display()), "--reward", &format!("{}:vowels", rewards.display())])
        .args(["--grad-accum", &case.grad_accum.to_string(), "--max-steps", "2", "--lr", "1e-2", "--max-seq-len", "64"])
        .args(["--set", "train.schedule=constant", "--set", "data.shuffle=false", "--report-to", "jsonl", "--output-dir", out.to_str().unwrap()])
        .args(["--set", "task.num_generations=4", "--set", "task.max_completion_length=6"]);
    if !extra.contains(&"--batch-size") {
        command.args(["--batch-size", "4"]);
    }
    for (key, value) in case.options.as_object().unwrap() {
        command.args(["--set", &format!("task.{key}={value}")]);
    }
    command.args(extra);
    command
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

/// The mean of `key` over `steps`.
fn mean_of(steps: &[Value], key: &str) -> f64 {
    steps.iter().map(|step| step[key].as_f64().unwrap_or_else(|| panic!("a step without {key}: {step}"))).sum::<f64>() / steps.len() as f64
}

/// `ft train --model arithmetic`, shortened: the reward of the random
/// policy's first steps, then a real rise of the format reward and of the
/// accuracy over the run; rollouts.jsonl's rows as documented, each
/// completion scored right when it is the sum.
#[test]
fn the_arithmetic_demo_learns_to_add_from_its_rewards() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("run");
    let output = ft().args(["train", "--model", "arithmetic", "--max-steps", "200", "--report-to", "jsonl", "--output-dir", out.to_str().unwrap()]).output().unwrap();
    assert!(output.status.success(), "{}", text(&output));
    let steps = steps(&out);
    assert_eq!(steps.len(), 200);
    let (first, last) = (&steps[..20], &steps[180..]);
    let rise = |key: &str| (mean_of(first, key), mean_of(last, key));
    let (reward, accuracy, format) = (rise("reward"), rise("rewards/accuracy/mean"), rise("rewards/format/mean"));
    let curve = format!("reward {reward:?}, accuracy {accuracy:?}, format {format:?} (first 20 steps, last 20)");
    // Measured: reward 0.98 to 1.32, accuracy 0.09 to 0.33, format 0.89 to 1.00.
    assert!(reward.1 - reward.0 >= 0.25, "{curve}");
    assert!(accuracy.1 - accuracy.0 >= 0.15 && format.1 >= 0.95, "{curve}");

    let rows = rollouts(&out);
    // Each step samples 16 completions of 2 prompts on each of 2 ranks.
    assert_eq!(rows.len(), 200 * 64);
    for row in &rows {
        let mut keys: Vec<&str> = row.as_object().unwrap().keys().map(String::as_str).collect();
        keys.sort();
        assert_eq!(keys, ["advantage", "completion", "completion_ids", "prompt", "prompt_ids", "reward", "rewards", "step"], "{row}");
        let (prompt, completion) = (row["prompt"].as_str().unwrap(), row["completion"].as_str().unwrap());
        // One token a character; the end token (0) is not in the text.
        assert_eq!(row["prompt_ids"].as_array().unwrap().len(), prompt.len(), "{row}");
        let ids = row["completion_ids"].as_array().unwrap();
        assert_eq!(ids.iter().filter(|id| id.as_i64() != Some(0)).count(), completion.len(), "{row}");
        let (a, b) = prompt.trim_end_matches('=').split_once('+').unwrap();
        let sum = a.parse::<u32>().unwrap() + b.parse::<u32>().unwrap();
        let right = completion.parse::<u32>() == Ok(sum);
        let only_digits = !completion.is_empty() && completion.chars().all(|c| c.is_ascii_digit());
        let rewards = &row["rewards"];
        assert_eq!((rewards["accuracy"].as_f64(), rewards["format"].as_f64()), (Some(right as u32 as f64), Some(only_digits as u32 as f64)), "{row}");
        assert_eq!(row["reward"].as_f64().unwrap(), (right as u32 + only_digits as u32) as f64, "{row}");
    }
}

/// The rows of two runs' rollouts.jsonl agree: the same completions, scores and advantages.
fn assert_equal_rollouts(ours: &[Value], theirs: &[Value], what: &str) {
    assert_eq!(ours.len(), theirs.len(), "{what}: rollouts");
    for (k, (a, b)) in ours.iter().zip(theirs).enumerate() {
        for key in ["step", "prompt", "completion_ids", "rewards"] {
            assert_eq!(a[key], b[key], "{what}: rollout {k}'s {key}");
        }
        for key in ["reward", "advantage"] {
            let (a, b) = (a[key].as_f64().unwrap(), b[key].as_f64().unwrap());
            assert!((a - b).abs() <= 1e-6 * b.abs().max(1.0), "{what}: rollout {k}'s {key} {a} vs {b}");
        }
    }
}

/// 2 ranks (1 micro-batch of 4 each) sample the completions 1 rank (2
/// micro-batches of 4) samples, as each example's completion is seeded by
/// the example, and train the same steps: plainly, under full_shard with
/// the state offloaded to the host, with LoRA's adapters (β > 0: the
/// reference is their base, which the first step's KL of 0 shows, the
/// adapters starting at zero), and with them over a 4-bit base, a window
/// trained twice (the sampling policy's log-probabilities, taken over
/// the gathered 4-bit base, weigh the second pass); and RLOO under zero1.
#[test]
fn two_ranks_equal_one_under_each_strategy_with_lora_qlora_and_rloo() {
    if shared::skipped_without(&[shared::GPT2_TOKENIZER]) {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let model = common::tiny_chat_llama(dir.path());
    let (prompts, rewards) = (prompt_file(dir.path(), false), reward_file(dir.path()));
    let run = |name: &str, ranks: usize, options: Value, extra: &[&str]| {
        let out = dir.path().join(name);
        // A global batch of 8 completions (2 prompts): 4 x 2 micro-batches on 1 rank, 4 x 1 on each of 2 (or 2 x 2).
        let grad_accum = if extra.contains(&"--batch-size") { 2 } else { 3 - ranks };
        let algorithm = if name.starts_with("rloo") { "rloo" } else { "grpo" };
        let case = Case { algorithm, conversational: false, grad_accum, options };
        let output = train(&model, &prompts, &rewards, &out, &case, &[&["--nproc-per-node", &ranks.to_string()], extra].concat());
        assert!(output.status.success(), "{name}: {}", text(&output));
        (steps(&out), rollouts(&out))
    };
    let figures = [&FIGURES[..], &["kl"]].concat();
    let lora = ["--lora-r", "4"];
    let qlora = ["--lora-r", "4", "--quantize", "nf4"];
    let sharded = ["--strategy", "full_shard"];
    let kl = json!({"beta": 0.04});
    let twice = json!({"beta": 0.04, "num_iterations": 2});
    let runs: [(&str, Value, &[&str], Vec<Vec<&str>>); 4] = [
        ("plain", json!({}), &[], vec![vec!["--batch-size", "2"], vec!["--strategy", "full_shard", "--offload", "cpu"]]),
        // RLOO's KL penalty in the rewards, from every rank's log-ratios.
        ("rloo", json!({}), &[], vec![vec!["--strategy", "zero1"]]),
        ("lora", kl, &lora, vec![[&lora[..], &sharded].concat()]),
        ("qlora", twice, &qlora, vec![[&qlora[..], &sharded].concat()]),
    ];
    for (name, options, one_flags, two_flags) in runs {
        let (one, one_rollouts) = run(&format!("{name}-1"), 1, options.clone(), one_flags);
        for (k, flags) in two_flags.iter().enumerate() {
            let what = format!("{name}: 2 ranks {flags:?} vs 1");
            let (two, two_rollouts) = run(&format!("{name}-2-{k}"), 2, options.clone(), flags);
            assert_equal_rollouts(&two_rollouts, &one_rollouts, &what);
            assert_equal_steps(&two, &one, &figures, &what);
        }
        if name == "lora" || name == "qlora" {
            assert!(one[0]["kl"].as_f64().unwrap().abs() < 1e-7, "{name}: {}", one[0]);
        }
    }
}

/// Under full_shard on 2 ranks, the rollouts decoded from the policy
/// gathered a unit at a time for each stage (`train.rollout_gather=per_unit`)
/// are those decoded from it gathered whole, bit for bit, and the run
/// trains the same steps: on the tiny Llama, prompts of different lengths
/// prefilled in step with the other rank's, the sampling policy's
/// log-probabilities (a window trained twice) taken through the same
/// gathers, the KL term's frozen copy beside them; on the `arithmetic`
/// preset (13 tokens, one completion a rank), a rank whose row ends early
/// stepping on with the other. A value the key does not know is refused, naming it.
#[test]
fn rollouts_gathered_a_unit_at_a_time_equal_the_whole_policys() {
    if shared::skipped_without(&[shared::GPT2_TOKENIZER]) {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let model = common::tiny_chat_llama(dir.path());
    let (prompts, rewards) = (prompt_file(dir.path(), false), reward_file(dir.path()));
    let case = Case { algorithm: "grpo", conversational: false, grad_accum: 1, options: json!({"beta": 0.04, "num_iterations": 2}) };
    let sharded = ["--nproc-per-node", "2", "--strategy", "full_shard"];
    // Each way's steps and rollouts, checked to say how it sampled.
    let run = |name: &str, gather: &str, command: &dyn Fn(&Path) -> std::process::Command| {
        let out = dir.path().join(format!("{name}-{gather}"));
        let output = command(&out).args(sharded).args(["--set", &format!("train.rollout_gather={gather}")]).output().unwrap();
        let log = text(&output);
        assert!(output.status.success(), "{name} {gather}: {log}");
        let how = if gather == "whole" { "whole" } else { "a unit at a time" };
        assert!(log.contains(&format!("rollouts: sampled from the policy gathered {how} (train.rollout_gather={gather})")), "{log}");
        (steps(&out), rollouts(&out))
    };
    let arithmetic = |gather: &str| {
        let command = |out: &Path| {
            let mut command = ft();
            command.args(["train", "--model", "arithmetic", "--device", "cpu", "--max-steps", "3", "--batch-size", "1", "--max-seq-len", "12", "--report-to", "jsonl"]);
            command.args(["--set", "task.num_generations=2", "--set", "task.max_completion_length=6", "--output-dir", out.to_str().unwrap()]);
            command
        };
        run("arithmetic", gather, &command)
    };
    let llama = |gather: &str| run("llama", gather, &|out: &Path| train_command(&model, &prompts, &rewards, out, &case, &[]));
    for (name, ways) in [("llama", &llama as &dyn Fn(&str) -> (Vec<Value>, Vec<Value>)), ("arithmetic", &arithmetic)] {
        let ((whole, whole_rollouts), (per_unit, per_unit_rollouts)) = (ways("whole"), ways("per_unit"));
        assert!(!per_unit_rollouts.is_empty() && per_unit_rollouts.len() == whole_rollouts.len(), "{name}");
        for (k, (a, b)) in per_unit_rollouts.iter().zip(&whole_rollouts).enumerate() {
            assert_eq!(a, b, "{name}: rollout {k}");
        }
        assert_eq!(per_unit.len(), whole.len(), "{name}");
        for (k, (a, b)) in per_unit.iter().zip(&whole).enumerate() {
            for key in ["loss", "grad_norm", "kl", "entropy", "completions/mean_length"] {
                assert_eq!(a.get(key), b.get(key), "{name}: step {}'s {key}", k + 1);
            }
        }
        if name == "arithmetic" {
            // Some step's two rows (one a rank) end apart: one at the end token, the other later.
            let ends = |step: &[Value]| step.iter().map(|row| row["completion_ids"].as_array().unwrap().len()).collect::<Vec<_>>();
            assert!(per_unit_rollouts.chunks(2).map(ends).any(|lengths| lengths[0] != lengths[1]), "{per_unit_rollouts:?}");
        }
    }

    let refused = train(&model, &prompts, &rewards, &dir.path().join("bad"), &case, &["--set", "train.rollout_gather=sharded"]);
    let said = text(&refused);
    assert_eq!(refused.status.code(), Some(1), "{said}");
    assert!(said.contains("config key `train.rollout_gather`: unknown variant: found `sharded`") && said.contains("`auto`, `whole`, `per_unit`"), "{said}");
}

/// What a user gets wrong stops the run with exit code 1 and a message
/// naming it, never a Rust panic: a reward function that raises (its
/// name and Python traceback, every rank stopped, though it raised on
/// one rank's completions), one that returns too
/// few rewards, a row without `prompt` (file and line), a missing reward
/// file, no reward at all, and a generation that is not whole groups of
/// `task.num_generations` (said before any rank starts).
#[test]
fn a_reward_function_that_raises_and_bad_prompts_and_batches_are_errors_naming_them() {
    if shared::skipped_without(&[shared::GPT2_TOKENIZER]) {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let model = common::tiny_chat_llama(dir.path());
    let prompts = prompt_file(dir.path(), false);
    let bad = dir.path().join("bad.py");
    // `raises` fails on one rank's prompts only: the other, waiting for its rewards, stops too.
    let functions = "def raises(prompts, completions, **kwargs):\n    return [1 / ('plus' not in p) for p in prompts]\n\ndef short(completions, **kwargs):\n    return [0.0] * (len(completions) - 1)\n";
    std::fs::write(&bad, functions).unwrap();
    let reward = |function: &str| format!("{}:{function}", bad.display());
    let no_prompt = dir.path().join("no-prompt.jsonl");
    std::fs::write(&no_prompt, "{\"prompt\": \"a\"}\n{\"question\": \"b\"}\n").unwrap();
    let refusal = |train_file: &Path, extra: &[&str]| {
        let out = dir.path().join(format!("out-{}", extra.join("-").replace('/', "")));
        let mut command = ft();
        command.args(["train", "--task", "grpo", "--model", model.to_str().unwrap(), "--train-file", train_file.to_str().unwrap(), "--device", "cpu", "--max-steps", "1"]);
        command.args(["--max-seq-len", "64", "--output-dir", out.to_str().unwrap(), "--set", "task.num_generations=4", "--set", "task.max_completion_length=4"]);
        let output = command.args(extra).output().unwrap();
        let log = text(&output);
        assert_eq!(output.status.code(), Some(1), "{extra:?}: {log}");
        assert!(!log.contains("panicked") && !log.contains("internal error"), "{extra:?}: {log}");
        log
    };
    // Rank 0 scores the first prompt's completions, rank 1 the second's.
    let log = refusal(&prompts, &["--reward", &reward("raises"), "--nproc-per-node", "2", "--batch-size", "4", "--set", "data.shuffle=false"]);
    let said = |rank: usize| log.contains(&format!("[rank {rank}] error: reward function {} raised an exception:", reward("raises")));
    assert!(said(0) && !said(1) && log.contains("ft launch: rank 0 exited with code 1; stopping the other ranks"), "{log}");
    assert!(log.contains("Traceback (most recent call last)") && log.contains("ZeroDivisionError: division by zero"), "{log}");
    let log = refusal(&prompts, &["--reward", &reward("short"), "--batch-size", "4"]);
    assert!(log.contains(&format!("reward function {} returned 3 rewards for 4 completions", reward("short"))), "{log}");
    let log = refusal(&no_prompt, &["--reward", &reward("short"), "--batch-size", "4"]);
    assert!(log.contains(&format!("{} line 2: no \"prompt\"", no_prompt.display())), "{log}");
    let log = refusal(&prompts, &["--reward", "/nonexistent/rewards.py:f", "--batch-size", "4"]);
    assert!(log.contains("reward `/nonexistent/rewards.py:f`: no such file /nonexistent/rewards.py"), "{log}");
    let log = refusal(&prompts, &["--batch-size", "4"]);
    assert!(log.contains("task `grpo` needs at least one reward function: --reward FILE.py:FUNCTION"), "{log}");
    let log = refusal(&prompts, &["--reward", &reward("short"), "--batch-size", "3", "--nproc-per-node", "2"]);
    let said = "error: a generation of 6 completions (batch_size 3 x 2 ranks x task.steps_per_generation 1) is not a whole number of groups of task.num_generations 4";
    assert!(log.starts_with(said) && !log.contains("[rank"), "said before any rank starts: {log}");
}

/// A run killed after a step resumes (`--resume latest`) to the
/// uninterrupted run's steps and rollouts.jsonl rows, none repeated: at a
/// window's boundary (killed after step 3, in the window of steps 3 and 4,
/// resumed from step 2's checkpoint: that window is sampled again, its rows
/// replaced), and inside a window at 2 ranks (killed after step 2,
/// resumed from step 1's: the window's samples, kept by each rank, are
/// trained on again).
/// Without them the window is sampled again from the resumed weights, as
/// the warning says, and its rows replace the first ones.
#[test]
fn a_killed_run_resumes_at_and_inside_a_rollout_window() {
    if shared::skipped_without(&[shared::GPT2_TOKENIZER]) {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let model = common::tiny_chat_llama(dir.path());
    let (prompts, rewards) = (prompt_file(dir.path(), false), reward_file(dir.path()));
    // Windows of two steps of 4 completions (a prompt a step), each step saved; the reference's log-probabilities kept too.
    let case = Case { algorithm: "grpo", conversational: false, grad_accum: 1, options: json!({"steps_per_generation": 2, "beta": 0.04}) };
    // Inside a window at 2 ranks (micro-batches of 2: every rank must have kept its samples), which
    // train as 1 rank does (the test above).
    let run = |name: &str, resume: bool, fault: Option<&str>| {
        let out = dir.path().join(name);
        let ranks: &[&str] = if name == "boundary" || name == "whole" { &[] } else { &["--nproc-per-node", "2", "--batch-size", "2"] };
        let flags = [&["--max-steps", "4", "--save-every", "1"][..], ranks, if resume { &["--resume", "latest"] } else { &[] }].concat();
        let mut command = train_command(&model, &prompts, &rewards, &out, &case, &flags);
        if let Some(fault) = fault {
            command.env("FT_FAULT_INJECT", fault);
        }
        let output = command.output().unwrap();
        assert_eq!(output.status.success(), fault.is_none(), "{name}: {}", text(&output));
        text(&output)
    };
    run("whole", false, None);
    let (whole, whole_rollouts) = (steps(&dir.path().join("whole")), rollouts(&dir.path().join("whole")));
    assert_eq!((whole.len(), whole_rollouts.len()), (4, 16));
    for (name, killed_after, fault) in [("boundary", 3, "after-step:3"), ("inside", 2, "after-step:2")] {
        run(name, false, Some(fault));
        if name == "inside" {
            let copy = std::process::Command::new("cp").arg("-a").arg(dir.path().join(name)).arg(dir.path().join("unkept")).status().unwrap();
            assert!(copy.success());
        }
        let log = run(name, true, None);
        let restored = log.contains("resuming inside the rollout window that starts at step 1: its samples kept in rollout_window/ are trained on again");
        assert!(restored == (name == "inside") && !log.contains("sampled again"), "{name}: {log}");
        let out = dir.path().join(name);
        let resumed = steps(&out);
        // metrics.jsonl continues from the checkpoint: its last steps are the resumed run's.
        let from = killed_after - 1;
        assert_equal_steps(&resumed[resumed.len() - (4 - from)..], &whole[from..], &[&FIGURES[..], &["kl"]].concat(), name);
        assert_equal_rollouts(&rollouts(&out), &whole_rollouts, name);
    }
    std::fs::remove_dir_all(dir.path().join("unkept/rollout_window")).unwrap();
    let log = run("unkept", true, None);
    assert!(log.contains("resuming at step 1, inside the rollout window that starts at step 1, with no samples kept for it"), "{log}");
    let rows = rollouts(&dir.path().join("unkept"));
    let row_steps: Vec<u64> = rows.iter().map(|row| row["step"].as_u64().unwrap()).collect();
    assert_eq!(row_steps, [[1; 8], [3; 8]].concat());
    let completions = |rows: &[Value]| rows[..8].iter().map(|row| row["completion_ids"].clone()).collect::<Vec<_>>();
    assert_ne!(completions(&rows), completions(&whole_rollouts), "sampled again from step 1's weights");
}

//! Extractive question answering end to end on the shared SQuAD v2.0 file: a
//! small BERT made by `ft init-model` (random weights, its own WordPiece
//! vocabulary) is fine-tuned on the file's first 64 questions and evaluated
//! on the same ones — from scratch it cannot generalise in a CPU test's
//! minute, but it must learn them: eval F1 rises; every question gets a
//! prediction, and the scores equal the official v2.0 evaluation's
//! (transformers 4.x's squad_metrics) on ft's predictions and null odds.
//! Bad inputs give clear messages.

use crate::common;
use common::{ft, shared, small_bert, text};
use serde_json::Value;
use std::path::Path;
use std::process::Command;

/// What transformers' copy of the official SQuAD v2.0 evaluation gives for
/// `predictions` with `null_odds` as the no-answer probabilities.
fn official_scores(squad: &Path, predictions: &Path, null_odds: &Path) -> Value {
    let scripts = Path::new(env!("CARGO_MANIFEST_DIR")).join("plugins/data/tests/python");
    let wheels = Path::new(env!("CARGO_MANIFEST_DIR")).join(".venv/reference");
    let script = "import json, sys\n\
sys.path.insert(0, sys.argv[1])\n\
from squad_eval_reference import load_squad_metrics, load_examples\n\
metrics = load_squad_metrics(sys.argv[2])\n\
preds, odds = json.load(open(sys.argv[4])), json.load(open(sys.argv[5]))\n\
examples = [e for e in load_examples(sys.argv[3]) if e.qas_id in preds]\n\
print(json.dumps(metrics.squad_evaluate(examples, preds, odds, 1.0)))";
    let args = [scripts.as_path(), wheels.as_path(), squad, predictions, null_odds].map(|p| p.to_str().unwrap().to_string());
    let output = Command::new("python").args(["-c", script]).args(args).output().expect("python (source scripts/env.sh)");
    assert!(output.status.success(), "{}", text(&output));
    serde_json::from_slice(output.stdout.split(|b| *b == b'\n').rev().find(|l| !l.is_empty()).unwrap()).unwrap()
}

#[test]
fn a_small_bert_learns_squad_v2_and_its_scores_follow_the_official_evaluation() {
    if shared::skipped_without(&[shared::SQUAD]) {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let squad = shared::path(shared::SQUAD);
    let model = small_bert(dir.path(), false);
    let out = dir.path().join("run");
    let output = ft()
        .args(["train", "--task", "extractive_qa", "--model", model.to_str().unwrap()])
        .args(["--train-file", squad.to_str().unwrap(), "--eval-file", squad.to_str().unwrap(), "--train-samples", "64", "--eval-samples", "64"])
        .args(["--max-seq-len", "256", "--set", "task.doc_stride=64", "--epochs", "16", "--batch-size", "8", "--lr", "2e-3"])
        .args(["--nproc-per-node", "2", "--output-dir", out.to_str().unwrap(), "--set", "train.warmup_ratio=0.05"])
        .output()
        .unwrap();
    let log = text(&output);
    assert!(output.status.success(), "{log}");
    let summary: Value = serde_json::from_str(&std::fs::read_to_string(out.join("summary.json")).unwrap()).unwrap();
    let epochs = summary["epochs"].as_array().unwrap();
    let f1 = |e: &Value| e["scores"]["f1"].as_f64().unwrap();
    let last = epochs.last().unwrap();
    assert!(f1(last) > f1(&epochs[0]) + 5.0, "eval F1 did not rise: {:?}", epochs.iter().map(f1).collect::<Vec<_>>());
    // Answering "no answer" everywhere raises F1 too (to 59 here, the share of unanswerable questions): the
    // answerable questions' F1 must rise as well (0-4 after the first epoch, 54-69 after the last with seeds 0, 7, 123).
    let answered = |e: &Value| e["scores"]["HasAns_f1"].as_f64().unwrap();
    assert!(answered(last) > answered(&epochs[0]) + 30.0, "answerable questions' F1 did not rise: {:?}", epochs.iter().map(answered).collect::<Vec<_>>());
    let scores = &last["scores"];
    for key in ["exact", "f1", "HasAns_exact", "HasAns_f1", "NoAns_exact", "NoAns_f1", "best_f1", "best_f1_thresh"] {
        assert!(scores[key].is_number(), "summary scores lack {key}: {scores}");
    }
    assert!(log.contains("HasAns_f1"), "the summary table shows the QA scores: {log}");

    // Every evaluated question has a prediction, and the official rules give ft's scores.
    let predictions: Value = serde_json::from_str(&std::fs::read_to_string(out.join("predictions.json")).unwrap()).unwrap();
    assert_eq!(predictions.as_object().unwrap().len(), 64);
    assert_eq!(scores["total"], 64.0);
    // The official rules over the questions evaluated.
    let official = official_scores(&squad, &out.join("predictions.json"), &out.join("null_odds.json"));
    for (key, value) in official.as_object().unwrap() {
        let ours = scores[key].as_f64().unwrap_or_else(|| panic!("ft has no {key}: {scores}"));
        assert!((ours - value.as_f64().unwrap()).abs() < 1e-9, "{key}: ft {ours} vs official {value}");
    }
}

#[test]
fn bad_question_answering_inputs_get_clear_messages() {
    if shared::skipped_without(&[shared::SQUAD]) {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let model = small_bert(dir.path(), true);
    let run = |args: &[&str]| {
        let output = ft()
            .args(["train", "--model", model.to_str().unwrap(), "--nproc-per-node", "1", "--epochs", "1", "--batch-size", "4"])
            // Within the small BERT's 256 positions.
            .args(["--max-seq-len", "64", "--output-dir", dir.path().join("out").to_str().unwrap()])
            // Each call is a run of its own in the one directory.
            .arg("--overwrite-output-dir")
            .args(args)
            .output()
            .unwrap();
        (output.status.success(), text(&output))
    };
    // A question longer than a window: skipped, counted and said; the others train.
    let squad = serde_json::json!({"version": "v2.0", "data": [{"title": "T", "paragraphs": [{
        "context": "The river flows through the old town near the harbour.",
        "qas": [
            {"id": "long", "question": "what ".repeat(80), "answers": [{"text": "river", "answer_start": 4}], "is_impossible": false},
            {"id": "bad-offset", "question": "Which river?", "answers": [{"text": "river", "answer_start": 9}], "is_impossible": false},
            {"id": "q1", "question": "What flows?", "answers": [{"text": "The river", "answer_start": 0}], "is_impossible": false},
            {"id": "q2", "question": "Where?", "answers": [{"text": "the old town", "answer_start": 24}], "is_impossible": false},
            {"id": "q3", "question": "Near what?", "answers": [{"text": "the harbour", "answer_start": 42}], "is_impossible": false},
            {"id": "q4", "question": "Is there a bridge?", "answers": [], "is_impossible": true}]}]}]});
    let file = dir.path().join("small.json");
    std::fs::write(&file, squad.to_string()).unwrap();
    let (ok, log) = run(&["--train-file", file.to_str().unwrap(), "--eval-file", file.to_str().unwrap(), "--set", "task.doc_stride=16"]);
    assert!(ok, "{log}");
    assert!(log.contains("1 training question(s) skipped: too long to leave room for the context in a 64-token window"), "{log}");
    assert!(log.contains("answer \"river\" is not at offset 9 of its context"), "{log}");
    let predictions: Value = serde_json::from_str(&std::fs::read_to_string(dir.path().join("out/predictions.json")).unwrap()).unwrap();
    assert_eq!(predictions["long"], "", "a skipped question predicts no answer");
    // The evaluation counts the questions it scored (the bad offset's left out), not their windows.
    let metrics = std::fs::read_to_string(dir.path().join("out/metrics.jsonl")).unwrap();
    let evaluations: Vec<Value> = metrics.lines().map(|line| serde_json::from_str::<Value>(line).unwrap()).filter(|record| record.get("eval_samples").is_some()).collect();
    assert_eq!(evaluations.len(), 1, "{metrics}");
    assert_eq!(evaluations[0]["eval_samples"], 5.0, "{metrics}");
    // data.range counts the file's questions, not their windows: 1:6 leaves out the long one.
    let slice = ["--set", "data.range=1:6", "--set", "train.schedule=constant"];
    let (ok, log) = run(&[&["--train-file", file.to_str().unwrap(), "--set", "task.doc_stride=16"][..], &slice].concat());
    assert!(ok && log.contains("data.range 1:6 takes questions 1 to 5 of its 6"), "{log}");
    assert!(log.contains("small.json: SQuAD data (the task's), 6 questions in 1 articles: 4 questions (1 with bad offsets skipped)") && !log.contains("too long"), "{log}");
    let (ok, log) = run(&["--train-file", file.to_str().unwrap(), "--set", "task.doc_stride=16", "--set", "data.range=4:9"]);
    assert!(!ok && log.contains("data.range 4:9 is not within") && log.contains("small.json: it has 6 questions"), "{log}");

    // A tokenizer that cannot make BERT's windows (the demo's byte-level BPE has no [CLS]) is refused up front.
    let bpe = ft_data::demo::write(&dir.path().join("bpe"), 5, 2, 0).unwrap().tokenizer;
    let (ok, log) = run(&["--train-file", file.to_str().unwrap(), "--tokenizer", bpe.to_str().unwrap()]);
    assert!(!ok && log.contains("bpe/tokenizer.json") && log.contains("[CLS]"), "{log}");
    // The wrong task for the model's head.
    let (ok, log) = run(&["--train-file", file.to_str().unwrap(), "--task", "causal_lm"]);
    assert!(!ok && log.contains("task `causal_lm` trains a causal_lm head, but this bert model has a question_answering head"), "{log}");
    let (ok, log) = run(&["--train-file", file.to_str().unwrap(), "--task", "extractive_qa", "--set", "task.doc_strid=4"]);
    assert!(!ok && log.contains("unknown field `doc_strid`"), "{log}");
}

//! The embedded demo (`make demo`, the main job on a fresh machine) end to
//! end. Its own file so that libtest, which runs tests in the order of
//! their names, starts this longest test among the first: begun near the
//! end, it ran alone while the other test thread had nothing left.

use serde_json::Value;
use std::path::Path;
use std::process::Command;

use crate::common::{ft, losses, text};

/// `make demo` as a newcomer runs it: every default, the whole schedule.
#[test]
fn the_demo_learns_to_read_answers_from_the_context_and_writes_its_outputs() {
    let dir = tempfile::tempdir().unwrap();
    let output = ft().args(["train", "--output-dir", dir.path().to_str().unwrap()]).output().unwrap();
    let log = text(&output);
    assert!(output.status.success(), "{log}");
    assert!(log.contains("== ft train summary ==") && log.contains("memory rank 1 (process RSS)"), "{log}");
    let summary: Value = serde_json::from_str(&std::fs::read_to_string(dir.path().join("summary.json")).unwrap()).unwrap();
    assert_eq!(summary["world_size"], 2);
    let epochs = summary["epochs"].as_array().unwrap();
    let eval_loss = |e: &Value| e["eval_loss"].as_f64().unwrap();
    assert!(eval_loss(&epochs[1]) < eval_loss(&epochs[0]), "eval loss did not fall: {epochs:?}");
    // Evaluation questions are about countries, names and rivers that never
    // occur in training: an exact answer is read from the context.
    let em = epochs.last().unwrap()["scores"]["em"].as_f64().unwrap();
    assert!(em >= 50.0, "the demo's final EM is {em}, below 50: {epochs:?}");
    let predictions: Value = serde_json::from_str(&std::fs::read_to_string(dir.path().join("predictions.json")).unwrap()).unwrap();
    assert!(predictions.as_object().unwrap().len() > 100, "every eval question has a prediction");
    // TensorBoard's own reader sees the same losses as metrics.jsonl.
    let python = Path::new(env!("CARGO_MANIFEST_DIR")).join(".venv/bin/python");
    let script = "import json, sys\n\
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator\n\
ea = EventAccumulator(sys.argv[1]); ea.Reload()\n\
print(json.dumps([[e.step, e.value] for e in ea.Scalars('loss')]))";
    let output = Command::new(python).args(["-c", script, dir.path().join("tensorboard").to_str().unwrap()]).output().unwrap();
    assert!(output.status.success(), "{}", text(&output));
    let scalars: Vec<(u64, f64)> = serde_json::from_slice(&output.stdout).unwrap();
    let expected = losses(dir.path());
    assert_eq!(scalars.len(), expected.len());
    for ((step, value), loss) in scalars.iter().zip(&expected) {
        assert!((value - loss).abs() <= 1e-6 * loss.abs(), "step {step}: {value} vs {loss}");
    }
    assert_eq!(scalars.last().unwrap().0, expected.len() as u64);

    // The exported model loads back and has the demo's architecture.
    let model = ft_models::hf::load_model(&dir.path().join("final")).unwrap();
    assert_eq!(model.model_type(), "bloom");
    assert!(dir.path().join("final/tokenizer.json").exists());
}

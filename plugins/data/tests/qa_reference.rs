//! ft's extractive question answering data side against transformers' own
//! code, on the whole shared SQuAD v2.0 file: the reference scripts under
//! tests/python/ transcribe run_qa.py and use transformers' fast
//! tokenizer, get ft's results as files and fail on any difference.
//!
//! `python` must be the project venv's (`source scripts/env.sh`); without it
//! these tests fail, they are not skipped.

use ft_data::qa::features::{Features, QaFeaturizer, TrainFeature, ValidationFeature, Window, WindowConfig};
use ft_data::qa::wordpiece::train_bert_tokenizer;
use ft_data::squad::{self, QaExample};
use serde_json::{json, Value};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;

const VOCAB_SIZE: usize = 3000;
/// run_qa.py's defaults, and short windows that overflow many times.
const SETTINGS: [WindowConfig; 2] =
    [WindowConfig { max_seq_length: 384, doc_stride: 128 }, WindowConfig { max_seq_length: 128, doc_stride: 32 }];
fn shared_squad() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../../shared/data/squad/squad-v2.0-dev-5-articles.json")
}

/// What the tests share, made once: the shared file's questions
/// (unanswerable ones included), ft's BERT tokenizer trained on its
/// contexts and questions, and the features in each setting.
struct Shared {
    examples: Vec<QaExample>,
    tokenizer_json: String,
    features: Vec<(Features<TrainFeature>, Features<ValidationFeature>)>,
}

fn shared() -> &'static Shared {
    static SHARED: OnceLock<Shared> = OnceLock::new();
    SHARED.get_or_init(|| {
        let (examples, stats) = squad::read(&shared_squad(), true).unwrap();
        assert_eq!((stats.questions, stats.bad_offsets_skipped), (examples.len(), 0));
        let mut contexts: Vec<&str> = examples.iter().map(|e| e.context.as_str()).collect();
        contexts.dedup();
        let texts = contexts.into_iter().chain(examples.iter().map(|e| e.question.as_str()));
        let tokenizer = train_bert_tokenizer(texts, VOCAB_SIZE).unwrap();
        // Through a file, as a training run loads it.
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("tokenizer.json");
        tokenizer.save(&path, false).unwrap();
        let features = SETTINGS
            .iter()
            .map(|&config| {
                let featurizer = QaFeaturizer::from_file(&path, config).unwrap();
                let train = featurizer.prepare_train_features(&examples);
                let validation = featurizer.prepare_validation_features(&examples);
                (train, validation)
            })
            .collect();
        let tokenizer_json = std::fs::read_to_string(&path).unwrap();
        Shared { examples, tokenizer_json, features }
    })
}

/// Runs a reference script with `args`; its failure (or a missing
/// `python`) fails the test with the script's output.
fn run_reference(script: &str, args: &[&Path]) {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/python").join(script);
    let output = Command::new("python").arg(&script).args(args).output().unwrap_or_else(|e| {
        panic!(
            "cannot run `python` ({e}): these tests need the project venv's python (torch, transformers) \
             first on PATH: run scripts/setup.sh, then `source scripts/env.sh`"
        )
    });
    let (stdout, stderr) = (String::from_utf8_lossy(&output.stdout), String::from_utf8_lossy(&output.stderr));
    assert!(output.status.success(), "{} failed ({}):\n{stdout}\n{stderr}", script.display(), output.status);
    println!("{stdout}");
}

fn write_json(path: &Path, value: &Value) {
    std::fs::write(path, serde_json::to_vec(value).unwrap()).unwrap();
}

/// The windows' model inputs as columns, like a tokenizer's batch output.
fn window_columns<'a>(windows: impl Iterator<Item = &'a Window> + Clone) -> Value {
    json!({
        "input_ids": windows.clone().map(|w| &w.input_ids).collect::<Vec<_>>(),
        "token_type_ids": windows.clone().map(|w| &w.token_type_ids).collect::<Vec<_>>(),
        "attention_mask": windows.map(|w| &w.attention_mask).collect::<Vec<_>>(),
    })
}

fn train_columns(features: &[TrainFeature]) -> Value {
    let mut columns = window_columns(features.iter().map(|f| &f.window));
    columns["example_index"] = json!(features.iter().map(|f| f.example_index).collect::<Vec<_>>());
    columns["start_positions"] = json!(features.iter().map(|f| f.start_position).collect::<Vec<_>>());
    columns["end_positions"] = json!(features.iter().map(|f| f.end_position).collect::<Vec<_>>());
    columns
}

fn validation_columns(features: &[ValidationFeature], examples: &[QaExample]) -> Value {
    let mut columns = window_columns(features.iter().map(|f| &f.window));
    columns["example_id"] = json!(features.iter().map(|f| &examples[f.example_index].id).collect::<Vec<_>>());
    columns["offset_mapping"] = json!(features.iter().map(|f| &f.offset_mapping).collect::<Vec<_>>());
    columns
}

/// (a) Every window of every question, for training and for evaluation, in
/// both window settings, equals run_qa.py's with transformers' tokenizer
/// loaded from ft's tokenizer.json.
#[test]
fn features_equal_run_qa_py() {
    let shared = shared();
    let mut settings = vec![];
    for (config, (train, validation)) in SETTINGS.iter().zip(&shared.features) {
        assert_eq!((train.skipped.len(), validation.skipped.len()), (0, 0));
        assert!(train.features.len() > shared.examples.len(), "some contexts must need several windows");
        settings.push(json!({
            "max_seq_length": config.max_seq_length,
            "doc_stride": config.doc_stride,
            "train": train_columns(&train.features),
            "validation": validation_columns(&validation.features, &shared.examples),
        }));
    }
    let dir = tempfile::tempdir().unwrap();
    let tokenizer = dir.path().join("tokenizer.json");
    std::fs::write(&tokenizer, &shared.tokenizer_json).unwrap();
    let ids: Vec<&str> = shared.examples.iter().map(|e| e.id.as_str()).collect();
    let ft_features = dir.path().join("ft_features.json");
    write_json(&ft_features, &json!({"example_ids": ids, "settings": settings}));
    run_reference("qa_features_reference.py", &[&shared_squad(), &tokenizer, &ft_features]);
}

//! ft's extractive question answering data side against transformers' own
//! code, on the whole shared SQuAD v2.0 file: the reference scripts under
//! tests/python/ transcribe run_qa.py and utils_qa.py, use transformers'
//! fast tokenizer and the official v2.0 evaluation, get ft's results as
//! files and fail on any difference.
//!
//! Without the shared data they are skipped (tests/common/shared.rs).
//! `python` must be the project venv's (`source scripts/env.sh`); without it
//! these tests fail, they are not skipped. The evaluation test also needs
//! the transformers 4.46.3 wheel scripts/setup.sh downloads into
//! .venv/reference (or a directory named by FT_REFERENCE_WHEELS).

use ft_data::qa::features::{Features, QaFeaturizer, TrainFeature, ValidationFeature, Window, WindowConfig};
use ft_data::qa::postprocess::{
    null_odds, postprocess_qa_predictions, prediction_texts, PostprocessConfig, QaPrediction,
};
use ft_data::qa::squad_eval::{evaluate_v1, evaluate_v2, DEFAULT_NA_PROB_THRESH};
use ft_data::qa::wordpiece::train_bert_tokenizer;
use ft_data::squad::{self, QaExample};
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde_json::{json, Value};
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;

const VOCAB_SIZE: usize = 3000;
/// run_qa.py's defaults, and short windows that overflow many times.
const SETTINGS: [WindowConfig; 2] =
    [WindowConfig { max_seq_length: 384, doc_stride: 128 }, WindowConfig { max_seq_length: 128, doc_stride: 32 }];
/// The setting whose evaluation windows get random logits: several windows
/// for many questions, so the null score is often a minimum over windows.
const LOGITS_SETTING: usize = 1;

/// The project's shared test data (tests/common/shared.rs): these tests read its SQuAD file.
#[path = "../../../tests/common/shared.rs"]
mod shared_data;

fn shared_squad() -> PathBuf {
    shared_data::path(shared_data::SQUAD)
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
        let (examples, stats) = squad::read(&shared_squad(), true, None).unwrap();
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

/// A small SQuAD file of edge cases: a context of common words (each one
/// token), then accented and CJK ones, asked for each of its words, so that
/// in some windows the answer starts in the last context token (where
/// run_qa.py's walk runs on through [SEP] and padding); plus a question with
/// leading whitespace and an unanswerable one.
fn write_edge_cases(path: &Path, context: &str) {
    let mut questions = vec![];
    let mut offset = 0;
    for (index, word) in context.split(' ').enumerate() {
        let question =
            if index == 0 { format!("\u{3000} \t Which word is number {index}?") } else { format!("Word {index}?") };
        let answers = [json!({"text": word, "answer_start": offset})];
        questions.push(json!({"id": format!("word{index}"), "question": question, "answers": answers}));
        offset += word.chars().count() + 1;
    }
    questions.push(json!({"id": "impossible", "question": "Why?", "answers": [], "is_impossible": true}));
    let squad = json!({"version": "v2.0", "data": [{"title": "Edge cases",
        "paragraphs": [{"context": context, "qas": questions}]}]});
    write_json(path, &squad);
}

/// One SQuAD file's features in each setting, and its question ids.
fn dataset_json(
    squad_file: &Path,
    examples: &[QaExample],
    features: &[(Features<TrainFeature>, Features<ValidationFeature>)],
) -> Value {
    let settings: Vec<Value> = SETTINGS
        .iter()
        .zip(features)
        .map(|(config, (train, validation))| {
            assert_eq!((train.skipped.len(), validation.skipped.len()), (0, 0));
            json!({
                "max_seq_length": config.max_seq_length,
                "doc_stride": config.doc_stride,
                "train": train_columns(&train.features),
                "validation": validation_columns(&validation.features, examples),
            })
        })
        .collect();
    let ids: Vec<&str> = examples.iter().map(|e| e.id.as_str()).collect();
    json!({"squad_file": squad_file, "example_ids": ids, "settings": settings})
}

/// (a) Every window of every question, for training and for evaluation, in
/// both window settings, equals run_qa.py's with transformers' tokenizer
/// loaded from ft's tokenizer.json: on the shared file and on edge cases.
#[test]
fn features_equal_run_qa_py() {
    if shared_data::skipped_without(&[shared_data::SQUAD]) {
        return;
    }
    let shared = shared();
    let dir = tempfile::tempdir().unwrap();
    let tokenizer = dir.path().join("tokenizer.json");
    std::fs::write(&tokenizer, &shared.tokenizer_json).unwrap();
    let edge_cases = dir.path().join("edge_cases.json");
    let common_words = ["the", "of", "and", "in", "to", "was", "by", "for", "with", "as", "on", "from"];
    let context: Vec<&str> = common_words.iter().cycle().take(200).copied().collect();
    write_edge_cases(&edge_cases, &format!("{} Café Zürich, naïve 北京 and Škoda.", context.join(" ")));
    let (edge_examples, _) = squad::read(&edge_cases, true, None).unwrap();
    let edge_features: Vec<_> = SETTINGS
        .iter()
        .map(|&config| {
            let featurizer = QaFeaturizer::from_file(&tokenizer, config).unwrap();
            (featurizer.prepare_train_features(&edge_examples), featurizer.prepare_validation_features(&edge_examples))
        })
        .collect();
    // What the comparison must cover: contexts in several windows, and
    // answers in a window's last context token.
    let (short_windows, edge_short_windows) = (&shared.features[1].0.features, &edge_features[1].0.features);
    assert!(short_windows.len() > shared.examples.len() * 3 / 2);
    assert!(edge_short_windows.iter().any(|f| f.start_position > f.end_position));
    let datasets = [
        dataset_json(&shared_squad(), &shared.examples, &shared.features),
        dataset_json(&edge_cases, &edge_examples, &edge_features),
    ];
    let ft_features = dir.path().join("ft_features.json");
    write_json(&ft_features, &json!(datasets));
    run_reference("qa_features_reference.py", &[&tokenizer, &ft_features]);
}

/// Seeded random logits for every evaluation window, distinct within a
/// window (numpy's argsort orders ties arbitrarily): a shuffled grid in
/// [-4, 4) with a jitter. The [CLS] logits are raised by 0 to 6 so that the
/// null answer sometimes wins. For every 50th question the context's logits
/// sink below the rest, the start logits rising and the end logits falling
/// along the context, so that the few context tokens among the n best pair
/// ends before starts: no valid span, utils_qa.py's "empty" fallback.
fn random_logits(features: &[ValidationFeature]) -> (Vec<Vec<f32>>, Vec<Vec<f32>>) {
    let mut rng = ChaCha8Rng::seed_from_u64(2024);
    let length = features[0].offset_mapping.len();
    let mut logits = || -> Vec<f32> {
        let mut grid: Vec<usize> = (0..length).collect();
        grid.shuffle(&mut rng);
        grid.into_iter().map(|g| g as f32 * 8.0 / length as f32 - 4.0 + rng.gen::<f32>() / 100.0).collect()
    };
    let (mut starts, mut ends): (Vec<Vec<f32>>, Vec<Vec<f32>>) = features.iter().map(|_| (logits(), logits())).unzip();
    for ((feature, start), end) in features.iter().zip(&mut starts).zip(&mut ends) {
        let raise = (feature.example_index % 7) as f32;
        start[0] += raise;
        end[0] += raise / 2.0;
        if feature.example_index % 50 == 0 {
            for (position, offsets) in feature.offset_mapping.iter().enumerate() {
                if offsets.is_some() {
                    start[position] = -30.0 + position as f32 / 1000.0;
                    end[position] = -30.0 - position as f32 / 1000.0;
                }
            }
        }
    }
    (starts, ends)
}

/// ft's postprocessing of the random logits.
fn postprocess(logits: &(Vec<Vec<f32>>, Vec<Vec<f32>>), config: &PostprocessConfig) -> Vec<QaPrediction> {
    let shared = shared();
    let features = &shared.features[LOGITS_SETTING].1.features;
    let starts: Vec<&[f32]> = logits.0.iter().map(Vec::as_slice).collect();
    let ends: Vec<&[f32]> = logits.1.iter().map(Vec::as_slice).collect();
    postprocess_qa_predictions(&shared.examples, features, &starts, &ends, config).unwrap()
}

fn v2(null_score_diff_threshold: f32) -> PostprocessConfig {
    PostprocessConfig { version_2_with_negative: true, null_score_diff_threshold, ..Default::default() }
}

/// One postprocessing run for the reference: its options and ft's results.
fn run_json(config: &PostprocessConfig, predictions: &[QaPrediction]) -> Value {
    let nbest: Vec<(&str, Vec<Value>)> = predictions
        .iter()
        .map(|p| {
            let answers = p.nbest.iter().map(|a| {
                json!({"text": a.text, "start_logit": a.start_logit, "end_logit": a.end_logit, "probability": a.probability})
            });
            (p.id.as_str(), answers.collect())
        })
        .collect();
    json!({
        "version_2_with_negative": config.version_2_with_negative,
        "null_score_diff_threshold": config.null_score_diff_threshold,
        "n_best_size": config.n_best_size,
        "max_answer_length": config.max_answer_length,
        "predictions": predictions.iter().map(|p| (&p.id, &p.text)).collect::<Vec<_>>(),
        "null_odds": null_odds(predictions),
        "nbest": nbest,
    })
}

/// (b) Predictions, null odds and n-best lists equal utils_qa.py's on the
/// same windows and logits, in v1 and in v2 with several thresholds.
#[test]
fn postprocessing_equals_utils_qa_py() {
    if shared_data::skipped_without(&[shared_data::SQUAD]) {
        return;
    }
    let shared = shared();
    let features = &shared.features[LOGITS_SETTING].1.features;
    let logits = random_logits(features);
    let runs: Vec<Value> = [PostprocessConfig::default(), v2(0.0), v2(2.5), v2(-1.5)]
        .iter()
        .map(|config| {
            let predictions = postprocess(&logits, config);
            // The logits must reach the fallback, and in v2 both decisions.
            let count = |text: &str| predictions.iter().filter(|p| p.text == text).count();
            if config.version_2_with_negative {
                assert!(0 < count("") && count("") < predictions.len(), "the null answer never or always wins");
            } else {
                assert!(count("empty") > 0, "no question reaches the \"empty\" fallback");
            }
            run_json(config, &predictions)
        })
        .collect();
    let examples: Vec<Value> = shared.examples.iter().map(|e| json!({"id": e.id, "context": e.context})).collect();
    let windows: Vec<Value> = features
        .iter()
        .map(|f| json!({"example_id": shared.examples[f.example_index].id, "offset_mapping": f.offset_mapping}))
        .collect();
    let dir = tempfile::tempdir().unwrap();
    let ft_postprocess = dir.path().join("ft_postprocess.json");
    let max_seq_length = SETTINGS[LOGITS_SETTING].max_seq_length;
    write_json(
        &ft_postprocess,
        &json!({"examples": examples, "features": windows, "max_seq_length": max_seq_length, "runs": runs}),
    );
    let logits_file = dir.path().join("logits.f32");
    let bytes: Vec<u8> = logits.0.iter().chain(&logits.1).flatten().flat_map(|x| x.to_le_bytes()).collect();
    std::fs::write(&logits_file, bytes).unwrap();
    run_reference("qa_postprocess_reference.py", &[&ft_postprocess, &logits_file]);
}

/// Predictions made to exercise the normalisation: exact, with articles and
/// punctuation around, partial, empty, only articles, an article between
/// non-ASCII dashes (which the official regex removes, leaving two tokens),
/// non-ASCII quotes, a piece of the context; no-answer probabilities with
/// many ties.
fn crafted_predictions(examples: &[QaExample]) -> (HashMap<String, String>, Vec<(String, f64)>) {
    let predictions = examples
        .iter()
        .enumerate()
        .map(|(index, example)| {
            let gold = example.answers.first().map_or("", String::as_str);
            let first_word = gold.split(' ').next().unwrap_or("");
            let text = match index % 8 {
                0 => gold.to_string(),
                1 => format!("The {gold}!"),
                2 => String::new(),
                3 => first_word.to_string(),
                4 => "a an the".to_string(),
                5 => format!("{} \u{2014}the\u{2014} (approx.)", gold.to_uppercase()),
                6 => example.context.split(' ').take(3).collect::<Vec<_>>().join(" "),
                _ => format!("\u{201c}{gold}\u{201d}"),
            };
            (example.id.clone(), text)
        })
        .collect();
    let na_probs = examples.iter().enumerate().map(|(index, e)| (e.id.clone(), (index % 7) as f64 / 10.0)).collect();
    (predictions, na_probs)
}

/// One evaluation case: ft's v2.0 scores and v1.1 scores of the answerable
/// questions, with the inputs the reference needs.
fn evaluation_case(
    name: &str,
    predictions: &HashMap<String, String>,
    na_probs: Option<&[(String, f64)]>,
    na_prob_thresh: f64,
) -> Value {
    let examples = &shared().examples;
    let v2 = evaluate_v2(examples, predictions, na_probs, na_prob_thresh).unwrap();
    let answerable: Vec<QaExample> = examples.iter().filter(|e| !e.answers.is_empty()).cloned().collect();
    let v1 = evaluate_v1(&answerable, predictions).unwrap();
    json!({
        "name": name,
        "predictions": predictions,
        "na_probs": na_probs,
        "na_prob_thresh": na_prob_thresh,
        "v2": v2.to_json(),
        "v1": {"exact_match": v1.exact_match, "f1": v1.f1},
    })
}

/// (c) ft's SQuAD v2.0 scores equal the official evaluation's (transformers
/// 4.46.3's squad_metrics) for the postprocessed predictions of (b) and for
/// crafted ones; its v1.1 scores equal the mean best compute_exact and
/// compute_f1 over the answerable questions.
#[test]
fn squad_scores_equal_the_official_evaluation() {
    if shared_data::skipped_without(&[shared_data::SQUAD]) {
        return;
    }
    let shared = shared();
    let logits = random_logits(&shared.features[LOGITS_SETTING].1.features);
    let postprocessed = postprocess(&logits, &v2(0.0));
    let (crafted, crafted_na_probs) = crafted_predictions(&shared.examples);
    let (texts, odds) = (prediction_texts(&postprocessed), null_odds(&postprocessed));
    let cases = json!([
        evaluation_case("postprocessed", &texts, Some(&odds), DEFAULT_NA_PROB_THRESH),
        evaluation_case("postprocessed, null odds above -1 mean no answer", &texts, Some(&odds), -1.0),
        evaluation_case("crafted", &crafted, Some(&crafted_na_probs), DEFAULT_NA_PROB_THRESH),
        evaluation_case("crafted, no-answer above 0.45", &crafted, Some(&crafted_na_probs), 0.45),
        evaluation_case("crafted, no na_probs", &crafted, None, DEFAULT_NA_PROB_THRESH),
    ]);
    let dir = tempfile::tempdir().unwrap();
    let ft_eval = dir.path().join("ft_eval.json");
    write_json(&ft_eval, &cases);
    let wheels = std::env::var_os("FT_REFERENCE_WHEELS")
        .map(PathBuf::from)
        .unwrap_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).join("../../.venv/reference"));
    run_reference("squad_eval_reference.py", &[&shared_squad(), &wheels, &ft_eval]);
}

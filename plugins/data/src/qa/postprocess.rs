//! From start/end logits to answer texts, as transformers'
//! examples/pytorch/question-answering/utils_qa.py's
//! `postprocess_qa_predictions` does it, rule for rule: for every example,
//! over all its windows, the `n_best_size` largest start and end logits are
//! paired, spans outside the context, reversed or longer than
//! `max_answer_length` are dropped, the best span's characters are cut
//! from the context; with `version_2_with_negative` the null answer (the
//! [CLS] score, the minimum over the windows) wins when it beats the best
//! span by more than `null_score_diff_threshold`.
//!
//! Scores are sums of f32 logits computed in f32, as numpy computes them on
//! the model's float32 outputs, so the null-score differences are the ones
//! utils_qa.py writes to null_odds.json, bit for bit.

use crate::qa::features::ValidationFeature;
use crate::squad::QaExample;
use anyhow::{bail, Result};
use std::collections::HashMap;

/// utils_qa.py's options and their run_qa.py defaults.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PostprocessConfig {
    /// SQuAD v2.0: the null answer "" may win.
    pub version_2_with_negative: bool,
    pub n_best_size: usize,
    /// In tokens.
    pub max_answer_length: usize,
    /// f32, the precision numpy compares the float32 score difference in.
    pub null_score_diff_threshold: f32,
}

impl Default for PostprocessConfig {
    fn default() -> Self {
        PostprocessConfig {
            version_2_with_negative: false,
            n_best_size: 20,
            max_answer_length: 30,
            null_score_diff_threshold: 0.0,
        }
    }
}

/// One entry of an example's n-best list (utils_qa.py's
/// nbest_predictions.json): the span's text, its logits and its softmax
/// probability over the list (computed in f64; numpy's is float32).
#[derive(Debug, Clone, PartialEq)]
pub struct NbestAnswer {
    pub text: String,
    pub start_logit: f32,
    pub end_logit: f32,
    pub probability: f64,
}

/// The prediction for one example.
#[derive(Debug, Clone, PartialEq)]
pub struct QaPrediction {
    pub id: String,
    /// The best span's text; "" when the null answer wins (v2 only).
    pub text: String,
    /// v2 only: the null score minus the best non-null span's score, what
    /// utils_qa.py writes to null_odds.json.
    pub null_score_diff: Option<f64>,
    /// Best first, at most `n_best_size` entries (plus the null answer in v2).
    pub nbest: Vec<NbestAnswer>,
}

/// A span (or the null answer at offsets (0, 0)) and its score.
#[derive(Debug, Clone, Copy)]
struct Candidate {
    offsets: (usize, usize),
    score: f32,
    start_logit: f32,
    end_logit: f32,
}

/// The predictions for `examples` from their evaluation windows (`features`,
/// as `prepare_validation_features` made them from the same examples) and
/// each window's start and end logits. An example without windows is an
/// error: postprocess only the examples that gave features.
pub fn postprocess_qa_predictions(
    examples: &[QaExample],
    features: &[ValidationFeature],
    start_logits: &[&[f32]],
    end_logits: &[&[f32]],
    config: &PostprocessConfig,
) -> Result<Vec<QaPrediction>> {
    if start_logits.len() != features.len() || end_logits.len() != features.len() {
        bail!(
            "got start logits for {} windows and end logits for {}, but {} windows",
            start_logits.len(),
            end_logits.len(),
            features.len()
        );
    }
    let mut windows_of_example = vec![vec![]; examples.len()];
    for (index, feature) in features.iter().enumerate() {
        let Some(windows) = windows_of_example.get_mut(feature.example_index) else {
            bail!(
                "window {index} belongs to example {}, but there are {} examples",
                feature.example_index,
                examples.len()
            );
        };
        windows.push(index);
    }
    examples
        .iter()
        .zip(&windows_of_example)
        .map(|(example, windows)| {
            let window_logits = windows.iter().map(|&w| (&features[w], start_logits[w], end_logits[w]));
            predict(example, window_logits, config)
        })
        .collect()
}

/// utils_qa.py's loop body for one example.
fn predict<'a>(
    example: &QaExample,
    windows: impl Iterator<Item = (&'a ValidationFeature, &'a [f32], &'a [f32])>,
    config: &PostprocessConfig,
) -> Result<QaPrediction> {
    let mut min_null: Option<Candidate> = None;
    let mut candidates = vec![];
    for (feature, start_logits, end_logits) in windows {
        let (Some(&cls_start), Some(&cls_end)) = (start_logits.first(), end_logits.first()) else {
            bail!("question {}: a window has no logits", example.id);
        };
        // The null answer's score is the minimum over the windows: all of
        // them must want it.
        let null_score = cls_start + cls_end;
        if min_null.is_none_or(|null| null.score > null_score) {
            min_null =
                Some(Candidate { offsets: (0, 0), score: null_score, start_logit: cls_start, end_logit: cls_end });
        }
        let offsets = &feature.offset_mapping;
        let end_indexes = largest(end_logits, config.n_best_size);
        for start in largest(start_logits, config.n_best_size) {
            for &end in &end_indexes {
                // Out of the window, or not context (question, special, padding).
                let (Some(Some(start_span)), Some(Some(end_span))) = (offsets.get(start), offsets.get(end)) else {
                    continue;
                };
                if end < start || end - start + 1 > config.max_answer_length {
                    continue;
                }
                candidates.push(Candidate {
                    offsets: (start_span.0, end_span.1),
                    score: start_logits[start] + end_logits[end],
                    start_logit: start_logits[start],
                    end_logit: end_logits[end],
                });
            }
        }
    }
    let Some(min_null) = min_null else {
        bail!("question {} has no windows: postprocess only the examples that gave features", example.id);
    };
    if config.version_2_with_negative {
        candidates.push(min_null);
    }
    // Python's sorted(reverse=True) is stable: equal scores keep their order.
    candidates.sort_by(|a, b| b.score.total_cmp(&a.score));
    candidates.truncate(config.n_best_size);
    // The null answer comes back when it fell out of the n best.
    if config.version_2_with_negative && !candidates.iter().any(|c| c.offsets == (0, 0)) {
        candidates.push(min_null);
    }

    let mut nbest: Vec<(String, Candidate)> =
        candidates.into_iter().map(|c| (char_slice(&example.context, c.offsets), c)).collect();
    // utils_qa.py: "In the very rare edge case we have not a single non-null
    // prediction, we create a fake prediction to avoid failure" - the text
    // "empty" with score and logits 0.
    if nbest.is_empty() || (nbest.len() == 1 && nbest[0].0.is_empty()) {
        let fake = Candidate { offsets: (0, 0), score: 0.0, start_logit: 0.0, end_logit: 0.0 };
        nbest.insert(0, ("empty".to_string(), fake));
    }
    let probabilities = softmax(&nbest.iter().map(|(_, c)| c.score).collect::<Vec<_>>());

    let (text, null_score_diff) = if config.version_2_with_negative {
        let Some((best_text, best)) = nbest.iter().find(|(text, _)| !text.is_empty()) else {
            bail!("question {}: every n-best span has an empty text", example.id);
        };
        let score_diff = min_null.score - best.start_logit - best.end_logit;
        let text = if score_diff > config.null_score_diff_threshold { String::new() } else { best_text.clone() };
        (text, Some(score_diff as f64))
    } else {
        (nbest[0].0.clone(), None)
    };
    let nbest = nbest
        .into_iter()
        .zip(probabilities)
        .map(|((text, c), probability)| NbestAnswer {
            text,
            start_logit: c.start_logit,
            end_logit: c.end_logit,
            probability,
        })
        .collect();
    Ok(QaPrediction { id: example.id.clone(), text, null_score_diff, nbest })
}

/// `np.argsort(logits)[-1 : -n - 1 : -1]`: the indices of the `n` largest
/// logits, largest first; equal logits higher index first, as reversing a
/// stable ascending sort gives.
fn largest(logits: &[f32], n: usize) -> Vec<usize> {
    let mut indices: Vec<usize> = (0..logits.len()).collect();
    indices.sort_by(|&a, &b| logits[b].total_cmp(&logits[a]).then(b.cmp(&a)));
    indices.truncate(n);
    indices
}

/// `context[start:end]` on a Python string: character indices, clamped.
fn char_slice(context: &str, (start, end): (usize, usize)) -> String {
    context.chars().skip(start).take(end.saturating_sub(start)).collect()
}

/// utils_qa.py's softmax with the max subtracted (LogSumExp trick).
fn softmax(scores: &[f32]) -> Vec<f64> {
    let max = scores.iter().copied().fold(f64::NEG_INFINITY, |m, s| m.max(s as f64));
    let exps: Vec<f64> = scores.iter().map(|&s| (s as f64 - max).exp()).collect();
    let sum: f64 = exps.iter().sum();
    exps.into_iter().map(|e| e / sum).collect()
}

/// `{id: text}`, predictions.json's content.
pub fn prediction_texts(predictions: &[QaPrediction]) -> HashMap<String, String> {
    predictions.iter().map(|p| (p.id.clone(), p.text.clone())).collect()
}

/// `{id: null score difference}` in example order, null_odds.json's
/// content (v2 predictions only); the na_probs of the v2.0 evaluation.
pub fn null_odds(predictions: &[QaPrediction]) -> Vec<(String, f64)> {
    predictions.iter().filter_map(|p| Some((p.id.clone(), p.null_score_diff?))).collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::qa::features::Window;

    /// "café" is characters 0..4, "in" 5..7, "zürich" 8..14, "now" 15..18.
    const CONTEXT: &str = "Café in Zürich now";

    fn example(id: &str) -> QaExample {
        QaExample {
            id: id.into(),
            title: "T".into(),
            question: "Where?".into(),
            context: CONTEXT.into(),
            answers: vec![],
            answer_start: None,
        }
    }

    /// An 8-token window: [CLS] question [SEP] then `spans` (context tokens),
    /// the rest [SEP] and padding.
    fn window(example_index: usize, spans: &[(usize, usize)]) -> ValidationFeature {
        let mut offset_mapping = vec![None; 3];
        offset_mapping.extend(spans.iter().map(|&span| Some(span)));
        offset_mapping.resize(8, None);
        let zeros = vec![0; 8];
        let window = Window { input_ids: zeros.clone(), token_type_ids: zeros.clone(), attention_mask: zeros };
        ValidationFeature { window, example_index, offset_mapping }
    }

    const WHOLE: [(usize, usize); 4] = [(0, 4), (5, 7), (8, 14), (15, 18)];
    const TAIL: [(usize, usize); 2] = [(8, 14), (15, 18)];

    fn run(windows: &[ValidationFeature], logits: &[([f32; 8], [f32; 8])], config: PostprocessConfig) -> QaPrediction {
        let starts: Vec<&[f32]> = logits.iter().map(|(s, _)| s.as_slice()).collect();
        let ends: Vec<&[f32]> = logits.iter().map(|(_, e)| e.as_slice()).collect();
        let mut predictions = postprocess_qa_predictions(&[example("q")], windows, &starts, &ends, &config).unwrap();
        assert_eq!(predictions.len(), 1);
        predictions.remove(0)
    }

    fn v2(threshold: f32) -> PostprocessConfig {
        PostprocessConfig { version_2_with_negative: true, null_score_diff_threshold: threshold, ..Default::default() }
    }

    #[test]
    fn best_valid_span_cut_by_characters() {
        // The best pair (1, 1) lies in the question and is skipped; (5, 5)
        // scores 9: "Zürich", cut by characters (bytes would give "Zür").
        let logits = ([0.0, 9.0, 0.0, 1.0, 0.0, 5.0, 2.0, 0.0], [0.0, 9.0, 0.0, 0.0, 1.0, 4.0, 3.0, 0.0]);
        let prediction = run(&[window(0, &WHOLE)], &[logits], PostprocessConfig::default());
        assert_eq!(prediction.text, "Zürich");
        assert_eq!(prediction.null_score_diff, None);
        assert_eq!((prediction.nbest[0].start_logit, prediction.nbest[0].end_logit), (5.0, 4.0));
        // Next: (5, 6) = 8, "Zürich now".
        let texts: Vec<&str> = prediction.nbest.iter().map(|a| a.text.as_str()).collect();
        assert_eq!(texts[..2], ["Zürich", "Zürich now"]);
        let total: f64 = prediction.nbest.iter().map(|a| a.probability).sum();
        assert!((total - 1.0).abs() < 1e-12);
        assert!(prediction.nbest.windows(2).all(|pair| pair[0].probability >= pair[1].probability));
    }

    #[test]
    fn spans_longer_than_max_answer_length_are_dropped() {
        // (3, 5) "Café in Zürich" scores 10 but is 3 tokens; (5, 5) scores 6.
        let logits = ([0.0, 0.0, 0.0, 5.0, 0.0, 1.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0, 0.0, 5.0, 1.0, 0.0]);
        let windows = [window(0, &WHOLE)];
        assert_eq!(run(&windows, &[logits], PostprocessConfig::default()).text, "Café in Zürich");
        let short = PostprocessConfig { max_answer_length: 2, ..Default::default() };
        assert_eq!(run(&windows, &[logits], short).text, "Zürich");
    }

    #[test]
    fn null_answer_wins_only_above_the_threshold() {
        // Null score 2 + 1 = 3; best span (5, 5) = 1.5 + 1 = 2.5; difference 0.5.
        let logits = ([2.0, 0.0, 0.0, 0.0, 0.0, 1.5, 0.0, 0.0], [1.0, 0.0, 0.0, 0.0, 0.0, 1.0, 0.0, 0.0]);
        let windows = [window(0, &WHOLE)];
        let at = |threshold| run(&windows, &[logits], v2(threshold));
        assert_eq!((at(0.0).text.as_str(), at(0.0).null_score_diff), ("", Some(0.5)));
        // Strictly greater: a difference equal to the threshold keeps the span.
        assert_eq!(at(0.5).text, "Zürich");
        assert_eq!(at(1.0).text, "Zürich");
        assert_eq!(at(0.0).nbest[0].text, "");
        // v1 ignores the null answer.
        assert_eq!(run(&windows, &[logits], PostprocessConfig::default()).text, "Zürich");
    }

    #[test]
    fn null_score_is_the_minimum_over_windows_and_spans_come_from_any() {
        let first = ([4.0, 0.0, 0.0, 0.0, 0.0, 1.0, 0.0, 0.0], [4.0, 0.0, 0.0, 0.0, 0.0, 1.0, 0.0, 0.0]);
        let second = ([1.0, 0.0, 0.0, 0.0, 3.0, 0.0, 0.0, 0.0], [1.0, 0.0, 0.0, 0.0, 3.0, 0.0, 0.0, 0.0]);
        let windows = [window(0, &WHOLE), window(0, &TAIL)];
        // Null: min(8, 2) = 2; best span "now" (second window, token 4) = 6.
        let prediction = run(&windows, &[first, second], v2(0.0));
        assert_eq!((prediction.text.as_str(), prediction.null_score_diff), ("now", Some(-4.0)));
        let null = prediction.nbest.iter().find(|a| a.text.is_empty()).unwrap();
        assert_eq!((null.start_logit, null.end_logit), (1.0, 1.0));
        // With one n-best slot the null answer falls out and is appended again.
        let one = PostprocessConfig { n_best_size: 1, ..v2(0.0) };
        let prediction = run(&windows, &[first, second], one);
        let texts: Vec<&str> = prediction.nbest.iter().map(|a| a.text.as_str()).collect();
        assert_eq!(texts, ["now", ""]);
        let expected = 1.0 / (1.0 + (-4.0f64).exp());
        assert!((prediction.nbest[0].probability - expected).abs() < 1e-12);
    }

    #[test]
    fn no_valid_span_gives_the_fake_empty_prediction() {
        // The 3 best starts are all outside the context.
        let logits =
            |cls: f32| ([cls, 5.0, 5.0, -9.0, -9.0, -9.0, -9.0, 5.0], [cls, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]);
        let windows = [window(0, &WHOLE)];
        let three = PostprocessConfig { n_best_size: 3, ..Default::default() };
        let prediction = run(&windows, &[logits(0.0)], three);
        assert_eq!(prediction.text, "empty");
        assert_eq!(prediction.nbest.len(), 1);
        // v2: the fake prediction's logits are 0, so the difference is the null score.
        let three_v2 = PostprocessConfig { n_best_size: 3, ..v2(0.0) };
        let prediction = run(&windows, &[logits(0.0)], three_v2);
        assert_eq!((prediction.text.as_str(), prediction.null_score_diff), ("empty", Some(0.0)));
        let prediction = run(&windows, &[logits(1.0)], three_v2);
        assert_eq!((prediction.text.as_str(), prediction.null_score_diff), ("", Some(2.0)));
        let texts: Vec<&str> = prediction.nbest.iter().map(|a| a.text.as_str()).collect();
        assert_eq!(texts, ["empty", ""]);
    }

    #[test]
    fn mismatched_inputs_are_errors() {
        let logits = [0.0f32; 8];
        let config = PostprocessConfig::default();
        let err = postprocess_qa_predictions(&[example("q")], &[window(0, &WHOLE)], &[], &[], &config).unwrap_err();
        assert!(err.to_string().contains("start logits for 0 windows and end logits for 0, but 1 windows"), "{err}");
        let examples = [example("q"), example("skipped")];
        let err =
            postprocess_qa_predictions(&examples, &[window(0, &WHOLE)], &[&logits], &[&logits], &config).unwrap_err();
        assert!(err.to_string().contains("question skipped has no windows"), "{err}");
    }

    #[test]
    fn official_file_contents() {
        let prediction = |id: &str, text: &str, diff| QaPrediction {
            id: id.into(),
            text: text.into(),
            null_score_diff: diff,
            nbest: vec![],
        };
        let predictions = [prediction("b", "x", Some(1.5)), prediction("a", "", Some(-2.0))];
        assert_eq!(prediction_texts(&predictions), HashMap::from([("b".into(), "x".into()), ("a".into(), "".into())]));
        assert_eq!(null_odds(&predictions), [("b".to_string(), 1.5), ("a".to_string(), -2.0)]);
    }
}

//! The official SQuAD scores, in percent as the scripts print them:
//! evaluate-v1.1.py's `exact_match` and `f1`, and evaluate-v2.0.py's
//! `exact`, `f1`, `total`, the `HasAns_*` / `NoAns_*` subsets and, given
//! no-answer probabilities, the best thresholds. Predictions are
//! predictions.json's `{id: text}`; no-answer probabilities the na_prob
//! file's `{id: float}` in file order (the order decides ties in
//! `find_best_thresh`), for instance utils_qa.py's null odds.
//!
//! The examples are the dataset: `answers` empty means unanswerable.

use crate::metrics::{answer_tokens, normalize, score, token_overlap_f1};
use crate::squad::QaExample;
use anyhow::{bail, Result};
use serde_json::json;
use std::collections::HashMap;

/// evaluate-v2.0.py's default `--na-prob-thresh`.
pub const DEFAULT_NA_PROB_THRESH: f64 = 1.0;

/// evaluate-v1.1.py's result.
#[derive(Debug, Clone, PartialEq)]
pub struct SquadV1Scores {
    pub exact_match: f64,
    pub f1: f64,
}

/// `exact`, `f1` and `total` of all questions or of a subset.
#[derive(Debug, Clone, PartialEq)]
pub struct EvalScores {
    pub exact: f64,
    pub f1: f64,
    pub total: usize,
}

/// `find_all_best_thresh`: the best scores any no-answer threshold gives.
#[derive(Debug, Clone, PartialEq)]
pub struct BestThresholds {
    pub best_exact: f64,
    pub best_exact_thresh: f64,
    pub best_f1: f64,
    pub best_f1_thresh: f64,
}

/// evaluate-v2.0.py's result.
#[derive(Debug, Clone, PartialEq)]
pub struct SquadV2Scores {
    pub all: EvalScores,
    /// Answerable questions, when there are some.
    pub has_ans: Option<EvalScores>,
    /// Unanswerable questions, when there are some.
    pub no_ans: Option<EvalScores>,
    /// Only when no-answer probabilities were given.
    pub best: Option<BestThresholds>,
}

impl SquadV2Scores {
    /// The script's output dictionary, with its key names.
    pub fn to_json(&self) -> serde_json::Value {
        let mut out = json!({"exact": self.all.exact, "f1": self.all.f1, "total": self.all.total});
        for (prefix, subset) in [("HasAns", &self.has_ans), ("NoAns", &self.no_ans)] {
            if let Some(s) = subset {
                out[format!("{prefix}_exact")] = json!(s.exact);
                out[format!("{prefix}_f1")] = json!(s.f1);
                out[format!("{prefix}_total")] = json!(s.total);
            }
        }
        if let Some(b) = &self.best {
            out["best_exact"] = json!(b.best_exact);
            out["best_exact_thresh"] = json!(b.best_exact_thresh);
            out["best_f1"] = json!(b.best_f1);
            out["best_f1_thresh"] = json!(b.best_f1_thresh);
        }
        out
    }
}

/// evaluate-v1.1.py: exact match and F1, each the best over the gold
/// answers, averaged over all questions; a question without a prediction
/// scores 0 (and is logged). Every question needs a gold answer.
pub fn evaluate_v1(examples: &[QaExample], predictions: &HashMap<String, String>) -> Result<SquadV1Scores> {
    if examples.is_empty() {
        bail!("no questions to evaluate");
    }
    let (mut exact_match, mut f1) = (0.0, 0.0);
    for example in examples {
        if example.answers.is_empty() {
            bail!("question {} has no gold answer: SQuAD v1.1 scores answerable questions only", example.id);
        }
        let Some(prediction) = predictions.get(&example.id) else {
            tracing::warn!("Unanswered question {} will receive score 0.", example.id);
            continue;
        };
        let (exact, overlap) = score(prediction, &example.answers);
        exact_match += exact;
        f1 += overlap;
    }
    let total = examples.len() as f64;
    Ok(SquadV1Scores { exact_match: 100.0 * exact_match / total, f1: 100.0 * f1 / total })
}

/// evaluate-v2.0.py's `compute_exact`.
pub fn compute_exact(gold: &str, prediction: &str) -> f64 {
    (normalize(gold) == normalize(prediction)) as u8 as f64
}

/// evaluate-v2.0.py's `compute_f1`: when either side has no tokens (a
/// no-answer), 1 if both have none, else 0.
pub fn compute_f1(gold: &str, prediction: &str) -> f64 {
    let (gold_tokens, predicted_tokens) = (answer_tokens(gold), answer_tokens(prediction));
    if gold_tokens.is_empty() || predicted_tokens.is_empty() {
        return (gold_tokens == predicted_tokens) as u8 as f64;
    }
    token_overlap_f1(&predicted_tokens, &gold_tokens)
}

/// One question's raw scores (`get_raw_scores`).
struct Scored<'a> {
    id: &'a str,
    has_answer: bool,
    exact: f64,
    f1: f64,
}

/// evaluate-v2.0.py's `main`: raw scores, the no-answer threshold
/// (`apply_no_ans_threshold`: a question whose no-answer probability is
/// above `na_prob_thresh` counts as answered "no answer"), then
/// `make_eval_dict` for all questions and each subset, and with `na_probs`
/// `find_all_best_thresh`. Every question needs a prediction (and a
/// no-answer probability when they are given), as the script does.
pub fn evaluate_v2(
    examples: &[QaExample],
    predictions: &HashMap<String, String>,
    na_probs: Option<&[(String, f64)]>,
    na_prob_thresh: f64,
) -> Result<SquadV2Scores> {
    let raw = raw_scores(examples, predictions)?;
    if raw.is_empty() {
        bail!("no questions to evaluate");
    }
    let na_prob_of: HashMap<&str, f64> = na_probs.unwrap_or_default().iter().map(|(id, p)| (id.as_str(), *p)).collect();
    if na_probs.is_some() {
        if let Some(missing) = raw.iter().find(|s| !na_prob_of.contains_key(s.id)) {
            bail!("no no-answer probability for question {}", missing.id);
        }
    }
    // apply_no_ans_threshold; without na_probs every probability is 0.0.
    let thresholded: Vec<(f64, f64)> = raw
        .iter()
        .map(|s| {
            let na_prob = na_prob_of.get(s.id).copied().unwrap_or(0.0);
            if na_prob > na_prob_thresh {
                let no_answer_right = (!s.has_answer) as u8 as f64;
                (no_answer_right, no_answer_right)
            } else {
                (s.exact, s.f1)
            }
        })
        .collect();
    let subset = |has_answer: bool| {
        let selected: Vec<(f64, f64)> =
            raw.iter().zip(&thresholded).filter(|(s, _)| s.has_answer == has_answer).map(|(_, t)| *t).collect();
        (!selected.is_empty()).then(|| make_eval_dict(&selected))
    };
    let best = na_probs.map(|na_probs| {
        let na_probs = python_dict(na_probs.iter().map(|(id, p)| (id.as_str(), *p)));
        let (best_exact, best_exact_thresh) = find_best_thresh(&raw, predictions, &na_probs, |s| s.exact);
        let (best_f1, best_f1_thresh) = find_best_thresh(&raw, predictions, &na_probs, |s| s.f1);
        BestThresholds { best_exact, best_exact_thresh, best_f1, best_f1_thresh }
    });
    Ok(SquadV2Scores { all: make_eval_dict(&thresholded), has_ans: subset(true), no_ans: subset(false), best })
}

/// `get_raw_scores`: per question (once per id, as the script's dicts
/// keep them) the best exact match and F1 over the gold answers whose
/// normalisation is not empty, or over [""] when none is.
fn raw_scores<'a>(examples: &'a [QaExample], predictions: &HashMap<String, String>) -> Result<Vec<Scored<'a>>> {
    let examples = python_dict(examples.iter().map(|e| (e.id.as_str(), e)));
    let missing: Vec<&str> = examples.iter().map(|(id, _)| *id).filter(|id| !predictions.contains_key(*id)).collect();
    if let Some(first) = missing.first() {
        bail!("no prediction for {} of {} questions, the first {first}", missing.len(), examples.len());
    }
    Ok(examples
        .into_iter()
        .map(|(id, example)| {
            let prediction = &predictions[id];
            let mut golds: Vec<&str> =
                example.answers.iter().map(String::as_str).filter(|a| !normalize(a).is_empty()).collect();
            if golds.is_empty() {
                golds.push("");
            }
            let best = |metric: fn(&str, &str) -> f64| golds.iter().map(|g| metric(g, prediction)).fold(0.0, f64::max);
            Scored { id, has_answer: !example.answers.is_empty(), exact: best(compute_exact), f1: best(compute_f1) }
        })
        .collect())
}

/// `make_eval_dict`: mean exact and F1 in percent, summed in order.
fn make_eval_dict(scores: &[(f64, f64)]) -> EvalScores {
    let total = scores.len();
    let sum = |pick: fn(&(f64, f64)) -> f64| scores.iter().map(pick).sum::<f64>();
    EvalScores { exact: 100.0 * sum(|s| s.0) / total as f64, f1: 100.0 * sum(|s| s.1) / total as f64, total }
}

/// `find_best_thresh`: walk the questions by increasing no-answer
/// probability (a stable sort, so file order breaks ties); answering up to
/// each one gains its score if answerable, loses 1 if unanswerable but
/// answered; the best running total (starting from answering none, which
/// gets every unanswerable question right) and the probability it was
/// reached at.
fn find_best_thresh(
    raw: &[Scored],
    predictions: &HashMap<String, String>,
    na_probs: &[(&str, f64)],
    score_of: fn(&Scored) -> f64,
) -> (f64, f64) {
    let scored: HashMap<&str, &Scored> = raw.iter().map(|s| (s.id, s)).collect();
    let mut current = raw.iter().filter(|s| !s.has_answer).count() as f64;
    let (mut best_score, mut best_thresh) = (current, 0.0);
    let mut by_probability = na_probs.to_vec();
    // Python compares -0.0 and 0.0 equal; total_cmp would order them.
    by_probability.sort_by(|a, b| (a.1 + 0.0).total_cmp(&(b.1 + 0.0)));
    for (id, na_prob) in by_probability {
        let Some(s) = scored.get(id) else { continue };
        current += if s.has_answer {
            score_of(s)
        } else if predictions[id].is_empty() {
            0.0
        } else {
            -1.0
        };
        if current > best_score {
            best_score = current;
            best_thresh = na_prob;
        }
    }
    (100.0 * best_score / raw.len() as f64, best_thresh)
}

/// A Python dict built from `(key, value)` pairs: one entry per key, at the
/// key's first position, with its last value.
fn python_dict<'a, T>(entries: impl Iterator<Item = (&'a str, T)>) -> Vec<(&'a str, T)> {
    let mut position: HashMap<&str, usize> = HashMap::new();
    let mut dict: Vec<(&str, T)> = vec![];
    for (key, value) in entries {
        match position.get(key) {
            Some(&at) => dict[at].1 = value,
            None => {
                position.insert(key, dict.len());
                dict.push((key, value));
            }
        }
    }
    dict
}

#[cfg(test)]
mod tests {
    use super::*;

    fn example(id: &str, answers: &[&str]) -> QaExample {
        QaExample {
            id: id.into(),
            title: "T".into(),
            question: "?".into(),
            context: "c".into(),
            answers: answers.iter().map(|a| a.to_string()).collect(),
            answer_start: (!answers.is_empty()).then_some(0),
        }
    }

    fn dataset() -> Vec<QaExample> {
        vec![
            example("q1", &["the Eiffel Tower", "Eiffel"]),
            example("q2", &["1889"]),
            example("q3", &[]),
            example("q4", &[]),
        ]
    }

    fn predictions(pairs: &[(&str, &str)]) -> HashMap<String, String> {
        pairs.iter().map(|(id, text)| (id.to_string(), text.to_string())).collect()
    }

    fn na_probs(pairs: &[(&str, f64)]) -> Vec<(String, f64)> {
        pairs.iter().map(|(id, p)| (id.to_string(), *p)).collect()
    }

    fn close(a: f64, b: f64) -> bool {
        (a - b).abs() < 1e-9
    }

    /// q1 exact (1, 1); q2 "in 1889" vs "1889": P 1/2, R 1, F1 2/3; q3 "" right; q4 wrong.
    const PREDICTIONS: [(&str, &str); 4] = [("q1", "Eiffel tower!"), ("q2", "in 1889"), ("q3", ""), ("q4", "Paris")];

    #[test]
    fn v2_scores_and_subsets_by_hand() {
        let scores = evaluate_v2(&dataset(), &predictions(&PREDICTIONS), None, DEFAULT_NA_PROB_THRESH).unwrap();
        assert_eq!(scores.all.total, 4);
        assert!(close(scores.all.exact, 50.0) && close(scores.all.f1, 100.0 * (1.0 + 2.0 / 3.0 + 1.0) / 4.0));
        let has_ans = scores.has_ans.clone().unwrap();
        assert!(close(has_ans.exact, 50.0) && close(has_ans.f1, 100.0 * (1.0 + 2.0 / 3.0) / 2.0) && has_ans.total == 2);
        let no_ans = scores.no_ans.clone().unwrap();
        assert!(close(no_ans.exact, 50.0) && close(no_ans.f1, 50.0) && no_ans.total == 2);
        assert_eq!(scores.best, None);
        let json = scores.to_json();
        assert_eq!(json["HasAns_total"], 2);
        assert!(json.get("best_f1").is_none());
        // Only answerable questions: no NoAns keys.
        let answerable = evaluate_v2(&dataset()[..2], &predictions(&PREDICTIONS), None, 1.0).unwrap();
        assert_eq!(answerable.no_ans, None);
        assert!(answerable.to_json().get("NoAns_exact").is_none());
    }

    #[test]
    fn no_answer_threshold_and_best_thresholds_by_hand() {
        let probs = na_probs(&[("q1", 0.1), ("q2", 0.9), ("q3", 0.8), ("q4", 0.95)]);
        let preds = predictions(&PREDICTIONS);
        // Above 0.85: q2 (answerable) now scores 0, q4 (unanswerable) 1.
        let scores = evaluate_v2(&dataset(), &preds, Some(&probs), 0.85).unwrap();
        assert!(close(scores.all.exact, 75.0) && close(scores.all.f1, 75.0));
        // Best thresholds: start at 2 (both unanswerable right); by probability
        // q1 +1 = 3 at 0.1, q3 +0, q2 +0 exact / +2/3 F1 (3.67 at 0.9), q4 -1.
        let best = scores.best.unwrap();
        assert!(close(best.best_exact, 75.0) && close(best.best_exact_thresh, 0.1));
        assert!(close(best.best_f1, 100.0 * (3.0 + 2.0 / 3.0) / 4.0) && close(best.best_f1_thresh, 0.9));
    }

    #[test]
    fn file_order_breaks_ties_in_the_best_threshold() {
        let preds = predictions(&PREDICTIONS);
        let best_exact = |order: &[&str]| {
            let probs: Vec<(String, f64)> = order.iter().map(|id| (id.to_string(), 0.2)).collect();
            evaluate_v2(&dataset(), &preds, Some(&probs), 1.0).unwrap().best.unwrap().best_exact
        };
        // q4 first: 2 - 1 + 1 never beats 2. q1 first: 3.
        assert!(close(best_exact(&["q4", "q1", "q2", "q3"]), 50.0));
        assert!(close(best_exact(&["q1", "q4", "q2", "q3"]), 75.0));
    }

    #[test]
    fn v2_empty_answers_and_golds_that_normalise_to_nothing() {
        assert_eq!((compute_exact("", ""), compute_f1("", "")), (1.0, 1.0));
        assert_eq!(compute_f1("the", "a"), 1.0);
        assert_eq!((compute_exact("x", ""), compute_f1("x", "")), (0.0, 0.0));
        // A gold that normalises to "" is dropped, leaving [""]: only an empty-normalising prediction is right.
        let dataset = [example("q", &["The"])];
        let score = |text| evaluate_v2(&dataset, &predictions(&[("q", text)]), None, 1.0).unwrap().all;
        assert_eq!((score("a").exact, score("a").f1), (100.0, 100.0));
        assert_eq!((score("The").exact, score("x").f1), (100.0, 0.0));
    }

    #[test]
    fn v1_averages_over_all_questions_missing_ones_score_zero() {
        let scores = evaluate_v1(&dataset()[..2], &predictions(&PREDICTIONS)).unwrap();
        assert!(close(scores.exact_match, 50.0) && close(scores.f1, 100.0 * (1.0 + 2.0 / 3.0) / 2.0));
        let scores = evaluate_v1(&dataset()[..2], &predictions(&PREDICTIONS[..1])).unwrap();
        assert!(close(scores.exact_match, 50.0) && close(scores.f1, 50.0));
        let err = evaluate_v1(&dataset(), &predictions(&PREDICTIONS)).unwrap_err();
        assert!(err.to_string().contains("question q3 has no gold answer"), "{err}");
    }

    #[test]
    fn v2_needs_every_prediction_and_probability() {
        let err = evaluate_v2(&dataset(), &predictions(&PREDICTIONS[..2]), None, 1.0).unwrap_err();
        assert_eq!(err.to_string(), "no prediction for 2 of 4 questions, the first q3");
        let probs = na_probs(&[("q1", 0.1)]);
        let err = evaluate_v2(&dataset(), &predictions(&PREDICTIONS), Some(&probs), 1.0).unwrap_err();
        assert_eq!(err.to_string(), "no no-answer probability for question q2");
    }
}

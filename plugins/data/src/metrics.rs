//! The official SQuAD evaluation: answers are normalised (lower case, no
//! punctuation, no articles a/an/the, single spaces), then exact match and
//! token-overlap F1, each the maximum over the gold answers.

use std::collections::HashMap;

pub fn normalize(text: &str) -> String {
    let lower = text.to_lowercase();
    let no_punct: String = lower.chars().filter(|c| !is_punctuation(*c)).collect();
    no_punct.split_whitespace().filter(|w| !matches!(*w, "a" | "an" | "the")).collect::<Vec<_>>().join(" ")
}

/// Python's `string.punctuation`, which the official script removes.
fn is_punctuation(c: char) -> bool {
    c.is_ascii_punctuation()
}

pub fn exact_match(prediction: &str, gold: &str) -> f64 {
    (normalize(prediction) == normalize(gold)) as u8 as f64
}

pub fn f1(prediction: &str, gold: &str) -> f64 {
    let predicted = normalize(prediction);
    let expected = normalize(gold);
    let predicted: Vec<&str> = predicted.split_whitespace().collect();
    let expected: Vec<&str> = expected.split_whitespace().collect();
    if predicted.is_empty() || expected.is_empty() {
        return (predicted == expected) as u8 as f64;
    }
    let mut counts: HashMap<&str, i64> = HashMap::new();
    for token in &expected {
        *counts.entry(token).or_default() += 1;
    }
    let mut common = 0;
    for token in &predicted {
        if let Some(count) = counts.get_mut(token) {
            if *count > 0 {
                *count -= 1;
                common += 1;
            }
        }
    }
    if common == 0 {
        return 0.0;
    }
    let precision = common as f64 / predicted.len() as f64;
    let recall = common as f64 / expected.len() as f64;
    2.0 * precision * recall / (precision + recall)
}

/// (exact match, F1) of one prediction: the best over the gold answers.
pub fn score(prediction: &str, golds: &[String]) -> (f64, f64) {
    let best = |metric: fn(&str, &str) -> f64| golds.iter().map(|g| metric(prediction, g)).fold(0.0, f64::max);
    (best(exact_match), best(f1))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn normalisation_follows_the_official_script() {
        assert_eq!(normalize("The  Norman-French, an Army!"), "normanfrench army");
    }

    #[test]
    fn scores_computed_by_hand() {
        let golds = vec!["the Normans".to_string(), "Normans of France".to_string()];
        assert_eq!(score("Normans", &golds), (1.0, 1.0));
        // "french normans" vs "normans of france": common {normans} = 1; P = 1/2, R = 1/3, F1 = 0.4.
        let (em, f) = score("French Normans", &golds[1..]);
        assert_eq!(em, 0.0);
        assert!((f - 0.4).abs() < 1e-12);
        assert_eq!(score("", &golds), (0.0, 0.0));
    }
}

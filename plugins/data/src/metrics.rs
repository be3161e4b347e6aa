//! The official SQuAD v1.1 evaluation (evaluate-v1.1.py): answers are
//! normalised (lower case, no punctuation, no articles a/an/the, single
//! spaces), then exact match and token-overlap F1, each the maximum over the
//! gold answers. `normalize` and the token overlap are shared with the v2.0
//! evaluation in `qa::squad_eval`.

use std::collections::HashMap;

/// `normalize_answer` of evaluate-v1.1.py and evaluate-v2.0.py, step by step
/// in the script's order: `lower`, `remove_punc` (Python's
/// `string.punctuation`, ASCII only), `remove_articles` (the regex
/// `\b(a|an|the)\b` replaced by a space), `white_space_fix`
/// (`" ".join(text.split())`). Punctuation goes first, so "the-thing" becomes
/// "thething" and keeps its article, while a non-ASCII "the—thing" loses it.
pub fn normalize(text: &str) -> String {
    let lower = text.to_lowercase();
    let no_punctuation: String = lower.chars().filter(|c| !c.is_ascii_punctuation()).collect();
    let no_articles = remove_articles(&no_punctuation);
    no_articles.split(is_python_space).filter(|word| !word.is_empty()).collect::<Vec<_>>().join(" ")
}

/// `re.sub(r"\b(a|an|the)\b", " ", text)`: with a word boundary on both
/// sides, a match is exactly a whole run of word characters that spells an
/// article, so the text is cut into such runs and the articles replaced.
fn remove_articles(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    while let Some(first) = rest.chars().next() {
        let in_word = is_python_word_char(first);
        let run_len = rest.find(|c| is_python_word_char(c) != in_word).unwrap_or(rest.len());
        let (run, tail) = rest.split_at(run_len);
        out.push_str(if in_word && matches!(run, "a" | "an" | "the") { " " } else { run });
        rest = tail;
    }
    out
}

/// A `\w` character of Python's `re` on text: `str.isalnum()` or "_".
/// Rust's `is_alphanumeric` agrees except on the few marks and symbols with
/// Unicode's Other_Alphabetic property (such as "ⓐ"), which Python's
/// `isalnum` rejects; none of them can sit inside an English article.
fn is_python_word_char(c: char) -> bool {
    c.is_alphanumeric() || c == '_'
}

/// Python's `str.isspace()`, which `str.split()` and `str.lstrip()` use:
/// Unicode White_Space plus the separators U+001C..U+001F.
pub(crate) fn is_python_space(c: char) -> bool {
    c.is_whitespace() || ('\u{1c}'..='\u{1f}').contains(&c)
}

/// `normalize_answer(text).split()`: the tokens F1 counts.
pub(crate) fn answer_tokens(text: &str) -> Vec<String> {
    normalize(text).split(' ').filter(|token| !token.is_empty()).map(str::to_string).collect()
}

/// The token-overlap F1 both scripts share: 0 when no token is in common
/// (also when either side has no tokens), else the harmonic mean of
/// precision and recall over the multiset intersection.
pub(crate) fn token_overlap_f1(predicted: &[String], expected: &[String]) -> f64 {
    let mut counts: HashMap<&str, i64> = HashMap::new();
    for token in expected {
        *counts.entry(token).or_default() += 1;
    }
    let mut common = 0;
    for token in predicted {
        if let Some(count) = counts.get_mut(token.as_str()) {
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

/// evaluate-v1.1.py's `exact_match_score`.
pub fn exact_match(prediction: &str, gold: &str) -> f64 {
    (normalize(prediction) == normalize(gold)) as u8 as f64
}

/// evaluate-v1.1.py's `f1_score`: no special case for empty answers, so two
/// answers that both normalise to nothing score 0 (v2.0 scores them 1).
pub fn f1(prediction: &str, gold: &str) -> f64 {
    token_overlap_f1(&answer_tokens(prediction), &answer_tokens(gold))
}

/// (exact match, F1) of one prediction: the best over the gold answers
/// (evaluate-v1.1.py's `metric_max_over_ground_truths`).
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
        // ASCII punctuation goes before the articles: "the-thing" keeps "the".
        assert_eq!(normalize("the-thing"), "thething");
        // Non-ASCII punctuation stays and is a word boundary for the regex.
        assert_eq!(normalize("the\u{2014}thing"), "\u{2014}thing");
        assert_eq!(normalize("\u{201c}The End\u{201d}"), "\u{201c} end\u{201d}");
        // Articles only as whole words; accented letters and digits are word characters.
        assert_eq!(normalize("theme an\u{e9} a1 A an THE"), "theme an\u{e9} a1");
        // Python's split() also cuts at U+001C..U+001F; no-break spaces are whitespace too.
        assert_eq!(normalize("x\u{1f}y\u{a0}z"), "x y z");
        assert_eq!(normalize("The"), "");
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
        // v1.1 has no empty-answer rule: both normalise to "", EM 1 but F1 0.
        assert_eq!(score("the", &["A".to_string()]), (1.0, 0.0));
        // Repeated tokens count once per occurrence: "x b b" vs "b b b c": common 2, P 2/3, R 2/4.
        assert!((f1("x b b", "b b b c") - 2.0 * (2.0 / 3.0) * 0.5 / (2.0 / 3.0 + 0.5)).abs() < 1e-12);
    }
}

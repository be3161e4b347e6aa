//! Messages for a name that is not known: the closest known name, and the list.

/// "; did you mean `full_shard`?" when one of `known` is close to `name`.
pub fn did_you_mean(name: &str, known: &[&str]) -> String {
    known
        .iter()
        .map(|k| (strsim::jaro_winkler(name, k), *k))
        .filter(|(score, _)| *score > 0.8)
        .max_by(|a, b| a.0.total_cmp(&b.0))
        .map(|(_, k)| format!("; did you mean `{k}`?"))
        .unwrap_or_default()
}

/// "unknown strategy `ful_shard`; did you mean `full_shard`? (registered: …)"
pub fn unknown(what: &str, name: &str, known: &[&str]) -> anyhow::Error {
    listed(what, name, &did_you_mean(name, known), known)
}

/// "unknown model_type `qwen3` (registered: …)": no guess, for names where
/// the closest known one is another thing altogether (a model_type a letter
/// away is another architecture, whose math would run on these weights).
pub fn unknown_without_guess(what: &str, name: &str, known: &[&str]) -> anyhow::Error {
    listed(what, name, "", known)
}

fn listed(what: &str, name: &str, suggestion: &str, known: &[&str]) -> anyhow::Error {
    let known = if known.is_empty() { "none".to_string() } else { known.join(", ") };
    anyhow::anyhow!("unknown {what} `{name}`{suggestion} (registered: {known}; `ft list` shows them)")
}


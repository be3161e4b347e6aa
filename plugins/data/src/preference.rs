//! Preference pairs, TRL's preference format (what the `dpo` task trains
//! on), from any source: `{"prompt", "chosen", "rejected"}` as strings
//! (standard) or message lists (conversational, rendered with the chat
//! template), or without `prompt` (implicit: the prompt is what `chosen`
//! and `rejected` share, as TRL's `extract_prompt` finds it). Tokenised as
//! TRL's DPOTrainer does (trl/trainer/dpo_trainer.py, `_prepare_dataset`):
//! the prompt alone and the prompt with each completion (a standard
//! completion ending with the EOS token's text), the completion starting
//! where the prompt's tokens and both whole sequences' stop agreeing.

use crate::chat::{ChatTemplate, Conversation};
use crate::example::{ids, Positions};
use crate::formats::{self, Chosen};
use crate::source::{Columns, Source, Split};
use crate::tokenizer;
use anyhow::{bail, Context as _, Result};
use ft_core::config::{DataFormat, DataRange};
use serde_json::Value as Json;
use std::path::Path;
use tokenizers::Tokenizer;

/// One tokenised sequence of a pair: the prompt's tokens then the completion's.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Sequence {
    pub ids: Vec<i64>,
    /// Where the completion starts in `ids`.
    pub completion_start: usize,
}

impl Sequence {
    /// The completion's tokens (what TRL's `completion_mask` marks).
    pub fn completion_tokens(&self) -> usize {
        self.ids.len() - self.completion_start
    }
}

/// A preference pair: the chosen and the rejected sequence.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Pair {
    pub chosen: Sequence,
    pub rejected: Sequence,
}

/// How sequences longer than `max_length` are handled: TRL's
/// `truncation_mode` (`keep_start` cuts the end and drops a pair whose
/// prompt alone fills `max_length`; `keep_end` cuts the start), or skipped whole.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Truncation {
    KeepStart,
    KeepEnd,
    /// Pairs with a sequence longer than `max_length` are skipped.
    Skip,
}

/// What [`load`] reads a source with.
pub struct LoadOptions<'a> {
    pub max_length: usize,
    pub truncation: Truncation,
    /// Only the source's rows in this range (`data.range`).
    pub range: Option<DataRange>,
    /// Keep the first N pairs (None: all).
    pub limit: Option<usize>,
    pub tokenizer_dir: &'a Path,
    pub chat_template: Option<&'a Path>,
    pub split: Split<'a>,
    pub columns: &'a Columns,
}

/// The pairs of a source, one per row in order; pairs that truncation
/// drops or skips are counted in the log; a malformed row (no `rejected`, an
/// empty completion, a prompt the chat template cannot render) is an error
/// naming its file and line.
pub fn load(path: &Path, tokenizer: &Tokenizer, options: &LoadOptions) -> Result<Vec<Pair>> {
    let source = Source::open(path, options.split)?;
    let mut encoder = PairEncoder::new(tokenizer, options.tokenizer_dir, options.chat_template)?;
    let (mut positions, mut pairs, mut dropped) = (Positions::new(options.range), vec![], 0);
    for row in source.rows(options.columns) {
        let row = row?;
        if !positions.take() || options.limit.is_some_and(|limit| pairs.len() >= limit) {
            continue;
        }
        let at = row.to_string();
        let pair = encoder.encode(&row.parse::<Json>()?, &at)?;
        match truncated(pair, options.max_length, options.truncation) {
            Some(pair) => pairs.push(pair),
            None => dropped += 1,
        }
    }
    positions.finish(Path::new(&source.name), "preference pairs (rows)")?;
    let why = match options.truncation {
        Truncation::KeepStart => format!("their prompt alone fills max_length {}", options.max_length),
        Truncation::KeepEnd => "none dropped under keep_end".to_string(),
        Truncation::Skip => format!("longer than max_length {} (task.truncation_mode keep_start or keep_end cuts them instead)", options.max_length),
    };
    if pairs.is_empty() {
        bail!("{}: no preference pair left ({dropped} skipped: {why})", source.name);
    }
    let gave = format!("{} preference pairs ({dropped} skipped: {why})", pairs.len());
    formats::log_source(&source.name, DataFormat::Preference, Chosen::ByTask, &format!("{} rows", positions.seen()), &gave);
    Ok(pairs)
}

/// `pair` cut to `max_length` tokens a sequence as TRL's collator cuts
/// them, or None where it is dropped (keep_start: the prompt alone fills
/// max_length; skip: longer than it).
pub fn truncated(mut pair: Pair, max_length: usize, truncation: Truncation) -> Option<Pair> {
    let too_long = pair.chosen.ids.len() > max_length || pair.rejected.ids.len() > max_length;
    match truncation {
        Truncation::Skip if too_long => None,
        Truncation::Skip => Some(pair),
        // The prompt's length as TRL measures it: the tokens both sequences share before their completions.
        Truncation::KeepStart if pair.chosen.completion_start.min(pair.rejected.completion_start) >= max_length => None,
        Truncation::KeepStart => {
            for sequence in [&mut pair.chosen, &mut pair.rejected] {
                sequence.ids.truncate(max_length);
            }
            Some(pair)
        }
        Truncation::KeepEnd => {
            for sequence in [&mut pair.chosen, &mut pair.rejected] {
                let cut = sequence.ids.len().saturating_sub(max_length);
                sequence.ids.drain(..cut);
                sequence.completion_start = sequence.completion_start.saturating_sub(cut);
            }
            Some(pair)
        }
    }
}

/// Turns preference rows into pairs with one tokenizer.
struct PairEncoder<'a> {
    tokenizer: &'a Tokenizer,
    tokenizer_dir: &'a Path,
    chat_template: Option<&'a Path>,
    /// Loaded at the first conversational row.
    template: Option<ChatTemplate>,
    /// The EOS token's text, which TRL appends to a standard completion.
    eos_token: Option<String>,
}

impl<'a> PairEncoder<'a> {
    fn new(tokenizer: &'a Tokenizer, tokenizer_dir: &'a Path, chat_template: Option<&'a Path>) -> Result<PairEncoder<'a>> {
        let special = tokenizer::special_tokens(&tokenizer::config(tokenizer_dir)?);
        let eos_token = special.get("eos_token").and_then(Json::as_str).map(String::from);
        let eos_token = eos_token.or_else(|| crate::example::eos_id(tokenizer).and_then(|id| tokenizer.id_to_token(id as u32)));
        Ok(PairEncoder { tokenizer, tokenizer_dir, chat_template, template: None, eos_token })
    }

    fn encode(&mut self, row: &Json, at: &str) -> Result<Pair> {
        let field = |key: &str| row.get(key).filter(|value| !value.is_null());
        let (Some(chosen), Some(rejected)) = (field("chosen"), field("rejected")) else {
            let missing = if field("chosen").is_none() { "chosen" } else { "rejected" };
            bail!("{at}: no \"{missing}\" (a preference row has \"chosen\" and \"rejected\", and a \"prompt\" unless they share it)");
        };
        let (prompt, chosen, rejected) = match field("prompt") {
            Some(prompt) => (prompt.clone(), chosen.clone(), rejected.clone()),
            None => extract_prompt(chosen, rejected, at)?,
        };
        for (name, completion) in [("chosen", &chosen), ("rejected", &rejected)] {
            let empty = match completion {
                Json::String(text) => text.is_empty(),
                Json::Array(messages) => messages.is_empty(),
                _ => bail!("{at}: \"{name}\" is neither a string nor a list of messages"),
            };
            if empty {
                bail!("{at}: \"{name}\" is an empty completion");
            }
        }
        match (&prompt, &chosen, &rejected) {
            (Json::String(prompt), Json::String(chosen), Json::String(rejected)) => self.standard(prompt, chosen, rejected, at),
            (Json::Array(prompt), Json::Array(chosen), Json::Array(rejected)) => self.conversational(row, prompt, chosen, rejected, at),
            _ => bail!("{at}: \"prompt\", \"chosen\" and \"rejected\" must all be strings or all be lists of messages"),
        }
    }

    /// Strings: the prompt with the tokenizer's special tokens (a BOS), and
    /// prompt + completion + the EOS token's text (unless it ends with it), as TRL tokenises them.
    fn standard(&self, prompt: &str, chosen: &str, rejected: &str, at: &str) -> Result<Pair> {
        let with_eos = |completion: &str| match &self.eos_token {
            Some(eos) if !completion.ends_with(eos.as_str()) => format!("{prompt}{completion}{eos}"),
            _ => format!("{prompt}{completion}"),
        };
        let encode = |text: &str| ids(self.tokenizer, text, true).with_context(|| at.to_string());
        Ok(split_pair(encode(prompt)?, encode(&with_eos(chosen))?, encode(&with_eos(rejected))?))
    }

    /// Message lists: the prompt rendered with the generation prompt, and
    /// the prompt's messages followed by each completion's, with the row's tools.
    fn conversational(&mut self, row: &Json, prompt: &[Json], chosen: &[Json], rejected: &[Json], at: &str) -> Result<Pair> {
        if self.template.is_none() {
            self.template = Some(ChatTemplate::load(self.tokenizer_dir, self.chat_template)?);
        }
        let template = self.template.as_ref().expect("loaded above");
        let render = |messages: &[Json], generation_prompt: bool, what: &str| -> Result<Vec<i64>> {
            let conversation = Conversation::from_row(messages, row, at)?;
            template.render_ids(self.tokenizer, &conversation, generation_prompt)?.map_err(|reason| anyhow::anyhow!("{at}: the chat template cannot render {what}: {reason}"))
        };
        let prompt_ids = render(prompt, true, "the prompt")?;
        let chosen_ids = render(&[prompt, chosen].concat(), false, "the prompt and \"chosen\"")?;
        let rejected_ids = render(&[prompt, rejected].concat(), false, "the prompt and \"rejected\"")?;
        Ok(split_pair(prompt_ids, chosen_ids, rejected_ids))
    }
}

/// The pair whose completions start where `prompt`'s tokens and each whole
/// sequence's first differ (TRL's `common_prefix_length`, the smaller of the two).
fn split_pair(prompt: Vec<i64>, chosen: Vec<i64>, rejected: Vec<i64>) -> Pair {
    let shared = |whole: &[i64]| prompt.iter().zip(whole).take_while(|(a, b)| a == b).count();
    let completion_start = shared(&chosen).min(shared(&rejected));
    Pair { chosen: Sequence { ids: chosen, completion_start }, rejected: Sequence { ids: rejected, completion_start } }
}

/// TRL's `extract_prompt` (trl/data_utils.py): the prompt is `chosen` up
/// to the first message (or character) where it and `rejected` differ —
/// one character earlier when a space precedes it — and the completions
/// what follows; where neither differs within the shorter, Python's loop
/// leaves the index at its last element.
fn extract_prompt(chosen: &Json, rejected: &Json, at: &str) -> Result<(Json, Json, Json)> {
    fn split<T: PartialEq>(chosen: &[T], rejected: &[T], is_space: impl Fn(&T) -> bool) -> Option<usize> {
        let shorter = chosen.len().min(rejected.len());
        let mut index = shorter.checked_sub(1)?;
        if let Some(first) = (0..shorter).find(|&i| chosen[i] != rejected[i]) {
            index = if first > 0 && is_space(&chosen[first - 1]) { first - 1 } else { first };
        }
        Some(index)
    }
    let no_prompt = || anyhow::anyhow!("{at}: no \"prompt\", and \"chosen\" and \"rejected\" share none (an empty one)");
    match (chosen, rejected) {
        (Json::Array(chosen), Json::Array(rejected)) => {
            let at = split(chosen, rejected, |_| false).ok_or_else(no_prompt)?;
            Ok((Json::from(chosen[..at].to_vec()), Json::from(chosen[at..].to_vec()), Json::from(rejected[at..].to_vec())))
        }
        (Json::String(chosen), Json::String(rejected)) => {
            let (chosen, rejected): (Vec<char>, Vec<char>) = (chosen.chars().collect(), rejected.chars().collect());
            let at = split(&chosen, &rejected, |c| *c == ' ').ok_or_else(no_prompt)?;
            let text = |chars: &[char]| Json::from(chars.iter().collect::<String>());
            Ok((text(&chosen[..at]), text(&chosen[at..]), text(&rejected[at..])))
        }
        _ => bail!("{at}: \"chosen\" and \"rejected\" must both be strings or both be lists of messages"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn the_implicit_prompt_is_what_trl_extracts() {
        let (user, blue, green) = (json!({"role": "user", "content": "sky?"}), json!({"role": "assistant", "content": "blue"}), json!({"role": "assistant", "content": "green"}));
        let (prompt, chosen, rejected) = extract_prompt(&json!([user, blue]), &json!([user, green]), "f line 1").unwrap();
        assert_eq!((prompt, chosen, rejected), (json!([user]), json!([blue]), json!([green])));
        // The space before the first difference goes to the completions.
        let (prompt, chosen, rejected) = extract_prompt(&json!("The sky is blue"), &json!("The sky is green"), "f line 1").unwrap();
        assert_eq!((prompt, chosen, rejected), (json!("The sky is"), json!(" blue"), json!(" green")));
        let err = extract_prompt(&json!([]), &json!([user]), "f line 3").unwrap_err().to_string();
        assert!(err.starts_with("f line 3: no \"prompt\""), "{err}");
    }

    #[test]
    fn truncation_follows_trls_rules() {
        let pair = Pair { chosen: Sequence { ids: vec![1, 2, 3, 4, 5], completion_start: 2 }, rejected: Sequence { ids: vec![1, 2, 6], completion_start: 2 } };
        let cut = truncated(pair.clone(), 4, Truncation::KeepStart).unwrap();
        assert_eq!((cut.chosen.ids, cut.rejected.ids), (vec![1, 2, 3, 4], vec![1, 2, 6]));
        let cut = truncated(pair.clone(), 2, Truncation::KeepEnd).unwrap();
        assert_eq!((cut.chosen, cut.rejected), (Sequence { ids: vec![4, 5], completion_start: 0 }, Sequence { ids: vec![2, 6], completion_start: 1 }));
        assert_eq!(truncated(pair.clone(), 2, Truncation::KeepStart), None, "the prompt fills max_length");
        assert_eq!(truncated(pair.clone(), 4, Truncation::Skip), None);
        assert_eq!(truncated(pair.clone(), 5, Truncation::Skip), Some(pair));
    }
}

//! Row formats: how one row — a JSON object keyed by column name, from
//! whichever source read it — becomes an example. Prompt/completion pairs
//! (strings, the loss on the completion; or TRL's conversational message
//! lists), conversations (`messages` with their `tools`), ShareGPT
//! (`conversations` of `from`/`value` turns, roles mapped as axolotl maps
//! them) and Alpaca (`instruction`, `input`, `output` in the Stanford Alpaca
//! prompt, the loss on the output). A row's keys say its format when
//! `data.format` does not.

use crate::chat::{ChatTemplate, Conversation};
use crate::example::{eos_id, ids, Example, Skipped, IGNORE_INDEX};
use crate::tokenizer;
use anyhow::{bail, Context as _, Result};
use ft_core::config::DataFormat;
use serde_json::Value as Json;
use std::path::{Path, PathBuf};
use tokenizers::Tokenizer;

/// The format a row's keys say: `messages` (chat), `conversations`
/// (ShareGPT), `chosen` or `rejected` (TRL's preference pairs), `prompt` and `completion`, `instruction` and `output`
/// (Alpaca), `text`; none for other rows.
pub fn detect(row: &Json) -> Option<DataFormat> {
    let has = |key: &str| row.get(key).is_some();
    match () {
        _ if has("messages") => Some(DataFormat::Chat),
        _ if has("conversations") => Some(DataFormat::Sharegpt),
        _ if has("chosen") || has("rejected") => Some(DataFormat::Preference),
        _ if has("prompt") && has("completion") => Some(DataFormat::PromptCompletion),
        _ if has("instruction") && has("output") => Some(DataFormat::Alpaca),
        _ if has("text") => Some(DataFormat::Text),
        _ => None,
    }
}

/// A format as the log names it.
pub fn name(format: DataFormat) -> &'static str {
    match format {
        DataFormat::Auto => "auto",
        DataFormat::Squad => "SQuAD",
        DataFormat::Text => "text",
        DataFormat::PromptCompletion => "prompt/completion",
        DataFormat::Chat => "chat",
        DataFormat::Sharegpt => "ShareGPT",
        DataFormat::Alpaca => "Alpaca",
        DataFormat::Preference => "preference",
    }
}

/// How a source's format was chosen, as its log line says.
#[derive(Debug, Clone, Copy)]
pub enum Chosen {
    /// From the source's content (`data.format` auto).
    Detected,
    /// As `data.format` (or a mixture source's `format`) sets it.
    Set,
    /// The only one the task reads (DPO's preference pairs, extractive QA's SQuAD).
    ByTask,
}

/// The one line the log gives a source, on rank 0 only (every rank reads
/// it): its format and how that was chosen, its rows (`rows`, e.g. "12
/// rows") and what they gave (`gave`, e.g. "10 examples (…)").
pub fn log_source(source: &str, format: DataFormat, chosen: Chosen, rows: &str, gave: &str) {
    if crate::logs_data() {
        let how = match chosen {
            Chosen::Detected => "detected",
            Chosen::Set => "data.format",
            Chosen::ByTask => "the task's",
        };
        tracing::info!("{source}: {} data ({how}), {rows}: {gave}", name(format));
    }
}

/// What a row of no known format is told, after "FILE line N: ".
pub const KNOWN_ROWS: &str = "neither {\"text\": …}, {\"prompt\": …, \"completion\": …}, {\"messages\": […]}, ShareGPT's {\"conversations\": […]}, a preference pair {\"prompt\": …, \"chosen\": …, \"rejected\": …} nor Alpaca's {\"instruction\": …, \"output\": …}";

/// ShareGPT's speakers and the roles they become: axolotl's default mapping
/// (src/axolotl/prompt_strategies/chat_template.py, `ChatTemplatePrompter.roles`).
const SHAREGPT_ROLES: [(&str, &str); 6] = [("human", "user"), ("user", "user"), ("gpt", "assistant"), ("assistant", "assistant"), ("system", "system"), ("tool", "tool")];

/// The Stanford Alpaca prompt, with an input and without (axolotl's
/// `AlpacaPrompter`: the system line, a blank line, the turn).
const ALPACA_WITH_INPUT: &str = "Below is an instruction that describes a task, paired with an input that provides further context. Write a response that appropriately completes the request.\n\n### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:\n";
const ALPACA_WITHOUT_INPUT: &str = "Below is an instruction that describes a task. Write a response that appropriately completes the request.\n\n### Instruction:\n{instruction}\n\n### Response:\n";

/// Turns rows of one format into examples with one tokenizer.
pub struct RowEncoder<'a> {
    format: DataFormat,
    tokenizer: &'a Tokenizer,
    /// Where the chat template is (`tokenizer_dir`, or the `--chat-template` file), loaded at the first conversation.
    tokenizer_dir: PathBuf,
    chat_template_file: Option<PathBuf>,
    template: Option<ChatTemplate>,
    /// The end token a completion or an Alpaca output ends with.
    eos: Option<i64>,
    max_seq_len: usize,
    truncate: bool,
    train_on_all: bool,
}

impl<'a> RowEncoder<'a> {
    /// Rows of `format` (prompt/completion, chat, ShareGPT or Alpaca) for
    /// `tokenizer` in `tokenizer_dir`, cut to (`truncate`) or skipped beyond
    /// `max_seq_len`, the loss on every token with `train_on_all`.
    pub fn new(format: DataFormat, tokenizer: &'a Tokenizer, tokenizer_dir: &Path, chat_template: Option<&Path>, max_seq_len: usize, truncate: bool, train_on_all: bool) -> Result<RowEncoder<'a>> {
        // The tokenizer's own EOS (as TRL appends `eos_token`), else a known end token.
        let eos = match tokenizer::special_tokens(&tokenizer::config(tokenizer_dir)?).get("eos_token").and_then(Json::as_str) {
            Some(token) => tokenizer.token_to_id(token).map(i64::from).or(eos_id(tokenizer)),
            None => eos_id(tokenizer),
        };
        Ok(RowEncoder {
            format,
            tokenizer,
            tokenizer_dir: tokenizer_dir.to_path_buf(),
            chat_template_file: chat_template.map(Path::to_path_buf),
            template: None,
            eos,
            max_seq_len,
            truncate,
            train_on_all,
        })
    }

    /// The chat template, loaded once.
    fn template(&mut self) -> Result<&ChatTemplate> {
        let template = match self.template.take() {
            Some(template) => template,
            None => ChatTemplate::load(&self.tokenizer_dir, self.chat_template_file.as_deref())?,
        };
        Ok(self.template.insert(template))
    }

    /// `row`'s example, or why it was skipped (the template refuses it, or
    /// it is longer than max_seq_len); a malformed row is an error that
    /// names it by `at` ("FILE line N").
    pub fn encode(&mut self, row: &Json, at: &str) -> Result<Result<Example, Skipped>> {
        let (tokenizer, max_len, truncate, all) = (self.tokenizer, self.max_seq_len, self.truncate, self.train_on_all);
        match self.format {
            DataFormat::Chat => {
                let conversation = Conversation::from_row(list(row, "messages", at)?, row, at)?;
                self.template()?.encode(tokenizer, &conversation, max_len, truncate, all)
            }
            DataFormat::Sharegpt => {
                let conversation = Conversation::from_row(&sharegpt_messages(list(row, "conversations", at)?, at)?, row, at)?;
                self.template()?.encode(tokenizer, &conversation, max_len, truncate, all)
            }
            DataFormat::PromptCompletion => match (row.get("prompt"), row.get("completion")) {
                (Some(Json::Array(prompt)), Some(Json::Array(completion))) => {
                    let prompt_only = Conversation::from_row(prompt, row, at)?;
                    let whole = Conversation::from_row(&[prompt.as_slice(), completion].concat(), row, at)?;
                    self.template()?.encode_prompt_completion(tokenizer, &prompt_only, &whole, max_len, truncate, all)
                }
                (Some(Json::Array(_)), _) | (_, Some(Json::Array(_))) => {
                    bail!("{at}: \"prompt\" and \"completion\" must both be strings or both be lists of messages (TRL's conversational prompt/completion)")
                }
                _ => Ok(self.prompt_completion(string(row, "prompt", at)?, string(row, "completion", at)?)?.fit(max_len, truncate)),
            },
            DataFormat::Alpaca => {
                let input = match row.get("input") {
                    None | Some(Json::Null) => "",
                    Some(_) => string(row, "input", at)?,
                };
                let instruction = string(row, "instruction", at)?;
                let prompt = match input.is_empty() {
                    true => ALPACA_WITHOUT_INPUT.replace("{instruction}", instruction),
                    // The instruction's own text is never searched for `{input}`: filled after it.
                    false => ALPACA_WITH_INPUT.replacen("{input}", input, 1).replacen("{instruction}", instruction, 1),
                };
                Ok(self.prompt_completion(&prompt, string(row, "output", at)?)?.fit(max_len, truncate))
            }
            other => bail!("{at}: rows of data.format {other:?} are not read by the row formats"),
        }
    }

    /// The prompt's tokens (with the tokenizer's own BOS), the
    /// completion's and the EOS unless it ends with it, the loss on the
    /// completion (on all with `train_on_all`). Tokenised apart, so the
    /// boundary is exact — as TRL's prompt/completion and axolotl's
    /// instruction formats do.
    fn prompt_completion(&self, prompt: &str, completion: &str) -> Result<Example> {
        let prompt = ids(self.tokenizer, prompt, true)?;
        let mut completion = ids(self.tokenizer, completion, false)?;
        if completion.last() != self.eos.as_ref() {
            completion.extend(self.eos);
        }
        let labels = match self.train_on_all {
            true => [prompt.as_slice(), &completion].concat(),
            false => std::iter::repeat_n(IGNORE_INDEX, prompt.len()).chain(completion.iter().copied()).collect(),
        };
        Ok(Example { input_ids: [prompt, completion].concat(), labels })
    }
}

/// `row[key]` as a list.
fn list<'r>(row: &'r Json, key: &str, at: &str) -> Result<&'r [Json]> {
    match row.get(key) {
        Some(Json::Array(items)) => Ok(items),
        _ => bail!("{at}: \"{key}\" is not a list"),
    }
}

/// `row[key]` as a string.
fn string<'r>(row: &'r Json, key: &str, at: &str) -> Result<&'r str> {
    row.get(key).and_then(Json::as_str).with_context(|| format!("{at}: no string \"{key}\""))
}

/// ShareGPT's turns as messages: `from` mapped to a role, `value` the
/// content, the turn's other keys kept after them; an unknown speaker is an error.
fn sharegpt_messages(turns: &[Json], at: &str) -> Result<Vec<Json>> {
    turns
        .iter()
        .enumerate()
        .map(|(i, turn)| {
            let n = i + 1;
            let Json::Object(fields) = turn else { bail!("{at}: turn {n} is not an object") };
            let Some(from) = fields.get("from").and_then(Json::as_str) else { bail!("{at}: turn {n} has no string \"from\"") };
            let Some((_, role)) = SHAREGPT_ROLES.iter().find(|(speaker, _)| *speaker == from) else {
                let speakers: Vec<&str> = SHAREGPT_ROLES.iter().map(|(speaker, _)| *speaker).collect();
                bail!("{at}: turn {n} is from {from:?}, which is none of ShareGPT's speakers ({})", speakers.join(", "));
            };
            let mut message = serde_json::Map::from_iter([("role".to_string(), Json::from(*role)), ("content".to_string(), fields.get("value").cloned().unwrap_or(Json::Null))]);
            message.extend(fields.iter().filter(|(key, _)| !matches!(key.as_str(), "from" | "value")).map(|(k, v)| (k.clone(), v.clone())));
            Ok(Json::Object(message))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn a_rows_keys_say_its_format() {
        for (row, format) in [
            (json!({"messages": []}), Some(DataFormat::Chat)),
            (json!({"conversations": [], "tools": []}), Some(DataFormat::Sharegpt)),
            (json!({"prompt": [], "completion": []}), Some(DataFormat::PromptCompletion)),
            (json!({"instruction": "i", "input": "", "output": "o"}), Some(DataFormat::Alpaca)),
            (json!({"text": "t"}), Some(DataFormat::Text)),
            (json!({"prompt": "p", "chosen": "c", "rejected": "r"}), Some(DataFormat::Preference)),
            (json!({"chosen": [], "rejected": []}), Some(DataFormat::Preference)),
            (json!({"prompt": "p"}), None),
            (json!([1]), None),
        ] {
            assert_eq!(detect(&row), format, "{row}");
        }
    }

    #[test]
    fn sharegpt_speakers_become_roles_and_an_unknown_one_is_named() {
        let turns = json!([{"from": "system", "value": "s"}, {"from": "human", "value": "h", "weight": 0}, {"from": "gpt", "value": "g"}, {"from": "tool", "value": "t"}]);
        let messages = sharegpt_messages(turns.as_array().unwrap(), "f line 2").unwrap();
        assert_eq!(
            messages,
            vec![json!({"role": "system", "content": "s"}), json!({"role": "user", "content": "h", "weight": 0}), json!({"role": "assistant", "content": "g"}), json!({"role": "tool", "content": "t"})]
        );
        let err = sharegpt_messages(json!([{"from": "bot", "value": "x"}]).as_array().unwrap(), "f line 2").unwrap_err().to_string();
        assert!(err.contains("f line 2: turn 1 is from \"bot\", which is none of ShareGPT's speakers (human, user, gpt"), "{err}");
    }
}

//! What every reader builds and shares, below them all: a tokenised example
//! with its labels, tokenizing a string, the end token, and which of a
//! file's examples `data.range` takes.

use anyhow::{Context as _, Result};
use ft_core::config::DataRange;
pub use ft_core::train::loss::IGNORE_INDEX;
use std::path::Path;
use tokenizers::Tokenizer;

/// One tokenised example. `labels[i]` is the target for position i, or
/// `IGNORE_INDEX` where no loss is taken (prompt tokens, padding); as in
/// transformers, the shift to the next token happens in the loss.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct Example {
    pub input_ids: Vec<i64>,
    pub labels: Vec<i64>,
}

impl Example {
    /// Tokens the loss is taken on: labels not ignored, after the shift.
    pub fn target_tokens(&self) -> usize {
        self.labels.iter().skip(1).filter(|l| **l != IGNORE_INDEX).count()
    }
}

/// Why a record gave no example; counted and logged, not fatal.
#[derive(Debug)]
pub enum Skipped {
    /// The chat template refused it (`raise_exception`) or failed on it.
    Unrenderable(String),
    /// Longer than max_seq_len (and `data.truncate` is off).
    TooLong,
}

impl Example {
    /// The example within `max_seq_len` tokens: cut to it with `truncate`,
    /// else skipped — never cut silently in the middle of an answer.
    pub fn fit(mut self, max_seq_len: usize, truncate: bool) -> Result<Example, Skipped> {
        if self.input_ids.len() <= max_seq_len {
            return Ok(self);
        }
        if !truncate {
            return Err(Skipped::TooLong);
        }
        self.input_ids.truncate(max_seq_len);
        self.labels.truncate(max_seq_len);
        Ok(self)
    }
}

/// The token ids of `text`, with the tokenizer's own special tokens (a BOS) when `special`.
pub fn ids(tokenizer: &Tokenizer, text: &str, special: bool) -> Result<Vec<i64>> {
    let encoding = tokenizer.encode(text, special).map_err(anyhow::Error::msg).with_context(|| format!("cannot tokenize {text:?}"))?;
    Ok(encoding.get_ids().iter().map(|&id| id as i64).collect())
}

/// The end-of-text token: the tokenizer's `<|endoftext|>`, `</s>` or `<eos>`, whichever it has.
pub fn eos_id(tokenizer: &Tokenizer) -> Option<i64> {
    ["<|endoftext|>", "</s>", "<eos>"].iter().find_map(|t| tokenizer.token_to_id(t)).map(|id| id as i64)
}

/// The examples of `all` (`file`'s `examples`, in file order) that `range`
/// (`data.range`) takes, said in the log; all of them without one.
pub fn in_range<T>(range: Option<DataRange>, all: Vec<T>, file: &Path, examples: &str) -> Result<Vec<T>> {
    let Some(range) = range else { return Ok(all) };
    let total = all.len();
    let selected = range.select(all, file, examples)?;
    tracing::info!("{}", range.describe(total, file, examples));
    Ok(selected)
}

/// Counts a file's examples as they stream past, saying which of them
/// `data.range` takes, so that no example outside it is held.
pub struct Positions {
    range: Option<DataRange>,
    seen: usize,
}

impl Positions {
    pub fn new(range: Option<DataRange>) -> Positions {
        Positions { range, seen: 0 }
    }

    /// Whether the next example is in the range (every one without a range).
    pub fn take(&mut self) -> bool {
        self.seen += 1;
        self.range.is_none_or(|range| range.contains(self.seen - 1))
    }

    /// The examples counted so far, in the range or not.
    pub fn seen(&self) -> usize {
        self.seen
    }

    /// Once every example of `file` has been counted: an error when the
    /// range is not within them, else what it took, in the log.
    pub fn finish(&self, file: &Path, examples: &str) -> Result<()> {
        if let Some(range) = self.range {
            range.positions(self.seen, file, examples)?;
            tracing::info!("{}", range.describe(self.seen, file, examples));
        }
        Ok(())
    }
}

//! Examples for a causal language model: token ids and, aligned with them,
//! the labels the loss is taken on — from SQuAD (prompts with the loss on
//! the answer, `prompt.rs`) or from text and JSONL (packed, `text.rs`).

use crate::squad::{self, QaExample};
use crate::{prompt, text};
use anyhow::Result;
pub use ft_core::train::loss::IGNORE_INDEX;
use std::path::Path;
use tokenizers::Tokenizer;

/// One tokenised example. `labels[i]` is the target for position i, or
/// `IGNORE_INDEX` where no loss is taken (prompt tokens, padding).
#[derive(Debug, Clone, PartialEq, Eq)]
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

/// SQuAD files are JSON; anything else is text or JSONL.
pub fn is_squad(path: &Path) -> bool {
    path.extension().and_then(|e| e.to_str()) == Some("json")
}

/// What [`load`] reads a file with.
pub struct LoadOptions {
    pub max_seq_len: usize,
    /// Keep the first N examples (None: all).
    pub limit: Option<usize>,
    /// Keep SQuAD v2's unanswerable questions (their target is the empty answer).
    pub include_unanswerable: bool,
    /// SQuAD prompts: the loss on the prompt's tokens too, not only the answer's.
    pub train_on_prompt: bool,
}

/// Tokenised examples of a file, and its questions when it is SQuAD.
pub fn load(path: &Path, tokenizer: &Tokenizer, options: &LoadOptions) -> Result<(Vec<Example>, Vec<QaExample>)> {
    let max_len = options.max_seq_len;
    if is_squad(path) {
        let (mut questions, stats) = squad::read(path, options.include_unanswerable)?;
        if let Some(limit) = options.limit {
            questions.truncate(limit);
        }
        let mut examples = vec![];
        let mut too_long = 0;
        for question in &questions {
            match prompt::encode(tokenizer, question, max_len, options.train_on_prompt)? {
                Some(example) => examples.push(example),
                None => too_long += 1,
            }
        }
        tracing::info!(
            "{}: {} questions from {} articles ({} unanswerable and {} with bad offsets skipped, {} too long for max_seq_len {max_len})",
            path.display(),
            examples.len(),
            stats.articles,
            stats.unanswerable_skipped,
            stats.bad_offsets_skipped,
            too_long
        );
        Ok((examples, questions))
    } else {
        let documents = text::read_documents(path)?;
        let mut examples = text::pack(tokenizer, &documents, max_len, prompt::eos_id(tokenizer))?;
        if let Some(limit) = options.limit {
            examples.truncate(limit);
        }
        tracing::info!("{}: {} documents packed into {} sequences of {max_len} tokens", path.display(), documents.len(), examples.len());
        Ok((examples, vec![]))
    }
}

/// Padding uses the tokenizer's pad token, else its end token (never read: no loss, causal).
pub fn pad_id(tokenizer: &Tokenizer) -> i64 {
    tokenizer.get_padding().map(|p| p.pad_id as i64).or(prompt::eos_id(tokenizer)).unwrap_or(0)
}

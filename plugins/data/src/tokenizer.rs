//! A Hugging Face tokenizer.json, checked against the model it feeds.

use anyhow::{bail, Result};
use std::path::Path;
use tokenizers::Tokenizer;

/// Loads `path`, refusing a tokenizer with more tokens than the model's
/// embedding has rows (those ids would fail deep inside a GPU kernel).
pub fn load(path: &Path, model_vocab: i64) -> Result<Tokenizer> {
    let tokenizer = Tokenizer::from_file(path).map_err(|e| anyhow::anyhow!("cannot load tokenizer {}: {e}", path.display()))?;
    let tokens = tokenizer.get_vocab_size(true);
    if tokens as i64 > model_vocab {
        bail!("tokenizer {} has {tokens} tokens but the model's vocab_size is {model_vocab}: use the model's own tokenizer", path.display());
    }
    Ok(tokenizer)
}

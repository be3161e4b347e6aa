//! A Hugging Face tokenizer.json, checked against the model it feeds, and
//! the special tokens tokenizer_config.json beside it names.

use anyhow::{bail, Result};
use std::path::Path;
use tokenizers::Tokenizer;

/// Loads `path`, refusing a tokenizer with more tokens than the model's
/// embedding has rows (those ids would fail deep inside a GPU kernel).
pub fn load(path: &Path, model_vocab: i64) -> Result<Tokenizer> {
    let tokenizer = open(path)?;
    let tokens = tokenizer.get_vocab_size(true);
    if tokens as i64 > model_vocab {
        bail!("tokenizer {} has {tokens} tokens but the model's vocab_size is {model_vocab}: use the model's own tokenizer", path.display());
    }
    Ok(tokenizer)
}

/// Loads `path`, for no model in particular (`ft tokenize`).
pub fn open(path: &Path) -> Result<Tokenizer> {
    Tokenizer::from_file(path).map_err(|e| anyhow::anyhow!("cannot load tokenizer {}: {e}", path.display()))
}

/// tokenizer_config.json in `dir`: its keys (empty when there is no file).
pub fn config(dir: &Path) -> Result<serde_json::Map<String, serde_json::Value>> {
    let path = dir.join("tokenizer_config.json");
    if !path.exists() {
        return Ok(Default::default());
    }
    let text = std::fs::read_to_string(&path).map_err(|e| anyhow::anyhow!("cannot read {}: {e}", path.display()))?;
    serde_json::from_str(&text).map_err(|e| anyhow::anyhow!("{}: not a JSON object: {e}", path.display()))
}

/// Its special tokens (`bos_token`, `eos_token`, …) as strings: each is a
/// string or an AddedToken dict with its `content`.
pub fn special_tokens(config: &serde_json::Map<String, serde_json::Value>) -> serde_json::Map<String, serde_json::Value> {
    config
        .iter()
        .filter(|(key, _)| key.ends_with("_token"))
        .filter_map(|(key, value)| Some((key.clone(), serde_json::Value::from(value.as_str().or_else(|| value.get("content")?.as_str())?))))
        .collect()
}

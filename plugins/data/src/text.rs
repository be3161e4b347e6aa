//! Plain text and JSONL (`{"text": …}` per line) for causal-LM fine-tuning:
//! streamed into fixed-length sequences with an end token between
//! documents, or (`data.packing`) each document its own examples, which
//! packing keeps apart.

use crate::example::{jsonl, Example};
use anyhow::{bail, Context, Result};
use std::path::Path;
use tokenizers::Tokenizer;

/// Documents of a file: JSONL lines' `text` fields, or a text file's
/// paragraphs (separated by blank lines).
pub fn read_documents(path: &Path) -> Result<Vec<String>> {
    if path.extension().and_then(|e| e.to_str()) == Some("jsonl") {
        jsonl::<serde_json::Value>(path)?
            .into_iter()
            .map(|(line, value)| match value.get("text").and_then(|t| t.as_str()) {
                Some(text) => Ok(text.to_string()),
                None => bail!("{} line {line}: no string field \"text\"", path.display()),
            })
            .collect()
    } else {
        let content = std::fs::read_to_string(path).with_context(|| format!("cannot read {}", path.display()))?;
        Ok(content.split("\n\n").map(str::trim).filter(|p| !p.is_empty()).map(String::from).collect())
    }
}

/// Concatenates the documents' tokens (each followed by `eos`) and cuts them
/// into sequences of `seq_len`; the remainder that does not fill one is dropped.
pub fn pack(tokenizer: &Tokenizer, documents: &[String], seq_len: usize, eos: Option<i64>) -> Result<Vec<Example>> {
    let mut stream: Vec<i64> = vec![];
    for document in documents {
        let encoding = tokenizer.encode(document.as_str(), false).map_err(anyhow::Error::msg)?;
        stream.extend(encoding.get_ids().iter().map(|&id| id as i64));
        stream.extend(eos);
    }
    Ok(stream
        .chunks_exact(seq_len)
        .map(|chunk| Example { input_ids: chunk.to_vec(), labels: chunk.to_vec() })
        .collect())
}

/// Each document's tokens and `eos` as examples of at most `max_len`
/// tokens (a longer document continues in the next), for packing with
/// document boundaries.
pub fn documents(tokenizer: &Tokenizer, documents: &[String], max_len: usize, eos: Option<i64>) -> Result<Vec<Example>> {
    let mut examples = vec![];
    for document in documents {
        let mut tokens: Vec<i64> = tokenizer.encode(document.as_str(), false).map_err(anyhow::Error::msg)?.get_ids().iter().map(|&id| id as i64).collect();
        tokens.extend(eos);
        examples.extend(tokens.chunks(max_len.max(1)).map(|piece| Example { input_ids: piece.to_vec(), labels: piece.to_vec() }));
    }
    Ok(examples)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn jsonl_errors_name_the_line() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("d.jsonl");
        std::fs::write(&path, "{\"text\": \"a\"}\n\n{\"body\": \"b\"}\n").unwrap();
        let err = read_documents(&path).unwrap_err().to_string();
        assert!(err.contains("d.jsonl line 3: no string field \"text\""), "{err}");
        std::fs::write(&path, "{\"text\": \"a\"}\nnot json\n").unwrap();
        assert!(read_documents(&path).unwrap_err().to_string().contains("line 2: not valid JSON"));
        let txt = dir.path().join("d.txt");
        std::fs::write(&txt, "one\ntwo\n\n\nthree").unwrap();
        assert_eq!(read_documents(&txt).unwrap(), vec!["one\ntwo", "three"]);
    }
}

//! Plain text and rows with a `text` column (JSON lines, Parquet, Arrow,
//! …: `source.rs`) for causal-LM fine-tuning: streamed into fixed-length
//! sequences with an end token between documents, or (`data.packing`)
//! each document its own examples, which packing keeps apart. Documents
//! stream through, so only the examples kept are held.

use crate::example::Example;
use crate::source::{Columns, Kind, Source};
use anyhow::{Context, Result};
use tokenizers::Tokenizer;

/// Documents of a source, in order: its rows' `text` column, or a text
/// file's paragraphs (separated by blank lines) unless its first line is a
/// JSON object (then it is JSON lines).
pub fn read_documents(source: &Source, columns: &Columns) -> Result<Box<dyn Iterator<Item = Result<String>>>> {
    if source.kind == Kind::Text && !starts_with_a_json_object(source)? {
        let file = &source.files[0];
        let content = std::fs::read(file).with_context(|| format!("cannot read {}", file.display()))?;
        let content = String::from_utf8(content).map_err(|_| anyhow::anyhow!("{} is not UTF-8 text (nor JSON lines, a JSON array, Parquet or Arrow)", file.display()))?;
        let paragraphs: Vec<String> = content.split("\n\n").map(str::trim).filter(|p| !p.is_empty()).map(String::from).collect();
        return Ok(Box::new(paragraphs.into_iter().map(Ok)));
    }
    Ok(Box::new(source.rows(columns).map(|row| {
        let row = row?;
        match row.parse::<serde_json::Value>()?.get("text").and_then(|t| t.as_str()) {
            Some(text) => Ok(text.to_string()),
            None => anyhow::bail!("{row}: no string field \"text\""),
        }
    })))
}

/// Whether a text file's first non-blank line is a JSON object.
fn starts_with_a_json_object(source: &Source) -> Result<bool> {
    use std::io::BufRead as _;
    let file = std::fs::File::open(&source.files[0]).with_context(|| format!("cannot read {}", source.files[0].display()))?;
    let first = std::io::BufReader::new(file).lines().map_while(Result::ok).find(|line| !line.trim().is_empty());
    Ok(first.is_some_and(|line| matches!(serde_json::from_str(&line), Ok(serde_json::Value::Object(_)))))
}

/// Concatenates the documents' tokens (each followed by `eos`), cut into
/// sequences of `seq_len` handed to `each` in order; the remainder that
/// does not fill one is dropped. Returns the number of documents.
pub fn pack(tokenizer: &Tokenizer, documents: impl Iterator<Item = Result<String>>, seq_len: usize, eos: Option<i64>, mut each: impl FnMut(Example)) -> Result<usize> {
    let mut stream: Vec<i64> = vec![];
    let mut count = 0;
    for document in documents {
        stream.extend(tokens(tokenizer, &document?)?);
        stream.extend(eos);
        count += 1;
        let full = stream.len() / seq_len * seq_len;
        for chunk in stream[..full].chunks_exact(seq_len) {
            each(Example { input_ids: chunk.to_vec(), labels: chunk.to_vec() });
        }
        stream.drain(..full);
    }
    Ok(count)
}

/// Each document's tokens and `eos` as examples of at most `max_len`
/// tokens (a longer document continues in the next), handed to `each` in
/// order, for packing with document boundaries. Returns the number of documents.
pub fn documents(tokenizer: &Tokenizer, documents: impl Iterator<Item = Result<String>>, max_len: usize, eos: Option<i64>, mut each: impl FnMut(Example)) -> Result<usize> {
    let mut count = 0;
    for document in documents {
        let mut tokens = tokens(tokenizer, &document?)?;
        tokens.extend(eos);
        count += 1;
        for piece in tokens.chunks(max_len.max(1)) {
            each(Example { input_ids: piece.to_vec(), labels: piece.to_vec() });
        }
    }
    Ok(count)
}

fn tokens(tokenizer: &Tokenizer, document: &str) -> Result<Vec<i64>> {
    Ok(tokenizer.encode(document, false).map_err(anyhow::Error::msg)?.get_ids().iter().map(|&id| id as i64).collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn read(path: &std::path::Path) -> Result<Vec<String>> {
        let source = Source::open(path, crate::source::Split::train(None))?;
        read_documents(&source, &Columns::new())?.collect()
    }

    #[test]
    fn jsonl_errors_name_the_line() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("d.jsonl");
        std::fs::write(&path, "{\"text\": \"a\"}\n\n{\"body\": \"b\"}\n").unwrap();
        let err = read(&path).unwrap_err().to_string();
        assert!(err.contains("d.jsonl line 3: no string field \"text\""), "{err}");
        std::fs::write(&path, "{\"text\": \"a\"}\nnot json\n").unwrap();
        assert!(read(&path).unwrap_err().to_string().contains("line 2: not valid JSON"));
        let txt = dir.path().join("d.txt");
        std::fs::write(&txt, "one\ntwo\n\n\nthree").unwrap();
        assert_eq!(read(&txt).unwrap(), vec!["one\ntwo", "three"]);
        std::fs::write(&txt, b"\xff\xfe").unwrap();
        assert!(read(&txt).unwrap_err().to_string().contains("d.txt is not UTF-8 text"));
    }
}

//! Examples for a causal language model: token ids and, aligned with them,
//! the labels the loss is taken on — from SQuAD (prompts with the loss on
//! the answer, `prompt.rs`), text (packed, `text.rs`), or rows in a row
//! format (`formats.rs`: prompt/completion pairs, conversations rendered
//! with the chat template, ShareGPT, Alpaca) — and `ft tokenize`'s file of
//! them. The rows come from a source (`source.rs`: JSON lines, a JSON
//! array, Parquet, Arrow); the format is `data.format`, or detected from
//! the first row. Several sources mix (`mixture.rs`).

use crate::example::{eos_id, Example, Positions, Skipped};
use crate::formats::{self, Chosen, RowEncoder};
use crate::mixture;
use crate::source::{Columns, Kind, Row, Source, Split};
use crate::squad::{self, QaExample};
use crate::{prompt, text};
use anyhow::{bail, Context, Result};
use ft_core::config::{DataConfig, DataFormat, DataRange, TrainOn};
use serde_json::Value as Json;
use std::io::Write as _;
use std::path::Path;
use tokenizers::Tokenizer;

/// What [`load`] reads a file with.
#[derive(Clone, Copy)]
pub struct LoadOptions<'a> {
    pub max_seq_len: usize,
    /// Only the file's examples in this range (`data.range`), in file order:
    /// SQuAD's questions, rows (JSONL's lines), text's packed sequences.
    pub range: Option<DataRange>,
    /// Keep the first N examples (None: all), of the range when there is one.
    pub limit: Option<usize>,
    /// Keep SQuAD v2's unanswerable questions (their target is the empty answer).
    pub include_unanswerable: bool,
    /// SQuAD prompts: the loss on the prompt's tokens too, not only the answer's.
    pub train_on_prompt: bool,
    pub format: DataFormat,
    /// Chat and prompt/completion: the loss on the assistant's (completion's) tokens or on all.
    pub train_on: TrainOn,
    /// Cut chat and prompt/completion examples to max_seq_len instead of skipping them.
    pub truncate: bool,
    /// The directory of tokenizer.json, where the chat template and the
    /// special tokens it names are found (tokenizer_config.json, chat_template.jinja).
    pub tokenizer_dir: &'a Path,
    /// A chat template file instead of the tokenizer's.
    pub chat_template: Option<&'a Path>,
    /// Text: each document its own examples (packed with boundaries by the
    /// task) instead of one stream cut into full sequences.
    pub packing: bool,
    /// The split of a dataset directory (`data.split`, `data.eval_split`).
    pub split: Split<'a>,
    /// The names the formats read, given to other columns (`data.columns`).
    pub columns: &'a Columns,
}

impl<'a> LoadOptions<'a> {
    /// `data.*`'s settings for the tokenizer at `tokenizer`, every example of the file, SQuAD's defaults.
    pub fn new(data: &'a DataConfig, tokenizer: &'a Path) -> LoadOptions<'a> {
        LoadOptions {
            max_seq_len: data.max_seq_len,
            range: None,
            limit: None,
            include_unanswerable: false,
            train_on_prompt: false,
            format: data.format,
            train_on: data.train_on,
            truncate: data.truncate,
            tokenizer_dir: tokenizer.parent().unwrap_or(Path::new(".")),
            chat_template: data.chat_template.as_deref(),
            packing: data.packing,
            split: Split::train(data.split.as_deref()),
            columns: &data.columns,
        }
    }
}

/// The format of a source by its content: SQuAD for a SQuAD file; for
/// rows, the first one's keys (`formats::detect`); plain text otherwise.
pub fn detect(source: &Source, columns: &Columns) -> Result<DataFormat> {
    if source.kind == Kind::Squad {
        return Ok(DataFormat::Squad);
    }
    let Some(row) = source.first_row(columns)? else { bail!("{} is empty", source.name) };
    let text = source.kind == Kind::Text;
    let json = serde_json::from_str::<Json>(row.json()?);
    if let Some(format) = json.as_ref().ok().and_then(formats::detect) {
        return Ok(format);
    }
    match json {
        Ok(Json::Object(keys)) if !text => {
            let columns = keys.keys().map(|k| format!("`{k}`")).collect::<Vec<_>>().join(", ");
            bail!("{row}: {} (its columns: {columns}; data.columns.NAME=COLUMN reads another column as NAME)", formats::KNOWN_ROWS)
        }
        Ok(_) if !text => bail!("{row}: {}", formats::KNOWN_ROWS),
        Err(_) if !text => bail!("{row}: not valid JSON"),
        _ => Ok(DataFormat::Text),
    }
}

/// The training examples: `data.train`'s, or the sources of
/// `data.mixture` interleaved in an order fixed by `seed`; of
/// `options.range` (counted over the mixture), up to `options.limit`.
/// None: no training data is set.
pub fn load_training(data: &DataConfig, seed: u64, tokenizer: &Tokenizer, options: &LoadOptions) -> Result<Option<Vec<Example>>> {
    data.check_max_seq_len()?;
    mixture::training_set(data, seed, options.range, options.limit, "examples", |path, source| {
        let Some(source) = source else { return Ok(load(path, tokenizer, options)?.0) };
        let own = LoadOptions {
            range: None,
            limit: None,
            format: if source.format == DataFormat::Auto { options.format } else { source.format },
            split: Split { name: source.split.as_deref().or(options.split.name), ..options.split },
            columns: if source.columns.is_empty() { options.columns } else { &source.columns },
            ..*options
        };
        Ok(load(path, tokenizer, &own)?.0)
    })
}

/// Tokenised examples of a source, and its questions when it is SQuAD.
pub fn load(path: &Path, tokenizer: &Tokenizer, options: &LoadOptions) -> Result<(Vec<Example>, Vec<QaExample>)> {
    let max_len = options.max_seq_len;
    let source = Source::open(path, options.split)?;
    let (format, chosen) = match options.format {
        DataFormat::Auto => (detect(&source, options.columns)?, Chosen::Detected),
        format => (format, Chosen::Set),
    };
    match (format, source.kind) {
        (DataFormat::Squad, Kind::Squad) => {}
        (DataFormat::Squad, kind) => bail!("data.format=squad reads SQuAD JSON files; {} is {}", source.name, kind.describe()),
        (format, Kind::Squad) => bail!("{} is a SQuAD file, which data.format={} does not read (leave data.format unset)", source.name, serde_json::to_value(format)?.as_str().unwrap_or("?")),
        _ => {}
    }
    match format {
        DataFormat::Squad => {
            let (mut questions, stats) = squad::read(path, options.include_unanswerable, options.range)?;
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
            let gave = format!(
                "{} prompts ({} unanswerable and {} with bad offsets skipped, {too_long} too long for max_seq_len {max_len})",
                examples.len(),
                stats.unanswerable_skipped,
                stats.bad_offsets_skipped
            );
            formats::log_source(&source.name, format, chosen, &format!("{} questions in {} articles", stats.questions, stats.articles), &gave);
            Ok((examples, questions))
        }
        // (Auto was resolved above.)
        DataFormat::Text | DataFormat::Auto => {
            // Every document is read, so that slices of the source are the
            // examples one run over it would train on; only the range's are kept.
            let documents = text::read_documents(&source, options.columns)?;
            let (mut positions, mut examples) = (Positions::new(options.range), vec![]);
            let keep = |example| {
                if positions.take() && options.limit.is_none_or(|limit| examples.len() < limit) {
                    examples.push(example);
                }
            };
            let (count, what) = match options.packing {
                true => (text::documents(tokenizer, documents, max_len, eos_id(tokenizer), keep)?, format!("document pieces of at most {max_len} tokens")),
                false => (text::pack(tokenizer, documents, max_len, eos_id(tokenizer), keep)?, format!("sequences of {max_len} tokens")),
            };
            positions.finish(Path::new(&source.name), &what)?;
            formats::log_source(&source.name, format, chosen, &format!("{count} documents"), &format!("{} {what}", examples.len()));
            Ok((examples, vec![]))
        }
        DataFormat::PromptCompletion | DataFormat::Chat | DataFormat::Sharegpt | DataFormat::Alpaca => Ok((records(&source, tokenizer, options, format, chosen)?, vec![])),
        DataFormat::Preference => bail!("{} holds preference pairs (\"chosen\"/\"rejected\"): the dpo task's data (--task dpo)", source.name),
    }
}

/// A source's examples in a row format, one per row in order (the rows of
/// `data.range` when set); rows the template refuses or too long for
/// max_seq_len are skipped and counted, malformed rows are errors naming
/// the row.
fn records(source: &Source, tokenizer: &Tokenizer, options: &LoadOptions, format: DataFormat, chosen: Chosen) -> Result<Vec<Example>> {
    let all = options.train_on == TrainOn::All;
    let mut rows = RowEncoder::new(format, tokenizer, options.tokenizer_dir, options.chat_template, options.max_seq_len, options.truncate, all)?;
    encode_rows(source, options, format, chosen, |row| rows.encode(&row.parse::<Json>()?, &row.to_string()))
}

/// Each row's example by `encode` (the rows of the range, up to
/// `options.limit`); the skipped are counted (the first unrenderable one's
/// reason logged), and a source that leaves none is an error. The log
/// names the source's format (`format`, and how it was chosen).
fn encode_rows(
    source: &Source,
    options: &LoadOptions,
    format: DataFormat,
    chosen: Chosen,
    mut encode: impl FnMut(&Row) -> Result<Result<Example, Skipped>>,
) -> Result<Vec<Example>> {
    let (mut positions, mut examples, mut encoded, mut unrenderable, mut too_long) = (Positions::new(options.range), vec![], 0, 0, 0);
    for row in source.rows(options.columns) {
        let row = row?;
        if !positions.take() || options.limit.is_some_and(|limit| examples.len() >= limit) {
            continue;
        }
        encoded += 1;
        match encode(&row)? {
            Ok(example) => examples.push(example),
            Err(Skipped::TooLong) => too_long += 1,
            Err(Skipped::Unrenderable(reason)) => {
                if unrenderable == 0 {
                    tracing::warn!("{row}: the chat template cannot render it: {reason}");
                }
                unrenderable += 1;
            }
        }
    }
    let counted = match source.kind {
        Kind::Jsonl | Kind::Text => "examples (non-blank lines)",
        _ => "examples (rows)",
    };
    positions.finish(Path::new(&source.name), counted)?;
    if examples.is_empty() && encoded > 0 {
        bail!("{}: no example left ({unrenderable} the chat template cannot render, {too_long} longer than max_seq_len {})", source.name, options.max_seq_len);
    }
    let gave = format!(
        "{} examples ({unrenderable} skipped as the chat template cannot render them, {too_long} longer than max_seq_len {}{})",
        examples.len(),
        options.max_seq_len,
        if options.truncate { ", cut" } else { " skipped" }
    );
    formats::log_source(&source.name, format, chosen, &format!("{} rows", positions.seen()), &gave);
    Ok(examples)
}

/// Writes `examples` to `path` as JSON lines (an [`Example`]'s are
/// `{"input_ids", "labels"}`), atomically: a temporary file beside it,
/// renamed into place once whole.
pub fn write_jsonl<T: serde::Serialize>(examples: &[T], path: &Path) -> Result<()> {
    let name = path.file_name().with_context(|| format!("{} is not a file name", path.display()))?;
    let temporary = path.with_file_name(format!(".{}.tmp", name.to_string_lossy()));
    let write = || -> Result<()> {
        let mut file = std::io::BufWriter::new(std::fs::File::create(&temporary)?);
        for example in examples {
            serde_json::to_writer(&mut file, example)?;
            file.write_all(b"\n")?;
        }
        file.into_inner().map_err(|e| e.into_error())?.sync_all()?;
        std::fs::rename(&temporary, path)?;
        Ok(())
    };
    write().inspect_err(|_| {
        // Nothing half-written stays behind.
        let _ = std::fs::remove_file(&temporary);
    }).with_context(|| format!("cannot write {}", path.display()))
}

/// Padding uses the tokenizer's pad token, else its end token (never read: no loss, causal).
pub fn pad_id(tokenizer: &Tokenizer) -> i64 {
    tokenizer.get_padding().map(|p| p.pad_id as i64).or(eos_id(tokenizer)).unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::example::IGNORE_INDEX;

    #[test]
    fn the_format_is_read_from_the_first_line() {
        let dir = tempfile::tempdir().unwrap();
        let cases = [
            ("a.jsonl", "\n{\"messages\": []}\n", Some(DataFormat::Chat)),
            ("a.jsonl", "{\"prompt\": \"p\", \"completion\": \"c\"}", Some(DataFormat::PromptCompletion)),
            ("a.jsonl", "{\"text\": \"t\"}", Some(DataFormat::Text)),
            ("a.jsonl", "{\"conversations\": [{\"from\": \"human\", \"value\": \"hi\"}]}", Some(DataFormat::Sharegpt)),
            ("a.jsonl", "{\"instruction\": \"i\", \"input\": \"\", \"output\": \"o\"}", Some(DataFormat::Alpaca)),
            ("a.txt", "Once upon a time", Some(DataFormat::Text)),
            ("a.txt", "{\"messages\": []}", Some(DataFormat::Chat)),
            ("a.jsonl", "{\"prompt\": \"p\"}", None),
            ("a.jsonl", "\n\nnot json", None),
        ];
        let detect_in = |path: &Path| detect(&Source::open(path, Split::train(None))?, &Columns::new());
        for (name, content, expected) in cases {
            let path = dir.path().join(name);
            std::fs::write(&path, content).unwrap();
            match expected {
                Some(format) => assert_eq!(detect_in(&path).unwrap(), format, "{content}"),
                None => assert!(detect_in(&path).unwrap_err().to_string().contains(&format!("{name} line ")), "{content}"),
            }
        }
        let squad = dir.path().join("squad.json");
        std::fs::write(&squad, "{\"version\": \"v2.0\", \"data\": []}").unwrap();
        assert_eq!(detect_in(&squad).unwrap(), DataFormat::Squad);
        std::fs::write(&squad, "[{\"text\": \"t\"}]").unwrap();
        assert_eq!(detect_in(&squad).unwrap(), DataFormat::Text);
    }

    #[test]
    fn a_range_takes_the_files_examples_in_file_order_in_every_format() {
        let dir = tempfile::tempdir().unwrap();
        let files = crate::demo::write(dir.path(), 20, 5, 0).unwrap();
        let tokenizer = Tokenizer::from_file(&files.tokenizer).unwrap();
        let jsonl = |name: &str, line: &dyn Fn(usize) -> Json| {
            let path = dir.path().join(name);
            std::fs::write(&path, (0..10).map(|i| line(i).to_string() + "\n").collect::<String>()).unwrap();
            path
        };
        let text = jsonl("text.jsonl", &|i| serde_json::json!({"text": format!("The country number {i} has a capital.")}));
        let pairs = jsonl("pairs.jsonl", &|i| serde_json::json!({"prompt": format!("Country {i}?"), "completion": format!(" capital {i}")}));
        // Line 4 (position 3) is too long for max_seq_len and skipped, but still counted.
        let chat = jsonl("chat.jsonl", &|i| {
            let question = if i == 3 { "why? ".repeat(40) } else { format!("Country {i}?") };
            serde_json::json!({"messages": [{"role": "user", "content": question}, {"role": "assistant", "content": format!("capital {i}")}]})
        });
        let template = dir.path().join("chat.jinja");
        std::fs::write(&template, "{% for m in messages %}{{ m.role }}: {% generation %}{{ m.content }}{% endgeneration %}\n{% endfor %}").unwrap();
        let data = DataConfig { chat_template: Some(template), ..DataConfig::default() };
        let read = |path: &Path, max_seq_len: usize, range: Option<&str>| {
            let options = LoadOptions { max_seq_len, range: range.map(|r| r.parse().unwrap()), ..LoadOptions::new(&data, &files.tokenizer) };
            load(path, &tokenizer, &options).map(|(examples, _)| examples)
        };
        for (path, max_seq_len, examples) in
            [(&files.train, 512, "questions"), (&text, 16, "sequences of 16 tokens"), (&pairs, 64, "examples (non-blank lines)"), (&chat, 64, "examples (non-blank lines)")]
        {
            let all = read(path, max_seq_len, None).unwrap();
            let (head, tail) = (read(path, max_seq_len, Some("0:4")).unwrap(), read(path, max_seq_len, Some("4:")).unwrap());
            assert_eq!([head.as_slice(), &tail].concat(), all, "{}: two slices are the whole file", path.display());
            let err = read(path, max_seq_len, Some("5:100000")).unwrap_err().to_string();
            assert!(err.contains(&format!("data.range 5:100000 is not within {}: it has ", path.display())) && err.contains(examples), "{err}");
        }
        assert_eq!(read(&pairs, 64, Some("2:5")).unwrap(), read(&pairs, 64, None).unwrap()[2..5]);
        // In a chat file the range counts lines, used or skipped: 2:5 is lines 3 and 5 (line 4 is too long).
        let chat_all = read(&chat, 64, None).unwrap();
        assert_eq!((chat_all.len(), read(&chat, 64, Some("2:5")).unwrap()), (9, chat_all[2..4].to_vec()));
        let err = read(&chat, 64, Some("3:4")).unwrap_err().to_string();
        assert!(err.contains("no example left") && err.contains("1 longer than max_seq_len"), "{err}");
        assert_eq!(read(&files.train, 512, Some("3:7")).unwrap(), read(&files.train, 512, None).unwrap()[3..7]);
    }

    #[test]
    fn tokenized_files_are_written_whole() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("out.jsonl");
        let examples = [Example { input_ids: vec![5, 6], labels: vec![IGNORE_INDEX, 6] }];
        write_jsonl(&examples, &path).unwrap();
        assert_eq!(std::fs::read_to_string(&path).unwrap(), "{\"input_ids\":[5,6],\"labels\":[-100,6]}\n");
        assert!(write_jsonl(&examples, &dir.path().join("missing/out.jsonl")).is_err());
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 1, "no temporary file left");
    }
}

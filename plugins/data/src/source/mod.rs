//! Where rows come from, below the formats that read them: JSON lines, a
//! JSON array of rows, Parquet and Arrow (`columnar.rs`) — one file, a
//! glob, or a dataset directory (the Hub's `data/{split}-0000k-of-0000n.parquet`,
//! `datasets`' `save_to_disk` with its `state.json`, a `DatasetDict` with its
//! `dataset_dict.json` and a directory per split) — plus plain text and
//! SQuAD files, which are not rows. What a file is comes from its content
//! (magic bytes, the first character), else its extension.
//!
//! A row is one JSON object, as a JSONL line is, its columns renamed as
//! `data.columns` says; each format reads it into what it needs
//! (`serde_json::Value`, or minijinja's `Value`, which keeps the keys' order
//! as Python does). Rows are read as they are needed — a line, or a record
//! batch of a Parquet row group or an Arrow stream, at a time — so memory
//! stays bounded however large the file.

mod columnar;

use anyhow::{bail, Context as _, Result};
use ft_core::config::DataConfig;
use std::collections::BTreeMap;
use std::io::{BufRead as _, BufReader, Read as _};
use std::path::{Path, PathBuf};
use std::rc::Rc;

/// What a data file holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// JSON lines (`.jsonl`, or `.json` as `datasets`' `to_json` writes it).
    Jsonl,
    /// A `.json` file holding one array of row objects.
    JsonArray,
    Parquet,
    /// Arrow IPC, stream (as `datasets` writes it) or file format.
    Arrow,
    /// Anything else: paragraphs, or JSON lines when its first line is JSON.
    Text,
    /// A SQuAD `.json` file (`{"data": [...]}`).
    Squad,
}

impl Kind {
    pub fn describe(self) -> &'static str {
        match self {
            Kind::Jsonl => "a JSON lines file",
            Kind::JsonArray => "a JSON array of rows",
            Kind::Parquet => "a Parquet file",
            Kind::Arrow => "an Arrow file",
            Kind::Text => "a text file",
            Kind::Squad => "a SQuAD JSON file",
        }
    }

    /// Read by columns (record batches), with a schema.
    fn columnar(self) -> bool {
        matches!(self, Kind::Parquet | Kind::Arrow)
    }
}

/// Which split of a dataset directory to read: the one `key` names
/// (`data.split`), else the only one, else the first of `defaults` it has.
#[derive(Debug, Clone, Copy)]
pub struct Split<'a> {
    pub key: &'static str,
    pub name: Option<&'a str>,
    pub defaults: &'static [&'static str],
}

impl<'a> Split<'a> {
    pub fn train(name: Option<&'a str>) -> Split<'a> {
        Split { key: "data.split", name, defaults: &["train"] }
    }

    pub fn eval(name: Option<&'a str>) -> Split<'a> {
        Split { key: "data.eval_split", name, defaults: EVAL_SPLITS }
    }
}

/// The names of evaluation splits, in the order one is chosen: a validation split before a test split.
const EVAL_SPLITS: &[&str] = &["validation", "valid", "val", "dev", "eval", "evaluation", "test", "testing"];

/// The evaluation data of a run: `data.eval` and the split `data.eval_split`
/// names; without `data.eval`, when the training data (`data.train`) is a
/// dataset directory, its split `data.eval_split` names, else its validation
/// split, else its test split, said in the log. None: nothing to evaluate on.
/// A directory whose other splits are none of these is refused, naming the
/// flags that choose.
pub fn eval_data(data: &DataConfig) -> Result<Option<(PathBuf, Option<String>)>> {
    if let Some(path) = &data.eval {
        return Ok(Some((path.clone(), data.eval_split.clone())));
    }
    let Some(dir) = data.train.as_ref().filter(|path| path.is_dir()) else {
        if let Some(split) = &data.eval_split {
            bail!("data.eval_split={split} names a split of the evaluation data, but there is none: give it with --eval-file (data.eval), or train on a dataset directory that has the split");
        }
        return Ok(None);
    };
    let splits = dir_splits(dir)?;
    let trained = choose_split(dir, splits.clone(), Split::train(data.split.as_deref()), "dataset directory")?.0;
    let others: Vec<String> = splits.into_iter().filter_map(|(name, _)| name).filter(|name| Some(name) != trained.as_ref()).collect();
    let chosen = match &data.eval_split {
        Some(split) if others.contains(split) => split.clone(),
        Some(split) => bail!("data.eval_split={split}: {} has no split `{split}` besides the one trained on; its other splits: {}", dir.display(), listed(&others)),
        None if others.is_empty() => return Ok(None),
        None => match EVAL_SPLITS.iter().find(|name| others.iter().any(|other| other == *name)) {
            Some(name) => name.to_string(),
            None => bail!(
                "{} has the splits {} besides the one trained on, none of them a validation or test split: \
                 evaluate on one with --set data.eval_split=NAME, or give other evaluation data with --eval-file",
                dir.display(),
                listed(&others)
            ),
        },
    };
    if crate::logs_data() {
        tracing::info!("no --eval-file: evaluating on the `{chosen}` split of {} (--eval-file gives other data, --set data.eval_split=NAME another split)", dir.display());
    }
    Ok(Some((dir.clone(), Some(chosen))))
}

/// Split names as a list for a message: `train`, `test`.
fn listed(names: &[String]) -> String {
    names.iter().map(|n| format!("`{n}`")).collect::<Vec<_>>().join(", ")
}

/// `data.columns`: the name a format reads → the file's column it reads it from.
pub type Columns = BTreeMap<String, String>;

/// A data source: its files, in order, all of one kind.
#[derive(Debug, Clone)]
pub struct Source {
    /// As the user gave it, with the split read: for logs and errors.
    pub name: String,
    pub kind: Kind,
    pub files: Vec<PathBuf>,
}

/// One row: a JSON object's text, and where it is.
#[derive(Debug, Clone)]
pub struct Row {
    pub file: Rc<Path>,
    /// JSON lines: the line (from 1); otherwise the row in the file (from 0).
    pub number: usize,
    unit: &'static str,
    text: Text,
}

/// A row's JSON: a line's own, or its record batch's line, written when
/// one of the batch's rows is first read (rows outside `data.range` never are).
#[derive(Debug, Clone)]
enum Text {
    Json(String),
    InBatch(Rc<columnar::Batch>, usize),
}

impl std::fmt::Display for Row {
    /// Where the row is: `data.jsonl line 3`, `train-00000-of-00002.parquet row 17`.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} {} {}", self.file.display(), self.unit, self.number)
    }
}

impl Row {
    /// The row as a JSON object's text.
    pub fn json(&self) -> Result<&str> {
        match &self.text {
            Text::Json(json) => Ok(json),
            Text::InBatch(batch, index) => batch.line(*index).with_context(|| format!("{self}: cannot write it as JSON")),
        }
    }

    /// The row as `T`, an error naming it where it is not valid JSON of that shape.
    pub fn parse<T: serde::de::DeserializeOwned>(&self) -> Result<T> {
        serde_json::from_str(self.json()?).with_context(|| format!("{self}: not valid JSON"))
    }
}

/// The rows of a source, in order.
pub type Rows = Box<dyn Iterator<Item = Result<Row>>>;

/// The split names `datasets` and the Hub recognise in file and directory names.
const SPLIT_NAMES: &[&str] = &["train", "training", "validation", "valid", "val", "dev", "test", "testing", "eval", "evaluation"];

impl Source {
    /// The source at `path`: a file, a glob (`*`, `?`, `[`), or a dataset directory, of which `split`.
    pub fn open(path: &Path, split: Split) -> Result<Source> {
        let text = path.to_string_lossy();
        let (splits, what) = if path.is_dir() {
            (dir_splits(path)?, "dataset directory")
        } else if !path.exists() && text.contains(['*', '?', '[']) {
            let files: Vec<PathBuf> = glob::glob(&text)
                .with_context(|| format!("{text} is not a valid glob pattern"))?
                .collect::<Result<_, _>>()
                .with_context(|| format!("cannot list {text}"))?;
            if files.is_empty() {
                bail!("no file matches {text}");
            }
            (vec![(None, files)], "glob")
        } else if !path.exists() {
            bail!("cannot read {}: no such file or directory", path.display())
        } else {
            (vec![(None, vec![path.to_path_buf()])], "file")
        };
        let (name, files) = choose_split(path, splits, split, what)?;
        let kinds = files.iter().map(|file| Ok((kind_of(file)?, file))).collect::<Result<Vec<_>>>()?;
        let kind = kinds[0].0;
        if let Some((other, file)) = kinds.iter().find(|(k, _)| *k != kind) {
            bail!("{text} mixes kinds of files: {} is {}, {} is {}", kinds[0].1.display(), kind.describe(), file.display(), other.describe());
        }
        if files.len() > 1 && !matches!(kind, Kind::Jsonl | Kind::JsonArray | Kind::Parquet | Kind::Arrow) {
            bail!("{text} holds several files of which {} is {}: only rows (JSON lines, JSON arrays, Parquet, Arrow) are read from several files", files[0].display(), kind.describe());
        }
        let name = match name {
            Some(split) => format!("{text} (split {split})"),
            None => text.into_owned(),
        };
        Ok(Source { name, kind, files })
    }

    /// The rows of every file in order, their columns renamed by `columns`.
    pub fn rows(&self, columns: &Columns) -> Rows {
        let (kind, columns) = (self.kind, Rc::new(columns.clone()));
        Box::new(self.files.clone().into_iter().flat_map(move |file| -> Rows {
            let rows = match kind.columnar() {
                true => columnar::rows(&file, kind, &columns),
                false => text_rows(&file, kind, columns.clone()),
            };
            rows.unwrap_or_else(|error| Box::new(std::iter::once(Err(error))))
        }))
    }

    /// The source's first row, if any.
    pub fn first_row(&self, columns: &Columns) -> Result<Option<Row>> {
        self.rows(columns).next().transpose()
    }
}

/// The files of each split of a dataset directory, in order: a
/// `DatasetDict`'s, a saved `Dataset`'s (one, unnamed), or the data files
/// below it (Parquet, Arrow, JSON lines) by the split their name says.
fn dir_splits(dir: &Path) -> Result<Vec<(Option<String>, Vec<PathBuf>)>> {
    let dict = dir.join("dataset_dict.json");
    if dict.exists() {
        let json: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&dict).with_context(|| format!("cannot read {}", dict.display()))?)
            .with_context(|| format!("{} is not valid JSON", dict.display()))?;
        let names = json.get("splits").and_then(|s| s.as_array()).with_context(|| format!("{} has no list \"splits\"", dict.display()))?;
        return names
            .iter()
            .map(|name| {
                let name = name.as_str().with_context(|| format!("{}: a split that is not a string", dict.display()))?;
                Ok((Some(name.to_string()), saved_dataset(&dir.join(name))?))
            })
            .collect();
    }
    if dir.join("state.json").exists() {
        return Ok(vec![(None, saved_dataset(dir)?)]);
    }
    let mut files = vec![];
    data_files(dir, &mut files)?;
    if files.is_empty() {
        bail!("{} holds no data files (Parquet, Arrow or JSON lines), nor a dataset saved by `datasets` (state.json, dataset_dict.json)", dir.display());
    }
    files.sort();
    let mut splits: Vec<(Option<String>, Vec<PathBuf>)> = vec![];
    for file in files {
        let split = split_named(file.strip_prefix(dir).unwrap_or(&file));
        match splits.iter_mut().find(|(name, _)| *name == split) {
            Some((_, files)) => files.push(file),
            None => splits.push((split, vec![file])),
        }
    }
    if splits.len() > 1 {
        if let Some((_, files)) = splits.iter().find(|(name, _)| name.is_none()) {
            bail!("{}: {} names no split, where other files do (e.g. data/train-00000-of-00001.parquet)", dir.display(), files[0].display());
        }
    }
    Ok(splits)
}

/// A saved `Dataset`'s Arrow files, as its `state.json` lists them.
fn saved_dataset(dir: &Path) -> Result<Vec<PathBuf>> {
    let state = dir.join("state.json");
    let text = std::fs::read_to_string(&state).with_context(|| format!("cannot read {} (a dataset saved by `datasets`' save_to_disk has one)", state.display()))?;
    let json: serde_json::Value = serde_json::from_str(&text).with_context(|| format!("{} is not valid JSON", state.display()))?;
    let files = json.get("_data_files").and_then(|f| f.as_array()).with_context(|| format!("{} has no list \"_data_files\"", state.display()))?;
    files
        .iter()
        .map(|file| Ok(dir.join(file.get("filename").and_then(|f| f.as_str()).with_context(|| format!("{}: a data file without \"filename\"", state.display()))?)))
        .collect()
}

/// The Parquet, Arrow and JSON lines files below `dir`, hidden ones left out.
fn data_files(dir: &Path, files: &mut Vec<PathBuf>) -> Result<()> {
    for entry in std::fs::read_dir(dir).with_context(|| format!("cannot list {}", dir.display()))? {
        let path = entry?.path();
        if path.file_name().is_some_and(|n| n.to_string_lossy().starts_with('.')) {
            continue;
        }
        if path.is_dir() {
            data_files(&path, files)?;
        } else if matches!(path.extension().and_then(|e| e.to_str()), Some("parquet" | "arrow" | "jsonl")) {
            files.push(path);
        }
    }
    Ok(())
}

/// The split a data file's path names: `NAME-0000k-of-0000n.parquet` (the
/// Hub's own naming), or a directory or file named as a split (`train/`, `test.jsonl`).
fn split_named(relative: &Path) -> Option<String> {
    let stem = relative.file_stem()?.to_string_lossy();
    if let Some((name, shard)) = stem.split_once('-') {
        let numbered = shard.split("-of-").collect::<Vec<_>>();
        if numbered.len() == 2 && numbered.iter().all(|n| !n.is_empty() && n.chars().all(|c| c.is_ascii_digit())) {
            return Some(name.to_string());
        }
    }
    let parts = relative.parent().into_iter().flat_map(|p| p.components()).map(|c| c.as_os_str().to_string_lossy().into_owned());
    parts.chain([stem.into_owned()]).find(|part| SPLIT_NAMES.contains(&part.to_lowercase().as_str()))
}

/// The files of the split `split` asks for.
fn choose_split(path: &Path, splits: Vec<(Option<String>, Vec<PathBuf>)>, split: Split, what: &str) -> Result<(Option<String>, Vec<PathBuf>)> {
    let names: Vec<String> = splits.iter().filter_map(|(name, _)| name.clone()).collect();
    let listed = || listed(&names);
    match split.name {
        Some(wanted) if names.is_empty() => {
            bail!("{}={wanted}: {} is a {what} without splits (it is read whole; leave {} unset)", split.key, path.display(), split.key)
        }
        Some(wanted) => match splits.into_iter().find(|(name, _)| name.as_deref() == Some(wanted)) {
            Some(found) => Ok(found),
            None => bail!("{}={wanted}: {} has no split `{wanted}`; its splits: {}", split.key, path.display(), listed()),
        },
        None if splits.len() == 1 => Ok(splits.into_iter().next().expect("one split")),
        None => match split.defaults.iter().find(|d| names.iter().any(|n| n == *d)) {
            Some(default) => Ok(splits.into_iter().find(|(name, _)| name.as_deref() == Some(default)).expect("the split is there")),
            None => bail!("{} has the splits {}: choose one with {}=NAME", path.display(), listed(), split.key),
        },
    }
}

/// What `file` is, by its first bytes, else its extension.
fn kind_of(file: &Path) -> Result<Kind> {
    let mut head = Vec::with_capacity(8);
    std::fs::File::open(file)
        .with_context(|| format!("cannot read {}", file.display()))?
        .take(8)
        .read_to_end(&mut head)
        .with_context(|| format!("cannot read {}", file.display()))?;
    let extension = file.extension().and_then(|e| e.to_str()).unwrap_or("");
    if head.starts_with(b"PAR1") {
        return Ok(Kind::Parquet);
    }
    if head.starts_with(b"ARROW1") || head.starts_with(&[0xff; 4]) {
        return Ok(Kind::Arrow);
    }
    let compressed: [(&[u8], &str); 5] = [(b"\x1f\x8b", "gzip"), (b"\x28\xb5\x2f\xfd", "zstd"), (b"PK\x03\x04", "zip"), (b"BZh", "bzip2"), (b"\xfd7zXZ", "xz")];
    if let Some((_, name)) = compressed.iter().find(|(magic, _)| head.starts_with(magic)) {
        bail!("{} is a {name}-compressed file; ft reads it uncompressed", file.display());
    }
    match extension {
        "parquet" => bail!("{} is not a Parquet file: it does not start with Parquet's magic bytes PAR1", file.display()),
        "arrow" => bail!("{} is not an Arrow file: it starts with neither an IPC stream's 0xFFFFFFFF nor ARROW1", file.display()),
        "jsonl" => Ok(Kind::Jsonl),
        "json" => json_kind(file),
        _ => Ok(Kind::Text),
    }
}

/// A `.json` file: an array of rows (`[`), JSON lines (a first line that
/// is a whole object, as `datasets`' `to_json` writes them), or SQuAD.
fn json_kind(file: &Path) -> Result<Kind> {
    let mut reader = BufReader::new(std::fs::File::open(file).with_context(|| format!("cannot read {}", file.display()))?);
    let start = loop {
        let buffer = reader.fill_buf().with_context(|| format!("cannot read {}", file.display()))?;
        match buffer.iter().position(|b| !b.is_ascii_whitespace()) {
            Some(at) => break buffer[at],
            None if buffer.is_empty() => bail!("{} is empty", file.display()),
            None => {
                let all = buffer.len();
                reader.consume(all);
            }
        }
    };
    if start == b'[' {
        return Ok(Kind::JsonArray);
    }
    let mut line = String::new();
    reader.read_line(&mut line).with_context(|| format!("{} is not UTF-8 text", file.display()))?;
    // A SQuAD file written on one line is read whole here: by serde_json's own, optimised `FromStr` (Cargo.toml says why).
    match line.parse::<serde_json::Value>() {
        Ok(serde_json::Value::Object(keys)) if !keys.contains_key("data") => Ok(Kind::Jsonl),
        _ => Ok(Kind::Squad),
    }
}

/// The rows of a JSON lines, JSON array or text file.
fn text_rows(file: &Path, kind: Kind, columns: Rc<Columns>) -> Result<Rows> {
    let path: Rc<Path> = Rc::from(file);
    let rename = move |row: Row| match columns.is_empty() {
        true => Ok(row),
        false => rename_columns(row, &columns),
    };
    if kind == Kind::JsonArray {
        let text = std::fs::read_to_string(file).with_context(|| format!("cannot read {}", file.display()))?;
        let rows: Vec<Box<serde_json::value::RawValue>> =
            serde_json::from_str(&text).with_context(|| format!("{} is not valid JSON (a JSON array of rows, as its first character says)", file.display()))?;
        return Ok(Box::new(rows.into_iter().enumerate().map(move |(number, raw)| {
            let row = Row { file: path.clone(), number, unit: "row", text: Text::Json(raw.get().to_string()) };
            match raw.get().starts_with('{') {
                true => rename(row),
                false => bail!("{row}: not an object {{\"column\": value, …}}"),
            }
        })));
    }
    let reader = BufReader::new(std::fs::File::open(file).with_context(|| format!("cannot read {}", file.display()))?);
    Ok(Box::new(reader.lines().enumerate().filter_map(move |(index, line)| {
        let row = Row { file: path.clone(), number: index + 1, unit: "line", text: Text::Json(String::new()) };
        match line {
            Err(error) if error.kind() == std::io::ErrorKind::InvalidData => Some(Err(anyhow::anyhow!("{row}: not UTF-8 text"))),
            Err(error) => Some(Err(anyhow::Error::new(error).context(format!("cannot read {}", path.display())))),
            Ok(line) if line.trim().is_empty() => None,
            Ok(json) => Some(rename(Row { text: Text::Json(json), ..row })),
        }
    })))
}

/// `row` with `columns`' file columns under their new names (a column the
/// new name had before goes); keys keep their order. A column the row
/// lacks is an error listing the ones it has.
fn rename_columns(row: Row, columns: &Columns) -> Result<Row> {
    use minijinja::value::{Value, ValueKind};
    let value: Value = row.parse()?;
    if value.kind() != ValueKind::Map {
        bail!("{row}: not an object {{\"column\": value, …}}");
    }
    let keys: Vec<Value> = value.try_iter().map_err(|e| anyhow::anyhow!("{row}: {e}"))?.collect();
    let has = |column: &str| keys.iter().any(|k| k.as_str() == Some(column));
    if let Some((name, column)) = columns.iter().find(|(_, column)| !has(column)) {
        let listed = keys.iter().map(|k| format!("`{k}`")).collect::<Vec<_>>().join(", ");
        bail!("{row}: no column `{column}` (data.columns.{name}); its columns: {listed}");
    }
    let renamed = keys.iter().filter_map(|key| {
        let key = key.as_str()?;
        let new_name = columns.iter().find(|(_, column)| *column == key).map(|(name, _)| name.as_str());
        match new_name {
            Some(name) => Some((name.to_string(), value.get_attr(key).ok()?)),
            // Replaced by a renamed column.
            None if columns.contains_key(key) => None,
            None => Some((key.to_string(), value.get_attr(key).ok()?)),
        }
    });
    let json = serde_json::to_string(&Value::from_iter(renamed)).with_context(|| format!("{row}: cannot rename its columns"))?;
    Ok(Row { text: Text::Json(json), ..row })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn split_names_come_from_the_hubs_naming_or_directories() {
        let cases = [
            ("data/train-00000-of-00002.parquet", Some("train")),
            ("data/my_split-00001-of-00002.parquet", Some("my_split")),
            ("default/test/0000.parquet", Some("test")),
            ("validation.jsonl", Some("validation")),
            ("data/0000.parquet", None),
            ("data/pre-train.parquet", None),
        ];
        for (path, split) in cases {
            assert_eq!(split_named(Path::new(path)).as_deref(), split, "{path}");
        }
    }

    #[test]
    fn a_split_is_the_one_named_the_only_one_or_the_default() {
        let splits = || vec![(Some("test".to_string()), vec![PathBuf::from("t")]), (Some("train".to_string()), vec![PathBuf::from("a")])];
        let chosen = |split: Split| choose_split(Path::new("d"), splits(), split, "dataset directory").map(|(n, _)| n.unwrap());
        assert_eq!(chosen(Split::train(None)).unwrap(), "train");
        assert_eq!(chosen(Split::eval(None)).unwrap(), "test");
        assert_eq!(chosen(Split::train(Some("test"))).unwrap(), "test");
        let err = chosen(Split::train(Some("dev"))).unwrap_err().to_string();
        assert_eq!(err, "data.split=dev: d has no split `dev`; its splits: `test`, `train`");
        let two = vec![(Some("a".to_string()), vec![]), (Some("b".to_string()), vec![])];
        let err = choose_split(Path::new("d"), two, Split::train(None), "dataset directory").unwrap_err().to_string();
        assert_eq!(err, "d has the splits `a`, `b`: choose one with data.split=NAME");
        let err = choose_split(Path::new("f.parquet"), vec![(None, vec![])], Split::train(Some("train")), "file").unwrap_err().to_string();
        assert!(err.contains("f.parquet is a file without splits"), "{err}");
    }

    #[test]
    fn json_rows_are_read_from_lines_or_an_array_and_renamed_in_order() {
        let dir = tempfile::tempdir().unwrap();
        let lines = dir.path().join("a.jsonl");
        std::fs::write(&lines, "{\"z\": 1, \"abstract\": \"x\", \"text\": \"old\"}\n\n{\"z\": 2, \"abstract\": \"y\"}\n").unwrap();
        let array = dir.path().join("a.json");
        std::fs::write(&array, " [{\"z\": 1, \"abstract\": \"x\", \"text\": \"old\"}, {\"z\": 2, \"abstract\": \"y\"}]").unwrap();
        let columns = Columns::from([("text".to_string(), "abstract".to_string())]);
        for (path, kind, places) in [(&lines, Kind::Jsonl, ["a.jsonl line 1", "a.jsonl line 3"]), (&array, Kind::JsonArray, ["a.json row 0", "a.json row 1"])] {
            let source = Source::open(path, Split::train(None)).unwrap();
            assert_eq!(source.kind, kind);
            let rows: Vec<Row> = source.rows(&columns).collect::<Result<_>>().unwrap();
            assert_eq!(rows.iter().map(|r| r.json().unwrap()).collect::<Vec<_>>(), ["{\"z\":1,\"text\":\"x\"}", "{\"z\":2,\"text\":\"y\"}"]);
            assert!(rows.iter().zip(places).all(|(row, place)| row.to_string().ends_with(place)), "{rows:?}");
            let missing = Columns::from([("text".to_string(), "body".to_string())]);
            let err = source.rows(&missing).next().unwrap().unwrap_err().to_string();
            assert!(err.contains("no column `body` (data.columns.text); its columns: `z`, `abstract`, `text`"), "{err}");
        }
        let squad = dir.path().join("squad.json");
        std::fs::write(&squad, "{\"version\": \"v2.0\", \"data\": []}").unwrap();
        assert_eq!(Source::open(&squad, Split::train(None)).unwrap().kind, Kind::Squad);
        std::fs::write(&squad, "{\n  \"data\": []\n}").unwrap();
        assert_eq!(Source::open(&squad, Split::train(None)).unwrap().kind, Kind::Squad);
        let gz = dir.path().join("a.jsonl.gz");
        std::fs::write(&gz, b"\x1f\x8b\x08\x00").unwrap();
        assert!(Source::open(&gz, Split::train(None)).unwrap_err().to_string().contains("is a gzip-compressed file"));
        let fake = dir.path().join("b.parquet");
        std::fs::write(&fake, "{}").unwrap();
        assert!(Source::open(&fake, Split::train(None)).unwrap_err().to_string().contains("is not a Parquet file"));
    }
}

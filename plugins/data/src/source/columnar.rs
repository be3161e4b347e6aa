//! Rows of Parquet and Arrow files (apache/arrow-rs): record batches read
//! as they are needed — a Parquet file's row groups a batch at a time, an
//! Arrow IPC stream's batches one by one — each written as JSON objects
//! by arrow-json, one a row, when one of its rows is first read. A null (a struct field or column a row does
//! not have, as `datasets` fills them in) is left out, as the JSON lines
//! the dataset came from leave it out.

use super::{Columns, Kind, Row, Rows, Text};
use anyhow::{bail, Context as _, Result};
use arrow_array::RecordBatch;
use arrow_schema::{ArrowError, Schema, SchemaRef};
use std::fs::File;
use std::io::{BufReader, Read as _};
use std::cell::OnceCell;
use std::path::Path;
use std::rc::Rc;
use std::sync::Arc;

/// Rows decoded at a time: small enough to keep memory bounded, large enough to be fast.
const BATCH_ROWS: usize = 1024;

type Batches = Box<dyn Iterator<Item = Result<RecordBatch, ArrowError>>>;

/// The rows of a Parquet or Arrow `file`, its columns renamed by `columns`.
pub(super) fn rows(file: &Path, kind: Kind, columns: &Columns) -> Result<Rows> {
    let open = || File::open(file).with_context(|| format!("cannot read {}", file.display()));
    let what = kind.describe();
    let (schema, batches): (SchemaRef, Batches) = match kind {
        Kind::Parquet => {
            let builder = parquet::arrow::arrow_reader::ParquetRecordBatchReaderBuilder::try_new(open()?)
                .with_context(|| format!("cannot read {} as {what}", file.display()))?
                .with_batch_size(BATCH_ROWS);
            let schema = builder.schema().clone();
            (schema, Box::new(builder.build().with_context(|| format!("cannot read {} as {what}", file.display()))?))
        }
        _ => {
            let mut magic = [0u8; 6];
            open()?.read_exact(&mut magic).with_context(|| format!("cannot read {}", file.display()))?;
            if &magic == b"ARROW1" {
                let reader = arrow_ipc::reader::FileReader::try_new(open()?, None).with_context(|| format!("cannot read {} as {what}", file.display()))?;
                (reader.schema(), Box::new(reader))
            } else {
                let reader = arrow_ipc::reader::StreamReader::try_new(BufReader::new(open()?), None)
                    .with_context(|| format!("cannot read {} as {what}", file.display()))?;
                (reader.schema(), Box::new(reader))
            }
        }
    };
    let (projection, renamed) = rename(&schema, columns, file)?;
    let path: Rc<Path> = Rc::from(file);
    let mut next_row = 0;
    Ok(Box::new(batches.flat_map(move |batch| -> Rows {
        let batch = batch
            .with_context(|| format!("{}: cannot read a record batch", path.display()))
            .and_then(|batch| Ok(RecordBatch::try_new(renamed.clone(), batch.project(&projection)?.columns().to_vec())?));
        match batch {
            Ok(batch) => {
                let (path, first, rows) = (path.clone(), next_row, batch.num_rows());
                next_row += rows;
                let batch = Rc::new(Batch { batch, lines: OnceCell::new() });
                Box::new((0..rows).map(move |i| Ok(Row { file: path.clone(), number: first + i, unit: "row", text: Text::InBatch(batch.clone(), i) })))
            }
            Err(error) => Box::new(std::iter::once(Err(error))),
        }
    })))
}

/// A record batch, and its rows as JSON once one of them is read.
#[derive(Debug)]
pub(super) struct Batch {
    batch: RecordBatch,
    lines: OnceCell<Result<Vec<String>, String>>,
}

impl Batch {
    /// Row `index` as a JSON object's text, nulls left out.
    pub(super) fn line(&self, index: usize) -> Result<&str> {
        let lines = self.lines.get_or_init(|| json_lines(&self.batch).map_err(|e| format!("{e:#}")));
        match lines {
            Ok(lines) => Ok(&lines[index]),
            Err(error) => bail!("{error}"),
        }
    }
}

/// The columns to keep (all but those a renamed column replaces) and the
/// schema they take: `columns`' file columns under their new names. A
/// column the file lacks is an error listing the ones it has.
fn rename(schema: &Schema, columns: &Columns, file: &Path) -> Result<(Vec<usize>, SchemaRef)> {
    let names: Vec<&str> = schema.fields().iter().map(|f| f.name().as_str()).collect();
    if let Some((name, column)) = columns.iter().find(|(_, column)| !names.contains(&column.as_str())) {
        let listed = names.iter().map(|n| format!("`{n}`")).collect::<Vec<_>>().join(", ");
        bail!("{}: no column `{column}` (data.columns.{name}); its columns: {listed}", file.display());
    }
    let mut projection = vec![];
    let mut fields = vec![];
    for (index, field) in schema.fields().iter().enumerate() {
        match columns.iter().find(|(_, column)| *column == field.name()) {
            Some((name, _)) => fields.push(field.as_ref().clone().with_name(name)),
            // Replaced by a renamed column.
            None if columns.contains_key(field.name()) => continue,
            None => fields.push(field.as_ref().clone()),
        }
        projection.push(index);
    }
    Ok((projection, Arc::new(Schema::new(fields))))
}

/// Each row of `batch` as a JSON object's text, nulls left out.
fn json_lines(batch: &RecordBatch) -> Result<Vec<String>> {
    let mut writer = arrow_json::LineDelimitedWriter::new(Vec::new());
    writer.write(batch)?;
    writer.finish()?;
    let text = String::from_utf8(writer.into_inner())?;
    Ok(text.lines().map(String::from).collect())
}

//! Parquet input for tokenization (FineWeb, Dolma and most Hugging Face datasets ship as
//! parquet): the documents of one string column, read with the `parquet` crate (arrow-rs)
//! through its column reader: tokenization needs only the strings, not arrow's in-memory
//! format (the crate's `arrow` feature, off: it is a large share of a clean build).
//!
//! Only the text column is read, a batch of rows at a time from one page after another, so
//! memory stays bounded by a page however large the file is. Each non-null value is one
//! document, in file order, exactly as the same text on a JSONL line would be; null values
//! are skipped (counted in [`ParquetDocs::nulls`]). The column must be a top-level column of
//! strings (`BYTE_ARRAY` annotated `STRING`/`UTF8`: arrow's `string`, `large_string` and
//! `string_view` are all written so); a missing column is an error naming the file and the
//! columns it has, and a value that is not UTF-8 one naming its row.

use crate::error::{DataError, Result};
use parquet::basic::{ConvertedType, LogicalType, Type as PhysicalType};
use parquet::column::reader::{ColumnReader, ColumnReaderImpl};
use parquet::data_type::{ByteArray, ByteArrayType};
use parquet::file::reader::{FileReader, SerializedFileReader};
use parquet::schema::types::ColumnDescriptor;
use std::fs::File;
use std::path::{Path, PathBuf};

/// Rows decoded at a time.
const BATCH_ROWS: usize = 1024;

/// The documents of one parquet file's text column, streamed.
pub struct ParquetDocs {
    path: PathBuf,
    file: SerializedFileReader<File>,
    /// The text column's index among the file's leaf columns, and its maximum definition
    /// level (0: required; below it, a value is null).
    column: usize,
    max_def: i16,
    /// The next row group to open, and the text column's reader in the current one.
    next_group: usize,
    reader: Option<ColumnReaderImpl<ByteArrayType>>,
    /// The current batch: its definition levels (one per row) and non-null values, and the
    /// next row and value in it.
    defs: Vec<i16>,
    values: Vec<ByteArray>,
    batch_rows: usize,
    at_row: usize,
    at_value: usize,
    /// Rows read so far (for progress and messages).
    rows: u64,
    total_rows: u64,
    file_bytes: u64,
    nulls: u64,
}

fn parquet_err(path: &Path, what: &str, e: impl std::fmt::Display) -> DataError {
    let e = e.to_string();
    let hint = if e.contains("Disabled feature") || e.contains("not supported") {
        " (a compression codec this kiln does not read: snappy, gzip, lz4 and zstd are read)"
    } else {
        ""
    };
    DataError::format(path, format!("{what}: {e}{hint}"))
}

/// Runs `f`, turning a panic of the parquet reader on damaged data into an error naming the
/// file (the reader validates what it reads, but a reader of received files must never take
/// kiln down).
fn guarded<T>(path: &Path, f: impl FnOnce() -> Result<T>) -> Result<T> {
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)).unwrap_or_else(|_| {
        Err(DataError::format(
            path,
            "the parquet reader failed on damaged data; is the file complete?",
        ))
    })
}

/// What a top-level leaf column holds, when it is not strings.
fn not_strings(c: &ColumnDescriptor) -> Option<String> {
    let string = matches!(c.logical_type_ref(), Some(LogicalType::String))
        || c.converted_type() == ConvertedType::UTF8;
    match (c.physical_type(), string) {
        _ if c.max_rep_level() > 0 => Some("nested or repeated values".into()),
        (PhysicalType::BYTE_ARRAY, true) => None,
        (PhysicalType::BYTE_ARRAY, false) => Some("binary values (BYTE_ARRAY, not STRING)".into()),
        (t, _) => Some(match c.logical_type_ref() {
            Some(l) => format!("{t} ({l:?})"),
            None => t.to_string(),
        }),
    }
}

impl ParquetDocs {
    /// Opens `path` and checks that it has a string column `column`.
    pub fn open(path: &Path, column: &str) -> Result<Self> {
        guarded(path, || Self::open_unguarded(path, column))
    }

    fn open_unguarded(path: &Path, column: &str) -> Result<Self> {
        let file = kiln_run::files::open_regular(path).map_err(|e| DataError::io(path, e))?;
        let file_bytes = file.metadata().map_err(|e| DataError::io(path, e))?.len();
        let file = SerializedFileReader::new(file)
            .map_err(|e| parquet_err(path, "not a readable parquet file", e))?;
        let meta = file.metadata().file_metadata();
        let schema = meta.schema_descr();
        let wrong = |what: String| {
            DataError::format(
                path,
                format!(
                    "column {column:?} holds {what}, not strings (choose the text column with --text-column)"
                ),
            )
        };
        let top = schema.root_schema().get_fields();
        let Some(field) = top.iter().find(|f| f.name() == column) else {
            let names: Vec<&str> = top.iter().map(|f| f.name()).collect();
            return Err(DataError::format(
                path,
                format!(
                    "no column {column:?}; the file's columns are {names:?} (choose one with --text-column)"
                ),
            ));
        };
        if field.is_group() {
            return Err(wrong("nested or repeated values".into()));
        }
        let (index, leaf) = (schema.columns().iter().enumerate())
            .find(|(_, c)| c.path().parts() == [column])
            .ok_or_else(|| wrong("nested or repeated values".into()))?;
        if let Some(what) = not_strings(leaf) {
            return Err(wrong(what));
        }
        Ok(Self {
            path: path.to_path_buf(),
            column: index,
            max_def: leaf.max_def_level(),
            total_rows: u64::try_from(meta.num_rows()).unwrap_or(0),
            file,
            next_group: 0,
            reader: None,
            defs: Vec::new(),
            values: Vec::new(),
            batch_rows: 0,
            at_row: 0,
            at_value: 0,
            rows: 0,
            file_bytes,
            nulls: 0,
        })
    }

    /// Null values skipped so far.
    pub fn nulls(&self) -> u64 {
        self.nulls
    }

    /// The file's bytes read so far, estimated from the rows read (for progress).
    pub fn bytes(&self) -> u64 {
        match self.total_rows {
            0 => 0,
            n => (self.file_bytes as u128 * u128::from(self.rows.min(n)) / u128::from(n)) as u64,
        }
    }

    /// The file's size.
    pub fn file_bytes(&self) -> u64 {
        self.file_bytes
    }

    /// The next document, or `None` after the last row.
    pub fn next_doc(&mut self) -> Result<Option<String>> {
        let path = self.path.clone();
        guarded(&path, || self.next_unguarded())
    }

    fn next_unguarded(&mut self) -> Result<Option<String>> {
        loop {
            if self.at_row < self.batch_rows {
                let null = self.max_def > 0 && self.defs[self.at_row] < self.max_def;
                self.at_row += 1;
                self.rows += 1;
                if null {
                    self.nulls += 1;
                    continue;
                }
                let value = self.values.get(self.at_value).ok_or_else(|| {
                    DataError::format(&self.path, format!("row {}: a value is missing", self.rows))
                })?;
                self.at_value += 1;
                let text = std::str::from_utf8(value.data()).map_err(|e| {
                    DataError::format(&self.path, format!("row {}: not UTF-8 ({e})", self.rows))
                })?;
                return Ok(Some(text.to_string()));
            }
            if !self.read_batch()? {
                return Ok(None);
            }
        }
    }

    /// Decodes the next batch of rows, opening the next row group when the current one is
    /// done; false after the last.
    fn read_batch(&mut self) -> Result<bool> {
        let read_err = |rows: u64, e: parquet::errors::ParquetError| {
            parquet_err(&self.path, &format!("reading the rows after row {rows}"), e)
        };
        loop {
            if let Some(reader) = &mut self.reader {
                self.defs.clear();
                self.values.clear();
                let defs = (self.max_def > 0).then_some(&mut self.defs);
                let (rows, _, _) = reader
                    .read_records(BATCH_ROWS, defs, None, &mut self.values)
                    .map_err(|e| read_err(self.rows, e))?;
                if rows > 0 {
                    (self.batch_rows, self.at_row, self.at_value) = (rows, 0, 0);
                    if self.max_def > 0 && self.defs.len() < rows {
                        return Err(DataError::format(
                            &self.path,
                            format!("rows after row {}: definition levels missing", self.rows),
                        ));
                    }
                    return Ok(true);
                }
            }
            if self.next_group >= self.file.num_row_groups() {
                return Ok(false);
            }
            let group = (self.file.get_row_group(self.next_group))
                .and_then(|g| g.get_column_reader(self.column))
                .map_err(|e| read_err(self.rows, e))?;
            self.next_group += 1;
            self.reader = match group {
                ColumnReader::ByteArrayColumnReader(r) => Some(r),
                // The column's type was checked when the file was opened.
                _ => None,
            };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use parquet::data_type::Int64Type;
    use parquet::file::properties::WriterProperties;
    use parquet::file::writer::SerializedFileWriter;
    use parquet::schema::parser::parse_message_type;
    use std::sync::Arc;

    /// A parquet file of `texts` (None: null) in column "text" after an id column, with row
    /// groups of `group` rows.
    pub(crate) fn write(path: &Path, texts: &[Option<&str>], group: usize) {
        let schema = "message m { required int64 id; optional binary text (STRING); }";
        let schema = Arc::new(parse_message_type(schema).unwrap());
        let props = Arc::new(WriterProperties::builder().build());
        let file = std::fs::File::create(path).unwrap();
        let mut w = SerializedFileWriter::new(file, schema, props).unwrap();
        for (g, rows) in texts.chunks(group).enumerate() {
            let mut rg = w.next_row_group().unwrap();
            let ids: Vec<i64> = (0..rows.len()).map(|i| (g * group + i) as i64).collect();
            let mut col = rg.next_column().unwrap().unwrap();
            col.typed::<Int64Type>()
                .write_batch(&ids, None, None)
                .unwrap();
            col.close().unwrap();
            let defs: Vec<i16> = rows.iter().map(|t| i16::from(t.is_some())).collect();
            let values: Vec<ByteArray> = rows.iter().flatten().map(|t| (*t).into()).collect();
            let mut col = rg.next_column().unwrap().unwrap();
            (col.typed::<ByteArrayType>())
                .write_batch(&values, Some(&defs), None)
                .unwrap();
            col.close().unwrap();
            rg.close().unwrap();
        }
        w.close().unwrap();
    }

    #[test]
    fn documents_stream_in_order_skipping_nulls() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("a.parquet");
        let texts: Vec<Option<String>> = (0..3000)
            .map(|i| (i % 7 != 3).then(|| format!("doc {i} ünï")))
            .collect();
        let refs: Vec<Option<&str>> = texts.iter().map(|t| t.as_deref()).collect();
        write(&p, &refs, 700);
        let mut docs = ParquetDocs::open(&p, "text").unwrap();
        let mut got = Vec::new();
        while let Some(d) = docs.next_doc().unwrap() {
            got.push(d);
        }
        let want: Vec<String> = texts.into_iter().flatten().collect();
        assert_eq!(got, want);
        assert_eq!(
            docs.nulls(),
            (0..3000).filter(|i| i % 7 == 3).count() as u64
        );
        assert_eq!(docs.bytes(), docs.file_bytes());
    }

    proptest::proptest! {
        /// A damaged file (bytes changed, or cut short) is read or refused naming the file:
        /// never a panic or a hang.
        #[test]
        fn damaged_files_never_panic(
            edits in proptest::collection::vec((0usize..4000, proptest::num::u8::ANY), 0..6),
            cut in 0usize..4000,
        ) {
            let dir = tempfile::tempdir().unwrap();
            let good = dir.path().join("good.parquet");
            let texts: Vec<Option<&str>> = (0u32..40).map(|i| (!i.is_multiple_of(5)).then_some("some words here")).collect();
            write(&good, &texts, 8);
            let mut bytes = std::fs::read(&good).unwrap();
            for (at, b) in edits {
                let n = bytes.len();
                bytes[at % n] = b;
            }
            bytes.truncate(bytes.len() - cut % bytes.len());
            let p = dir.path().join("bad.parquet");
            std::fs::write(&p, &bytes).unwrap();
            let read = ParquetDocs::open(&p, "text").and_then(|mut d| {
                let mut n = 0;
                while n < 10_000 && d.next_doc()?.is_some() {
                    n += 1;
                }
                Ok(n)
            });
            if let Err(e) = read {
                proptest::prop_assert!(e.to_string().contains("bad.parquet"), "{e}");
            }
        }
    }

    #[test]
    fn a_missing_or_non_string_column_is_named() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("a.parquet");
        write(&p, &[Some("x")], 10);
        let err = ParquetDocs::open(&p, "content").err().unwrap().to_string();
        assert!(
            err.contains("a.parquet")
                && err.contains("no column \"content\"")
                && err.contains("\"text\""),
            "{err}"
        );
        let err = ParquetDocs::open(&p, "id").err().unwrap().to_string();
        assert!(err.contains("column \"id\" holds INT64"), "{err}");
        let junk = dir.path().join("junk.parquet");
        std::fs::write(&junk, b"PAR1 not really").unwrap();
        let err = ParquetDocs::open(&junk, "text").err().unwrap().to_string();
        assert!(
            err.contains("junk.parquet") && err.contains("not a readable parquet"),
            "{err}"
        );
    }

    /// A column of lists or a group named as the text column is refused naming what it holds,
    /// as is one of bytes not annotated as strings.
    #[test]
    fn repeated_nested_and_binary_columns_are_refused() {
        let dir = tempfile::tempdir().unwrap();
        for (name, schema) in [
            ("list", "message m { repeated binary text (STRING); }"),
            (
                "group",
                "message m { optional group text { optional binary t (STRING); } }",
            ),
            ("binary", "message m { optional binary text; }"),
        ] {
            let p = dir.path().join(format!("{name}.parquet"));
            let schema = Arc::new(parse_message_type(schema).unwrap());
            let props = Arc::new(WriterProperties::builder().build());
            let file = std::fs::File::create(&p).unwrap();
            SerializedFileWriter::new(file, schema, props)
                .unwrap()
                .close()
                .unwrap();
            let err = ParquetDocs::open(&p, "text").err().unwrap().to_string();
            let what = match name {
                "binary" => "holds binary values",
                _ => "holds nested or repeated values",
            };
            assert!(
                err.contains(&format!("{name}.parquet")) && err.contains(what),
                "{err}"
            );
        }
    }
}

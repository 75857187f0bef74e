//! Parquet input for tokenization (FineWeb, Dolma and most Hugging Face datasets ship as
//! parquet): the documents of one string column, read with the `parquet` crate (arrow-rs).
//!
//! Only the text column is read (a projection), a batch of rows at a time, so memory stays
//! bounded by a row group's column chunk however large the file is. Each non-null value is
//! one document, in file order, exactly as the same text on a JSONL line would be; null
//! values are skipped (counted in [`ParquetDocs::nulls`]). The column must hold strings
//! (`string`, `large_string` or `string_view`); a missing column is an error naming the
//! file and the columns it has.

use crate::error::{DataError, Result};
use arrow_array::{Array, ArrayRef, LargeStringArray, StringArray, StringViewArray};
use arrow_schema::DataType;
use parquet::arrow::ProjectionMask;
use parquet::arrow::arrow_reader::{ParquetRecordBatchReader, ParquetRecordBatchReaderBuilder};
use std::path::{Path, PathBuf};

/// Rows decoded at a time.
const BATCH_ROWS: usize = 1024;

/// The documents of one parquet file's text column, streamed.
pub struct ParquetDocs {
    path: PathBuf,
    reader: ParquetRecordBatchReader,
    /// The current batch's column and the next row in it.
    current: Option<(ArrayRef, usize)>,
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
/// file (arrow-rs validates what it reads, but a reader of received files must never take
/// kiln down).
fn guarded<T>(path: &Path, f: impl FnOnce() -> Result<T>) -> Result<T> {
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)).unwrap_or_else(|_| {
        Err(DataError::format(
            path,
            "the parquet reader failed on damaged data; is the file complete?",
        ))
    })
}

impl ParquetDocs {
    /// Opens `path` and checks that it has a string column `column`.
    pub fn open(path: &Path, column: &str) -> Result<Self> {
        guarded(path, || Self::open_unguarded(path, column))
    }

    fn open_unguarded(path: &Path, column: &str) -> Result<Self> {
        let file = kiln_run::files::open_regular(path).map_err(|e| DataError::io(path, e))?;
        let file_bytes = file.metadata().map_err(|e| DataError::io(path, e))?.len();
        let builder = ParquetRecordBatchReaderBuilder::try_new(file)
            .map_err(|e| parquet_err(path, "not a readable parquet file", e))?;
        let schema = builder.schema().clone();
        let Some((index, field)) = schema
            .fields()
            .iter()
            .enumerate()
            .find(|(_, f)| f.name() == column)
        else {
            let names: Vec<&str> = schema.fields().iter().map(|f| f.name().as_str()).collect();
            return Err(DataError::format(
                path,
                format!(
                    "no column {column:?}; the file's columns are {names:?} (choose one with --text-column)"
                ),
            ));
        };
        if !matches!(
            field.data_type(),
            DataType::Utf8 | DataType::LargeUtf8 | DataType::Utf8View
        ) {
            return Err(DataError::format(
                path,
                format!(
                    "column {column:?} holds {}, not strings (choose the text column with --text-column)",
                    field.data_type()
                ),
            ));
        }
        let total_rows = u64::try_from(builder.metadata().file_metadata().num_rows()).unwrap_or(0);
        let mask = ProjectionMask::roots(builder.parquet_schema(), [index]);
        let reader = builder
            .with_projection(mask)
            .with_batch_size(BATCH_ROWS)
            .build()
            .map_err(|e| parquet_err(path, "cannot read the file", e))?;
        Ok(Self {
            path: path.to_path_buf(),
            reader,
            current: None,
            rows: 0,
            total_rows,
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
            if let Some((col, at)) = &mut self.current
                && *at < col.len()
            {
                let i = *at;
                *at += 1;
                self.rows += 1;
                if col.is_null(i) {
                    self.nulls += 1;
                    continue;
                }
                return Ok(Some(string_at(col, i).to_string()));
            }
            match self.reader.next() {
                None => return Ok(None),
                Some(Err(e)) => {
                    return Err(parquet_err(
                        &self.path,
                        &format!("reading the rows after row {}", self.rows),
                        e,
                    ));
                }
                Some(Ok(batch)) => self.current = Some((batch.column(0).clone(), 0)),
            }
        }
    }
}

/// Row `i` (not null) of a string column of one of the three string types.
fn string_at(col: &ArrayRef, i: usize) -> &str {
    let any = col.as_any();
    if let Some(a) = any.downcast_ref::<StringArray>() {
        a.value(i)
    } else if let Some(a) = any.downcast_ref::<LargeStringArray>() {
        a.value(i)
    } else if let Some(a) = any.downcast_ref::<StringViewArray>() {
        a.value(i)
    } else {
        // The type was checked when the file was opened.
        ""
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use arrow_array::{Int64Array, RecordBatch};
    use parquet::arrow::ArrowWriter;
    use parquet::file::properties::WriterProperties;
    use std::sync::Arc;

    /// A parquet file of `texts` (None: null) in column "text" and an id column, with row
    /// groups of `group` rows.
    pub(crate) fn write(path: &Path, texts: &[Option<&str>], group: usize) {
        let text: ArrayRef = Arc::new(StringArray::from(texts.to_vec()));
        let ids: ArrayRef = Arc::new(Int64Array::from_iter_values(0..texts.len() as i64));
        let batch = RecordBatch::try_from_iter([("id", ids), ("text", text)]).unwrap();
        let props = WriterProperties::builder()
            .set_max_row_group_row_count(Some(group))
            .build();
        let file = std::fs::File::create(path).unwrap();
        let mut w = ArrowWriter::try_new(file, batch.schema(), Some(props)).unwrap();
        w.write(&batch).unwrap();
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
        assert!(err.contains("column \"id\" holds Int64"), "{err}");
        let junk = dir.path().join("junk.parquet");
        std::fs::write(&junk, b"PAR1 not really").unwrap();
        let err = ParquetDocs::open(&junk, "text").err().unwrap().to_string();
        assert!(
            err.contains("junk.parquet") && err.contains("not a readable parquet"),
            "{err}"
        );
    }
}

//! The documents of text inputs: `.jsonl`/`.json` files (one JSON object per line, the text
//! under a key), `.parquet` files (a string column, [`crate::parquet`]) or plain text cut by
//! paragraph, by line or taken whole; read one at a time, every error naming the file and line.

use crate::error::{DataError, Result};
use std::fs::File;
use std::io::{BufRead, BufReader, Read};
use std::path::PathBuf;

/// Longest input line read (a JSONL document is one line).
pub const MAX_LINE_BYTES: u64 = 256 << 20;

/// How plain-text files are cut into documents.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum TextSplit {
    /// Blank-line separated paragraphs.
    #[default]
    Paragraph,
    /// Every non-empty line.
    Line,
    /// The whole file.
    File,
}

impl std::str::FromStr for TextSplit {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s {
            "paragraph" => Ok(TextSplit::Paragraph),
            "line" => Ok(TextSplit::Line),
            "file" => Ok(TextSplit::File),
            _ => Err(format!(
                "unknown split {s:?} (expected paragraph, line or file)"
            )),
        }
    }
}

/// Where documents come from.
#[derive(Debug, Clone)]
pub struct DocSource {
    pub files: Vec<PathBuf>,
    /// JSON field holding the text in `.jsonl`/`.json` files.
    pub json_key: String,
    /// Column holding the text in `.parquet` files.
    pub text_column: String,
    /// How `.txt` (any non-JSON) files split into documents.
    pub split: TextSplit,
}

impl DocSource {
    /// Total input bytes (for progress).
    pub fn total_bytes(&self) -> u64 {
        self.files
            .iter()
            .filter_map(|f| std::fs::metadata(f).ok())
            .map(|m| m.len())
            .sum()
    }

    /// A streaming reader over all documents of all files, in order.
    pub fn reader(&self) -> DocReader<'_> {
        DocReader {
            src: self,
            next_file: 0,
            current: None,
            bytes: 0,
            parquet: None,
            nulls: 0,
        }
    }
}

struct OpenFile {
    path: PathBuf,
    reader: BufReader<File>,
    json: bool,
    /// The number of the line last read (1-based; 0 before the first).
    line: usize,
    /// The byte offset in the file where the line last read starts.
    line_start: u64,
    /// The byte offset of the next line.
    offset: u64,
    done: bool,
}

/// Streams documents; see [`DocSource::reader`].
pub struct DocReader<'a> {
    src: &'a DocSource,
    next_file: usize,
    current: Option<OpenFile>,
    bytes: u64,
    /// The parquet file being read, if the current input is one.
    parquet: Option<crate::parquet::ParquetDocs>,
    /// Null values of finished parquet files, skipped.
    nulls: u64,
}

impl DocReader<'_> {
    /// Input bytes consumed so far.
    pub fn bytes(&self) -> u64 {
        self.bytes + self.parquet.as_ref().map_or(0, |p| p.bytes())
    }

    /// Null values skipped in parquet files so far.
    pub fn nulls(&self) -> u64 {
        self.nulls + self.parquet.as_ref().map_or(0, |p| p.nulls())
    }

    /// The next document of the parquet file being read; `None` (and the file closed) at its
    /// end, or when the current input is not one.
    fn next_parquet_doc(&mut self) -> Result<Option<String>> {
        let Some(p) = self.parquet.as_mut() else {
            return Ok(None);
        };
        if let Some(doc) = p.next_doc()? {
            return Ok(Some(doc));
        }
        self.bytes += p.file_bytes();
        self.nulls += p.nulls();
        self.parquet = None;
        Ok(None)
    }

    /// The next document, or `None` at the end of the last file.
    pub fn next_doc(&mut self) -> Result<Option<String>> {
        loop {
            if let Some(doc) = self.next_parquet_doc()? {
                return Ok(Some(doc));
            }
            if self.current.as_ref().is_none_or(|c| c.done) && !self.open_next()? {
                return Ok(None);
            }
            if self.parquet.is_some() {
                continue;
            }
            let Some(f) = self.current.as_mut() else {
                continue;
            };
            let split = if f.json {
                TextSplit::Line
            } else {
                self.src.split
            };
            let mut doc = String::new();
            let mut line = String::new();
            loop {
                let n = f.read_line(&mut line)?;
                self.bytes += n as u64;
                if n == 0 {
                    f.done = true;
                    break;
                }
                if f.json {
                    match f.json_text(&line, &self.src.json_key)? {
                        Some(text) => return Ok(Some(text)),
                        None => continue,
                    }
                }
                match split {
                    TextSplit::Line => {
                        let t = line.trim_end_matches(['\n', '\r']);
                        if !t.trim().is_empty() {
                            return Ok(Some(t.to_string()));
                        }
                    }
                    TextSplit::Paragraph if line.trim().is_empty() => {
                        if !doc.is_empty() {
                            break;
                        }
                    }
                    TextSplit::Paragraph | TextSplit::File => doc.push_str(&line),
                }
            }
            if !doc.is_empty() {
                let trimmed = doc.trim_end_matches(['\n', '\r']).len();
                doc.truncate(trimmed);
                return Ok(Some(doc));
            }
        }
    }

    /// Opens the next input file; `false` after the last.
    fn open_next(&mut self) -> Result<bool> {
        let Some(path) = self.src.files.get(self.next_file) else {
            return Ok(false);
        };
        self.next_file += 1;
        // A FIFO or device named as input is refused without blocking on it.
        let file = kiln_run::files::open_regular(path).map_err(|e| DataError::io(path, e))?;
        let ext = path
            .extension()
            .map(|e| e.to_string_lossy().to_lowercase())
            .unwrap_or_default();
        if ext == "parquet" {
            self.current = None;
            self.parquet = Some(crate::parquet::ParquetDocs::open(
                path,
                &self.src.text_column,
            )?);
            return Ok(true);
        }
        self.current = Some(OpenFile {
            path: path.clone(),
            reader: BufReader::with_capacity(1 << 20, file),
            json: ext == "jsonl" || ext == "json" || ext == "ndjson",
            line: 0,
            line_start: 0,
            offset: 0,
            done: false,
        });
        Ok(true)
    }
}

impl OpenFile {
    /// Reads the next line into `line` (cleared first); the bytes read, 0 at the end. Bounded,
    /// so that an input without newlines (/dev/zero, a binary file) is an error instead of a
    /// read that fills memory. A line that is not UTF-8 is an error naming its line, where
    /// the line starts and the offset of its first bad byte.
    fn read_line(&mut self, line: &mut String) -> Result<usize> {
        line.clear();
        let mut bytes = Vec::new();
        let n = (&mut self.reader)
            .take(MAX_LINE_BYTES + 1)
            .read_until(b'\n', &mut bytes)
            .map_err(|e| DataError::io(&self.path, e))?;
        if n == 0 {
            return Ok(0);
        }
        self.line += 1;
        self.line_start = self.offset;
        self.offset += n as u64;
        if n as u64 > MAX_LINE_BYTES {
            return Err(self.bad(format!(
                "line longer than {} MiB; is this a text or JSONL file?",
                MAX_LINE_BYTES >> 20
            )));
        }
        match String::from_utf8(bytes) {
            Ok(text) => *line = text,
            Err(e) => {
                let at = e.utf8_error().valid_up_to();
                let byte = e.as_bytes().get(at).copied().unwrap_or(0);
                return Err(self.bad(format!(
                    "not valid UTF-8: byte 0x{byte:02x} at offset {} (column {}); convert the file to UTF-8 or drop the record",
                    self.line_start + at as u64,
                    at + 1
                )));
            }
        }
        Ok(n)
    }

    /// An error about the line last read: its file, number and where it starts.
    fn bad(&self, reason: String) -> DataError {
        DataError::record(&self.path, self.line, self.line_start, reason)
    }

    /// The string field `key` of the JSON object on `line` (the current line); `None` for a
    /// blank line.
    fn json_text(&self, line: &str, key: &str) -> Result<Option<String>> {
        if line.trim().is_empty() {
            return Ok(None);
        }
        let v: serde_json::Value =
            serde_json::from_str(line).map_err(|e| self.bad(format!("not a JSON object: {e}")))?;
        match v.get(key) {
            Some(serde_json::Value::String(text)) => Ok(Some(text.clone())),
            Some(other) => Err(self.bad(format!(
                "field {key:?} is {}, not a string (choose the field with --json-key)",
                json_kind(other)
            ))),
            None => Err(self.bad(format!(
                "no string field {key:?} (choose the field with --json-key)"
            ))),
        }
    }
}

/// What kind of JSON value `v` is, for an error message.
fn json_kind(v: &serde_json::Value) -> &'static str {
    match v {
        serde_json::Value::Null => "null",
        serde_json::Value::Bool(_) => "a boolean",
        serde_json::Value::Number(_) => "a number",
        serde_json::Value::String(_) => "a string",
        serde_json::Value::Array(_) => "an array",
        serde_json::Value::Object(_) => "an object",
    }
}

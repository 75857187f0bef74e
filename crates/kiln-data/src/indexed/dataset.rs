//! An open dataset (`.idx` and `.bin`): sequences read and decoded to token ids.

use super::format::*;
use super::index_file::*;
use crate::error::{DataError, Result};
use memmap2::Mmap;
use std::path::{Path, PathBuf};

/// An indexed dataset: the `.idx` plus the memory-mapped `.bin`.
#[derive(Debug)]
pub struct IndexedDataset {
    pub(super) prefix: PathBuf,
    pub(super) index: IndexFile,
    pub(super) bin_path: PathBuf,
    pub(super) bin: Option<Mmap>,
}

impl IndexedDataset {
    /// Open `PREFIX.idx` and `PREFIX.bin`, checking that the `.bin` has exactly the size the
    /// index describes (a truncated shard is caught here, naming the file).
    pub fn open(prefix: &Path) -> Result<IndexedDataset> {
        let index = IndexFile::open(&idx_path(prefix))?;
        let bin_path = bin_path(prefix);
        let file =
            kiln_run::files::open_regular(&bin_path).map_err(|e| DataError::io(&bin_path, e))?;
        let len = file
            .metadata()
            .map_err(|e| DataError::io(&bin_path, e))?
            .len();
        let expected = index.expected_bin_len()?;
        if len != expected {
            return Err(DataError::format(
                &bin_path,
                format!(
                    "{} .bin: {len} bytes, but its index {} describes {expected}",
                    if len < expected {
                        "truncated"
                    } else {
                        "mismatched"
                    },
                    index.path().display()
                ),
            ));
        }
        // A zero-length file cannot be mapped on every platform; an empty dataset needs no map.
        let bin = if len == 0 {
            None
        } else {
            // SAFETY: read-only map of an immutable shard; see IndexFile::open.
            Some(unsafe { Mmap::map(&file) }.map_err(|e| DataError::io(&bin_path, e))?)
        };
        Ok(IndexedDataset {
            prefix: prefix.to_path_buf(),
            index,
            bin_path,
            bin,
        })
    }

    /// The prefix this dataset was opened from.
    pub fn prefix(&self) -> &Path {
        &self.prefix
    }
    /// The parsed index.
    pub fn index(&self) -> &IndexFile {
        &self.index
    }
    /// Token dtype.
    pub fn dtype(&self) -> DType {
        self.index.dtype
    }
    /// Number of sequences.
    pub fn len(&self) -> usize {
        self.index.sequences
    }
    /// Whether the dataset has no sequences.
    pub fn is_empty(&self) -> bool {
        self.index.sequences == 0
    }

    /// Append tokens `[offset, offset + count)` of sequence `seq` to `out`.
    pub fn read_into(
        &self,
        seq: usize,
        offset: usize,
        count: usize,
        out: &mut Vec<u32>,
    ) -> Result<()> {
        if seq >= self.index.sequences {
            return Err(DataError::Invalid(format!(
                "{}: sequence {seq} out of range (dataset has {})",
                self.prefix.display(),
                self.index.sequences
            )));
        }
        let len = self.index.length(seq)? as usize;
        if offset.checked_add(count).is_none_or(|end| end > len) {
            return Err(DataError::Invalid(format!(
                "{}: tokens {offset}..{} of sequence {seq} out of range (length {len})",
                self.prefix.display(),
                offset.saturating_add(count)
            )));
        }
        if count == 0 {
            return Ok(());
        }
        let size = self.index.dtype.size();
        let ptr = self.index.pointer(seq);
        let bin = self.bin.as_deref().ok_or_else(|| {
            DataError::format(&self.bin_path, "no token data (.bin not opened or empty)")
        })?;
        let start = usize::try_from(ptr)
            .ok()
            .and_then(|p| p.checked_add(offset * size))
            .filter(|s| s + count * size <= bin.len())
            .ok_or_else(|| {
                DataError::format(
                    &self.bin_path,
                    format!("sequence {seq} points at byte {ptr}, outside the file"),
                )
            })?;
        let bytes = &bin[start..start + count * size];
        out.reserve(count);
        decode(self.index.dtype, bytes, out).map_err(|(_, v)| {
            DataError::format(
                &self.bin_path,
                format!("sequence {seq} holds token {v}, not a valid token id"),
            )
        })
    }

    /// The largest token id any id of this dtype can be (`u16`: 65535), without reading
    /// the tokens.
    pub fn dtype_max_token(&self) -> u64 {
        match self.index.dtype {
            DType::U8 => u8::MAX as u64,
            DType::I8 => i8::MAX as u64,
            DType::I16 => i16::MAX as u64,
            DType::U16 => u16::MAX as u64,
            DType::I32 => i32::MAX as u64,
            DType::I64 | DType::F32 | DType::F64 => u32::MAX as u64,
        }
    }

    /// The largest token id in the `.bin`, read in parallel (`None`: no tokens). A negative
    /// or out-of-range id is an error naming its byte offset. O(tokens); cache the result.
    pub fn scan_max_token(&self) -> Result<Option<u32>> {
        use rayon::prelude::*;
        let Some(bin) = self.bin.as_deref() else {
            return Ok(None);
        };
        let size = self.index.dtype.size();
        let chunk = (16 << 20) / size * size;
        let maxima: Vec<Result<Option<u32>>> = bin
            .par_chunks(chunk)
            .enumerate()
            .map(|(k, bytes)| {
                let mut max: Option<u32> = None;
                let mut out = Vec::with_capacity(bytes.len() / size);
                decode(self.index.dtype, bytes, &mut out).map_err(|(i, v)| {
                    DataError::format(
                        &self.bin_path,
                        format!(
                            "byte {} holds token {v}, not a valid token id",
                            k * chunk + i * size
                        ),
                    )
                })?;
                for t in out {
                    max = Some(max.map_or(t, |m: u32| m.max(t)));
                }
                Ok(max)
            })
            .collect();
        let mut max = None;
        for m in maxima {
            if let Some(t) = m? {
                max = Some(max.map_or(t, |x: u32| x.max(t)));
            }
        }
        Ok(max)
    }

    /// All tokens of sequence `seq`.
    pub fn sequence(&self, seq: usize) -> Result<Vec<u32>> {
        let len = if seq < self.index.sequences {
            self.index.length(seq)? as usize
        } else {
            0
        };
        // No reservation by the stored length: a corrupt `.idx` may claim 2^31 tokens that the
        // `.bin` does not hold. `read_into` reserves only after checking the `.bin` has them.
        let mut out = Vec::new();
        self.read_into(seq, 0, len, &mut out)?;
        Ok(out)
    }

    /// All tokens of document `doc` (its sequences in order); an error names the index file
    /// when it has no such document or its document index is corrupt there.
    pub fn document(&self, doc: usize) -> Result<Vec<u32>> {
        let idx = &self.index;
        if doc >= idx.documents() {
            return Err(DataError::format(
                idx.path(),
                format!("no document {doc}: it holds {}", idx.documents()),
            ));
        }
        let (s0, s1) = (idx.document_index(doc), idx.document_index(doc + 1));
        if s0 < 0 || s1 < s0 || s1 as usize > idx.sequences() {
            return Err(DataError::format(
                idx.path(),
                format!("corrupt document index at document {doc}"),
            ));
        }
        let mut tokens = Vec::new();
        for s in s0 as usize..s1 as usize {
            tokens.extend(self.sequence(s)?);
        }
        Ok(tokens)
    }
}

/// Appends the token ids stored as `dtype` in `bytes` to `out`; an id that is negative or
/// does not fit `u32` is returned as `(its index in bytes / size, its value)`.
pub(super) fn decode(
    dtype: DType,
    bytes: &[u8],
    out: &mut Vec<u32>,
) -> std::result::Result<(), (usize, i64)> {
    let start = out.len();
    let bad = |out: &Vec<u32>, v: i64| (out.len() - start, v);
    match dtype {
        DType::U16 => out.extend(
            bytes
                .chunks_exact(2)
                .map(|c| u16::from_le_bytes([c[0], c[1]]) as u32),
        ),
        DType::U8 => out.extend(bytes.iter().map(|&b| b as u32)),
        DType::I32 => {
            for c in bytes.chunks_exact(4) {
                let v = i32::from_le_bytes([c[0], c[1], c[2], c[3]]);
                let t = u32::try_from(v).map_err(|_| bad(out, v as i64))?;
                out.push(t);
            }
        }
        DType::I8 => {
            for &b in bytes {
                let v = b as i8;
                let t = u32::try_from(v).map_err(|_| bad(out, v as i64))?;
                out.push(t);
            }
        }
        DType::I16 => {
            for c in bytes.chunks_exact(2) {
                let v = i16::from_le_bytes([c[0], c[1]]);
                let t = u32::try_from(v).map_err(|_| bad(out, v as i64))?;
                out.push(t);
            }
        }
        DType::I64 => {
            for c in bytes.chunks_exact(8) {
                let mut a = [0u8; 8];
                a.copy_from_slice(c);
                let v = i64::from_le_bytes(a);
                let t = u32::try_from(v).map_err(|_| bad(out, v))?;
                out.push(t);
            }
        }
        // Rejected in IndexFile::open; nothing to decode.
        DType::F32 | DType::F64 => return Err((0, 0)),
    }
    Ok(())
}

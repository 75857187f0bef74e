//! Writing a dataset: tokens appended as sequences, then the `.idx` written.

use super::format::*;
use crate::error::{DataError, Result};
use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};

/// Writes a Megatron indexed dataset. Files are written under temporary names and renamed on
/// [`IndexedDatasetBuilder::finish`], so a crash never leaves a half-written shard under the
/// real name.
pub struct IndexedDatasetBuilder {
    pub(super) prefix: PathBuf,
    pub(super) dtype: DType,
    pub(super) bin_tmp: PathBuf,
    pub(super) bin: BufWriter<File>,
    pub(super) lengths: Vec<i32>,
    pub(super) doc_index: Vec<i64>,
    pub(super) bytes: u64,
}

impl IndexedDatasetBuilder {
    /// Start writing `PREFIX.bin`/`PREFIX.idx` with the given token dtype (integer dtypes only).
    pub fn create(prefix: &Path, dtype: DType) -> Result<IndexedDatasetBuilder> {
        if matches!(dtype, DType::F32 | DType::F64) {
            return Err(DataError::Invalid(format!(
                "{}: dtype {} cannot hold token ids",
                prefix.display(),
                dtype.name()
            )));
        }
        let bin_tmp = tmp_name(&bin_path(prefix));
        let file = File::create(&bin_tmp).map_err(|e| DataError::io(&bin_tmp, e))?;
        Ok(IndexedDatasetBuilder {
            prefix: prefix.to_path_buf(),
            dtype,
            bin_tmp,
            bin: BufWriter::with_capacity(1 << 20, file),
            lengths: Vec::new(),
            doc_index: vec![0],
            bytes: 0,
        })
    }

    /// Token dtype being written.
    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// Add one sequence (Megatron's `add_item`); call [`Self::end_document`] after the last
    /// sequence of a document.
    pub fn add_item(&mut self, tokens: &[u32]) -> Result<()> {
        let len = i32::try_from(tokens.len()).map_err(|_| {
            DataError::Invalid(format!(
                "{}: a sequence of {} tokens exceeds the format's i32 length",
                self.prefix.display(),
                tokens.len()
            ))
        })?;
        let mut buf = Vec::with_capacity(tokens.len() * self.dtype.size());
        for &t in tokens {
            let fits = match self.dtype {
                DType::U8 => t <= u8::MAX as u32,
                DType::I8 => t <= i8::MAX as u32,
                DType::U16 => t <= u16::MAX as u32,
                DType::I16 => t <= i16::MAX as u32,
                DType::I32 => t <= i32::MAX as u32,
                _ => true,
            };
            if !fits {
                return Err(DataError::Invalid(format!(
                    "{}: token id {t} does not fit dtype {}",
                    self.prefix.display(),
                    self.dtype.name()
                )));
            }
            match self.dtype {
                DType::U8 | DType::I8 => buf.push(t as u8),
                DType::U16 | DType::I16 => buf.extend_from_slice(&(t as u16).to_le_bytes()),
                DType::I32 => buf.extend_from_slice(&(t as i32).to_le_bytes()),
                DType::I64 => buf.extend_from_slice(&(t as i64).to_le_bytes()),
                DType::F32 | DType::F64 => unreachable!("rejected in create"),
            }
        }
        self.bin
            .write_all(&buf)
            .map_err(|e| DataError::io(&self.bin_tmp, e))?;
        self.bytes += buf.len() as u64;
        self.lengths.push(len);
        Ok(())
    }

    /// Close the current document (Megatron's `end_document`).
    pub fn end_document(&mut self) {
        self.doc_index.push(self.lengths.len() as i64);
    }

    /// Add a one-sequence document.
    pub fn add_document(&mut self, tokens: &[u32]) -> Result<()> {
        self.add_item(tokens)?;
        self.end_document();
        Ok(())
    }

    /// Sequences written so far.
    pub fn sequences(&self) -> usize {
        self.lengths.len()
    }

    /// Tokens written so far.
    pub fn tokens(&self) -> u64 {
        self.bytes / self.dtype.size() as u64
    }

    /// Write the `.idx` and publish both files under their real names.
    pub fn finish(mut self) -> Result<()> {
        self.bin
            .flush()
            .map_err(|e| DataError::io(&self.bin_tmp, e))?;
        let idx_final = idx_path(&self.prefix);
        let idx_tmp = tmp_name(&idx_final);
        write_index(&idx_tmp, self.dtype, &self.lengths, &self.doc_index)?;
        let bin_final = bin_path(&self.prefix);
        std::fs::rename(&self.bin_tmp, &bin_final).map_err(|e| DataError::io(&bin_final, e))?;
        std::fs::rename(&idx_tmp, &idx_final).map_err(|e| DataError::io(&idx_final, e))?;
        Ok(())
    }
}

/// Write an `.idx` file for the given sequence lengths and document index (pointers are
/// derived from the lengths, as Megatron's `_IndexWriter` does). Public so that benchmarks can
/// write index-only corpora.
pub fn write_index(path: &Path, dtype: DType, lengths: &[i32], doc_index: &[i64]) -> Result<()> {
    let file = File::create(path).map_err(|e| DataError::io(path, e))?;
    let mut w = BufWriter::with_capacity(1 << 20, file);
    let io = |e| DataError::io(path, e);
    w.write_all(INDEX_MAGIC).map_err(io)?;
    w.write_all(&1u64.to_le_bytes()).map_err(io)?;
    w.write_all(&[dtype.code()]).map_err(io)?;
    w.write_all(&(lengths.len() as u64).to_le_bytes())
        .map_err(io)?;
    w.write_all(&(doc_index.len() as u64).to_le_bytes())
        .map_err(io)?;
    w.write_all(bytemuck::cast_slice(&to_le_i32(lengths)))
        .map_err(io)?;
    let size = dtype.size() as i64;
    let mut ptr = 0i64;
    let mut pointers = Vec::with_capacity(lengths.len());
    for &l in lengths {
        pointers.push(ptr.to_le());
        ptr += l as i64 * size;
    }
    w.write_all(bytemuck::cast_slice(&pointers)).map_err(io)?;
    let docs: Vec<i64> = doc_index.iter().map(|d| d.to_le()).collect();
    w.write_all(bytemuck::cast_slice(&docs)).map_err(io)?;
    w.flush().map_err(io)?;
    Ok(())
}

pub(super) fn to_le_i32(v: &[i32]) -> Vec<i32> {
    v.iter().map(|x| x.to_le()).collect()
}

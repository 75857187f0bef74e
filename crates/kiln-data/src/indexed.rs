//! Megatron indexed datasets (`PREFIX.bin` + `PREFIX.idx`), byte-compatible with Megatron-LM
//! and megatron-core in both directions.
//!
//! `.idx` layout (all little-endian, no padding, so nothing after the header is aligned):
//!
//! | bytes | field |
//! | --- | --- |
//! | 9 | magic `MMIDIDX\0\0` |
//! | 8 | version, `u64` = 1 |
//! | 1 | dtype code (1 u8, 2 i8, 3 i16, 4 i32, 5 i64, 6 f64, 7 f32, 8 u16) |
//! | 8 | `sequence_count` (`u64`) |
//! | 8 | `document_count` (`u64`): length of the document-index array, i.e. documents + 1 |
//! | 4·S | sequence lengths (`i32`, in tokens) |
//! | 8·S | sequence pointers (`i64`, byte offsets into `.bin`) |
//! | 8·D | document indices (`i64`, first sequence of each document, then `S`) |
//! | S | optional: sequence modes (`i8`), only in multimodal datasets |
//!
//! `.bin` is the tokens of every sequence back to back in the dtype.
//!
//! Like megatron-core's `GPTDataset`, the blending layer treats each *sequence* as a
//! document; `tokenize` writes one sequence per document, as Megatron's `preprocess_data.py`
//! does without `--split-sentences`.

use crate::error::{DataError, Result};
use memmap2::Mmap;
use rayon::prelude::*;
use std::fs::File;
use std::io::{BufWriter, Write};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

/// The `.idx` magic bytes.
pub const INDEX_MAGIC: &[u8; 9] = b"MMIDIDX\x00\x00";
const HEADER_LEN: usize = 9 + 8 + 1 + 8 + 8;

/// Token dtype codes, as Megatron numbers them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DType {
    U8,
    I8,
    I16,
    I32,
    I64,
    F64,
    F32,
    U16,
}

impl DType {
    /// Megatron's numeric code for the dtype.
    pub fn code(self) -> u8 {
        match self {
            DType::U8 => 1,
            DType::I8 => 2,
            DType::I16 => 3,
            DType::I32 => 4,
            DType::I64 => 5,
            DType::F64 => 6,
            DType::F32 => 7,
            DType::U16 => 8,
        }
    }

    /// The dtype for a Megatron code, if it is one.
    pub fn from_code(code: u8) -> Option<DType> {
        Some(match code {
            1 => DType::U8,
            2 => DType::I8,
            3 => DType::I16,
            4 => DType::I32,
            5 => DType::I64,
            6 => DType::F64,
            7 => DType::F32,
            8 => DType::U16,
            _ => return None,
        })
    }

    /// Bytes per token.
    pub fn size(self) -> usize {
        match self {
            DType::U8 | DType::I8 => 1,
            DType::I16 | DType::U16 => 2,
            DType::I32 | DType::F32 => 4,
            DType::I64 | DType::F64 => 8,
        }
    }

    /// The dtype Megatron picks for a vocabulary: `uint16` below 65500 entries, else `int32`
    /// (`DType.optimal_dtype`). Matching it keeps files byte-identical with Megatron's.
    pub fn optimal(vocab_size: usize) -> DType {
        if vocab_size < 65_500 {
            DType::U16
        } else {
            DType::I32
        }
    }

    /// numpy's name for the dtype.
    pub fn name(self) -> &'static str {
        match self {
            DType::U8 => "uint8",
            DType::I8 => "int8",
            DType::I16 => "int16",
            DType::I32 => "int32",
            DType::I64 => "int64",
            DType::F64 => "float64",
            DType::F32 => "float32",
            DType::U16 => "uint16",
        }
    }
}

/// Path of the `.idx` file of a prefix (the prefix plus `.idx`, as Megatron appends it).
pub fn idx_path(prefix: &Path) -> PathBuf {
    let mut s = prefix.as_os_str().to_owned();
    s.push(".idx");
    PathBuf::from(s)
}

/// Path of the `.bin` file of a prefix.
pub fn bin_path(prefix: &Path) -> PathBuf {
    let mut s = prefix.as_os_str().to_owned();
    s.push(".bin");
    PathBuf::from(s)
}

#[inline]
fn le_u64(b: &[u8], at: usize) -> u64 {
    let mut a = [0u8; 8];
    a.copy_from_slice(&b[at..at + 8]);
    u64::from_le_bytes(a)
}

#[inline]
fn le_i32(b: &[u8], at: usize) -> i32 {
    let mut a = [0u8; 4];
    a.copy_from_slice(&b[at..at + 4]);
    i32::from_le_bytes(a)
}

#[inline]
fn le_i64(b: &[u8], at: usize) -> i64 {
    let mut a = [0u8; 8];
    a.copy_from_slice(&b[at..at + 8]);
    i64::from_le_bytes(a)
}

/// Entries of an `.idx` array read per call by the streamed passes ([`IndexFile::stream`]):
/// 64 Ki sequences, 256 KiB of lengths and 512 KiB of pointers.
pub const RUN: usize = 1 << 16;

/// The parsed `.idx` of a dataset, memory-mapped. Opening costs O(1): the arrays are read
/// lazily through the map, so a 100M-sequence index opens instantly. Whole-array passes
/// ([`IndexFile::stream`]) read through fixed buffers instead of the map, so that they leave
/// nothing resident: every page touched through a map counts toward the process's memory
/// (RSS) for as long as the map lives, 20 bytes per sequence for a walk of all three arrays.
#[derive(Debug)]
pub struct IndexFile {
    path: PathBuf,
    file: File,
    /// Sequences read by streamed passes over this open file ([`IndexFile::streamed`]).
    streamed: std::sync::atomic::AtomicU64,
    map: Mmap,
    dtype: DType,
    sequences: usize,
    doc_index_len: usize,
    lengths_at: usize,
    pointers_at: usize,
    docs_at: usize,
    has_modes: bool,
}

/// What an `.idx` file's header says, checked against the file's size.
struct Header {
    dtype: DType,
    sequences: usize,
    doc_index_len: usize,
    /// One mode byte per sequence follows the document index (multimodal).
    has_modes: bool,
}

impl Header {
    /// The header of the index bytes `b` (from `path`, for errors).
    fn parse(b: &[u8], path: &Path) -> Result<Header> {
        if b.len() < HEADER_LEN {
            return Err(DataError::format(
                path,
                format!(
                    "truncated index: {} bytes, shorter than the {HEADER_LEN}-byte header",
                    b.len()
                ),
            ));
        }
        if &b[..9] != INDEX_MAGIC {
            return Err(DataError::format(
                path,
                "not a Megatron indexed dataset: bad magic (expected MMIDIDX\\0\\0)",
            ));
        }
        let version = le_u64(b, 9);
        if version != 1 {
            return Err(DataError::format(
                path,
                format!("unsupported index version {version} (only 1 exists)"),
            ));
        }
        let dtype = DType::from_code(b[17])
            .ok_or_else(|| DataError::format(path, format!("unknown dtype code {}", b[17])))?;
        if matches!(dtype, DType::F32 | DType::F64) {
            return Err(DataError::format(
                path,
                format!("dtype {} cannot hold token ids", dtype.name()),
            ));
        }
        let (sequences, doc_index_len) = (le_u64(b, 18), le_u64(b, 26));
        let too_big = || DataError::format(path, "corrupt index: counts larger than the file");
        let seqs = usize::try_from(sequences).map_err(|_| too_big())?;
        let docs = usize::try_from(doc_index_len).map_err(|_| too_big())?;
        let body = seqs
            .checked_mul(12)
            .and_then(|x| x.checked_add(docs.checked_mul(8)?))
            .and_then(|x| x.checked_add(HEADER_LEN))
            .ok_or_else(too_big)?;
        let has_modes = if b.len() == body {
            false
        } else if Some(b.len()) == body.checked_add(seqs) {
            true
        } else {
            return Err(DataError::format(
                path,
                format!(
                    "truncated or corrupt index: {} bytes, but {sequences} sequences and {doc_index_len} document indices need {body}",
                    b.len()
                ),
            ));
        };
        Ok(Header {
            dtype,
            sequences: seqs,
            doc_index_len: docs,
            has_modes,
        })
    }
}

impl IndexFile {
    /// Open and validate the header and the size of an `.idx` file.
    pub fn open(path: &Path) -> Result<IndexFile> {
        let file = kiln_run::files::open_regular(path).map_err(|e| DataError::io(path, e))?;
        // SAFETY: the map is read-only; a file truncated underneath us by another process is
        // the one case memmap cannot protect against, as for every mmap-based reader
        // (Megatron's included). Shards are immutable by convention and pinned by the manifest.
        let map = unsafe { Mmap::map(&file) }.map_err(|e| DataError::io(path, e))?;
        let Header {
            dtype,
            sequences,
            doc_index_len,
            has_modes,
        } = Header::parse(&map, path)?;
        let idx = IndexFile {
            path: path.to_path_buf(),
            file,
            streamed: Default::default(),
            dtype,
            sequences,
            doc_index_len,
            lengths_at: HEADER_LEN,
            pointers_at: HEADER_LEN + 4 * sequences,
            docs_at: HEADER_LEN + 12 * sequences,
            has_modes,
            map,
        };
        if idx.doc_index_len == 0 {
            return Err(DataError::format(
                path,
                "corrupt index: empty document index (it always starts with 0)",
            ));
        }
        let first = idx.document_index(0);
        let last = idx.document_index(idx.doc_index_len - 1);
        if first != 0 || last != sequences as i64 {
            return Err(DataError::format(
                path,
                format!(
                    "corrupt index: document index runs {first}..{last}, expected 0..{sequences}"
                ),
            ));
        }
        Ok(idx)
    }

    /// The file this index was read from.
    pub fn path(&self) -> &Path {
        &self.path
    }
    /// Token dtype.
    pub fn dtype(&self) -> DType {
        self.dtype
    }
    /// Number of sequences (the unit of shuffling and packing).
    pub fn sequences(&self) -> usize {
        self.sequences
    }
    /// Number of documents (the document index holds one more entry).
    pub fn documents(&self) -> usize {
        self.doc_index_len - 1
    }
    /// Whether the index carries multimodal sequence modes (read, then ignored).
    pub fn has_modes(&self) -> bool {
        self.has_modes
    }

    /// Raw length of sequence `i` as stored (may be negative in a corrupt file).
    #[inline]
    pub fn raw_length(&self, i: usize) -> i32 {
        le_i32(&self.map, self.lengths_at + 4 * i)
    }

    /// Length of sequence `i` in tokens; a negative stored length reads as an error.
    #[inline]
    pub fn length(&self, i: usize) -> Result<u32> {
        let l = self.raw_length(i);
        u32::try_from(l).map_err(|_| {
            DataError::format(
                &self.path,
                format!("corrupt index: sequence {i} has length {l}"),
            )
        })
    }

    /// Byte offset of sequence `i` in the `.bin`.
    #[inline]
    pub fn pointer(&self, i: usize) -> i64 {
        le_i64(&self.map, self.pointers_at + 8 * i)
    }

    /// Entry `i` of the document index.
    #[inline]
    pub fn document_index(&self, i: usize) -> i64 {
        le_i64(&self.map, self.docs_at + 8 * i)
    }

    /// Sum of all sequence lengths, checking every length, every pointer and the document
    /// index (O(sequences), streamed in parallel through fixed buffers; see
    /// [`IndexFile::stream`]). With the size check of [`IndexedDataset::open`], a passing
    /// index has every sequence inside the `.bin`. An error names the first bad entry.
    pub fn check_all(&self) -> Result<u64> {
        let parts = rayon::current_num_threads();
        Ok(self.stream(true, parts, || (), |_, _, _| {})?.0)
    }

    /// Sequences that whole-array passes ([`IndexFile::stream`]) have read from this open
    /// file: its sequence count after a pass that built or checked anything, 0 after an
    /// open that found everything in the cache.
    pub fn streamed(&self) -> u64 {
        self.streamed.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Reads lengths `[start, start + out.len())` with `pread` (not through the map).
    pub fn read_lengths(&self, start: usize, out: &mut [i32]) -> Result<()> {
        self.read_at(self.lengths_at + 4 * start, bytemuck::cast_slice_mut(out))?;
        out.iter_mut().for_each(|v| *v = i32::from_le(*v));
        Ok(())
    }

    /// Reads pointers `[start, start + out.len())` with `pread` (not through the map).
    pub fn read_pointers(&self, start: usize, out: &mut [i64]) -> Result<()> {
        self.read_at(self.pointers_at + 8 * start, bytemuck::cast_slice_mut(out))?;
        out.iter_mut().for_each(|v| *v = i64::from_le(*v));
        Ok(())
    }

    /// Reads document-index entries `[start, start + out.len())` with `pread`.
    pub fn read_document_index(&self, start: usize, out: &mut [i64]) -> Result<()> {
        self.read_at(self.docs_at + 8 * start, bytemuck::cast_slice_mut(out))?;
        out.iter_mut().for_each(|v| *v = i64::from_le(*v));
        Ok(())
    }

    fn read_at(&self, at: usize, buf: &mut [u8]) -> Result<()> {
        self.file
            .read_exact_at(buf, at as u64)
            .map_err(|e| DataError::io(&self.path, e))
    }

    /// One pass over the sequence lengths, in `parts` contiguous parts run in parallel, each
    /// read [`RUN`] entries at a time into buffers it reuses (memory: O(parts x RUN), whatever
    /// the index's size, and nothing left mapped). Every length is checked (negative is
    /// damage); with `check`, so is every pointer (sequence `i` must start where `i - 1`
    /// ends, the first at 0) and the document index (never backwards): what
    /// [`IndexFile::check_all`] promises. Each part's state starts as `init()` and `each` folds
    /// every run of checked lengths into it, with the run's first sequence number; runs reach a
    /// part in order. Returns the sum of all lengths and the parts' states, in order.
    ///
    /// Damage is reported as a sequential check would: the lowest-numbered bad sequence (its
    /// pointer is compared with the end of the sequence before it, which is where a sequential
    /// walk expects it once every earlier sequence has passed), else the first bad
    /// document-index entry.
    pub fn stream<S: Send>(
        &self,
        check: bool,
        parts: usize,
        init: impl Fn() -> S + Sync + Send,
        each: impl Fn(&mut S, usize, &[i32]) + Sync + Send,
    ) -> Result<(u64, Vec<S>)> {
        let n = self.sequences;
        let parts = parts.clamp(1, n.div_ceil(RUN).max(1));
        let per = n.div_ceil(parts);
        let found: Vec<std::result::Result<(u64, S), (usize, DataError)>> = (0..parts)
            .into_par_iter()
            .map(|p| {
                let (i0, i1) = ((p * per).min(n), ((p + 1) * per).min(n));
                let mut state = init();
                let sum =
                    self.stream_part(i0, i1, check, |start, lens| each(&mut state, start, lens))?;
                Ok((sum, state))
            })
            .collect();
        let mut first: Option<(usize, DataError)> = None;
        let mut total = 0u64;
        let mut states = Vec::with_capacity(parts);
        for r in found {
            match r {
                Ok((sum, state)) => {
                    total += sum;
                    states.push(state);
                }
                Err((at, e)) => {
                    if first.as_ref().is_none_or(|(f, _)| at < *f) {
                        first = Some((at, e));
                    }
                }
            }
        }
        if let Some((_, e)) = first {
            return Err(e);
        }
        if check {
            self.check_document_index()?;
        }
        Ok((total, states))
    }

    /// Sequences `[i0, i1)` of [`IndexFile::stream`]: their lengths' sum, or the first bad
    /// sequence and its error.
    fn stream_part(
        &self,
        i0: usize,
        i1: usize,
        check: bool,
        mut each: impl FnMut(usize, &[i32]),
    ) -> std::result::Result<u64, (usize, DataError)> {
        let size = self.dtype.size() as i64;
        let cap = RUN.min(i1 - i0);
        let mut lens = vec![0i32; cap];
        let mut ptrs = vec![0i64; if check { cap } else { 0 }];
        // Where sequence i0 must start: 0 for the first; else where sequence i0 - 1 ends (not
        // known when that length is damaged: the part before reports it, at a lower number).
        let mut expected = Some(0i64);
        if check && i0 > 0 {
            let (mut l, mut p) = ([0i32], [0i64]);
            self.read_lengths(i0 - 1, &mut l).map_err(|e| (i0, e))?;
            self.read_pointers(i0 - 1, &mut p).map_err(|e| (i0, e))?;
            expected = (l[0] >= 0).then(|| p[0].saturating_add(l[0] as i64 * size));
        }
        let mut sum = 0u64;
        let mut i = i0;
        while i < i1 {
            let run = (i1 - i).min(RUN);
            let (lens, ptrs) = (&mut lens[..run], &mut ptrs[..if check { run } else { 0 }]);
            self.read_lengths(i, lens).map_err(|e| (i, e))?;
            if check {
                self.read_pointers(i, ptrs).map_err(|e| (i, e))?;
            }
            // A branch-free pass over the run (vectorised); the exact first error only when
            // it finds one.
            let mut bad = false;
            let mut s = 0u64;
            for &l in lens.iter() {
                bad |= l < 0;
                s += l as u32 as u64;
            }
            if check {
                let start = expected.unwrap_or(ptrs[0]);
                bad |= ptrs[0] != start || ptrs[0] < 0;
                for k in 1..run {
                    let end = ptrs[k - 1].wrapping_add(lens[k - 1] as i64 * size);
                    bad |= ptrs[k] != end || ptrs[k] < 0;
                }
            }
            if bad {
                return Err(self.first_damage(i, lens, ptrs, expected, check));
            }
            if check {
                expected = ptrs[run - 1].checked_add(lens[run - 1] as i64 * size);
                if expected.is_none() && i + run < self.sequences {
                    let at = i + run - 1;
                    return Err((
                        at + 1,
                        DataError::format(
                            &self.path,
                            format!(
                                "corrupt index: sequence {at} ends past the largest byte offset"
                            ),
                        ),
                    ));
                }
            }
            sum += s;
            each(i, lens);
            self.streamed
                .fetch_add(run as u64, std::sync::atomic::Ordering::Relaxed);
            i += run;
        }
        Ok(sum)
    }

    /// The first damaged sequence of a run that the branch-free pass flagged, with the error a
    /// sequential walk gives.
    fn first_damage(
        &self,
        i: usize,
        lens: &[i32],
        ptrs: &[i64],
        mut expected: Option<i64>,
        check: bool,
    ) -> (usize, DataError) {
        let size = self.dtype.size() as i64;
        for (k, &l) in lens.iter().enumerate() {
            let at = i + k;
            if l < 0 {
                let reason = format!("corrupt index: sequence {at} has length {l}");
                return (at, DataError::format(&self.path, reason));
            }
            if check {
                let ptr = ptrs[k];
                if let Some(e) = expected
                    && ptr != e
                {
                    let reason =
                        format!("corrupt index: sequence {at} points at byte {ptr}, expected {e}");
                    return (at, DataError::format(&self.path, reason));
                }
                if ptr < 0 {
                    let reason = format!("corrupt index: sequence {at} points at byte {ptr}");
                    return (at, DataError::format(&self.path, reason));
                }
                expected = ptr.checked_add(l as i64 * size);
                if expected.is_none() {
                    let reason =
                        format!("corrupt index: sequence {at} ends past the largest byte offset");
                    return (at, DataError::format(&self.path, reason));
                }
            }
        }
        let reason = "corrupt index: a run of sequences failed its check but no entry did";
        (i, DataError::format(&self.path, reason))
    }

    /// The document index never goes backwards (streamed in parallel, like
    /// [`IndexFile::stream`]); an error names the first entry that does.
    fn check_document_index(&self) -> Result<()> {
        let n = self.doc_index_len;
        let found: Vec<Option<(usize, i64, i64)>> = (0..n.div_ceil(RUN))
            .into_par_iter()
            .map_init(
                || vec![0i64; RUN + 1],
                |buf, c| -> Result<Option<(usize, i64, i64)>> {
                    // Entry c * RUN - 1 too, the one the run's first entry follows.
                    let (j0, j1) = ((c * RUN).saturating_sub(1), ((c + 1) * RUN).min(n));
                    let buf = &mut buf[..j1 - j0];
                    self.read_document_index(j0, buf)?;
                    let mut prev = if c == 0 { 0 } else { buf[0] };
                    let skip = usize::from(c > 0);
                    for (k, &d) in buf.iter().enumerate().skip(skip) {
                        if d < prev {
                            return Ok(Some((j0 + k, d, prev)));
                        }
                        prev = d;
                    }
                    Ok(None)
                },
            )
            .collect::<Result<_>>()?;
        match found.into_iter().flatten().next() {
            Some((i, d, prev)) => Err(DataError::format(
                &self.path,
                format!("corrupt index: document index {i} ({d}) goes backwards from {prev}"),
            )),
            None => Ok(()),
        }
    }

    /// Bytes the `.bin` must have: one past the last sequence's end.
    pub fn expected_bin_len(&self) -> Result<u64> {
        if self.sequences == 0 {
            return Ok(0);
        }
        let last = self.sequences - 1;
        let end = self
            .pointer(last)
            .checked_add(self.length(last)? as i64 * self.dtype.size() as i64);
        match end {
            Some(e) if e >= 0 => Ok(e as u64),
            _ => Err(DataError::format(
                &self.path,
                "corrupt index: last sequence pointer out of range",
            )),
        }
    }
}

/// An indexed dataset: the `.idx` plus the memory-mapped `.bin`.
#[derive(Debug)]
pub struct IndexedDataset {
    prefix: PathBuf,
    index: IndexFile,
    bin_path: PathBuf,
    bin: Option<Mmap>,
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

    /// Open only the `.idx` (enough to build sample indices); token reads will fail.
    pub fn open_index_only(prefix: &Path) -> Result<IndexedDataset> {
        Ok(IndexedDataset {
            prefix: prefix.to_path_buf(),
            index: IndexFile::open(&idx_path(prefix))?,
            bin_path: bin_path(prefix),
            bin: None,
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
fn decode(dtype: DType, bytes: &[u8], out: &mut Vec<u32>) -> std::result::Result<(), (usize, i64)> {
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

/// Writes a Megatron indexed dataset. Files are written under temporary names and renamed on
/// [`IndexedDatasetBuilder::finish`], so a crash never leaves a half-written shard under the
/// real name.
pub struct IndexedDatasetBuilder {
    prefix: PathBuf,
    dtype: DType,
    bin_tmp: PathBuf,
    bin: BufWriter<File>,
    lengths: Vec<i32>,
    doc_index: Vec<i64>,
    bytes: u64,
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

fn to_le_i32(v: &[i32]) -> Vec<i32> {
    v.iter().map(|x| x.to_le()).collect()
}

/// A temporary sibling name unique to this process and call, so that concurrent writers never
/// share a temporary file.
pub(crate) fn tmp_name(path: &Path) -> PathBuf {
    use std::sync::atomic::{AtomicU64, Ordering};
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let n = COUNTER.fetch_add(1, Ordering::Relaxed);
    let mut s = path.as_os_str().to_owned();
    s.push(format!(".tmp.{}.{n}", std::process::id()));
    PathBuf::from(s)
}

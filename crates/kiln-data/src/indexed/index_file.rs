//! The `.idx` file: its header, validated, and its arrays read in bounded runs.

use super::format::*;
use crate::error::{DataError, Result};
use memmap2::Mmap;
use rayon::prelude::*;
use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

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
    pub(super) path: PathBuf,
    pub(super) file: File,
    /// Sequences read by streamed passes over this open file ([`IndexFile::streamed`]).
    pub(super) streamed: std::sync::atomic::AtomicU64,
    pub(super) map: Mmap,
    pub(super) dtype: DType,
    pub(super) sequences: usize,
    pub(super) doc_index_len: usize,
    pub(super) lengths_at: usize,
    pub(super) pointers_at: usize,
    pub(super) docs_at: usize,
    pub(super) has_modes: bool,
}

/// What an `.idx` file's header says, checked against the file's size.
pub(super) struct Header {
    dtype: DType,
    sequences: usize,
    doc_index_len: usize,
    /// One mode byte per sequence follows the document index (multimodal).
    has_modes: bool,
}

impl Header {
    /// The header of the index bytes `b` (from `path`, for errors).
    pub(super) fn parse(b: &[u8], path: &Path) -> Result<Header> {
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

    pub(super) fn read_at(&self, at: usize, buf: &mut [u8]) -> Result<()> {
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
    pub(super) fn stream_part(
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
    pub(super) fn first_damage(
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
    pub(super) fn check_document_index(&self) -> Result<()> {
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

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

mod builder;
mod dataset;
mod format;
mod index_file;

pub use builder::{IndexedDatasetBuilder, write_index};
pub use dataset::IndexedDataset;
pub(crate) use format::tmp_name;
pub use format::{DType, INDEX_MAGIC, bin_path, idx_path};
pub use index_file::{IndexFile, RUN};

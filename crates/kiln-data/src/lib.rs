//! kiln's data layer: Megatron-compatible indexed datasets, tokenization, deterministic
//! weighted blending and the resumable loader.
//!
//! | module | what |
//! | --- | --- |
//! | [`indexed`] | `.bin`/`.idx` reader (mmap) and writer, byte-compatible with Megatron |
//! | [`tokenize`] | BPE training and parallel tokenization with HF `tokenizers` |
//! | [`parquet`] | the text column of `.parquet` inputs, streamed a batch of rows at a time |
//! | [`corpus`] | corpus lists: `weight prefix [corpus]` lines |
//! | [`blend`] | megatron-core's greedy blend, with weight-stable schedule changes |
//! | [`index`] | per-dataset shuffled, packed sample index (O(1) access, tiny cache) |
//! | [`loader`] | [`BlendedLoader`]: `(step, dp_rank, dp_size, batch)` to token rows |
//! | [`manifest`] | shard pins (size + SHA-256) and their verification |
//! | [`yeet`] | `kiln yeet`: a file, directory or tarball on every node's local disk, read once |
//!
//! The trainer's seam:
//!
//! ```no_run
//! # use kiln_data::{BlendedLoader, LoaderConfig};
//! # fn main() -> Result<(), kiln_data::DataError> {
//! let cfg = LoaderConfig::new(2048, 1234, 1000 * 256, "cache".into());
//! let loader = BlendedLoader::open("corpus.txt".as_ref(), &cfg)?;
//! let rows: Vec<Vec<u32>> = loader.batch(17, 0, 8, 32)?; // step 17, rank 0 of 8, 32 rows
//! # Ok(()) }
//! ```

pub mod blend;
pub mod cache;
pub mod corpus;
pub mod documents;
pub mod error;
pub mod fingerprint;
pub mod index;
pub mod indexed;
pub mod loader;
pub mod manifest;
pub mod parquet;
pub mod perm;
pub mod progress;
pub mod summary;
pub mod tokenize;
pub mod yeet;

pub use blend::{BlendSchedule, BlendSegment};
pub use corpus::{CorpusEntry, CorpusList};
pub use error::DataError;
pub use indexed::{DType, IndexedDataset, IndexedDatasetBuilder};
pub use loader::{BlendedLoader, LoaderConfig, Resume};
pub use manifest::{Manifest, Verify};

/// Run `f` on a pool of `threads` workers (all cores when `None`). Every result of this crate
/// is the same whatever the thread count; this only changes speed.
pub fn with_threads<R: Send>(
    threads: Option<usize>,
    f: impl FnOnce() -> R + Send,
) -> Result<R, DataError> {
    match threads {
        None => Ok(f()),
        Some(n) => rayon::ThreadPoolBuilder::new()
            .num_threads(n.max(1))
            .build()
            .map(|pool| pool.install(f))
            .map_err(|e| DataError::Invalid(format!("cannot start {n} worker threads: {e}"))),
    }
}

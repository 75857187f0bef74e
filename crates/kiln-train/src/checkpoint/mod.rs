//! Checkpoints: `RUN_DIR/checkpoints/step-<N>/` holds `model.safetensors`,
//! `optimizer.safetensors`, `state.json` and `manifest.json` (checksum and size of each file:
//! SHA-256 here, XXH3-128 in the memory tier's snapshots; see `checksum.rs`).
//! A sharded run (`parallelism.shard`) has no `optimizer.safetensors`: each rank writes its
//! own shard, `optimizer-<r>-of-<n>.safetensors`, in parallel (tensors named
//! `<param>.<slot>@<first element>`, a contiguous piece of the flattened state), and rank 0
//! moves them into the checkpoint it publishes, under one manifest. [`load`] assembles the
//! whole state from the shards (export, eval), so any rank count and any mode resumes it; a
//! missing shard, or pieces that leave a gap, reject the checkpoint like a corrupt file. A
//! sharded run never holds the whole state: rank 0 verifies every file in bounded chunks
//! ([`verify`]) and each rank reads only its own elements of each tensor, whatever rank
//! count or mode wrote it ([`load_kept`], in `partial.rs`). With parameters
//! sharded (`parallelism.shard = "parameters"`) the weights are shards too: no
//! `model.safetensors`, but `model-<r>-of-<n>.safetensors` per rank (`<param>@<first
//! element>`), assembled the same way, so eval and export read the checkpoint directly.
//!
//! Publishing is crash-safe: everything is written into a temporary directory, each file and
//! the directory are fsynced, and only then is it renamed to `step-<N>` (rename is atomic).
//! Loading verifies the manifest; a torn or corrupt checkpoint is rejected and the one before
//! it is used.
//!
//! A checkpoint directory may come from elsewhere (copied from another machine, or planted),
//! so loading trusts nothing in it: the manifest may name only the fixed files of the format
//! ([`FILES`]), every file must be a regular file (not a link, FIFO or device), and no read
//! goes beyond the size the manifest declares.
//!
//! [`CheckpointStore`] owns a run's checkpoint directory: which checkpoint to resume from,
//! moving rejected and foreign checkpoints aside (`checkpoints/rejected/`, never deleted), and
//! retention that only ever deletes older checkpoints of this run's own lineage.

//!
//! One file a concern: [`format`] the tensor files (safetensors), [`manifest`] one checkpoint
//! directory (its manifest and shard set, written and read back verified), [`store`] a run's
//! folder of them (publish, resume, rejection, retention); [`partial`], [`region`] and
//! [`stream`] read and write pieces of tensors, [`checksum`] the hashes, [`files`] the
//! filesystem calls they share.

mod checksum;
mod error;
mod files;
mod format;
mod manifest;
mod partial;
pub mod region;
mod store;
mod stream;

pub use checksum::{Checksum, ChecksumKind, ManifestEntry};
pub use error::CheckpointError;
pub(crate) use files::{create_shared_dir_all, io_err, remove_tree};
pub use format::{HostTensor, StoredDtype, from_safetensors};
pub(crate) use manifest::lineage_of;
pub use manifest::{
    Checkpoint, Contents, FILES, MANIFEST_FILE, MODEL_FILE, Manifest, OPTIMIZER_FILE, STATE_FILE,
    ShardFile, load, load_state, write_shard,
};
pub use partial::{Keep, Part, Want, load_kept, verify};
pub use store::{
    CheckpointStore, Opened, Rejection, SaveReport, dir_name, list_steps, load_latest_valid, save,
    save_with,
};
pub use stream::{Hashing, Source, StreamError, to_safetensors};

#[cfg(test)]
pub(crate) mod tests;

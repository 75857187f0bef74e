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
//! [`CheckpointManager`] owns a run's checkpoint directory: which checkpoint to resume from,
//! moving rejected and foreign checkpoints aside (`checkpoints/rejected/`, never deleted), and
//! retention that only ever deletes older checkpoints of this run's own lineage.

mod checksum;
mod partial;
pub mod region;
mod stream;
pub use checksum::{Checksum, ChecksumKind};
pub use partial::{Keep, Part, Want, load_kept, verify};
pub use stream::{Hashing, Source, StreamError};

use kiln_run::layout;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::fs::File;
use std::io::{Read, Write};
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};

/// A checkpoint's files, named in [`kiln_run::layout`] (the one place run-directory names
/// are spelled).
pub use kiln_run::layout::{
    CHECKPOINT_MANIFEST as MANIFEST_FILE, CHECKPOINT_MODEL as MODEL_FILE,
    CHECKPOINT_OPTIMIZER as OPTIMIZER_FILE, CHECKPOINT_STATE as STATE_FILE,
};
/// The files a manifest lists: exactly these, nothing else.
pub const FILES: [&str; 3] = [MODEL_FILE, OPTIMIZER_FILE, STATE_FILE];
/// Largest manifest or state file accepted (they are a few hundred bytes to a few KB).
const MAX_SMALL_FILE: u64 = 16 << 20;
/// Note left inside a directory moved to `checkpoints/rejected/`.
const REJECTED_NOTE: &str = "REJECTED.txt";

/// Errors saving or loading checkpoints.
#[derive(Debug, thiserror::Error)]
pub enum CheckpointError {
    /// Filesystem error.
    #[error("checkpoint {path}: {source}")]
    Io {
        /// The file or directory.
        path: PathBuf,
        /// The cause.
        source: std::io::Error,
    },
    /// The checkpoint is incomplete or does not match its manifest.
    #[error("checkpoint {path}: {reason}")]
    Invalid {
        /// The checkpoint directory or file.
        path: PathBuf,
        /// What is wrong.
        reason: String,
    },
}

pub(crate) fn io_err(path: &Path) -> impl FnOnce(std::io::Error) -> CheckpointError + '_ {
    move |source| CheckpointError::Io {
        path: path.to_path_buf(),
        source,
    }
}

/// `std::fs::create_dir_all` for a folder that other processes share and remove when it is
/// empty: the ranks of one node keep their memory snapshots under one run folder, which a
/// rank that ends (or that only checked it could write there) removes when it holds nothing.
/// Between `create_dir_all`'s making of that folder and of the rank's own inside it, another
/// rank can remove it, and the second `mkdir` then fails with `NotFound`; or another rank
/// made it first and a third removed it before `create_dir_all` saw it there, which fails with
/// `AlreadyExists`. Made again, a few times, neither is an error (it would refuse the
/// rank's start with exit 78, or skip a snapshot).
pub(crate) fn create_shared_dir_all(path: &Path) -> std::io::Result<()> {
    use std::io::ErrorKind::{AlreadyExists, NotFound};
    let mut tries = 0;
    loop {
        match std::fs::create_dir_all(path) {
            Err(e) if matches!(e.kind(), NotFound | AlreadyExists) && tries < 16 => tries += 1,
            done => return done,
        }
    }
}

fn invalid(path: &Path, reason: impl Into<String>) -> CheckpointError {
    CheckpointError::Invalid {
        path: path.to_path_buf(),
        reason: reason.into(),
    }
}

/// The element type a tensor is stored with (`training.master_dtype` for weights; optimizer
/// state is always f32).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum StoredDtype {
    /// 32-bit float.
    #[default]
    F32,
    /// bfloat16.
    Bf16,
}

impl StoredDtype {
    /// Bytes per element.
    pub fn width(self) -> usize {
        match self {
            Self::F32 => 4,
            Self::Bf16 => 2,
        }
    }
}

/// A named tensor on the host. Values are held as f32 whatever the stored dtype (every bf16
/// value is exactly an f32), so the rest of kiln handles one element type; the dtype says
/// how the tensor is written and was read.
#[derive(Debug, Clone, PartialEq)]
pub struct HostTensor {
    /// Parameter (or state) name.
    pub name: String,
    /// Shape.
    pub shape: Vec<usize>,
    /// How it is stored in safetensors.
    pub dtype: StoredDtype,
    /// Values, row-major.
    pub values: Vec<f32>,
}

impl HostTensor {
    /// An f32 tensor.
    pub fn f32(name: String, shape: Vec<usize>, values: Vec<f32>) -> Self {
        Self {
            name,
            shape,
            dtype: StoredDtype::F32,
            values,
        }
    }

    /// Elements `range` of this tensor, read as a tensor of shape `shape`: from the whole
    /// tensor (that shape, or flat: the weights assembled from shards have no other), or,
    /// where `pieces` allows it, from a piece of exactly `range.len()` elements (what
    /// [`load_kept`] reads); `None` when it is neither.
    pub fn elements(
        &self,
        shape: &[usize],
        range: std::ops::Range<usize>,
        pieces: bool,
    ) -> Option<Vec<f32>> {
        let numel: usize = shape.iter().product();
        let whole = (self.shape == shape || self.shape == [numel]) && self.values.len() == numel;
        match (whole, pieces && self.shape == [range.len()]) {
            (true, _) => self.values.get(range).map(<[f32]>::to_vec),
            (false, true) => Some(self.values.clone()),
            (false, false) => None,
        }
    }
}

/// bf16 bits of `v`, rounded to nearest even (exact for values that are bf16 already).
fn bf16_bits(v: f32) -> u16 {
    burn::tensor::bf16::from_f32(v).to_bits()
}

/// Serialises tensors to safetensors bytes. Deterministic: same tensors, same bytes (the
/// metadata map has a single fixed key, tensors are ordered by the format's rules).
pub fn to_safetensors(tensors: &[HostTensor]) -> Result<Vec<u8>, StreamError> {
    let sources: Vec<&dyn Source> = tensors.iter().map(|t| t as &dyn Source).collect();
    let mut out = Vec::new();
    stream::write(&mut out, &sources)?;
    Ok(out)
}

/// Parses safetensors bytes into host tensors: F32 and BF16 are read (BF16 widened to f32
/// exactly, the dtype kept); any other dtype is an error naming the tensor.
pub fn from_safetensors(bytes: &[u8], path: &Path) -> Result<Vec<HostTensor>, CheckpointError> {
    let st =
        safetensors::SafeTensors::deserialize(bytes).map_err(|e| invalid(path, e.to_string()))?;
    let mut out = Vec::new();
    for (name, view) in st.tensors() {
        let dtype = stored_dtype(view.dtype(), &name, path)?;
        let values = decode(view.data(), dtype);
        out.push(HostTensor {
            name,
            shape: view.shape().to_vec(),
            dtype,
            values,
        });
    }
    out.sort_by(|a, b| a.name.cmp(&b.name));
    Ok(out)
}

/// The [`StoredDtype`] of a safetensors dtype kiln reads (F32, BF16); any other is an error
/// naming the tensor `name` of `path`.
fn stored_dtype(
    dtype: safetensors::Dtype,
    name: &str,
    path: &Path,
) -> Result<StoredDtype, CheckpointError> {
    match dtype {
        safetensors::Dtype::F32 => Ok(StoredDtype::F32),
        safetensors::Dtype::BF16 => Ok(StoredDtype::Bf16),
        other => Err(invalid(
            path,
            format!("tensor {name} has dtype {other:?}; kiln reads F32 and BF16"),
        )),
    }
}

/// Little-endian values of `dtype` as f32 (bf16 widened exactly).
fn decode(bytes: &[u8], dtype: StoredDtype) -> Vec<f32> {
    match dtype {
        StoredDtype::F32 => bytes
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect(),
        StoredDtype::Bf16 => bytes
            .chunks_exact(2)
            .map(|c| burn::tensor::bf16::from_bits(u16::from_le_bytes([c[0], c[1]])).to_f32())
            .collect(),
    }
}

/// One file's entry in `manifest.json`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ManifestEntry {
    /// The file's checksum (SHA-256, or XXH3-128 in a memory-tier snapshot).
    #[serde(flatten)]
    pub sum: Checksum,
    /// Size in bytes.
    pub bytes: u64,
}

/// `manifest.json`: file name -> checksum.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Manifest {
    /// Format version.
    pub version: u32,
    /// The files of the checkpoint (every file but the manifest).
    pub files: BTreeMap<String, ManifestEntry>,
}

/// What a checkpoint holds, in memory.
#[derive(Debug, Clone)]
pub struct Checkpoint {
    /// Optimizer step the checkpoint was taken after.
    pub step: u64,
    /// Model weights.
    pub model: Vec<HostTensor>,
    /// Optimizer state (names `<param>.exp_avg` / `<param>.exp_avg_sq`).
    pub optimizer: Vec<HostTensor>,
    /// `state.json`, kept as JSON so this module does not depend on the trainer's types.
    pub state: serde_json::Value,
    /// A sharded run's optimizer shards, already written by their ranks ([`write_shard`]):
    /// moved into the checkpoint in place of `optimizer` (empty otherwise).
    pub shards: Vec<ShardFile>,
}

impl Checkpoint {
    /// What [`save`] writes of it.
    pub fn contents(&self) -> Contents<'_> {
        Contents {
            step: self.step,
            model: self.model.iter().map(|t| t as &dyn Source).collect(),
            optimizer: self.optimizer.iter().map(|t| t as &dyn Source).collect(),
            state: &self.state,
            shards: &self.shards,
        }
    }
}

/// What a checkpoint is written from: a [`Checkpoint`] in host memory, or the step's own
/// tensors, each read only as its bytes are written ([`Source`]).
pub struct Contents<'a> {
    /// Optimizer step the checkpoint is taken after.
    pub step: u64,
    /// Model weights.
    pub model: Vec<&'a dyn Source>,
    /// Optimizer state.
    pub optimizer: Vec<&'a dyn Source>,
    /// `state.json`.
    pub state: &'a serde_json::Value,
    /// A sharded run's shard files, already written (see [`Checkpoint::shards`]).
    pub shards: &'a [ShardFile],
}

/// One rank's optimizer shard, written and fsynced in the step's staging directory, to be
/// moved into the checkpoint rank 0 publishes.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ShardFile {
    /// Its file name in the checkpoint.
    pub name: String,
    /// Where it is now.
    pub path: PathBuf,
    /// Its checksum and size.
    pub entry: ManifestEntry,
}

/// Writes one rank's shard file `name` (its optimizer state pieces `<param>.<slot>@<start>`,
/// or its weight pieces `<param>@<start>`) for step `step` into the staging directory under
/// `root`, fsynced.
pub fn write_shard(
    root: &Path,
    step: u64,
    name: String,
    tensors: &[HostTensor],
) -> Result<ShardFile, CheckpointError> {
    let dir = root.join(layout::checkpoint_shard_staging(step));
    std::fs::create_dir_all(&dir).map_err(io_err(&dir))?;
    let path = dir.join(&name);
    remove_tree(&path)?;
    let sources: Vec<&dyn Source> = tensors.iter().map(|t| t as &dyn Source).collect();
    let entry = write_tensors_synced(&path, ChecksumKind::Sha256, &sources)?;
    fsync_dir(&dir)?;
    Ok(ShardFile { name, path, entry })
}

/// Name of a checkpoint directory.
pub fn dir_name(step: u64) -> String {
    layout::checkpoint_dir(step)
}

pub(crate) fn fsync_dir(dir: &Path) -> Result<(), CheckpointError> {
    File::open(dir)
        .and_then(|f| f.sync_all())
        .map_err(io_err(dir))
}

/// Creates `path` (it must not exist) and writes it through a hashing, buffered writer with
/// `fill`; synced. Returns its manifest entry. A failed write leaves what it wrote for the
/// caller's temporary directory to remove.
fn write_file_synced(
    path: &Path,
    kind: ChecksumKind,
    fill: impl FnOnce(&mut dyn Write) -> Result<(), StreamError>,
) -> Result<ManifestEntry, CheckpointError> {
    let f = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .open(path)
        .map_err(io_err(path))?;
    let mut out = Hashing::new(std::io::BufWriter::with_capacity(1 << 20, f), kind);
    fill(&mut out).map_err(|e| match e {
        StreamError::Io(source) => CheckpointError::Io {
            path: path.to_path_buf(),
            source,
        },
        other => invalid(path, other.to_string()),
    })?;
    let (entry, buffered) = out.finish();
    buffered
        .into_inner()
        .map_err(|e| e.into_error())
        .and_then(|f| f.sync_all())
        .map_err(io_err(path))?;
    Ok(entry)
}

fn write_synced(
    path: &Path,
    kind: ChecksumKind,
    bytes: &[u8],
) -> Result<ManifestEntry, CheckpointError> {
    write_file_synced(path, kind, |out| Ok(out.write_all(bytes)?))
}

/// Writes `tensors` as the safetensors file `path`, each tensor read as it is written.
fn write_tensors_synced(
    path: &Path,
    kind: ChecksumKind,
    tensors: &[&dyn Source],
) -> Result<ManifestEntry, CheckpointError> {
    write_file_synced(path, kind, |out| stream::write(out, tensors))
}

/// Writes `ckpt`'s files into the directory `tmp`, each synced, then the manifest that lists
/// them: the model and optimizer state (unless the ranks staged them as shard files, which are
/// moved in), the training state.
fn write_contents(tmp: &Path, ckpt: &Contents, kind: ChecksumKind) -> Result<(), CheckpointError> {
    let mut files = BTreeMap::new();
    let sharded = |parse: fn(&str) -> Option<(usize, usize)>| {
        ckpt.shards.iter().any(|f| parse(&f.name).is_some())
    };
    if !sharded(layout::parse_model_shard) {
        let entry = write_tensors_synced(&tmp.join(MODEL_FILE), kind, &ckpt.model)?;
        files.insert(MODEL_FILE.to_string(), entry);
    }
    if !sharded(layout::parse_optimizer_shard) {
        let entry = write_tensors_synced(&tmp.join(OPTIMIZER_FILE), kind, &ckpt.optimizer)?;
        files.insert(OPTIMIZER_FILE.to_string(), entry);
    }
    for f in ckpt.shards {
        let to = tmp.join(&f.name);
        std::fs::rename(&f.path, &to).map_err(io_err(&f.path))?;
        files.insert(f.name.clone(), f.entry.clone());
    }
    let state = serde_json::to_vec_pretty(ckpt.state).map_err(|e| invalid(tmp, e.to_string()))?;
    files.insert(
        STATE_FILE.to_string(),
        write_synced(&tmp.join(STATE_FILE), kind, &state)?,
    );
    let manifest = serde_json::to_vec_pretty(&Manifest { version: 1, files })
        .map_err(|e| invalid(tmp, e.to_string()))?;
    write_synced(&tmp.join(MANIFEST_FILE), kind, &manifest)?;
    Ok(())
}

/// Renames the written directory `tmp` to `step`'s checkpoint directory under `root`.
fn publish(root: &Path, tmp: &Path, step: u64) -> Result<(), CheckpointError> {
    let final_dir = root.join(dir_name(step));
    if std::fs::symlink_metadata(&final_dir).is_ok() {
        // Re-saving a step that exists (a resumed run that stops at the same step): move the
        // old one aside first, so there is never a moment without a valid step-<N>.
        let old = root.join(format!(".old-{}-{}", dir_name(step), std::process::id()));
        std::fs::rename(&final_dir, &old).map_err(io_err(&final_dir))?;
        std::fs::rename(tmp, &final_dir).map_err(io_err(&final_dir))?;
        remove_tree(&old)?;
    } else {
        std::fs::rename(tmp, &final_dir).map_err(io_err(&final_dir))?;
    }
    Ok(())
}

/// Writes `ckpt` as `root/step-<N>` atomically with SHA-256 checksums and returns its path.
pub fn save(root: &Path, ckpt: &Contents) -> Result<PathBuf, CheckpointError> {
    save_with(root, ckpt, ChecksumKind::Sha256)
}

/// [`save`] with the files' checksums of `kind`.
pub fn save_with(
    root: &Path,
    ckpt: &Contents,
    kind: ChecksumKind,
) -> Result<PathBuf, CheckpointError> {
    create_shared_dir_all(root).map_err(io_err(root))?;
    let final_dir = root.join(dir_name(ckpt.step));
    let tmp = root.join(format!(
        ".tmp-{}-{}",
        dir_name(ckpt.step),
        std::process::id()
    ));
    if std::fs::symlink_metadata(&tmp).is_ok() {
        std::fs::remove_dir_all(&tmp).map_err(io_err(&tmp))?;
    }
    std::fs::create_dir(&tmp).map_err(io_err(&tmp))?;
    let written = write_contents(&tmp, ckpt, kind)
        .and_then(|()| fsync_dir(&tmp))
        .and_then(|()| publish(root, &tmp, ckpt.step));
    if written.is_err() {
        // A failed write (a full disk, most often) must not keep what it wrote: the space
        // would be missing for the retry, which then fails at once.
        let _ = remove_tree(&tmp);
    }
    written?;
    fsync_dir(root)?;
    if !ckpt.shards.is_empty() {
        remove_tree(&root.join(layout::checkpoint_shard_staging(ckpt.step)))?;
    }
    Ok(final_dir)
}

/// Removes a directory kiln wrote; a symlink is removed itself, never followed.
pub(crate) fn remove_tree(path: &Path) -> Result<(), CheckpointError> {
    match std::fs::symlink_metadata(path) {
        Ok(m) if m.is_dir() => std::fs::remove_dir_all(path).map_err(io_err(path)),
        Ok(_) => std::fs::remove_file(path).map_err(io_err(path)),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(io_err(path)(e)),
    }
}

/// Steps of the `step-<N>` directories under `root`, newest first.
pub fn list_steps(root: &Path) -> Vec<u64> {
    let Ok(entries) = std::fs::read_dir(root) else {
        return Vec::new();
    };
    let mut steps: Vec<u64> = entries
        .filter_map(Result::ok)
        .filter_map(|e| layout::parse_checkpoint_dir(e.file_name().to_str()?))
        .collect();
    steps.sort_unstable_by(|a, b| b.cmp(a));
    steps
}

/// Opens a file of a checkpoint for reading, and its size: refuses links and anything but a
/// regular file.
fn open_regular(path: &Path) -> Result<(File, u64), CheckpointError> {
    let file = std::fs::OpenOptions::new()
        .read(true)
        // O_NONBLOCK: opening a FIFO must not wait for a writer; O_NOFOLLOW: no links.
        .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK | libc::O_CLOEXEC)
        .open(path)
        .map_err(|e| {
            if e.raw_os_error() == Some(libc::ELOOP) {
                invalid(
                    path,
                    "is a symbolic link; checkpoint files must be regular files",
                )
            } else {
                invalid(path, format!("unreadable: {e}"))
            }
        })?;
    let meta = file
        .metadata()
        .map_err(|e| invalid(path, format!("unreadable: {e}")))?;
    if !meta.is_file() {
        return Err(invalid(
            path,
            "is not a regular file (a device, FIFO or directory); refused",
        ));
    }
    Ok((file, meta.len()))
}

/// Reads a file of a checkpoint: refuses links and anything but a regular file, and never
/// reads more than `expect` bytes (the size the manifest declares, or a cap).
fn read_bounded(path: &Path, expect: Option<u64>, cap: u64) -> Result<Vec<u8>, CheckpointError> {
    let (file, size) = open_regular(path)?;
    let limit = expect.unwrap_or(cap);
    if size > limit {
        return Err(invalid(
            path,
            match expect {
                Some(e) => format!("size {size} != {e} in manifest (torn write or corrupt)"),
                None => format!("{size} bytes; at most {cap} expected"),
            },
        ));
    }
    let mut bytes = Vec::with_capacity(size as usize);
    file.take(limit + 1)
        .read_to_end(&mut bytes)
        .map_err(|e| invalid(path, format!("unreadable: {e}")))?;
    if let Some(e) = expect
        && bytes.len() as u64 != e
    {
        return Err(invalid(
            path,
            format!("size {} != {e} in manifest (torn write?)", bytes.len()),
        ));
    }
    Ok(bytes)
}

/// Reads and checks `dir/manifest.json`: it must list exactly [`FILES`].
fn read_manifest(dir: &Path) -> Result<Manifest, CheckpointError> {
    let path = dir.join(MANIFEST_FILE);
    let bytes = read_bounded(&path, None, MAX_SMALL_FILE).map_err(|e| match e {
        CheckpointError::Invalid { reason, .. } => {
            invalid(dir, format!("no usable {MANIFEST_FILE} ({reason})"))
        }
        other => other,
    })?;
    let manifest: Manifest = serde_json::from_slice(&bytes)
        .map_err(|e| invalid(&path, format!("malformed manifest: {e}")))?;
    for name in manifest.files.keys() {
        let shard = layout::parse_optimizer_shard(name).or(layout::parse_model_shard(name));
        if !FILES.contains(&name.as_str()) && shard.is_none() {
            return Err(invalid(
                &path,
                format!(
                    "manifest names {name:?}, which is not a file of a kiln checkpoint (only {}, optimizer-<r>-of-<n>.safetensors or model-<r>-of-<n>.safetensors); refused",
                    FILES.join(", ")
                ),
            ));
        }
    }
    if !manifest.files.contains_key(STATE_FILE) {
        return Err(invalid(
            &path,
            format!("manifest does not list {STATE_FILE}"),
        ));
    }
    check_shard_set(&manifest, &path, MODEL_FILE, layout::parse_model_shard)?;
    check_shard_set(
        &manifest,
        &path,
        OPTIMIZER_FILE,
        layout::parse_optimizer_shard,
    )?;
    Ok(manifest)
}

/// The manifest lists the weights, and the optimizer state, once each: the whole file
/// (`whole`), or every shard (names `parse` reads) of one rank count.
fn check_shard_set(
    manifest: &Manifest,
    path: &Path,
    whole: &str,
    parse: fn(&str) -> Option<(usize, usize)>,
) -> Result<(), CheckpointError> {
    let shards: Vec<(usize, usize)> = manifest.files.keys().filter_map(|n| parse(n)).collect();
    let has_whole = manifest.files.contains_key(whole);
    let Some(&(_, n)) = shards.first() else {
        return match has_whole {
            true => Ok(()),
            false => Err(invalid(path, format!("manifest does not list {whole}"))),
        };
    };
    if has_whole {
        return Err(invalid(
            path,
            format!("manifest lists both {whole} and shards of it"),
        ));
    }
    let missing: Vec<usize> = (0..n).filter(|&r| !shards.contains(&(r, n))).collect();
    if !missing.is_empty() || shards.len() != n {
        return Err(invalid(
            path,
            format!(
                "manifest lists {} of the {n} shards of {whole} (missing ranks {missing:?}, or shards of another rank count)",
                shards.len()
            ),
        ));
    }
    Ok(())
}

/// The tensors of a sharded checkpoint's shards (names `parse` reads): every shard read and
/// verified, and each tensor assembled from its pieces (`<name>@<where>`, see
/// [`region`]), which must tile it without a gap or an overlap.
fn load_shards(
    dir: &Path,
    manifest: &Manifest,
    parse: fn(&str) -> Option<(usize, usize)>,
) -> Result<Vec<HostTensor>, CheckpointError> {
    let mut pieces: BTreeMap<String, Vec<(region::Region, Vec<f32>)>> = BTreeMap::new();
    let names = manifest.files.keys().filter(|n| parse(n).is_some());
    for name in names {
        let path = dir.join(name);
        for t in from_safetensors(&read_verified(dir, manifest, name)?, &path)? {
            let Some((base, r)) = region::Region::parse(&t.name, t.values.len()) else {
                return Err(invalid(
                    &path,
                    format!("tensor {} is not a shard piece (<name>@<where>)", t.name),
                ));
            };
            pieces
                .entry(base.to_string())
                .or_default()
                .push((r, t.values));
        }
    }
    let mut out = Vec::with_capacity(pieces.len());
    for (name, parts) in pieces {
        let regions: Vec<&region::Region> = parts.iter().map(|(r, _)| r).collect();
        let shape = region::whole_shape(&regions);
        let n = shape.iter().product();
        let mut a = region::Assembly::new(shape.clone(), region::Region::flat(0..n));
        let fault = |why: String| invalid(dir, format!("tensor {name}: {why}"));
        for (r, values) in &parts {
            if let Some(part) = a.needs(r) {
                a.put(r, part.clone(), &values[part]).map_err(&fault)?;
            }
        }
        let values = a.finish().map_err(fault)?;
        out.push(HostTensor::f32(name, shape, values));
    }
    Ok(out)
}

/// Reads one file of `dir` listed in `manifest` and checks its size and checksum.
fn read_verified(dir: &Path, manifest: &Manifest, name: &str) -> Result<Vec<u8>, CheckpointError> {
    let path = dir.join(name);
    let entry = &manifest.files[name];
    let bytes = read_bounded(&path, Some(entry.bytes), entry.bytes)?;
    if let Some(why) = entry.sum.mismatch(&Checksum::of(entry.sum.kind(), &bytes)) {
        return Err(invalid(&path, why));
    }
    Ok(bytes)
}

/// Loads and verifies only `state.json` of `dir` (cheap: for lineage checks).
pub fn load_state(dir: &Path) -> Result<serde_json::Value, CheckpointError> {
    let manifest = read_manifest(dir)?;
    parse_state(dir, &read_verified(dir, &manifest, STATE_FILE)?).map(|(_, v)| v)
}

fn parse_state(dir: &Path, bytes: &[u8]) -> Result<(u64, serde_json::Value), CheckpointError> {
    let state_path = dir.join(STATE_FILE);
    let state: serde_json::Value = serde_json::from_slice(bytes)
        .map_err(|e| invalid(&state_path, format!("malformed: {e}")))?;
    let step = state
        .get("step")
        .and_then(serde_json::Value::as_u64)
        .ok_or_else(|| invalid(&state_path, "no integer `step`"))?;
    Ok((step, state))
}

/// Loads and verifies `dir` against its manifest.
pub fn load(dir: &Path) -> Result<Checkpoint, CheckpointError> {
    let manifest = read_manifest(dir)?;
    let (step, state) = parse_state(dir, &read_verified(dir, &manifest, STATE_FILE)?)?;
    let whole_or_shards = |whole: &str, parse| match manifest.files.contains_key(whole) {
        true => from_safetensors(&read_verified(dir, &manifest, whole)?, &dir.join(whole)),
        false => load_shards(dir, &manifest, parse),
    };
    let model = whole_or_shards(MODEL_FILE, layout::parse_model_shard)?;
    let optimizer = whole_or_shards(OPTIMIZER_FILE, layout::parse_optimizer_shard)?;
    Ok(Checkpoint {
        step,
        model,
        optimizer,
        state,
        shards: Vec::new(),
    })
}

/// The newest checkpoint under `root` that verifies. Each rejected one is passed to
/// `on_reject` (path and reason) before the next older one is tried. Read-only: for tools
/// that inspect a run (eval, export); a training run uses [`CheckpointManager`].
pub fn load_latest_valid(
    root: &Path,
    mut on_reject: impl FnMut(&Path, &str),
) -> Option<(PathBuf, Checkpoint)> {
    for step in list_steps(root) {
        let dir = root.join(dir_name(step));
        match load(&dir) {
            Ok(c) => return Some((dir, c)),
            Err(e) => on_reject(&dir, &e.to_string()),
        }
    }
    None
}

/// The lineage id recorded in a checkpoint's state (`run_id`); checkpoints written before
/// lineages existed have none.
pub(crate) fn lineage_of(state: &serde_json::Value) -> Option<&str> {
    state.get("run_id").and_then(serde_json::Value::as_str)
}

/// A checkpoint moved to `checkpoints/rejected/`.
#[derive(Debug, Clone, Serialize)]
pub struct Rejection {
    /// Where it was.
    pub path: PathBuf,
    /// Why it was rejected.
    pub reason: String,
    /// Where it is now.
    pub moved_to: PathBuf,
}

/// What a save did.
#[derive(Debug, Clone, Serialize)]
pub struct SaveReport {
    /// The published checkpoint.
    pub path: PathBuf,
    /// Older checkpoints of this lineage deleted by retention.
    pub pruned: Vec<PathBuf>,
    /// Newer checkpoints of this lineage that a rollback made obsolete, moved aside.
    pub superseded: Vec<Rejection>,
}

/// The checkpoints of one training run: resume choice, move-aside of bad or foreign ones,
/// saving and retention.
///
/// Retention rule: after saving step S, only checkpoints of this run's lineage (its
/// `run_id`) older than S are candidates for deletion, and the newest `keep - 1` of them
/// stay. Nothing of another lineage, nothing corrupt and nothing newer than S is ever
/// deleted: those are moved to `checkpoints/rejected/` with a note saying why.
#[derive(Debug)]
pub struct CheckpointManager {
    root: PathBuf,
    keep: usize,
    run_id: String,
    /// Steps known to be this lineage's (found at open or saved since).
    ours: Vec<u64>,
}

/// The result of [`CheckpointManager::open`].
pub struct Opened {
    /// The manager, with the lineage of the resumed checkpoint (or a new one).
    pub manager: CheckpointManager,
    /// The checkpoint to resume from, when resuming and one verified.
    pub resume: Option<(PathBuf, Checkpoint)>,
    /// Checkpoints moved aside (corrupt, torn, foreign).
    pub rejected: Vec<Rejection>,
    /// The temporary directories of earlier writers killed mid-save, deleted, with their
    /// bytes.
    pub reclaimed: Vec<(PathBuf, u64)>,
}

/// The newest checkpoint under `root` (of `steps`, newest first) that `load` accepts; each
/// one refused before it is moved aside into `rejected`.
fn newest_valid(
    root: &Path,
    steps: &[u64],
    load: fn(&Path) -> Result<Checkpoint, CheckpointError>,
    rejected: &mut Vec<Rejection>,
) -> Result<Option<(PathBuf, Checkpoint)>, CheckpointError> {
    for &step in steps {
        let dir = root.join(dir_name(step));
        match load(&dir) {
            Ok(c) => return Ok(Some((dir, c))),
            Err(e) => rejected.push(move_aside(root, &dir, &e.to_string())?),
        }
    }
    Ok(None)
}

/// Whether the checkpoint at `dir` is this run's, beside the `chosen` one it resumes from:
/// `Ok` when it is; `Err(Some(why))` when it must be moved aside (another lineage's, or any
/// when the run starts afresh); `Err(None)` when it is left where it is, out of the run's set
/// (one older than the resume point whose state cannot be read: harmless).
fn lineage_verdict(
    dir: &Path,
    chosen: Option<&(PathBuf, Checkpoint)>,
    resume: bool,
    run_id: &str,
) -> Result<(), Option<String>> {
    let Some((chosen_dir, chosen_ck)) = chosen else {
        let why = if resume {
            "no checkpoint of this directory verified, so this run started afresh"
        } else {
            "checkpoint.resume = false: a new run started in this directory"
        };
        return Err(Some(format!("not this run's: {why}")));
    };
    if dir == chosen_dir {
        return Ok(());
    }
    // Older than the chosen one: ours if its lineage matches (checkpoints from before
    // lineages existed belong to a lineage-less resumed run).
    let state = load_state(dir).map_err(|_| None)?;
    if lineage_of(&state) == lineage_of(&chosen_ck.state) {
        return Ok(());
    }
    Err(Some(format!(
        "belongs to another run (run_id {:?}; this run is {run_id:?})",
        lineage_of(&state)
    )))
}

impl CheckpointManager {
    /// Scans `root`. With `resume`, the newest checkpoint that verifies is chosen and its
    /// lineage adopted; corrupt checkpoints newer than it and valid ones of another lineage
    /// are moved aside. Without `resume` (or when none verifies) a new lineage `new_run_id`
    /// starts and every existing checkpoint is moved aside: none of them is this run's.
    pub fn open(
        root: &Path,
        keep: usize,
        resume: bool,
        new_run_id: &str,
    ) -> Result<Opened, CheckpointError> {
        Self::open_with(root, keep, resume, new_run_id, load)
    }

    /// [`CheckpointManager::open`], reading the candidates with `load` ([`load`], or
    /// [`verify`] for a sharded run whose ranks then read their own pieces).
    pub fn open_with(
        root: &Path,
        keep: usize,
        resume: bool,
        new_run_id: &str,
        load: fn(&Path) -> Result<Checkpoint, CheckpointError>,
    ) -> Result<Opened, CheckpointError> {
        let reclaimed = remove_dead_writers_leftovers(root)?;
        let mut rejected = Vec::new();
        let steps = list_steps(root);
        let chosen = match resume {
            true => newest_valid(root, &steps, load, &mut rejected)?,
            false => None,
        };
        let run_id = chosen.as_ref().map_or(new_run_id.to_string(), |(_, c)| {
            lineage_of(&c.state).unwrap_or(new_run_id).to_string()
        });
        let mut ours = Vec::new();
        for &step in &steps {
            let dir = root.join(dir_name(step));
            if std::fs::symlink_metadata(&dir).is_err() {
                continue; // moved aside above
            }
            match lineage_verdict(&dir, chosen.as_ref(), resume, &run_id) {
                Ok(()) => ours.push(step),
                Err(Some(why)) => rejected.push(move_aside(root, &dir, &why)?),
                Err(None) => {}
            }
        }
        Ok(Opened {
            manager: CheckpointManager {
                root: root.to_path_buf(),
                keep: keep.max(1),
                run_id,
                ours,
            },
            resume: chosen,
            rejected,
            reclaimed,
        })
    }

    /// Continues lineage `run_id` when no checkpoint of this directory was resumed (a run
    /// restarted before its first persistent checkpoint, recorded in the run directory);
    /// ignored once a checkpoint decided the lineage.
    pub fn adopt_lineage(&mut self, run_id: &str) {
        if self.ours.is_empty() {
            self.run_id = run_id.to_string();
        }
    }

    /// This run's lineage id (written into every checkpoint's state as `run_id`).
    pub fn run_id(&self) -> &str {
        &self.run_id
    }

    /// The checkpoint directory of the root.
    pub fn root(&self) -> &Path {
        &self.root
    }

    /// Publishes `ckpt`, then moves aside this lineage's checkpoints newer than it (left by
    /// a rollback) and deletes this lineage's oldest beyond `keep`.
    pub fn save(&mut self, ckpt: &Contents) -> Result<SaveReport, CheckpointError> {
        let path = save(&self.root, ckpt)?;
        let step = ckpt.step;
        let mut superseded = Vec::new();
        for &s in self.ours.iter().filter(|&&s| s > step) {
            let dir = self.root.join(dir_name(s));
            superseded.push(move_aside(
                &self.root,
                &dir,
                &format!("superseded: the run rolled back and saved step {step} after it"),
            )?);
        }
        self.ours.retain(|&s| s < step);
        self.ours.push(step);
        self.ours.sort_unstable_by(|a, b| b.cmp(a));
        let mut pruned = Vec::new();
        for &s in self.ours.iter().skip(self.keep) {
            let dir = self.root.join(dir_name(s));
            remove_tree(&dir)?;
            pruned.push(dir);
        }
        self.ours.truncate(self.keep);
        self.remove_own_leftovers()?;
        self.remove_stale_shard_staging(step)?;
        Ok(SaveReport {
            path,
            pruned,
            superseded,
        })
    }

    /// Deletes the optimizer-shard staging directories of steps before `step` (left by a
    /// sharded run that died between its ranks' writes and rank 0's publish).
    fn remove_stale_shard_staging(&self, step: u64) -> Result<(), CheckpointError> {
        let Ok(entries) = std::fs::read_dir(&self.root) else {
            return Ok(());
        };
        for e in entries.filter_map(Result::ok) {
            let stale = layout::parse_shard_staging(&e.file_name().to_string_lossy())
                .is_some_and(|s| s < step);
            if stale {
                remove_tree(&e.path())?;
            }
        }
        Ok(())
    }

    /// Deletes this process's temporary directories of earlier failed saves (another
    /// process's are not touched: the run-directory lock means there is none, but a
    /// directory shared by mistake must not lose a save in flight).
    fn remove_own_leftovers(&self) -> Result<(), CheckpointError> {
        let pid = std::process::id().to_string();
        let Ok(entries) = std::fs::read_dir(&self.root) else {
            return Ok(());
        };
        for e in entries.filter_map(Result::ok) {
            let name = e.file_name();
            let name = name.to_string_lossy();
            let own = (name.starts_with(".tmp-") || name.starts_with(".old-"))
                && name.rsplit('-').next() == Some(pid.as_str());
            if own {
                remove_tree(&e.path())?;
            }
        }
        Ok(())
    }
}

/// Deletes the temporary and replaced directories (`.tmp-*`, `.old-*`) of every earlier writer
/// of `root` and returns them with their bytes: the caller owns the directory (it holds the run
/// directory's lock, [`crate::run_dir::RunDir`]), so no other process writes there, and a writer
/// killed mid-save (SIGKILL, a lost node, a preemption) would otherwise leave up to a whole
/// checkpoint there for ever.
fn remove_dead_writers_leftovers(root: &Path) -> Result<Vec<(PathBuf, u64)>, CheckpointError> {
    let Ok(entries) = std::fs::read_dir(root) else {
        return Ok(Vec::new());
    };
    let mut removed = Vec::new();
    for e in entries.filter_map(Result::ok) {
        let name = e.file_name();
        let name = name.to_string_lossy();
        if name.starts_with(".tmp-") || name.starts_with(".old-") {
            let bytes = tree_bytes(&e.path());
            remove_tree(&e.path())?;
            removed.push((e.path(), bytes));
        }
    }
    removed.sort();
    Ok(removed)
}

/// Bytes of the regular files under `path` (not following links).
fn tree_bytes(path: &Path) -> u64 {
    let Ok(meta) = std::fs::symlink_metadata(path) else {
        return 0;
    };
    if !meta.is_dir() {
        return if meta.is_file() { meta.len() } else { 0 };
    }
    std::fs::read_dir(path).map_or(0, |entries| {
        entries
            .filter_map(Result::ok)
            .map(|e| tree_bytes(&e.path()))
            .sum()
    })
}

/// Moves `dir` into `root/rejected/` (a free name) with a note of `reason`.
fn move_aside(root: &Path, dir: &Path, reason: &str) -> Result<Rejection, CheckpointError> {
    let aside = root.join(layout::REJECTED);
    std::fs::create_dir_all(&aside).map_err(io_err(&aside))?;
    let base = dir
        .file_name()
        .map_or_else(|| "checkpoint".into(), |n| n.to_string_lossy().into_owned());
    let mut target = aside.join(&base);
    let mut n = 1;
    while std::fs::symlink_metadata(&target).is_ok() {
        target = aside.join(format!("{base}.{n}"));
        n += 1;
    }
    std::fs::rename(dir, &target).map_err(io_err(dir))?;
    if std::fs::symlink_metadata(&target).is_ok_and(|m| m.is_dir()) {
        // Best effort: the move is what matters; the note only explains it.
        let _ = std::fs::write(
            target.join(REJECTED_NOTE),
            format!(
                "moved here by kiln at unix time {:.0} from {}\nreason: {reason}\n",
                kiln_run::unix_time(),
                dir.display()
            ),
        );
    }
    fsync_dir(root)?;
    Ok(Rejection {
        path: dir.to_path_buf(),
        reason: reason.to_string(),
        moved_to: target,
    })
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    pub(crate) fn ckpt(step: u64, run_id: &str) -> Checkpoint {
        Checkpoint {
            step,
            model: vec![HostTensor::f32("w".into(), vec![2], vec![1.0, step as f32])],
            optimizer: vec![HostTensor::f32(
                "w.exp_avg".into(),
                vec![2],
                vec![0.5, 0.25],
            )],
            state: serde_json::json!({"step": step, "run_id": run_id}),
            shards: Vec::new(),
        }
    }

    /// A checkpoint of step 9 under `root` whose weights `w` and moments `w.exp_avg` (values
    /// `w`, `m`) are in one shard per `(first element, elements)` of `cuts`, each written by
    /// its rank; the path it is published at.
    pub(crate) fn sharded_ckpt(
        root: &Path,
        w: &[f32],
        m: &[f32],
        cuts: &[(usize, usize)],
    ) -> PathBuf {
        let piece = |name: &str, v: &[f32], at: usize, n: usize| {
            HostTensor::f32(format!("{name}@{at}"), vec![n], v[at..at + n].to_vec())
        };
        let ranks = cuts.len();
        let shards: Vec<ShardFile> = (cuts.iter().enumerate())
            .flat_map(|(r, &(at, n))| {
                let (wp, mp) = (piece("w", w, at, n), piece("w.exp_avg", m, at, n));
                [
                    write_shard(root, 9, layout::checkpoint_model_shard(r, ranks), &[wp]).unwrap(),
                    write_shard(root, 9, layout::checkpoint_optimizer_shard(r, ranks), &[mp])
                        .unwrap(),
                ]
            })
            .collect();
        let ck = Checkpoint {
            model: Vec::new(),
            optimizer: Vec::new(),
            shards,
            ..ckpt(9, "a")
        };
        save(root, &ck.contents()).unwrap()
    }

    fn flip_last_byte(f: &Path) {
        let mut bytes = std::fs::read(f).unwrap();
        let last = bytes.len() - 1;
        bytes[last] ^= 1;
        std::fs::write(f, bytes).unwrap();
    }

    /// The temporary directories (`.tmp-...`) under `root`.
    fn leftovers(root: &Path) -> Vec<String> {
        std::fs::read_dir(root)
            .unwrap()
            .filter_map(|e| Some(e.ok()?.file_name().to_str()?.to_string()))
            .filter(|n| n.starts_with(".tmp-"))
            .collect()
    }

    /// Issue 46: a write that failed (on a full disk) left `.tmp-step-<N>-<pid>` behind, so
    /// the retry on the same disk failed at once. Here the failure comes after the weights
    /// and moments were written: a staged shard file is gone.
    #[test]
    fn a_failed_save_removes_its_temporary_directory() {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path();
        save(root, &ckpt(4, "a").contents()).unwrap();
        let gone = ShardFile {
            name: "extra.safetensors".into(),
            path: root.join("staged-elsewhere/extra.safetensors"),
            entry: ManifestEntry {
                sum: Checksum::Sha256(String::new()),
                bytes: 0,
            },
        };
        let ck = Checkpoint {
            shards: vec![gone],
            ..ckpt(8, "a")
        };
        let err = save(root, &ck.contents()).unwrap_err().to_string();
        assert!(err.contains("staged-elsewhere"), "{err}");
        assert_eq!(leftovers(root), Vec::<String>::new());
        assert_eq!(list_steps(root), vec![4], "the published one stays");
        // The same step saves once the cause is gone.
        save(root, &ckpt(8, "a").contents()).unwrap();
        assert_eq!(list_steps(root), vec![8, 4]);
    }

    /// Issue 60: a writer SIGKILLed mid-save left `.tmp-step-<N>-<pid>` (and a replace its
    /// `.old-...`) for ever, since only the current process's were removed. The next owner
    /// of the directory removes every one, whoever wrote it, and says how much.
    #[test]
    fn opening_removes_the_temporary_folders_of_killed_writers() {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path();
        save(root, &ckpt(4, "a").contents()).unwrap();
        for name in [".tmp-step-8-4242", ".tmp-step-12-77", ".old-step-4-4242"] {
            std::fs::create_dir_all(root.join(name)).unwrap();
            std::fs::write(root.join(name).join("model.safetensors"), [0u8; 100]).unwrap();
        }
        let opened = CheckpointManager::open(root, 3, true, "b").unwrap();
        assert_eq!(leftovers(root), Vec::<String>::new());
        assert!(!root.join(".old-step-4-4242").exists());
        let names: Vec<String> = (opened.reclaimed.iter())
            .map(|(p, _)| p.file_name().unwrap().to_string_lossy().into_owned())
            .collect();
        assert_eq!(
            names,
            [".old-step-4-4242", ".tmp-step-12-77", ".tmp-step-8-4242"]
        );
        assert!(opened.reclaimed.iter().all(|(_, b)| *b == 100));
        assert_eq!(
            opened.resume.map(|(_, c)| c.step),
            Some(4),
            "the checkpoint stays"
        );
    }

    #[test]
    fn save_load_round_trip_and_corruption_falls_back() {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path();
        save(root, &ckpt(10, "a").contents()).unwrap();
        save(root, &ckpt(20, "a").contents()).unwrap();
        let (_, c) = load_latest_valid(root, |_, _| panic!("no rejection expected")).unwrap();
        assert_eq!(c.step, 20);
        assert_eq!(c.model, ckpt(20, "a").model);
        flip_last_byte(&root.join("step-20/model.safetensors"));
        let mut rejected = Vec::new();
        let (_, c) =
            load_latest_valid(root, |p, r| rejected.push((p.to_path_buf(), r.to_string())))
                .unwrap();
        assert_eq!(c.step, 10);
        assert_eq!(rejected.len(), 1);
        assert!(rejected[0].1.contains("SHA-256"), "{}", rejected[0].1);
    }

    /// A parameter-sharded checkpoint: both ranks' weight and optimizer pieces, assembled
    /// on load; a lost weights shard, or the whole weights listed beside their shards, is
    /// refused naming the file set.
    #[test]
    fn weight_shards_assemble_and_an_incomplete_set_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path();
        let saved = sharded_ckpt(root, &[1.0, 2.0], &[0.5, 0.5], &[(0, 1), (1, 1)]);
        assert!(!saved.join(MODEL_FILE).exists());
        let back = load(&saved).unwrap();
        assert_eq!(
            back.model,
            vec![HostTensor::f32("w".into(), vec![2], vec![1.0, 2.0])]
        );
        assert_eq!(back.optimizer[0].values, vec![0.5, 0.5]);
        // The whole weights beside their shards.
        let manifest_path = saved.join(MANIFEST_FILE);
        let mut manifest = read_manifest(&saved).unwrap();
        let entry = manifest.files[&layout::checkpoint_model_shard(0, 2)].clone();
        manifest.files.insert(MODEL_FILE.into(), entry);
        std::fs::write(&manifest_path, serde_json::to_vec(&manifest).unwrap()).unwrap();
        let err = load(&saved).unwrap_err().to_string();
        assert!(
            err.contains("lists both model.safetensors and shards"),
            "{err}"
        );
        // A lost weights shard.
        manifest.files.remove(MODEL_FILE);
        manifest.files.remove(&layout::checkpoint_model_shard(1, 2));
        std::fs::write(&manifest_path, serde_json::to_vec(&manifest).unwrap()).unwrap();
        let err = load(&saved).unwrap_err().to_string();
        assert!(
            err.contains("1 of the 2 shards of model.safetensors (missing ranks [1]"),
            "{err}"
        );
    }

    #[test]
    fn bf16_tensors_keep_their_dtype_and_other_dtypes_are_named() {
        let w = HostTensor {
            name: "w".into(),
            shape: vec![3],
            dtype: StoredDtype::Bf16,
            values: vec![1.0, -0.00390625, 3.140625],
        };
        let m = HostTensor::f32("m".into(), vec![1], vec![0.1]);
        let bytes = to_safetensors(&[w.clone(), m.clone()]).unwrap();
        let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
        assert_eq!(st.tensor("w").unwrap().dtype(), safetensors::Dtype::BF16);
        assert_eq!(st.tensor("w").unwrap().data().len(), 6);
        let back = from_safetensors(&bytes, Path::new("x")).unwrap();
        assert_eq!(back, vec![m, w]);
        // An f16 tensor is refused by name, not misread.
        let f16 = safetensors::tensor::TensorView::new(safetensors::Dtype::F16, vec![1], &[0, 60])
            .unwrap();
        let bytes = safetensors::serialize([("h", f16)], &None).unwrap();
        let err = from_safetensors(&bytes, Path::new("x.safetensors"))
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("tensor h has dtype F16") && err.contains("x.safetensors"),
            "{err}"
        );
    }

    #[test]
    fn manifest_may_name_only_the_formats_files_and_never_special_ones() {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path();
        let ck = save(root, &ckpt(1, "a").contents()).unwrap();
        let manifest_path = ck.join(MANIFEST_FILE);
        let good = std::fs::read_to_string(&manifest_path).unwrap();
        for evil in ["../../../../etc/hostname", "/dev/zero", "sub/x", ".."] {
            let m = good.replace("\"state.json\"", &format!("{evil:?}"));
            std::fs::write(&manifest_path, m).unwrap();
            let err = load(&ck).unwrap_err().to_string();
            assert!(
                err.contains("not a file of a kiln checkpoint"),
                "{evil}: {err}"
            );
        }
        std::fs::write(&manifest_path, &good).unwrap();
        // A listed file replaced by a link to a device or by a FIFO is refused, not read.
        let state = ck.join(STATE_FILE);
        std::fs::remove_file(&state).unwrap();
        std::os::unix::fs::symlink("/dev/zero", &state).unwrap();
        let err = load(&ck).unwrap_err().to_string();
        assert!(err.contains("symbolic link"), "{err}");
        std::fs::remove_file(&state).unwrap();
        nix::unistd::mkfifo(&state, nix::sys::stat::Mode::S_IRWXU).unwrap();
        let err = load(&ck).unwrap_err().to_string();
        assert!(err.contains("not a regular file"), "{err}");
    }

    #[test]
    fn retention_keeps_k_of_its_lineage_and_moves_foreign_and_corrupt_aside() {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path();
        // Another run's checkpoints at higher steps, one of them corrupt.
        for s in [40, 50, 60] {
            save(root, &ckpt(s, "other").contents()).unwrap();
        }
        flip_last_byte(&root.join("step-60/model.safetensors"));
        let opened = CheckpointManager::open(root, 2, false, "mine").unwrap();
        assert!(opened.resume.is_none());
        assert_eq!(opened.rejected.len(), 3, "{:?}", opened.rejected);
        let mut m = opened.manager;
        for s in [10, 20, 30] {
            let report = m.save(&ckpt(s, "mine").contents()).unwrap();
            assert!(
                report.pruned.iter().all(|p| !p.ends_with(dir_name(s))),
                "pruned what it just saved: {report:?}"
            );
        }
        assert_eq!(list_steps(root), vec![30, 20]);
        let aside: Vec<_> = std::fs::read_dir(root.join("rejected"))
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .collect();
        assert_eq!(aside.len(), 3, "{aside:?}");
    }

    #[test]
    fn resume_adopts_the_lineage_and_a_rollback_supersedes_newer_checkpoints() {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path();
        for s in [10, 20, 30] {
            save(root, &ckpt(s, "r1").contents()).unwrap();
        }
        flip_last_byte(&root.join("step-30/optimizer.safetensors"));
        let opened = CheckpointManager::open(root, 3, true, "new").unwrap();
        assert_eq!(opened.resume.as_ref().unwrap().1.step, 20);
        assert_eq!(opened.manager.run_id(), "r1");
        assert_eq!(opened.rejected.len(), 1);
        let mut m = opened.manager;
        // Saving step 15 (after an in-memory rollback) moves step 20 aside, keeps 10.
        let report = m.save(&ckpt(15, "r1").contents()).unwrap();
        assert_eq!(report.superseded.len(), 1);
        assert_eq!(list_steps(root), vec![15, 10]);
    }
}

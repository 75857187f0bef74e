//! One checkpoint directory: its manifest (each file's size and checksum) and shard set,
//! written into a temporary directory and read back verified, trusting nothing in it.

use super::checksum::{Checksum, ChecksumKind, ManifestEntry};
use super::error::{CheckpointError, invalid};
use super::files::{fsync_dir, io_err, remove_tree};
use super::format::{HostTensor, from_safetensors};
use super::stream::{Hashing, Source, StreamError};
use super::{region, stream};
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

/// Creates `path` (it must not exist) and writes it through a hashing, buffered writer with
/// `fill`; synced. Returns its manifest entry. A failed write leaves what it wrote for the
/// caller's temporary directory to remove.
pub(super) fn write_file_synced(
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

pub(super) fn write_synced(
    path: &Path,
    kind: ChecksumKind,
    bytes: &[u8],
) -> Result<ManifestEntry, CheckpointError> {
    write_file_synced(path, kind, |out| Ok(out.write_all(bytes)?))
}

/// Writes `tensors` as the safetensors file `path`, each tensor read as it is written.
pub(super) fn write_tensors_synced(
    path: &Path,
    kind: ChecksumKind,
    tensors: &[&dyn Source],
) -> Result<ManifestEntry, CheckpointError> {
    write_file_synced(path, kind, |out| stream::write(out, tensors))
}

/// Writes `ckpt`'s files into the directory `tmp`, each synced, then the manifest that lists
/// them: the model and optimizer state (unless the ranks staged them as shard files, which are
/// moved in), the training state.
pub(super) fn write_contents(
    tmp: &Path,
    ckpt: &Contents,
    kind: ChecksumKind,
) -> Result<(), CheckpointError> {
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

/// Opens a file of a checkpoint for reading, and its size: refuses links and anything but a
/// regular file.
pub(super) fn open_regular(path: &Path) -> Result<(File, u64), CheckpointError> {
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
pub(super) fn read_bounded(
    path: &Path,
    expect: Option<u64>,
    cap: u64,
) -> Result<Vec<u8>, CheckpointError> {
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
pub(super) fn read_manifest(dir: &Path) -> Result<Manifest, CheckpointError> {
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
pub(super) fn check_shard_set(
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
pub(super) fn load_shards(
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
pub(super) fn read_verified(
    dir: &Path,
    manifest: &Manifest,
    name: &str,
) -> Result<Vec<u8>, CheckpointError> {
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

pub(super) fn parse_state(
    dir: &Path,
    bytes: &[u8],
) -> Result<(u64, serde_json::Value), CheckpointError> {
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

/// Largest manifest or state file accepted (they are a few hundred bytes to a few KB).
pub(super) const MAX_SMALL_FILE: u64 = 16 << 20;

/// The lineage id recorded in a checkpoint's state (`run_id`); checkpoints written before
/// lineages existed have none.
pub(crate) fn lineage_of(state: &serde_json::Value) -> Option<&str> {
    state.get("run_id").and_then(serde_json::Value::as_str)
}

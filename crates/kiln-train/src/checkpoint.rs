//! Checkpoints: `RUN_DIR/checkpoints/step-<N>/` holds `model.safetensors`,
//! `optimizer.safetensors`, `state.json` and `manifest.json` (SHA-256 and size of each file).
//!
//! Publishing is crash-safe: everything is written into a temporary directory, each file and
//! the directory are fsynced, and only then is it renamed to `step-<N>` (rename is atomic).
//! Loading verifies the manifest; a torn or corrupt checkpoint is rejected (and reported by
//! the caller) and the one before it is used.

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use std::collections::BTreeMap;
use std::fs::File;
use std::io::Write;
use std::path::{Path, PathBuf};

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

fn io_err(path: &Path) -> impl FnOnce(std::io::Error) -> CheckpointError + '_ {
    move |source| CheckpointError::Io {
        path: path.to_path_buf(),
        source,
    }
}

fn invalid(path: &Path, reason: impl Into<String>) -> CheckpointError {
    CheckpointError::Invalid {
        path: path.to_path_buf(),
        reason: reason.into(),
    }
}

/// A named f32 tensor on the host.
#[derive(Debug, Clone, PartialEq)]
pub struct HostTensor {
    /// Parameter (or state) name.
    pub name: String,
    /// Shape.
    pub shape: Vec<usize>,
    /// Values, row-major.
    pub values: Vec<f32>,
}

/// Serialises tensors to safetensors bytes. Deterministic: same tensors, same bytes (the
/// metadata map has a single fixed key, tensors are ordered by the format's rules).
pub fn to_safetensors(tensors: &[HostTensor]) -> Result<Vec<u8>, safetensors::SafeTensorError> {
    let bytes: Vec<Vec<u8>> = tensors
        .iter()
        .map(|t| t.values.iter().flat_map(|v| v.to_le_bytes()).collect())
        .collect();
    let views = tensors
        .iter()
        .zip(&bytes)
        .map(|(t, b)| {
            safetensors::tensor::TensorView::new(safetensors::Dtype::F32, t.shape.clone(), b)
                .map(|v| (t.name.clone(), v))
        })
        .collect::<Result<Vec<_>, _>>()?;
    let meta = std::collections::HashMap::from([("format".to_string(), "pt".to_string())]);
    safetensors::serialize(views, &Some(meta))
}

/// Parses safetensors bytes into f32 tensors (any other dtype is an error).
pub fn from_safetensors(bytes: &[u8], path: &Path) -> Result<Vec<HostTensor>, CheckpointError> {
    let st =
        safetensors::SafeTensors::deserialize(bytes).map_err(|e| invalid(path, e.to_string()))?;
    let mut out = Vec::new();
    for (name, view) in st.tensors() {
        if view.dtype() != safetensors::Dtype::F32 {
            return Err(invalid(
                path,
                format!("tensor {name} has dtype {:?}, expected F32", view.dtype()),
            ));
        }
        let values = view
            .data()
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect();
        out.push(HostTensor {
            name,
            shape: view.shape().to_vec(),
            values,
        });
    }
    out.sort_by(|a, b| a.name.cmp(&b.name));
    Ok(out)
}

/// One file's entry in `manifest.json`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ManifestEntry {
    /// Lower-case hex SHA-256 of the file.
    pub sha256: String,
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
}

/// Name of a checkpoint directory.
pub fn dir_name(step: u64) -> String {
    format!("step-{step}")
}

fn fsync_dir(dir: &Path) -> Result<(), CheckpointError> {
    File::open(dir)
        .and_then(|f| f.sync_all())
        .map_err(io_err(dir))
}

fn write_synced(path: &Path, bytes: &[u8]) -> Result<ManifestEntry, CheckpointError> {
    let mut f = File::create(path).map_err(io_err(path))?;
    f.write_all(bytes)
        .and_then(|()| f.sync_all())
        .map_err(io_err(path))?;
    Ok(ManifestEntry {
        sha256: hex::encode(Sha256::digest(bytes)),
        bytes: bytes.len() as u64,
    })
}

/// Writes `ckpt` as `root/step-<N>` atomically and returns its path.
pub fn save(root: &Path, ckpt: &Checkpoint) -> Result<PathBuf, CheckpointError> {
    std::fs::create_dir_all(root).map_err(io_err(root))?;
    let final_dir = root.join(dir_name(ckpt.step));
    let tmp = root.join(format!(
        ".tmp-{}-{}",
        dir_name(ckpt.step),
        std::process::id()
    ));
    if tmp.exists() {
        std::fs::remove_dir_all(&tmp).map_err(io_err(&tmp))?;
    }
    std::fs::create_dir_all(&tmp).map_err(io_err(&tmp))?;
    let mut files = BTreeMap::new();
    let ser = |t: &[HostTensor], name: &str| {
        to_safetensors(t).map_err(|e| invalid(&tmp.join(name), e.to_string()))
    };
    let model = ser(&ckpt.model, "model.safetensors")?;
    files.insert(
        "model.safetensors".to_string(),
        write_synced(&tmp.join("model.safetensors"), &model)?,
    );
    let opt = ser(&ckpt.optimizer, "optimizer.safetensors")?;
    files.insert(
        "optimizer.safetensors".to_string(),
        write_synced(&tmp.join("optimizer.safetensors"), &opt)?,
    );
    let state = serde_json::to_vec_pretty(&ckpt.state).map_err(|e| invalid(&tmp, e.to_string()))?;
    files.insert(
        "state.json".to_string(),
        write_synced(&tmp.join("state.json"), &state)?,
    );
    let manifest = serde_json::to_vec_pretty(&Manifest { version: 1, files })
        .map_err(|e| invalid(&tmp, e.to_string()))?;
    write_synced(&tmp.join("manifest.json"), &manifest)?;
    fsync_dir(&tmp)?;
    if final_dir.exists() {
        // Re-saving a step that exists (a resumed run that stops at the same step): move the
        // old one aside first, so there is never a moment without a valid step-<N>.
        let old = root.join(format!(
            ".old-{}-{}",
            dir_name(ckpt.step),
            std::process::id()
        ));
        std::fs::rename(&final_dir, &old).map_err(io_err(&final_dir))?;
        std::fs::rename(&tmp, &final_dir).map_err(io_err(&final_dir))?;
        std::fs::remove_dir_all(&old).map_err(io_err(&old))?;
    } else {
        std::fs::rename(&tmp, &final_dir).map_err(io_err(&final_dir))?;
    }
    fsync_dir(root)?;
    Ok(final_dir)
}

/// Steps of the `step-<N>` directories under `root`, newest first.
pub fn list_steps(root: &Path) -> Vec<u64> {
    let Ok(entries) = std::fs::read_dir(root) else {
        return Vec::new();
    };
    let mut steps: Vec<u64> = entries
        .filter_map(Result::ok)
        .filter_map(|e| e.file_name().to_str()?.strip_prefix("step-")?.parse().ok())
        .collect();
    steps.sort_unstable_by(|a, b| b.cmp(a));
    steps
}

/// Loads and verifies `dir` against its manifest.
pub fn load(dir: &Path) -> Result<Checkpoint, CheckpointError> {
    let manifest_path = dir.join("manifest.json");
    let manifest_bytes = std::fs::read(&manifest_path)
        .map_err(|e| invalid(dir, format!("no readable manifest.json ({e})")))?;
    let manifest: Manifest = serde_json::from_slice(&manifest_bytes)
        .map_err(|e| invalid(&manifest_path, format!("malformed manifest: {e}")))?;
    let mut contents = BTreeMap::new();
    for required in ["model.safetensors", "optimizer.safetensors", "state.json"] {
        if !manifest.files.contains_key(required) {
            return Err(invalid(
                &manifest_path,
                format!("manifest does not list {required}"),
            ));
        }
    }
    for (name, entry) in &manifest.files {
        let path = dir.join(name);
        let bytes = std::fs::read(&path).map_err(|e| invalid(&path, format!("unreadable: {e}")))?;
        if bytes.len() as u64 != entry.bytes {
            return Err(invalid(
                &path,
                format!(
                    "size {} != {} in manifest (torn write?)",
                    bytes.len(),
                    entry.bytes
                ),
            ));
        }
        let sum = hex::encode(Sha256::digest(&bytes));
        if sum != entry.sha256 {
            return Err(invalid(
                &path,
                format!("SHA-256 {sum} != {} in manifest (corrupt)", entry.sha256),
            ));
        }
        contents.insert(name.clone(), bytes);
    }
    let state_path = dir.join("state.json");
    let state: serde_json::Value = serde_json::from_slice(&contents["state.json"])
        .map_err(|e| invalid(&state_path, format!("malformed: {e}")))?;
    let step = state
        .get("step")
        .and_then(serde_json::Value::as_u64)
        .ok_or_else(|| invalid(&state_path, "no integer `step`"))?;
    Ok(Checkpoint {
        step,
        model: from_safetensors(
            &contents["model.safetensors"],
            &dir.join("model.safetensors"),
        )?,
        optimizer: from_safetensors(
            &contents["optimizer.safetensors"],
            &dir.join("optimizer.safetensors"),
        )?,
        state,
    })
}

/// The newest checkpoint under `root` that verifies. Each rejected one is passed to
/// `on_reject` (path and reason) before the next older one is tried.
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

/// Deletes all but the newest `keep` checkpoints and any leftover temporary directories of
/// this process's earlier crashes. Returns the deleted directories.
pub fn prune(root: &Path, keep: usize) -> Result<Vec<PathBuf>, CheckpointError> {
    let mut deleted = Vec::new();
    for step in list_steps(root).into_iter().skip(keep) {
        let dir = root.join(dir_name(step));
        std::fs::remove_dir_all(&dir).map_err(io_err(&dir))?;
        deleted.push(dir);
    }
    if let Ok(entries) = std::fs::read_dir(root) {
        for e in entries.filter_map(Result::ok) {
            let name = e.file_name();
            let name = name.to_string_lossy();
            if name.starts_with(".tmp-") || name.starts_with(".old-") {
                let path = e.path();
                std::fs::remove_dir_all(&path).map_err(io_err(&path))?;
                deleted.push(path);
            }
        }
    }
    Ok(deleted)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ckpt(step: u64) -> Checkpoint {
        Checkpoint {
            step,
            model: vec![HostTensor {
                name: "w".into(),
                shape: vec![2],
                values: vec![1.0, step as f32],
            }],
            optimizer: vec![HostTensor {
                name: "w.exp_avg".into(),
                shape: vec![2],
                values: vec![0.5, 0.25],
            }],
            state: serde_json::json!({"step": step}),
        }
    }

    #[test]
    fn save_load_round_trip_and_corruption_falls_back() {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path();
        save(root, &ckpt(10)).unwrap();
        save(root, &ckpt(20)).unwrap();
        let (_, c) = load_latest_valid(root, |_, _| panic!("no rejection expected")).unwrap();
        assert_eq!(c.step, 20);
        assert_eq!(c.model, ckpt(20).model);
        // flip one byte of the newest model file
        let f = root.join("step-20/model.safetensors");
        let mut bytes = std::fs::read(&f).unwrap();
        let last = bytes.len() - 1;
        bytes[last] ^= 1;
        std::fs::write(&f, bytes).unwrap();
        let mut rejected = Vec::new();
        let (_, c) =
            load_latest_valid(root, |p, r| rejected.push((p.to_path_buf(), r.to_string())))
                .unwrap();
        assert_eq!(c.step, 10);
        assert_eq!(rejected.len(), 1);
        assert!(rejected[0].1.contains("SHA-256"), "{}", rejected[0].1);
    }

    #[test]
    fn torn_checkpoint_without_manifest_is_rejected_and_prune_keeps_k() {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path();
        for s in [1, 2, 3] {
            save(root, &ckpt(s)).unwrap();
        }
        std::fs::remove_file(root.join("step-3/manifest.json")).unwrap();
        assert!(load(&root.join("step-3")).is_err());
        std::fs::create_dir_all(root.join(".tmp-step-9-1")).unwrap();
        let deleted = prune(root, 2).unwrap();
        assert_eq!(list_steps(root), vec![3, 2]);
        assert_eq!(deleted.len(), 2);
    }

    #[test]
    fn serialisation_is_deterministic() {
        let a = to_safetensors(&ckpt(5).model).unwrap();
        let b = to_safetensors(&ckpt(5).model).unwrap();
        assert_eq!(a, b);
    }
}

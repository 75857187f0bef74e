//! Shard manifests: pin each shard's size and SHA-256 so that a run refuses a shard that
//! changed under it (a corpus owner re-emitting shards silently changes the history of every
//! run that reads them).
//!
//! `kiln data manifest LIST` writes `LIST.manifest.json` (by default) next to the list:
//!
//! ```json
//! {"version":1,"shards":[{"path":"web/cc_0001_text.bin","size":123,"sha256":"…","sampled_sha256":"…"}]}
//! ```
//!
//! Paths are relative to the manifest's directory. Verification is fast by default (size plus
//! the sampled fingerprint of [`crate::fingerprint::sampled`], ~2 MiB read per shard) or full
//! (every byte hashed) on request.

use crate::error::{DataError, Result};
use crate::fingerprint;
use crate::indexed::{bin_path, idx_path};
use rayon::prelude::*;
use std::path::{Path, PathBuf};

/// How thoroughly to check shards against their manifest.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Verify {
    /// Do not check.
    Off,
    /// Size and sampled SHA-256 (default): milliseconds per shard.
    #[default]
    Fast,
    /// Size and the full SHA-256 of every byte.
    Full,
}

impl std::str::FromStr for Verify {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s {
            "off" => Ok(Verify::Off),
            "fast" => Ok(Verify::Fast),
            "full" => Ok(Verify::Full),
            _ => Err(format!(
                "unknown verify mode {s:?} (expected off, fast or full)"
            )),
        }
    }
}

/// One pinned file.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct ShardPin {
    /// Path relative to the manifest's directory (or absolute).
    pub path: String,
    /// Size in bytes.
    pub size: u64,
    /// SHA-256 of the whole file.
    pub sha256: String,
    /// SHA-256 of the sampled pages (see [`crate::fingerprint::sampled`]).
    pub sampled_sha256: String,
}

/// A manifest file.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Manifest {
    pub version: u32,
    pub shards: Vec<ShardPin>,
}

/// The default manifest path for a corpus list: `LIST.manifest.json`.
pub fn default_path(list: &Path) -> PathBuf {
    let mut s = list.as_os_str().to_owned();
    s.push(".manifest.json");
    PathBuf::from(s)
}

fn relative(path: &Path, base: &Path) -> String {
    let abs = |p: &Path| std::path::absolute(p).unwrap_or_else(|_| p.to_path_buf());
    let (p, b) = (abs(path), abs(base));
    match p.strip_prefix(&b) {
        Ok(rel) => rel.to_string_lossy().into_owned(),
        Err(_) => p.to_string_lossy().into_owned(),
    }
}

impl Manifest {
    /// Hash the `.bin` and `.idx` of every prefix (in parallel, with a byte progress bar) and
    /// build a manifest whose paths are relative to `manifest_path`'s directory.
    pub fn create(prefixes: &[PathBuf], manifest_path: &Path) -> Result<Manifest> {
        let base = manifest_path.parent().unwrap_or(Path::new("."));
        let files: Vec<PathBuf> = prefixes
            .iter()
            .flat_map(|p| [idx_path(p), bin_path(p)])
            .collect();
        let mut total = 0u64;
        for f in &files {
            total += std::fs::metadata(f).map_err(|e| DataError::io(f, e))?.len();
        }
        let bar = crate::progress::bytes_bar(total, "sha256");
        let shards: Vec<Result<ShardPin>> = files
            .par_iter()
            .map(|f| {
                let mut last = 0;
                let sha256 = fingerprint::full(f, |done| {
                    bar.inc(done - last);
                    last = done;
                })?;
                let (size, sampled_sha256) = fingerprint::sampled(f)?;
                Ok(ShardPin {
                    path: relative(f, base),
                    size,
                    sha256,
                    sampled_sha256,
                })
            })
            .collect();
        bar.finish_and_clear();
        Ok(Manifest {
            version: 1,
            shards: shards.into_iter().collect::<Result<_>>()?,
        })
    }

    /// Read a manifest file.
    pub fn read(path: &Path) -> Result<Manifest> {
        let text = kiln_run::files::read_to_string_limited(
            path,
            crate::error::limits::MANIFEST,
            "a shard manifest",
        )
        .map_err(|e| DataError::io(path, e))?;
        let m: Manifest = serde_json::from_str(&text)
            .map_err(|e| DataError::format(path, format!("not a kiln manifest: {e}")))?;
        if m.version != 1 {
            return Err(DataError::format(
                path,
                format!(
                    "manifest version {} is not supported (expected 1)",
                    m.version
                ),
            ));
        }
        Ok(m)
    }

    /// Write the manifest (atomically).
    pub fn write(&self, path: &Path) -> Result<()> {
        let text = serde_json::to_string_pretty(self)
            .map_err(|e| DataError::format(path, e.to_string()))?;
        let bytes = (text + "\n").into_bytes();
        kiln_run::files::write_atomic(path, &bytes, kiln_run::files::Atomic::DURABLE)
            .map_err(|e| DataError::io(path, e))
    }

    /// Check the `.bin` and `.idx` of each prefix against the manifest at `manifest_path`.
    /// A file not pinned, or pinned with other bytes, is an error naming it.
    pub fn verify(&self, manifest_path: &Path, prefixes: &[PathBuf], mode: Verify) -> Result<()> {
        if mode == Verify::Off {
            return Ok(());
        }
        let base = manifest_path.parent().unwrap_or(Path::new("."));
        let files: Vec<PathBuf> = prefixes
            .iter()
            .flat_map(|p| [idx_path(p), bin_path(p)])
            .collect();
        let results: Vec<Result<()>> = files
            .par_iter()
            .map(|f| {
                let rel = relative(f, base);
                let pin = self
                    .shards
                    .iter()
                    .find(|s| s.path == rel || base.join(&s.path) == *f)
                    .ok_or_else(|| DataError::ShardChanged {
                        path: f.clone(),
                        manifest: manifest_path.to_path_buf(),
                        reason: "not pinned in the manifest".into(),
                    })?;
                let changed = |reason: String| DataError::ShardChanged {
                    path: f.clone(),
                    manifest: manifest_path.to_path_buf(),
                    reason,
                };
                let (size, sampled) = fingerprint::sampled(f)?;
                if size != pin.size {
                    return Err(changed(format!("size {size}, pinned {}", pin.size)));
                }
                match mode {
                    Verify::Fast if sampled != pin.sampled_sha256 => {
                        Err(changed("sampled SHA-256 differs".into()))
                    }
                    Verify::Full => {
                        let full = fingerprint::full(f, |_| {})?;
                        if full != pin.sha256 {
                            Err(changed(format!("SHA-256 {full}, pinned {}", pin.sha256)))
                        } else {
                            Ok(())
                        }
                    }
                    _ => Ok(()),
                }
            })
            .collect();
        results.into_iter().collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::indexed::{DType, IndexedDatasetBuilder};

    #[test]
    fn pins_and_refuses_changed_shards_by_name() {
        let dir = tempfile::tempdir().unwrap();
        let prefix = dir.path().join("a");
        let mut b = IndexedDatasetBuilder::create(&prefix, DType::U16).unwrap();
        b.add_document(&[1, 2, 3]).unwrap();
        b.finish().unwrap();
        let mpath = dir.path().join("list.manifest.json");
        let m = Manifest::create(std::slice::from_ref(&prefix), &mpath).unwrap();
        m.write(&mpath).unwrap();
        let m = Manifest::read(&mpath).unwrap();
        assert_eq!(m.shards[0].path, "a.idx");
        m.verify(&mpath, std::slice::from_ref(&prefix), Verify::Full)
            .unwrap();
        // Same size, different bytes.
        std::fs::write(bin_path(&prefix), [9u8, 0, 2, 0, 3, 0]).unwrap();
        for mode in [Verify::Fast, Verify::Full] {
            let err = m
                .verify(&mpath, std::slice::from_ref(&prefix), mode)
                .unwrap_err()
                .to_string();
            assert!(err.contains("a.bin") && err.contains("changed"), "{err}");
        }
        m.verify(&mpath, std::slice::from_ref(&prefix), Verify::Off)
            .unwrap();
        let other = dir.path().join("b");
        let err = m.verify(&mpath, &[other], Verify::Fast).unwrap_err();
        assert!(err.to_string().contains("b.idx"), "{err}");
    }
}

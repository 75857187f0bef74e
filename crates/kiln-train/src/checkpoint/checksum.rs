//! The checksum of a checkpoint file in its manifest, named by its algorithm.
//!
//! Persistent checkpoints use SHA-256: they outlive the job, move between machines and are
//! read by other tools, and their writes are rare. The memory tier's snapshots use XXH3-128:
//! they live in node-local memory for one job, guard only against a torn or damaged copy, and
//! are written every few steps on the writer thread, where SHA-256 (about 2 GB/s) took about
//! 2% of the CPU step of the reference model on 2 cores and XXH3 (AVX2, tens of GB/s) takes a
//! tenth of that. A manifest says which one each file carries (`"sha256"` or `"xxh3_128"`
//! beside `"bytes"`), so any reader verifies either.

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

/// Which algorithm a writer uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ChecksumKind {
    /// SHA-256: persistent checkpoints.
    Sha256,
    /// XXH3-128 (seed 0): memory-tier snapshots.
    Xxh3_128,
}

/// A file's checksum: lower-case hex, under the algorithm's name.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Checksum {
    /// SHA-256, 64 hex digits.
    Sha256(String),
    /// XXH3-128, 32 hex digits (big-endian, as `xxhsum -H2` prints it).
    Xxh3_128(String),
}

impl Checksum {
    /// The checksum of `bytes`.
    pub fn of(kind: ChecksumKind, bytes: &[u8]) -> Checksum {
        let mut h = Hasher::new(kind);
        h.update(bytes);
        h.finish()
    }

    /// Its algorithm.
    pub fn kind(&self) -> ChecksumKind {
        match self {
            Checksum::Sha256(_) => ChecksumKind::Sha256,
            Checksum::Xxh3_128(_) => ChecksumKind::Xxh3_128,
        }
    }

    /// `None` if `got` (computed with this checksum's algorithm) matches; otherwise what is
    /// wrong, for an error message.
    pub fn mismatch(&self, got: &Checksum) -> Option<String> {
        (self != got).then(|| format!("{got} != {self} in manifest (corrupt)"))
    }
}

impl std::fmt::Display for Checksum {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Checksum::Sha256(h) => write!(f, "SHA-256 {h}"),
            Checksum::Xxh3_128(h) => write!(f, "XXH3-128 {h}"),
        }
    }
}

/// A checksum computed over bytes as they pass.
pub enum Hasher {
    /// SHA-256.
    Sha256(Box<Sha256>),
    /// XXH3-128.
    Xxh3_128(Box<twox_hash::XxHash3_128>),
}

impl Hasher {
    /// An empty hash of `kind`.
    pub fn new(kind: ChecksumKind) -> Hasher {
        match kind {
            ChecksumKind::Sha256 => Hasher::Sha256(Box::new(Sha256::new())),
            ChecksumKind::Xxh3_128 => Hasher::Xxh3_128(Box::new(twox_hash::XxHash3_128::new())),
        }
    }

    /// Adds `bytes`.
    pub fn update(&mut self, bytes: &[u8]) {
        match self {
            Hasher::Sha256(h) => h.update(bytes),
            Hasher::Xxh3_128(h) => h.write(bytes),
        }
    }

    /// The checksum of everything added.
    pub fn finish(self) -> Checksum {
        match self {
            Hasher::Sha256(h) => Checksum::Sha256(hex::encode(h.finalize())),
            Hasher::Xxh3_128(h) => Checksum::Xxh3_128(format!("{:032x}", h.finish_128())),
        }
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn known_values_and_manifest_spelling() {
        // Reference values: `sha256sum` and `xxhsum -H2` of "abc".
        assert_eq!(
            Checksum::of(ChecksumKind::Sha256, b"abc"),
            Checksum::Sha256(
                "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad".into()
            )
        );
        assert_eq!(
            Checksum::of(ChecksumKind::Xxh3_128, b"abc"),
            Checksum::Xxh3_128("06b05ab6733a618578af5f94892f3950".into())
        );
        let json = serde_json::to_string(&Checksum::of(ChecksumKind::Xxh3_128, b"")).unwrap();
        assert!(json.starts_with(r#"{"xxh3_128":""#), "{json}");
    }

    #[test]
    fn streamed_equals_one_shot_for_both_kinds() {
        let data: Vec<u8> = (0..300_000u32).map(|i| (i * 7 % 251) as u8).collect();
        for kind in [ChecksumKind::Sha256, ChecksumKind::Xxh3_128] {
            let mut h = Hasher::new(kind);
            for piece in data.chunks(4097) {
                h.update(piece);
            }
            let got = h.finish();
            assert_eq!(got, Checksum::of(kind, &data));
            assert_eq!(got.kind(), kind);
            assert!(got.mismatch(&Checksum::of(kind, &data[1..])).is_some());
        }
    }
}

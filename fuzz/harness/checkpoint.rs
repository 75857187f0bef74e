//! Fuzz harness: a checkpoint directory as `kiln_train::checkpoint::load` reads it
//! (`manifest.json`, `state.json`, `model.safetensors`, and `optimizer.safetensors` or a
//! sharded run's two `optimizer-<r>-of-00002.safetensors`).
//!
//! The input is four parts separated by [`SEP`]: manifest, state, model, optimizer (missing
//! parts are empty files); a fifth part makes it a sharded checkpoint: parts four and five are
//! the two optimizer shards ([`SHARDED`]). An empty manifest part means "a correct manifest
//! for the other files", so that mutations of `state.json` and the safetensors files get past
//! the checksums and reach their parsers (and the shards' assembly); a non-empty one is
//! written as it is.
//!
//! The partial reader of a sharded run (`verify`, `load_kept`) must agree with `load`: on a
//! checkpoint `load` accepts, it verifies and gives the same tensors whole, and each
//! tensor's elements 1..3 (or an error naming them when it has fewer); its errors name the
//! checkpoint too.
//!
//! Manifest entries naming anything but the checkpoint's own files (`../x`, `/dev/zero`)
//! must be refused without being opened (`regressions/checkpoint/manifest-*`).

use kiln_train::checkpoint::{
    self, Checksum, ChecksumKind, MANIFEST_FILE, MODEL_FILE, Manifest, ManifestEntry,
    OPTIMIZER_FILE, STATE_FILE,
};
use std::collections::BTreeMap;

/// Separates the parts of a multi-file fuzz input.
pub const SEP: &[u8] = b"--KILN-FUZZ-PART--";

/// The checkpoint's files, in the order of the input's parts.
pub const FILES: [&str; 4] = [MANIFEST_FILE, STATE_FILE, MODEL_FILE, OPTIMIZER_FILE];

/// The files of a sharded checkpoint (an input of five parts), in order.
pub const SHARDED: [&str; 5] = [
    MANIFEST_FILE,
    STATE_FILE,
    MODEL_FILE,
    "optimizer-00000-of-00002.safetensors",
    "optimizer-00001-of-00002.safetensors",
];

/// Up to five parts; the files they are written as.
fn split(data: &[u8]) -> (Vec<&[u8]>, &'static [&'static str]) {
    let mut parts = Vec::new();
    let mut rest = data;
    while parts.len() + 1 < SHARDED.len() {
        match rest.windows(SEP.len()).position(|w| w == SEP) {
            Some(at) => {
                parts.push(&rest[..at]);
                rest = &rest[at + SEP.len()..];
            }
            None => break,
        }
    }
    parts.push(rest);
    let files: &[&str] = match parts.len() {
        5 => &SHARDED,
        _ => &FILES,
    };
    parts.resize(files.len(), &[]);
    (parts, files)
}

pub fn run(data: &[u8]) {
    let (parts, names) = split(data);
    let dir = tempfile::tempdir().expect("temporary directory");
    let ck = dir.path().join("step-7");
    std::fs::create_dir(&ck).expect("checkpoint directory");
    for (name, bytes) in names.iter().zip(&parts).skip(1) {
        std::fs::write(ck.join(name), bytes).expect("write a part");
    }
    // Both checksums a manifest may carry: SHA-256 (persistent) and XXH3-128 (memory tier).
    let kind = match data.len() % 2 {
        0 => ChecksumKind::Sha256,
        _ => ChecksumKind::Xxh3_128,
    };
    let manifest = if parts[0].is_empty() {
        let files: BTreeMap<String, ManifestEntry> = names[1..]
            .iter()
            .zip(&parts[1..])
            .map(|(name, bytes)| {
                let entry = ManifestEntry {
                    sum: Checksum::of(kind, bytes),
                    bytes: bytes.len() as u64,
                };
                (name.to_string(), entry)
            })
            .collect();
        serde_json::to_vec(&Manifest { version: 1, files }).expect("manifest JSON")
    } else {
        parts[0].to_vec()
    };
    std::fs::write(ck.join(names[0]), &manifest).expect("write the manifest");
    if let Err(e) = checkpoint::load_state(&ck) {
        assert!(e.to_string().contains("step-7"), "{e}");
    }
    let loaded = checkpoint::load(&ck);
    partial_agrees(&ck, loaded.as_ref().ok());
    match loaded {
        Ok(c) => {
            assert_eq!(c.state.get("step").and_then(|s| s.as_u64()), Some(c.step));
            for t in c.model.iter().chain(&c.optimizer) {
                let n = t.shape.iter().try_fold(1usize, |a, &d| a.checked_mul(d));
                assert_eq!(
                    n,
                    Some(t.values.len()),
                    "tensor {} shape {:?}",
                    t.name,
                    t.shape
                );
            }
        }
        Err(e) => {
            let msg = e.to_string();
            assert!(
                msg.contains("step-7"),
                "error does not name the checkpoint: {msg}"
            );
        }
    }
    // The newest-valid scan over a root holding it must give a verdict too.
    let mut rejected = 0;
    let found = checkpoint::load_latest_valid(dir.path(), |_, _| rejected += 1);
    assert!(found.is_some() != (rejected == 1));
}

/// `verify` and `load_kept` on `ck` against `load`'s result `all` (see the module docs).
fn partial_agrees(ck: &std::path::Path, all: Option<&checkpoint::Checkpoint>) {
    let named = |e: checkpoint::CheckpointError| {
        let msg = e.to_string();
        assert!(
            msg.contains("step-7"),
            "error does not name the checkpoint: {msg}"
        );
        msg
    };
    let verified = checkpoint::verify(ck).map_err(named);
    let whole = checkpoint::load_kept(ck, &|_, _| None).map_err(named);
    let first = |_: checkpoint::Part, _: &str| {
        Some(checkpoint::Want {
            shape: Vec::new(),
            region: checkpoint::region::Region::flat(1..3),
        })
    };
    let part = checkpoint::load_kept(ck, &first).map_err(named);
    let Some(all) = all else {
        return;
    };
    assert!(
        verified.is_ok(),
        "load accepts what verify refuses: {verified:?}"
    );
    let whole = whole.expect("load_kept refuses what load accepts");
    assert_eq!(
        (&whole.model, &whole.optimizer),
        (&all.model, &all.optimizer)
    );
    match part {
        Ok(p) => {
            for (t, a) in p
                .model
                .iter()
                .chain(&p.optimizer)
                .zip(all.model.iter().chain(&all.optimizer))
            {
                assert_eq!(t.values, a.values[1..3], "tensor {}", t.name);
            }
        }
        Err(msg) => assert!(msg.contains("elements 1..3"), "{msg}"),
    }
}

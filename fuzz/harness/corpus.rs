//! Runs a fuzz harness over every committed input of its target: the seed corpus
//! (`fuzz/corpus/<target>/`) and the crash regressions (`fuzz/regressions/<target>/`). Used
//! by the corpus tests of the crates that own the parsers (`tests/fuzz_corpus.rs`), so the
//! seeds and every past finding run in the ordinary `cargo test`, without cargo-fuzz.

#![allow(dead_code)] // each test binary uses only some of these helpers

use std::path::{Path, PathBuf};

/// The repository's `fuzz/` directory (the including crate sits in `crates/<name>/`).
pub fn fuzz_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fuzz")
}

fn files_in(dir: &Path) -> Vec<PathBuf> {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return Vec::new();
    };
    let mut files: Vec<PathBuf> = entries
        .filter_map(Result::ok)
        .map(|e| e.path())
        .filter(|p| p.is_file())
        .collect();
    files.sort();
    files
}

/// Feeds every seed and regression input of `target` to `run`; fails naming each input that
/// panicked. Returns how many inputs ran.
pub fn run_all(target: &str, run: fn(&[u8])) -> usize {
    let seeds = files_in(&fuzz_dir().join("corpus").join(target));
    assert!(!seeds.is_empty(), "no seed corpus in fuzz/corpus/{target}/");
    let regressions = files_in(&fuzz_dir().join("regressions").join(target));
    let mut failed = Vec::new();
    for file in seeds.iter().chain(&regressions) {
        let bytes = std::fs::read(file).expect("read a corpus file");
        if std::panic::catch_unwind(|| run(&bytes)).is_err() {
            failed.push(file.display().to_string());
        }
    }
    assert!(
        failed.is_empty(),
        "{target}: inputs that panicked: {failed:#?}"
    );
    seeds.len() + regressions.len()
}

/// The seeds that kiln's own writers produce for `target` must be in its corpus, byte for
/// byte, so that the corpus follows the formats. `KILN_WRITE_FUZZ_SEEDS=1` (re)writes them.
pub fn check_seeds(target: &str, seeds: &[(&str, Vec<u8>)]) {
    let dir = fuzz_dir().join("corpus").join(target);
    let write = std::env::var_os("KILN_WRITE_FUZZ_SEEDS").is_some();
    if write {
        std::fs::create_dir_all(&dir).expect("create the corpus directory");
    }
    for (name, bytes) in seeds {
        let path = dir.join(name);
        if write {
            std::fs::write(&path, bytes).expect("write a seed");
        }
        let on_disk = std::fs::read(&path).unwrap_or_default();
        assert!(
            on_disk == *bytes,
            "fuzz/corpus/{target}/{name} differs from what kiln writes now; regenerate the seeds with \
             KILN_WRITE_FUZZ_SEEDS=1 cargo test --release -p <crate> --test fuzz_corpus"
        );
    }
}

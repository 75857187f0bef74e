//! The fuzz targets of kiln-data's parsers, run over their committed seed corpora and crash
//! regressions (`fuzz/corpus/<target>/`, `fuzz/regressions/<target>/`) as ordinary tests: no
//! input may panic, and each parser gives a value or an error naming the file. The harnesses
//! are the fuzz targets' own (`fuzz/harness/`); `scripts/fuzz.sh` runs them under libFuzzer.

#[path = "../../../fuzz/harness/alloc_cap.rs"]
mod alloc_cap;
#[path = "../../../fuzz/harness/corpus.rs"]
mod corpus;
#[path = "../../../fuzz/harness/corpus_list.rs"]
mod corpus_list;
#[path = "../../../fuzz/harness/data_manifest.rs"]
mod data_manifest;
#[path = "../../../fuzz/harness/idx.rs"]
mod idx;
#[path = "../../../fuzz/harness/idx_bin.rs"]
mod idx_bin;

use kiln_data::indexed::{DType, IndexedDatasetBuilder, bin_path, idx_path};
use kiln_data::{Manifest, manifest};

/// Documents, each a list of sequences of token ids.
type Documents = Vec<Vec<Vec<u32>>>;

/// Datasets written by kiln's own writer: (name, dtype, documents).
fn datasets() -> Vec<(&'static str, DType, Documents)> {
    vec![
        (
            "u16-three-docs",
            DType::U16,
            vec![vec![vec![1, 2, 3]], vec![vec![4]], vec![vec![5, 6]]],
        ),
        (
            "i32-with-empty",
            DType::I32,
            vec![vec![vec![70000, 1]], vec![vec![]], vec![vec![9]]],
        ),
        (
            "u8-multi-seq-doc",
            DType::U8,
            vec![vec![vec![1, 2], vec![3]], vec![vec![4, 5, 6, 7]]],
        ),
        ("i64-one", DType::I64, vec![vec![vec![42; 5]]]),
        (
            "i16-i8",
            DType::I16,
            vec![vec![vec![300, 2]], vec![vec![1]]],
        ),
        (
            "i8-one",
            DType::I8,
            vec![vec![vec![1, 2, 3, 4, 5, 6, 7, 8, 9, 10]]],
        ),
        ("empty", DType::U16, vec![]),
    ]
}

/// `(.idx bytes, .bin bytes)` of each dataset of [`datasets`], as the builder writes them.
fn written() -> Vec<(&'static str, Vec<u8>, Vec<u8>)> {
    let dir = tempfile::tempdir().unwrap();
    datasets()
        .into_iter()
        .map(|(name, dtype, docs)| {
            let prefix = dir.path().join(name);
            let mut b = IndexedDatasetBuilder::create(&prefix, dtype).unwrap();
            for doc in docs {
                for seq in doc {
                    b.add_item(&seq).unwrap();
                }
                b.end_document();
            }
            b.finish().unwrap();
            let idx = std::fs::read(idx_path(&prefix)).unwrap();
            let bin = std::fs::read(bin_path(&prefix)).unwrap();
            (name, idx, bin)
        })
        .collect()
}

#[test]
fn idx_seeds_and_regressions() {
    let mut seeds: Vec<(&str, Vec<u8>)> = Vec::new();
    for (name, idx, _) in written() {
        seeds.push((name, idx));
    }
    // A multimodal index: one mode byte per sequence after the document index.
    let (_, mut idx, _) = written().remove(0);
    idx.extend_from_slice(&[0, 1, 0]);
    seeds.push(("u16-with-modes", idx));
    corpus::check_seeds("idx", &seeds);
    assert!(corpus::run_all("idx", idx::run) >= seeds.len());
}

#[test]
fn idx_bin_seeds_and_regressions() {
    let seeds: Vec<(&str, Vec<u8>)> = written()
        .into_iter()
        .map(|(name, idx, bin)| (name, [idx.as_slice(), idx_bin::SEP, &bin].concat()))
        .collect();
    corpus::check_seeds("idx_bin", &seeds);
    assert!(corpus::run_all("idx_bin", idx_bin::run) >= seeds.len());
}

#[test]
fn corpus_list_seeds_and_regressions() {
    assert!(corpus::run_all("corpus_list", corpus_list::run) >= 3);
}

#[test]
fn data_manifest_seeds_and_regressions() {
    let dir = tempfile::tempdir().unwrap();
    let mut prefixes = Vec::new();
    for (name, idx, bin) in written().into_iter().take(3) {
        let prefix = dir.path().join("shards").join(name);
        std::fs::create_dir_all(prefix.parent().unwrap()).unwrap();
        std::fs::write(idx_path(&prefix), idx).unwrap();
        std::fs::write(bin_path(&prefix), bin).unwrap();
        prefixes.push(prefix);
    }
    let mpath = manifest::default_path(&dir.path().join("list.txt"));
    Manifest::create(&prefixes, &mpath)
        .unwrap()
        .write(&mpath)
        .unwrap();
    // The dataset the harness verifies against: `a`, one document [1, 2, 3] in uint16.
    let dir2 = tempfile::tempdir().unwrap();
    let a = dir2.path().join("a");
    let mut b = IndexedDatasetBuilder::create(&a, DType::U16).unwrap();
    b.add_document(&[1, 2, 3]).unwrap();
    b.finish().unwrap();
    let m2 = dir2.path().join("fuzz.manifest.json");
    Manifest::create(std::slice::from_ref(&a), &m2)
        .unwrap()
        .write(&m2)
        .unwrap();
    let seeds = [
        ("three-shards", std::fs::read(&mpath).unwrap()),
        ("pins-the-harness-dataset", std::fs::read(&m2).unwrap()),
    ];
    corpus::check_seeds("data_manifest", &seeds);
    assert!(corpus::run_all("data_manifest", data_manifest::run) >= seeds.len());
}

/// Fuzz finding (idx_bin): `IndexedDataset::sequence` reserved the length the `.idx` claims
/// (up to 2^31 tokens, 8 GiB) before checking that the `.bin` holds it. This binary's
/// allocator aborts on any allocation over 256 MiB, so the old code fails here.
#[test]
fn fuzz_sequence_length_beyond_the_bin_allocates_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let prefix = dir.path().join("d");
    let mut b = IndexedDatasetBuilder::create(&prefix, DType::U16).unwrap();
    b.add_document(&[1, 2, 3]).unwrap();
    b.add_document(&[4]).unwrap();
    b.finish().unwrap();
    // Sequence 0 now claims i32::MAX tokens; the last sequence (what open checks) is intact.
    let mut idx = std::fs::read(idx_path(&prefix)).unwrap();
    idx[34..38].copy_from_slice(&i32::MAX.to_le_bytes());
    std::fs::write(idx_path(&prefix), idx).unwrap();
    let ds = kiln_data::IndexedDataset::open(&prefix).unwrap();
    let err = ds.sequence(0).unwrap_err().to_string();
    assert!(
        err.contains("d.bin") && err.contains("outside the file"),
        "{err}"
    );
    assert_eq!(ds.sequence(1).unwrap(), [4]);
}

//! Fuzz harness: a shard manifest (`LIST.manifest.json`, `kiln_data::Manifest`).
//!
//! A manifest that reads must write back and read again to the same value, and verifying a
//! real dataset against it must give a verdict, never a panic. Manifest paths are only
//! compared with the list's files, never opened.

use kiln_data::{DType, IndexedDatasetBuilder, Manifest, Verify};

pub fn run(data: &[u8]) {
    let dir = tempfile::tempdir().expect("temporary directory");
    let path = dir.path().join("fuzz.manifest.json");
    std::fs::write(&path, data).expect("write the input");
    let m = match Manifest::read(&path) {
        Ok(m) => m,
        Err(e) => {
            let msg = e.to_string();
            assert!(
                msg.contains("fuzz.manifest.json"),
                "error does not name the file: {msg}"
            );
            return;
        }
    };
    assert_eq!(m.version, 1);
    let again = dir.path().join("again.manifest.json");
    m.write(&again).expect("write back");
    assert_eq!(Manifest::read(&again).expect("read back"), m);

    let prefix = dir.path().join("a");
    let mut b = IndexedDatasetBuilder::create(&prefix, DType::U16).expect("builder");
    b.add_document(&[1, 2, 3]).expect("add");
    b.finish().expect("finish");
    for mode in [Verify::Off, Verify::Fast, Verify::Full] {
        if let Err(e) = m.verify(&path, std::slice::from_ref(&prefix), mode) {
            let msg = e.to_string();
            assert!(msg.contains("a.idx") || msg.contains("a.bin"), "{msg}");
        }
    }
}

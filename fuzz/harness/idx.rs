//! Fuzz harness: a Megatron `.idx` file on its own (`kiln_data::indexed::IndexFile`).
//!
//! The input is the file's bytes. Whatever they are, opening must return a value or an error
//! naming the file, never panic; an index that opens must claim no more than the file holds,
//! and every accessor within the counts it reports must work.

use kiln_data::indexed::IndexFile;

pub fn run(data: &[u8]) {
    let dir = tempfile::tempdir().expect("temporary directory");
    let path = dir.path().join("fuzz.idx");
    std::fs::write(&path, data).expect("write the input");
    let idx = match IndexFile::open(&path) {
        Ok(idx) => idx,
        Err(e) => {
            let msg = e.to_string();
            assert!(
                msg.contains("fuzz.idx"),
                "error does not name the file: {msg}"
            );
            return;
        }
    };
    // The counts were checked against the file size before anything was read.
    let need = 34 + 12 * idx.sequences() as u128 + 8 * (idx.documents() as u128 + 1);
    assert!(
        need <= data.len() as u128,
        "index claims {need} bytes, file has {}",
        data.len()
    );
    let mut sum = 0u64;
    let mut all_valid = true;
    for i in 0..idx.sequences() {
        let _ = idx.pointer(i);
        match idx.length(i) {
            Ok(l) => sum += u64::from(l),
            Err(e) => {
                assert!(e.to_string().contains("fuzz.idx"));
                all_valid = false;
            }
        }
    }
    for i in 0..=idx.documents() {
        let _ = idx.document_index(i);
    }
    match idx.check_all() {
        Ok(total) => {
            assert!(all_valid, "check_all accepted a negative length");
            assert_eq!(total, sum, "check_all's token total");
        }
        Err(e) => assert!(e.to_string().contains("fuzz.idx")),
    }
    if let Err(e) = idx.expected_bin_len() {
        assert!(e.to_string().contains("fuzz.idx"));
    }
}

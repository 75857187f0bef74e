//! Fuzz harness: a Megatron dataset as a pair, `PREFIX.idx` + `PREFIX.bin`, read the way the
//! loader reads it (`IndexedDataset::open`, every sequence, then the packed, shuffled
//! samples of `DatasetIndex`).
//!
//! The input is the `.idx` bytes, the separator [`SEP`], then the `.bin` bytes (no separator:
//! an empty `.bin`). The index may describe lengths and pointers that the `.bin` does not
//! hold: reads must be refused with an error, never go outside the `.bin`, never panic and
//! never allocate by a length the file does not back.

use kiln_data::index::DatasetIndex;
use kiln_data::indexed::IndexedDataset;

/// Separates the parts of a multi-file fuzz input.
pub const SEP: &[u8] = b"--KILN-FUZZ-PART--";

fn split2(data: &[u8]) -> (&[u8], &[u8]) {
    match data.windows(SEP.len()).position(|w| w == SEP) {
        Some(at) => (&data[..at], &data[at + SEP.len()..]),
        None => (data, &[]),
    }
}

pub fn run(data: &[u8]) {
    let (idx_bytes, bin_bytes) = split2(data);
    let dir = tempfile::tempdir().expect("temporary directory");
    let prefix = dir.path().join("fuzz");
    std::fs::write(dir.path().join("fuzz.idx"), idx_bytes).expect("write .idx");
    std::fs::write(dir.path().join("fuzz.bin"), bin_bytes).expect("write .bin");
    let ds = match IndexedDataset::open(&prefix) {
        Ok(ds) => ds,
        Err(e) => {
            let msg = e.to_string();
            assert!(msg.contains("fuzz."), "error does not name the file: {msg}");
            return;
        }
    };
    let size = ds.dtype().size();
    for seq in 0..ds.len() {
        match ds.sequence(seq) {
            Ok(tokens) => {
                let len = ds
                    .index()
                    .length(seq)
                    .expect("a read sequence has a length");
                assert_eq!(tokens.len(), len as usize);
                assert!(
                    tokens.len() * size <= bin_bytes.len(),
                    "read more than the .bin holds"
                );
            }
            Err(e) => assert!(e.to_string().contains("fuzz"), "{e}"),
        }
        let mut out = Vec::new();
        assert!(ds.read_into(seq, usize::MAX, 2, &mut out).is_err());
    }
    assert!(ds.sequence(ds.len()).is_err());

    // The loader's view: shuffled epochs packed into samples of seq_len + 1 tokens.
    let seq_len = 1 + (data.len() % 13) as u64;
    let samples = 24;
    let Ok((_, fp)) = kiln_data::fingerprint::sampled(&dir.path().join("fuzz.idx")) else {
        return;
    };
    let cache = dir.path().join("cache");
    std::fs::create_dir_all(&cache).expect("cache directory");
    let index = match DatasetIndex::open(ds, &fp, 7, seq_len, samples, &cache) {
        Ok(i) => i,
        Err(e) => {
            assert!(e.to_string().contains("fuzz"), "{e}");
            return;
        }
    };
    for j in 0..samples {
        let mut out = Vec::new();
        match index.sample_into(j, &mut out) {
            Ok(()) => assert_eq!(out.len() as u64, seq_len + 1, "sample {j}"),
            Err(e) => assert!(e.to_string().contains("fuzz"), "{e}"),
        }
    }
}

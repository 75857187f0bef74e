//! Fuzz harness: a corpus list (`weight prefix [corpus]` lines, `kiln_data::CorpusList`).
//!
//! A list that parses must have usable weights: finite, >= 0, and normalising to a
//! distribution (finite, summing to 1), since the blend is built from them.

use kiln_data::CorpusList;

pub fn run(data: &[u8]) {
    let dir = tempfile::tempdir().expect("temporary directory");
    let path = dir.path().join("fuzz-list.txt");
    std::fs::write(&path, data).expect("write the input");
    let list = match CorpusList::read(&path) {
        Ok(l) => l,
        Err(e) => {
            let msg = e.to_string();
            assert!(
                msg.contains("fuzz-list.txt"),
                "error does not name the file: {msg}"
            );
            return;
        }
    };
    assert!(!list.entries.is_empty());
    for e in &list.entries {
        assert!(
            e.weight.is_finite() && e.weight >= 0.0,
            "weight {}",
            e.weight
        );
        assert!(!e.key.is_empty());
        assert!(e.line >= 1);
        assert!(e.prefix.is_absolute() || e.prefix.starts_with(dir.path()));
    }
    let w = list.normalized_weights();
    assert!(
        w.iter().all(|x| x.is_finite() && *x >= 0.0),
        "normalised weights {w:?}"
    );
    let sum: f64 = w.iter().sum();
    assert!((sum - 1.0).abs() < 1e-6, "normalised weights sum to {sum}");
}

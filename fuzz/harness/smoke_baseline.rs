//! Fuzz harness: smoke-gate baselines (`kiln_gates::smoke::load`) and what `kiln smoke`
//! does with one: compare a run with it, diff the configs, write the report.
//!
//! A baseline that loads compares as identical with itself.

use kiln_gates::smoke::{self, Verdict};
use std::path::Path;

pub fn run(data: &[u8]) {
    let dir = tempfile::tempdir().expect("temporary directory");
    let path = dir.path().join("fuzz-baseline.json");
    std::fs::write(&path, data).expect("write the input");
    let base = match smoke::load(&path) {
        Ok(b) => b,
        Err(e) => {
            let msg = e.to_string();
            assert!(
                msg.contains("fuzz-baseline.json"),
                "error does not name the file: {msg}"
            );
            return;
        }
    };
    for r in &base.records {
        for bits in [&r.loss_bits, &r.grad_norm_bits] {
            let hex = bits
                .strip_prefix("0x")
                .expect("accepted bits start with 0x");
            assert!(
                hex.len() == 8 && hex.bytes().all(|b| b.is_ascii_hexdigit()),
                "accepted {bits:?} as f32 bits"
            );
        }
    }
    assert_eq!(
        smoke::compare(&base, &base, smoke::Setup::Same, 0.25),
        Verdict::Identical,
        "{base:?}"
    );
    let mut other = base.clone();
    other.config = "[training]\nsteps = 3\n".into();
    other.peak_rss_mib = 100.0;
    if let Some(r) = other.records.first_mut() {
        r.loss_bits = "0x3f800000".into();
    }
    for (a, b) in [(&base, &other), (&other, &base)] {
        for setup in [smoke::Setup::Same, smoke::Setup::Layout, smoke::Setup::Any] {
            let v = smoke::compare(a, b, setup, 0.25);
            let text = smoke::report(&v, a, b, Path::new("b.json"));
            assert!(text.starts_with("smoke: "), "{text}");
        }
    }
    let _ = smoke::config_differences(&base.config, &other.config);
}

//! The fuzz targets of kiln-gates' parsers (multiple-choice task files, smoke baselines), run
//! over their committed seed corpora and crash regressions (`fuzz/corpus/<target>/`,
//! `fuzz/regressions/<target>/`) as ordinary tests. The harnesses are the fuzz targets' own
//! (`fuzz/harness/`); `scripts/fuzz.sh` runs them under libFuzzer.

#[path = "../../../fuzz/harness/alloc_cap.rs"]
mod alloc_cap;
#[path = "../../../fuzz/harness/corpus.rs"]
mod corpus;
#[path = "../../../fuzz/harness/mc_tasks.rs"]
mod mc_tasks;
#[path = "../../../fuzz/harness/smoke_baseline.rs"]
mod smoke_baseline;

use kiln_gates::mc::{save_tasks, synthetic_copy_tasks};
use kiln_gates::smoke::{self, SmokeRun, StepRecord};

#[test]
fn mc_tasks_seeds_and_regressions() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("t.jsonl");
    save_tasks(&synthetic_copy_tasks(3, 1), &path).unwrap();
    let mut with_comment = b"# held-out copy tasks\n\n".to_vec();
    with_comment.extend(std::fs::read(&path).unwrap());
    let seeds = [
        ("synthetic-copy-3", std::fs::read(&path).unwrap()),
        ("comment-and-blank", with_comment),
    ];
    corpus::check_seeds("mc_tasks", &seeds);
    assert!(corpus::run_all("mc_tasks", mc_tasks::run) >= seeds.len());
}

#[test]
fn smoke_baseline_seeds_and_regressions() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("b.json");
    let record = |step: u64, loss: f32, grad: f32| StepRecord {
        step,
        loss_bits: format!("{:#010x}", loss.to_bits()),
        grad_norm_bits: format!("{:#010x}", grad.to_bits()),
        loss,
        grad_norm: grad,
    };
    let run = SmokeRun {
        format: smoke::FORMAT.into(),
        kiln_version: "0.1.0".into(),
        cpu: "x86_64 avx2".into(),
        steps: 2,
        config_sha256: "00".repeat(32),
        config: "[training]\nsteps = 2\nseed = 1\n\n[model]\nd_model = 16\n".into(),
        peak_rss_mib: 120.5,
        seconds: 0.25,
        records: vec![record(1, 4.6, 1.5), record(2, 4.4, 1.25)],
        tolerance: 0.0,
        ranks: 1,
    };
    smoke::save(&run, &path).unwrap();
    // (The corpus also holds a copy of the shipped gates/smoke-default.json.)
    let seeds = [("two-steps", std::fs::read(&path).unwrap())];
    corpus::check_seeds("smoke_baseline", &seeds);
    assert!(corpus::run_all("smoke_baseline", smoke_baseline::run) >= seeds.len());
}

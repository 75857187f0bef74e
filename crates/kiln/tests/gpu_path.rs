//! The GPU code path in CI: `kiln train` on burn's CubeCL backend running on CubeCL's CPU
//! runtime (`training.device = "cubecl-cpu"`, cargo feature `cubecl-cpu`; the same backend
//! code, with burn's generic ops on device tensors and CubeCL kernels compiled by LLVM,
//! that `cuda`/`rocm` run), checked against the same run on `flex`.
//!
//! Ignored by default: on this runtime every kernel with a cube barrier (burn's default
//! matmul, SimpleUnit, and the shared-sum reductions) runs one OS thread per unit of the
//! cube, spinning on a barrier, so a tiny-model step takes minutes on 2 cores (145-183 s
//! measured on a busy 2-core host) against 0.2 s on flex. Run it with
//! `cargo test --release -p kiln --features kiln/cubecl-cpu --test gpu_path -- --ignored`.
#![cfg(feature = "cubecl-cpu")]

use std::path::Path;
use std::time::Instant;

mod common;

const STEPS: u64 = 2;

/// (step, loss, step time, grad norm) of each step.
fn step_losses(run_dir: &Path) -> Vec<(u64, f64, f64, f64)> {
    std::fs::read_to_string(run_dir.join("metrics.jsonl"))
        .unwrap_or_default()
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter(|m| m.get("step_time_s").is_some())
        .map(|m| {
            (
                m["step"].as_u64().unwrap(),
                m["loss"].as_f64().unwrap(),
                m["step_time_s"].as_f64().unwrap(),
                m["grad_norm"].as_f64().unwrap(),
            )
        })
        .collect()
}

fn train(run_dir: &Path, device: &str) -> Vec<(u64, f64, f64, f64)> {
    let steps = format!("training.steps={STEPS}");
    let dev = format!("training.device={device}");
    let sets = [
        "training.batch_size=4",
        "training.threads=2",
        "checkpoint.interval=0",
        "eval.interval=0",
        "eval.samples=4",
        "lr_scheduler.warmup_steps=2",
        steps.as_str(),
        dev.as_str(),
    ];
    let t = Instant::now();
    let out = common::train_cmd(run_dir, &sets)
        .output()
        .expect("spawn kiln");
    assert!(
        out.status.success(),
        "kiln train on {device} failed: {}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    let losses = step_losses(run_dir);
    eprintln!(
        "{device}: {STEPS} steps in {:.1} s (process), step times {:?} s, grad norms {:?}",
        t.elapsed().as_secs_f64(),
        losses.iter().map(|l| l.2).collect::<Vec<_>>(),
        losses.iter().map(|l| l.3).collect::<Vec<_>>()
    );
    losses
}

#[test]
#[ignore = "minutes per step on CubeCL's CPU runtime (barrier kernels); run with --ignored"]
fn trains_on_cubecl_cpu_like_flex() {
    let tmp = tempfile::tempdir().unwrap();
    let flex = train(&tmp.path().join("flex"), "flex");
    let cube = train(&tmp.path().join("cubecl-cpu"), "cubecl-cpu");
    assert_eq!(cube.len(), STEPS as usize, "one metrics line per step");
    assert_eq!(flex.len(), cube.len());
    for ((s, lf, _, nf), (_, lc, _, nc)) in flex.iter().zip(&cube) {
        assert!(lc.is_finite(), "step {s}: loss {lc} on cubecl-cpu");
        // Same init, data and math; only the summation order differs.
        assert!(
            (lf - lc).abs() <= 1e-3 * lf.abs(),
            "step {s}: loss {lc} on cubecl-cpu vs {lf} on flex"
        );
        assert!(
            (nf - nc).abs() <= 1e-3 * nf.abs(),
            "step {s}: gradient norm {nc} on cubecl-cpu vs {nf} on flex"
        );
    }
    assert!(
        cube.last().unwrap().1 < cube[0].1,
        "loss did not fall on cubecl-cpu: {cube:?}"
    );
}

//! The in-run guards against injected faults (`debug.*`), with the real binary: each guard
//! fires, writes its event, and training recovers and finishes.

use std::path::Path;
use std::process::Output;

use crate::common;

use common::events;

/// Settings on top of the tiny model: a high LR, and guards that react within a short run.
const TINY: &[&str] = &[
    "training.batch_size=8",
    "training.steps=80",
    "training.threads=1",
    "optimizer.lr=1e-2",
    "checkpoint.interval=0",
    "eval.interval=0",
    "eval.samples=8",
    "lr_scheduler.kind=constant",
    "lr_scheduler.warmup_steps=5",
    "guards.spike_window=20",
    "guards.snapshot_interval=10",
    "guards.spike_skip_batches=5",
];

fn train(run_dir: &Path, extra: &[&str]) -> Output {
    let sets: Vec<&str> = TINY.iter().chain(extra).copied().collect();
    common::train_cmd(run_dir, &sets)
        .output()
        .expect("spawn kiln")
}

fn step_losses(run_dir: &Path) -> Vec<(u64, f64)> {
    std::fs::read_to_string(run_dir.join("metrics.jsonl"))
        .unwrap_or_default()
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter(|m| m.get("step_time_s").is_some())
        .map(|m| (m["step"].as_u64().unwrap(), m["loss"].as_f64().unwrap()))
        .collect()
}

fn assert_ok(out: &Output) {
    assert!(
        out.status.success(),
        "kiln train failed:\n{}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

#[test]
fn injected_nan_is_skipped_and_training_finishes() {
    let tmp = tempfile::tempdir().unwrap();
    let out = train(tmp.path(), &["debug.nan_at_step=12"]);
    assert_ok(&out);
    let ev = events(tmp.path());
    let skips: Vec<_> = ev
        .iter()
        .filter(|e| e["event"] == "nonfinite_skip")
        .collect();
    assert_eq!(skips.len(), 1, "{ev:?}");
    assert_eq!(skips[0]["step"], 11);
    // A NaN loss makes every gradient NaN: each parameter is named.
    let mut named: Vec<String> = serde_json::from_value(skips[0]["params"].clone()).unwrap();
    named.sort();
    let all = common::tensor_names(&tmp.path().join("model.safetensors"));
    assert_eq!(named, all);
    let losses = step_losses(tmp.path());
    assert_eq!(
        losses.last().unwrap().0,
        80,
        "the run must still complete all steps"
    );
    assert!(losses.iter().all(|(_, l)| l.is_finite()));
}

#[test]
fn loss_spike_rolls_back_skips_batches_and_loss_returns_to_its_curve() {
    let tmp = tempfile::tempdir().unwrap();
    let clean = tmp.path().join("clean");
    assert_ok(&train(&clean, &[]));
    let spiked = tmp.path().join("spiked");
    assert_ok(&train(&spiked, &["debug.spike_at_step=50"]));
    let ev = events(&spiked);
    let spike = ev
        .iter()
        .find(|e| e["event"] == "loss_spike")
        .expect("loss_spike event");
    assert_eq!(spike["step"], 50);
    let rollback = ev
        .iter()
        .find(|e| e["event"] == "rollback")
        .expect("rollback event");
    assert_eq!(rollback["reason"], "loss_spike");
    assert_eq!(
        rollback["to_step"], 40,
        "rolls back to the snapshot before the spike"
    );
    assert_eq!(rollback["skip_batches"], 5);
    // The spiking batch was never learned from: no logged step has the spike's loss...
    let spike_loss = spike["loss"].as_f64().unwrap();
    let losses = step_losses(&spiked);
    assert!(
        losses.iter().all(|(_, l)| *l < spike_loss * 0.8),
        "{losses:?}"
    );
    // ...and the run ends on the clean run's curve.
    let end = |l: &[(u64, f64)]| l.iter().rev().take(10).map(|x| x.1).sum::<f64>() / 10.0;
    let (a, b) = (end(&step_losses(&clean)), end(&losses));
    assert!((a - b).abs() / a < 0.1, "final loss {b} vs clean {a}");
    assert_eq!(losses.last().unwrap().0, 80);
}

#[test]
fn frozen_parameters_are_reported_by_name() {
    let tmp = tempfile::tempdir().unwrap();
    let out = train(
        tmp.path(),
        &[
            "debug.freeze_params=post_attention_layernorm",
            "guards.frozen_check_interval=20",
        ],
    );
    assert_ok(&out);
    let ev = events(tmp.path());
    let frozen = ev
        .iter()
        .find(|e| e["event"] == "frozen_params")
        .expect("frozen_params event");
    let names: Vec<&str> = frozen["params"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|v| v.as_str())
        .collect();
    assert_eq!(
        names,
        [
            "model.layers.0.post_attention_layernorm.weight",
            "model.layers.1.post_attention_layernorm.weight"
        ]
    );
    assert!(String::from_utf8_lossy(&out.stdout).contains("did not change"));
}

#[test]
fn first_step_loss_far_from_ln_vocab_stops_with_an_explanation() {
    let tmp = tempfile::tempdir().unwrap();
    // A broken init (std 3 instead of 0.02) makes the first loss far above ln(vocab).
    let out = train(
        tmp.path(),
        &["model.init_std=3.0", "model.scale_residual_init=false"],
    );
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("ln(vocab=16)") && err.contains("far above"),
        "{err}"
    );
    assert!(
        events(tmp.path())
            .iter()
            .any(|e| e["event"] == "initial_loss_error")
    );
}

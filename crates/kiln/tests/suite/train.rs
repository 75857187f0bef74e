//! End-to-end tests of `kiln train` with the real binary, real signals and real files:
//! exact resume after SIGKILL, fallback from a corrupt checkpoint, SIGTERM preemption, and
//! clear errors for bad configs.

use std::path::{Path, PathBuf};
use std::process::{Child, Command};
use std::time::{Duration, Instant};

use crate::common;

use common::KILN;
use common::events;

/// Settings on top of the tiny model: short runs with frequent checkpoints.
const TINY: &[&str] = &[
    "training.batch_size=4",
    "training.steps=30",
    "training.threads=1",
    "checkpoint.interval=5",
    "checkpoint.keep_latest_k=3",
    "eval.interval=0",
    "eval.samples=8",
    "lr_scheduler.warmup_steps=5",
];

fn train_cmd(run_dir: &Path, extra: &[&str]) -> Command {
    let sets: Vec<&str> = TINY.iter().chain(extra).copied().collect();
    common::train_cmd(run_dir, &sets)
}

fn run_to_end(run_dir: &Path, extra: &[&str]) -> std::process::Output {
    let out = train_cmd(run_dir, extra).output().expect("spawn kiln");
    assert!(
        out.status.success(),
        "kiln train failed: {}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

/// Spawns a training run and returns once it printed `step=<at least n>` and the note of
/// the checkpoint at or before it (written in the background).
fn spawn_until_step(run_dir: &Path, n: u64) -> Child {
    common::spawn_until(train_cmd(run_dir, &[]), n, Some(n / 5 * 5))
}

fn signal(child: &Child, sig: i32) {
    // SAFETY: kill(2) with a pid we own.
    let rc = unsafe { libc::kill(child.id() as i32, sig) };
    assert_eq!(rc, 0, "kill failed");
}

fn final_files(run_dir: &Path) -> (Vec<u8>, Vec<u8>, Vec<u8>) {
    let ck = run_dir.join("checkpoints/step-30");
    (
        std::fs::read(run_dir.join("model.safetensors")).expect("final model"),
        std::fs::read(ck.join("model.safetensors")).expect("checkpoint model"),
        std::fs::read(ck.join("optimizer.safetensors")).expect("checkpoint optimizer"),
    )
}

fn reference(tmp: &Path) -> PathBuf {
    let dir = tmp.join("uninterrupted");
    run_to_end(&dir, &[]);
    dir
}

/// The README's default run learns its task on flex (about 30 s on 2 cores): the bar the
/// device's run (`tests/gpu_path.rs`) is held to.
#[test]
fn the_default_run_learns_its_task() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("default");
    let out = common::default_run(&dir, tmp.path(), &[])
        .output()
        .expect("spawn kiln");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    common::assert_learnt_the_copy_task(&dir);
}

#[test]
fn sigkill_at_any_point_then_resume_is_bit_identical() {
    let tmp = tempfile::tempdir().unwrap();
    let reference = reference(tmp.path());
    let dir = tmp.path().join("killed");
    // Kill twice at different points (between and just after checkpoints), then finish.
    for at in [7, 18] {
        let mut child = spawn_until_step(&dir, at);
        signal(&child, libc::SIGKILL);
        let status = child.wait().unwrap();
        assert!(!status.success());
    }
    run_to_end(&dir, &[]);
    let resumes: Vec<u64> = events(&dir)
        .iter()
        .filter(|e| e["event"] == "resume")
        .map(|e| e["step"].as_u64().unwrap())
        .collect();
    assert_eq!(
        resumes.len(),
        2,
        "expected two resumes, events: {:?}",
        events(&dir)
    );
    assert!(resumes.iter().all(|&s| s > 0 && s < 30), "{resumes:?}");
    let (a, b) = (final_files(&reference), final_files(&dir));
    assert!(
        a.0 == b.0,
        "final model.safetensors differs after SIGKILL + resume"
    );
    assert!(a.1 == b.1, "checkpoint model differs");
    assert!(
        a.2 == b.2,
        "optimizer state differs: resume did not restore AdamW exactly"
    );
}

#[test]
fn corrupt_newest_checkpoint_is_rejected_and_the_previous_one_used() {
    let tmp = tempfile::tempdir().unwrap();
    let reference = reference(tmp.path());
    let dir = tmp.path().join("corrupt");
    run_to_end(&dir, &[]);
    // Corrupt the newest checkpoint's weights and tear the one before (no manifest).
    let newest = dir.join("checkpoints/step-30/model.safetensors");
    let mut bytes = std::fs::read(&newest).unwrap();
    let mid = bytes.len() / 2;
    bytes[mid] ^= 0xFF;
    std::fs::write(&newest, bytes).unwrap();
    std::fs::remove_file(dir.join("checkpoints/step-25/manifest.json")).unwrap();
    std::fs::remove_file(dir.join("model.safetensors")).unwrap();
    run_to_end(&dir, &[]);
    let ev = events(&dir);
    let rejected: Vec<&str> = ev
        .iter()
        .filter(|e| e["event"] == "checkpoint_rejected")
        .filter_map(|e| e["path"].as_str())
        .collect();
    assert!(
        rejected.iter().any(|p| p.ends_with("step-30")),
        "{rejected:?}"
    );
    assert!(
        rejected.iter().any(|p| p.ends_with("step-25")),
        "{rejected:?}"
    );
    let resume = ev
        .iter()
        .rev()
        .find(|e| e["event"] == "resume")
        .expect("resume event");
    assert_eq!(resume["step"], 20);
    assert!(
        final_files(&reference) == final_files(&dir),
        "result after fallback differs"
    );
}

#[test]
fn sigterm_finishes_the_step_saves_and_exits_preempted() {
    let tmp = tempfile::tempdir().unwrap();
    let reference = reference(tmp.path());
    let dir = tmp.path().join("term");
    let mut child = spawn_until_step(&dir, 8);
    let t0 = Instant::now();
    signal(&child, libc::SIGTERM);
    let status = child.wait().unwrap();
    assert_eq!(
        status.code(),
        Some(75),
        "SIGTERM must exit 75 (preempted, resumable)"
    );
    assert!(t0.elapsed() < Duration::from_secs(30));
    let ev = events(&dir);
    let sig = ev
        .iter()
        .find(|e| e["event"] == "signal")
        .expect("signal event");
    assert_eq!(sig["signal"], libc::SIGTERM);
    let step = sig["step"].as_u64().unwrap();
    assert!(
        dir.join(format!("checkpoints/step-{step}/manifest.json"))
            .exists()
    );
    assert!(
        ev.iter()
            .any(|e| e["event"] == "exit" && e["reason"] == "preempted")
    );
    run_to_end(&dir, &[]);
    assert!(
        final_files(&reference) == final_files(&dir),
        "result after SIGTERM + resume differs"
    );
}

#[test]
fn changed_model_shape_refuses_to_resume() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("shape");
    run_to_end(&dir, &["training.steps=5"]);
    let out = train_cmd(&dir, &["training.steps=10", "model.d_model=64"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("cannot resume") && err.contains("model shape"),
        "{err}"
    );
}

/// Issue 60: a start refused for a changed model key (exit 78) had already rewritten
/// `RUN/config.toml` with the refused settings, and `kiln export RUN` then wrote them beside
/// weights trained with others (rope_theta 500000 for a model trained at 10000). A refused
/// start changes nothing in the run directory's config, and export takes the trained one.
#[test]
fn a_refused_start_leaves_the_runs_config_as_it_was() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("run");
    run_to_end(&dir, &["training.steps=4"]);
    let before = std::fs::read(dir.join("config.toml")).unwrap();
    let out = train_cmd(&dir, &["training.steps=8", "model.rope_theta=500000"])
        .output()
        .unwrap();
    assert_eq!(
        out.status.code(),
        Some(78),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let after = std::fs::read(dir.join("config.toml")).unwrap();
    assert!(before == after, "the refused start rewrote config.toml");
    let hf = tmp.path().join("hf");
    let out = Command::new(KILN)
        .arg("export")
        .arg(&dir)
        .args(["--to", "hf"])
        .arg(&hf)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let json: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(hf.join("config.json")).unwrap()).unwrap();
    assert_eq!(json["rope_theta"].as_f64(), Some(10000.0), "{json}");
}

#[test]
fn bad_config_errors_name_the_problem() {
    let tmp = tempfile::tempdir().unwrap();
    let cfg = tmp.path().join("bad.toml");
    std::fs::write(&cfg, "[training]\nstepz = 10\n").unwrap();
    let out = Command::new(KILN)
        .args(["train"])
        .arg(&cfg)
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("stepz") && err.contains("bad.toml"), "{err}");

    let out = Command::new(KILN)
        .args(["train", "--set", "training.steps"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("section.key=value"));

    let out = Command::new(KILN)
        .args(["train", "/nonexistent/x.toml"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("/nonexistent/x.toml"));
}

#[test]
fn print_config_shows_effective_values() {
    let out = Command::new(KILN)
        .args(["train", "--print-config", "--set", "training.steps=77"])
        .output()
        .unwrap();
    assert!(out.status.success());
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("steps = 77"), "{text}");
    assert!(
        text.contains("[checkpoint]") && text.contains("keep_latest_k"),
        "{text}"
    );
}

/// Activation checkpointing recomputes each block in the backward pass and trains the same
/// bits as keeping its activations (and the SIGKILLed run with it resumes exactly).
#[test]
fn activation_checkpointing_trains_the_same_bits() {
    let tmp = tempfile::tempdir().unwrap();
    let kept = reference(tmp.path());
    let rd = tmp.path().join("recomputed");
    let out = run_to_end(&rd, &["training.activation_checkpointing=blocks"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(
        final_files(&kept).0,
        final_files(&rd).0,
        "the weights differ with activation checkpointing"
    );
    let bad = train_cmd(
        &tmp.path().join("bad"),
        &["training.activation_checkpointing=some"],
    )
    .output()
    .unwrap();
    assert_eq!(bad.status.code(), Some(78));
    let err = String::from_utf8_lossy(&bad.stderr);
    assert!(err.contains("activation_checkpointing"), "{err}");
}

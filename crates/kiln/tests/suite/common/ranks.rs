//! Jobs of several ranks over a real MPI: `kiln launch --mpi` of the tiny model, and what
//! their run directories hold (each step's metrics, events, final weights).

use std::path::Path;
use std::process::{Child, Command, Output};
use std::time::{Duration, Instant};

/// `kiln launch --mpi --np N -- kiln train` of the tiny model on run directory `rd`, with
/// `sets` on top.
pub fn launch(np: usize, rd: &Path, sets: &[&str]) -> Command {
    let mut cmd = Command::new(super::KILN);
    cmd.args([
        "launch",
        "--mpi",
        "--np",
        &np.to_string(),
        "--timeout",
        "120",
    ])
    .arg("--run-dir")
    .arg(rd)
    .args(["--", super::KILN, "train", "--no-progress-bar", "--run-dir"])
    .arg(rd);
    for s in super::TINY_MODEL.iter().chain(sets) {
        cmd.arg("--set").arg(s);
    }
    for v in [
        "PBS_JOBID",
        "SLURM_JOB_ID",
        "SLURM_JOBID",
        "RANK",
        "WORLD_SIZE",
        "LOCAL_RANK",
        "KILN_PROGRESS_DIR",
    ] {
        cmd.env_remove(v);
    }
    cmd
}

/// [`launch`], run to its end.
pub fn run(np: usize, rd: &Path, sets: &[&str]) -> Output {
    launch(np, rd, sets).output().expect("spawn kiln launch")
}

pub fn text(out: &Output) -> String {
    format!(
        "{}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

pub fn events(rd: &Path, source: &str) -> Vec<serde_json::Value> {
    let mut all = super::events(rd);
    all.retain(|e| e["source"] == source);
    all
}

pub fn step_lines(rd: &Path) -> Vec<serde_json::Value> {
    std::fs::read_to_string(rd.join("metrics.jsonl"))
        .unwrap_or_default()
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter(|m| m.get("step_time_s").is_some())
        .collect()
}

pub fn weights(rd: &Path) -> Vec<u8> {
    std::fs::read(rd.join("model.safetensors")).expect("final weights")
}

pub fn assert_ok(out: &Output) {
    assert_eq!(out.status.code(), Some(0), "{}", text(out));
}

/// Waits until the run's metrics reach `step`, then returns.
pub fn wait_for_step(rd: &Path, step: u64, child: &mut Child) {
    let t0 = Instant::now();
    loop {
        if step_lines(rd)
            .last()
            .and_then(|m| m["step"].as_u64())
            .is_some_and(|s| s >= step)
        {
            return;
        }
        if let Ok(Some(status)) = child.try_wait() {
            panic!("the job ended ({status}) before step {step}");
        }
        assert!(
            t0.elapsed() < Duration::from_secs(120),
            "never reached step {step}"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

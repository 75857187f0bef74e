//! Jobs of several ranks over a real MPI: `kiln launch --mpi` of the tiny model, and what
//! their run directories hold (each step's metrics, events, final weights).

use std::path::Path;
use std::process::{Child, Command, Output};
use std::time::{Duration, Instant};

/// `kiln launch --mpi --np N --timeout 120 --run-dir RD`, with none of a scheduler's or an
/// outer launcher's variables; the command to launch goes after it (`--`, ...).
pub fn launcher(np: usize, rd: &Path) -> Command {
    let mut cmd = Command::new(super::KILN);
    let np = np.to_string();
    cmd.args(["launch", "--mpi", "--np", &np, "--timeout", "120"])
        .arg("--run-dir")
        .arg(rd);
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

/// `kiln launch --mpi --np N -- kiln train` of the tiny model on run directory `rd`, with
/// `sets` on top.
pub fn launch(np: usize, rd: &Path, sets: &[&str]) -> Command {
    let mut cmd = launcher(np, rd);
    cmd.args(["--", super::KILN, "train", "--no-progress-bar", "--run-dir"])
        .arg(rd);
    for s in super::TINY_MODEL.iter().chain(sets) {
        cmd.arg("--set").arg(s);
    }
    cmd
}

/// A job (`launch` of a run directory) run to its end, then again with rank 1 SIGKILLed after
/// step 8's checkpoint, then the same command once more: it resumes once and ends with the
/// weights of the uninterrupted run, bit for bit.
pub fn kill_one_rank_then_resume(launch: &dyn Fn(&Path) -> Command) {
    let tmp = tempfile::tempdir().unwrap();
    let reference = tmp.path().join("reference");
    assert_ok(&launch(&reference).output().unwrap());
    let rd = tmp.path().join("killed");
    let mut job = launch(&rd)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    wait_for_step(&rd, 10, &mut job);
    let status = super::kill_rank_after_checkpoint(&rd, 8, 1, &mut job, Duration::from_secs(120));
    assert_ne!(status.code(), Some(0), "a killed rank fails the attempt");
    assert!(
        !rd.join("model.safetensors").exists(),
        "the job did not finish"
    );
    let out = launch(&rd).output().unwrap();
    assert_ok(&out);
    let resumed = events(&rd, "train")
        .into_iter()
        .filter(|e| e["event"] == "resume");
    assert_eq!(resumed.count(), 1, "{}", text(&out));
    assert_eq!(weights(&reference), weights(&rd), "resume is not exact");
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

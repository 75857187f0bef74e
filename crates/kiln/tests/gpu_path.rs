//! The GPU code path in CI: `kiln train` on burn's CubeCL backend running on CubeCL's CPU
//! runtime (`training.device = "cubecl-cpu"`, cargo feature `cubecl-cpu`; the same backend
//! code, with burn's generic ops on device tensors and CubeCL kernels compiled by LLVM,
//! that `cuda`/`rocm` run), checked against flex: the same losses and gradient norms, a
//! checkpoint moving between devices, bf16 compute on f32 masters, and two MPI ranks
//! (gradients staged through host memory), and exact resume after SIGKILL on that device (with the kernel choices kept in
//! the run directory). With `--features kiln/cuda` and two GPUs, the same two-rank check runs
//! on CUDA with the gradients averaged over NCCL.
//!
//! Slow by nature: on this runtime a process spends about a minute compiling its kernels
//! (LLVM) and timing burn's autotune candidates before its first step, and a tiny-model
//! step then takes seconds (kernels with a cube barrier run one spinning thread per unit),
//! so the runs here are a few steps each. Built only with `--features kiln/cubecl-cpu`.
#![cfg(feature = "cubecl-cpu")]

use std::path::Path;
use std::process::{Command, Output};
use std::time::Instant;

#[path = "suite/common/mod.rs"]
mod common;

/// A tiny run: batch 4, no eval, checkpoints every 2 steps; the guards that read the device
/// state (the rollback snapshot, the frozen-parameter check, the replica check) and the
/// memory-tier snapshots every 2 steps, so that each runs on device tensors (none of them
/// changes the numbers).
const SETS: &[&str] = &[
    "training.batch_size=4",
    "training.threads=2",
    "checkpoint.interval=2",
    "checkpoint.snapshot_interval=2",
    "guards.snapshot_interval=2",
    "guards.frozen_check_interval=2",
    "guards.replica_check_interval=2",
    "eval.interval=0",
    "eval.samples=4",
    "lr_scheduler.warmup_steps=2",
];

fn train(run_dir: &Path, device: &str, steps: u64) -> Command {
    let (steps, dev) = (
        format!("training.steps={steps}"),
        format!("training.device={device}"),
    );
    let mut sets = SETS.to_vec();
    sets.extend([steps.as_str(), dev.as_str()]);
    common::train_cmd(run_dir, &sets)
}

fn assert_ok(out: &Output, what: &str) {
    assert!(
        out.status.success(),
        "{what} failed: {}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Runs `cmd` to the end; prints how long it took.
fn run(mut cmd: Command, what: &str) {
    let t = Instant::now();
    let out = cmd.output().expect("spawn kiln");
    assert_ok(&out, what);
    eprintln!("{what}: {:.1} s", t.elapsed().as_secs_f64());
}

/// (step, loss, grad norm, step time) of each step line in metrics.jsonl.
fn steps(run_dir: &Path) -> Vec<(u64, f64, f64, f64)> {
    std::fs::read_to_string(run_dir.join("metrics.jsonl"))
        .unwrap_or_default()
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter(|m| m.get("step_time_s").is_some())
        .map(|m| {
            (
                m["step"].as_u64().unwrap(),
                m["loss"].as_f64().unwrap(),
                m["grad_norm"].as_f64().unwrap(),
                m["step_time_s"].as_f64().unwrap(),
            )
        })
        .collect()
}

/// Every step of `got` within `tol` (relative) of `want` in loss and gradient norm.
fn assert_close(got: &[(u64, f64, f64, f64)], want: &[(u64, f64, f64, f64)], tol: f64) {
    assert_eq!(got.len(), want.len(), "{got:?} vs {want:?}");
    for ((s, l, n, _), (_, lw, nw, _)) in got.iter().zip(want) {
        assert!(l.is_finite(), "step {s}: loss {l}");
        assert!(
            (l - lw).abs() <= tol * lw.abs(),
            "step {s}: loss {l} vs {lw}"
        );
        assert!(
            (n - nw).abs() <= tol * nw.abs(),
            "step {s}: grad norm {n} vs {nw}"
        );
    }
}

/// The tensors of a safetensors file: name -> (dtype, shape).
fn safetensors_header(path: &Path) -> Vec<(String, String, String)> {
    let bytes = bytes(path);
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let v: serde_json::Value = serde_json::from_slice(&bytes[8..8 + n]).unwrap();
    let mut out: Vec<_> = v
        .as_object()
        .unwrap()
        .iter()
        .filter(|(k, _)| *k != "__metadata__")
        .map(|(k, t)| (k.clone(), t["dtype"].to_string(), t["shape"].to_string()))
        .collect();
    out.sort();
    out
}

fn bytes(path: &Path) -> Vec<u8> {
    std::fs::read(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// Same init, data and math as flex; only the summation order differs, so losses and
/// gradient norms agree to 1e-3 (measured: 1e-7). A checkpoint written on flex resumes on
/// cubecl-cpu (same tensor names and dtypes) and goes on like the flex run.
#[test]
fn trains_like_flex_and_resumes_a_flex_checkpoint() {
    let tmp = tempfile::tempdir().unwrap();
    let (flex, cube, moved) = (
        tmp.path().join("flex"),
        tmp.path().join("cube"),
        tmp.path().join("moved"),
    );
    run(train(&flex, "flex", 4), "flex, 4 steps");
    run(train(&cube, "cubecl-cpu", 4), "cubecl-cpu, 4 steps");
    let cube_steps = steps(&cube);
    eprintln!("cubecl-cpu steps (step, loss, grad norm, s): {cube_steps:?}");
    assert_close(&cube_steps, &steps(&flex), 1e-3);
    // The checkpoint written from device tensors exports like flex's: the same tensors.
    let exported: Vec<_> = [&flex, &cube]
        .into_iter()
        .map(|rd| {
            let out = rd.join("hf");
            let o = Command::new(common::KILN)
                .arg("export")
                .arg(rd.join("checkpoints/step-4"))
                .args(["--to", "hf"])
                .arg(&out)
                .output()
                .unwrap();
            assert_ok(&o, "kiln export");
            safetensors_header(&out.join("model.safetensors"))
        })
        .collect();
    assert_eq!(
        exported[0], exported[1],
        "exported tensors: names, dtypes, shapes"
    );
    run(train(&moved, "flex", 2), "flex, 2 steps");
    run(
        train(&moved, "cubecl-cpu", 4),
        "cubecl-cpu, resumed from flex",
    );
    let resumed: Vec<_> = steps(&moved).into_iter().filter(|s| s.0 > 2).collect();
    assert_close(&resumed, &steps(&flex)[2..], 1e-3);
}

/// `training.dtype = "bf16"` (bf16 matmuls on f32 master weights) on the device trains like
/// it does on flex: losses and gradient norms within 1e-3 (measured: 4e-5, bf16 products
/// summed in another order).
#[test]
fn bf16_compute_on_f32_masters_trains_like_flex() {
    let tmp = tempfile::tempdir().unwrap();
    let (flex, cube) = (tmp.path().join("flex"), tmp.path().join("cube"));
    for (dir, device) in [(&flex, "flex"), (&cube, "cubecl-cpu")] {
        let mut cmd = train(dir, device, 4);
        cmd.args(["--set", "training.dtype=bf16"]);
        run(cmd, &format!("{device}, bf16, 4 steps"));
    }
    assert_close(&steps(&cube), &steps(&flex), 1e-3);
}

/// `kiln launch --mpi --np 2 -- kiln train` on cubecl-cpu for `steps` steps, each rank on half
/// of the tiny run's batch.
fn two_ranks(dir: &Path, steps: u64) -> Command {
    let mut cmd = common::kiln_cmd(&["launch", "--mpi", "--np", "2", "--timeout", "600"]);
    cmd.arg("--run-dir").arg(dir).args(["--", common::KILN]);
    cmd.args(train(dir, "cubecl-cpu", steps).get_args());
    cmd.args(["--set", "training.batch_size=2"]);
    cmd
}

/// Two MPI ranks on cubecl-cpu (gradients averaged through host memory), each on half of the
/// flex rank's batch (2 rows each: the same 4 samples a step), train the model one flex rank
/// trains: the same losses and gradient norms to float rounding. (Each rank once ran the
/// whole batch of 4, a global batch of 8 against flex's 4: the losses agreed but the
/// step-1 gradient norm was 0.797 against 1.005, the mean over twice the samples.)
///
/// And as on flex's data-parallel tests: rank 1 SIGKILLed after the step-2 checkpoint, then
/// the same command, resumes once and ends with the uninterrupted run's weights, to the byte.
#[test]
fn two_ranks_on_cubecl_cpu_match_one_flex_rank_and_resume_exactly() {
    let tmp = tempfile::tempdir().unwrap();
    let (flex, dp, killed) = (
        tmp.path().join("flex"),
        tmp.path().join("dp"),
        tmp.path().join("killed"),
    );
    run(train(&flex, "flex", 6), "flex, 6 steps");
    run(two_ranks(&dp, 6), "2 MPI ranks on cubecl-cpu, 6 steps");
    assert_close(&steps(&dp), &steps(&flex), 1e-3);

    let mut job = two_ranks(&killed, 6)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .expect("spawn kiln launch");
    let limit = std::time::Duration::from_secs(600);
    let status = common::kill_rank_after_checkpoint(&killed, 2, 1, &mut job, limit);
    assert!(!status.success(), "a killed rank fails the attempt");
    assert!(
        !killed.join("model.safetensors").exists(),
        "the job finished before the kill"
    );
    run(two_ranks(&killed, 6), "2 MPI ranks on cubecl-cpu, resumed");
    let resumes = kiln_run::read_events(&killed)
        .expect("events.jsonl")
        .into_iter()
        .filter(|e| e.source == "train" && e.event == "resume")
        .count();
    assert_eq!(resumes, 1, "one resume");
    assert!(
        bytes(&dp.join("model.safetensors")) == bytes(&killed.join("model.safetensors")),
        "2 ranks on cubecl-cpu: the weights differ after SIGKILL + resume"
    );
}

/// SIGKILL after the step-2 checkpoint, then the same command, ends with the same bytes as
/// the uninterrupted run on this device, as it does on flex. Autotune times candidate kernels
/// and keeps the fastest, so two processes may pick kernels with different summation orders
/// (this test failed under load for that reason); each rank's choices now persist in the run
/// directory (`device-cache-<R>.db`) and a resumed process reads them back. The killed run
/// starts from a copy of the uninterrupted run's cache, so the two compared runs use the same
/// kernels from step 1, and the resume must keep them.
#[test]
fn sigkill_and_resume_on_cubecl_cpu_is_bit_identical() {
    let tmp = tempfile::tempdir().unwrap();
    let (cube, killed) = (tmp.path().join("cube"), tmp.path().join("killed"));
    run(train(&cube, "cubecl-cpu", 4), "cubecl-cpu, 4 steps");
    std::fs::create_dir_all(&killed).unwrap();
    let caches: Vec<_> = std::fs::read_dir(&cube)
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .filter(|n| n.to_string_lossy().starts_with("device-cache-0.db"))
        .collect();
    assert!(!caches.is_empty(), "no device cache in {}", cube.display());
    for name in caches {
        std::fs::copy(cube.join(&name), killed.join(&name)).unwrap();
    }
    let mut child = common::spawn_until(train(&killed, "cubecl-cpu", 4), 3, Some(2));
    // SAFETY: kill(2) with a pid we own.
    assert_eq!(unsafe { libc::kill(child.id() as i32, libc::SIGKILL) }, 0);
    let _ = child.wait();
    run(train(&killed, "cubecl-cpu", 4), "cubecl-cpu, resumed");
    for file in [
        "model.safetensors",
        "checkpoints/step-4/optimizer.safetensors",
    ] {
        assert!(
            bytes(&cube.join(file)) == bytes(&killed.join(file)),
            "{file} differs after SIGKILL + resume on cubecl-cpu"
        );
    }
}

/// The smoke gate has a baseline per device: 10 steps of the tiny model on `cubecl-cpu`
/// against `gates/smoke-cubecl-cpu.json`, blessed there with a relative tolerance of 1e-4
/// (CubeCL compiles for the host's CPU features and tiles its CPU GEMM by the core count, and
/// burn autotunes reductions per process, so another machine may differ in the last bits;
/// flex differs from this runtime by about 1 ulp). flex's baselines compare bits. (The
/// default smoke model took 310 s for 10 steps on this runtime.)
#[test]
fn smoke_passes_against_the_devices_own_baseline() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let mut cmd = common::kiln_cmd(&["smoke", "--baseline", "gates/smoke-cubecl-cpu.json"]);
    cmd.current_dir(root);
    for set in common::TINY_MODEL
        .iter()
        .chain(&["training.batch_size=4", "training.device=cubecl-cpu"])
    {
        cmd.args(["--set", set]);
    }
    let t = Instant::now();
    let out = cmd.output().unwrap();
    assert_ok(&out, "kiln smoke on cubecl-cpu");
    let text = String::from_utf8_lossy(&out.stdout);
    eprintln!("{text} ({:.1} s)", t.elapsed().as_secs_f64());
    assert!(text.contains("smoke: PASS: 10 steps within 1e-4"), "{text}");
}

/// The CUDA GPUs this machine has (`nvidia-smi -L`), 0 without a driver.
#[cfg(feature = "cuda")]
fn cuda_gpus() -> usize {
    Command::new("nvidia-smi")
        .arg("-L")
        .output()
        .ok()
        .filter(|o| o.status.success())
        .map(|o| {
            String::from_utf8_lossy(&o.stdout)
                .lines()
                .filter(|l| l.starts_with("GPU "))
                .count()
        })
        .unwrap_or(0)
}

/// Two MPI ranks on CUDA, one GPU each (`kiln launch` sets `CUDA_VISIBLE_DEVICES`), average
/// their gradients on the devices over NCCL (the unique id broadcast over MPI) and train the
/// model one rank trains on half their batch each: the same losses and gradient norms to
/// float rounding. Needs two GPUs (NCCL refuses two ranks on one GPU): skipped, with the
/// reason printed, elsewhere, CI included.
#[cfg(feature = "cuda")]
#[test]
fn two_ranks_on_cuda_average_over_nccl_and_match_one_rank() {
    let gpus = cuda_gpus();
    if gpus < 2 {
        eprintln!("skipped: {gpus} CUDA GPU(s) here (nvidia-smi -L); NCCL needs one per rank");
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let (one, dp) = (tmp.path().join("one"), tmp.path().join("dp"));
    run(train(&one, "cuda", 4), "cuda, 1 rank, 4 steps");
    let mut cmd = common::kiln_cmd(&["launch", "--mpi", "--np", "2", "--timeout", "600"]);
    cmd.arg("--run-dir").arg(&dp).args(["--", common::KILN]);
    cmd.args(train(&dp, "cuda", 4).get_args());
    cmd.args(["--set", "training.batch_size=2"])
        .env("KILN_LOG", "info");
    let out = cmd.output().expect("spawn kiln");
    assert_ok(&out, "2 MPI ranks on cuda");
    let log = String::from_utf8_lossy(&out.stderr);
    assert!(log.contains("over NCCL"), "NCCL was not used:\n{log}");
    assert_close(&steps(&dp), &steps(&one), 1e-3);
}

/// The README's default model and run (`kiln train` on the built-in copy task) on the device
/// reaches flex's bar (`common::assert_learnt_the_copy_task`; flex's own run, 500 steps, is
/// `tests/train.rs`), in 300 steps rather than 500: CI's whole run must stay under 45 minutes
/// and this one took 7 of them at 500. Seed 1234 here: accuracy 1.000 from step 200 on,
/// held-out loss 1.0547 at step 200 and 1.0488 at 300 (1.0444 at 500). About 5 minutes on 2
/// cores.
///
/// And no matrix product of the training step is autotuned on this runtime (CubeCL's decision
/// log, `cubecl.toml` in the working directory, holds no matmul): before, two candidates were
/// close in time for these shapes and fresh processes of one command came out with two
/// pick-sets (5:2 in 7 runs, different bits from step 4). The projections and the output head
/// now take a kernel fixed in advance there (`kernels/device/matmul.rs`), so the run has
/// the same bits every time on a machine. (At the old default LR of 3e-3 the task was learnt
/// late or not at all for some seeds, on flex too, and seed 1234 on this device did not learn
/// it by step 500 with two of three kernel choices: see `OptimizerConfig::default`.)
#[test]
fn the_default_run_learns_its_task_on_the_device() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("default");
    let decisions = tmp.path().join("autotune.jsonl");
    let config = format!(
        "[autotune.decisions]\nfile = {:?}\n",
        decisions.display().to_string()
    );
    std::fs::write(tmp.path().join("cubecl.toml"), config).unwrap();
    let sets = ["training.device=cubecl-cpu", "training.steps=300"];
    let cmd = common::default_run(&dir, tmp.path(), &sets);
    run(cmd, "the default run on cubecl-cpu");
    common::assert_learnt_the_copy_task(&dir);
    // Each line a decision with its key: a matmul's key has its problem `definition`.
    let log = std::fs::read_to_string(&decisions).expect("CubeCL wrote its decision log");
    let tuned: Vec<&str> = log
        .lines()
        .filter(|l| l.contains("\"definition\""))
        .collect();
    assert!(
        log.lines().count() > 0,
        "no autotune decisions logged at all"
    );
    assert!(
        tuned.is_empty(),
        "matmuls autotuned on cubecl-cpu: {tuned:?}"
    );
}

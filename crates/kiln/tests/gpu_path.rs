//! The GPU code path in CI: `kiln train` on burn's CubeCL backend running on CubeCL's CPU
//! runtime (`training.device = "cubecl-cpu"`, cargo feature `cubecl-cpu`; the same backend
//! code, with burn's generic ops on device tensors and CubeCL kernels compiled by LLVM,
//! that `cuda`/`rocm` run), checked against flex: the same losses and gradient norms, a
//! checkpoint moving between devices, bf16 compute on f32 masters, and two MPI ranks
//! (gradients staged through host memory), every sharding mode on two ranks (host-staged, and
//! the device-buffer collectives NCCL runs, over MPI), checkpoints moving between devices in
//! sharded runs, and exact resume after SIGKILL on that device (with the kernel choices kept
//! in the run directory). With `--features kiln/cuda` and a CUDA GPU, NCCL on 2 and 4 ranks
//! (one GPU: each rank an NCCL host of its own) for every mode.
//!
//! Slow by nature: on this runtime a process spends about a minute compiling its kernels
//! (LLVM) and timing burn's autotune candidates before its first step, and a tiny-model
//! step then takes seconds (kernels with a cube barrier run one spinning thread per unit),
//! so the runs here are a few steps each. Built only with `--features kiln/cubecl-cpu`.
#![cfg(feature = "cubecl-cpu")]

use std::path::{Path, PathBuf};
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

/// The largest relative difference in loss or gradient norm between the steps of `got`
/// and `want` (the same steps).
fn worst(got: &[(u64, f64, f64, f64)], want: &[(u64, f64, f64, f64)]) -> f64 {
    got.iter()
        .zip(want)
        .map(|((_, l, n, _), (_, lw, nw, _))| {
            ((l - lw).abs() / lw.abs()).max((n - nw).abs() / nw.abs())
        })
        .fold(0.0, f64::max)
}

/// Copies rank 0's device cache of run directory `from` (CubeCL's compiled kernels and
/// autotune decisions) to `to` as the cache of each of `ranks` ranks, so that a process
/// starting there does not compile again (about a minute a process on this runtime).
fn seed_caches(from: &Path, to: &Path, ranks: usize) {
    std::fs::create_dir_all(to).unwrap();
    for e in std::fs::read_dir(from).unwrap() {
        let name = e.unwrap().file_name().to_string_lossy().into_owned();
        let Some(tail) = name.strip_prefix("device-cache-0.db") else {
            continue;
        };
        for r in 0..ranks {
            let dest = to.join(format!("device-cache-{r}.db{tail}"));
            std::fs::copy(from.join(&name), dest).unwrap();
        }
    }
}

/// Copies every rank's device cache of run directory `from` to `to`, each as its own rank's.
fn copy_caches(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for e in std::fs::read_dir(from).unwrap() {
        let name = e.unwrap().file_name();
        if name.to_string_lossy().starts_with("device-cache-") {
            std::fs::copy(from.join(&name), to.join(&name)).unwrap();
        }
    }
}

/// `two_ranks` with `parallelism.shard = mode` and `sets`, on `device`.
fn sharded(dir: &Path, steps: u64, mode: &str, device: &str, sets: &[&str]) -> Command {
    let mut cmd = common::kiln_cmd(&["launch", "--mpi", "--np", "2", "--timeout", "600"]);
    cmd.arg("--run-dir").arg(dir).args(["--", common::KILN]);
    cmd.args(train(dir, device, steps).get_args());
    cmd.args(["--set", "training.batch_size=2"])
        .args(["--set", &format!("parallelism.shard={mode}")]);
    for s in sets {
        cmd.args(["--set", s]);
    }
    cmd
}

/// Tensor parallelism on the device: two MPI ranks on cubecl-cpu with `parallelism.tp = 2`
/// (the tiny model's 2 query heads cut one a rank, its one K/V head whole on each, the
/// embedding and the head by the vocabulary; the model's collectives staged through host
/// memory) train the model one flex rank trains on the same batch: losses and gradient norms
/// within 1e-3 relative each step, as the data-parallel runs above; and the TP checkpoint
/// resumes on one flex rank.
#[test]
fn tensor_parallel_on_cubecl_cpu_trains_like_one_flex_rank() {
    let tmp = tempfile::tempdir().unwrap();
    let (flex, tp) = (tmp.path().join("flex"), tmp.path().join("tp"));
    run(train(&flex, "flex", 4), "flex, 4 steps");
    let mut cmd = common::kiln_cmd(&["launch", "--mpi", "--np", "2", "--timeout", "600"]);
    cmd.arg("--run-dir").arg(&tp).args(["--", common::KILN]);
    cmd.args(train(&tp, "cubecl-cpu", 4).get_args());
    cmd.args(["--set", "parallelism.tp=2"]);
    run(cmd, "tp = 2 on cubecl-cpu, 4 steps");
    assert_close(&steps(&tp), &steps(&flex), 1e-3);
    // Its step-2 checkpoint (pieces named by their boxes) resumes on one flex rank.
    let moved = tmp.path().join("moved");
    std::fs::create_dir_all(moved.join("checkpoints")).unwrap();
    let from = tp.join("checkpoints/step-2");
    let to = moved.join("checkpoints/step-2");
    std::fs::create_dir_all(&to).unwrap();
    for e in std::fs::read_dir(&from).unwrap() {
        let name = e.unwrap().file_name();
        std::fs::copy(from.join(&name), to.join(&name)).unwrap();
    }
    run(
        train(&moved, "flex", 4),
        "the tp checkpoint resumed on flex",
    );
    let (got, want) = (steps(&moved), steps(&flex));
    assert_close(&got, &want[2..], 1e-3);
}

/// `parallelism.collectives = "device"` on `cmd` (a trainer's command line, last): the device-buffer collectives NCCL runs (packing
/// into flat device buffers, reduce-scatter and all-gather results cut into views), with
/// each flat buffer staged through host MPI instead of NCCL.
fn on_device_buffers(mut cmd: Command) -> Command {
    cmd.args(["--set", "parallelism.collectives=device"]);
    cmd
}

/// Two MPI ranks on cubecl-cpu in every sharding mode train the model one flex rank trains
/// on their whole batch: losses and gradient norms within 1e-3 relative each step (the
/// two-rank replicated test's tolerance; the reduction order differs, and flex differs from
/// this runtime by about 1 ulp). Optimizer state and parameters + activation checkpointing
/// (which a parameter-sharded pass does already: the key must change nothing) run the
/// host-staged collectives that flex runs; gradients and parameters run the device-buffer
/// collectives of the NCCL path over MPI (`parallelism.collectives = "device"`). Then:
/// - a parameter-sharded checkpoint written on this device resumes on one flex rank,
///   replicated, and goes on like the flex run (steps 3 and 4 within 1e-3);
/// - a flex checkpoint of two gradient-sharded ranks resumes on this device with parameters
///   sharded, likewise;
/// - rank 1 of a gradient-sharded run SIGKILLed after the step-2 checkpoint, then the same
///   command, ends with the uninterrupted run's weights and optimizer shards, to the byte.
///
/// Each run after the first starts from the first one's device cache, so that only one
/// compiles CubeCL's kernels (see `seed_caches`).
#[test]
fn sharded_modes_on_cubecl_cpu_match_one_flex_rank_move_between_devices_and_resume_exactly() {
    let t0 = Instant::now();
    let tmp = tempfile::tempdir().unwrap();
    let dir = |name: &str| tmp.path().join(name);
    let flex = dir("flex");
    run(train(&flex, "flex", 4), "flex, 4 steps");
    let want = steps(&flex);
    // Steps `from + 1 ..= to` of run directory `d` against the flex run's.
    let check = |d: &Path, what: &str, from: usize, to: usize| {
        let got: Vec<_> = (steps(d).into_iter())
            .filter(|s| s.0 > from as u64)
            .collect();
        let want = &want[from..to];
        eprintln!(
            "{what}: worst relative difference {:.1e}",
            worst(&got, want)
        );
        assert_close(&got, want, 1e-3);
    };
    let first = dir("optimizer");
    run(
        sharded(&first, 4, "optimizer", "cubecl-cpu", &[]),
        "optimizer sharded",
    );
    check(&first, "optimizer sharded, host-staged", 0, 4);
    let cases: [(&str, &str, &[&str], bool); 2] = [
        ("gradients", "gradients", &[], true),
        (
            "parameters-ac",
            "parameters",
            &["training.activation_checkpointing=blocks"],
            false,
        ),
    ];
    for (name, mode, sets, device) in cases {
        let d = dir(name);
        seed_caches(&first, &d, 2);
        let cmd = sharded(&d, 4, mode, "cubecl-cpu", sets);
        let cmd = if device { on_device_buffers(cmd) } else { cmd };
        run(cmd, name);
        check(&d, name, 0, 4);
    }
    // Parameters sharded on the device buffers for 2 steps, resumed on one flex rank.
    let to_flex = dir("to-flex");
    seed_caches(&first, &to_flex, 2);
    let cmd = on_device_buffers(sharded(&to_flex, 2, "parameters", "cubecl-cpu", &[]));
    run(cmd, "parameters sharded, device buffers, 2 steps");
    check(&to_flex, "parameters sharded, device buffers", 0, 2);
    run(train(&to_flex, "flex", 4), "resumed on one flex rank");
    check(
        &to_flex,
        "cubecl-cpu parameter shards resumed on flex",
        2,
        4,
    );
    // Two flex ranks with gradients sharded, resumed on the device with parameters sharded.
    let from_flex = dir("from-flex");
    run(
        sharded(&from_flex, 2, "gradients", "flex", &[]),
        "flex, gradients sharded, 2 steps",
    );
    seed_caches(&first, &from_flex, 2);
    let cmd = on_device_buffers(sharded(&from_flex, 4, "parameters", "cubecl-cpu", &[]));
    run(cmd, "resumed on cubecl-cpu, parameters sharded");
    check(
        &from_flex,
        "flex gradient shards resumed on cubecl-cpu",
        2,
        4,
    );
    // SIGKILL and resume of the gradient-sharded run, from its caches (each rank its own).
    let (whole, killed) = (dir("gradients"), dir("killed"));
    copy_caches(&whole, &killed);
    let mut job = on_device_buffers(sharded(&killed, 4, "gradients", "cubecl-cpu", &[]))
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .expect("spawn kiln launch");
    let limit = std::time::Duration::from_secs(600);
    let status = common::kill_rank_after_checkpoint(&killed, 2, 1, &mut job, limit);
    assert!(!status.success(), "a killed rank fails the attempt");
    let cmd = on_device_buffers(sharded(&killed, 4, "gradients", "cubecl-cpu", &[]));
    run(cmd, "gradients sharded, resumed after SIGKILL");
    for file in [
        "model.safetensors",
        "checkpoints/step-4/optimizer-00000-of-00002.safetensors",
        "checkpoints/step-4/optimizer-00001-of-00002.safetensors",
    ] {
        assert!(
            bytes(&whole.join(file)) == bytes(&killed.join(file)),
            "{file} differs after SIGKILL + resume (gradients sharded, device buffers)"
        );
    }
    eprintln!(
        "sharded modes on cubecl-cpu: {:.0} s",
        t0.elapsed().as_secs_f64()
    );
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

/// `kiln launch --mpi --np RANKS -- kiln train` on CUDA for `steps` steps, the tiny run's
/// batch of 4 split over the ranks, with `parallelism.shard = mode`; where the machine has
/// fewer GPUs than ranks, each rank is an NCCL host of its own (`KILN_NCCL_RANKS_AS_HOSTS`:
/// NCCL's socket transport over loopback, so that several ranks share a GPU).
#[cfg(feature = "cuda")]
fn cuda_ranks(dir: &Path, ranks: usize, steps: u64, mode: &str) -> Command {
    let np = ranks.to_string();
    let mut cmd = common::kiln_cmd(&["launch", "--mpi", "--np", &np, "--timeout", "600"]);
    cmd.arg("--run-dir").arg(dir).args(["--", common::KILN]);
    cmd.args(train(dir, "cuda", steps).get_args());
    cmd.args(["--set", &format!("training.batch_size={}", 4 / ranks)])
        .args(["--set", &format!("parallelism.shard={mode}")])
        .env("KILN_LOG", "info");
    if cuda_gpus() < ranks {
        cmd.env("KILN_NCCL_RANKS_AS_HOSTS", "1");
    }
    cmd
}

/// NCCL on CUDA, 2 and 4 ranks (on one GPU: each rank its own NCCL host), for replicated
/// training and every sharding mode: each trains the model one CUDA rank trains on their
/// whole batch (losses and gradient norms within 1e-3 relative, the tolerance of the
/// host-staged two-rank test above), NCCL's results agree with the host-staged path's
/// (`parallelism.collectives = "host"`, the same run otherwise) within 1e-4 relative, and a
/// parameter-sharded run SIGKILLed after its step-2 checkpoint and resumed ends with the
/// uninterrupted run's bytes. Skipped, with the reason printed, without a CUDA GPU (CI).
///
/// Every run starts from the one-rank run's device cache (compiled kernels, autotune
/// decisions), so that no process compiles again: about 10 s a launch instead of 70.
#[cfg(feature = "cuda")]
#[test]
fn nccl_on_cuda_trains_every_mode_like_one_rank_and_like_the_host_path() {
    let gpus = cuda_gpus();
    if gpus == 0 {
        eprintln!("skipped: no CUDA GPU here (nvidia-smi -L); NCCL needs one");
        return;
    }
    let t0 = Instant::now();
    let tmp = tempfile::tempdir().unwrap();
    let one = tmp.path().join("one");
    run(train(&one, "cuda", 4), "cuda, 1 rank, 4 steps");
    let want = steps(&one);
    let cases: &[(usize, &str)] = &[
        (2, "parameters"),
        (2, "none"),
        (2, "gradients"),
        (2, "optimizer"),
        (4, "parameters"),
        (4, "none"),
    ];
    for &(ranks, mode) in cases {
        let dir = tmp.path().join(format!("{mode}-{ranks}"));
        seed_caches(&one, &dir, ranks);
        let t = Instant::now();
        let out = cuda_ranks(&dir, ranks, 4, mode)
            .output()
            .expect("spawn kiln");
        assert_ok(&out, &format!("{ranks} ranks on cuda, {mode}"));
        let log = String::from_utf8_lossy(&out.stderr);
        assert!(log.contains("over NCCL"), "NCCL was not used:\n{log}");
        let got = steps(&dir);
        eprintln!(
            "{ranks} ranks, {mode}: {:.1} s, worst relative difference to 1 rank {:.1e}",
            t.elapsed().as_secs_f64(),
            worst(&got, &want)
        );
        assert_close(&got, &want, 1e-3);
        if ranks == 2 && matches!(mode, "parameters" | "gradients") {
            let host = tmp.path().join(format!("{mode}-{ranks}-host"));
            seed_caches(&one, &host, ranks);
            let mut cmd = cuda_ranks(&host, ranks, 4, mode);
            cmd.args(["--set", "parallelism.collectives=host"]);
            run(cmd, &format!("{ranks} ranks on cuda, {mode}, host-staged"));
            let staged = steps(&host);
            eprintln!(
                "{ranks} ranks, {mode}: NCCL against host-staged MPI {:.1e}",
                worst(&got, &staged)
            );
            assert_close(&got, &staged, 1e-4);
        }
    }
    // SIGKILL of rank 1 after the step-2 checkpoint, then the same command: the bytes of the
    // uninterrupted run (which ran with the same caches).
    let whole = tmp.path().join("parameters-2");
    let killed = tmp.path().join("killed");
    copy_caches(&whole, &killed);
    let mut job = cuda_ranks(&killed, 2, 4, "parameters")
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .expect("spawn kiln launch");
    let limit = std::time::Duration::from_secs(300);
    let status = common::kill_rank_after_checkpoint(&killed, 2, 1, &mut job, limit);
    assert!(!status.success(), "a killed rank fails the attempt");
    run(
        cuda_ranks(&killed, 2, 4, "parameters"),
        "2 ranks on cuda, resumed",
    );
    assert!(
        bytes(&whole.join("model.safetensors")) == bytes(&killed.join("model.safetensors")),
        "NCCL, parameters sharded: the weights differ after SIGKILL + resume"
    );
    eprintln!(
        "NCCL tests on {gpus} GPU(s): {:.0} s",
        t0.elapsed().as_secs_f64()
    );
}

/// The README's default run (`kiln train` on the built-in copy task) on `cubecl-cpu` for
/// `steps` steps, with CubeCL's autotune decisions logged (`cubecl.toml` in the working
/// directory). Returns the temporary directory, the run directory and the decision log.
fn default_run_on_the_device(steps: u64) -> (tempfile::TempDir, PathBuf, String) {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("default");
    let decisions = tmp.path().join("autotune.jsonl");
    let config = format!(
        "[autotune.decisions]\nfile = {:?}\n",
        decisions.display().to_string()
    );
    std::fs::write(tmp.path().join("cubecl.toml"), config).unwrap();
    let steps = format!("training.steps={steps}");
    let sets = ["training.device=cubecl-cpu", steps.as_str()];
    let cmd = common::default_run(&dir, tmp.path(), &sets);
    run(cmd, "the default run on cubecl-cpu");
    let log = std::fs::read_to_string(&decisions).expect("CubeCL wrote its decision log");
    (tmp, dir, log)
}

/// No matrix product of the default run's training step is autotuned on this runtime
/// (CubeCL's decision log holds no matmul): before, two candidates were close in time for
/// these shapes and fresh processes of one command came out with two pick-sets (5:2 in 7
/// runs, different bits from step 4). The projections and the output head now take a kernel
/// fixed in advance there (`kernels/device/matmul.rs`), so the run has the same bits every
/// time on a machine. 20 steps: every kernel of the step and of the eval is chosen by then.
#[test]
fn the_default_run_autotunes_no_matrix_product_on_the_device() {
    let (_tmp, dir, log) = default_run_on_the_device(20);
    let last = steps(&dir).last().map(|s| s.0);
    assert_eq!(last, Some(20), "the run trained 20 steps");
    // Each line a decision with its key: a matmul's key has its problem `definition`.
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

/// The default run on the device reaches flex's bar (`common::assert_learnt_the_copy_task`;
/// flex's own run, 500 steps, is the suite's `train::the_default_run_learns_its_task`) in 300
/// steps. Seed 1234 here: accuracy 1.000 from step 200 on, held-out loss 1.0547 at step 200
/// and 1.0488 at 300 (1.0444 at 500). About 5 minutes on 2 cores, 82% of this file's run in
/// CI, so behind `--ignored` (docs/testing.md): the device's numerics are held to flex's
/// step by step by the tests above, and flex's run learns the task in the suite. (At the old
/// default LR of 3e-3 the task was learnt late or not at all for some seeds, on flex too,
/// and seed 1234 on this device did not learn it by step 500 with two of three kernel
/// choices: see `OptimizerConfig::default`.)
#[test]
#[ignore = "5 minutes: run with --ignored (docs/testing.md)"]
fn the_default_run_learns_its_task_on_the_device() {
    let (_tmp, dir, _) = default_run_on_the_device(300);
    common::assert_learnt_the_copy_task(&dir);
}

//! Data-parallel training over a real MPI (Debian's OpenMPI, installed by `.ci/run`), with
//! the real binary started by `kiln launch --mpi` and real signals: one model trained by N
//! ranks, exact repeatability and resume, agreed preemption, resize, and replica checks.
//!
//! Needs a kiln built with `--features mpi` (the README's test command builds it so); without
//! the feature only the last test runs, which checks the error such a kiln gives.

#![cfg_attr(not(feature = "mpi"), allow(dead_code, unused_imports))]

use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};

use crate::common;
use crate::common::ranks::{self, assert_ok, events, step_lines, text, wait_for_step, weights};

/// Short runs of the tiny model; every rank one thread.
const DP: &[&str] = &[
    "training.batch_size=2",
    "training.threads=1",
    "training.compute_shards=1",
    "training.steps=24",
    "checkpoint.interval=4",
    "eval.interval=0",
    "eval.samples=8",
    "lr_scheduler.warmup_steps=4",
    "guards.replica_check_interval=4",
];

/// `kiln launch --mpi --np N -- kiln train` of the tiny model with [`DP`] and `sets` on top.
fn launch(np: usize, rd: &Path, sets: &[&str]) -> Command {
    ranks::launch(np, rd, &[DP, sets].concat())
}

fn run(np: usize, rd: &Path, sets: &[&str]) -> Output {
    launch(np, rd, sets).output().expect("spawn kiln launch")
}

#[cfg(feature = "mpi")]
fn reference(tmp: &Path, np: usize) -> PathBuf {
    let rd = tmp.join(format!("reference-{np}"));
    assert_ok(&run(np, &rd, &[]));
    rd
}

#[cfg(feature = "mpi")]
#[test]
fn two_ranks_train_one_model_with_global_metrics_and_one_writer() {
    let tmp = tempfile::tempdir().unwrap();
    let rd = reference(tmp.path(), 2);
    let start = events(&rd, "train")
        .into_iter()
        .find(|e| e["event"] == "start")
        .unwrap();
    assert_eq!(start["ranks"], 2);
    assert_eq!(start["global_batch"], 4, "2 ranks x batch 2");
    assert!(start["engine"].as_str().unwrap().contains("mpi"), "{start}");
    // Step-1 loss is the global mean, ~ln(vocab), never divided by the number of ranks.
    let steps = step_lines(&rd);
    let first = steps[0]["loss"].as_f64().unwrap();
    let ln_vocab = (16f64).ln();
    assert!(
        (first - ln_vocab).abs() < 0.3,
        "step-1 loss {first} vs ln 16 = {ln_vocab}"
    );
    assert_eq!(steps.len(), 24, "one writer: one metrics line per step");
    // tokens are global: 2 ranks x 2 sequences x 32 tokens per step.
    assert_eq!(steps[0]["tokens_seen"], 128);
    let last = steps.last().unwrap()["loss"].as_f64().unwrap();
    assert!(last < first - 0.2, "it learned: {first} -> {last}");

    // The same command again from scratch: bit-identical weights.
    let again = tmp.path().join("again");
    assert_ok(&run(2, &again, &[]));
    assert_eq!(
        weights(&rd),
        weights(&again),
        "two identical 2-rank runs differ"
    );
}

#[cfg(feature = "mpi")]
#[test]
fn sigkill_of_one_rank_then_the_same_command_ends_bit_identical() {
    kill_one_rank_then_resume(2, &[]);
}

/// An `np`-rank run of `sets`, rank 1 SIGKILLed after step 8's checkpoint, then the same
/// command: it resumes once and ends with the weights of an uninterrupted run.
#[cfg(feature = "mpi")]
fn kill_one_rank_then_resume(np: usize, sets: &[&str]) {
    ranks::kill_one_rank_then_resume(&|rd| launch(np, rd, sets));
}

#[cfg(feature = "mpi")]
#[test]
fn sigterm_to_one_rank_makes_all_ranks_checkpoint_at_one_step_and_exit_75() {
    let tmp = tempfile::tempdir().unwrap();
    let rd = tmp.path().join("term");
    // The memory tier off: a preempted (exit 75) run keeps its snapshots for the resume this
    // test never runs.
    let sets = [
        "training.steps=100000",
        "checkpoint.interval=0",
        "checkpoint.snapshot_interval=0",
    ];
    let mut job = launch(3, &rd, &sets)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    wait_for_step(&rd, 5, &mut job);
    let pid = common::trainer_pid(&rd, 2).expect("rank 2's pid");
    // SAFETY: kill(2) on a pid of a process this test started.
    assert_eq!(unsafe { libc::kill(pid, libc::SIGTERM) }, 0);
    let status = job.wait().unwrap();
    assert_eq!(status.code(), Some(75), "preempted, resumable");
    let ev = events(&rd, "train");
    let signal = ev
        .iter()
        .find(|e| e["event"] == "signal")
        .expect("signal event");
    assert_eq!(
        signal["ranks"],
        serde_json::json!([2]),
        "names the rank: {signal}"
    );
    let step = signal["step"].as_u64().unwrap();
    let saved = ev
        .iter()
        .find(|e| e["event"] == "checkpoint_saved")
        .expect("a checkpoint");
    assert_eq!(
        saved["step"].as_u64(),
        Some(step),
        "saved at the agreed step"
    );
    let exit = ev.iter().rev().find(|e| e["event"] == "exit").unwrap();
    assert_eq!(exit["code"], 75);
    assert!(
        rd.join(format!("checkpoints/step-{step}/manifest.json"))
            .exists()
    );
}

#[cfg(feature = "mpi")]
#[test]
fn a_checkpoint_of_three_ranks_resumes_on_two_with_the_same_samples() {
    let tmp = tempfile::tempdir().unwrap();
    let out = resume_resized(tmp.path(), (3, &[]), (2, &[]));
    let resized = events(&tmp.path().join("resized"), "train")
        .into_iter()
        .find(|e| e["event"] == "resized")
        .unwrap_or_else(|| panic!("no resized event: {}", text(&out)));
    assert_eq!(resized["from_ranks"], 3);
    assert_eq!(resized["to_ranks"], 2);
    assert_eq!(resized["global_batch"], 12);
    assert_eq!(resized["grad_accum_steps"], 3);
    // A global batch that cannot be split is refused clearly.
    let out = run(
        2,
        &tmp.path().join("bad"),
        &["training.global_batch_size=6", "training.steps=2"],
    );
    assert_eq!(out.status.code(), Some(78), "{}", text(&out));
    assert!(text(&out).contains("cannot be split"), "{}", text(&out));
}

/// A 12-step run on `from` = (ranks, sets), and the same run with its last checkpoint lost
/// resumed from step 8 on `to` (in `tmp/resized`): every step trains on the same global
/// samples, and the losses differ only by the order of the reduction (2e-3 relative: the
/// sums of another rank count round differently, and that grows over the steps).
#[cfg(feature = "mpi")]
fn resume_resized(tmp: &Path, from: (usize, &[&str]), to: (usize, &[&str])) -> Output {
    // Global batch 12 = 3 ranks x batch 2 x accumulation 2 (or 2 x 3, 1 x 6).
    fn with<'a>(extra: &[&'a str]) -> Vec<&'a str> {
        let mut sets = vec!["training.global_batch_size=12", "training.steps=12"];
        sets.extend_from_slice(extra);
        sets
    }
    let (from_sets, to_sets) = (with(from.1), with(to.1));
    let full = tmp.join("full");
    assert_ok(&run(from.0, &full, &from_sets));
    // The same run, its last checkpoint lost: it resumes from step 8...
    let rd = tmp.join("resized");
    assert_ok(&run(from.0, &rd, &from_sets));
    std::fs::remove_dir_all(rd.join("checkpoints/step-12")).unwrap();
    std::fs::remove_file(rd.join("model.safetensors")).unwrap();
    let mut kept: Vec<String> = std::fs::read_to_string(rd.join("metrics.jsonl"))
        .unwrap()
        .lines()
        .map(String::from)
        .collect();
    kept.truncate(8);
    std::fs::write(rd.join("metrics.jsonl"), kept.join("\n") + "\n").unwrap();
    // ... on the other ranks and mode.
    let out = run(to.0, &rd, &to_sets);
    assert_ok(&out);
    let (a, b) = (step_lines(&full), step_lines(&rd));
    assert_eq!(a.len(), 12);
    assert_eq!(b.len(), 12);
    for (x, y) in a.iter().zip(&b) {
        assert_eq!(x["first_sample"], y["first_sample"], "{x} vs {y}");
        assert_eq!(x["global_batch"], y["global_batch"]);
        let (lx, ly) = (x["loss"].as_f64().unwrap(), y["loss"].as_f64().unwrap());
        assert!(
            (lx - ly).abs() < 2e-3 * lx.abs(),
            "step {}: {lx} vs {ly}",
            x["step"]
        );
    }
    out
}

const SHARD_OPTIMIZER: &str = "parallelism.shard=optimizer";
const SHARD_GRADIENTS: &str = "parallelism.shard=gradients";
const SHARD_PARAMETERS: &str = "parallelism.shard=parameters";

/// Optimizer sharding makes the replicated run's calls and computes every element as it
/// does: the same weights bit for bit. Gradient sharding reduce-scatters instead (another
/// MPI reduction order) and sums the norm per range: equal losses to 1e-4 relative (float
/// rounding of the sums), and its ranks still agree bit for bit (the replica check every 4
/// steps would stop the run). Parameter sharding reduce-scatters stage by stage, with the
/// same tolerance, and its held-out eval (stage by stage, every rank) agrees as closely.
#[cfg(feature = "mpi")]
#[test]
fn sharded_runs_train_like_the_replicated_run_on_two_and_three_ranks() {
    let tmp = tempfile::tempdir().unwrap();
    for np in [2, 3] {
        let replicated = reference(tmp.path(), np);
        let rd = tmp.path().join(format!("optimizer-{np}"));
        assert_ok(&run(np, &rd, &[SHARD_OPTIMIZER]));
        assert_eq!(weights(&replicated), weights(&rd), "{np} ranks");
        for (mode, set) in [
            ("gradients", SHARD_GRADIENTS),
            ("parameters", SHARD_PARAMETERS),
        ] {
            let rd = tmp.path().join(format!("{mode}-{np}"));
            assert_ok(&run(np, &rd, &[set]));
            trains_like(&replicated, &rd, &format!("{mode}, {np} ranks"));
            check_shard_files(&rd.join("checkpoints/step-24"), np, mode == "parameters");
            if mode == "parameters" {
                // Gathering each stage ahead on a second thread (Debian's OpenMPI grants
                // MPI_THREAD_MULTIPLE) makes the same calls: the same weights, bit for bit.
                assert!(!prefetch_of(&rd), "off by default");
                let ahead = tmp.path().join(format!("{mode}-{np}-prefetch"));
                assert_ok(&run(np, &ahead, &[set, "parallelism.prefetch=true"]));
                assert!(prefetch_of(&ahead), "{np} ranks: MPI_THREAD_MULTIPLE");
                assert_eq!(weights(&ahead), weights(&rd), "{np} ranks, prefetch or not");
            }
            // Export reads the sharded checkpoint directly (its manifest verifies every shard).
            let out = std::process::Command::new(common::KILN)
                .arg("export")
                .arg(rd.join("checkpoints/step-24"))
                .args(["--to", "hf"])
                .arg(tmp.path().join(format!("hf-{mode}-{np}")))
                .output()
                .unwrap();
            assert_ok(&out);
        }
    }
}

/// Issue 59: Muon, SophiaG, SPAM and Mano shard in every mode, Schedule-Free AdamW with its
/// parameters. Mano's projection and norms, like Muon's Newton-Schulz, see each whole matrix
/// on its owner rank. Muon's Newton-Schulz sees each whole
/// matrix on one owner rank (gathered from the ranks' ranges and scattered back), SophiaG is
/// element-wise and its Hessian pass (sampled labels) is reduced like the gradients, SPAM is
/// element-wise (here with its reset every 6 updates, so that the 24 steps reset and clip). With
/// `optimizer` the gradients are the replicated run's, so the weights are too, bit for bit;
/// `gradients` and `parameters` reduce in another order: losses and eval within 1e-4
/// relative, as for AdamW. On 2 and 3 ranks (3 does not divide the model's elements, so
/// matrices straddle the ranks unevenly), with the Hessian estimated every 3 steps.
#[cfg(feature = "mpi")]
#[test]
fn sharded_optimizers_train_like_their_replicated_runs() {
    let tmp = tempfile::tempdir().unwrap();
    for kind in ["muon", "sophiag", "spam", "schedule_free_adamw", "mano"] {
        let opt = format!("optimizer.kind={kind}");
        let every: &[&str] = match kind {
            "spam" => &[
                "optimizer.spam.reset_interval=6",
                "optimizer.spam.clip_after=3",
            ],
            "schedule_free_adamw" => &["lr_scheduler.kind=constant"],
            _ => &["optimizer.sophia.hessian_interval=3"],
        };
        let with = |more: &[&str]| -> Vec<String> {
            let mut v = vec![opt.clone()];
            v.extend(every.iter().chain(more).map(|s| s.to_string()));
            v
        };
        for np in [2, 3] {
            let replicated = tmp.path().join(format!("{kind}-{np}"));
            assert_ok(&run(np, &replicated, &strs(&with(&[]))));
            // Schedule-Free shards its weights with its state only (the config says why).
            let split_state = kind != "schedule_free_adamw";
            if split_state {
                let rd = tmp.path().join(format!("{kind}-optimizer-{np}"));
                assert_ok(&run(np, &rd, &strs(&with(&[SHARD_OPTIMIZER]))));
                assert!(weights(&replicated) == weights(&rd), "{kind}, {np} ranks");
            }
            let modes = [
                ("gradients", SHARD_GRADIENTS),
                ("parameters", SHARD_PARAMETERS),
            ];
            let modes = modes
                .into_iter()
                .filter(|(m, _)| split_state || *m == "parameters");
            for (mode, set) in modes {
                let rd = tmp.path().join(format!("{kind}-{mode}-{np}"));
                assert_ok(&run(np, &rd, &strs(&with(&[set]))));
                trains_like(&replicated, &rd, &format!("{kind}, {mode}, {np} ranks"));
                check_shard_files(&rd.join("checkpoints/step-24"), np, mode == "parameters");
            }
        }
    }
}

fn strs(v: &[String]) -> Vec<&str> {
    v.iter().map(String::as_str).collect()
}

/// Sharded Muon and SophiaG resume bit-identically after a rank is SIGKILLed (their state
/// in one optimizer file per rank), and a sharded Muon checkpoint resumes replicated on
/// fewer ranks with the same samples.
#[cfg(feature = "mpi")]
#[test]
fn sharded_muon_and_sophiag_resume_bit_identical_and_reshard() {
    kill_one_rank_then_resume(2, &[SHARD_PARAMETERS, "optimizer.kind=muon"]);
    kill_one_rank_then_resume(
        2,
        &[
            SHARD_GRADIENTS,
            "optimizer.kind=sophiag",
            "optimizer.sophia.hessian_interval=3",
        ],
    );
    let tmp = tempfile::tempdir().unwrap();
    let from: &[&str] = &[SHARD_GRADIENTS, "optimizer.kind=muon"];
    resume_resized(tmp.path(), (3, from), (2, &["optimizer.kind=muon"]));
}

/// Whether run `rd` gathered each stage's weights ahead (its `start` event).
fn prefetch_of(rd: &Path) -> bool {
    let start = events(rd, "train")
        .into_iter()
        .find(|e| e["event"] == "start");
    start.expect("a start event")["prefetch"] == true
}

/// One optimizer shard per rank, written by that rank, under one manifest; with parameters
/// sharded one weights shard per rank too, and no whole weights file.
fn check_shard_files(ckpt: &Path, np: usize, weights_sharded: bool) {
    assert!(!ckpt.join("optimizer.safetensors").exists());
    assert_eq!(ckpt.join("model.safetensors").exists(), !weights_sharded);
    for r in 0..np {
        for (kind, expected) in [("optimizer", true), ("model", weights_sharded)] {
            let name = format!("{kind}-{r:05}-of-{np:05}.safetensors");
            assert_eq!(ckpt.join(&name).exists(), expected, "{name}");
        }
    }
}

/// Run `rd` (`what`) has the steps of run `reference`, each loss and the last held-out loss
/// within 1e-4 relative of its.
fn trains_like(reference: &Path, rd: &Path, what: &str) {
    let (a, b) = (step_lines(reference), step_lines(rd));
    assert_eq!(a.len(), b.len(), "{what}");
    for (x, y) in a.iter().zip(&b) {
        let (lx, ly) = (x["loss"].as_f64().unwrap(), y["loss"].as_f64().unwrap());
        assert!(
            (lx - ly).abs() < 1e-4 * lx.abs(),
            "{what}, step {}: {lx} vs {ly}",
            x["step"]
        );
    }
    let (ex, ey) = (eval_loss(reference), eval_loss(rd));
    assert!((ex - ey).abs() < 1e-4 * ex, "{what} eval: {ex} vs {ey}");
}

/// The held-out loss of a run's last eval.
fn eval_loss(rd: &Path) -> f64 {
    std::fs::read_to_string(rd.join("metrics.jsonl"))
        .unwrap_or_default()
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter_map(|m| m["eval_loss"].as_f64())
        .next_back()
        .unwrap_or_else(|| panic!("no eval in {}", rd.display()))
}

#[cfg(feature = "mpi")]
#[test]
fn a_sharded_run_sigkilled_resumes_bit_identical() {
    kill_one_rank_then_resume(2, &[SHARD_GRADIENTS]);
}

#[cfg(feature = "mpi")]
#[test]
fn a_parameter_sharded_run_sigkilled_resumes_bit_identical() {
    kill_one_rank_then_resume(2, &[SHARD_PARAMETERS]);
}

const TWO_REPLICAS: &str = "parallelism.dp_replicate=2";

/// Hybrid sharding: 4 ranks as 2 replicas of 2 shards train like the replicated 4-rank run
/// (losses and eval to 1e-4 relative: the reduce-scatter within a replica and then the
/// all-reduce over the replicas sum in another order than one all-reduce), write one set of
/// 2 shards (the first replica's), and the replicas of each shard agree bit for bit (the
/// replica check every 4 steps compares them). A corrupted replica is named by its rank;
/// replicas that do not divide the ranks are refused naming the key.
#[cfg(feature = "mpi")]
#[test]
fn hybrid_sharding_trains_like_the_replicated_run_and_checks_its_replicas() {
    let tmp = tempfile::tempdir().unwrap();
    let replicated = reference(tmp.path(), 4);
    for (mode, set) in [
        ("gradients", SHARD_GRADIENTS),
        ("parameters", SHARD_PARAMETERS),
    ] {
        let rd = tmp.path().join(format!("hybrid-{mode}"));
        assert_ok(&run(4, &rd, &[set, TWO_REPLICAS]));
        trains_like(&replicated, &rd, &format!("hybrid {mode}"));
        let start = events(&rd, "train")
            .into_iter()
            .find(|e| e["event"] == "start")
            .unwrap();
        assert_eq!(
            (start["shard"].as_str(), start["shard_ranks"].as_u64()),
            (Some(mode), Some(2))
        );
        let ckpt = rd.join("checkpoints/step-24");
        check_shard_files(&ckpt, 2, mode == "parameters");
        assert!(!ckpt.join("optimizer-00000-of-00004.safetensors").exists());
    }
    let rd = tmp.path().join("sdc");
    let sdc = [
        SHARD_PARAMETERS,
        TWO_REPLICAS,
        "debug.corrupt_replica_rank=3",
        "debug.corrupt_replica_at_step=6",
    ];
    let out = run(4, &rd, &sdc);
    assert_eq!(out.status.code(), Some(76), "{}", text(&out));
    let mismatch = events(&rd, "train")
        .into_iter()
        .find(|e| e["event"] == "replica_mismatch")
        .expect("replica_mismatch event");
    assert_eq!(mismatch["ranks"], serde_json::json!([3]), "{mismatch}");
    assert_eq!(mismatch["step"], 8, "{mismatch}");
    let out = run(
        3,
        &tmp.path().join("bad"),
        &[SHARD_PARAMETERS, TWO_REPLICAS],
    );
    assert_eq!(out.status.code(), Some(78), "{}", text(&out));
    assert!(
        text(&out).contains("parallelism.dp_replicate = 2 does not divide the 3 ranks"),
        "{}",
        text(&out)
    );
}

#[cfg(feature = "mpi")]
#[test]
fn a_hybrid_sharded_run_sigkilled_resumes_bit_identical() {
    kill_one_rank_then_resume(4, &[SHARD_PARAMETERS, TWO_REPLICAS]);
}

/// A hybrid checkpoint (2 shards) resumes on 2 ranks with parameters sharded and on 3
/// replicated, and a replicated one as hybrid: the same samples at every step.
#[cfg(feature = "mpi")]
#[test]
fn a_hybrid_checkpoint_resumes_on_other_ranks_and_modes() {
    const HYBRID: &[&str] = &[SHARD_PARAMETERS, TWO_REPLICAS, "training.batch_size=1"];
    for (from, to) in [
        ((4, HYBRID), (2, &[SHARD_PARAMETERS][..])),
        ((4, HYBRID), (3, &["parallelism.shard=none"][..])),
        ((2, &[SHARD_GRADIENTS][..]), (4, HYBRID)),
    ] {
        let tmp = tempfile::tempdir().unwrap();
        resume_resized(tmp.path(), from, to);
    }
}

/// With parameters sharded no rank holds a whole parameter (most ranks hold nothing of a
/// norm's weight): the frozen check still names exactly the frozen ones, and a non-finite
/// step every parameter whose gradient is NaN (all of them, from a NaN loss), from every
/// rank's pieces.
#[cfg(feature = "mpi")]
#[test]
fn frozen_and_non_finite_parameters_are_named_from_every_ranks_pieces() {
    let tmp = tempfile::tempdir().unwrap();
    let rd = tmp.path().join("frozen");
    let sets = [
        SHARD_PARAMETERS,
        "debug.freeze_params=post_attention_layernorm",
        "guards.frozen_check_interval=4",
        "debug.nan_at_step=2",
        "training.steps=8",
    ];
    assert_ok(&run(3, &rd, &sets));
    let skip = events(&rd, "train")
        .into_iter()
        .find(|e| e["event"] == "nonfinite_skip")
        .expect("nonfinite_skip event");
    let mut named: Vec<String> = serde_json::from_value(skip["params"].clone()).unwrap();
    named.sort();
    assert_eq!(named, common::tensor_names(&rd.join("model.safetensors")));
    let frozen = events(&rd, "train")
        .into_iter()
        .find(|e| e["event"] == "frozen_params")
        .expect("frozen_params event");
    assert_eq!(
        frozen["params"],
        serde_json::json!([
            "model.layers.0.post_attention_layernorm.weight",
            "model.layers.1.post_attention_layernorm.weight"
        ]),
        "{frozen}"
    );
}

#[cfg(feature = "mpi")]
#[test]
fn a_sharded_checkpoint_resumes_replicated_on_fewer_ranks_and_back() {
    for (from, to) in [
        ((3, SHARD_GRADIENTS), (2, "parallelism.shard=none")),
        ((3, SHARD_GRADIENTS), (1, "parallelism.shard=none")),
        ((1, "parallelism.shard=none"), (3, SHARD_GRADIENTS)),
        ((2, SHARD_OPTIMIZER), (3, SHARD_GRADIENTS)),
        ((3, SHARD_PARAMETERS), (2, "parallelism.shard=none")),
        ((3, SHARD_PARAMETERS), (1, "parallelism.shard=none")),
        ((1, "parallelism.shard=none"), (3, SHARD_PARAMETERS)),
        ((3, SHARD_GRADIENTS), (2, SHARD_PARAMETERS)),
    ] {
        let tmp = tempfile::tempdir().unwrap();
        resume_resized(tmp.path(), (from.0, &[from.1]), (to.0, &[to.1]));
    }
}

/// A missing shard (of the optimizer state, or with parameters sharded of the weights)
/// rejects the whole checkpoint: the run falls back to the one before.
#[cfg(feature = "mpi")]
#[test]
fn a_missing_shard_falls_back_to_the_previous_checkpoint() {
    for (mode, lost) in [
        (SHARD_GRADIENTS, "optimizer-00001-of-00002.safetensors"),
        (SHARD_PARAMETERS, "model-00000-of-00002.safetensors"),
    ] {
        let tmp = tempfile::tempdir().unwrap();
        let rd = tmp.path().join("lost-shard");
        assert_ok(&run(2, &rd, &[mode, "training.steps=8"]));
        std::fs::remove_file(rd.join("checkpoints/step-8").join(lost)).unwrap();
        std::fs::remove_file(rd.join("model.safetensors")).unwrap();
        let out = run(2, &rd, &[mode, "training.steps=8"]);
        assert_ok(&out);
        let ev = events(&rd, "train");
        let rejected = ev
            .iter()
            .find(|e| e["event"] == "checkpoint_rejected")
            .unwrap_or_else(|| panic!("{mode}: no rejection: {}", text(&out)));
        assert!(
            rejected["path"].as_str().unwrap().ends_with("step-8"),
            "{rejected}"
        );
        let resume = ev.iter().find(|e| e["event"] == "resume").expect("resumed");
        assert_eq!(resume["step"], 4, "{mode}: {resume}");
    }
}

/// A model whose replicated state does not fit one rank's memory limit, nor 4 ranks' with
/// gradients sharded, trains on 4 ranks with parameters sharded under the same per-rank
/// limit (its measured peak under it too), and each refusal names that mode.
#[cfg(feature = "mpi")]
#[test]
fn a_model_refused_on_one_rank_trains_on_four_sharded_ranks_under_the_same_limit() {
    let tmp = tempfile::tempdir().unwrap();
    let big = [
        "model.d_model=512",
        "model.n_heads=8",
        "model.n_kv_heads=8",
        "model.n_layers=2",
        "model.ffn_hidden=2048",
        "training.steps=2",
        "checkpoint.interval=0",
    ];
    // Estimated: 1.2 GiB replicated, 577 MiB a rank on 4 with gradients sharded, 425 MiB
    // with parameters sharded.
    let limit = "500M";
    let on = |np: usize, mode: &str, name: &str| {
        let mut sets = big.to_vec();
        sets.push(mode);
        let rd = tmp.path().join(name);
        let out = launch(np, &rd, &sets)
            .env("KILN_MEMORY_LIMIT", limit)
            .output()
            .unwrap();
        (out, rd)
    };
    let (one, _) = on(1, "parallelism.shard=none", "one");
    assert_eq!(one.status.code(), Some(78), "{}", text(&one));
    let said = text(&one);
    assert!(
        said.contains("parallelism.shard = \"parameters\""),
        "{said}"
    );
    let on_four = |mode: &str, name: &str| on(4, mode, name);
    let (gradients, _) = on_four(SHARD_GRADIENTS, "gradients");
    assert_eq!(gradients.status.code(), Some(78), "{}", text(&gradients));
    let said = text(&gradients);
    assert!(
        said.contains("parallelism.shard = \"parameters\""),
        "{said}"
    );
    let (four, rd) = on_four(SHARD_PARAMETERS, "parameters");
    assert_ok(&four);
    let peak = events(&rd, "train")
        .into_iter()
        .find(|e| e["event"] == "peak_memory")
        .expect("peak memory");
    for mib in peak["rank_mib"].as_array().unwrap() {
        assert!(mib.as_f64().unwrap() < 500.0, "{peak}");
    }
}

/// A parameter-sharded rank resumes holding its own pieces, not the whole state: on 4 ranks
/// of a model whose state is 97 MiB, each rank's peak when resumed from a checkpoint stays
/// within a quarter of that of its peak in the uninterrupted run (reading the whole
/// checkpoint, as kiln did before, added about 70 MiB a rank), and the resumed run ends with
/// the same weights bit for bit. Rank 0 reads as its peers do but is left out of the
/// comparison: as the writer its peak is set by when its asynchronous saves overlap the
/// steps (measured 182-215 MiB over three identical runs, the others within 5 MiB).
#[cfg(feature = "mpi")]
#[test]
fn a_sharded_resume_reads_only_its_own_pieces() {
    let tmp = tempfile::tempdir().unwrap();
    let sets = [
        "model.d_model=512",
        "model.n_heads=8",
        "model.n_kv_heads=8",
        "model.n_layers=2",
        "model.ffn_hidden=2048",
        "training.steps=4",
        "checkpoint.interval=2",
        SHARD_PARAMETERS,
    ];
    let peaks = |rd: &Path| -> Vec<f64> {
        let peak = events(rd, "train")
            .into_iter()
            .rfind(|e| e["event"] == "peak_memory")
            .expect("peak memory");
        serde_json::from_value(peak["rank_mib"].clone()).unwrap()
    };
    let full = tmp.path().join("full");
    assert_ok(&run(4, &full, &sets));
    let rd = tmp.path().join("resumed");
    assert_ok(&run(4, &rd, &sets));
    std::fs::remove_dir_all(rd.join("checkpoints/step-4")).unwrap();
    std::fs::remove_file(rd.join("model.safetensors")).unwrap();
    let out = run(4, &rd, &sets);
    assert_ok(&out);
    let resume = events(&rd, "train")
        .into_iter()
        .find(|e| e["event"] == "resume")
        .unwrap_or_else(|| panic!("not resumed: {}", text(&out)));
    assert_eq!(resume["step"], 2);
    assert_eq!(weights(&full), weights(&rd), "the resume is not exact");
    let (fresh, resumed) = (peaks(&full), peaks(&rd));
    for (rank, (f, r)) in fresh.iter().zip(&resumed).enumerate().skip(1) {
        assert!(r - f < 24.0, "rank {rank}: {f} MiB fresh, {r} MiB resumed");
    }
}

#[cfg(feature = "mpi")]
#[test]
fn a_corrupted_replica_is_named_and_stops_the_run_before_it_is_saved() {
    let tmp = tempfile::tempdir().unwrap();
    let rd = tmp.path().join("sdc");
    let shm = tmp.path().join("shm");
    let tier = format!("checkpoint.snapshot_dir={}", shm.display());
    let out = run(
        3,
        &rd,
        &[
            "debug.corrupt_replica_rank=1",
            "debug.corrupt_replica_at_step=6",
            &tier,
        ],
    );
    assert_eq!(out.status.code(), Some(76), "{}", text(&out));
    // The memory tier held a snapshot (step 5) no check had passed: it went with the run.
    for rank in 0..3 {
        let left = common::snapshot_steps(&shm, rank);
        assert!(left.is_empty(), "rank {rank} kept snapshots {left:?}");
    }
    let ev = events(&rd, "train");
    let mismatch = ev
        .iter()
        .find(|e| e["event"] == "replica_mismatch")
        .expect("replica_mismatch event");
    assert_eq!(mismatch["ranks"], serde_json::json!([1]), "{mismatch}");
    assert_eq!(
        mismatch["step"], 8,
        "caught at the first check after the corruption"
    );
    let saved: Vec<u64> = ev
        .iter()
        .filter(|e| e["event"] == "checkpoint_saved")
        .filter_map(|e| e["step"].as_u64())
        .collect();
    assert_eq!(saved, vec![4], "nothing after the corruption was saved");
}

#[cfg(not(feature = "mpi"))]
#[test]
fn several_ranks_on_a_kiln_without_mpi_is_a_clear_config_error() {
    let tmp = tempfile::tempdir().unwrap();
    let out = common::train_cmd(&tmp.path().join("r"), &["training.steps=2"])
        .env("RANK", "0")
        .env("WORLD_SIZE", "2")
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(78), "{}", text(&out));
    assert!(text(&out).contains("--features mpi"), "{}", text(&out));
}

/// `kiln launch --mpi --np N -- kiln VERB ARGS...` on the tiny model with `sets` (no run
/// directory: the gates verbs write where their flags say).
#[cfg(feature = "mpi")]
fn launch_gate(np: usize, args: &[&str], sets: &[&str]) -> Output {
    // The launch's own run directory (events, attempt logs) in a temporary one, not in the
    // working directory's runs/.
    let launch_dir = tempfile::tempdir().expect("a temporary directory");
    let mut cmd = ranks::launcher(np, launch_dir.path());
    cmd.arg("--").arg(common::KILN).args(args);
    for s in common::TINY_MODEL.iter().chain(sets) {
        cmd.arg("--set").arg(s);
    }
    cmd.output().expect("spawn kiln launch")
}

/// The losses of an lr-find sweep written to `dir` (`lr-find.csv`: step,lr,loss,...).
#[cfg(feature = "mpi")]
fn sweep_losses(dir: &Path) -> Vec<f64> {
    let csv = std::fs::read_to_string(dir.join("lr-find.csv")).expect("lr-find.csv");
    csv.lines()
        .skip(1)
        .map(|l| l.split(',').nth(2).and_then(|v| v.parse().ok()).expect(l))
        .collect()
}

/// Relative difference of two loss curves, the largest over their steps.
#[cfg(feature = "mpi")]
fn worst_rel(a: &[f64], b: &[f64]) -> f64 {
    assert_eq!(a.len(), b.len(), "{a:?}\n{b:?}");
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs() / x.abs())
        .fold(0.0, f64::max)
}

#[cfg(feature = "mpi")]
#[test]
fn lr_find_is_one_data_parallel_sweep_over_all_ranks_written_by_rank_0() {
    let tmp = tempfile::tempdir().unwrap();
    let sweep = ["--steps", "8", "--min", "1e-4", "--max", "1e-1"];
    let one_dir = tmp.path().join("one");
    let one_sets = ["training.batch_size=4", "training.threads=1"];
    let mut args = vec!["lr-find", "--out", one_dir.to_str().unwrap()];
    args.extend(sweep);
    assert_ok(&launch_gate(1, &args, &one_sets));
    let one = sweep_losses(&one_dir);
    // Two ranks of batch 2 train on the one rank's batch of 4 (and three of batch 2 with
    // parameters sharded on one of 6): every mode is the one data-parallel step.
    for (np, mode) in [(2, "none"), (2, "parameters"), (3, "gradients")] {
        let dir = tmp.path().join(format!("{np}-{mode}"));
        let mut args = vec!["lr-find", "--out", dir.to_str().unwrap()];
        args.extend(sweep);
        let shard = format!("parallelism.shard={mode}");
        let sets = ["training.batch_size=2", "training.threads=1", &shard];
        let out = launch_gate(np, &args, &sets);
        assert_ok(&out);
        let t = text(&out);
        assert_eq!(t.matches("suggested lr:").count(), 1, "rank 0 reports: {t}");
        assert_eq!(
            t.matches("wrote ").count(),
            4,
            "rank 0 writes its 4 files once: {t}"
        );
        let losses = sweep_losses(&dir);
        eprintln!("{np} ranks, shard {mode}: {losses:?} (one rank: {one:?})");
        if np == 2 {
            // The same samples as one rank's batch of 4, averaged in another order.
            let d = worst_rel(&one, &losses);
            assert!(
                d < 1e-4,
                "{np} ranks, shard {mode}: {d:e}\n{one:?}\n{losses:?}"
            );
        }
        assert!(losses.iter().all(|l| l.is_finite()), "{losses:?}");
    }
}

#[cfg(feature = "mpi")]
#[test]
fn smoke_gates_several_ranks_with_rank_0_recording_and_a_baseline_per_rank_count() {
    let tmp = tempfile::tempdir().unwrap();
    let baseline = tmp.path().join("smoke-2.json");
    let b = baseline.to_str().unwrap();
    let sets = ["training.threads=1", "parallelism.shard=optimizer"];
    let bless = ["smoke", "--bless", "--baseline", b, "--steps", "4"];
    let out = launch_gate(2, &bless, &sets);
    assert_ok(&out);
    let saved: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&baseline).unwrap()).unwrap();
    assert_eq!(saved["ranks"], 2, "{saved}");
    let records = saved["records"].as_array().unwrap();
    assert_eq!(records.len(), 4, "{saved}");
    assert!(
        records
            .iter()
            .all(|r| r["loss"].as_f64().is_some_and(f64::is_finite))
    );
    // The gate over both ranks passes against its own baseline, bit for bit.
    let check = ["smoke", "--baseline", b];
    let out = launch_gate(2, &check, &sets);
    assert_ok(&out);
    assert!(
        text(&out).contains("smoke: PASS: 4 steps bit-identical"),
        "{}",
        text(&out)
    );
    // Three ranks (or one) are not the baseline's setup: refused, by name, before the run.
    let out = launch_gate(3, &check, &sets);
    assert_ne!(out.status.code(), Some(0), "{}", text(&out));
    assert!(
        text(&out).contains("ranks (data-parallel): baseline 2, this run 3"),
        "{}",
        text(&out)
    );
}

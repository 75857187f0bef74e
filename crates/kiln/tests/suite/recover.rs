//! The memory tier of recovery, with the real binary, real signals and (for 2 ranks) a real
//! MPI: a run SIGKILLed after a memory snapshot resumes from it (or from a peer's copy when
//! its own store is gone) and ends bit-identical to a run never interrupted; a corrupt
//! snapshot is rejected, never used. The only persistent checkpoint here is the last step's,
//! so a resume of a killed run can only come from the memory tier. The ledger (`kiln status`
//! and its `--json`) tells each fault's detection time, resume tier and lost work.

#![cfg_attr(not(feature = "mpi"), allow(dead_code, unused_imports))]

use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use crate::common::{self, rank_store, snapshot_steps};

// Long enough (a few seconds) that the snapshot writer, which skips a snapshot rather than
// stall the step, has published two well before the end even on a loaded machine: at 400
// steps (0.3 s) a busy CI machine could finish the run first.
const STEPS: u64 = 2000;

/// Short runs of the tiny model with frequent snapshots and rare checkpoints.
fn sets(shm: &Path) -> Vec<String> {
    let mut v: Vec<String> = [
        "training.batch_size=2",
        "training.threads=1",
        "training.compute_shards=1",
        "checkpoint.interval=1000",
        "checkpoint.snapshot_interval=3",
        "checkpoint.snapshot_keep=2",
        "eval.interval=0",
        "eval.samples=8",
        "lr_scheduler.warmup_steps=4",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    v.push(format!("training.steps={STEPS}"));
    v.push(format!("checkpoint.snapshot_dir={}", shm.display()));
    v
}

/// `kiln train` on one rank, or `kiln launch --mpi --np N -- kiln train`.
fn command(np: usize, rd: &Path, shm: &Path) -> Command {
    let mut cmd = if np == 1 {
        common::kiln_cmd(&["train", "--no-progress-bar", "--run-dir"])
    } else {
        let mut c = common::kiln_cmd(&["launch", "--mpi", "--np", &np.to_string()]);
        c.args(["--timeout", "120", "--run-dir"]).arg(rd).args([
            "--",
            common::KILN,
            "train",
            "--no-progress-bar",
            "--run-dir",
        ]);
        c
    };
    cmd.arg(rd);
    for s in common::TINY_MODEL
        .iter()
        .map(|s| s.to_string())
        .chain(sets(shm))
    {
        cmd.arg("--set").arg(s);
    }
    cmd
}

fn run_ok(np: usize, rd: &Path, shm: &Path) {
    let out = command(np, rd, shm).output().expect("spawn kiln");
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

fn weights(rd: &Path) -> Vec<u8> {
    std::fs::read(rd.join("model.safetensors")).expect("final weights")
}

fn events(rd: &Path, name: &str) -> Vec<serde_json::Value> {
    let mut all = common::events(rd);
    all.retain(|e| e["event"] == name);
    all
}

/// Waits until every one of `ranks` holds two snapshots.
fn wait_for_snapshots(shm: &Path, ranks: usize, child: &mut Child) {
    let t0 = Instant::now();
    while !(0..ranks).all(|r| snapshot_steps(shm, r).len() >= 2) {
        if let Ok(Some(status)) = child.try_wait() {
            panic!("the run ended ({status}) before two snapshots");
        }
        assert!(t0.elapsed() < Duration::from_secs(120), "no two snapshots");
        std::thread::sleep(Duration::from_millis(2));
    }
}

fn sigkill(pid: i32) {
    // SAFETY: kill(2) on a process this test started.
    assert_eq!(unsafe { libc::kill(pid, libc::SIGKILL) }, 0);
}

/// Starts a run, waits until every rank holds two snapshots, SIGKILLs `victim`
/// (rank 0 = the `kiln train` itself on one rank) and waits for the run to end.
fn run_and_kill(np: usize, rd: &Path, shm: &Path, victim: usize) {
    let mut child = command(np, rd, shm)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("spawn kiln");
    wait_for_snapshots(shm, np, &mut child);
    let pid = if np == 1 {
        child.id() as i32
    } else {
        common::trainer_pid(rd, victim).expect("the victim's pid")
    };
    sigkill(pid);
    let status = child.wait().unwrap();
    assert!(!status.success(), "the killed run must not succeed");
    assert!(
        !rd.join("model.safetensors").exists(),
        "the run did not finish"
    );
}

/// The guards' rollback interval in [`kill_between_rollback_points`]: the memory tier
/// snapshots every 3 steps, so most of its snapshots fall between two multiples of it.
const ROLLBACK_EVERY: u64 = 7;

/// Like [`run_and_kill`] with `guards.snapshot_interval` = [`ROLLBACK_EVERY`], but every
/// rank is killed, when every rank's newest snapshot is well into training (where a garbage
/// batch stands out as a spike) and between two of the guards' snapshots (the ranks are
/// stopped while their stores are read), at least three steps before the next one. Returns
/// that snapshot's step and data cursor.
fn kill_between_rollback_points(np: usize, rd: &Path, shm: &Path) -> (u64, u64) {
    let mut child = command(np, rd, shm)
        .arg("--set")
        .arg(format!("guards.snapshot_interval={ROLLBACK_EVERY}"))
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("spawn kiln");
    wait_for_snapshots(shm, np, &mut child);
    let pids: Vec<i32> = if np == 1 {
        vec![child.id() as i32]
    } else {
        (0..np)
            .map(|r| common::trainer_pid(rd, r).expect("a trainer's pid"))
            .collect()
    };
    let t0 = Instant::now();
    let step = loop {
        pids.iter().for_each(|&p| signal(p, libc::SIGSTOP));
        let newest: Vec<u64> = (0..np).map(|r| snapshot_steps(shm, r)[0]).collect();
        let s = newest[0];
        // The spike two batches on must come before the next rollback point, or the runs
        // roll back to that one and the restored point goes untested.
        let between = (1..ROLLBACK_EVERY - 2).contains(&(s % ROLLBACK_EVERY));
        if s > 400 && between && newest.iter().all(|&n| n == s) {
            break s;
        }
        pids.iter().for_each(|&p| signal(p, libc::SIGCONT));
        assert!(
            t0.elapsed() < Duration::from_secs(120),
            "no snapshot between two"
        );
        std::thread::sleep(Duration::from_millis(1));
    };
    // Every rank goes: a survivor's writer would publish a newer snapshot once continued.
    pids.iter().for_each(|&p| signal(p, libc::SIGKILL));
    assert!(
        !child.wait().unwrap().success(),
        "the killed run must not succeed"
    );
    let state = rank_store(shm, 0)
        .unwrap()
        .join(format!("step-{step}/state.json"));
    let state: serde_json::Value = serde_json::from_slice(&std::fs::read(state).unwrap()).unwrap();
    (step, state["data_cursor"].as_u64().unwrap())
}

fn signal(pid: i32, sig: i32) {
    // SAFETY: kill(2) on a process this test started.
    unsafe { libc::kill(pid, sig) };
}

/// A loss spike two batches after a resume between two of the guards' snapshots: the
/// resumed run (on `np` ranks; `replaced`: rank 1's store is gone) rolls back to the same
/// step as an uninterrupted run with the same spike, and ends bit-identical to it.
fn spike_after_resume_rolls_back_as_uninterrupted(np: usize, replaced: bool) {
    let tmp = tempfile::tempdir().unwrap();
    let (rd, shm) = (tmp.path().join("killed"), tmp.path().join("shm"));
    let (step, cursor) = kill_between_rollback_points(np, &rd, &shm);
    if replaced {
        std::fs::remove_dir_all(rank_store(&shm, 1).unwrap()).unwrap();
    }
    let spike = [
        format!("guards.snapshot_interval={ROLLBACK_EVERY}"),
        format!("debug.spike_at_step={}", cursor + 2),
    ];
    let run = |rd: &Path, shm: &Path| {
        let mut c = command(np, rd, shm);
        spike.iter().for_each(|s| {
            c.arg("--set").arg(s);
        });
        let out = c.output().expect("spawn kiln");
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
    };
    run(&rd, &shm);
    let reference = tmp.path().join("reference");
    run(&reference, &tmp.path().join("shm-ref"));
    let to_step = |rd: &Path| {
        let r = events(rd, "rollback");
        assert_eq!(r.len(), 1, "{}: {r:?}", rd.display());
        r[0]["to_step"].as_u64().unwrap()
    };
    assert_eq!(the_resume(&rd)["step"], step);
    assert_eq!(to_step(&reference), step - step % ROLLBACK_EVERY);
    assert_eq!(to_step(&rd), to_step(&reference), "rolled back elsewhere");
    assert!(events(&rd, "rollback_point_lost").is_empty());
    finish_identical_tail(&rd, &shm, &weights(&reference));
}

#[test]
fn a_spike_after_a_memory_resume_rolls_back_where_an_uninterrupted_run_does() {
    spike_after_resume_rolls_back_as_uninterrupted(1, false);
}

#[cfg(feature = "mpi")]
#[test]
fn a_replaced_rank_gets_the_rollback_point_from_its_peer() {
    spike_after_resume_rolls_back_as_uninterrupted(2, true);
}

/// The one `resume` event of the run, checked to come from a snapshot (no persistent
/// checkpoint existed).
fn the_resume(rd: &Path) -> serde_json::Value {
    let resumes = events(rd, "resume");
    assert_eq!(resumes.len(), 1, "{resumes:?}");
    let r = resumes[0].clone();
    let step = r["step"].as_u64().unwrap();
    assert!(step > 0 && step < STEPS, "{r}");
    assert!(r["persistent_step"].is_null(), "{r}");
    r
}

fn reference(tmp: &Path, np: usize) -> Vec<u8> {
    let (rd, shm) = (tmp.join(format!("reference-{np}")), tmp.join("shm-ref"));
    run_ok(np, &rd, &shm);
    weights(&rd)
}

#[test]
fn one_rank_sigkill_resumes_from_its_memory_snapshot_bit_identical() {
    let tmp = tempfile::tempdir().unwrap();
    let reference = reference(tmp.path(), 1);
    let (rd, shm) = (tmp.path().join("killed"), tmp.path().join("shm"));
    run_and_kill(1, &rd, &shm, 0);
    let newest = snapshot_steps(&shm, 0)[0];
    run_ok(1, &rd, &shm);
    let r = the_resume(&rd);
    assert_eq!(r["tier"], "memory", "{r}");
    assert_eq!(r["step"], newest, "the newest snapshot is used: {r}");
    let left: Vec<_> = std::fs::read_dir(&shm).unwrap().flatten().collect();
    assert!(left.is_empty(), "snapshots left after success: {left:?}");
    assert!(weights(&rd) == reference, "resume from memory is not exact");
}

#[test]
fn a_corrupt_snapshot_is_rejected_and_the_one_before_it_used() {
    let tmp = tempfile::tempdir().unwrap();
    let reference = reference(tmp.path(), 1);
    let (rd, shm) = (tmp.path().join("corrupt"), tmp.path().join("shm"));
    run_and_kill(1, &rd, &shm, 0);
    let steps = snapshot_steps(&shm, 0);
    assert!(steps.len() >= 2, "two snapshots kept: {steps:?}");
    let store = rank_store(&shm, 0).unwrap();
    let model = store.join(format!("step-{}/model.safetensors", steps[0]));
    let mut bytes = std::fs::read(&model).unwrap();
    let mid = bytes.len() / 2;
    bytes[mid] ^= 0x40;
    std::fs::write(&model, bytes).unwrap();
    run_ok(1, &rd, &shm);
    let rejected = events(&rd, "snapshot_rejected");
    assert_eq!(rejected.len(), 1, "{rejected:?}");
    assert!(
        rejected[0]["reason"].as_str().unwrap().contains("XXH3-128"),
        "{rejected:?}"
    );
    let r = the_resume(&rd);
    assert_eq!(r["tier"], "memory", "{r}");
    assert_eq!(
        r["step"], steps[1],
        "the snapshot before the corrupt one: {r}"
    );
    assert!(
        weights(&rd) == reference,
        "resume after a rejection is not exact"
    );
}

#[cfg(feature = "mpi")]
#[test]
fn two_ranks_sigkill_of_one_resumes_from_memory_bit_identical() {
    let tmp = tempfile::tempdir().unwrap();
    let reference = reference(tmp.path(), 2);
    let (rd, shm) = (tmp.path().join("killed"), tmp.path().join("shm"));
    run_and_kill(2, &rd, &shm, 1);
    run_ok(2, &rd, &shm);
    let r = the_resume(&rd);
    // Rank 1 died perhaps in the middle of writing the snapshot rank 0 finished: then it
    // received rank 0's copy. Either way the resume is from memory, not from storage.
    let tier = r["tier"].as_str().unwrap();
    assert!(tier == "memory" || tier == "peer", "{r}");
    the_fault_in_the_ledger(&rd, tier);
    assert!(weights(&rd) == reference, "resume from memory is not exact");
    let left: Vec<_> = std::fs::read_dir(&shm).unwrap().flatten().collect();
    assert!(left.is_empty(), "snapshots left after success: {left:?}");
}

#[cfg(feature = "mpi")]
#[test]
fn a_rank_whose_snapshots_are_gone_heals_from_its_peer_bit_identical() {
    let tmp = tempfile::tempdir().unwrap();
    let reference = reference(tmp.path(), 2);
    let (rd, shm) = (tmp.path().join("replaced"), tmp.path().join("shm"));
    run_and_kill(2, &rd, &shm, 1);
    // Rank 1's node was replaced: its node-local memory is empty.
    std::fs::remove_dir_all(rank_store(&shm, 1).unwrap()).unwrap();
    let newest = snapshot_steps(&shm, 0)[0];
    run_ok(2, &rd, &shm);
    let r = the_resume(&rd);
    assert_eq!(r["tier"], "peer", "{r}");
    assert_eq!(r["source_rank"], 0, "{r}");
    assert_eq!(r["peer_ranks"], serde_json::json!([1]), "{r}");
    assert_eq!(r["step"], newest, "{r}");
    let healed = events(&rd, "snapshot_from_peer");
    assert_eq!(healed.len(), 1, "{healed:?}");
    assert!(healed[0]["bytes"].as_u64().unwrap() > 0);
    the_fault_in_the_ledger(&rd, "peer");
    finish_identical_tail(&rd, &shm, &reference);
}

/// The kill of rank 1 as `kiln status --json` and `kiln status` tell it: one fault, rank 1,
/// found within a second (the recorded detection time, not a clock of this test), resumed
/// from `tier` at the resume's step, its lost work = steps redone x step time.
fn the_fault_in_the_ledger(rd: &Path, tier: &str) {
    let out = common::kiln_cmd(&["status", "--json"])
        .arg(rd)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let faults = v["ledger"]["faults"].as_array().unwrap();
    assert_eq!(faults.len(), 1, "{faults:?}");
    let f = &faults[0];
    assert_eq!(f["ranks"], serde_json::json!([1]), "{f}");
    let detect = f["detect_s"].as_f64().unwrap();
    eprintln!("ledger fault: {f}");
    assert!(detect < 1.0, "detect_s {detect}: {f}");
    assert_eq!(f["resumed_from"], tier, "{f}");
    assert_eq!(f["resumed_step"], the_resume(rd)["step"], "{f}");
    let step_s = f["step_s"].as_f64().unwrap();
    assert!(step_s > 0.0, "{f}");
    assert!(f["lost_steps"].as_u64().is_some(), "{f}");
    // The one fault lost the seconds the ledger counts as lost work.
    let bucket = v["ledger"]["buckets"]["lost"].as_f64().unwrap();
    assert!(
        (f["lost_s"].as_f64().unwrap() - bucket).abs() < 1e-6,
        "{f} vs lost work {bucket}"
    );
    let text = common::kiln_cmd(&["status"]).arg(rd).output().unwrap();
    let text = String::from_utf8_lossy(&text.stdout);
    assert!(text.contains("faults: 1; detection mean"), "{text}");
    assert!(
        text.contains(&format!("resumed from {tier} at step")),
        "{text}"
    );
}

/// The checks after a run already finished: exact, and cleaned up.
fn finish_identical_tail(rd: &Path, shm: &Path, reference: &[u8]) {
    assert!(weights(rd) == reference, "resume from a peer is not exact");
    let left: Vec<_> = std::fs::read_dir(shm).unwrap().flatten().collect();
    assert!(left.is_empty(), "snapshots left after success: {left:?}");
}

/// The persistent checkpoints of the run in `rd`, newest first.
fn checkpoint_steps(rd: &Path) -> Vec<u64> {
    kiln_train::checkpoint::list_steps(&rd.join("checkpoints"))
}

/// A run (one rank, snapshots every 3 steps, `extra` on top) stopped with SIGTERM once it
/// holds two snapshots: it checkpoints at its stop step, after its snapshots, and exits 75.
/// Returns that checkpoint's step.
fn stop_with_a_checkpoint(rd: &Path, shm: &Path, extra: &[&str]) -> u64 {
    let mut cmd = command(1, rd, shm);
    extra.iter().for_each(|s| {
        cmd.arg("--set").arg(s);
    });
    let mut child = cmd
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("spawn kiln");
    wait_for_snapshots(shm, 1, &mut child);
    signal(child.id() as i32, libc::SIGTERM);
    assert_eq!(child.wait().unwrap().code(), Some(75), "preempted");
    checkpoint_steps(rd)[0]
}

/// Resumes the run in `rd` (snapshots now rare, so that none is taken before the check)
/// and returns its snapshot steps once it trained past `step`; then kills it.
fn snapshots_after_resuming_past(rd: &Path, shm: &Path, step: u64, extra: &[&str]) -> Vec<u64> {
    let mut cmd = command(1, rd, shm);
    for s in extra.iter().chain(&["checkpoint.snapshot_interval=100000"]) {
        cmd.arg("--set").arg(s);
    }
    let mut child = common::spawn_until(cmd, step + 2, None);
    let left = snapshot_steps(shm, 0);
    sigkill(child.id() as i32);
    let _ = child.wait();
    left
}

/// Issue 46: a run that finds stale snapshots of its own lineage, older than its newest
/// persistent checkpoint, removes them (they held the node's RAM for nothing). A SIGTERM stop
/// checkpoints after its last snapshot: on resume every snapshot is stale.
#[test]
fn a_resume_deletes_its_snapshots_older_than_the_persistent_checkpoint() {
    let tmp = tempfile::tempdir().unwrap();
    let (rd, shm) = (tmp.path().join("run"), tmp.path().join("shm"));
    let no_anchor = ["guards.snapshot_interval=0"];
    let persistent = stop_with_a_checkpoint(&rd, &shm, &no_anchor);
    let before = snapshot_steps(&shm, 0);
    assert!(
        before.iter().filter(|&&s| s < persistent).count() >= 1,
        "{before:?} vs {persistent}"
    );
    let left = snapshots_after_resuming_past(&rd, &shm, persistent, &no_anchor);
    let stale: Vec<u64> = left.into_iter().filter(|&s| s < persistent).collect();
    assert_eq!(stale, Vec::<u64>::new(), "older than step {persistent}");
}

/// Held out: with the guards' rollback interval on (7), the snapshot at its newest multiple
/// before the checkpoint is the resumed run's rollback point and stays; every other older one
/// goes.
#[test]
fn a_resume_keeps_only_the_rollback_point_among_its_stale_snapshots() {
    let tmp = tempfile::tempdir().unwrap();
    let (rd, shm) = (tmp.path().join("run"), tmp.path().join("shm"));
    let anchor = ["guards.snapshot_interval=7", "checkpoint.snapshot_keep=3"];
    let persistent = stop_with_a_checkpoint(&rd, &shm, &anchor);
    let left = snapshots_after_resuming_past(&rd, &shm, persistent, &anchor);
    let stale: Vec<u64> = left.into_iter().filter(|&s| s < persistent).collect();
    assert!(stale.len() <= 1, "{stale:?} older than {persistent}");
    assert!(stale.iter().all(|s| s % 7 == 0), "{stale:?}");
}

/// `kiln launch LAUNCH -- kiln train` on `np` ranks (`--mpi` for more than one) with the
/// memory tier of [`sets`] in `shm` and `extra` settings on top.
fn launch_train(np: usize, rd: &Path, shm: &Path, launch: &[&str], extra: &[&str]) -> Command {
    let np_s = np.to_string();
    let mut c = common::kiln_cmd(&["launch", "--np", &np_s]);
    if np > 1 {
        c.arg("--mpi");
    }
    c.args(launch).arg("--run-dir").arg(rd).args([
        "--",
        common::KILN,
        "train",
        "--no-progress-bar",
        "--run-dir",
    ]);
    c.arg(rd);
    let all = common::TINY_MODEL
        .iter()
        .map(|s| s.to_string())
        .chain(sets(shm))
        .chain(extra.iter().map(|s| s.to_string()));
    for s in all {
        c.arg("--set").arg(s);
    }
    c
}

/// The `nodes_released` events of the run in `rd`.
fn released(rd: &Path) -> Vec<serde_json::Value> {
    events(rd, "nodes_released")
}

/// The run folders (`kiln-<hash>`) in the snapshot directory `shm`.
fn tier_folders(shm: &Path) -> Vec<String> {
    std::fs::read_dir(shm)
        .map(|d| {
            d.flatten()
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .collect()
        })
        .unwrap_or_default()
}

/// Issue 46: a launch that gives up after its retries left the memory tier's snapshots in
/// the node's /dev/shm. Without a scheduler the default keeps them (the same command
/// resumes on this machine: see the Slurm tests for the default under one); told to
/// (`--memory-tier-at-end remove`), the launch removes them once it ends for good. Here its
/// trainer is SIGKILLed in both attempts of `--retries 1`: the run's folder is gone from
/// the snapshot directory and `nodes_released` says so.
#[test]
fn a_launch_that_gives_up_removes_its_memory_tier_when_told() {
    let tmp = tempfile::tempdir().unwrap();
    let (rd, shm) = (tmp.path().join("run"), tmp.path().join("shm"));
    let flags = [
        "--retries",
        "1",
        "--backoff",
        "0.2",
        "--memory-tier-at-end",
        "remove",
    ];
    let mut job = launch_train(1, &rd, &shm, &flags, &[])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    for attempt in 1..=2 {
        wait_for_snapshots(&shm, 1, &mut job);
        let t0 = Instant::now();
        let pid = loop {
            if let Some(p) = common::trainer_pid(&rd, 0) {
                break p;
            }
            assert!(
                t0.elapsed() < Duration::from_secs(60),
                "attempt {attempt}: no trainer"
            );
            std::thread::sleep(Duration::from_millis(10));
        };
        sigkill(pid);
        // The next attempt's trainer resumes from these snapshots and writes newer ones.
        let t0 = Instant::now();
        while attempt == 1 && common::trainer_pid(&rd, 0).is_none_or(|p| p == pid) {
            assert!(t0.elapsed() < Duration::from_secs(60), "no second attempt");
            std::thread::sleep(Duration::from_millis(10));
        }
    }
    let status = job.wait().unwrap();
    assert!(!status.success(), "both attempts were killed");
    assert_eq!(
        tier_folders(&shm),
        Vec::<String>::new(),
        "left in {}",
        shm.display()
    );
    let r = released(&rd);
    assert_eq!(r.len(), 1, "{r:?}");
    assert_eq!(r[0]["kept"], false);
    assert_eq!(r[0]["removed"].as_array().unwrap().len(), 1, "{r:?}");
    assert_eq!(r[0]["failed"], serde_json::json!([]), "{r:?}");
}

/// Held out: three ranks under mpirun that end at the walltime (they checkpoint and exit 75).
/// Without a scheduler the default keeps every rank's snapshots (this machine is where the
/// same command resumes); `--memory-tier-at-end remove` removes them all.
#[cfg(feature = "mpi")]
#[test]
fn a_launch_that_ends_at_the_walltime_keeps_its_memory_tier_only_where_it_resumes() {
    let tmp = tempfile::tempdir().unwrap();
    for remove in [false, true] {
        let rd = tmp.path().join(format!("run-{remove}"));
        let shm = tmp.path().join(format!("shm-{remove}"));
        let mut flags = vec!["--walltime", "12", "--timeout", "120"];
        if remove {
            flags.extend(["--memory-tier-at-end", "remove"]);
        }
        let mut job = launch_train(3, &rd, &shm, &flags, &["training.steps=1000000"])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        wait_for_snapshots(&shm, 3, &mut job);
        let status = job.wait().unwrap();
        assert_eq!(
            status.code(),
            Some(75),
            "remove={remove}: the walltime stop"
        );
        let r = released(&rd);
        assert_eq!(r.len(), 1, "remove={remove}: {r:?}");
        assert_eq!(r[0]["kept"], !remove, "{r:?}");
        if remove {
            assert_eq!(tier_folders(&shm), Vec::<String>::new());
        } else {
            let folders = tier_folders(&shm);
            assert_eq!(folders.len(), 1, "{folders:?}");
            assert!((0..3).all(|rank| !snapshot_steps(&shm, rank).is_empty()));
        }
    }
}

/// This run's memory-tier folder in `shm` (several runs share it in the test below).
fn tier_of(rd: &Path, shm: &Path) -> std::path::PathBuf {
    kiln_train::components::checkpoints::snapshot::run_folder(&shm.display().to_string(), rd)
}

/// Runs one rank in `rd` until it holds two snapshots, then sends it `sig` (SIGKILL, or
/// SIGTERM: it checkpoints after its snapshots) and waits for it.
fn interrupt(rd: &Path, shm: &Path, sig: i32) {
    let mut child = command(1, rd, shm)
        .args(["--set", "guards.snapshot_interval=0"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("spawn kiln");
    let store = tier_of(rd, shm).join("rank-0");
    let t0 = Instant::now();
    while kiln_train::checkpoint::list_steps(&store).len() < 2 {
        assert!(
            child.try_wait().unwrap().is_none(),
            "ended before two snapshots"
        );
        assert!(t0.elapsed() < Duration::from_secs(120), "no two snapshots");
        std::thread::sleep(Duration::from_millis(2));
    }
    signal(child.id() as i32, sig);
    assert!(
        !child.wait().unwrap().success(),
        "the interrupted run must not succeed"
    );
}

/// Issue 60: memory tiers outlived their use (four folders in /dev/shm after a day of
/// ordinary runs, tens of GB each on a 7B model). The next kiln start on the node reclaims the
/// other runs' tiers that no resume can use (a run directory gone; snapshots older than the
/// run's newest checkpoint), says so in its events, and keeps the one a resume needs, which
/// `kiln status` and `kiln doctor` show and from which that run then resumes.
#[test]
fn tiers_no_resume_can_use_are_reclaimed_by_the_next_start_on_the_node() {
    let tmp = tempfile::tempdir().unwrap();
    let shm = tmp.path().join("shm");
    let [gone, stopped, kept, other] =
        ["gone", "stopped", "kept", "other"].map(|n| tmp.path().join(n));
    interrupt(&gone, &shm, libc::SIGKILL);
    interrupt(&stopped, &shm, libc::SIGTERM);
    assert!(
        tier_of(&stopped, &shm).exists(),
        "a stopped run keeps its tier"
    );
    // Its start reclaims the stopped run's tier: every snapshot is older than its checkpoint.
    interrupt(&kept, &shm, libc::SIGKILL);
    let reclaimed = events(&kept, "memory_tier_reclaimed");
    assert_eq!(reclaimed.len(), 1, "{reclaimed:?}");
    assert_eq!(
        reclaimed[0]["folder"],
        tier_of(&stopped, &shm).display().to_string()
    );
    assert_eq!(reclaimed[0]["removed"], true);
    assert!(
        reclaimed[0]["why"]
            .as_str()
            .unwrap()
            .contains("older than its run's newest checkpoint")
    );
    assert!(reclaimed[0]["bytes"].as_u64().unwrap() > 0);
    assert!(!tier_of(&stopped, &shm).exists());

    let doctor = common::kiln_cmd(&["doctor", "--snapshot-dir"])
        .arg(&shm)
        .output()
        .unwrap();
    let doctor = String::from_utf8_lossy(&doctor.stdout);
    assert!(doctor.contains("memory tiers:  2 in"), "{doctor}");
    assert_eq!(
        doctor
            .matches("kept: its run has no persistent checkpoint")
            .count(),
        2,
        "{doctor}"
    );
    let status = common::kiln_cmd(&["status"]).arg(&kept).output().unwrap();
    let status = String::from_utf8_lossy(&status.stdout);
    assert!(
        status.contains("memory tier on ") && status.contains("2 snapshots"),
        "{status}"
    );

    std::fs::remove_dir_all(&gone).unwrap();
    let mut short = command(1, &other, &shm);
    let out = short.args(["--set", "training.steps=10"]).output().unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let reclaimed = events(&other, "memory_tier_reclaimed");
    assert_eq!(reclaimed.len(), 1, "{reclaimed:?}");
    assert!(
        reclaimed[0]["why"].as_str().unwrap().contains("is gone"),
        "{reclaimed:?}"
    );
    let left: Vec<std::path::PathBuf> = std::fs::read_dir(&shm)
        .unwrap()
        .flatten()
        .map(|e| e.path())
        .collect();
    assert_eq!(
        left,
        [tier_of(&kept, &shm)],
        "only the tier a resume needs is left"
    );

    let held = kiln_train::checkpoint::list_steps(&tier_of(&kept, &shm).join("rank-0"));
    run_ok(1, &kept, &shm);
    let resumed = events(&kept, "resume");
    assert_eq!(resumed.last().unwrap()["tier"], "memory", "{resumed:?}");
    assert_eq!(resumed.last().unwrap()["step"], held[0]);
}

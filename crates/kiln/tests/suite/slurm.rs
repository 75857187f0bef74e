//! Node and job scope against a real Slurm (Debian's slurm-wlm, started by each test in its
//! own directory and port range; see `common/slurm.rs`), training with the real `kiln train`.
//! Without Slurm installed these tests fail on purpose (`.ci/run` installs it).
//!
//! Multi-node jobs train data-parallel over MPI (srun with PMIx) when kiln is built with the
//! `mpi` feature, as the README's test command builds it. Without it, rank 0 is the real
//! trainer and the other ranks stand in for its replicas: each follows rank 0's progress in
//! its own beacon (with its own host) and ends when rank 0 is done. Either way a downed node
//! or a stopped rank is what node scope must find and replace.

use crate::common;

use common::KILN;
use common::slurm::DATA_PARALLEL;
use common::slurm::{Cluster, submit, wait_until};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

/// The trainer of every Slurm test: tiny, one thread, checkpoints every 50 steps.
fn train_sets(steps: u64) -> Vec<String> {
    let mut v: Vec<String> = common::TINY_MODEL.iter().map(|s| s.to_string()).collect();
    v.extend([
        "model.n_layers=1".to_string(),
        "training.threads=1".to_string(),
        format!("training.steps={steps}"),
        "checkpoint.interval=50".to_string(),
        "eval.interval=0".to_string(),
        "training.batch_size=2".to_string(),
        "training.compute_shards=1".to_string(),
    ]);
    v
}

fn train_args(run: &Path, steps: u64) -> Vec<String> {
    train_args_with(run, steps, &[])
}

/// [`train_args`] with more `--set`s.
fn train_args_with(run: &Path, steps: u64, extra: &[&str]) -> Vec<String> {
    let mut a = vec![
        KILN.to_string(),
        "train".into(),
        "--run-dir".into(),
        run.display().to_string(),
        "--no-progress-bar".into(),
    ];
    for s in train_sets(steps)
        .iter()
        .map(String::as_str)
        .chain(extra.iter().copied())
    {
        a.push("--set".into());
        a.push(s.to_string());
    }
    a
}

/// The same training run on `ranks` ranks, uninterrupted, for the weights to compare with
/// (data-parallel ranks through a local `kiln launch --mpi`).
fn reference_weights(dir: &Path, steps: u64, ranks: usize) -> Vec<u8> {
    let run = dir.join("reference");
    let mut args = train_args(&run, steps);
    if ranks > 1 && DATA_PARALLEL {
        let np = ranks.to_string();
        let mut launch: Vec<String> = [KILN, "launch", "--mpi", "--np", &np, "--run-dir"]
            .iter()
            .map(|s| s.to_string())
            .collect();
        launch.push(run.display().to_string());
        launch.push("--".into());
        launch.append(&mut args);
        args = launch;
    }
    let mut cmd = Command::new(&args[0]);
    cmd.args(&args[1..]);
    for v in [
        "SLURM_JOB_ID",
        "SLURM_JOBID",
        "PBS_JOBID",
        "KILN_PROGRESS_DIR",
        "RANK",
        "WORLD_SIZE",
    ] {
        cmd.env_remove(v);
    }
    let out = cmd.output().unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    std::fs::read(run.join("model.safetensors")).unwrap()
}

/// Training steps that take about `target` on this machine now (measured on 300 steps).
fn steps_for(dir: &Path, target: Duration) -> u64 {
    let args = train_args(&dir.join("calibrate"), 300);
    let t = std::time::Instant::now();
    let out = Command::new(&args[0]).args(&args[1..]).output().unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let per_step = t.elapsed().as_secs_f64() / 300.0;
    ((target.as_secs_f64() / per_step) as u64).clamp(1000, 200_000) / 50 * 50
}

/// What every rank of a multi-node job runs: the data-parallel trainer, or (without MPI)
/// the rank script.
fn rank_command(dir: &Path, run: &Path, steps: u64) -> Vec<String> {
    if DATA_PARALLEL {
        train_args(run, steps)
    } else {
        vec![
            "sh".into(),
            common::slurm::standin_rank_script(dir, &train_args(run, steps))
                .display()
                .to_string(),
        ]
    }
}

fn events(run: &Path) -> Vec<kiln_run::Event> {
    kiln_run::read_events(run).unwrap_or_default()
}

fn named<'a>(ev: &'a [kiln_run::Event], name: &str) -> Vec<&'a kiln_run::Event> {
    ev.iter().filter(|e| e.event == name).collect()
}

fn job_output(run: &Path) -> String {
    let mut all = String::new();
    for e in std::fs::read_dir(run).unwrap().filter_map(Result::ok) {
        let name = e.file_name().to_string_lossy().into_owned();
        if name.starts_with("job-") && name.ends_with(".out") {
            all += &std::fs::read_to_string(e.path()).unwrap_or_default();
        }
    }
    all
}

fn last_step(run: &Path) -> u64 {
    named(&events(run), "checkpoint_saved")
        .iter()
        .filter_map(|e| e.fields["step"].as_u64())
        .max()
        .unwrap_or(0)
}

/// Once job `id` saved step 100, SIGSTOPs rank 1's process and waits for the job to
/// complete (asserted); returns the job's output and the run's events.
fn stop_rank_1_until_completed(
    cluster: &Cluster,
    dir: &Path,
    run: &Path,
    id: &str,
) -> (String, Vec<kiln_run::Event>) {
    wait_until(Duration::from_secs(120), "a checkpoint at step 100", || {
        last_step(run) >= 100
    });
    let pid = common::slurm::rank_pid(dir, run, 1).expect("rank 1's process");
    // SAFETY: kill(2) on a rank process this test's cluster started.
    assert_eq!(unsafe { libc::kill(pid, libc::SIGSTOP) }, 0);
    let state = cluster.wait_job(id, Duration::from_secs(240));
    let out = job_output(run);
    assert_eq!(state, "COMPLETED", "{out}");
    (out, events(run))
}

/// A job of `steps` steps on 3 of a 4-node cluster with the fourth node its spare (30 s
/// silence watchdog, 0.5 s backoff, and `extra` flags): the cluster, the test's directory,
/// the run directory and the job's id.
fn three_nodes_and_a_spare(steps: u64, extra: &[&str]) -> (Cluster, PathBuf, PathBuf, String) {
    let cluster = Cluster::start(4, 2);
    let dir = cluster.dir.path().join("t");
    std::fs::create_dir_all(&dir).unwrap();
    let run = dir.join("run");
    let command = rank_command(&dir, &run, steps);
    let mut flags = vec![
        "--nodes",
        "3",
        "--spares",
        "1",
        "--time",
        "10:00",
        "--launch-arg=--timeout=30",
        "--launch-arg=--backoff=0.5",
    ];
    flags.extend(extra);
    let id = submit(&cluster, &run, &flags, &command);
    (cluster, dir, run, id)
}

#[test]
fn a_downed_node_is_named_swapped_for_the_spare_and_quarantined() {
    let steps = 1200;
    let (cluster, dir, run, id) = three_nodes_and_a_spare(steps, &[]);
    wait_until(Duration::from_secs(120), "a checkpoint at step 200", || {
        last_step(&run) >= 200
    });
    cluster.down("n2");
    let state = cluster.wait_job(&id, Duration::from_secs(240));
    let out = job_output(&run);
    assert_eq!(state, "COMPLETED", "{out}");
    let ev = events(&run);
    let ends = named(&ev, "attempt_end");
    assert!(ends.len() >= 2, "{out}");
    let failed = ends[0];
    assert_eq!(
        failed.fields["cause"], "node-failure",
        "{:?}\n{out}",
        failed.fields
    );
    assert_eq!(failed.fields["culprit_hosts"], serde_json::json!(["n2"]));
    let swap = named(&ev, "node_swap");
    assert_eq!(swap.len(), 1, "{out}");
    assert_eq!(
        (
            swap[0].fields["host"].as_str(),
            swap[0].fields["replacement"].as_str()
        ),
        (Some("n2"), Some("n4"))
    );
    assert_eq!(swap[0].fields["blind"], false);
    assert_eq!(
        ends[1].fields["hosts"],
        serde_json::json!(["n1", "n4", "n3"])
    );
    assert_eq!(ends.last().unwrap().fields["classification"], "success");
    let q = kiln_launch::read_quarantine(&run.join("quarantine.jsonl")).unwrap();
    assert_eq!(q.len(), 1);
    assert_eq!(
        (q[0].host.as_str(), q[0].cause.as_str()),
        ("n2", "node-failure")
    );
    assert!(q[0].evidence.contains("n2"), "{}", q[0].evidence);
    let launch_end = named(&ev, "launch_end");
    assert_eq!(launch_end[0].fields["exit_code"], 0);
    // Resumed from the last checkpoint: the same weights as a run never interrupted.
    let weights = std::fs::read(run.join("model.safetensors")).unwrap();
    assert!(
        weights == reference_weights(&dir, steps, if DATA_PARALLEL { 3 } else { 1 }),
        "final weights differ from an uninterrupted run"
    );
    // kiln status shows the ledger and the swap.
    let status = Command::new(KILN).arg("status").arg(&run).output().unwrap();
    let text = String::from_utf8_lossy(&status.stdout);
    assert!(text.contains("ETTR") && text.contains("n2 -> n4"), "{text}");
}

#[test]
fn a_hang_on_one_rank_is_named_by_its_host_and_swapped() {
    let (cluster, dir, run, id) = three_nodes_and_a_spare(
        900,
        &[
            "--launch-arg=--stall-timeout=3",
            "--launch-arg=--grace=5",
            // Its first strike swaps the host (the default, 2, retries in place first).
            "--launch-arg=--strikes=1",
        ],
    );
    // Rank 1 (on n2) is stopped: its heartbeats stop (the others' go on), so the liveness
    // watchdog, not the slower stall watchdog, ends the attempt and names it.
    let (out, ev) = stop_rank_1_until_completed(&cluster, &dir, &run, &id);
    let ends = named(&ev, "attempt_end");
    let hung = ends[0];
    assert_eq!(hung.fields["classification"], "no-heartbeat", "{out}");
    assert_eq!(hung.fields["culprit_ranks"], serde_json::json!([1]));
    let detect = hung.fields["detect_s"]
        .as_f64()
        .expect("detection time recorded");
    assert!(
        detect < 3.0,
        "found by liveness, before the 3 s stall watchdog: {detect}"
    );
    assert_eq!(hung.fields["cause"], "hang");
    assert_eq!(hung.fields["culprit_hosts"], serde_json::json!(["n2"]));
    let swap = named(&ev, "node_swap");
    assert_eq!(swap[0].fields["host"], "n2");
    assert_eq!(swap[0].fields["replacement"], "n4");
    assert_eq!(ends.last().unwrap().fields["classification"], "success");
    assert_eq!(
        kiln_launch::read_quarantine(&run.join("quarantine.jsonl")).unwrap()[0].cause,
        "hang"
    );
}

/// The control plane on a real Slurm: the shim of rank 1, which on n2 also runs the node's
/// agent, is SIGKILLed (its trainer dies with it: no exit record is written). The agent's
/// connection drops, kiln takes n2 as lost at once (well before the 30 s silence watchdog),
/// names it and swaps it for the spare, and the job completes.
#[test]
fn a_lost_node_agent_is_its_node_lost_named_and_swapped() {
    let (cluster, dir, run, id) = three_nodes_and_a_spare(900, &["--launch-arg=--strikes=1"]);
    wait_until(Duration::from_secs(120), "a checkpoint at step 100", || {
        last_step(&run) >= 100
    });
    let rank = common::slurm::rank_pid(&dir, &run, 1).expect("rank 1's process");
    let stat = std::fs::read_to_string(format!("/proc/{rank}/stat")).unwrap();
    let after_name = &stat[stat.rfind(')').unwrap() + 2..];
    let shim: i32 = after_name
        .split_whitespace()
        .nth(1)
        .unwrap()
        .parse()
        .unwrap();
    let cmdline = std::fs::read(format!("/proc/{shim}/cmdline")).unwrap();
    assert!(
        String::from_utf8_lossy(&cmdline).contains("--as-rank"),
        "rank 1's parent is its shim"
    );
    // SAFETY: kill(2) on the shim this test's cluster started.
    assert_eq!(unsafe { libc::kill(shim, libc::SIGKILL) }, 0);
    let state = cluster.wait_job(&id, Duration::from_secs(240));
    let out = job_output(&run);
    assert_eq!(state, "COMPLETED", "{out}");
    let ev = events(&run);
    let ends = named(&ev, "attempt_end");
    let lost = &ends[0].fields;
    assert_eq!(
        lost["culprit_hosts"],
        serde_json::json!(["n2"]),
        "{lost:?}\n{out}"
    );
    assert_eq!(
        (&lost["classification"], &lost["culprit_source"]),
        (
            &serde_json::json!("no-heartbeat"),
            &serde_json::json!("agent")
        ),
        "{lost:?}"
    );
    assert!(
        lost["detect_s"].as_f64().is_some_and(|s| s < 5.0),
        "found by the plane, not the 30 s watchdog: {lost:?}"
    );
    let swap = named(&ev, "node_swap");
    assert_eq!(swap[0].fields["host"], "n2", "{out}");
    assert_eq!(ends.last().unwrap().fields["classification"], "success");
}

/// A stopped rank (its shim kills it once its heartbeat is silent) leaves its peer on another
/// node blocked in the all-reduce, deaf to SIGTERM. kiln's SIGKILL after the grace reaches
/// srun, but srun's death does not end the peer: Slurm would only kill it after `KillWait`
/// (60 s here), and until then it holds the run directory's lock against the next attempt
/// (whose trainer gives up after 10 s: the job fails, as it did without the escalation
/// through the shims). The peer's shim must kill it: the job then recovers in one retry on
/// the same hosts.
#[cfg(feature = "mpi")]
#[test]
fn a_peer_blocked_in_a_collective_is_killed_through_its_shim_not_left_to_slurm() {
    let cluster = Cluster::start_with_kill_wait(3, 2, 60);
    let dir = cluster.dir.path().join("t");
    std::fs::create_dir_all(&dir).unwrap();
    let run = dir.join("run");
    let steps = 900;
    let command = rank_command(&dir, &run, steps);
    let id = submit(
        &cluster,
        &run,
        &[
            "--nodes",
            "2",
            "--time",
            "10:00",
            "--launch-arg=--timeout=30",
            "--launch-arg=--backoff=0.5",
        ],
        &command,
    );
    let (out, ev) = stop_rank_1_until_completed(&cluster, &dir, &run, &id);
    let ends = named(&ev, "attempt_end");
    let classes: Vec<_> = ends.iter().map(|e| &e.fields["classification"]).collect();
    assert_eq!(classes, ["no-heartbeat", "success"], "{out}");
    assert_eq!(ends[0].fields["culprit_ranks"], serde_json::json!([1]));
    assert_eq!(
        ends[1].fields["hosts"], ends[0].fields["hosts"],
        "same hosts"
    );
    let weights = std::fs::read(run.join("model.safetensors")).unwrap();
    assert!(
        weights == reference_weights(&dir, steps, 2),
        "final weights differ from an uninterrupted run"
    );
}

#[test]
fn two_attempts_without_a_step_stop_the_loop_without_using_spares() {
    let cluster = Cluster::start(4, 2);
    let run = cluster.dir.path().join("run");
    let id = submit(
        &cluster,
        &run,
        &[
            "--nodes",
            "3",
            "--spares",
            "1",
            "--time",
            "5:00",
            "--launch-arg=--backoff=0.2",
        ],
        &[
            "sh".into(),
            "-c".into(),
            "echo 'RuntimeError: cannot open shard 7'; exit 1".into(),
        ],
    );
    cluster.wait_job(&id, Duration::from_secs(120));
    let out = job_output(&run);
    let ev = events(&run);
    let ends = named(&ev, "attempt_end");
    assert_eq!(ends.len(), 2, "{out}");
    // A failure before any step uses no spare (whichever rank happened to fail first):
    // both attempts ran on the same hosts.
    assert_eq!(ends[0].fields["hosts"], ends[1].fields["hosts"]);
    assert!(named(&ev, "node_swap").is_empty(), "{out}");
    assert!(named(&ev, "quarantine").is_empty());
    let stopped = named(&ev, "stopped");
    assert!(
        stopped[0].fields["reason"]
            .as_str()
            .unwrap()
            .contains("completed no step"),
        "{out}"
    );
    assert_eq!(named(&ev, "launch_end")[0].fields["exit_code"], 1);
    assert!(!run.join("quarantine.jsonl").exists());
}

#[test]
fn a_chained_job_crosses_the_walltime_through_a_usr1_checkpoint_with_the_same_weights() {
    let cluster = Cluster::start(1, 2);
    let dir = cluster.dir.path().join("t");
    std::fs::create_dir_all(&dir).unwrap();
    let run = dir.join("run");
    // About 45 s of training on this machine now: more than fits before the first job's
    // warning (about 30 s into a 1-minute job), on a quiet or a busy machine.
    let steps = steps_for(&dir, Duration::from_secs(45));
    let reference = std::thread::spawn({
        let dir = dir.clone();
        move || reference_weights(&dir, steps, 1)
    });
    let first = submit(
        &cluster,
        &run,
        &[
            "--nodes",
            "1",
            "--spares",
            "0",
            "--time",
            "1:00",
            "--chain",
            "6",
            "--launch-arg=--backoff=0.5",
        ],
        &train_args(&run, steps),
    );
    cluster.wait_job(&first, Duration::from_secs(120));
    wait_until(Duration::from_secs(420), "the chain to end", || {
        named(&events(&run), "chain")
            .iter()
            .any(|e| e.fields["decision"] == "end")
    });
    let out = job_output(&run);
    let ev = events(&run);
    let chain = named(&ev, "chain");
    let last = chain.last().unwrap();
    assert_eq!(last.fields["reason"], "the run completed", "{out}");
    let jobs = named(&ev, "job_submitted");
    assert!(
        jobs.len() >= 2,
        "one job did it all: make the run longer\n{out}"
    );
    // The first job ended on the walltime warning: kiln got USR1 and forwarded it, the trainer
    // checkpointed and exited 75, and the next job resumed.
    let signals: Vec<i64> = named(&ev, "signal")
        .iter()
        .filter_map(|e| e.fields["signal"].as_i64())
        .collect();
    assert!(
        signals.contains(&(libc::SIGUSR1 as i64)),
        "{signals:?}\n{out}"
    );
    assert_eq!(chain[0].fields["exit_code"], 75);
    assert!(!named(&ev, "resume").is_empty());
    assert_eq!(named(&ev, "job_start").len(), jobs.len());
    let weights = std::fs::read(run.join("model.safetensors")).unwrap();
    assert!(
        weights == reference.join().unwrap(),
        "chained weights differ from one long job"
    );
    let status = Command::new(KILN).arg("status").arg(&run).output().unwrap();
    let text = String::from_utf8_lossy(&status.stdout);
    assert!(text.contains("queue") && text.contains("ETTR"), "{text}");
}

#[test]
fn a_replica_mismatch_swaps_the_host_of_the_named_rank() {
    let cluster = Cluster::start(4, 2);
    let run = cluster.dir.path().join("run");
    // Attempt 1: rank 1 reports that its parameters disagree (the trainer's event and exit
    // code), as a data-parallel trainer does on a corrupting host. Attempt 2 runs clean.
    let program = format!(
        r#"if [ "$RANK" = 1 ] && [ ! -e "{r}/mismatched" ]; then
  touch "{r}/mismatched"
  printf '{{"time":%s,"source":"train","event":"replica_mismatch","step":5,"ranks":[1]}}\n' "$(date +%s.%N)" >> "{r}/events.jsonl"
  exit 76
fi
sleep 0.5; echo step=1; sleep 0.5; echo step=2"#,
        r = run.display()
    );
    std::fs::create_dir_all(&run).unwrap();
    let id = submit(
        &cluster,
        &run,
        &[
            "--nodes",
            "3",
            "--spares",
            "1",
            "--time",
            "5:00",
            "--launch-arg=--backoff=0.2",
        ],
        &["sh".into(), "-c".into(), program],
    );
    cluster.wait_job(&id, Duration::from_secs(120));
    let out = job_output(&run);
    let ev = events(&run);
    let ends = named(&ev, "attempt_end");
    assert_eq!(ends.len(), 2, "{out}");
    assert_eq!(
        ends[0].fields["classification"], "replica-mismatch",
        "{out}"
    );
    assert_eq!(ends[0].fields["exit_code"], 76);
    assert_eq!(ends[0].fields["cause"], "replica-mismatch");
    assert_eq!(ends[0].fields["culprit_hosts"], serde_json::json!(["n2"]));
    let swap = named(&ev, "node_swap");
    assert_eq!(
        (
            swap[0].fields["host"].as_str(),
            swap[0].fields["replacement"].as_str()
        ),
        (Some("n2"), Some("n4"))
    );
    assert_eq!(ends[1].fields["classification"], "success");
}

#[test]
fn with_no_spare_left_the_job_shrinks_to_min_nodes() {
    let cluster = Cluster::start(3, 2);
    let dir = cluster.dir.path().join("t");
    std::fs::create_dir_all(&dir).unwrap();
    let run = dir.join("run");
    // A global batch that 3 and 2 ranks share evenly: the trainer resumes at fewer ranks with
    // the same samples per step.
    let command = if DATA_PARALLEL {
        train_args_with(&run, 900, &["training.global_batch_size=12"])
    } else {
        rank_command(&dir, &run, 900)
    };
    let id = submit(
        &cluster,
        &run,
        &[
            "--nodes",
            "3",
            "--spares",
            "0",
            "--time",
            "10:00",
            "--launch-arg=--min-nodes=2",
            "--launch-arg=--timeout=30",
            "--launch-arg=--backoff=0.5",
        ],
        &command,
    );
    wait_until(Duration::from_secs(120), "a checkpoint at step 100", || {
        last_step(&run) >= 100
    });
    cluster.down("n3");
    let state = cluster.wait_job(&id, Duration::from_secs(240));
    let out = job_output(&run);
    assert_eq!(state, "COMPLETED", "{out}");
    let ev = events(&run);
    let shrink = named(&ev, "shrink");
    assert_eq!(shrink.len(), 1, "{out}");
    assert_eq!(shrink[0].fields["dropped"], "n3");
    let starts = named(&ev, "attempt_start");
    assert_eq!(starts[1].fields["hosts"], serde_json::json!(["n1", "n2"]));
    assert_eq!(starts[1].fields["np"], 2);
    assert_eq!(
        named(&ev, "attempt_end").last().unwrap().fields["classification"],
        "success"
    );
}

/// The steps of the memory snapshots rank `rank` holds in the snapshot directory `shm`.
fn snapshots_in(shm: &Path, rank: usize) -> usize {
    std::fs::read_dir(shm)
        .ok()
        .and_then(|mut d| d.next())
        .and_then(Result::ok)
        .and_then(|run_folder| {
            std::fs::read_dir(run_folder.path().join(format!("rank-{rank}"))).ok()
        })
        .map_or(0, |steps| steps.count())
}

/// Issue 46: a job that gives up after its retries left its memory tier in the node's
/// /dev/shm (RAM the next user of the node does not get back). Here a one-node job's
/// trainer is SIGKILLed in every attempt until recovery gives up; under a scheduler the
/// allocation ends with the job, so by default its snapshots go: none is left, and
/// `nodes_released` says what went.
#[test]
fn a_job_that_gives_up_after_its_retries_releases_its_memory_tier() {
    let cluster = Cluster::start(1, 2);
    let dir = cluster.dir.path().join("t");
    std::fs::create_dir_all(&dir).unwrap();
    let run = dir.join("run");
    let shm = dir.join("shm");
    let snapshot_dir = format!("checkpoint.snapshot_dir={}", shm.display());
    let command = train_args_with(
        &run,
        1_000_000,
        &["checkpoint.snapshot_interval=3", snapshot_dir.as_str()],
    );
    let id = submit(
        &cluster,
        &run,
        &[
            "--nodes",
            "1",
            "--spares",
            "0",
            "--time",
            "10:00",
            "--launch-arg=--backoff=0.5",
            "--launch-arg=--timeout=60",
        ],
        &command,
    );
    // The first attempt's trainer once it holds a snapshot, then every later attempt's as
    // soon as it starts: attempts that get no further make kiln's recovery give up.
    let mut killed: Vec<i32> = Vec::new();
    let t0 = std::time::Instant::now();
    while named(&events(&run), "launch_end").is_empty() {
        assert!(
            t0.elapsed() < Duration::from_secs(240),
            "the launch never gave up: {}",
            job_output(&run)
        );
        let ready = !killed.is_empty() || snapshots_in(&shm, 0) >= 1;
        if let Some(pid) = common::trainer_pid(&run, 0).filter(|p| !killed.contains(p))
            && ready
        {
            // SAFETY: kill(2) on the trainer this test's cluster started.
            unsafe { libc::kill(pid, libc::SIGKILL) };
            killed.push(pid);
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    assert!(killed.len() >= 2, "{killed:?}");
    cluster.wait_job(&id, Duration::from_secs(240));
    let out = job_output(&run);
    let ends = named(&events(&run), "attempt_end").len();
    assert_eq!(ends, killed.len(), "{out}");
    let left: Vec<_> = std::fs::read_dir(&shm)
        .unwrap()
        .flatten()
        .map(|e| e.path())
        .collect();
    assert!(
        left.is_empty(),
        "left in the snapshot directory: {left:?}\n{out}"
    );
    let ev = events(&run);
    let released = named(&ev, "nodes_released");
    assert_eq!(released.len(), 1, "{out}");
    let r = &released[0].fields;
    assert_eq!(r["kept"], false, "{r:?}");
    assert_eq!(r["host"], "n1", "{r:?}");
    assert_eq!(r["removed"].as_array().map(Vec::len), Some(1), "{r:?}");
    assert_eq!(r["failed"], serde_json::json!([]), "{r:?}");
}

/// Held out: a two-node job whose ranks keep memory snapshots (in a snapshot directory of
/// the test) ends at its walltime (kiln submit's stop before the limit: the ranks
/// checkpoint and exit 75). kiln launch, on n1, removes the tier there itself and runs
/// `kiln launch --release-node` through srun on n2: no rank's snapshots and no node record
/// is left, and `nodes_released` names n2 as released through the launcher.
#[cfg(feature = "mpi")]
#[test]
fn the_end_of_a_job_releases_every_nodes_memory_tier_through_srun() {
    let cluster = Cluster::start(2, 2);
    let dir = cluster.dir.path().join("t");
    std::fs::create_dir_all(&dir).unwrap();
    let run = dir.join("run");
    let shm = dir.join("shm");
    let snapshot_dir = format!("checkpoint.snapshot_dir={}", shm.display());
    let command = train_args_with(
        &run,
        1_000_000,
        &[
            "checkpoint.snapshot_interval=3",
            "checkpoint.snapshot_keep=2",
            snapshot_dir.as_str(),
        ],
    );
    let id = submit(
        &cluster,
        &run,
        &[
            "--nodes",
            "2",
            "--spares",
            "0",
            "--time",
            "1:00",
            "--launch-arg=--timeout=60",
        ],
        &command,
    );
    let snapshots = || {
        (0..2).all(|r| {
            std::fs::read_dir(&shm)
                .ok()
                .and_then(|mut d| d.next())
                .and_then(Result::ok)
                .is_some_and(|run_folder| {
                    std::fs::read_dir(run_folder.path().join(format!("rank-{r}")))
                        .is_ok_and(|mut steps| steps.next().is_some())
                })
        })
    };
    let t0 = std::time::Instant::now();
    while !snapshots() {
        assert!(
            t0.elapsed() < Duration::from_secs(120),
            "no snapshots of both ranks: {}",
            job_output(&run)
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    let state = cluster.wait_job(&id, Duration::from_secs(240));
    let out = job_output(&run);
    assert!(
        matches!(state.as_str(), "COMPLETED" | "FAILED"),
        "{state}: {out}"
    );
    let left: Vec<_> = std::fs::read_dir(&shm)
        .unwrap()
        .flatten()
        .map(|e| e.path())
        .collect();
    assert!(
        left.is_empty(),
        "left in the snapshot directory: {left:?}\n{out}"
    );
    let records: Vec<_> = std::fs::read_dir(run.join("progress"))
        .unwrap()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with("node-"))
        .collect();
    assert!(records.is_empty(), "{records:?}");
    let ev = events(&run);
    let released = named(&ev, "nodes_released");
    assert_eq!(released.len(), 1, "{out}");
    let r = &released[0].fields;
    assert_eq!(r["kept"], false, "{r:?}");
    assert_eq!(r["host"], "n1", "{r:?}");
    assert_eq!(r["hosts"], serde_json::json!(["n2"]), "{r:?}");
    assert_eq!(r["failed"], serde_json::json!([]), "{r:?}\n{out}");
}

//! Stragglers named for real: a 3-rank data-parallel run in which one rank is slowed by
//! SIGSTOP/SIGCONT cycling (stopped 15 or 18 ms of every 20 ms, a period shorter than a step, so
//! every step of that rank is slowed alike, as a throttled CPU would be), on a real MPI (`kiln launch --mpi`)
//! and on the test Slurm; `kiln launch` names that rank (and its host) first in a `straggler`
//! event and `kiln status` shows it. (On a machine this loaded, CPU contention alone can keep
//! another rank above the factor for a window: the test asks that the slowed rank is named
//! as the worst, not that no other ever is.)

use crate::common;

use common::KILN;
use std::path::Path;
use std::process::Command;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

/// A trainer of `steps` steps of about ten milliseconds each.
fn train_args(run: &Path, steps: u64) -> Vec<String> {
    let mut a = vec![
        KILN.to_string(),
        "train".into(),
        "--run-dir".into(),
        run.display().to_string(),
        "--no-progress-bar".into(),
    ];
    for s in common::TINY_MODEL.iter().map(|s| s.to_string()).chain([
        "training.threads=1".into(),
        "training.compute_shards=1".into(),
        "training.batch_size=8".into(),
        "training.seq_len=64".into(),
        format!("training.steps={steps}"),
        "checkpoint.interval=0".into(),
        "checkpoint.snapshot_interval=0".into(),
        "eval.interval=0".into(),
        "eval.samples=0".into(),
    ]) {
        a.push("--set".into());
        a.push(s);
    }
    a
}

/// Stops and continues `pid`, `stopped_ms` of every 20 ms (15: about 4 x its work per step),
/// until `done`.
fn cycle(pid: i32, stopped_ms: u64, done: Arc<AtomicBool>) -> std::thread::JoinHandle<()> {
    std::thread::spawn(move || {
        while !done.load(Ordering::Relaxed) {
            // SAFETY: kill(2) on a rank process this test started.
            if unsafe { libc::kill(pid, libc::SIGSTOP) } != 0 {
                return;
            }
            std::thread::sleep(Duration::from_millis(stopped_ms));
            unsafe { libc::kill(pid, libc::SIGCONT) };
            std::thread::sleep(Duration::from_millis(20 - stopped_ms));
        }
    })
}

fn stragglers(run: &Path) -> Vec<kiln_run::Event> {
    kiln_run::read_events(run)
        .unwrap_or_default()
        .into_iter()
        .filter(|e| e.event == "straggler")
        .collect()
}

/// The end of the Slurm jobs' output (the ranks' stderr included), for a failure message.
fn job_output(run: &Path) -> String {
    let mut text = String::new();
    for e in std::fs::read_dir(run).into_iter().flatten().flatten() {
        if e.file_name().to_string_lossy().starts_with("job-") {
            text += &std::fs::read_to_string(e.path()).unwrap_or_default();
        }
    }
    let tail = text.len().saturating_sub(6000);
    text[text.ceil_char_boundary(tail)..].to_string()
}

fn status(run: &Path) -> String {
    let o = Command::new(KILN).arg("status").arg(run).output().unwrap();
    String::from_utf8_lossy(&o.stdout).into_owned()
}

/// A 3-rank `kiln launch --mpi` in `run` whose rank 2 is stopped `stopped_ms` of every 20 ms
/// from its start until the launcher names it a straggler (at most two minutes), then
/// preempted (SIGTERM to the launcher, by its PID): the job's output. The job runs until the
/// naming, not for a fixed number of steps: the detector needs two windows of beacon reads
/// (every 200 ms), which a fixed step count ran out of on a faster machine (CI's, at 400).
#[cfg(feature = "mpi")]
fn with_rank_2_slowed(run: &Path, stopped_ms: u64) -> std::process::Output {
    let mut cmd = common::kiln_cmd(&["launch", "--mpi", "--np", "3", "--timeout", "120"]);
    cmd.arg("--run-dir")
        .arg(run)
        .arg("--")
        .args(train_args(run, 1_000_000));
    let mut job = (cmd.stdout(std::process::Stdio::null()))
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut pid = None;
    common::slurm::wait_until(Duration::from_secs(60), "rank 2's trainer", || {
        pid = common::trainer_pid(run, 2);
        pid.is_some()
    });
    let done = Arc::new(AtomicBool::new(false));
    let slow = cycle(pid.unwrap_or_default(), stopped_ms, done.clone());
    let named = || stragglers(run).iter().any(|e| e.fields["rank"] == 2);
    let until = std::time::Instant::now() + Duration::from_secs(120);
    while !named() && std::time::Instant::now() < until {
        if job.try_wait().unwrap().is_some() {
            break;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    done.store(true, Ordering::Relaxed);
    slow.join().unwrap();
    // SAFETY: kill(2) on the launcher this test started (a no-op error if it ended).
    unsafe { libc::kill(job.id() as i32, libc::SIGTERM) };
    job.wait_with_output().unwrap()
}

/// The job of [`with_rank_2_slowed`] ended as preempted (the ranks' exit 75): not by a fault.
#[cfg(feature = "mpi")]
fn preempted(out: &std::process::Output) -> String {
    let err = String::from_utf8_lossy(&out.stderr).into_owned();
    assert_eq!(out.status.code(), Some(kiln_run::exit::PREEMPTED), "{err}");
    err
}

#[cfg(feature = "mpi")]
#[test]
fn a_slowed_rank_is_named_on_a_real_mpi() {
    let dir = tempfile::tempdir().unwrap();
    let run = dir.path().join("run");
    let err = preempted(&with_rank_2_slowed(&run, 15));
    // Rank 2 named, at more than twice its peers' work, and worse than any other rank CPU
    // contention on this machine made the launcher name.
    let named = stragglers(&run);
    let ratio = |e: &kiln_run::Event| e.fields["ratio"].as_f64().unwrap_or_default();
    let two = named.iter().find(|e| e.fields["rank"] == 2);
    let two = two.unwrap_or_else(|| panic!("rank 2 not named: {named:?}\n{err}"));
    assert!(ratio(two) > 2.0, "{named:?}");
    assert!(named.iter().all(|e| ratio(e) <= ratio(two)), "{named:?}");
    assert!(
        err.contains("rank 2 on") && err.contains("is a straggler"),
        "{err}"
    );
    let s = status(&run);
    assert!(s.contains("stragglers: rank 2 on"), "{s}");
}

/// Issue 60: a rank at about half speed (stopped 10 ms of every 20; measured 1.85x its
/// peers' work with 50 ms of every 100) went unnamed under the old factor of 2 while the
/// whole job ran at its pace. It costs the job about half its speed: named, with that cost,
/// in the event and in `kiln status`.
#[cfg(feature = "mpi")]
#[test]
fn a_rank_at_half_speed_is_named_with_what_it_costs() {
    let dir = tempfile::tempdir().unwrap();
    let run = dir.path().join("run");
    let err = preempted(&with_rank_2_slowed(&run, 10));
    let named = stragglers(&run);
    let two = named.iter().find(|e| e.fields["rank"] == 2);
    let two = two.unwrap_or_else(|| panic!("rank 2 not named: {named:?}\n{err}"));
    let cost = two.fields["cost"].as_f64().unwrap();
    assert!(cost >= 0.25, "{two:?}");
    assert!(status(&run).contains("costing the job"), "{}", status(&run));
}

/// The same on the test Slurm: three nodes, one rank each (srun with PMIx), rank 1 (on n2)
/// slowed; the straggler is named by its host, and with `--auto-retry
/// --straggler-is-node-failure` the attempt ends (the ranks checkpoint) and the job goes on
/// with n2 swapped for the first spare, n4.
#[cfg(feature = "mpi")]
#[test]
fn a_slowed_rank_is_named_by_its_host_on_slurm_and_its_host_swapped() {
    use common::slurm::{Cluster, wait_until};
    let cluster = Cluster::start(5, 2);
    let dir = cluster.dir.path().join("t");
    std::fs::create_dir_all(&dir).unwrap();
    let run = dir.join("run");
    let mut command = train_args(&run, 600);
    // Checkpoints on (the SIGTERM of a stopped attempt saves one, which the next resumes).
    command.extend(["--set".into(), "checkpoint.interval=100".into()]);
    let flags = [
        "--nodes",
        "3",
        "--spares",
        "2",
        "--time",
        "10:00",
        "--launch-arg=--timeout=120",
        "--launch-arg=--straggler-is-node-failure",
        // Where a straggler costs a node, half the job's speed: CPU contention on this
        // oversubscribed machine alone keeps a healthy rank above a quarter for a window (its
        // node swapped too, and two spares are all there are).
        "--launch-arg=--straggler-cost=0.5",
        "--launch-arg=--backoff=0.2",
    ];
    let id = common::slurm::submit(&cluster, &run, &flags, &command);
    let events = || kiln_run::read_events(&run).unwrap_or_default();
    let mut pid = None;
    wait_until(Duration::from_secs(120), "rank 1's trainer", || {
        pid = common::slurm::rank_pid(&dir, &run, 1);
        pid.is_some()
    });
    let done = Arc::new(AtomicBool::new(false));
    // Slowed about 10 x: the slowed rank saves slowly when the attempt is stopped, which
    // the checkpoint must survive (srun, sent SIGTERM, used to kill the step at once).
    let slow = cycle(pid.unwrap_or_default(), 18, done.clone());
    let state = cluster.wait_job(&id, Duration::from_secs(300));
    done.store(true, Ordering::Relaxed);
    slow.join().unwrap();
    assert_eq!(state, "COMPLETED", "{:#?}\n{}", events(), job_output(&run));
    let named = stragglers(&run);
    assert!(!named.is_empty());
    assert_eq!(
        (
            named[0].fields["rank"].as_u64(),
            named[0].fields["host"].as_str()
        ),
        (Some(1), Some("n2")),
        "{named:?}"
    );
    let s = status(&run);
    assert!(s.contains("stragglers: rank 1 on n2"), "{s}");
    let ev = events();
    let of = |name: &str| ev.iter().filter(|e| e.event == name).collect::<Vec<_>>();
    let ends = of("attempt_end");
    // On a loaded machine a later attempt may name a rank that CPU contention alone kept
    // over the factor (2.3x seen here beside a compiler; the module documentation: its host
    // is swapped for the second spare), or start slower than the startup watchdog's limit
    // (10 x the first attempt's startup, 16.7 s, beside a busy loop): retried. Anything else
    // (a crash) fails the test.
    assert!(
        (2..=3).contains(&ends.len())
            && ends[1..ends.len() - 1]
                .iter()
                .all(|e| ["straggler", "hung-silent"]
                    .contains(&e.fields["classification"].as_str().unwrap_or_default())),
        "{ends:?}\n{}",
        job_output(&run)
    );
    assert_eq!(ends[0].fields["classification"], "straggler");
    assert_eq!(ends[0].fields["cause"], "straggler");
    assert_eq!(ends[0].fields["culprit_hosts"], serde_json::json!(["n2"]));
    let swap = of("node_swap");
    assert_eq!(
        (
            swap[0].fields["host"].as_str(),
            swap[0].fields["replacement"].as_str()
        ),
        (Some("n2"), Some("n4"))
    );
    assert_eq!(ends[ends.len() - 1].fields["classification"], "success");
    // The second attempt resumed from the checkpoint the stopped ranks wrote.
    let resumed = of("resume");
    assert!(
        resumed.iter().any(|e| e.fields["step"].as_u64() > Some(0)),
        "{resumed:?}"
    );
}

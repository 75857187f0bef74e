//! The soak: a real training run on a fake Slurm cluster (tests/common/slurm.rs), chained
//! across walltimes, with a fault injected every ~2 minutes (a node downed, a rank SIGSTOPped,
//! a rank SIGKILLed), for KILN_SOAK_MINUTES (default 30). Not in the default suite:
//!
//!   cargo test --release -p kiln --test soak -- --ignored --nocapture
//!
//! Environment: KILN_SOAK_MINUTES (30), KILN_SOAK_FAULT_EVERY (120 s), KILN_SOAK_STEPS (the
//! training length; default: what a calibration run says fits the minutes), KILN_SOAK_DIR
//! (where the run directory and soak-report.json are kept; default target/soak-<unix time>).
//!
//! Faulted hosts are repaired by the "operator" 150 s after their fault: a downed node is
//! resumed, and the host is taken off the run's quarantine file (otherwise a long soak would
//! quarantine the whole cluster, as a real one would without its admins).
//!
//! The job runs 2 active nodes + 1 spare per batch job (walltime 6 minutes, chained), and
//! trains data-parallel over MPI on both nodes when built with `--features mpi` (without it,
//! rank 0 is the real `kiln train` and rank 1 stands in for a replica, following rank 0's
//! beacon). At the end the final weights are compared with an uninterrupted run of the same
//! config (run after it, so the whole test takes about 1.6 times KILN_SOAK_MINUTES; `kiln
//! launch --mpi --np 2` locally for data-parallel), and the ledger is printed: `kiln
//! status`, then the per-cause ETTR table and the per-fault table (detection time, resume
//! tier, work lost) in Markdown, ready for bench/soak/results.md, also written to `soak-table.md`
//! beside `soak-report.json`. The stall watchdog runs on its default (a
//! multiple of the observed step time); liveness on the default heartbeat timeout.

use crate::common;

use common::KILN;
use common::slurm::Cluster;
use common::slurm::DATA_PARALLEL;
use serde_json::json;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

fn env_or<T: std::str::FromStr>(k: &str, d: T) -> T {
    std::env::var(k)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(d)
}

fn train_sets(steps: u64) -> Vec<String> {
    let mut v: Vec<String> = common::TINY_MODEL.iter().map(|s| s.to_string()).collect();
    v.extend([
        "model.n_layers=1".to_string(),
        "training.threads=1".to_string(),
        format!("training.steps={steps}"),
        "checkpoint.interval=200".to_string(),
        "checkpoint.keep_latest_k=3".to_string(),
        "eval.interval=0".to_string(),
        "training.batch_size=2".to_string(),
        "training.compute_shards=1".to_string(),
    ]);
    v
}

/// `args` run uninterrupted on `ranks` ranks (a local `kiln launch --mpi` for more than one).
fn uninterrupted(run: &Path, args: Vec<String>, ranks: usize) -> Command {
    let mut argv = args;
    if ranks > 1 {
        let mut launch: Vec<String> = vec![
            KILN.into(),
            "launch".into(),
            "--mpi".into(),
            "--np".into(),
            ranks.to_string(),
            "--run-dir".into(),
            run.display().to_string(),
            "--".into(),
        ];
        launch.append(&mut argv);
        argv = launch;
    }
    let mut c = Command::new(&argv[0]);
    c.args(&argv[1..]);
    for v in [
        "SLURM_JOB_ID",
        "SLURM_JOBID",
        "PBS_JOBID",
        "KILN_PROGRESS_DIR",
        "RANK",
        "WORLD_SIZE",
    ] {
        c.env_remove(v);
    }
    c
}

fn ranks() -> usize {
    if DATA_PARALLEL { 2 } else { 1 }
}

fn train_args(run: &Path, steps: u64) -> Vec<String> {
    let mut a = vec![
        KILN.to_string(),
        "train".into(),
        "--run-dir".into(),
        run.display().to_string(),
        "--no-progress-bar".into(),
    ];
    for s in train_sets(steps) {
        a.push("--set".into());
        a.push(s);
    }
    a
}

/// Seconds per step of this config on this machine now, alone (the reference the soak is
/// compared with runs after it: see [`reference_weights`]).
fn step_time(dir: &Path) -> f64 {
    let t = Instant::now();
    let run = dir.join("calibrate");
    let ok = uninterrupted(&run, train_args(&run, 2000), ranks())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .status()
        .unwrap()
        .success();
    assert!(ok, "the calibration run failed");
    t.elapsed().as_secs_f64() / 2000.0
}

/// The final weights of an uninterrupted run of `steps`, which the soak's must equal. Run
/// after the soak, not beside it: beside it, even at the lowest priority (nice 19, its own
/// autogroup), its two MPI ranks took a third of the soak's cores, slowed its steps 4x and
/// its restarts (spawn, MPI init) 2-4x, and those restarts are what the soak measures.
fn reference_weights(keep: &Path, steps: u64) -> Vec<u8> {
    let r = keep.join("reference");
    let out = uninterrupted(&r, train_args(&r, steps), ranks())
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    std::fs::read(r.join("model.safetensors")).unwrap()
}

fn events(run: &Path) -> Vec<kiln_run::Event> {
    kiln_run::read_events(run).unwrap_or_default()
}

/// The hosts of the running attempt and the job's batch host, if an attempt runs.
fn current(cluster: &Cluster, run: &Path) -> Option<(Vec<String>, String)> {
    let ev = events(run);
    let last_start = ev.iter().rposition(|e| e.event == "attempt_start")?;
    if ev[last_start..].iter().any(|e| e.event == "attempt_end") {
        return None;
    }
    let hosts: Vec<String> = ev[last_start].fields["hosts"]
        .as_array()?
        .iter()
        .filter_map(|h| Some(h.as_str()?.to_string()))
        .collect();
    let job = ev.iter().rev().find(|e| e.event == "job_start")?.fields["job_id"]
        .as_str()?
        .to_string();
    let batch = cluster.job(&job).get("BatchHost").cloned()?;
    Some((hosts, batch))
}

/// Takes `host` off a quarantine file, as an operator does after a repair (write a new file,
/// rename it over the old one).
fn unquarantine(file: &Path, host: &str) {
    let Ok(entries) = kiln_launch::read_quarantine(file) else {
        return;
    };
    let kept: String = entries
        .iter()
        .filter(|e| e.host != host)
        .map(|e| serde_json::to_string(e).unwrap() + "\n")
        .collect();
    let tmp = file.with_extension("repair");
    if std::fs::write(&tmp, kept).is_ok() {
        let _ = std::fs::rename(&tmp, file);
    }
}

fn signal(pid: i32, sig: i32) -> bool {
    // SAFETY: kill(2) on a rank process of this soak's own cluster.
    unsafe { libc::kill(pid, sig) == 0 }
}

#[test]
#[ignore = "a 30-minute soak; run with --ignored (see the module docs)"]
fn soak() {
    let minutes: f64 = env_or("KILN_SOAK_MINUTES", 30.0);
    let every: f64 = env_or("KILN_SOAK_FAULT_EVERY", 120.0);
    let keep = std::env::var("KILN_SOAK_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|_| {
            PathBuf::from(env!("CARGO_MANIFEST_DIR"))
                .join("../../target")
                .join(format!("soak-{}", kiln_run::unix_time() as u64))
        });
    std::fs::create_dir_all(&keep).unwrap();
    let keep = std::path::absolute(&keep).unwrap();
    let run = keep.join("run");
    let per_step = step_time(&keep);
    // Sized to take about the soak's length when nothing fails (the calibration includes a
    // launch: KILN_SOAK_STEPS overrides it). The reference takes about as long again after.
    let steps = env_or(
        "KILN_SOAK_STEPS",
        ((minutes * 60.0 / per_step) as u64 / 200 * 200).max(2000),
    );
    eprintln!(
        "soak: {minutes} min, a fault every {every} s, {steps} steps at {:.1} ms/step, in {}",
        per_step * 1e3,
        keep.display()
    );
    let cluster = Cluster::start(12, 2);
    let command: Vec<String> = if DATA_PARALLEL {
        train_args(&run, steps)
    } else {
        vec![
            "sh".into(),
            common::slurm::standin_rank_script(&keep, &train_args(&run, steps))
                .display()
                .to_string(),
        ]
    };
    let mut c = cluster.cmd(KILN);
    c.args([
        "submit",
        "--scheduler",
        "slurm",
        "--nodes",
        "2",
        "--spares",
        "1",
        "--time",
        "6:00",
        "--chain",
        "100",
        "--run-dir",
    ])
    .arg(&run)
    .args([
        "--launch-arg=--timeout=60",
        "--launch-arg=--backoff=0.5,2",
        "--launch-arg=--grace=5",
        "--",
    ])
    .args(&command);
    let out = c.output().unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let kinds = ["node-down", "stop-replica", "kill-trainer", "stop-trainer"];
    let mut faults: Vec<serde_json::Value> = Vec::new();
    let mut next = Instant::now() + Duration::from_secs_f64(every);
    let mut repairs: Vec<(String, Instant, bool)> = Vec::new();
    let limit = Instant::now() + Duration::from_secs_f64(minutes * 60.0 * 3.0 + 600.0);
    let done = |run: &Path| {
        events(run)
            .iter()
            .any(|e| e.event == "chain" && e.fields["decision"] == "end")
    };
    while !done(&run) {
        assert!(Instant::now() < limit, "the soak run did not finish");
        std::thread::sleep(Duration::from_millis(500));
        // The operator repairs faulted hosts: back into Slurm and off the quarantine list.
        repairs.retain(|(n, at, down)| {
            if at.elapsed() < Duration::from_secs(150) {
                return true;
            }
            if *down {
                let _ = cluster
                    .cmd("scontrol")
                    .args(["update", &format!("nodename={n}"), "state=resume"])
                    .output();
            }
            unquarantine(&run.join("quarantine.jsonl"), n);
            false
        });
        if Instant::now() < next {
            continue;
        }
        let Some((hosts, batch)) = current(&cluster, &run) else {
            continue;
        };
        let kind = kinds[faults.len() % kinds.len()];
        let ok = match kind {
            "node-down" => match hosts.iter().find(|h| **h != batch) {
                Some(h) => {
                    cluster.down(h);
                    repairs.push((h.clone(), Instant::now(), true));
                    true
                }
                None => false,
            },
            "stop-replica" => {
                common::slurm::rank_pid(&keep, &run, 1).is_some_and(|p| signal(p, libc::SIGSTOP))
            }
            "kill-trainer" => {
                common::slurm::rank_pid(&keep, &run, 0).is_some_and(|p| signal(p, libc::SIGKILL))
            }
            _ => common::slurm::rank_pid(&keep, &run, 0).is_some_and(|p| signal(p, libc::SIGSTOP)),
        };
        if ok && kind != "node-down" {
            let faulted = if kind == "stop-replica" {
                hosts.get(1)
            } else {
                hosts.first()
            };
            repairs.extend(faulted.map(|h| (h.clone(), Instant::now(), false)));
        }
        if ok {
            eprintln!(
                "soak: t={:.0} s: {kind} (hosts {hosts:?})",
                kiln_run::unix_time()
            );
            faults.push(json!({"time": kiln_run::unix_time(), "fault": kind, "hosts": hosts}));
            next = Instant::now() + Duration::from_secs_f64(every);
        }
    }
    let ev = events(&run);
    let l = kiln_run::ledger::ledger(&ev);
    let status = Command::new(KILN).arg("status").arg(&run).output().unwrap();
    let status = String::from_utf8_lossy(&status.stdout).into_owned();
    let _ = Command::new(KILN).arg("plot").arg(&run).output();
    let weights = std::fs::read(run.join("model.safetensors")).ok();
    let same = weights.is_some() && weights == Some(reference_weights(&keep, steps));
    let walltimes = ev
        .iter()
        .filter(|e| e.event == "chain" && e.fields["exit_code"] == 75)
        .count();
    let report = json!({
        "minutes": l.total / 60.0,
        "ettr": l.ettr(),
        "buckets": l.buckets,
        "jobs": l.jobs,
        "attempts": l.attempts.len(),
        "lost_steps": l.lost_steps,
        "ledger_faults": l.faults,
        "swaps": l.swaps.len(),
        "blind_swaps": l.swaps.iter().filter(|s| s.blind).count(),
        "faults": faults,
        "walltime_crossings": walltimes,
        "steps": steps,
        "ms_per_step": per_step * 1e3,
        "final_weights_equal_uninterrupted": same,
    });
    std::fs::write(
        keep.join("soak-report.json"),
        serde_json::to_string_pretty(&report).unwrap(),
    )
    .unwrap();
    let table = format!(
        "Soak: {minutes} min, a fault every {every} s, {} ms/step, {} rank(s)\n\n{}",
        (per_step * 1e3).round(),
        ranks(),
        kiln_gates::recovery::markdown(&l)
    );
    std::fs::write(keep.join("soak-table.md"), &table).unwrap();
    eprintln!(
        "{status}\nsoak report: {}\n{}\n\n{table}",
        keep.join("soak-report.json").display(),
        serde_json::to_string_pretty(&report).unwrap()
    );
    assert!(same, "the final weights differ from an uninterrupted run");
}

//! `kiln launch --mpi` with the real OpenMPI `mpirun` (Debian `openmpi-bin`, which `.ci/run`
//! installs). Without mpirun this test fails on purpose: a silently skipped MPI test would
//! hide a broken CI image.

use crate::common;

use std::process::Command;

#[test]
fn mpirun_starts_two_ranks_that_see_rank_and_world_size() {
    let found = std::env::var_os("PATH")
        .map(|p| std::env::split_paths(&p).any(|d| d.join("mpirun").is_file()))
        .unwrap_or(false);
    assert!(
        found,
        "mpirun not found in PATH: install OpenMPI (Debian: apt-get install -y openmpi-bin libopenmpi-dev)"
    );
    let dir = tempfile::tempdir().unwrap();
    let rd = dir.path().join("run");
    let mut cmd = crate::common::ranks::launcher(2, &rd);
    cmd.args(["--", "sh", "-c", "echo \"RANK=$RANK WORLD_SIZE=$WORLD_SIZE LOCAL_RANK=$LOCAL_RANK MASTER=$MASTER_ADDR:$MASTER_PORT\""]);
    let out = cmd.output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(
        out.status.code(),
        Some(0),
        "stdout: {stdout}\nstderr: {stderr}"
    );
    for r in 0..2 {
        assert!(
            stdout.contains(&format!(
                "RANK={r} WORLD_SIZE=2 LOCAL_RANK={r} MASTER=127.0.0.1:"
            )),
            "{stdout}\n{stderr}"
        );
    }
    let events = kiln_run::read_events(&rd).unwrap();
    let start = events.iter().find(|e| e.event == "launch_start").unwrap();
    assert_eq!(start.fields["launcher"], "mpirun");
}

/// A rank that exits with a code ends the attempt with that code, and mpirun, which is
/// already aborting the job itself, is left to finish: kiln sent it SIGTERM mid-abort, and
/// OpenMPI's mpirun segfaulted in `PMIx_Finalize` on every such failure (3 of 3 runs), its
/// backtrace in the user's log. The shims stop the other ranks instead.
#[test]
fn a_rank_that_exits_with_a_code_leaves_mpirun_to_abort_cleanly() {
    let dir = tempfile::tempdir().unwrap();
    let rd = dir.path().join("run");
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_kiln"));
    cmd.args([
        "launch",
        "--mpi",
        "--np",
        "2",
        "--timeout",
        "60",
        "--run-dir",
    ])
    .arg(&rd)
    .args([
        "--",
        "sh",
        "-c",
        "if [ \"$RANK\" = 1 ]; then exit 3; fi; sleep 30",
    ]);
    for v in [
        "PBS_JOBID",
        "SLURM_JOB_ID",
        "SLURM_JOBID",
        "RANK",
        "KILN_PROGRESS_DIR",
    ] {
        cmd.env_remove(v);
    }
    let t0 = std::time::Instant::now();
    let out = cmd.output().unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(out.status.code(), Some(3), "{text}");
    assert!(text.contains("rank 1 on"), "{text}");
    assert!(!text.contains("Segmentation fault"), "{text}");
    assert!(
        t0.elapsed().as_secs() < 25,
        "rank 0 was not stopped: {text}"
    );
}

/// A hostfile in kiln's documented `host:N` form was parsed by kiln but handed raw to
/// OpenMPI, which cannot read it (exit 255, classed retryable). The launcher gets a file in
/// its own syntax (`host slots=N`), whatever syntax the user wrote.
#[test]
fn a_hostfile_in_any_kiln_syntax_reaches_mpirun_in_its_own() {
    for hostfile in [
        "localhost:2\n",
        "localhost\nlocalhost\n",
        "localhost slots=2\n",
    ] {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("hosts"), hostfile).unwrap();
        let mut cmd = common::kiln_cmd(&[
            "launch",
            "--mpi",
            "--hostfile",
            "hosts",
            "--np",
            "2",
            "--timeout",
            "60",
            "--run-dir",
            "run",
            "--",
            "sh",
            "-c",
            "echo RANK=$RANK/$WORLD_SIZE",
        ]);
        cmd.current_dir(dir.path());
        let out = cmd.output().unwrap();
        let stdout = String::from_utf8_lossy(&out.stdout);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(
            out.status.code(),
            Some(0),
            "{hostfile:?}: {stdout}\n{stderr}"
        );
        for r in 0..2 {
            assert!(
                stdout.contains(&format!("RANK={r}/2")),
                "{hostfile:?}: {stdout}"
            );
        }
        let written = std::fs::read_to_string(dir.path().join("run/hostfile")).unwrap();
        assert_eq!(written, "localhost slots=2\n", "{hostfile:?}");
    }
}

/// SIGTERM to `kiln launch` is a preemption: the ranks checkpoint and exit 75, and kiln
/// reports 75 from the ranks' own exits on every launch path. Under mpirun it returned
/// mpirun's 1 with no exit records: mpirun, signalled by kiln, SIGKILLed its ranks (and their
/// `--as-rank` shims) a moment later, and aborted the job when the first rank exited 75 while
/// the other still wrote its checkpoint. Here rank 1 takes 1.5 s to "checkpoint".
#[test]
fn sigterm_is_a_preemption_reported_as_75_from_the_ranks_on_every_launch_path() {
    let script = "trap 'sleep $((RANK * 3 / 2)); echo saved > ckpt-$RANK; exit 75' TERM; \
                  echo ready-$RANK; while true; do sleep 0.05; done";
    for mpi in [false, true] {
        let dir = tempfile::tempdir().unwrap();
        let rd = dir.path().join("run");
        let mut cmd = common::kiln_cmd(&["launch", "--np", "2", "--timeout", "60"]);
        if mpi {
            cmd.arg("--mpi");
        }
        let mut child = cmd
            .current_dir(dir.path())
            .arg("--run-dir")
            .arg(&rd)
            .args(["--", "sh", "-c", script])
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        for r in 0..2 {
            common::wait_for_file_text(
                &rd.join("attempt-1.log"),
                &format!("ready-{r}"),
                &mut child,
            );
        }
        // SAFETY: plain kill(2) on our own child's pid.
        assert_eq!(unsafe { libc::kill(child.id() as i32, libc::SIGTERM) }, 0);
        let out = child.wait_with_output().unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(75), "mpi={mpi}: {stderr}");
        for r in 0..2 {
            let ckpt = std::fs::read_to_string(dir.path().join(format!("ckpt-{r}")));
            assert_eq!(
                ckpt.ok().as_deref(),
                Some("saved\n"),
                "mpi={mpi}: rank {r} checkpointed"
            );
        }
        let events = kiln_run::read_events(&rd).unwrap();
        let end = events
            .iter()
            .find(|e| e.event == kiln_run::event::ATTEMPT_END)
            .unwrap();
        assert_eq!(end.fields["classification"], "interrupted", "mpi={mpi}");
        assert_eq!(end.fields["exit_code"], 75, "mpi={mpi}");
        if mpi {
            let exits = end.fields["rank_exits"].as_array().unwrap();
            let codes: Vec<_> = exits
                .iter()
                .map(|x| (x["rank"].clone(), x["code"].clone()))
                .collect();
            assert_eq!(
                codes,
                [(0.into(), 75.into()), (1.into(), 75.into())],
                "every rank recorded its own exit: {exits:?}"
            );
        }
    }
}

/// One GPU per local rank on both launch paths: a local spawn (kiln sets each rank's
/// variable) and mpirun (each rank's shim does, from the accelerators kiln detected). No GPU
/// is needed: the binding is the variable the runtime reads.
#[test]
fn each_local_rank_gets_its_own_gpu_on_every_launch_path() {
    for (visible, want) in [
        (None, ["0", "1", "2"]),
        (Some("GPU-8c1a,4,6"), ["GPU-8c1a", "4", "6"]),
    ] {
        for mpi in [false, true] {
            let dir = tempfile::tempdir().unwrap();
            let rd = dir.path().join("run");
            let mut args = vec!["launch", "--np", "3", "--timeout", "60"];
            if mpi {
                args.push("--mpi");
            }
            if visible.is_none() {
                args.extend(["--accelerator", "nvidia", "--gpus-per-node", "3"]);
            }
            let mut cmd = common::kiln_cmd(&args);
            cmd.arg("--run-dir").arg(&rd).args([
                "--",
                "sh",
                "-c",
                "echo \"rank $LOCAL_RANK gpu $CUDA_VISIBLE_DEVICES\"",
            ]);
            if let Some(v) = visible {
                cmd.env("CUDA_VISIBLE_DEVICES", v);
            }
            let out = cmd.output().expect("run kiln");
            let stdout = String::from_utf8_lossy(&out.stdout);
            assert_eq!(
                out.status.code(),
                Some(0),
                "mpi={mpi}: {stdout}\n{}",
                String::from_utf8_lossy(&out.stderr)
            );
            for (r, gpu) in want.iter().enumerate() {
                assert!(
                    stdout.contains(&format!("rank {r} gpu {gpu}\n")),
                    "mpi={mpi} visible={visible:?}: rank {r} should see only {gpu}:\n{stdout}"
                );
            }
        }
    }
}

/// Issue 46, kiln's own trainer: rank 1 stops (SIGSTOP, with a heartbeat timeout far above
/// the stall timeout) while rank 0 waits for it in the gradient all-reduce. Both beacons
/// were at the same step; rank 0's now says `collective` (its MPI engine marks a long
/// collective), so the stall names rank 1 from the phases, evidence labelled `beacon`.
#[cfg(feature = "mpi")]
#[test]
fn a_stall_in_kiln_train_names_the_rank_that_is_not_in_the_collective() {
    let dir = tempfile::tempdir().unwrap();
    let rd = dir.path().join("run");
    let mut cmd = common::kiln_cmd(&[
        "launch",
        "--mpi",
        "--np",
        "2",
        "--stall-timeout",
        "3",
        "--heartbeat-timeout",
        "120",
        "--grace",
        "1",
        "--run-dir",
    ]);
    cmd.arg(&rd)
        .args([
            "--",
            common::KILN,
            "train",
            "--no-progress-bar",
            "--run-dir",
        ])
        .arg(&rd);
    for set in common::TINY_MODEL.iter().chain(&[
        "training.steps=100000",
        "training.threads=1",
        "training.batch_size=2",
        "checkpoint.interval=100000",
        "checkpoint.snapshot_interval=0",
        "eval.interval=0",
    ]) {
        cmd.arg("--set").arg(set);
    }
    let mut job = cmd
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let t0 = std::time::Instant::now();
    while common::beacon_step(&rd, 1) < 20 {
        assert!(job.try_wait().unwrap().is_none(), "the job ended early");
        assert!(t0.elapsed().as_secs() < 240, "rank 1 never reached step 20");
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    let pid = common::trainer_pid(&rd, 1).expect("rank 1's pid");
    // SAFETY: kill(2) on a pid of a process this test started (through kiln launch).
    assert_eq!(unsafe { libc::kill(pid, libc::SIGSTOP) }, 0);
    let status = job.wait().unwrap();
    // SAFETY: as above; ESRCH when it is gone, as it should be.
    unsafe { libc::kill(pid, libc::SIGKILL) };
    assert_eq!(status.code(), Some(124));
    let end = kiln_run::read_events(&rd)
        .unwrap()
        .into_iter()
        .find(|e| e.event == "attempt_end")
        .unwrap()
        .fields;
    assert_eq!(end["classification"], "hung-stalled", "{end:?}");
    assert_eq!(end["culprit_ranks"], serde_json::json!([1]), "{end:?}");
    let phase = |rank: u64| {
        end["progress"]
            .as_array()
            .unwrap()
            .iter()
            .find(|p| p["rank"] == rank && p["source"] == "beacon")
            .map(|p| p["phase"].clone())
    };
    assert_eq!(phase(0), Some("collective".into()), "{end:?}");
    assert_eq!(phase(1), Some("train".into()), "{end:?}");
    let evidence = end["evidence"].as_array().unwrap();
    assert!(
        !evidence.is_empty() && evidence.iter().all(|e| e["source"] == "beacon"),
        "{evidence:?}"
    );
    let message = end["message"].as_str().unwrap();
    assert!(
        message.contains("ranks that stopped advancing first: 1 (from beacons and phases"),
        "{message}"
    );
}

/// `kiln launch --mpi --np NP --retries 1 -- kiln train` (a short run) in which rank
/// `victim`'s trainer is SIGKILLed once it passed step 10, in each of the first `kills`
/// attempts; returns the launch's exit code and the Open MPI job ids of its attempts.
#[cfg(feature = "mpi")]
fn kill_ranks_under_mpirun(
    dir: &std::path::Path,
    np: usize,
    victim: usize,
    kills: usize,
) -> (Option<i32>, Vec<u32>) {
    let rd = dir.join("run");
    let jobs = dir.join("jobids");
    let mut train = vec![
        common::KILN.to_string(),
        "train".into(),
        "--no-progress-bar".into(),
        "--run-dir".into(),
        rd.display().to_string(),
    ];
    for set in common::TINY_MODEL.iter().chain(&[
        "training.steps=300",
        "training.threads=1",
        "training.batch_size=2",
        "checkpoint.interval=100",
        "checkpoint.snapshot_interval=0",
        "eval.interval=0",
    ]) {
        train.extend(["--set".to_string(), set.to_string()]);
    }
    let quoted: Vec<String> = train.iter().map(|a| format!("'{a}'")).collect();
    let script = format!(
        "echo \"$OMPI_MCA_ess_base_jobid\" >> '{}'; exec {}",
        jobs.display(),
        quoted.join(" ")
    );
    let np = np.to_string();
    let mut job = retried_mpi_launch(&rd, &np, &[], &script)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    for attempt in 1..=kills {
        let t0 = std::time::Instant::now();
        let pid = loop {
            let started = std::fs::read_to_string(&jobs)
                .unwrap_or_default()
                .lines()
                .count();
            let step = common::beacon_step(&rd, victim);
            if started >= attempt * np.parse::<usize>().unwrap()
                && step >= 10
                && let Some(pid) = common::trainer_pid(&rd, victim)
            {
                break pid;
            }
            assert!(job.try_wait().unwrap().is_none(), "the launch ended early");
            assert!(
                t0.elapsed().as_secs() < 240,
                "attempt {attempt} never reached step 10"
            );
            std::thread::sleep(std::time::Duration::from_millis(20));
        };
        // SAFETY: kill(2) on a pid of a process this test started (through kiln launch).
        assert_eq!(unsafe { libc::kill(pid, libc::SIGKILL) }, 0);
        // Wait for the next attempt's ranks, whose beacons start over.
        while attempt < kills
            && std::fs::read_to_string(&jobs)
                .unwrap_or_default()
                .lines()
                .count()
                < (attempt + 1) * np.parse::<usize>().unwrap()
        {
            assert!(job.try_wait().unwrap().is_none(), "the launch ended early");
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
        let _ = std::fs::remove_file(rd.join(format!("progress/rank-{victim}")));
    }
    let code = job.wait().unwrap().code();
    let mut ids: Vec<u32> = std::fs::read_to_string(&jobs)
        .unwrap()
        .lines()
        .filter_map(|l| l.trim().parse().ok())
        .collect();
    ids.sort_unstable();
    ids.dedup();
    (code, ids)
}

/// `kiln launch --mpi` of `sh -c script` on `np` ranks into run directory `rd`, with one
/// retry 0.2 s after a failed attempt, and `extra` flags.
#[cfg(feature = "mpi")]
fn retried_mpi_launch(rd: &std::path::Path, np: &str, extra: &[&str], script: &str) -> Command {
    let mut args = vec![
        "launch",
        "--mpi",
        "--np",
        np,
        "--retries",
        "1",
        "--backoff",
        "0.2",
    ];
    args.extend_from_slice(extra);
    args.push("--run-dir");
    let mut cmd = common::kiln_cmd(&args);
    cmd.arg(rd).args(["--", "sh", "-c", script]);
    cmd
}

/// The files in /dev/shm of this user's Open MPI job `jobid`.
#[cfg(feature = "mpi")]
fn mpi_segments_of(jobid: u32) -> Vec<String> {
    // SAFETY: getuid has no preconditions.
    let uid = unsafe { libc::getuid() };
    let mark = format!(".{uid}.{jobid:x}.");
    std::fs::read_dir("/dev/shm")
        .unwrap()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.contains("_segment.") && n.contains(&mark))
        .collect()
}

/// Issue 46: each attempt that ended with a killed rank left Open MPI's shared-memory files
/// (`/dev/shm/vader_segment.*`, 4 MiB each). The launcher's rank shims remove their ranks'
/// once the rank ended: none of any attempt's is left.
#[cfg(feature = "mpi")]
#[test]
fn an_attempt_with_a_killed_rank_leaves_no_mpi_segments() {
    let dir = tempfile::tempdir().unwrap();
    let (code, jobs) = kill_ranks_under_mpirun(dir.path(), 2, 1, 1);
    assert_eq!(code, Some(0), "the retry completes");
    assert_eq!(jobs.len(), 2, "{jobs:?}");
    for j in jobs {
        assert_eq!(mpi_segments_of(j), Vec::<String>::new(), "job {j:x}");
    }
}

/// Held out: three ranks, rank 0 killed, in every attempt: the launch gives up, and still
/// no segment of either attempt is left.
#[cfg(feature = "mpi")]
#[test]
fn a_launch_that_gives_up_leaves_no_mpi_segments() {
    let dir = tempfile::tempdir().unwrap();
    let (code, jobs) = kill_ranks_under_mpirun(dir.path(), 3, 0, 2);
    assert_ne!(code, Some(0));
    assert_eq!(jobs.len(), 2, "{jobs:?}");
    for j in jobs {
        assert_eq!(mpi_segments_of(j), Vec::<String>::new(), "job {j:x}");
    }
}

/// Open MPI 4 keeps a job's session directory (`$TMPDIR/ompi.<host>.<uid>/pid.<mpirun's
/// pid>`, 8 MiB of PMIx stores) until `mpirun` exits on its own; an `mpirun` that kiln must
/// SIGKILL (here: ranks that ignore SIGTERM, silent past `--timeout`) left it behind, one per
/// such attempt. The launcher removes it once the attempt ended.
#[cfg(feature = "mpi")]
#[test]
fn an_mpirun_killed_with_its_attempt_leaves_no_session_directory() {
    let dir = tempfile::tempdir().unwrap();
    let rd = dir.path().join("run");
    let seen = dir.path().join("sessions");
    let script = format!(
        "echo \"$OMPI_MCA_orte_jobfam_session_dir\" >> {seen}; trap '' TERM; sleep 60",
        seen = seen.display()
    );
    let mut cmd = retried_mpi_launch(&rd, "2", &["--timeout", "2", "--grace", "0.5"], &script);
    let out = cmd.output().unwrap();
    let log = String::from_utf8_lossy(&out.stderr);
    assert_ne!(out.status.code(), Some(0), "{log}");
    let mut sessions: Vec<String> = std::fs::read_to_string(&seen)
        .unwrap()
        .lines()
        .map(str::to_owned)
        .collect();
    sessions.sort();
    sessions.dedup();
    assert_eq!(sessions.len(), 2, "one per attempt: {sessions:?}\n{log}");
    for s in &sessions {
        assert!(s.contains("/ompi.") && s.contains("/pid."), "{s}");
        assert!(!std::path::Path::new(s).exists(), "{s} is left\n{log}");
    }
}

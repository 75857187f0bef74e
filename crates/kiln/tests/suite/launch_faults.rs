//! Issue 9's launch and topology classes, each against the real binary: absurd sizes,
//! unbounded durations, a non-executable program, port 0, malformed visible-device lists,
//! non-UTF-8 rank variables, buffered output, a leftover holding the output under mpirun,
//! and deterministic exit codes that must not be retried.

use std::ffi::OsStr;
use std::os::unix::ffi::OsStrExt;
use std::path::Path;
use std::process::{Command, Output};
use std::time::{Duration, Instant};

use crate::common;

fn kiln(args: &[&str]) -> Command {
    common::kiln_cmd(args)
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

fn s(p: &Path) -> String {
    p.display().to_string()
}

fn attempt_ends(dir: &Path) -> Vec<serde_json::Map<String, serde_json::Value>> {
    kiln_run::read_events(dir)
        .unwrap()
        .into_iter()
        .filter(|e| e.event == "attempt_end")
        .map(|e| e.fields)
        .collect()
}

/// A usage error: exit 2, the needle in stderr, no panic, and no run directory created.
fn refused(out: &Output, needle: &str, run_dir: &Path) {
    let err = text(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{needle}: {err}");
    assert!(err.contains(needle), "want {needle:?} in: {err}");
    assert!(!err.contains("panicked"), "{err}");
    assert!(
        !run_dir.exists(),
        "something started: {}",
        run_dir.display()
    );
}

#[test]
fn absurd_rank_counts_are_refused_before_anything_starts() {
    let dir = tempfile::tempdir().unwrap();
    let rd = dir.path().join("run");
    for (flags, needle) in [
        (&["--np", "4294967296"][..], "at most 1048576 ranks"),
        (
            &["--gpus-per-node", "4294967296"][..],
            "--gpus-per-node 4294967296",
        ),
        (&["--ppn", "100000"][..], "--ppn 100000"),
        (&["--np", "100000"][..], "pass --oversubscribe"),
        (
            &["--np", "5000", "--oversubscribe"][..],
            "at most 4096 local ranks",
        ),
    ] {
        let t = Instant::now();
        let rd_s = s(&rd);
        let mut args = vec!["launch"];
        args.extend_from_slice(flags);
        args.extend(["--run-dir", &rd_s, "--", "true"]);
        let out = kiln(&args).output().unwrap();
        refused(&out, needle, &rd);
        assert!(
            t.elapsed() < Duration::from_secs(5),
            "{flags:?} took {:?}",
            t.elapsed()
        );
    }
    // Forced, a modest oversubscription runs.
    let out = kiln(&[
        "launch",
        "--np",
        "20",
        "--oversubscribe",
        "--run-dir",
        &s(&rd),
        "--",
        "true",
    ])
    .output()
    .unwrap();
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
}

#[test]
fn every_duration_flag_is_finite_positive_and_bounded() {
    let dir = tempfile::tempdir().unwrap();
    let rd = dir.path().join("run");
    for (flag, value) in [
        ("--timeout", "1e300"),
        ("--timeout", "inf"),
        ("--timeout", "0"),
        ("--stall-timeout", "nan"),
        ("--stall-timeout", "-3"),
        ("--grace", "1e300"),
        ("--grace", "nan"),
        ("--walltime", "1e300"),
        ("--walltime", "99999999:00:00"),
        ("--backoff", "1e300"),
        ("--backoff", "1,inf"),
    ] {
        let out = kiln(&["launch", flag, value, "--run-dir", &s(&rd), "--", "true"])
            .output()
            .unwrap();
        refused(&out, flag, &rd);
    }
}

#[test]
fn a_non_executable_program_exits_126_and_a_missing_one_127() {
    let dir = tempfile::tempdir().unwrap();
    let script = dir.path().join("train.sh");
    std::fs::write(&script, "#!/bin/sh\necho hi\n").unwrap();
    let rd = dir.path().join("run");
    let out = kiln(&["launch", "--run-dir", &s(&rd), "--", &s(&script)])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(126), "{}", text(&out.stderr));
    assert!(
        text(&out.stderr).contains("permission denied"),
        "{}",
        text(&out.stderr)
    );
    // A directory is not executable either.
    let out = kiln(&["launch", "--run-dir", &s(&rd), "--", &s(dir.path())])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(126));
    // Under a launcher the rank shim says the same.
    let out = kiln(&["launch", "--as-rank", "--", &s(&script)])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(126), "{}", text(&out.stderr));
    let out = kiln(&["launch", "--run-dir", &s(&rd), "--", "no-such-kiln-program"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(127));
}

#[test]
fn master_port_zero_is_refused_and_help_says_so() {
    let dir = tempfile::tempdir().unwrap();
    let rd = dir.path().join("run");
    let out = kiln(&[
        "launch",
        "--master-port",
        "0",
        "--run-dir",
        &s(&rd),
        "--",
        "true",
    ])
    .output()
    .unwrap();
    refused(&out, "--master-port 0", &rd);
    let help = text(&kiln(&["launch", "--help"]).output().unwrap().stdout);
    assert!(help.contains("0 is refused"), "{help}");
    // A rank environment with MASTER_PORT=0 is an error too.
    let out = kiln(&["doctor"]).env("MASTER_PORT", "0").output().unwrap();
    assert_eq!(out.status.code(), Some(1));
    assert!(
        text(&out.stdout).contains("MASTER_PORT=0"),
        "{}",
        text(&out.stdout)
    );
}

#[test]
fn malformed_visible_device_lists_are_errors_not_gpu_counts() {
    let dir = tempfile::tempdir().unwrap();
    let rd = dir.path().join("run");
    for bad in ["GPU-zzz,,%%", "0,,1", "0,0"] {
        let out = kiln(&["launch", "--dry-run", "--run-dir", &s(&rd), "--", "true"])
            .env("CUDA_VISIBLE_DEVICES", bad)
            .output()
            .unwrap();
        refused(&out, "CUDA_VISIBLE_DEVICES=", &rd);
        let out = kiln(&["doctor"])
            .env("CUDA_VISIBLE_DEVICES", bad)
            .output()
            .unwrap();
        assert_eq!(out.status.code(), Some(1), "doctor with {bad:?}");
    }
    // The runtimes' own rules: -1 hides every GPU; a negative index ends the list.
    let dry = |v: &str| {
        let out = kiln(&["launch", "--dry-run", "--", "true"])
            .env("CUDA_VISIBLE_DEVICES", v)
            .output()
            .unwrap();
        assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
        text(&out.stdout)
    };
    assert!(dry("-1").contains("accelerators: 0 x cpu"));
    assert!(dry("0,2,-1,1").contains("accelerators: 2 x nvidia"));
}

#[test]
fn non_utf8_rank_variables_are_errors_naming_them() {
    for var in [
        "RANK",
        "WORLD_SIZE",
        "PMI_RANK",
        "SLURM_PROCID",
        "OMPI_COMM_WORLD_LOCAL_RANK",
    ] {
        let bad = OsStr::from_bytes(b"\xff1");
        let out = kiln(&["doctor"]).env(var, bad).output().unwrap();
        assert_eq!(out.status.code(), Some(1), "{var}");
        let report = text(&out.stdout);
        assert!(
            report.contains(&format!("{var} is set but is not valid UTF-8")),
            "{var}: {report}"
        );
        // The rank shim (what every rank runs under a launcher) refuses to start the program.
        let out = kiln(&["launch", "--as-rank", "--", "echo", "started"])
            .env(var, bad)
            .output()
            .unwrap();
        assert_eq!(out.status.code(), Some(2), "{var}");
        assert!(!text(&out.stdout).contains("started"));
        assert!(text(&out.stderr).contains(var), "{}", text(&out.stderr));
    }
}

#[test]
fn buffered_python_output_reaches_the_watchdog_line_by_line() {
    let dir = tempfile::tempdir().unwrap();
    let rd = dir.path().join("run");
    // Twelve lines half a second apart against a 3 s watchdog: block-buffered, nothing would
    // come before the program's end (6 s) and the watchdog would stop it; line by line, a
    // loaded 2-core CI machine has 2.5 s of slack for the interpreter's start (with 2 s and
    // ten lines, a parallel test run once stopped it there).
    let program = "import time\nfor i in range(1,13):\n print(f\"step={i}\"); time.sleep(0.5)";
    let out = kiln(&[
        "launch",
        "--np",
        "1",
        "--timeout",
        "3",
        "--run-dir",
        &s(&rd),
        "--",
        "python3",
        "-c",
        program,
    ])
    .output()
    .expect("python3 (Debian: python3) is needed for this test");
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    let end = &attempt_ends(&rd)[0];
    assert_eq!(end["classification"], "success");
    assert_eq!(end["last_progress"], 12);
    // A program sees a terminal on stdout (line-buffered by the C library), the log keeps the
    // bytes unchanged (no \r\n), and PYTHONUNBUFFERED=1 is set for launchers without a pty.
    let rd = dir.path().join("tty");
    let out = kiln(&[
        "launch",
        "--run-dir",
        &s(&rd),
        "--",
        "sh",
        "-c",
        "[ -t 1 ] && echo stdout-is-a-tty; echo \"PYTHONUNBUFFERED=$PYTHONUNBUFFERED\"",
    ])
    .output()
    .unwrap();
    assert_eq!(out.status.code(), Some(0));
    let log = std::fs::read(rd.join("attempt-1.log")).unwrap();
    assert_eq!(text(&log), "stdout-is-a-tty\nPYTHONUNBUFFERED=1\n");
}

#[test]
fn mpirun_rank_that_exits_0_with_a_leftover_holding_stdout_is_a_success() {
    let dir = tempfile::tempdir().unwrap();
    let rd = dir.path().join("run");
    let pid_file = dir.path().join("bg.pid");
    let t = Instant::now();
    let script = format!("sleep 60 & echo $! > {}; echo step=1", s(&pid_file));
    let out = kiln(&[
        "launch",
        "--mpi",
        "--np",
        "1",
        "--timeout",
        "3",
        "--grace",
        "1",
        "--run-dir",
        &s(&rd),
        "--",
        "sh",
        "-c",
        &script,
    ])
    .output()
    .unwrap();
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    assert!(
        t.elapsed() < Duration::from_secs(3),
        "took {:?}",
        t.elapsed()
    );
    let end = &attempt_ends(&rd)[0];
    assert_eq!(end["classification"], "success");
    assert_eq!(end["rank_exits"][0]["code"], 0);
    let pid: i32 = std::fs::read_to_string(&pid_file)
        .unwrap()
        .trim()
        .parse()
        .unwrap();
    assert!(
        !Path::new(&format!("/proc/{pid}")).exists() || {
            let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
            stat.rsplit(')')
                .next()
                .and_then(|r| r.split_whitespace().next())
                == Some("Z")
        },
        "the leftover survived"
    );
}

#[test]
fn deterministic_exit_codes_are_not_retried_and_replica_mismatch_is() {
    let dir = tempfile::tempdir().unwrap();
    for (code, class, attempts) in [
        (78, "deterministic", 1),
        (65, "deterministic", 1),
        (73, "deterministic", 1),
        (76, "replica-mismatch", 3),
        (1, "failed", 3),
    ] {
        let rd = dir.path().join(format!("run-{code}"));
        let out = kiln(&[
            "launch",
            "--retries",
            "2",
            "--backoff",
            "0.05",
            "--run-dir",
            &s(&rd),
            "--",
            "sh",
            "-c",
            &format!("exit {code}"),
        ])
        .output()
        .unwrap();
        assert_eq!(out.status.code(), Some(code), "{}", text(&out.stderr));
        let ends = attempt_ends(&rd);
        assert_eq!(ends.len(), attempts, "exit {code}");
        assert_eq!(ends[0]["classification"], class, "exit {code}");
    }
    // Under mpirun the rank's own code decides (the shim records it), and it is not retried.
    let rd = dir.path().join("mpi");
    let out = kiln(&[
        "launch",
        "--mpi",
        "--np",
        "2",
        "--retries",
        "2",
        "--backoff",
        "0.05",
        "--run-dir",
        &s(&rd),
        "--",
        "sh",
        "-c",
        "[ \"$RANK\" = 1 ] && exit 78; sleep 5",
    ])
    .output()
    .unwrap();
    assert_eq!(out.status.code(), Some(78), "{}", text(&out.stderr));
    assert_eq!(attempt_ends(&rd).len(), 1);
    let help = text(&kiln(&["launch", "--help"]).output().unwrap().stdout);
    assert!(
        help.contains("deterministic") && help.contains("replica-mismatch"),
        "{help}"
    );
}

/// kiln's stop request is addressed to one attempt: the previous attempt's SIGKILL stays in
/// the progress directory for that attempt's shims (one may not have polled yet when the next
/// attempt starts at once), and the next attempt's ranks leave it alone.
#[test]
fn the_rank_shim_acts_only_on_a_stop_request_addressed_to_its_attempt() {
    let dir = tempfile::tempdir().unwrap();
    let progress = dir.path();
    let now = kiln_run::unix_time();
    kiln_run::write_stop_request(progress, libc::SIGKILL, now, Some("old")).unwrap();
    let shim = |attempt: &str| {
        kiln(&[
            "launch",
            "--as-rank",
            "--",
            "sh",
            "-c",
            "sleep 1; echo survived",
        ])
        .env("KILN_PROGRESS_DIR", progress)
        .env("KILN_ATTEMPT", attempt)
        .output()
        .unwrap()
    };
    let out = shim("new");
    assert!(
        out.status.success() && text(&out.stdout).contains("survived"),
        "another attempt's request was acted on: {}",
        text(&out.stderr)
    );
    let out = shim("old");
    assert!(!text(&out.stdout).contains("survived"), "its own was not");
    let exits = kiln_run::read_exit_records(progress);
    assert_eq!(exits[0].signal, Some(libc::SIGKILL), "{exits:?}");
    assert_eq!(exits[0].attempt.as_deref(), Some("old"));
}

//! End-to-end tests of `kiln launch` / `kiln doctor`: the real binary, real processes, real
//! signals. Programs are small `sh` scripts so each test controls exactly what a rank does.

use serde_json::Value;
use std::path::Path;
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use crate::common;
use common::KILN;

fn kiln(args: &[&str]) -> Command {
    common::kiln_cmd(args)
}

fn run(args: &[&str]) -> (Output, Duration) {
    let t = Instant::now();
    let out = kiln(args).output().expect("run kiln");
    (out, t.elapsed())
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

fn events(dir: &Path) -> Vec<kiln_run::Event> {
    kiln_run::read_events(dir).expect("events.jsonl")
}

fn attempt_ends(dir: &Path) -> Vec<serde_json::Map<String, Value>> {
    events(dir)
        .into_iter()
        .filter(|e| e.event == "attempt_end")
        .map(|e| e.fields)
        .collect()
}

fn s(p: &Path) -> String {
    p.display().to_string()
}

/// Whether `pid` still runs (a zombie has finished running and only awaits its reaper).
fn running(pid: i32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Ok(stat) => {
            stat.rsplit(')')
                .next()
                .and_then(|r| r.split_whitespace().next())
                != Some("Z")
        }
        Err(_) => false,
    }
}

#[test]
fn silent_hang_is_killed_within_timeout_plus_one_second() {
    let dir = tempfile::tempdir().unwrap();
    let rd = dir.path().join("run");
    let (out, elapsed) = run(&[
        "launch",
        "--timeout",
        "1",
        "--grace",
        "1",
        "--run-dir",
        &s(&rd),
        "--",
        "sh",
        "-c",
        "echo step=1; sleep 30",
    ]);
    assert_eq!(
        out.status.code(),
        Some(124),
        "stderr: {}",
        text(&out.stderr)
    );
    assert!(
        elapsed < Duration::from_millis(2500),
        "took {elapsed:?} for --timeout 1"
    );
    assert!(
        elapsed >= Duration::from_secs(1),
        "killed before the timeout: {elapsed:?}"
    );
    assert!(
        text(&out.stdout).contains("step=1"),
        "output passes through"
    );
    assert!(
        text(&out.stderr).contains("no output for"),
        "{}",
        text(&out.stderr)
    );
    let ends = attempt_ends(&rd);
    assert_eq!(ends.len(), 1);
    assert_eq!(ends[0]["classification"], "hung-silent");
    assert_eq!(ends[0]["exit_code"], 124);
    assert_eq!(ends[0]["last_progress"], 1);
    let detect = ends[0]["detect_s"].as_f64().unwrap();
    assert!((1.0..2.0).contains(&detect), "detect_s {detect}");
    assert_eq!(
        std::fs::read(rd.join("attempt-1.log")).unwrap(),
        b"step=1\n"
    );
}

#[test]
fn heartbeat_without_progress_is_caught_by_the_stall_watchdog_only() {
    let dir = tempfile::tempdir().unwrap();
    let beat = "echo step=1; while true; do echo heartbeat; sleep 0.1; done";
    // The silence watchdog alone never fires: the job ends only at the walltime.
    let rd = dir.path().join("silence-only");
    let (out, elapsed) = run(&[
        "launch",
        "--timeout",
        "1",
        "--walltime",
        "2.5",
        "--grace",
        "1",
        "--run-dir",
        &s(&rd),
        "--",
        "sh",
        "-c",
        beat,
    ]);
    assert_eq!(out.status.code(), Some(75), "stderr: {}", text(&out.stderr));
    assert!(elapsed >= Duration::from_millis(2500));
    assert_eq!(attempt_ends(&rd)[0]["classification"], "walltime");
    // The stall watchdog catches it.
    let rd = dir.path().join("stall");
    let (out, elapsed) = run(&[
        "launch",
        "--timeout",
        "1",
        "--stall-timeout",
        "1",
        "--grace",
        "1",
        "--run-dir",
        &s(&rd),
        "--",
        "sh",
        "-c",
        beat,
    ]);
    assert_eq!(
        out.status.code(),
        Some(124),
        "stderr: {}",
        text(&out.stderr)
    );
    assert!(elapsed < Duration::from_millis(2500), "took {elapsed:?}");
    assert!(
        text(&out.stderr).contains("progress stalled"),
        "{}",
        text(&out.stderr)
    );
    let end = &attempt_ends(&rd)[0];
    assert_eq!(end["classification"], "hung-stalled");
    assert_eq!(end["last_progress"], 1);
}

#[test]
fn stalled_rank_is_named_from_beacons() {
    let dir = tempfile::tempdir().unwrap();
    let rd = dir.path().join("run");
    // Two local ranks write beacons and keep printing; rank 1 stops advancing at step 3.
    let script = r#"i=0
while true; do
  if [ "$RANK" = 0 ] || [ $i -lt 3 ]; then i=$((i+1)); fi
  printf '%s train %s\n' $i $(date +%s) > "$KILN_PROGRESS_DIR/.tmp-$RANK"
  mv "$KILN_PROGRESS_DIR/.tmp-$RANK" "$KILN_PROGRESS_DIR/rank-$RANK"
  echo "rank $RANK alive"
  sleep 0.1
done"#;
    let (out, _) = run(&[
        "launch",
        "--np",
        "2",
        "--stall-timeout",
        "1.5",
        "--grace",
        "1",
        "--run-dir",
        &s(&rd),
        "--",
        "sh",
        "-c",
        script,
    ]);
    assert_eq!(
        out.status.code(),
        Some(124),
        "stderr: {}",
        text(&out.stderr)
    );
    let err = text(&out.stderr);
    assert!(
        err.contains("ranks that stopped advancing first: 1 "),
        "{err}"
    );
    let end = &attempt_ends(&rd)[0];
    assert_eq!(end["classification"], "hung-stalled");
    assert_eq!(end["culprit_ranks"], serde_json::json!([1]));
}

#[test]
fn grandchildren_are_killed_and_nothing_is_left_running() {
    let dir = tempfile::tempdir().unwrap();
    let rd = dir.path().join("run");
    let bg = dir.path().join("bg.pid");
    let escaped = dir.path().join("escaped.pid");
    // One grandchild stays in the process group; one escapes it with setsid.
    let script = format!(
        "sleep 300 & echo $! > {}; setsid sleep 301 & echo $! > {}; echo step=1; sleep 300",
        s(&bg),
        s(&escaped)
    );
    let (out, _) = run(&[
        "launch",
        "--timeout",
        "1",
        "--grace",
        "1",
        "--run-dir",
        &s(&rd),
        "--",
        "sh",
        "-c",
        &script,
    ]);
    assert_eq!(
        out.status.code(),
        Some(124),
        "stderr: {}",
        text(&out.stderr)
    );
    for f in [&bg, &escaped] {
        let pid: i32 = std::fs::read_to_string(f).unwrap().trim().parse().unwrap();
        assert!(!running(pid), "{} (pid {pid}) survived kiln", f.display());
    }
}

#[test]
fn retries_follow_the_backoff_stop_on_success_and_survive_invalid_utf8() {
    let dir = tempfile::tempdir().unwrap();
    let rd = dir.path().join("run");
    let count = dir.path().join("count");
    let script = format!(
        // Attempt 1 trains (to step 1): retried at once. Attempts 2 and 3 get no further: the
        // base, then double. Attempt 4 trains further (step 4): at once; attempt 5 gets no
        // further: back at the base. Attempt 6 succeeds.
        "n=$(cat {c} 2>/dev/null || echo 0); n=$((n+1)); echo $n > {c}; p=$n; [ $n -le 3 ] && p=1; [ $n -eq 5 ] && p=4; printf 'attempt %s \\377\\376\\033[1mstep=%s\\033[0m\\n' $n $p; [ $n -ge 6 ]",
        c = s(&count)
    );
    let (out, _) = run(&[
        "launch",
        "--retries",
        "5",
        "--backoff",
        "0.4,0.6",
        "--run-dir",
        &s(&rd),
        "--",
        "sh",
        "-c",
        &script,
    ]);
    assert_eq!(out.status.code(), Some(0), "stderr: {}", text(&out.stderr));
    assert_eq!(
        std::fs::read_to_string(&count).unwrap().trim(),
        "6",
        "no retry after success"
    );
    assert!(
        out.stdout.windows(2).any(|w| w == b"\xff\xfe"),
        "raw bytes pass through"
    );
    let log = std::fs::read(rd.join("attempt-2.log")).unwrap();
    assert!(
        log.starts_with(b"attempt 2 \xff\xfe\x1b[1mstep=1"),
        "{log:?}"
    );
    let ev = events(&rd);
    let ends: Vec<_> = ev.iter().filter(|e| e.event == "attempt_end").collect();
    let classes: Vec<_> = ends
        .iter()
        .map(|e| e.fields["classification"].as_str().unwrap())
        .collect();
    assert_eq!(
        classes,
        ["failed", "failed", "failed", "failed", "failed", "success"]
    );
    assert_eq!(
        ends[5].fields["last_progress"], 6,
        "progress read through escape codes"
    );
    let backoffs: Vec<f64> = ev
        .iter()
        .filter(|e| e.event == "backoff")
        .map(|e| e.fields["seconds"].as_f64().unwrap())
        .collect();
    assert_eq!(backoffs, [0.0, 0.4, 0.6, 0.0, 0.4]);
    // The gap between an attempt's end and the next start is the backoff.
    let starts: Vec<_> = ev.iter().filter(|e| e.event == "attempt_start").collect();
    for i in 0..5 {
        let gap = starts[i + 1].time - ends[i].fields["end_time"].as_f64().unwrap();
        assert!(
            gap >= backoffs[i] - 0.01 && gap < backoffs[i] + 0.5,
            "gap {gap} for backoff {}",
            backoffs[i]
        );
    }
    let end = ev.iter().find(|e| e.event == "launch_end").unwrap();
    assert_eq!(end.fields["attempts"], 6);
}

#[test]
fn exhausted_retries_return_the_programs_exit_code() {
    let dir = tempfile::tempdir().unwrap();
    let rd = dir.path().join("run");
    let (out, _) = run(&[
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
        "exit 3",
    ]);
    assert_eq!(out.status.code(), Some(3));
    assert_eq!(attempt_ends(&rd).len(), 3);
}

fn wait_for(path: &Path, needle: &str, child: &mut Child) {
    let until = Instant::now() + Duration::from_secs(10);
    while Instant::now() < until {
        if std::fs::read_to_string(path).is_ok_and(|t| t.contains(needle)) {
            return;
        }
        if let Ok(Some(st)) = child.try_wait() {
            panic!("kiln exited early: {st}");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    panic!("{needle:?} never appeared in {}", path.display());
}

#[test]
fn sigterm_to_kiln_is_forwarded_to_the_ranks_and_stops_retrying() {
    let dir = tempfile::tempdir().unwrap();
    let rd = dir.path().join("run");
    let script = "trap 'echo got-term; exit 75' TERM; echo ready; while true; do sleep 0.05; done";
    let mut child = kiln(&[
        "launch",
        "--retries",
        "5",
        "--backoff",
        "0.1",
        "--run-dir",
        &s(&rd),
        "--",
        "sh",
        "-c",
        script,
    ])
    .stdout(Stdio::piped())
    .stderr(Stdio::piped())
    .spawn()
    .unwrap();
    wait_for(&rd.join("attempt-1.log"), "ready", &mut child);
    let t = Instant::now();
    // SAFETY: plain kill(2) on our own child's pid.
    assert_eq!(unsafe { libc_kill(child.id() as i32, 15) }, 0);
    let out = child.wait_with_output().unwrap();
    assert!(
        t.elapsed() < Duration::from_secs(3),
        "stop took {:?}",
        t.elapsed()
    );
    assert_eq!(
        out.status.code(),
        Some(75),
        "the rank's own exit code after a forwarded SIGTERM"
    );
    assert!(
        text(&out.stdout).contains("got-term"),
        "the rank got SIGTERM: {}",
        text(&out.stdout)
    );
    let ends = attempt_ends(&rd);
    assert_eq!(ends.len(), 1, "no retry after SIGTERM");
    assert_eq!(ends[0]["classification"], "interrupted");
}

unsafe extern "C" {
    #[link_name = "kill"]
    fn libc_kill(pid: i32, sig: i32) -> i32;
}

#[test]
fn local_ranks_see_the_rank_environment() {
    let dir = tempfile::tempdir().unwrap();
    let rd = dir.path().join("run");
    let (out, _) = run(&[
        "launch",
        "--np",
        "2",
        "--run-dir",
        &s(&rd),
        "--",
        "sh",
        "-c",
        "echo \"R=$RANK/$WORLD_SIZE L=$LOCAL_RANK/$LOCAL_WORLD_SIZE M=$MASTER_ADDR:$MASTER_PORT P=$KILN_PROGRESS_DIR\"",
    ]);
    assert_eq!(out.status.code(), Some(0), "stderr: {}", text(&out.stderr));
    let stdout = text(&out.stdout);
    let progress = s(&rd.join("progress"));
    for r in 0..2 {
        assert!(
            stdout.contains(&format!("R={r}/2 L={r}/2 M=127.0.0.1:")),
            "{stdout}"
        );
    }
    assert!(stdout.contains(&format!("P={progress}")), "{stdout}");
}

#[test]
fn a_missing_program_exits_127_with_a_message() {
    let dir = tempfile::tempdir().unwrap();
    let (out, _) = run(&[
        "launch",
        "--run-dir",
        &s(&dir.path().join("r")),
        "--",
        "no-such-program-kiln-test",
    ]);
    assert_eq!(out.status.code(), Some(127));
    assert!(
        text(&out.stderr).contains("no-such-program-kiln-test: command not found"),
        "{}",
        text(&out.stderr)
    );
}

#[test]
fn bad_input_names_the_file_line_or_flags() {
    let dir = tempfile::tempdir().unwrap();
    let hf = dir.path().join("hosts.txt");
    std::fs::write(&hf, "node1\nnode2 slots=lots\n").unwrap();
    let (out, _) = run(&["launch", "--mpi", "--hostfile", &s(&hf), "--", "true"]);
    assert_eq!(out.status.code(), Some(2));
    let err = text(&out.stderr);
    assert!(err.contains("hosts.txt") && err.contains("line 2"), "{err}");

    std::fs::write(&hf, "# empty\n").unwrap();
    let (out, _) = run(&["launch", "--mpi", "--hostfile", &s(&hf), "--", "true"]);
    assert_eq!(out.status.code(), Some(2));
    assert!(
        text(&out.stderr).contains("lists no hosts"),
        "{}",
        text(&out.stderr)
    );

    let (out, _) = run(&[
        "launch", "--np", "3", "--ppn", "2", "--nnodes", "1", "--", "true",
    ]);
    assert_eq!(out.status.code(), Some(2));
    assert!(
        text(&out.stderr).contains("--np 3 is more than --nnodes 1 x --ppn 2"),
        "{}",
        text(&out.stderr)
    );

    let (out, _) = run(&["launch", "--retries", "1", "--auto-retry", "--", "true"]);
    assert_eq!(out.status.code(), Some(2));
    assert!(
        text(&out.stderr).contains("--auto-retry"),
        "{}",
        text(&out.stderr)
    );

    // A straggler can only be a node failure where kiln swaps nodes.
    let (out, _) = run(&["launch", "--straggler-is-node-failure", "--", "true"]);
    assert_eq!(out.status.code(), Some(2));
    assert!(
        text(&out.stderr).contains("--auto-retry"),
        "{}",
        text(&out.stderr)
    );

    let (out, _) = run(&["launch", "--progress-regex", "step", "--", "true"]);
    assert_eq!(out.status.code(), Some(2));
    assert!(
        text(&out.stderr).contains("capture group"),
        "{}",
        text(&out.stderr)
    );
}

#[test]
fn dry_run_prints_the_pbs_and_slurm_argv() {
    let dir = tempfile::tempdir().unwrap();
    let nodefile = dir.path().join("nodefile");
    std::fs::write(&nodefile, "x1\nx1\nx2\nx2\n").unwrap();
    let out = kiln(&[
        "launch",
        "--dry-run",
        "--ppn",
        "2",
        "--cpu-bind",
        "none",
        "--",
        "python",
        "train.py",
    ])
    .env("PBS_JOBID", "7.pbs")
    .env("PBS_NODEFILE", &nodefile)
    .output()
    .unwrap();
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    let stdout = text(&out.stdout);
    let want = format!(
        "argv: [\"mpiexec\",\"--envall\",\"-n\",\"4\",\"-ppn\",\"2\",\"--hostfile\",\"{}\",\"{KILN}\",\"launch\",\"--as-rank\",\"--\",\"python\",\"train.py\"]",
        s(&nodefile)
    );
    assert!(stdout.contains(&want), "{stdout}\nwant {want}");

    let out = kiln(&[
        "launch",
        "--dry-run",
        "--gpus-per-node",
        "4",
        "--",
        "python",
        "train.py",
    ])
    .env("SLURM_JOB_ID", "9")
    .env("SLURM_JOB_NODELIST", "nid[001-002]")
    .output()
    .unwrap();
    let stdout = text(&out.stdout);
    let want = format!(
        "argv: [\"srun\",\"--nodes=2\",\"--ntasks=8\",\"--ntasks-per-node=4\",\"--gpus-per-node=4\",\"--kill-on-bad-exit=1\",\"--overlap\",\"{KILN}\",\"launch\",\"--as-rank\",\"--\",\"python\",\"train.py\"]"
    );
    assert!(stdout.contains(&want), "{stdout}\nwant {want}");
}

#[test]
fn help_documents_flags_and_every_exit_classification() {
    let out = kiln(&["launch", "--help"]).output().unwrap();
    let help = text(&out.stdout);
    for needle in [
        "--timeout",
        "--stall-timeout",
        "--progress-regex",
        "--retries",
        "--auto-retry",
        "--backoff",
        "--grace",
        "--walltime",
        "--np",
        "--ppn",
        "--nnodes",
        "--hostfile",
        "--mpi",
        "--dry-run",
        "--run-dir",
        "success",
        "failed",
        "hung-silent",
        "hung-stalled",
        "killed-by-signal",
        "preempted",
        "walltime",
        "not-found",
        "interrupted",
        "124",
        "127",
        "75",
    ] {
        assert!(help.contains(needle), "launch --help lacks {needle}");
    }
    let out = kiln(&["doctor", "--help"]).output().unwrap();
    assert!(text(&out.stdout).contains("--hostfile"));
    let out = kiln(&["doctor"]).output().unwrap();
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    let report = text(&out.stdout);
    assert!(
        report.contains("scheduler:     none") && report.contains("rank env:"),
        "{report}"
    );
}

/// `kiln doctor --device`: on flex every fused kernel agrees with its composed twin (f32;
/// bf16 has no kernels there to check, said so, and NCCL is not used); an unknown device is
/// a config error naming it, not a panic.
#[test]
fn doctor_checks_a_device_and_refuses_an_unknown_one() {
    let out = kiln(&["doctor", "--device", "flex"]).output().unwrap();
    let report = text(&out.stdout);
    assert_eq!(out.status.code(), Some(0), "{report}{}", text(&out.stderr));
    let checks: Vec<&str> = report
        .lines()
        .filter(|l| l.contains("(tolerance"))
        .collect();
    assert!(checks.len() >= 20, "{report}");
    assert!(checks.iter().all(|l| l.ends_with(" ok")), "{report}");
    assert!(report.contains("kernels bf16: skipped"), "{report}");
    assert!(
        report.contains("nccl:          not used on flex"),
        "{report}"
    );
    let out = kiln(&["doctor", "--device", "nonsense"]).output().unwrap();
    assert_eq!(out.status.code(), Some(78), "{}", text(&out.stdout));
    assert!(
        text(&out.stderr).contains("device \"nonsense\": unknown device"),
        "{}",
        text(&out.stderr)
    );
}

#[test]
fn auto_retry_gives_up_when_attempts_stop_making_progress() {
    let dir = tempfile::tempdir().unwrap();
    let rd = dir.path().join("run");
    let (out, _) = run(&[
        "launch",
        "--auto-retry",
        "--backoff",
        "0.05",
        "--run-dir",
        &s(&rd),
        "--",
        "sh",
        "-c",
        "echo step=1; exit 1",
    ]);
    assert_eq!(out.status.code(), Some(1), "stderr: {}", text(&out.stderr));
    // Attempt 1 makes new progress (step 1); attempts 2-4 get no further: three in a row.
    assert_eq!(attempt_ends(&rd).len(), 4);
}

#[test]
fn status_shows_the_goodput_ledger_and_plot_draws_the_timeline() {
    let dir = tempfile::tempdir().unwrap();
    let rd = dir.path().join("run");
    let count = dir.path().join("count");
    let script = format!(
        "n=$(cat {c} 2>/dev/null || echo 0); n=$((n+1)); echo $n > {c}; sleep 0.2; echo step=1; sleep 0.3; echo step=2; [ $n -ge 2 ]",
        c = s(&count)
    );
    let (out, _) = run(&[
        "launch",
        "--retries",
        "1",
        "--backoff",
        "0.3",
        "--run-dir",
        &s(&rd),
        "--",
        "sh",
        "-c",
        &script,
    ]);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    let status = kiln(&["status", &s(&rd)]).output().unwrap();
    assert_eq!(status.status.code(), Some(0), "{}", text(&status.stderr));
    let report = text(&status.stdout);
    for needle in [
        "goodput: ETTR",
        "productive",
        "startup",
        "lost work",
        "backoff",
        "2 attempt(s)",
        "failed",
    ] {
        assert!(report.contains(needle), "{needle:?} missing in\n{report}");
    }
    let plot = kiln(&["plot", &s(&rd)]).output().unwrap();
    assert_eq!(plot.status.code(), Some(0), "{}", text(&plot.stderr));
    assert!(rd.join("plots/timeline.svg").exists() && rd.join("plots/timeline.png").exists());
}

/// `step=18446744073709551615` was taken as progress, so a healthy job that then counted 1, 2,
/// 3 was killed as stalled; a counter that starts again from 1 looked the same. Progress
/// counts when it is plausible and moves forward, and a restarted counter goes on counting;
/// a job stuck at one step is still caught.
#[test]
fn implausible_and_restarting_step_counters_are_not_stalls() {
    let dir = tempfile::tempdir().unwrap();
    // Each job prints a step every 0.3 s for about 6 s: twice the stall timeout.
    let series = "for i in 1 2 3 4 5 6 7 8 9 10; do sleep 0.3; echo step=$i; done";
    for (name, script) in [
        (
            "garbage",
            format!("echo step=18446744073709551615; {series}"),
        ),
        ("huge", format!("echo step=99999999999; {series}")),
        ("restart", format!("{series}; {series}")),
    ] {
        let rd = dir.path().join(name);
        let (out, _) = run(&[
            "launch",
            "--stall-timeout",
            "3",
            "--run-dir",
            &s(&rd),
            "--",
            "sh",
            "-c",
            &script,
        ]);
        assert_eq!(out.status.code(), Some(0), "{name}: {}", text(&out.stderr));
        let end = &attempt_ends(&rd)[0];
        assert_eq!(end["classification"], "success", "{name}");
        assert_eq!(end["last_progress"], 10, "{name}");
    }
    // A job that goes back and forth between two steps is stuck, not progressing.
    let rd = dir.path().join("stuck");
    let stuck = "echo step=10; while true; do echo step=9; echo step=10; sleep 0.1; done";
    let (out, _) = run(&[
        "launch",
        "--stall-timeout",
        "1",
        "--grace",
        "1",
        "--run-dir",
        &s(&rd),
        "--",
        "sh",
        "-c",
        stuck,
    ]);
    assert_eq!(out.status.code(), Some(124), "{}", text(&out.stderr));
    assert_eq!(attempt_ends(&rd)[0]["classification"], "hung-stalled");
}

#[test]
fn bad_startup_timeouts_and_strikes_are_usage_errors() {
    for (flag, needle) in [
        ("--startup-timeout=-1", "--startup-timeout -1"),
        ("--startup-timeout=nan", "--startup-timeout NaN"),
        ("--strikes=0", "--strikes"),
    ] {
        let (out, _) = run(&["launch", flag, "--", "true"]);
        assert_eq!(out.status.code(), Some(2), "{flag}: {}", text(&out.stderr));
        assert!(
            text(&out.stderr).contains(needle),
            "{flag}: {}",
            text(&out.stderr)
        );
    }
}

/// Issue 46: under a local launch the ranks' last lines ran into each other mid-line
/// (`rank 0 donerank 1 done`): each rank's output reaches kiln's output and the attempt log
/// in whole lines, and a last line without its newline gets one.
#[test]
fn local_ranks_last_lines_do_not_run_together() {
    let dir = tempfile::tempdir().unwrap();
    let rd = dir.path().join("run");
    let (out, _) = run(&[
        "launch",
        "--np",
        "2",
        "--run-dir",
        &s(&rd),
        "--",
        "sh",
        "-c",
        "printf 'rank %s done' $RANK",
    ]);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    let log = std::fs::read(rd.join("attempt-1.log")).unwrap();
    for (what, bytes) in [("stdout", &out.stdout), ("log", &log)] {
        let mut lines: Vec<String> = text(bytes).lines().map(str::to_string).collect();
        lines.sort();
        assert_eq!(
            lines,
            ["rank 0 done", "rank 1 done"],
            "{what}: {:?}",
            text(bytes)
        );
    }
}

/// Held out: four ranks, each writing its lines in pieces with pauses between them (the
/// others' pieces arrive in between), on stdout and stderr: every line kiln passes on is
/// one rank's whole line.
#[test]
fn local_ranks_lines_written_in_pieces_stay_whole() {
    let dir = tempfile::tempdir().unwrap();
    let rd = dir.path().join("run");
    let script = "for i in 1 2 3; do printf 'r%s line %s ' $RANK $i; sleep 0.05; \
                  printf 'middle of r%s ' $RANK; sleep 0.05; echo \"end of r$RANK\"; \
                  printf 'err r%s ' $RANK >&2; sleep 0.03; echo \"tail r$RANK\" >&2; done";
    let (out, _) = run(&[
        "launch",
        "--np",
        "4",
        "--run-dir",
        &s(&rd),
        "--",
        "sh",
        "-c",
        script,
    ]);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    let whole = |line: &str| {
        (0..4).any(|r| {
            (1..=3).any(|i| line == format!("r{r} line {i} middle of r{r} end of r{r}"))
                || line == format!("err r{r} tail r{r}")
        })
    };
    let log = std::fs::read(rd.join("attempt-1.log")).unwrap();
    let err = text(&out.stderr);
    let rank_err: Vec<&str> = err.lines().filter(|l| l.starts_with("err ")).collect();
    assert_eq!(rank_err.len(), 12, "{err}");
    for (what, t) in [("stdout", text(&out.stdout)), ("log", text(&log))] {
        let lines: Vec<&str> = t.lines().collect();
        let ours: Vec<&&str> = lines
            .iter()
            .filter(|l| l.starts_with('r') || l.starts_with("err"))
            .collect();
        assert_eq!(
            ours.len(),
            if what == "log" { 24 } else { 12 },
            "{what}: {t}"
        );
        for l in ours {
            assert!(whole(l), "{what}: a line was cut: {l:?}\n{t}");
        }
    }
    for l in rank_err {
        assert!(whole(l), "stderr: a line was cut: {l:?}");
    }
}

/// Issue 46: two ranks in lockstep (as in a gloo all-reduce), rank 1 stopping before the
/// collective of step 5 and rank 0 waiting in it. Both ranks' last output is step 4, rank 1's
/// line a second later: nothing kiln saw tells them apart (no beacons, both processes
/// asleep), so no rank may be named (it named rank 0, with evidence labelled `beacon` that
/// came from the output). The stall is still caught in about `--stall-timeout` and retried.
#[test]
fn a_stall_that_output_cannot_attribute_names_no_rank() {
    let dir = tempfile::tempdir().unwrap();
    let rd = dir.path().join("run");
    let script = "i=1; while [ $i -le 4 ]; do \
                    if [ \"$RANK\" = 1 ] && [ $i = 4 ]; then sleep 1; fi; \
                    echo \"step: $i\"; i=$((i+1)); sleep 0.1; \
                  done; sleep 60";
    let t0 = Instant::now();
    let (out, _) = run(&[
        "launch",
        "--np",
        "2",
        "--retries",
        "1",
        "--stall-timeout",
        "3",
        "--grace",
        "1",
        "--run-dir",
        &s(&rd),
        "--",
        "sh",
        "-c",
        script,
    ]);
    assert_eq!(out.status.code(), Some(124), "{}", text(&out.stderr));
    assert!(t0.elapsed() < Duration::from_secs(30), "{:?}", t0.elapsed());
    let ends = attempt_ends(&rd);
    assert_eq!(ends.len(), 2, "retried once: {ends:?}");
    for end in &ends {
        assert_eq!(end["classification"], "hung-stalled", "{end:?}");
        assert_eq!(end["culprit_ranks"], serde_json::json!([]), "{end:?}");
        let message = end["message"].as_str().unwrap_or_default();
        assert!(
            message.contains("ranks 0, 1 all stopped at step 4 (from their output")
                && message.contains("nothing kiln saw tells them apart"),
            "{message}"
        );
        let evidence = end["evidence"].as_array().cloned().unwrap_or_default();
        assert!(
            evidence.iter().all(|e| e["source"] != "beacon"),
            "{evidence:?}"
        );
    }
}

/// Held out: three ranks, and what does tell them apart. From the output alone, a rank
/// whose last step is lower than the others' (rank 2 stops at step 2, the others reach 5);
/// from beacons with phases, the rank still computing while the others wait in a collective
/// (rank 1 of 3, all at step 7). Each is named, its evidence labelled with its source.
#[test]
fn a_stall_names_the_rank_that_output_steps_or_beacon_phases_set_apart() {
    let dir = tempfile::tempdir().unwrap();
    let by_output = "i=1; while [ $i -le 5 ]; do \
                       if [ \"$RANK\" = 2 ] && [ $i = 3 ]; then sleep 60; fi; \
                       echo \"step: $i\"; i=$((i+1)); sleep 0.1; done; sleep 60";
    let by_phase = "for i in 1 2 3 4 5 6 7; do \
                      printf '%s train %s\\n' $i $(date +%s) > \"$KILN_PROGRESS_DIR/.t$RANK\"; \
                      mv \"$KILN_PROGRESS_DIR/.t$RANK\" \"$KILN_PROGRESS_DIR/rank-$RANK\"; sleep 0.1; done; \
                    if [ \"$RANK\" != 1 ]; then \
                      printf '7 collective %s\\n' $(date +%s) > \"$KILN_PROGRESS_DIR/.t$RANK\"; \
                      mv \"$KILN_PROGRESS_DIR/.t$RANK\" \"$KILN_PROGRESS_DIR/rank-$RANK\"; fi; \
                    while true; do echo \"rank $RANK alive\"; sleep 0.2; done";
    for (name, script, rank, source) in [
        ("output", by_output, 2, "output"),
        ("phase", by_phase, 1, "beacon"),
    ] {
        let rd = dir.path().join(name);
        let (out, _) = run(&[
            "launch",
            "--np",
            "3",
            "--stall-timeout",
            "2",
            "--grace",
            "1",
            "--run-dir",
            &s(&rd),
            "--",
            "sh",
            "-c",
            script,
        ]);
        assert_eq!(
            out.status.code(),
            Some(124),
            "{name}: {}",
            text(&out.stderr)
        );
        let end = &attempt_ends(&rd)[0];
        assert_eq!(
            end["culprit_ranks"],
            serde_json::json!([rank]),
            "{name}: {end:?}"
        );
        let evidence = end["evidence"].as_array().cloned().unwrap_or_default();
        assert!(
            !evidence.is_empty() && evidence.iter().all(|e| e["source"] == source),
            "{name}: {evidence:?}"
        );
    }
}

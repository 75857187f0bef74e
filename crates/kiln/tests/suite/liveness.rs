//! Liveness apart from progress (issue 21): ranks beat to their node's launcher every 0.1 s
//! from a thread; a SIGSTOPped rank falls silent and is found within `--heartbeat-timeout`, a
//! SIGKILLed rank ends the attempt at once; either way the other rank (blocked, as in a
//! collective) is not left waiting, and the rank and host are named. Ranks that all keep
//! beating but stop making progress are caught by the stall watchdog after a multiple of their
//! observed step time (its default), and a slow run that still progresses is left alone.
//! Detection times are read from the recorded events, not measured on this (loaded) machine.

use crate::common;

use serde_json::Value;
use std::path::Path;

/// A Python rank program that first beats like kiln's trainer (a thread writing to
/// `$KILN_HEARTBEAT_FD` every 0.1 s), then runs `$rest`.
macro_rules! beating_rank {
    ($rest:literal) => {
        concat!(
            "import os, sys, threading, time
fd = int(os.environ['KILN_HEARTBEAT_FD'])
def beat():
    while True:
        os.write(fd, b'.')
        time.sleep(0.1)
threading.Thread(target=beat, daemon=True).start()
",
            $rest
        )
    };
}

/// A rank that beats like kiln's trainer (a thread writing to `$KILN_HEARTBEAT_FD`), then
/// blocks forever as a rank waiting in a collective would.
const RANK: &str = beating_rank!(
    "r = os.environ['RANK']
time.sleep(0.3)
open('pid-' + r + '.tmp', 'w').write(str(os.getpid()))
os.rename('pid-' + r + '.tmp', 'pid-' + r)
print('ready-' + r, flush=True)
time.sleep(600)
"
);

fn attempt_end(rd: &Path) -> serde_json::Map<String, Value> {
    let events = kiln_run::read_events(rd).unwrap();
    let end = events
        .iter()
        .find(|e| e.event == kiln_run::event::ATTEMPT_END)
        .expect("an attempt_end event");
    end.fields.clone()
}

/// Runs 2 ranks (`mpi`: under mpirun), sends `signal` to rank 1, and returns its attempt_end.
fn fault_one_of_two(mpi: bool, signal: i32) -> serde_json::Map<String, Value> {
    let dir = tempfile::tempdir().unwrap();
    let rd = dir.path().join("run");
    let mut cmd = common::kiln_cmd(&["launch", "--np", "2", "--timeout", "120"]);
    if mpi {
        cmd.arg("--mpi");
    }
    let mut child = cmd
        .current_dir(dir.path())
        .args(["--heartbeat-timeout", "1", "--grace", "2", "--run-dir"])
        .arg(&rd)
        .args(["--", "python3", "-c", RANK])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    for r in 0..2 {
        common::wait_for_file_text(&rd.join("attempt-1.log"), &format!("ready-{r}"), &mut child);
    }
    let pid: i32 = std::fs::read_to_string(dir.path().join("pid-1"))
        .unwrap()
        .trim()
        .parse()
        .unwrap();
    // SAFETY: kill(2) on the pid of a rank this test started.
    assert_eq!(unsafe { libc::kill(pid, signal) }, 0);
    let out = child.wait_with_output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    // A stopped rank that kiln did not kill must not outlive the test.
    // SAFETY: as above; ESRCH when it is gone, as it should be.
    let survivor = unsafe { libc::kill(pid, 0) } == 0;
    if survivor {
        // SAFETY: as above.
        unsafe { libc::kill(pid, libc::SIGKILL) };
    }
    assert!(
        !survivor,
        "mpi={mpi}: the faulted rank outlived the attempt"
    );
    let end = attempt_end(&rd);
    assert_ne!(out.status.code(), Some(0), "mpi={mpi}: {stderr}");
    assert_eq!(
        end["culprit_ranks"],
        serde_json::json!([1]),
        "mpi={mpi}: {end:?}"
    );
    let message = end["message"].as_str().unwrap_or_default();
    assert!(
        message.contains(&format!("rank 1 on {}", kiln_run::this_host())),
        "mpi={mpi}: the rank and host are named: {message}"
    );
    end
}

#[test]
fn a_stopped_rank_is_found_within_the_heartbeat_timeout_on_every_launch_path() {
    for mpi in [false, true] {
        let end = fault_one_of_two(mpi, libc::SIGSTOP);
        assert_eq!(end["classification"], "no-heartbeat", "mpi={mpi}: {end:?}");
        let detect = end["detect_s"].as_f64().unwrap();
        eprintln!(
            "SIGSTOP mpi={mpi}: detect_s {detect:.3} kill_s {}",
            end["kill_s"]
        );
        // Silent for the 1 s bound, found at the next check (0.1 s apart).
        assert!((1.0..1.5).contains(&detect), "mpi={mpi}: detect_s {detect}");
    }
}

#[test]
fn a_killed_rank_ends_the_attempt_at_once_on_every_launch_path() {
    for mpi in [false, true] {
        let end = fault_one_of_two(mpi, libc::SIGKILL);
        assert_eq!(
            end["classification"], "killed-by-signal",
            "mpi={mpi}: {end:?}"
        );
        let detect = end["detect_s"].as_f64().unwrap();
        eprintln!(
            "SIGKILL mpi={mpi}: detect_s {detect:.3} kill_s {}",
            end["kill_s"]
        );
        assert!(detect < 1.0, "mpi={mpi}: detect_s {detect}");
    }
}

/// A rank that beats like kiln's trainer and writes a beacon per step: it sleeps each of the
/// comma-separated seconds of argv[1] (one step each), then exits 0, or with argv[2] = `hang`
/// keeps printing and beating without another step (a hang every rank still beats through).
const STEPPER: &str = beating_rank!(
    "d, r = os.environ['KILN_PROGRESS_DIR'], os.environ['RANK']
def beacon(step):
    tmp = os.path.join(d, '.tmp-' + r)
    open(tmp, 'w').write('%d train %.3f\\n' % (step, time.time()))
    os.replace(tmp, os.path.join(d, 'rank-' + r))
step = 0
beacon(step)
for w in sys.argv[1].split(','):
    time.sleep(float(w))
    step += 1
    beacon(step)
    print('rank', r, 'did step', step, flush=True)
while sys.argv[2] == 'hang':
    print('rank', r, 'alive', flush=True)
    time.sleep(0.2)
"
);

/// `kiln launch --np 2` of [`STEPPER`] with the stall watchdog on its default; the exit code
/// and the attempt's end.
fn stepper(steps: &str, then: &str) -> (Option<i32>, serde_json::Map<String, Value>, Value) {
    let dir = tempfile::tempdir().unwrap();
    let rd = dir.path().join("run");
    let out = common::kiln_cmd(&["launch", "--np", "2", "--grace", "1", "--run-dir"])
        .arg(&rd)
        .args(["--", "python3", "-c", STEPPER, steps, then])
        .output()
        .unwrap();
    let status = common::kiln_cmd(&["status", "--json"])
        .arg(&rd)
        .output()
        .unwrap();
    let status: Value = serde_json::from_slice(&status.stdout).unwrap();
    (out.status.code(), attempt_end(&rd), status)
}

#[test]
fn a_hang_every_rank_beats_through_is_caught_after_a_multiple_of_the_step_time() {
    let (code, end, status) = stepper("0.5,0.5,0.5,0.5,0.5,0.5", "hang");
    assert_eq!(code, Some(124), "{end:?}");
    assert_eq!(end["classification"], "hung-stalled", "{end:?}");
    let message = end["message"].as_str().unwrap_or_default();
    assert!(
        message.contains("default: 10 x slowest recent step"),
        "{message}"
    );
    // "... stalled for D s (limit L s: default: ...": the limit the watchdog derived.
    let limit: f64 = message
        .split("(limit ")
        .nth(1)
        .and_then(|t| t.split(' ').next())
        .and_then(|t| t.parse().ok())
        .unwrap_or_else(|| panic!("no limit in {message}"));
    let detect = end["detect_s"].as_f64().unwrap();
    eprintln!("stall: limit {limit:.2} s, detect_s {detect:.2} s: {message}");
    // 10 x the slowest step seen (0.5 s, read every 0.2 s: at most about 0.9 s), above the
    // 3 s floor; caught when the stalled ranks had been idle that long.
    assert!((4.5..=10.0).contains(&limit), "limit {limit}");
    assert!(
        detect >= limit - 0.05 && detect < limit + 2.0,
        "detect_s {detect}"
    );
    // The ledger tells the same detection time.
    let faults = status["ledger"]["faults"].as_array().unwrap();
    assert_eq!(faults.len(), 1, "{faults:?}");
    assert_eq!(faults[0]["classification"], "hung-stalled");
    assert_eq!(faults[0]["detect_s"].as_f64(), Some(detect));
}

#[test]
fn a_slow_run_that_still_progresses_is_not_stopped() {
    // Each step up to twice as long as the last, the last one 4 s: longer than the 3 s a
    // fixed limit had, well within 10 x the slowest step seen.
    let (code, end, status) = stepper("0.3,0.6,1.2,2.4,4.0", "exit");
    assert_eq!(code, Some(0), "{end:?}");
    assert_eq!(end["classification"], "success", "{end:?}");
    assert_eq!(status["ledger"]["faults"], serde_json::json!([]));
}

//! Liveness apart from progress (issue 21): ranks beat to their node's launcher every 0.1 s
//! from a thread; a SIGSTOPped rank falls silent and is found within `--heartbeat-timeout`, a
//! SIGKILLed rank ends the attempt at once; either way the other rank (blocked, as in a
//! collective) is not left waiting, and the rank and host are named. Detection times are read
//! from the recorded events, not measured on this (loaded) machine.

mod common;

use serde_json::Value;
use std::path::Path;

/// A rank that beats like kiln's trainer (a thread writing to `$KILN_HEARTBEAT_FD`), then
/// blocks forever as a rank waiting in a collective would.
const RANK: &str = "import os, threading, time
fd = int(os.environ['KILN_HEARTBEAT_FD'])
def beat():
    while True:
        os.write(fd, b'.')
        time.sleep(0.1)
threading.Thread(target=beat, daemon=True).start()
r = os.environ['RANK']
time.sleep(0.3)
open('pid-' + r + '.tmp', 'w').write(str(os.getpid()))
os.rename('pid-' + r + '.tmp', 'pid-' + r)
print('ready-' + r, flush=True)
time.sleep(600)
";

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

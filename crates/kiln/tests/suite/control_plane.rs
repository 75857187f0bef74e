//! The control plane under a real `kiln launch --mpi` training run: with `--control-plane tcp`
//! (the default) nothing polls the run directory: the ranks' beacons, liveness and stop files
//! stay in node memory and reach kiln through the node agent. The same run on the `files`
//! plane shows what the count would catch. strace counts the operations of every process of
//! the launch (`.ci/run` installs it; without it this test fails on purpose).

use crate::common;
use std::process::Command;

/// Runs a 2-rank training of a few seconds under strace; the path-based file operations (opens,
/// stats, renames, ...) of every process on the run's `progress/` directory.
fn progress_ops(plane: &str) -> Vec<String> {
    let dir = tempfile::tempdir().unwrap();
    let rd = dir.path().join("run");
    let log = dir.path().join("strace.log");
    let mut cmd = Command::new("strace");
    cmd.args(["-f", "--seccomp-bpf", "-qq", "-e", "trace=%file", "-o"])
        .arg(&log)
        .arg(common::KILN)
        .args(["launch", "--mpi", "--np", "2", "--control-plane", plane])
        .args(["--timeout", "120", "--run-dir"])
        .arg(&rd)
        .args([
            "--",
            common::KILN,
            "train",
            "--no-progress-bar",
            "--run-dir",
        ])
        .arg(&rd);
    for set in common::TINY_MODEL.iter().chain(&[
        "training.steps=1500",
        "training.threads=1",
        "training.batch_size=2",
        "checkpoint.interval=100000",
        "checkpoint.snapshot_interval=0",
        "eval.interval=0",
    ]) {
        cmd.arg("--set").arg(set);
    }
    for k in common::DETECTED {
        cmd.env_remove(k);
    }
    let out = cmd
        .output()
        .expect("strace (Debian package strace) runs kiln launch");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let progress = rd.join("progress");
    let text = std::fs::read_to_string(&log).unwrap();
    let quoted = format!("\"{}", progress.display());
    text.lines()
        .filter(|l| l.contains(&quoted))
        .map(str::to_string)
        .collect()
}

#[test]
fn a_training_run_under_mpirun_makes_no_polling_operations_on_the_run_directory() {
    let tcp = progress_ops("tcp");
    let files = progress_ops("files");
    // The files plane: the shims check the stop file every 25 ms and the supervisor lists the
    // directory several times a second: thousands of operations in a few seconds.
    assert!(
        files.len() > 500,
        "the files plane made only {} operations",
        files.len()
    );
    // The tcp plane: only what an attempt does once (the directory made and cleared, each
    // rank's Open MPI job record, the node records read at the end), none of it a poll.
    assert!(
        tcp.len() < 60,
        "{} operations on progress/ under --control-plane tcp:\n{}",
        tcp.len(),
        tcp.join("\n")
    );
    for polled in ["stop", "rank-", "live-", "exit-"] {
        let n = tcp
            .iter()
            .filter(|l| l.contains(&format!("progress/{polled}")))
            .count();
        assert_eq!(
            n,
            0,
            "progress/{polled}: {n} operations under tcp:\n{}",
            tcp.join("\n")
        );
    }
    eprintln!(
        "operations on progress/: files plane {}, tcp plane {}",
        files.len(),
        tcp.len()
    );
}

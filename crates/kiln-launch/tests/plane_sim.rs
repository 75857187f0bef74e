//! The control plane on a simulated 16-node job (`kiln-plane-sim`, what
//! `bench/launch/scale.sh` runs at 256 nodes): kiln's real supervisor and node agents, 12
//! simulated ranks a node. Each fault is found, its culprit named, and in steady state the
//! supervisor does nothing on the run directory.

use std::process::Command;

fn scale(fault: &str, plane: &str) -> serde_json::Value {
    let out = Command::new(env!("CARGO_BIN_EXE_kiln-plane-sim"))
        .args([
            "scale",
            "--nodes",
            "16",
            "--ranks-per-node",
            "12",
            "--warmup-s",
            "4",
        ])
        .args(["--step-s", "0.25", "--fault", fault, "--plane", plane])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let line = String::from_utf8_lossy(&out.stdout);
    serde_json::from_str(line.trim()).unwrap_or_else(|e| panic!("{e}: {line}"))
}

#[test]
fn a_16_node_job_finds_every_fault_in_time_and_names_its_culprit() {
    // (fault, classification, detection bound in seconds: the 0.5 s heartbeat bound plus
    // forwarding for a stopped rank; a killed rank's exit record at once; a dropped agent
    // after its 0.3 s settle; a straggler after the straggler watch's steps).
    for (fault, class, bound) in [
        ("stop", "NoHeartbeat", 2.0),
        ("kill", "Signaled", 1.5),
        ("agent", "NoHeartbeat", 2.5),
        ("straggler", "Straggler", 30.0),
    ] {
        let r = scale(fault, "tcp");
        assert_eq!(r["classification"], class, "{fault}: {r}");
        assert_eq!(r["culprit_ok"], true, "{fault}: {r}");
        let detect = r["detect_s"].as_f64().unwrap();
        assert!(
            detect > 0.0 && detect < bound,
            "{fault}: detected after {detect} s: {r}"
        );
        assert!(r["supervisor_cpu"].as_f64().unwrap() < 0.25, "{r}");
    }
}

#[test]
fn the_files_plane_still_finds_a_stopped_rank() {
    let r = scale("stop", "files");
    assert_eq!(r["classification"], "NoHeartbeat", "{r}");
    assert_eq!(r["culprit_ok"], true, "{r}");
}

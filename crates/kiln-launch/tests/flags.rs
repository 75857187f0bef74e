//! `kiln launch`'s flags are defined once (kiln_launch::LaunchRequest): a request written back
//! as a command line (`to_argv`, what `kiln submit` puts in a batch script) parses to the same
//! request, whatever its values, and the list of kiln's flag names is derived from it.

use kiln_launch::{LaunchRequest, TopologyFlags, kiln_flags};
use proptest::prelude::*;
use std::path::PathBuf;

fn text() -> impl Strategy<Value = String> {
    // Any printable text, hyphens and `=` included (a regex, a walltime, a path).
    "[ -~]{1,24}"
}

fn request() -> impl Strategy<Value = LaunchRequest> {
    let sizes = (
        proptest::option::of(1usize..100_000),
        proptest::option::of(1usize..1024),
        proptest::option::of(1usize..10_000),
        proptest::option::of(text().prop_map(PathBuf::from)),
        prop::sample::select(vec!["auto", "pbs", "slurm", "none"]),
        any::<bool>(),
        any::<bool>(),
        prop::sample::select(vec!["auto", "nvidia", "amd", "intel", "cpu"]),
        proptest::option::of(0usize..64),
        proptest::option::of(text()),
        proptest::option::of(text()),
        proptest::option::of(1u16..),
    );
    let watch = (
        any::<bool>(),
        proptest::option::of(0.0f64..1e6),
        proptest::option::of(0.0f64..1e6),
        text(),
        0.0f64..1e3,
        proptest::option::of(text()),
        proptest::option::of(0u32..100),
        proptest::option::of(0usize..100),
        proptest::option::of(1usize..100),
        proptest::option::of(text().prop_map(PathBuf::from)),
        text(),
    );
    let rest = (
        proptest::option::of(1u32..100),
        proptest::option::of(text().prop_map(PathBuf::from)),
        proptest::option::of(text().prop_map(PathBuf::from)),
        any::<bool>(),
        any::<bool>(),
        0.01f64..1e3,
        1u32..10,
        proptest::option::of(0.0f64..1e6),
        prop::sample::select(vec!["auto", "keep", "remove"]),
    );
    (sizes, watch, rest).prop_map(|(s, w, r)| {
        LaunchRequest {
            np: s.0,
            ppn: s.1,
            nnodes: s.2,
            oversubscribe: s.6,
            topology: TopologyFlags {
                hostfile: s.3,
                scheduler: s.4.into(),
                mpi: s.5,
                accelerator: s.7.into(),
                gpus_per_node: s.8,
            },
            cpu_bind: s.9,
            master_addr: s.10,
            master_port: s.11,
            no_rank_env: w.0,
            timeout: w.1,
            stall_timeout: w.2,
            startup_timeout: r.7,
            progress_regex: w.3,
            grace: w.4,
            heartbeat_timeout: r.5,
            walltime: w.5,
            control_plane: if r.3 { "files" } else { "tcp" }.to_string(),
            // --retries and --auto-retry exclude each other.
            retries: w.6.filter(|_| !r.3),
            auto_retry: r.3,
            // Only with --auto-retry.
            straggler_is_node_failure: r.3 && w.0,
            straggler_cost: None,
            spares: w.7,
            strikes: r.6,
            min_nodes: w.8,
            quarantine_file: w.9,
            backoff: w.10,
            chain: r.0,
            chain_script: r.1,
            run_dir: r.2,
            memory_tier_at_end: r.8.into(),
            dry_run: r.4,
            as_rank: false,
            release_node: false,
            command: Vec::new(),
        }
    })
}

proptest! {
    #[test]
    fn a_request_written_as_flags_parses_back_to_itself(req in request()) {
        let argv = req.to_argv().expect("UTF-8 values are written");
        let back = LaunchRequest::parse_flags(&argv)
            .map_err(|e| TestCaseError::fail(format!("{argv:?}: {e}")))?;
        prop_assert_eq!(back, req, "{:?}", argv);
    }
}

#[test]
fn paths_that_are_not_utf8_are_written_byte_for_byte() {
    use std::os::unix::ffi::OsStrExt;
    let odd = std::ffi::OsStr::from_bytes(b"/runs/\xff a\n").to_owned();
    let req = LaunchRequest {
        run_dir: Some(PathBuf::from(&odd)),
        quarantine_file: Some(PathBuf::from(&odd)),
        topology: TopologyFlags {
            hostfile: Some(PathBuf::from(&odd)),
            ..TopologyFlags::default()
        },
        ..LaunchRequest::default()
    };
    let argv = req.to_argv().expect("paths are written as bytes");
    assert_eq!(LaunchRequest::parse_flags(&argv).unwrap(), req, "{argv:?}");
}

#[test]
fn defaults_write_nothing_and_the_flag_list_is_derived() {
    assert!(LaunchRequest::default().to_argv().unwrap().is_empty());
    let flags = kiln_flags();
    for f in [
        "--np",
        "--mpi",
        "--stall-timeout",
        "--run-dir",
        "--as-rank",
        "--chain-script",
    ] {
        assert!(flags.iter().any(|g| g == f), "{f} missing from {flags:?}");
    }
    assert!(flags.iter().all(|f| f.starts_with("--")), "{flags:?}");
}

#[test]
fn the_shared_topology_flags_keep_their_heading_to_themselves() {
    use clap::Args;
    let cmd = LaunchRequest::augment_args(clap::Command::new("launch"));
    let heading = |id: &str| {
        cmd.get_arguments()
            .find(|a| a.get_id() == id)
            .map(|a| a.get_help_heading())
    };
    for id in [
        "hostfile",
        "scheduler",
        "mpi",
        "accelerator",
        "gpus_per_node",
    ] {
        assert_eq!(heading(id), Some(Some("Topology")), "{id}");
    }
    // The flags after them keep theirs (none: clap's "Options").
    for id in ["run_dir", "dry_run", "as_rank"] {
        assert_eq!(heading(id), Some(None), "{id}");
    }
}

#[test]
fn strikes_below_one_are_refused_and_two_is_the_default() {
    assert!(LaunchRequest::parse_flags(["--strikes=0"]).is_err());
    assert_eq!(
        LaunchRequest::parse_flags(["--strikes=3"]).unwrap().strikes,
        3
    );
    assert_eq!(LaunchRequest::default().strikes, 2);
}

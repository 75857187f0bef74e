//! One attempt with real processes: exit classification, a failing rank stopping the others,
//! a stop request forwarded as a signal, a missing program.

use kiln_launch::{AttemptConfig, Classification, ProcSpec, StopRequest, run_attempt};
use std::cell::Cell;
use std::path::Path;
use std::time::{Duration, Instant};

fn sh(script: &str, rank: Option<usize>) -> ProcSpec {
    ProcSpec {
        argv: vec!["sh".into(), "-c".into(), script.into()],
        env: rank
            .map(|r| vec![("RANK".to_string(), r.to_string())])
            .unwrap_or_default(),
        rank,
    }
}

fn config(dir: &Path, procs: Vec<ProcSpec>) -> AttemptConfig {
    AttemptConfig {
        procs,
        log_path: dir.join("attempt.log"),
        silence_timeout: None,
        stall_timeout: None,
        stall_auto: false,
        progress_regex: Some(
            kiln_launch::ProgressRegex::new(kiln_launch::DEFAULT_PROGRESS_REGEX).unwrap(),
        ),
        progress_dir: None,
        clear_progress_dir: false,
        plane: None,
        attempt: None,
        grace: Duration::from_secs(1),
        deadline: None,
        echo: false,
        reap_orphans: false,
        stdout_pty: true,
        expected_ranks: None,
        rank_shims: false,
        straggler_ends_attempt: false,
        straggler_cost: kiln_launch::straggler::COST,
        heartbeat_timeout: None,
        startup_timeout: None,
        startup_auto: false,
    }
}

#[test]
fn an_attempt_that_never_reaches_a_step_is_ended_by_the_startup_watchdog() {
    let dir = tempfile::tempdir().unwrap();
    let mut cfg = config(dir.path(), vec![sh("echo wiring up; sleep 30", None)]);
    cfg.startup_timeout = Some(Duration::from_millis(500));
    let t0 = std::time::Instant::now();
    let o = run_attempt(&cfg, &no_stop).unwrap();
    assert_eq!(o.classification, Classification::HungSilent);
    let message = o.message.unwrap_or_default();
    assert!(message.contains("no rank reached a step"), "{message}");
    assert!(o.detect_s.unwrap() >= 0.5, "{:?}", o.detect_s);
    assert!(t0.elapsed() < Duration::from_secs(20), "it was not killed");
    // Once a step was seen the startup watchdog is done: a quiet run goes on.
    let mut cfg = config(
        dir.path(),
        vec![sh("echo step=1; sleep 1.5; echo step=2", None)],
    );
    cfg.startup_timeout = Some(Duration::from_millis(500));
    let o = run_attempt(&cfg, &no_stop).unwrap();
    assert_eq!(o.classification, Classification::Success, "{:?}", o.message);
}

fn no_stop() -> Option<StopRequest> {
    None
}

#[test]
fn exit_codes_and_signals_are_classified() {
    let dir = tempfile::tempdir().unwrap();
    for (script, class, code) in [
        ("echo step=7", Classification::Success, 0),
        ("exit 3", Classification::Failed, 3),
        ("exit 75", Classification::Preempted, 75),
        ("kill -9 $$", Classification::Signaled, 137),
    ] {
        let o = run_attempt(&config(dir.path(), vec![sh(script, None)]), &no_stop).unwrap();
        assert_eq!((o.classification, o.exit_code), (class, code), "{script}");
    }
    let o = run_attempt(&config(dir.path(), vec![sh("echo step=7", None)]), &no_stop).unwrap();
    assert_eq!(o.last_progress, Some(7));
}

#[test]
fn a_failing_rank_stops_the_others_and_is_named() {
    let dir = tempfile::tempdir().unwrap();
    let procs = vec![sh("sleep 30", Some(0)), sh("sleep 0.2; exit 5", Some(1))];
    let t = Instant::now();
    let o = run_attempt(&config(dir.path(), procs), &no_stop).unwrap();
    assert!(t.elapsed() < Duration::from_secs(5), "{:?}", t.elapsed());
    assert_eq!((o.classification, o.exit_code), (Classification::Failed, 5));
    assert!(o.message.unwrap().contains("failed first") && o.culprits == [1]);
}

#[test]
fn a_stop_request_is_forwarded_as_that_signal() {
    let dir = tempfile::tempdir().unwrap();
    let ready = dir.path().join("ready");
    let script = format!(
        "trap 'exit 75' USR1; touch {}; while true; do sleep 0.05; done",
        ready.display()
    );
    let asked = Cell::new(false);
    let stop = || {
        if !asked.get() && ready.exists() {
            asked.set(true);
        }
        asked.get().then_some(StopRequest {
            signal: libc::SIGUSR1,
            count: 1,
        })
    };
    let o = run_attempt(&config(dir.path(), vec![sh(&script, None)]), &stop).unwrap();
    assert_eq!(o.classification, Classification::Walltime);
    assert_eq!(o.exit_code, 75);
}

#[test]
fn a_missing_program_is_not_found() {
    let dir = tempfile::tempdir().unwrap();
    let spec = ProcSpec {
        argv: vec!["/nonexistent/kiln-test".into()],
        env: vec![],
        rank: None,
    };
    let o = run_attempt(&config(dir.path(), vec![spec]), &no_stop).unwrap();
    assert_eq!(
        (o.classification, o.exit_code),
        (Classification::NotFound, 127)
    );
    assert!(!o.classification.retryable());
}

#[test]
fn in_a_collective_the_rank_that_is_not_waiting_is_the_culprit() {
    let dir = tempfile::tempdir().unwrap();
    let progress = dir.path().join("progress");
    std::fs::create_dir_all(&progress).unwrap();
    // Both ranks reach step 5 and stop at the same moment; rank 0 says it waits in the
    // all-reduce, rank 1 (stuck in its own compute) does not.
    let beacon = |rank: usize, phase: &str| {
        format!(
            "for i in 1 2 3 4 5; do printf '%s {phase} %s h{rank}\\n' $i $(date +%s.%N) > {p}/.t{rank}; mv {p}/.t{rank} {p}/rank-{rank}; sleep 0.05; done; echo alive; sleep 30",
            p = progress.display()
        )
    };
    let mut cfg = config(
        dir.path(),
        vec![
            sh(&beacon(0, "allreduce"), Some(0)),
            sh(&beacon(1, "train"), Some(1)),
        ],
    );
    cfg.progress_dir = Some(progress.clone());
    cfg.stall_timeout = Some(Duration::from_secs(1));
    let o = run_attempt(&cfg, &no_stop).unwrap();
    assert_eq!(o.classification, Classification::HungStalled);
    assert_eq!(o.culprits, [1]);
    let hosts: Vec<_> = o.progress.iter().filter_map(|p| p.host.clone()).collect();
    assert_eq!(hosts, ["h0", "h1"]);
    assert!(o.advanced());
}

#[test]
fn in_a_tie_the_stopped_rank_is_the_culprit() {
    let dir = tempfile::tempdir().unwrap();
    let progress = dir.path().join("progress");
    std::fs::create_dir_all(&progress).unwrap();
    // Both ranks write beacons up to step 3 at the same moments and then stop advancing, as
    // data-parallel ranks do when one of them hangs: rank 1 is stopped (SIGSTOP), rank 0 keeps
    // spinning (as MPI does while it waits in a collective).
    let script = |rank: usize, tail: &str| {
        format!(
            "for i in 1 2 3; do printf '%s train %s\n' $i $(date +%s.%N) > {p}/.t{rank}; mv {p}/.t{rank} {p}/rank-{rank}; sleep 0.05; done; echo ready; {tail}",
            p = progress.display()
        )
    };
    let mut cfg = config(
        dir.path(),
        vec![
            sh(&script(0, "while :; do :; done"), Some(0)),
            sh(&script(1, "kill -STOP $$"), Some(1)),
        ],
    );
    cfg.progress_dir = Some(progress.clone());
    cfg.stall_timeout = Some(Duration::from_secs(2));
    let o = run_attempt(&cfg, &no_stop).unwrap();
    assert_eq!(o.classification, Classification::HungStalled);
    assert_eq!(o.culprits, [1], "{:?}", o.message);
    assert!(o.message.unwrap().contains("stopped"));
}

/// An earlier attempt's shim may write its rank's exit record just after the next attempt
/// started (the soak saw it: srun killed, the shim still polling; the next attempt, started
/// at once, read a SIGKILL it never got and ended). Records carry their attempt's token:
/// another attempt's is ignored, this attempt's ends it; another attempt's stop request is kept.
#[test]
fn an_exit_record_of_another_attempt_does_not_end_this_one() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path().display();
    let record = |token: &str| {
        format!(
            "sleep 0.3; printf -- '- 9 %s.000 n1 {token}\\n' $(date +%s) > {d}/.x; mv {d}/.x {d}/exit-0; sleep 2; echo step=1"
        )
    };
    let run = |token: &str| {
        let mut cfg = config(dir.path(), vec![sh(&record(token), None)]);
        cfg.progress_dir = Some(dir.path().to_path_buf());
        cfg.heartbeat_timeout = Some(Duration::from_secs(1));
        cfg.attempt = Some("new".into());
        cfg.expected_ranks = Some(1);
        run_attempt(&cfg, &no_stop).unwrap()
    };
    // The previous attempt's SIGKILL request stays for its shims (see kiln_run's stop.rs).
    kiln_run::write_stop_request(dir.path(), 9, kiln_run::unix_time(), Some("old")).unwrap();
    let o = run("old");
    assert_eq!(o.classification, Classification::Success, "{:?}", o.message);
    let kept = kiln_run::read_stop_request(dir.path()).expect("the request was cleared");
    assert_eq!(kept.attempt.as_deref(), Some("old"));
    let o = run("new");
    assert_eq!(
        o.classification,
        Classification::Signaled,
        "{:?}",
        o.message
    );
    assert_eq!(o.culprits, [0]);
}

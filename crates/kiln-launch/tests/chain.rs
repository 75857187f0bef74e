//! The end of a chained batch job: which exits continue the chain, and the successor's
//! submission through PBS's `qsub` (a stand-in that says so: no PBS can be installed here).
//! The Slurm side runs for real in the kiln crate's tests/slurm.rs.

use kiln_launch::{BatchScheduler, ChainJob, continue_chain};
use std::os::unix::fs::PermissionsExt;

#[test]
fn resumable_exits_continue_until_the_limit_and_the_successor_depends_on_its_job() {
    let dir = tempfile::tempdir().unwrap();
    let bin = dir.path().join("bin");
    std::fs::create_dir_all(&bin).unwrap();
    let log = dir.path().join("qsub.args");
    std::fs::write(
        bin.join("qsub"),
        format!(
            "#!/bin/sh\necho 'stand-in qsub for tests: not PBS' >&2\nprintf '%s\\n' \"$@\" >> '{}'\necho 78.pbs-standin\n",
            log.display()
        ),
    )
    .unwrap();
    std::fs::set_permissions(bin.join("qsub"), std::fs::Permissions::from_mode(0o755)).unwrap();
    // This test binary runs only this test, so changing PATH touches nothing else.
    let path = format!(
        "{}:{}",
        bin.display(),
        std::env::var("PATH").unwrap_or_default()
    );
    // SAFETY: single-threaded at this point of the only test in this binary.
    unsafe { std::env::set_var("PATH", path) };
    let run = dir.path().join("run");
    let mut events = kiln_run::EventLog::open(&run, "launch").unwrap();
    let job = |index| ChainJob {
        scheduler: BatchScheduler::Pbs,
        job_id: "77.pbs-standin".into(),
        index,
        limit: 3,
        script: run.join("job.pbs"),
    };
    let cases = [
        (1, 0, true, false, "the run completed"),
        (1, 78, true, false, "which a new job would not fix"),
        (1, 75, false, false, "made no progress"),
        (3, 75, true, false, "chain limit 3 reached"),
        (1, 69, true, true, "submitting job 2 of 3"),
        (2, 75, true, true, "submitting job 3 of 3"),
    ];
    for (index, code, progress, next, reason) in cases {
        let (went, why) = continue_chain(&job(index), code, progress, &["x9".into()], &mut events);
        assert_eq!(went, next, "exit {code}: {why}");
        assert!(why.contains(reason), "exit {code}: {why}");
    }
    let args = std::fs::read_to_string(&log).unwrap();
    let script = run.join("job.pbs").display().to_string();
    let want = format!(
        "-v\nKILN_CHAIN_INDEX=2\n-W\ndepend=afterany:77.pbs-standin\n{script}\n-v\nKILN_CHAIN_INDEX=3\n-W\ndepend=afterany:77.pbs-standin\n{script}\n"
    );
    assert_eq!(args, want);
    let ev = kiln_run::read_events(&run).unwrap();
    let submitted: Vec<_> = ev.iter().filter(|e| e.event == "job_submitted").collect();
    assert_eq!(submitted.len(), 2);
    assert_eq!(submitted[0].fields["job_id"], "78.pbs-standin");
    assert_eq!(submitted[0].fields["after"], "77.pbs-standin");
    let decisions: Vec<_> = ev
        .iter()
        .filter(|e| e.event == "chain")
        .map(|e| e.fields["decision"].as_str().unwrap().to_string())
        .collect();
    assert_eq!(decisions, ["end", "end", "end", "end", "next", "next"]);
}

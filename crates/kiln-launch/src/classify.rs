//! How an attempt ended, and what `kiln launch` exits with for it. Exit codes and their
//! retry meaning come from [`kiln_run::exit`], the table the trainer exits with.

use kiln_run::exit;

/// How an attempt ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub enum Classification {
    /// Every rank exited 0.
    Success,
    /// A rank (or the launcher) exited with a non-zero code that may be transient.
    Failed,
    /// A rank exited with a code that says the same input fails the same way (invalid
    /// config or data, guard stop, run directory locked, usage): never retried.
    Deterministic,
    /// Data-parallel replicas disagreed (exit 76): a host corrupts or desyncs its rank;
    /// retried on other hosts.
    ReplicaMismatch,
    /// The program (or launcher) could not be found or executed.
    NotFound,
    /// No output (and no beacon update) for `--timeout` seconds.
    HungSilent,
    /// Output continued but progress did not advance for `--stall-timeout` seconds.
    HungStalled,
    /// A rank that sent heartbeats stopped sending them for `--heartbeat-timeout` seconds
    /// (stopped, wedged or gone): it was killed and the attempt ended.
    NoHeartbeat,
    /// A rank was killed by a signal kiln did not send (OOM killer, segfault, ...).
    Signaled,
    /// The program exited 75: it checkpointed after a stop request and can resume.
    Preempted,
    /// `--walltime` ran out, or the scheduler warned kiln with SIGUSR1.
    Walltime,
    /// kiln got SIGINT/SIGTERM/SIGHUP, forwarded it, and stopped.
    Interrupted,
}

impl Classification {
    /// The name written to `events.jsonl`.
    pub fn name(self) -> &'static str {
        match self {
            Classification::Success => "success",
            Classification::Failed => "failed",
            Classification::Deterministic => "deterministic",
            Classification::ReplicaMismatch => "replica-mismatch",
            Classification::NotFound => "not-found",
            Classification::HungSilent => "hung-silent",
            Classification::HungStalled => "hung-stalled",
            Classification::NoHeartbeat => "no-heartbeat",
            Classification::Signaled => "killed-by-signal",
            Classification::Preempted => "preempted",
            Classification::Walltime => "walltime",
            Classification::Interrupted => "interrupted",
        }
    }

    /// Whether another attempt may help. Never after success; not when the program does not
    /// exist or failed deterministically, the walltime is over, or a person asked kiln to stop.
    pub fn retryable(self) -> bool {
        matches!(
            self,
            Classification::Failed
                | Classification::ReplicaMismatch
                | Classification::HungSilent
                | Classification::HungStalled
                | Classification::NoHeartbeat
                | Classification::Signaled
                | Classification::Preempted
        )
    }

    /// Whether this ending is a hang caught by a watchdog.
    pub fn is_hang(self) -> bool {
        matches!(
            self,
            Classification::HungSilent | Classification::HungStalled | Classification::NoHeartbeat
        )
    }
}

/// Exit code for a process that exited with `code` or was killed by `signal` (128+N, as
/// shells report it).
pub fn exit_code_of(code: Option<i32>, signal: Option<i32>) -> i32 {
    match (code, signal) {
        (Some(c), _) => c,
        (None, Some(s)) => 128 + s,
        (None, None) => 1,
    }
}

/// Classifies an exit code as a shell reports it (128+N for signal N is "killed by a
/// signal" only when `signaled` says the process really died of one).
pub fn classify_code(code: i32, signaled: bool) -> Classification {
    match code {
        exit::SUCCESS => Classification::Success,
        exit::PREEMPTED => Classification::Preempted,
        exit::REPLICA_MISMATCH => Classification::ReplicaMismatch,
        exit::NOT_FOUND | exit::NOT_EXECUTABLE => Classification::NotFound,
        c if exit::is_deterministic(c) => Classification::Deterministic,
        _ if signaled => Classification::Signaled,
        _ => Classification::Failed,
    }
}

/// Classifies a finished process by its exit code or signal (no watchdog or stop involved).
pub fn classify_exit(code: Option<i32>, signal: Option<i32>) -> Classification {
    match (code, signal) {
        (Some(c), _) => classify_code(c, false),
        (None, Some(_)) => Classification::Signaled,
        (None, None) => Classification::Failed,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn codes_map_to_classes_with_the_retry_meaning_of_kiln_run() {
        assert_eq!(classify_exit(Some(0), None), Classification::Success);
        assert_eq!(classify_exit(Some(1), None), Classification::Failed);
        assert_eq!(classify_exit(Some(75), None), Classification::Preempted);
        assert_eq!(
            classify_exit(Some(76), None),
            Classification::ReplicaMismatch
        );
        for c in [
            exit::CONFIG,
            exit::GUARD_STOP,
            exit::RUN_DIR_LOCKED,
            exit::USAGE,
        ] {
            let class = classify_exit(Some(c), None);
            assert_eq!(class, Classification::Deterministic, "{c}");
            assert!(!class.retryable());
        }
        assert_eq!(classify_exit(Some(127), None), Classification::NotFound);
        assert_eq!(classify_exit(None, Some(9)), Classification::Signaled);
        assert_eq!(classify_code(137, true), Classification::Signaled);
        assert!(Classification::ReplicaMismatch.retryable());
    }
}

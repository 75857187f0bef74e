//! How an attempt ended, and what `kiln launch` exits with for it.

use kiln_run::{EXIT_PREEMPTED, EXIT_WATCHDOG};

/// How an attempt ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Classification {
    /// Every rank exited 0.
    Success,
    /// A rank (or the launcher) exited with a non-zero code.
    Failed,
    /// The program (or launcher) could not be found or executed.
    NotFound,
    /// No output (and no beacon update) for `--timeout` seconds.
    HungSilent,
    /// Output continued but progress did not advance for `--stall-timeout` seconds.
    HungStalled,
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
            Classification::NotFound => "not-found",
            Classification::HungSilent => "hung-silent",
            Classification::HungStalled => "hung-stalled",
            Classification::Signaled => "killed-by-signal",
            Classification::Preempted => "preempted",
            Classification::Walltime => "walltime",
            Classification::Interrupted => "interrupted",
        }
    }

    /// Whether another attempt may help. Never after success; not when the program does not
    /// exist, the walltime is over, or a person asked kiln to stop.
    pub fn retryable(self) -> bool {
        matches!(
            self,
            Classification::Failed
                | Classification::HungSilent
                | Classification::HungStalled
                | Classification::Signaled
                | Classification::Preempted
        )
    }
}

/// Exit code for a process that exited with `code` or was killed by `signal` (128+N, as
/// shells report it), with the watchdog and preemption codes kiln-run defines.
pub fn exit_code_of(code: Option<i32>, signal: Option<i32>) -> i32 {
    match (code, signal) {
        (Some(c), _) => c,
        (None, Some(s)) => 128 + s,
        (None, None) => 1,
    }
}

/// Classifies a finished process by its exit code or signal (no watchdog or stop involved).
pub fn classify_exit(code: Option<i32>, signal: Option<i32>) -> Classification {
    match (code, signal) {
        (Some(0), _) => Classification::Success,
        (Some(c), _) if c == EXIT_PREEMPTED => Classification::Preempted,
        (Some(_), _) => Classification::Failed,
        (None, Some(_)) => Classification::Signaled,
        (None, None) => Classification::Failed,
    }
}

/// The watchdog exit code (124, as GNU timeout).
pub const WATCHDOG_EXIT: i32 = EXIT_WATCHDOG;
/// The exit code for a walltime stop (75, "resumable").
pub const WALLTIME_EXIT: i32 = EXIT_PREEMPTED;
/// Exit code when the program does not exist (as shells use).
pub const NOT_FOUND_EXIT: i32 = 127;
/// Exit code when the program exists but cannot be executed.
pub const NOT_EXECUTABLE_EXIT: i32 = 126;

//! Exit codes of kiln's processes and how a supervisor should treat each: the one table that
//! the trainer (which exits with them), `kiln launch` (which classifies them) and
//! `kiln status` share. Codes follow sysexits.h where one fits.

/// All steps done.
pub const SUCCESS: i32 = 0;
/// An error that may be transient (I/O, a lost peer): worth a retry.
pub const FAILURE: i32 = 1;
/// Bad command line (clap's usage exit code).
pub const USAGE: i32 = 2;
/// A guard stopped training (non-finite steps or rollbacks past their bound, initial loss
/// far off): the same input would fail the same way, so a retry is pointless
/// (`EX_DATAERR`).
pub const GUARD_STOP: i32 = 65;
/// Node scope ran out of healthy hosts: every spare was used and the job may not shrink.
/// Not the program's fault: a new allocation (the next job of a chain) resumes it
/// (`EX_UNAVAILABLE`).
pub const NODES_EXHAUSTED: i32 = 69;
/// Another process holds the run directory (`EX_CANTCREAT`).
pub const RUN_DIR_LOCKED: i32 = 73;
/// Stopped by a signal (SIGTERM/SIGUSR1/SIGINT, walltime) after saving a checkpoint;
/// running the same command resumes (`EX_TEMPFAIL`, "try again later").
pub const PREEMPTED: i32 = 75;
/// Data-parallel replicas disagree on their parameters (silent data corruption or a
/// desynced rank); the culprit rank is named in the event log and no checkpoint of the bad
/// weights was written (`EX_PROTOCOL`). Retrying on a different host is the remedy.
pub const REPLICA_MISMATCH: i32 = 76;
/// The config, a data file, a checkpoint or another input is invalid: deterministic, never
/// retried (`EX_CONFIG`).
pub const CONFIG: i32 = 78;
/// A watchdog killed the job (as GNU `timeout`).
pub const WATCHDOG: i32 = 124;
/// The program exists but cannot be executed (as the shells use).
pub const NOT_EXECUTABLE: i32 = 126;
/// The program or the launcher does not exist (as the shells use).
pub const NOT_FOUND: i32 = 127;

/// Whether an exit with this code is deterministic, so that rerunning the same command on
/// the same input cannot help (a supervisor must not spend retries or spare nodes on it).
pub fn is_deterministic(code: i32) -> bool {
    matches!(
        code,
        USAGE | GUARD_STOP | RUN_DIR_LOCKED | CONFIG | NOT_EXECUTABLE | NOT_FOUND
    )
}

/// Whether a job that ended with this code should be continued by a new batch job of its
/// chain: it stopped resumably (checkpointed on a signal or walltime) or ran out of hosts.
pub fn is_resumable(code: i32) -> bool {
    matches!(code, PREEMPTED | NODES_EXHAUSTED)
}

/// A short name of what an exit code means, for logs and `kiln status`.
pub fn describe(code: i32) -> &'static str {
    match code {
        SUCCESS => "success",
        FAILURE => "error",
        USAGE => "usage error",
        GUARD_STOP => "guard stopped training",
        NODES_EXHAUSTED => "no healthy host left (spares exhausted)",
        RUN_DIR_LOCKED => "run directory locked by another process",
        PREEMPTED => "preempted (checkpointed, resumable)",
        REPLICA_MISMATCH => "replica mismatch",
        CONFIG => "invalid config or input",
        WATCHDOG => "watchdog kill",
        NOT_EXECUTABLE => "not executable",
        NOT_FOUND => "not found",
        c if c > 128 => "killed by a signal",
        _ => "failed",
    }
}

/// An error that knows the exit code kiln ends with because of it. Every library error type
/// that reaches the command line implements it; `kiln`'s `main` is the one place that maps
/// an error to its code (the first error in the chain that has one).
pub trait ExitCoded {
    /// The process exit code (one of this module's constants, or a passed-through one).
    fn exit_code(&self) -> i32;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn retry_meaning_of_each_code() {
        for c in [
            CONFIG,
            GUARD_STOP,
            RUN_DIR_LOCKED,
            USAGE,
            NOT_FOUND,
            NOT_EXECUTABLE,
        ] {
            assert!(is_deterministic(c), "{c}");
        }
        for c in [
            SUCCESS,
            FAILURE,
            PREEMPTED,
            REPLICA_MISMATCH,
            NODES_EXHAUSTED,
            WATCHDOG,
            137,
        ] {
            assert!(!is_deterministic(c), "{c}");
        }
        assert!(is_resumable(PREEMPTED) && is_resumable(NODES_EXHAUSTED) && !is_resumable(FAILURE));
    }
}

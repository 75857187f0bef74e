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

/// One exit code and what it means: a row of [`CODES`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Code {
    /// The code.
    pub code: i32,
    /// A short name, for logs and `kiln status`.
    pub name: &'static str,
    /// What happened and what to do, in one line, for `--help` and the README.
    pub meaning: &'static str,
}

/// Every code kiln's processes exit with on their own account (a program's own code is
/// passed through by `kiln launch`), with its meaning: the one table that `--help` and
/// [`describe`] are made from.
pub const CODES: &[Code] = &[
    Code {
        code: SUCCESS,
        name: "success",
        meaning: "all done (kiln train: every step, final weights in RUN_DIR/model.safetensors)",
    },
    Code {
        code: FAILURE,
        name: "error",
        meaning: "an error that may be transient (I/O, a lost peer); the message says which",
    },
    Code {
        code: USAGE,
        name: "usage error",
        meaning: "bad flags or flag values; nothing started",
    },
    Code {
        code: GUARD_STOP,
        name: "guard stopped training",
        meaning: "non-finite steps or loss spikes that rollbacks did not cure \
                  (guards.max_rollbacks), or a first-step loss far from ln(vocab); \
                  checkpoints are kept",
    },
    Code {
        code: NODES_EXHAUSTED,
        name: "no healthy host left (spares exhausted)",
        meaning: "node scope had no healthy host left for a failed one and --min-nodes \
                  forbids shrinking; a new allocation resumes the run",
    },
    Code {
        code: RUN_DIR_LOCKED,
        name: "run directory locked by another process",
        meaning: "another trainer writes the run directory (named: pid and host)",
    },
    Code {
        code: PREEMPTED,
        name: "preempted (checkpointed, resumable)",
        meaning: "SIGTERM, SIGUSR1 or SIGINT arrived (on any rank), the current step \
                  finished and a checkpoint was saved; the same command resumes exactly",
    },
    Code {
        code: REPLICA_MISMATCH,
        name: "replica mismatch",
        meaning: "data-parallel replicas disagree on their parameters; the rank is named in \
                  events.jsonl (replica_mismatch) and none of the bad weights was saved",
    },
    Code {
        code: CONFIG,
        name: "invalid config or input",
        meaning: "invalid config, data, checkpoint, rank environment or other input (also: \
                  resuming a checkpoint of another optimizer.kind): fix it, do not retry",
    },
    Code {
        code: WATCHDOG,
        name: "watchdog kill",
        meaning: "a watchdog killed the job: no output, no progress or no heartbeat for too long",
    },
    Code {
        code: NOT_EXECUTABLE,
        name: "not executable",
        meaning: "the program exists but cannot be executed",
    },
    Code {
        code: NOT_FOUND,
        name: "not found",
        meaning: "the program or the launcher does not exist",
    },
];

/// The row of [`CODES`] for `code`, if it is one of them.
pub fn code(code: i32) -> Option<&'static Code> {
    CODES.iter().find(|c| c.code == code)
}

/// A short name of what an exit code means, for logs and `kiln status`.
pub fn describe(code: i32) -> &'static str {
    match self::code(code) {
        Some(c) => c.name,
        None if code > 128 => "killed by a signal",
        None => "failed",
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

    #[test]
    fn every_code_is_in_the_table_once() {
        let all = [
            SUCCESS,
            FAILURE,
            USAGE,
            GUARD_STOP,
            NODES_EXHAUSTED,
            RUN_DIR_LOCKED,
            PREEMPTED,
            REPLICA_MISMATCH,
            CONFIG,
            WATCHDOG,
            NOT_EXECUTABLE,
            NOT_FOUND,
        ];
        for c in all {
            assert_eq!(CODES.iter().filter(|r| r.code == c).count(), 1, "{c}");
        }
        assert_eq!(CODES.len(), all.len());
        assert_eq!(describe(CONFIG), "invalid config or input");
        assert_eq!(
            (describe(137), describe(3)),
            ("killed by a signal", "failed")
        );
    }
}

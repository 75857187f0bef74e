//! How an attempt ended, and what `kiln launch` exits with for it: the classes, and
//! [`ENDINGS`], the table of each class's exit code and meaning that `kiln launch --help`
//! prints. Exit codes and their retry meaning come from [`kiln_run::exit`], the table the
//! trainer exits with.

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
    /// A rank stayed slower than its peers (`--straggler-is-node-failure`): kiln stopped
    /// the ranks so they checkpoint, to retry without its host.
    Straggler,
}

impl Classification {
    /// Every class, in the order of [`Classification`]'s definition.
    pub const ALL: [Classification; 13] = [
        Classification::Success,
        Classification::Failed,
        Classification::Deterministic,
        Classification::ReplicaMismatch,
        Classification::NotFound,
        Classification::HungSilent,
        Classification::HungStalled,
        Classification::NoHeartbeat,
        Classification::Signaled,
        Classification::Preempted,
        Classification::Walltime,
        Classification::Interrupted,
        Classification::Straggler,
    ];

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
            Classification::Straggler => "straggler",
        }
    }

    /// Whether a process that exited with a code is classed so ([`classify_code`]'s classes),
    /// not a watchdog, a stop, the walltime or a signal.
    pub fn is_from_exit_code(self) -> bool {
        matches!(
            self,
            Classification::Success
                | Classification::Failed
                | Classification::Deterministic
                | Classification::ReplicaMismatch
                | Classification::NotFound
                | Classification::Preempted
        )
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
                | Classification::Straggler
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

/// What `kiln launch` exits with for an ending of [`ENDINGS`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ExitOf {
    /// One of [`kiln_run::exit`]'s codes.
    Code(i32),
    /// The program's own exit code (`N`).
    Program,
    /// 128 + the signal a rank died of (`128+N`), as shells report it.
    Signal,
    /// 128 + the stop signal kiln got: SIGINT, SIGTERM or SIGHUP.
    Stop,
}

impl std::fmt::Display for ExitOf {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ExitOf::Code(c) => write!(f, "{c}"),
            ExitOf::Program => f.write_str("N"),
            ExitOf::Signal => f.write_str("128+N"),
            ExitOf::Stop => {
                let [int, term, hup] = [libc::SIGINT, libc::SIGTERM, libc::SIGHUP].map(|s| 128 + s);
                write!(f, "{int}/{term}/{hup}")
            }
        }
    }
}

/// What an ending of `kiln launch` is: a class of an attempt, or an end of kiln's own that
/// no attempt's class covers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EndedAs {
    /// The last attempt's class (written to `events.jsonl`).
    Class(Classification),
    /// An end of kiln's own, named in parentheses in the listing.
    Launcher(&'static str),
}

/// One way `kiln launch` ends: a row of [`ENDINGS`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Ending {
    /// The class, or kiln's own end.
    pub ended_as: EndedAs,
    /// The exit code.
    pub exit: ExitOf,
    /// What happened, in one line; `None`: the meaning of the code in [`exit::CODES`].
    pub meaning: Option<&'static str>,
}

impl Ending {
    /// The class's name, or kiln's own end in parentheses.
    pub fn name(&self) -> String {
        match self.ended_as {
            EndedAs::Class(c) => c.name().to_string(),
            EndedAs::Launcher(what) => format!("({what})"),
        }
    }

    /// What happened: this row's own meaning, else that of its code in [`exit::CODES`].
    pub fn meaning(&self) -> &'static str {
        match (self.meaning, self.exit) {
            (Some(m), _) => m,
            (None, ExitOf::Code(c)) => exit::code(c).map_or("", |c| c.meaning),
            (None, _) => "",
        }
    }
}

/// Every way `kiln launch` ends, with its exit code and meaning: the one table that
/// `kiln launch --help` prints. Every class has at least one row.
pub const ENDINGS: &[Ending] = {
    use Classification::*;
    use EndedAs::{Class, Launcher};
    use ExitOf::{Code, Program, Signal, Stop};
    &[
        row(
            Class(Success),
            Code(exit::SUCCESS),
            Some("every rank exited 0"),
        ),
        row(
            Class(Failed),
            Program,
            Some("the program's own non-zero exit code (the first rank to fail)"),
        ),
        row(
            Class(Deterministic),
            Program,
            Some(
                "a rank exited 2, 65, 73 or 78 (usage, guard stop, run directory locked, \
                 invalid config or input): the same input fails the same way, so it is never \
                 retried and no spare is used",
            ),
        ),
        row(
            Class(ReplicaMismatch),
            Code(exit::REPLICA_MISMATCH),
            Some(
                "data-parallel replicas disagree; retried, and under node scope the host of \
                 the named rank is swapped",
            ),
        ),
        row(
            Class(HungSilent),
            Code(exit::WATCHDOG),
            Some("--timeout: no output for S seconds"),
        ),
        row(
            Class(HungStalled),
            Code(exit::WATCHDOG),
            Some(
                "--stall-timeout (or its default, a multiple of the step time): progress did not advance",
            ),
        ),
        row(
            Class(NoHeartbeat),
            Code(exit::WATCHDOG),
            Some(
                "--heartbeat-timeout: a rank that beat fell silent (stopped, wedged); it was \
                 killed and the rank and host are named",
            ),
        ),
        row(
            Class(Signaled),
            Signal,
            Some("a rank died of signal N kiln did not send (137: SIGKILL, e.g. OOM)"),
        ),
        row(
            Class(Preempted),
            Code(exit::PREEMPTED),
            Some("the program exited 75 (checkpointed, resumable) and no retry is left"),
        ),
        row(
            Class(Walltime),
            Code(exit::PREEMPTED),
            Some("--walltime ran out or kiln got SIGUSR1; ranks got SIGTERM/SIGUSR1"),
        ),
        row(
            Class(Straggler),
            Code(exit::PREEMPTED),
            Some(
                "--straggler-is-node-failure: a rank stayed slower than its peers; the ranks \
                 got SIGTERM to checkpoint, and its host is swapped for a spare",
            ),
        ),
        row(
            Launcher("spares exhausted"),
            Code(exit::NODES_EXHAUSTED),
            None,
        ),
        row(Class(NotFound), Code(exit::NOT_FOUND), None),
        row(Class(NotFound), Code(exit::NOT_EXECUTABLE), None),
        row(
            Class(Interrupted),
            Stop,
            Some(
                "kiln got SIGINT/SIGTERM/SIGHUP, forwarded it and stopped retrying; if the \
                 ranks exited with a code after that, that code (75: resumable)",
            ),
        ),
        row(
            Launcher("usage"),
            Code(exit::USAGE),
            Some(
                "bad flags, conflicting or absurd sizes, malformed hostfile or visible-device \
                 list; nothing started",
            ),
        ),
    ]
};

/// A row of [`ENDINGS`].
const fn row(ended_as: EndedAs, exit: ExitOf, meaning: Option<&'static str>) -> Ending {
    Ending {
        ended_as,
        exit,
        meaning,
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
    fn every_code_maps_to_a_class_said_to_come_from_an_exit_code() {
        for code in 0..=255 {
            assert!(
                classify_code(code, false).is_from_exit_code(),
                "exit code {code}"
            );
        }
        let others = Classification::ALL
            .into_iter()
            .filter(|c| !c.is_from_exit_code())
            .collect::<Vec<_>>();
        assert_eq!(
            others,
            [
                Classification::HungSilent,
                Classification::HungStalled,
                Classification::NoHeartbeat,
                Classification::Signaled,
                Classification::Walltime,
                Classification::Interrupted,
                Classification::Straggler,
            ]
        );
    }

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

    #[test]
    fn every_class_ends_in_the_table_with_the_code_it_is_classified_from() {
        for class in Classification::ALL {
            assert!(
                ENDINGS.iter().any(|e| e.ended_as == EndedAs::Class(class)),
                "{class:?} has no row"
            );
        }
        for e in ENDINGS {
            assert!(!e.meaning().is_empty(), "{}", e.name());
            let (EndedAs::Class(class), ExitOf::Code(code)) = (e.ended_as, e.exit) else {
                continue;
            };
            // A code a program exits with is classified as its row says; the watchdogs',
            // the walltime's and a straggler's codes are kiln's own.
            let kilns_own = matches!(class, Classification::Walltime | Classification::Straggler);
            if !(class.is_hang() || kilns_own) {
                assert_eq!(classify_code(code, false), class, "{code}");
            }
        }
        // The codes the deterministic row names are those classified deterministic.
        let deterministic = ENDINGS
            .iter()
            .find(|e| e.ended_as == EndedAs::Class(Classification::Deterministic))
            .map(Ending::meaning)
            .unwrap_or_default();
        for c in exit::CODES {
            let named = deterministic.contains(&format!(" {},", c.code))
                || deterministic.contains(&format!(" {} ", c.code));
            let is = classify_code(c.code, false) == Classification::Deterministic;
            assert_eq!(named, is, "{}", c.code);
        }
        assert_eq!(ExitOf::Stop.to_string(), "130/143/129");
    }
}

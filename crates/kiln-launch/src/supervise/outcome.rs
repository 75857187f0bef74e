//! How an attempt ended: [`AttemptOutcome`] (what the recovery loop and the event log get),
//! [`RankProgress`] (how far each rank came), and the [`Verdict`] a handler of the watch loop
//! reaches before the processes are gone.

use crate::classify::{Classification, classify_code};
use kiln_run::{ExitRecord, unix_time};
use std::time::Instant;

/// Where the naming of a culprit rank came from: the `source` of its evidence in
/// `attempt_end` (see [`crate::Evidence`]); public as [`crate::evidence_source`].
pub mod source {
    /// The ranks' beacon files: steps, and phases (a rank computing while the others wait
    /// in a collective).
    pub const BEACON: &str = "beacon";
    /// The step numbers in the ranks' output (locally spawned ranks, one stream each).
    pub const OUTPUT: &str = "output";
    /// The ranks' processes: one stopped, or idle while the others spin.
    pub const LIVENESS: &str = "liveness";
    /// A rank's heartbeat fell silent.
    pub const HEARTBEAT: &str = "heartbeat";
    /// A node's agent (the `tcp` control plane) dropped its connection or fell silent.
    pub const AGENT: &str = "agent";
    /// The ranks' exit records (`kiln launch --as-rank`): the rank that failed first.
    pub const EXIT_RECORD: &str = "exit-record";
    /// The exit status of a rank kiln spawned itself: the one that failed first.
    pub const EXIT_STATUS: &str = "exit-status";
}

/// Progress of one rank (or of the merged output, rank `None`).
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct RankProgress {
    /// The rank, when known.
    pub rank: Option<usize>,
    /// Largest step seen.
    pub step: u64,
    /// Phase from the beacon (`None` for output-derived progress).
    pub phase: Option<String>,
    /// Host from the beacon, when it said.
    pub host: Option<String>,
    /// Seconds since it last advanced, when the attempt ended or the watchdog fired.
    pub idle_s: f64,
    /// Where it came from: `beacon` or `output`.
    pub source: &'static str,
}

/// The result of one attempt.
#[derive(Debug, Clone)]
pub struct AttemptOutcome {
    /// How it ended.
    pub classification: Classification,
    /// What kiln exits with if this is the last attempt.
    pub exit_code: i32,
    /// The signal that killed the deciding process, if one did.
    pub signal: Option<i32>,
    /// Unix start and end times.
    pub start_time: f64,
    /// See `start_time`.
    pub end_time: f64,
    /// Largest step seen by any means.
    pub last_progress: Option<u64>,
    /// The step the ranks started from (the lowest first beacon), when beacons say.
    pub start_step: Option<u64>,
    /// Unix time progress first advanced in this attempt (a step completed).
    pub first_advance_time: Option<f64>,
    /// Unix time progress last advanced.
    pub last_advance_time: Option<f64>,
    /// Per-rank (or merged) progress.
    pub progress: Vec<RankProgress>,
    /// The ranks named as the culprits: those that stopped advancing first (a watchdog), lost
    /// their heartbeat, or failed first.
    pub culprits: Vec<usize>,
    /// Where the naming of `culprits` came from (one of [`source`]).
    pub culprit_source: Option<&'static str>,
    /// How each rank's program ended, from the exit records of `kiln launch --as-rank`.
    pub rank_exits: Vec<ExitRecord>,
    /// Seconds from the last activity/advance to the watchdog firing.
    pub detect_s: Option<f64>,
    /// Seconds from the watchdog firing (or stop) until every process was gone.
    pub kill_s: Option<f64>,
    /// A human sentence about the ending (watchdog message, spawn error, ...).
    pub message: Option<String>,
}

impl AttemptOutcome {
    /// Whether any step completed during this attempt.
    pub fn advanced(&self) -> bool {
        self.first_advance_time.is_some()
    }

    /// The outcome of an attempt that could not start: exit `code` (classified by it),
    /// `message` says why.
    pub fn not_started(code: i32, message: String) -> Self {
        Self::spawn_failure(classify_code(code, false), code, message)
    }

    pub(super) fn spawn_failure(
        classification: Classification,
        code: i32,
        message: String,
    ) -> Self {
        let now = unix_time();
        AttemptOutcome {
            classification,
            exit_code: code,
            signal: None,
            start_time: now,
            end_time: now,
            last_progress: None,
            start_step: None,
            first_advance_time: None,
            last_advance_time: None,
            progress: Vec::new(),
            culprits: Vec::new(),
            culprit_source: None,
            rank_exits: Vec::new(),
            detect_s: None,
            kill_s: None,
            message: Some(message),
        }
    }
}

/// What a handler of the watch loop (a stop, the walltime, liveness, a watchdog) decided,
/// before the processes are gone.
pub(super) struct Verdict {
    pub(super) classification: Classification,
    pub(super) at: Instant,
    pub(super) detect_s: Option<f64>,
    pub(super) culprits: Vec<usize>,
    /// Where the naming of `culprits` came from (one of [`source`]).
    pub(super) culprit_source: Option<&'static str>,
    pub(super) message: Option<String>,
    /// An exit code that overrides the usual one for the classification.
    pub(super) exit_code: Option<i32>,
}

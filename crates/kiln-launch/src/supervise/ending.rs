//! The outcome of an attempt, once every process is gone: from the verdict a handler reached,
//! or else from how the processes (and the ranks' exit records) ended; with the progress each
//! rank made and the times of detection and kill.

use super::beacons::Tracked;
use super::exits::{by_rank_exits, describe, first_failed, fresh_exit_records, ranks_exit_code};
use super::outcome::{AttemptOutcome, RankProgress, Verdict};
use super::output::Shared;
use super::watch::{Attempt, Watch};
use crate::classify::{Classification, exit_code_of};
use kiln_run::{ExitRecord, exit};
use std::collections::BTreeMap;
use std::os::unix::process::ExitStatusExt;
use std::sync::{Arc, Mutex};
use std::time::Instant;

/// How the attempt ended, before the progress and times are added.
struct Ending {
    classification: Classification,
    exit_code: i32,
    detect_s: Option<f64>,
    culprits: Vec<usize>,
    culprit_source: Option<&'static str>,
    message: Option<String>,
    /// When the verdict was reached (the kill time counts from it).
    at: Option<Instant>,
}

/// The deciding process's exit: `(code, signal)`.
type Status = (Option<i32>, Option<i32>);

impl Watch {
    /// The outcome, once every process is gone.
    pub(super) fn outcome(mut self, a: &Attempt<'_>) -> AttemptOutcome {
        let end = Instant::now();
        let rank_exits = (a.cfg.reports())
            .map(|r| fresh_exit_records(r.files(), a.ours()))
            .unwrap_or_default();
        // The deciding status: the first failure, else the launcher/rank 0.
        let decide = self.first_failure.unwrap_or(0);
        let status = self.statuses.get(decide).copied().flatten();
        let status: Status = (
            status.and_then(|s| s.code()),
            status.and_then(|s| s.signal()),
        );
        let at_time = self.verdict.as_ref().map_or(end, |v| v.at);
        let progress = progress_report(a.shared, &self.beacons.ranks, at_time);
        let last_progress = progress.iter().map(|p| p.step).max();
        let start_step = self.beacons.ranks.values().map(|t| t.first_step).min();
        let mut ending = match self.verdict.take() {
            Some(v) => decided(v, a, status, &rank_exits, self.stop_signal),
            None => self.ended_alone(a, status, &rank_exits, end),
        };
        ending.message = ending
            .message
            .or_else(|| self.first_failure_message(a, ending.classification, status));
        let (first_advance, last_advance) = (a.shared.lock())
            .map(|s| (s.first_advance, s.last_advance))
            .unwrap_or((None, None));
        let unix = |i: Instant| unix_at(i, a.start, a.start_time);
        AttemptOutcome {
            classification: ending.classification,
            exit_code: ending.exit_code,
            signal: status.1,
            start_time: a.start_time,
            end_time: unix(end),
            last_progress,
            start_step,
            first_advance_time: first_advance.map(unix),
            last_advance_time: last_advance.map(unix),
            progress,
            culprits: ending.culprits,
            culprit_source: ending.culprit_source,
            rank_exits,
            detect_s: ending.detect_s,
            kill_s: ending.at.map(|at| end.duration_since(at).as_secs_f64()),
            message: ending.message,
        }
    }

    /// How an attempt that no handler ended went: by the exits (see [`by_rank_exits`]); the
    /// culprit is the rank that failed first.
    fn ended_alone(
        &self,
        a: &Attempt<'_>,
        (code, signal): Status,
        rank_exits: &[ExitRecord],
        end: Instant,
    ) -> Ending {
        let (classification, exit_code, message) = by_rank_exits(code, signal, rank_exits);
        let ended = unix_at(self.ended.unwrap_or(end), a.start, a.start_time);
        let detect_s = self
            .failure_detect_s
            .or_else(|| first_failed(rank_exits).map(|r| (ended - r.time).max(0.0)));
        let culprit = match self.first_failure.and_then(|i| a.running.ranks.get(i)) {
            Some(Some(rank)) => Some((*rank, super::source::EXIT_STATUS)),
            _ => first_failed(rank_exits).map(|r| (r.rank, super::source::EXIT_RECORD)),
        }
        .filter(|_| classification != Classification::Success);
        Ending {
            classification,
            exit_code,
            detect_s,
            culprits: culprit.iter().map(|c| c.0).collect(),
            culprit_source: culprit.map(|c| c.1),
            message,
            at: None,
        }
    }

    /// "rank R failed first", when one of several ranks kiln spawned failed first.
    fn first_failure_message(
        &self,
        a: &Attempt<'_>,
        classification: Classification,
        (code, signal): Status,
    ) -> Option<String> {
        let failed = matches!(
            classification,
            Classification::Failed | Classification::Signaled | Classification::Deterministic
        );
        let rank = (self.first_failure)
            .and_then(|i| a.running.ranks.get(i).copied().flatten())
            .filter(|_| failed && a.running.ranks.len() > 1)?;
        Some(format!(
            "rank {rank} on {} failed first ({}); the other ranks were stopped",
            kiln_run::this_host(),
            describe(code, signal)
        ))
    }
}

/// How an attempt a handler ended went: the verdict decides, and the exit code follows from
/// its classification.
fn decided(
    v: Verdict,
    a: &Attempt<'_>,
    (code, signal): Status,
    rank_exits: &[ExitRecord],
    stop_signal: Option<i32>,
) -> Ending {
    let ranks_code = stop_signal.and(ranks_exit_code(a.cfg, rank_exits));
    let exit_code = v.exit_code.unwrap_or(match v.classification {
        Classification::HungSilent | Classification::HungStalled => exit::WATCHDOG,
        Classification::Walltime | Classification::Straggler => exit::PREEMPTED,
        // After forwarding a stop, the ranks that checkpointed and exited tell the truth
        // about where they stand (75: resumable): their own exits decide, not the launcher's.
        _ => ranks_code.unwrap_or(match (code, stop_signal) {
            (Some(c), _) => c,
            (None, Some(s)) => 128 + s,
            (None, None) => exit_code_of(code, signal),
        }),
    });
    Ending {
        classification: v.classification,
        exit_code,
        detect_s: v.detect_s,
        culprits: v.culprits,
        culprit_source: v.culprit_source,
        message: v.message,
        at: Some(v.at),
    }
}

/// Unix time of `i`, from the attempt's start in both clocks.
fn unix_at(i: Instant, start: Instant, start_time: f64) -> f64 {
    start_time + i.saturating_duration_since(start).as_secs_f64()
}

/// Each rank's progress at `at`: from beacons, then from output.
fn progress_report(
    shared: &Arc<Mutex<Shared>>,
    beacons: &BTreeMap<usize, Tracked>,
    at: Instant,
) -> Vec<RankProgress> {
    let mut out: Vec<RankProgress> = beacons
        .iter()
        .map(|(r, t)| RankProgress {
            rank: Some(*r),
            step: t.step,
            phase: Some(t.phase.clone()),
            host: t.host.clone(),
            idle_s: at.saturating_duration_since(t.last_advance).as_secs_f64(),
            source: "beacon",
        })
        .collect();
    if let Ok(s) = shared.lock() {
        out.extend(s.output_progress.iter().map(|(r, (step, t))| RankProgress {
            rank: *r,
            step: *step,
            phase: None,
            host: None,
            idle_s: at.saturating_duration_since(*t).as_secs_f64(),
            source: "output",
        }));
    }
    out
}

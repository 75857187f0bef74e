//! Liveness apart from progress: heartbeats of the ranks kiln spawned, the records the rank
//! shims write (`lost-<R>` when a rank fell silent, `exit-<R>` when one exited, `live-<R>` with
//! its process state and CPU use), and samples of kiln's own process groups. A dead rank ends
//! its attempt at once; the process states tell a stuck rank from the ones waiting on it.

use super::cadence::{Cadence, LIVENESS_EVERY};
use super::config::AttemptConfig;
use super::exits::{Ours, describe, first_failed, fresh_exit_records};
use super::outcome::Verdict;
use super::reports::Reports;
use super::spawn::Running;
use crate::classify::{Classification, classify_code};
use crate::groups::{group_liveness, kill_groups};
use kiln_run::RankFiles;
use kiln_run::{Liveness, exit, unix_time};
use nix::sys::signal::Signal;
use std::collections::BTreeMap;
use std::process::ExitStatus;
use std::time::{Duration, Instant};

/// A rank's process as its shim (or kiln's own sample) last reported it.
#[derive(Debug, Clone)]
pub(super) struct Live {
    pub(super) state: char,
    cpu_ticks: u64,
    pub(super) cpu_changed: Instant,
}

/// The liveness of an attempt's ranks.
pub(super) struct LiveRanks {
    pub(super) ranks: BTreeMap<usize, Live>,
    /// The progress directory is read for lost and exit records every [`LIVENESS_EVERY`].
    records: Cadence,
}

impl LiveRanks {
    pub(super) fn new() -> Self {
        LiveRanks {
            ranks: BTreeMap::new(),
            records: Cadence::new(LIVENESS_EVERY),
        }
    }

    /// Merges the shims' liveness records in `dir` and samples of the ranks kiln spawned
    /// itself (they have no shim to report them).
    pub(super) fn sample(
        &mut self,
        files: &dyn RankFiles,
        running: &Running,
        ours: Ours<'_>,
        now: Instant,
    ) {
        let mut fresh = kiln_run::read_liveness(files);
        for (pg, rank) in running.groups.iter().zip(&running.ranks) {
            if let (Some(rank), Some((state, cpu_ticks))) = (rank, group_liveness(pg.as_raw())) {
                fresh.push(Liveness {
                    rank: *rank,
                    state,
                    cpu_ticks,
                    time: unix_time(),
                    host: kiln_run::this_host().to_string(),
                    attempt: None,
                });
            }
        }
        for l in fresh
            .into_iter()
            .filter(|l| ours.owns(l.time, l.attempt.as_deref()))
        {
            let entry = self.ranks.entry(l.rank).or_insert(Live {
                state: l.state,
                cpu_ticks: l.cpu_ticks,
                cpu_changed: now,
            });
            if l.cpu_ticks != entry.cpu_ticks {
                entry.cpu_ticks = l.cpu_ticks;
                entry.cpu_changed = now;
            }
            entry.state = l.state;
        }
    }

    /// A rank kiln spawned whose heartbeat fell silent for `--heartbeat-timeout` (killed here
    /// at once: it is stopped or wedged), a rank a shim gave up on (`lost-<R>`), or a rank
    /// under a launcher that exited with a failure while the launcher still runs. Each ends
    /// the attempt at once, naming the rank and host, with the detection time.
    pub(super) fn verdict(
        &mut self,
        cfg: &AttemptConfig,
        running: &Running,
        statuses: &[Option<ExitStatus>],
        ours: Ours<'_>,
        now: Instant,
    ) -> Option<Verdict> {
        let read_dir = self.records.due(now);
        let bound = cfg.heartbeat_timeout?;
        if let Some(v) = silent_heartbeat(running, statuses, bound, now) {
            return Some(v);
        }
        let reports = cfg.reports().filter(|_| read_dir)?;
        let files = reports.files();
        (lost_verdict(files, bound, ours, now))
            .or_else(|| failed_rank_verdict(files, ours, now))
            .or_else(|| lost_node_verdict(reports, now))
    }
}

/// A running rank kiln spawned whose heartbeat fell silent for `bound`: killed at once.
fn silent_heartbeat(
    running: &Running,
    statuses: &[Option<ExitStatus>],
    bound: Duration,
    now: Instant,
) -> Option<Verdict> {
    for (i, rank, l) in &running.beats {
        let Some(silent) = l.silent_for(now).filter(|s| *s >= bound) else {
            continue;
        };
        if statuses.get(*i).copied().flatten().is_some() {
            continue;
        }
        kill_groups(&running.groups[*i..=*i], Signal::SIGKILL);
        let host = kiln_run::this_host().to_string();
        return Some(no_heartbeat(*rank, &host, silent.as_secs_f64(), bound, now));
    }
    None
}

/// A rank a shim gave up on for its silence (`lost-<R>`).
pub(super) fn lost_verdict(
    files: &dyn RankFiles,
    bound: Duration,
    ours: Ours<'_>,
    now: Instant,
) -> Option<Verdict> {
    let l = kiln_run::read_lost_records(files)
        .into_iter()
        .find(|l| ours.owns(l.time, l.attempt.as_deref()))?;
    let detect = l.silent_s + (unix_time() - l.time).max(0.0);
    Some(no_heartbeat(l.rank, &l.host, detect, bound, now))
}

/// A rank under a launcher that exited with a failure (its exit record) while the launcher
/// still runs.
fn failed_rank_verdict(files: &dyn RankFiles, ours: Ours<'_>, now: Instant) -> Option<Verdict> {
    let exits = fresh_exit_records(files, ours);
    let r = first_failed(&exits)?;
    let code = r.shell_code();
    Some(Verdict {
        classification: classify_code(code, r.signal.is_some()),
        at: now,
        detect_s: Some((unix_time() - r.time).max(0.0)),
        culprits: vec![r.rank],
        culprit_source: Some(super::source::EXIT_RECORD),
        message: Some(format!(
            "rank {} on {} failed first ({}); the other ranks were stopped",
            r.rank,
            r.host,
            describe(r.code, r.signal)
        )),
        exit_code: Some(code),
    })
}

/// A node whose agent's connection dropped without a goodbye, or that fell silent (the
/// `tcp` control plane): its ranks are lost with it.
fn lost_node_verdict(reports: Reports<'_>, now: Instant) -> Option<Verdict> {
    let n = reports.lost_node(now)?;
    let how = match n.dropped {
        true => "dropped its connection",
        false => "fell silent",
    };
    let ranks: Vec<String> = n.ranks.iter().map(usize::to_string).collect();
    Some(Verdict {
        classification: Classification::NoHeartbeat,
        at: now,
        detect_s: Some(n.silent_s),
        culprits: n.ranks.clone(),
        culprit_source: Some(super::source::AGENT),
        message: Some(format!(
            "node {} is lost: its agent {how} ({:.2} s since it last reported; ranks {})",
            n.host,
            n.silent_s,
            if ranks.is_empty() {
                "unknown".to_string()
            } else {
                ranks.join(",")
            }
        )),
        exit_code: Some(exit::WATCHDOG),
    })
}

fn no_heartbeat(rank: usize, host: &str, detect_s: f64, bound: Duration, now: Instant) -> Verdict {
    Verdict {
        classification: Classification::NoHeartbeat,
        at: now,
        detect_s: Some(detect_s),
        culprits: vec![rank],
        culprit_source: Some(super::source::HEARTBEAT),
        message: Some(format!(
            "rank {rank} on {host} sent no heartbeat for {detect_s:.2} s (--heartbeat-timeout {}): \
             stopped, wedged or gone",
            bound.as_secs_f64()
        )),
        exit_code: Some(exit::WATCHDOG),
    }
}

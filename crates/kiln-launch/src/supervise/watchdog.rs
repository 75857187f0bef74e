//! The progress watchdogs: silence (`--timeout`: no output and no beacon change) and stall
//! (`--stall-timeout`: output goes on but no rank advances), and naming the ranks that
//! stopped advancing first.

use super::beacons::{Beacons, Tracked};
use super::config::AttemptConfig;
use super::liveness::Live;
use super::outcome::Verdict;
use super::output::Shared;
use crate::classify::Classification;
use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// Output-derived progress per source: `(step, when it last advanced)`.
type OutputProgress = BTreeMap<Option<usize>, (u64, Instant)>;

/// What the watchdogs judge by, at one instant.
pub(super) struct Seen<'a> {
    pub(super) beacons: &'a Beacons,
    pub(super) live: &'a BTreeMap<usize, Live>,
    pub(super) last_output: Option<Instant>,
    pub(super) output: OutputProgress,
    pub(super) now: Instant,
}

/// The startup watchdog, the stall watchdog, then the silence watchdog. `start`: the
/// attempt's.
pub(super) fn watchdog(
    cfg: &AttemptConfig,
    shared: &Arc<Mutex<Shared>>,
    (beacons, live): (&Beacons, &BTreeMap<usize, Live>),
    steps: &crate::stall::StepClock,
    (start, now): (Instant, Instant),
) -> Option<Verdict> {
    let (seen, advanced) = {
        let s = shared.lock().ok()?;
        let seen = Seen {
            beacons,
            live,
            last_output: s.last_output,
            output: s.output_progress.clone(),
            now,
        };
        (seen, s.first_advance.is_some())
    };
    if !advanced
        && let Some(limit) = cfg.startup_timeout
        && let Some(v) = not_started(&seen, (now.duration_since(start), limit), cfg.startup_auto)
    {
        return Some(v);
    }
    let stall = match cfg.stall_timeout {
        Some(s) => Some((s, format!("--stall-timeout {}", s.as_secs_f64()))),
        None => steps.limit().filter(|_| cfg.stall_auto),
    };
    stall
        .and_then(|(limit, how)| stalled(&seen, limit, &how))
        .or_else(|| cfg.silence_timeout.and_then(|limit| silent(&seen, limit)))
}

/// Stall: any tracked rank (beacon) or output source that has not advanced for `limit`.
fn stalled(seen: &Seen<'_>, limit: Duration, how: &str) -> Option<Verdict> {
    let now = seen.now;
    let beacons = &seen.beacons.ranks;
    let mut idle: Vec<(u64, f64)> = beacons
        .values()
        .filter(|t| !t.finished())
        .map(|t| (t.step, now.duration_since(t.last_advance).as_secs_f64()))
        .collect();
    if beacons.is_empty() {
        idle.extend(
            (seen.output.values()).map(|(step, at)| (*step, now.duration_since(*at).as_secs_f64())),
        );
    }
    let worst = idle.iter().map(|i| i.1).fold(0.0, f64::max);
    if idle.is_empty() || worst < limit.as_secs_f64() {
        return None;
    }
    let Named {
        ranks: culprits,
        who,
        source: culprit_source,
    } = first_stopped(seen);
    let step = idle.iter().map(|i| i.0).max().unwrap_or(0);
    Some(Verdict {
        exit_code: None,
        classification: Classification::HungStalled,
        at: now,
        detect_s: Some(worst),
        culprits,
        culprit_source,
        message: Some(format!(
            "watchdog: progress stalled for {worst:.1} s (limit {:.1} s: {how}) although the job is still running; \
             last step {step}; {who}",
            limit.as_secs_f64()
        )),
    })
}

/// Startup: no rank advanced `waited` after the attempt started, `limit` or more (`auto`: the
/// default limit, see [`crate::stall::startup_limit`]).
fn not_started(
    seen: &Seen<'_>,
    (waited, limit): (Duration, Duration),
    auto: bool,
) -> Option<Verdict> {
    if waited < limit {
        return None;
    }
    let how = match auto {
        true => format!(
            "{} x the slowest startup of this launch's earlier attempts, at least {} s",
            crate::stall::STARTUP_FACTOR,
            crate::stall::STARTUP_FLOOR.as_secs()
        ),
        false => "--startup-timeout".to_string(),
    };
    let Named {
        ranks: culprits,
        who,
        source: culprit_source,
    } = first_stopped(seen);
    Some(Verdict {
        exit_code: None,
        classification: Classification::HungSilent,
        at: seen.now,
        detect_s: Some(waited.as_secs_f64()),
        culprits,
        culprit_source,
        message: Some(format!(
            "watchdog: no rank reached a step {:.1} s after the attempt started (limit {:.1} s: {how}); {who}",
            waited.as_secs_f64(),
            limit.as_secs_f64(),
        )),
    })
}

/// Silence: no output and no beacon change for `limit`.
fn silent(seen: &Seen<'_>, limit: Duration) -> Option<Verdict> {
    let now = seen.now;
    let last = seen
        .last_output
        .unwrap_or(now)
        .max(seen.beacons.last_change);
    let quiet = now.duration_since(last).as_secs_f64();
    if quiet < limit.as_secs_f64() {
        return None;
    }
    let Named {
        ranks: culprits,
        who,
        source: culprit_source,
    } = first_stopped(seen);
    let step = (seen.output.values().map(|p| p.0))
        .chain(seen.beacons.ranks.values().map(|t| t.step))
        .max();
    let step = step.map_or("no progress seen".to_string(), |s| format!("last step {s}"));
    Some(Verdict {
        exit_code: None,
        classification: Classification::HungSilent,
        at: now,
        detect_s: Some(quiet),
        culprits,
        culprit_source,
        message: Some(format!(
            "watchdog: no output for {quiet:.1} s (--timeout {}); {step}; {who}",
            limit.as_secs_f64()
        )),
    })
}

/// A rank's progress as the watchdog compares it: `(rank, step, last advance, source)`.
type RankIdle = (usize, u64, Instant, &'static str);

/// The ranks a watchdog names, the sentence that says why, and where the evidence came from
/// (see [`crate::supervise::source`]; `None` when no rank is named).
pub(super) struct Named {
    pub(super) ranks: Vec<usize>,
    pub(super) who: String,
    pub(super) source: Option<&'static str>,
}

/// Names the ranks that stopped advancing first: the lowest step; among beacons at the same
/// step, a rank still computing while others wait in a collective, else those whose last
/// advance is within half a second of the earliest. Beacons win over output. Output only
/// tells ranks apart by their step: lines of ranks at the same step reach kiln in whatever
/// order the pipes deliver them, so their times say nothing. When every rank is still tied
/// (and their processes do not tell them apart either), no rank is named, and the sentence
/// says so.
fn first_stopped(seen: &Seen<'_>) -> Named {
    let (beacons, now) = (&seen.beacons.ranks, seen.now);
    let ranks: Vec<RankIdle> = if !beacons.is_empty() {
        beacons
            .iter()
            .filter(|(_, t)| !t.finished())
            .map(|(r, t)| (*r, t.step, t.last_advance, super::source::BEACON))
            .collect()
    } else {
        (seen.output.iter())
            .filter_map(|(r, (s, t))| Some(((*r)?, *s, *t, super::source::OUTPUT)))
            .collect()
    };
    if ranks.is_empty() {
        return Named {
            ranks: Vec::new(),
            who: "no per-rank progress (write beacons to $KILN_PROGRESS_DIR/rank-<R> to name the rank)"
                .into(),
            source: None,
        };
    }
    let from = ranks[0].3;
    let suspects = suspects(&ranks, beacons);
    let by_phase = suspects.len() < ranks.len();
    let min_step = suspects.iter().map(|r| r.1).min().unwrap_or(0);
    let lowest: Vec<_> = suspects.iter().filter(|r| r.1 == min_step).collect();
    let earliest = lowest.iter().map(|r| r.2).min().unwrap_or(now);
    let first: Vec<usize> = lowest
        .iter()
        .filter(|r| {
            from == super::source::OUTPUT
                || r.2.duration_since(earliest) <= Duration::from_millis(500)
        })
        .map(|r| r.0)
        .collect();
    let detail: Vec<String> = ranks
        .iter()
        .map(|(r, s, t, _)| {
            let phase = beacons
                .get(r)
                .filter(|_| from == super::source::BEACON)
                .map_or(String::new(), |t| format!(" {}", t.phase));
            format!(
                "rank {r} step {s}{phase} ({:.1} s ago)",
                now.duration_since(*t).as_secs_f64()
            )
        })
        .collect();
    let (narrowed, how) = narrow_by_liveness(first.clone(), seen.live, now);
    let source = if narrowed.len() < first.len() {
        super::source::LIVENESS
    } else {
        from
    };
    let list: Vec<String> = narrowed.iter().map(usize::to_string).collect();
    let what = if from == super::source::BEACON {
        "beacons"
    } else {
        "their output"
    };
    if narrowed.len() > 1 && narrowed.len() == ranks.len() {
        return Named {
            ranks: Vec::new(),
            who: format!(
                "ranks {} all stopped at step {min_step} (from {what}: {}); nothing kiln saw tells them apart, so no rank is named \
                 (beacons with a phase, `<step> collective` while waiting on the others, in $KILN_PROGRESS_DIR/rank-<R>, would)",
                list.join(", "),
                detail.join(", ")
            ),
            source: None,
        };
    }
    let by = if by_phase {
        " and phases: the others wait in a collective"
    } else {
        ""
    };
    Named {
        who: format!(
            "ranks that stopped advancing first: {} (from {what}{by}{how}: {})",
            list.join(", "),
            detail.join(", ")
        ),
        ranks: narrowed,
        source: Some(source),
    }
}

/// In a collective every healthy rank waits for the stuck one at the same step: a rank whose
/// beacon says it waits on the others is not the culprit when some rank does not.
fn suspects(ranks: &[RankIdle], beacons: &BTreeMap<usize, Tracked>) -> Vec<RankIdle> {
    let working: Vec<usize> = beacons
        .iter()
        .filter(|(_, t)| !t.waiting() && !t.finished())
        .map(|(r, _)| *r)
        .collect();
    if !working.is_empty() && working.len() < ranks.len() && ranks.iter().all(|r| r.3 == "beacon") {
        ranks
            .iter()
            .filter(|r| working.contains(&r.0))
            .copied()
            .collect()
    } else {
        ranks.to_vec()
    }
}

/// Among ranks that stopped at the same step at the same time (a collective: the healthy
/// ones wait for the stuck one), the stuck one is the process that does nothing: stopped, or
/// using no CPU while the others spin in MPI. Returns the narrowed list (unchanged when the
/// processes do not tell them apart) and how it was narrowed.
fn narrow_by_liveness(
    tied: Vec<usize>,
    live: &BTreeMap<usize, Live>,
    now: Instant,
) -> (Vec<usize>, &'static str) {
    if tied.len() < 2 || !tied.iter().all(|r| live.contains_key(r)) {
        return (tied, "");
    }
    let strict = |v: &Vec<usize>| !v.is_empty() && v.len() < tied.len();
    let stopped: Vec<usize> = tied
        .iter()
        .copied()
        .filter(|r| matches!(live[r].state, 'T' | 't'))
        .collect();
    if strict(&stopped) {
        return (stopped, " and process states: stopped");
    }
    let idle_for = |r: &usize| now.saturating_duration_since(live[r].cpu_changed);
    let busy = tied.iter().any(|r| idle_for(r) < Duration::from_secs(1));
    let idle: Vec<usize> = tied
        .iter()
        .copied()
        .filter(|r| idle_for(r) >= Duration::from_secs(2))
        .collect();
    if busy && strict(&idle) {
        return (idle, " and CPU use: no CPU while the others spin");
    }
    (tied, "")
}

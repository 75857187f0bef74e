//! The goodput ledger: every second of a run's wall time, across all batch jobs and launch
//! attempts, attributed from `events.jsonl` alone:
//!
//! | bucket            | what                                                                  |
//! | ----------------- | --------------------------------------------------------------------- |
//! | productive        | training whose result was kept (first to last step of each attempt,   |
//! |                   | less checkpoint stalls and lost work)                                 |
//! | startup           | attempt start to its first completed step (a failed start: all of it) |
//! | checkpoint stall  | time the step waited for saves and memory snapshots (`stall_s` of     |
//! |                   | `checkpoint_saved` / `snapshot_saved`; a log from before `stall_s`:   |
//! |                   | `seconds`). An asynchronous save's write is not a stall.              |
//! | lost work         | steps redone: work after the checkpoint the next attempt resumed from |
//! | detection         | a failed attempt's fault (the last heartbeat, progress or exit of the |
//! |                   | rank that failed: `detect_s` before the supervisor decided) to the end|
//! |                   | of its kill; a log without `detect_s`: a hang's last step to the end  |
//! | backoff           | waiting between attempts                                              |
//! | queue             | a batch job's submission to its start                                 |
//! | other             | the rest: kiln's own start and decisions, gaps the events do not cover|
//!
//! ETTR (effective training time ratio) is productive / total.
//!
//! Each failed attempt is also a [`Fault`]: when it happened, how long the supervisor took to
//! decide (`detect_s` of `attempt_end`), the tier the next attempt resumed from (`tier` of its
//! `resume`: memory, peer or persistent), and the work it lost (steps redone x the attempt's
//! step time).

use crate::event;
use crate::events::Event;
use serde_json::Value;

/// The names of the ledger's buckets (rows of `kiln status`, spans of the timeline plot).
pub mod bucket {
    /// Steps that stayed (not lost to a rollback or a restart).
    pub const PRODUCTIVE: &str = "productive";
    /// From attempt start to the first step.
    pub const STARTUP: &str = "startup";
    /// What the training step waited for checkpoints.
    pub const CHECKPOINT_STALL: &str = "checkpoint stall";
    /// Steps done after the last checkpoint that a restart redid.
    pub const LOST_WORK: &str = "lost work";
    /// From a fault to the end of its attempt's kill.
    pub const DETECTION: &str = "detection";
    /// Waiting between attempts.
    pub const BACKOFF: &str = "backoff";
    /// Waiting for the scheduler between jobs.
    pub const QUEUE: &str = "queue";
    /// Everything else.
    pub const OTHER: &str = "other";
}

/// Seconds per bucket.
#[derive(Debug, Clone, Copy, Default, PartialEq, serde::Serialize)]
pub struct Buckets {
    /// Training kept.
    pub productive: f64,
    /// Launch to first step.
    pub startup: f64,
    /// Saving checkpoints.
    pub checkpoint: f64,
    /// Work redone after a failure.
    pub lost: f64,
    /// From a fault to the end of its attempt's kill.
    pub detection: f64,
    /// Between attempts.
    pub backoff: f64,
    /// Waiting in the scheduler's queue.
    pub queue: f64,
    /// Everything else.
    pub other: f64,
}

impl Buckets {
    /// `(name, seconds)` in display order.
    pub fn rows(&self) -> [(&'static str, f64); 8] {
        [
            (bucket::PRODUCTIVE, self.productive),
            (bucket::STARTUP, self.startup),
            (bucket::CHECKPOINT_STALL, self.checkpoint),
            (bucket::LOST_WORK, self.lost),
            (bucket::DETECTION, self.detection),
            (bucket::BACKOFF, self.backoff),
            (bucket::QUEUE, self.queue),
            (bucket::OTHER, self.other),
        ]
    }
}

/// One span of the timeline, seconds since the run's first event.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct Span {
    /// Start.
    pub from: f64,
    /// End.
    pub to: f64,
    /// Bucket name (as in [`Buckets::rows`]).
    pub kind: &'static str,
}

/// One attempt, for the timeline.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct AttemptSummary {
    /// Start and end, seconds since the run's first event.
    pub from: f64,
    /// See `from`.
    pub to: f64,
    /// First and last completed step time (relative), when it made progress.
    pub work: Option<(f64, f64)>,
    /// Step it started from and the last step seen.
    pub steps: (Option<u64>, Option<u64>),
    /// Classification.
    pub classification: String,
    /// Culprit hosts named.
    pub culprits: Vec<String>,
    /// Hosts it ran on.
    pub hosts: Vec<String>,
    /// The tier its resume came from (`memory`, `peer`, `persistent`), if it resumed.
    pub resumed_from: Option<String>,
    /// Steps of this attempt the next one redid (a failed attempt that was resumed).
    pub lost_steps: Option<u64>,
    /// Seconds of this attempt counted as lost work (the steps redone and the one in flight
    /// at the fault): its share of the ledger's lost-work bucket.
    pub lost_s: f64,
    /// Its trainer's startup phases (`spawn` from the attempt's start to the process's,
    /// then the `startup_phases` event's), seconds, in order.
    pub phases: Vec<(String, f64)>,
}

/// A failed attempt and its recovery.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct Fault {
    /// The attempt that failed (1-based, in time order).
    pub attempt: usize,
    /// When the fault happened (the supervisor's decision less `detect_s`; the attempt's
    /// last progress when that is unknown), seconds since the run's first event.
    pub at: f64,
    /// How the attempt ended (`no-heartbeat`, `hung-stalled`, `failed`, ...).
    pub classification: String,
    /// Ranks named as the culprits.
    pub ranks: Vec<u64>,
    /// Their hosts.
    pub hosts: Vec<String>,
    /// Seconds from the fault to the supervisor deciding, when it recorded them.
    pub detect_s: Option<f64>,
    /// Seconds from the decision until every process of the attempt was gone.
    pub kill_s: Option<f64>,
    /// The tier the next attempt resumed from (`memory`, `peer`, `persistent`); `None` when
    /// none followed or it started afresh.
    pub resumed_from: Option<String>,
    /// The step it resumed from.
    pub resumed_step: Option<u64>,
    /// Steps of this attempt the next one redid.
    pub lost_steps: Option<u64>,
    /// Seconds per step of this attempt (first to last progress).
    pub step_s: Option<f64>,
    /// Seconds of work this attempt lost, as the ledger's lost-work bucket counts them:
    /// from the point the next attempt resumed from (the save it used) to the fault, that is
    /// the steps redone and the step in flight. The faults' `lost_s` add up to the bucket.
    pub lost_s: Option<f64>,
}

/// A node swap or quarantine, for the timeline.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct Swap {
    /// When (relative).
    pub at: f64,
    /// The host swapped out.
    pub host: String,
    /// Its replacement (`None`: dropped).
    pub replacement: Option<String>,
    /// Why.
    pub cause: String,
    /// Whether it was a guess.
    pub blind: bool,
}

/// The ledger of a run.
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize)]
pub struct Ledger {
    /// Unix time of the first event counted.
    pub start: f64,
    /// Total wall seconds.
    pub total: f64,
    /// Seconds per bucket (they add up to `total`).
    pub buckets: Buckets,
    /// Batch jobs seen (`job_start`).
    pub jobs: usize,
    /// Attempts, in time order.
    pub attempts: Vec<AttemptSummary>,
    /// Node swaps and drops.
    pub swaps: Vec<Swap>,
    /// Steps redone after failures.
    pub lost_steps: u64,
    /// Failed attempts, in time order.
    pub faults: Vec<Fault>,
    /// Timeline spans, by bucket.
    pub spans: Vec<Span>,
}

impl Ledger {
    /// productive / total (0 when nothing happened).
    pub fn ettr(&self) -> f64 {
        if self.total > 0.0 {
            self.buckets.productive / self.total
        } else {
            0.0
        }
    }
}

fn f(e: &Event, k: &str) -> Option<f64> {
    e.fields.get(k).and_then(Value::as_f64)
}

fn u(e: &Event, k: &str) -> Option<u64> {
    e.fields.get(k).and_then(Value::as_u64)
}

fn strings(e: &Event, k: &str) -> Vec<String> {
    e.fields
        .get(k)
        .and_then(Value::as_array)
        .map(|a| {
            a.iter()
                .filter_map(|v| Some(v.as_str()?.to_string()))
                .collect()
        })
        .unwrap_or_default()
}

/// An attempt as the ledger sees it (absolute times).
struct Att {
    start: f64,
    end: f64,
    first: Option<f64>,
    last: Option<f64>,
    start_step: Option<u64>,
    last_step: Option<u64>,
    class: String,
    culprits: Vec<String>,
    culprit_ranks: Vec<u64>,
    hosts: Vec<String>,
    detect_s: Option<f64>,
    kill_s: Option<f64>,
}

/// Endings that are not faults (kiln-launch's `Classification::name`): the run finished or
/// was stopped on purpose, after a checkpoint.
const NOT_FAULTS: [&str; 4] = ["success", "walltime", "preempted", "interrupted"];

impl Att {
    /// Unix time of the fault: the decision (end less the kill) less the detection time.
    fn fault_time(&self) -> Option<f64> {
        let decided = self.end - self.kill_s.unwrap_or(0.0);
        Some((decided - self.detect_s?).max(self.start))
    }

    /// When it reached `step`, by linear interpolation between its first progress (at its
    /// start step) and its last; `None` outside those steps.
    fn time_of_step(&self, step: u64) -> Option<f64> {
        let (s0, s1, t0, t1) = (self.start_step?, self.last_step?, self.first?, self.last?);
        if step < s0 || step > s1 || s1 == s0 {
            return None;
        }
        Some(t0 + (t1 - t0) * (step - s0) as f64 / (s1 - s0) as f64)
    }

    /// Seconds per step between its first and last progress.
    fn step_s(&self) -> Option<f64> {
        let steps = self.last_step?.checked_sub(self.start_step?)?;
        let secs = self.last? - self.first?;
        (steps > 0 && secs > 0.0).then(|| secs / steps as f64)
    }
}

/// Attempts from `attempt_end` events; a run trained without `kiln launch` counts each
/// trainer session (`start` to `exit`) as one attempt.
fn attempts(events: &[Event]) -> Vec<Att> {
    let mut v: Vec<Att> = events
        .iter()
        .filter(|e| e.event == event::ATTEMPT_END)
        .filter_map(|e| {
            Some(Att {
                start: f(e, "start_time")?,
                end: f(e, "end_time")?,
                first: f(e, "first_advance_time"),
                last: f(e, "last_advance_time"),
                start_step: u(e, "start_step"),
                last_step: u(e, "last_progress"),
                class: e.fields.get("classification")?.as_str()?.to_string(),
                culprits: strings(e, "culprit_hosts"),
                culprit_ranks: e
                    .fields
                    .get("culprit_ranks")
                    .and_then(Value::as_array)
                    .map(|a| a.iter().filter_map(Value::as_u64).collect())
                    .unwrap_or_default(),
                hosts: strings(e, "hosts"),
                detect_s: f(e, "detect_s"),
                kill_s: f(e, "kill_s"),
            })
        })
        .collect();
    if v.is_empty() {
        v = trainer_sessions(events);
    }
    v.sort_by(|a, b| a.start.total_cmp(&b.start));
    // The trainer says exactly where it started; a beacon read may come a few steps late.
    for a in &mut v {
        if let Some(s) = events
            .iter()
            .find(|e| {
                e.event == event::START
                    && e.source == crate::event::source::TRAIN
                    && e.time >= a.start
                    && e.time <= a.end
            })
            .and_then(|e| u(e, "step"))
        {
            a.start_step = Some(s);
        }
    }
    v
}

/// A run trained without `kiln launch`: each trainer session (`start` to `exit`) as an
/// attempt.
fn trainer_sessions(events: &[Event]) -> Vec<Att> {
    let mut v = Vec::new();
    let mut open: Option<&Event> = None;
    let train = events
        .iter()
        .filter(|e| e.source == crate::event::source::TRAIN);
    for e in train {
        match (e.event.as_str(), open) {
            (event::START, _) => open = Some(e),
            (event::EXIT, Some(s)) => {
                let code = e.fields.get("code").and_then(Value::as_i64).unwrap_or(1);
                v.push(Att {
                    start: s.time,
                    end: e.time,
                    first: Some(s.time),
                    last: Some(e.time),
                    start_step: u(s, "step"),
                    last_step: u(e, "step"),
                    class: match code {
                        0 => "success".into(),
                        _ => format!("exit {code}"),
                    },
                    culprits: Vec::new(),
                    culprit_ranks: Vec::new(),
                    hosts: Vec::new(),
                    detect_s: None,
                    kill_s: None,
                });
                open = None;
            }
            _ => {}
        }
    }
    v
}

/// Computes the ledger of a run from its events (any order; sorted by time here).
pub fn ledger(events: &[Event]) -> Ledger {
    let mut events: Vec<Event> = events.to_vec();
    events.sort_by(|a, b| a.time.total_cmp(&b.time));
    let atts = attempts(&events);
    let Some((t0, t1)) = run_bounds(&events, &atts) else {
        return Ledger::default();
    };
    let mut tl = Timeline::new(t0);
    let (saves, resumes) = (saves(&events), resumes(&events));
    let mut summaries = Vec::new();
    for (i, a) in atts.iter().enumerate() {
        // None when training never started again (the run ended in failed starts).
        let resumed = atts
            .get(i + 1)
            .and_then(|n| resumes.iter().find(|r| r.0 >= n.start).map(|r| r.1));
        let mut s = summary(a, t0);
        let lost_before = tl.buckets.lost;
        s.lost_steps = tl.attempt(a, &saves, resumed);
        s.lost_s = tl.buckets.lost - lost_before;
        attempt_details(&mut s, a, &events);
        summaries.push(s);
    }
    for e in events.iter().filter(|e| e.event == event::BACKOFF) {
        let end = e.time + f(e, "seconds").unwrap_or(0.0);
        tl.span(e.time, end, bucket::BACKOFF);
    }
    let job_starts: Vec<&Event> = events
        .iter()
        .filter(|e| e.event == event::JOB_START)
        .collect();
    for e in &job_starts {
        if let Some(s) = f(e, "submit_time") {
            tl.span(s, e.time, bucket::QUEUE);
        }
    }
    let total = t1 - t0;
    let counted: f64 = tl.buckets.rows().iter().map(|r| r.1).sum();
    tl.buckets.other += (total - counted).max(0.0);
    Ledger {
        start: t0,
        total,
        buckets: tl.buckets,
        jobs: job_starts.len(),
        faults: faults(&atts, &summaries, t0),
        lost_steps: summaries.iter().filter_map(|s| s.lost_steps).sum(),
        attempts: summaries,
        swaps: swaps(&events, t0),
        spans: tl.spans,
    }
}

/// The run's first and last moments (Unix times): its events, its attempts and the
/// submissions of its batch jobs; `None` when there is nothing.
fn run_bounds(events: &[Event], atts: &[Att]) -> Option<(f64, f64)> {
    let t0 = events
        .iter()
        .map(|e| e.time)
        .chain(atts.iter().map(|a| a.start))
        .chain(events.iter().filter_map(|e| f(e, "submit_time")))
        .reduce(f64::min)?;
    let t1 = events
        .iter()
        .map(|e| e.time)
        .chain(atts.iter().map(|a| a.end))
        .fold(t0, f64::max);
    Some((t0, t1))
}

/// Checkpoint and snapshot saves: `(time, step, seconds the step stalled)`.
fn saves(events: &[Event]) -> Vec<(f64, u64, f64)> {
    events
        .iter()
        .filter(|e| e.event == event::CHECKPOINT_SAVED || e.event == event::SNAPSHOT_SAVED)
        .filter_map(|e| {
            let stall = f(e, "stall_s").or_else(|| f(e, "seconds")).unwrap_or(0.0);
            Some((e.time, u(e, "step")?, stall))
        })
        .collect()
}

/// Where each training start began: `(time, step)`, a resume's step or 0 for a fresh start.
fn resumes(events: &[Event]) -> Vec<(f64, u64)> {
    let fresh = |e: &Event| {
        e.event == event::START
            && e.source == crate::event::source::TRAIN
            && e.fields.get("resumed_from").is_some_and(Value::is_null)
    };
    events
        .iter()
        .filter_map(|e| match e.event == event::RESUME {
            true => Some((e.time, u(e, "step")?)),
            false => fresh(e).then_some((e.time, 0)),
        })
        .collect()
}

/// Node swaps and drops, relative to `t0`.
fn swaps(events: &[Event], t0: f64) -> Vec<Swap> {
    let text = |e: &Event, k: &str| e.fields.get(k).and_then(Value::as_str).map(str::to_string);
    events
        .iter()
        .filter(|e| e.event == event::NODE_SWAP || e.event == event::SHRINK)
        .map(|e| Swap {
            at: e.time - t0,
            host: text(e, "host")
                .or_else(|| text(e, "dropped"))
                .unwrap_or_else(|| "?".into()),
            replacement: text(e, "replacement"),
            cause: text(e, "cause").unwrap_or_else(|| "?".into()),
            blind: e
                .fields
                .get("blind")
                .and_then(Value::as_bool)
                .unwrap_or(false),
        })
        .collect()
}

/// The buckets and the timeline's spans, filled span by span.
struct Timeline {
    t0: f64,
    buckets: Buckets,
    spans: Vec<Span>,
}

impl Timeline {
    fn new(t0: f64) -> Self {
        Self {
            t0,
            buckets: Buckets::default(),
            spans: Vec::new(),
        }
    }

    /// Counts `[from, to)` (Unix times) in bucket `kind`; nothing when it is empty.
    fn span(&mut self, from: f64, to: f64, kind: &'static str) {
        let d = (to - from).max(0.0);
        if d <= 0.0 {
            return;
        }
        let b = &mut self.buckets;
        let slot = match kind {
            bucket::PRODUCTIVE => &mut b.productive,
            bucket::STARTUP => &mut b.startup,
            bucket::CHECKPOINT_STALL => &mut b.checkpoint,
            bucket::LOST_WORK => &mut b.lost,
            bucket::DETECTION => &mut b.detection,
            bucket::BACKOFF => &mut b.backoff,
            bucket::QUEUE => &mut b.queue,
            _ => &mut b.other,
        };
        *slot += d;
        self.spans.push(Span {
            from: from - self.t0,
            to: to - self.t0,
            kind,
        });
    }

    /// Counts attempt `a`'s time, whose work the next attempt resumed from step `resumed`
    /// (`None`: none did); returns the steps it redid (a failed attempt that was resumed).
    fn attempt(&mut self, a: &Att, saves: &[(f64, u64, f64)], resumed: Option<u64>) -> Option<u64> {
        let (Some(first), Some(last)) = (a.first, a.last.or(a.first)) else {
            // No step completed: the whole attempt was a start that went nowhere (a hang's
            // detection included, when it was one).
            let hung = a.class.starts_with("hung");
            let kind = if hung {
                bucket::DETECTION
            } else {
                bucket::STARTUP
            };
            self.span(a.start, a.end, kind);
            return None;
        };
        let success = a.class == "success";
        let inside = || saves.iter().filter(|s| s.0 >= a.start && s.0 <= a.end);
        let stall: f64 = inside().map(|s| s.2).sum();
        let kept_until = if success {
            a.end
        } else {
            // Where the work stops being kept: the save of the checkpoint the next attempt
            // resumed from (or, for the last attempt, its last save). A snapshot whose writer
            // was stopped or killed before it logged the save is still used: the work up to
            // its step, by the attempt's pace, was kept.
            let target = inside()
                .filter(|s| resumed.is_none_or(|r| s.1 == r))
                .map(|s| s.0)
                .reduce(f64::max);
            match target.or_else(|| a.time_of_step(resumed?)) {
                Some(t) => t.clamp(first, a.end),
                None => first,
            }
        };
        self.span(a.start, first, bucket::STARTUP);
        let work_end = if success { a.end } else { last.max(first) };
        let kept_end = kept_until.min(work_end);
        // Checkpoint stalls are inside the kept work; they are taken out of productive.
        let kept_stall = stall.min((kept_end - first).max(0.0));
        self.span(first, kept_end - kept_stall, bucket::PRODUCTIVE);
        self.span(kept_end - kept_stall, kept_end, bucket::CHECKPOINT_STALL);
        self.span(kept_end, work_end, bucket::LOST_WORK);
        if success {
            return None;
        }
        // The work up to the fault is lost; from the fault on, the supervisor was finding it
        // and ending the attempt. Without a recorded detection time, a hang's tail is
        // detection and any other's lost work.
        let fault = match a.fault_time() {
            Some(t) => t.clamp(work_end, a.end),
            None if a.class.starts_with("hung") => work_end,
            None => a.end,
        };
        self.span(work_end, fault, bucket::LOST_WORK);
        self.span(fault, a.end, bucket::DETECTION);
        Some(a.last_step?.saturating_sub(resumed?))
    }
}

/// The failed attempts, each with its detection, the tier the next attempt resumed from and
/// the work it lost.
fn faults(atts: &[Att], summaries: &[AttemptSummary], t0: f64) -> Vec<Fault> {
    let failed = atts
        .iter()
        .zip(summaries)
        .enumerate()
        .filter(|(_, (a, _))| !NOT_FAULTS.contains(&a.class.as_str()));
    failed
        .map(|(i, (a, s))| {
            let next = summaries.get(i + 1).filter(|n| n.resumed_from.is_some());
            let step_s = a.step_s();
            Fault {
                attempt: i + 1,
                at: a.fault_time().or(a.last).unwrap_or(a.end) - t0,
                classification: a.class.clone(),
                ranks: a.culprit_ranks.clone(),
                hosts: a.culprits.clone(),
                detect_s: a.detect_s,
                kill_s: a.kill_s,
                resumed_from: next.and_then(|n| n.resumed_from.clone()),
                resumed_step: next.and_then(|n| n.steps.0),
                lost_steps: s.lost_steps,
                step_s,
                lost_s: Some(s.lost_s),
            }
        })
        .collect()
}

fn summary(a: &Att, t0: f64) -> AttemptSummary {
    AttemptSummary {
        from: a.start - t0,
        to: a.end - t0,
        work: a.first.map(|fst| (fst - t0, a.last.unwrap_or(fst) - t0)),
        steps: (a.start_step, a.last_step),
        classification: a.class.clone(),
        culprits: a.culprits.clone(),
        hosts: a.hosts.clone(),
        resumed_from: None,
        lost_steps: None,
        lost_s: 0.0,
        phases: Vec::new(),
    }
}

/// The tier of the attempt's resume and its startup phases, from its trainer's events.
fn attempt_details(s: &mut AttemptSummary, a: &Att, events: &[Event]) {
    let inside = |e: &&Event| {
        e.source == crate::event::source::TRAIN && e.time >= a.start && e.time <= a.end
    };
    s.resumed_from = events
        .iter()
        .filter(inside)
        .find(|e| e.event == event::RESUME)
        .map(|e| {
            e.fields
                .get("tier")
                .and_then(Value::as_str)
                .unwrap_or(event::tier::PERSISTENT)
                .to_string()
        });
    let Some(p) = events
        .iter()
        .filter(inside)
        .find(|e| e.event == event::STARTUP_PHASES)
    else {
        return;
    };
    if let Some(start) = f(p, "process_start") {
        s.phases.push(("spawn".into(), (start - a.start).max(0.0)));
    }
    for name in event::phase::ALL {
        if let Some(v) = f(p, &format!("{name}_s")) {
            s.phases.push((name.to_string(), v));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::{Map, json};

    fn ev(time: f64, source: &str, name: &str, fields: Value) -> Event {
        let Value::Object(fields) = fields else {
            return Event {
                time,
                source: source.into(),
                event: name.into(),
                fields: Map::new(),
            };
        };
        Event {
            time,
            source: source.into(),
            event: name.into(),
            fields,
        }
    }

    #[test]
    fn every_second_is_attributed_once() {
        // Job submitted at 0, starts at 10. Attempt 1: 10-40, first step at 12, checkpoint of
        // step 100 saved at 30 (1 s), last step at 35, crash. Backoff 40-42. Attempt 2:
        // 42-80, resumes at 100, first step at 45, success.
        let events = vec![
            ev(0.0, "submit", "job_submitted", json!({"job_id": "7"})),
            ev(
                10.0,
                "launch",
                "job_start",
                json!({"job_id": "7", "submit_time": 0.0}),
            ),
            ev(10.0, "launch", "attempt_start", json!({"attempt": 1})),
            ev(
                30.0,
                "train",
                "checkpoint_saved",
                json!({"step": 100, "seconds": 1.0}),
            ),
            ev(
                40.0,
                "launch",
                "attempt_end",
                json!({"start_time": 10.0, "end_time": 40.0, "first_advance_time": 12.0, "last_advance_time": 35.0, "classification": "failed", "last_progress": 130, "culprit_hosts": ["n2"]}),
            ),
            ev(40.0, "launch", "backoff", json!({"seconds": 2.0})),
            ev(42.5, "train", "resume", json!({"step": 100})),
            ev(
                80.0,
                "launch",
                "attempt_end",
                json!({"start_time": 42.0, "end_time": 80.0, "first_advance_time": 45.0, "last_advance_time": 79.0, "classification": "success", "last_progress": 200}),
            ),
            ev(
                80.0,
                "launch",
                "node_swap",
                json!({"host": "n2", "replacement": "n4", "cause": "crash"}),
            ),
        ];
        let l = ledger(&events);
        assert_eq!(l.total, 80.0);
        let b = l.buckets;
        assert_eq!(b.queue, 10.0);
        assert_eq!(b.startup, 2.0 + 3.0);
        assert_eq!(b.checkpoint, 1.0);
        // Attempt 1 kept 12..30 (less the 1 s save), lost 30..35 and the crash tail 35..40.
        assert_eq!(b.lost, 10.0);
        assert_eq!(b.productive, 17.0 + 35.0);
        assert_eq!(b.backoff, 2.0);
        let sum: f64 = b.rows().iter().map(|r| r.1).sum();
        assert!((sum - l.total).abs() < 1e-9, "{sum} vs {}", l.total);
        assert_eq!(l.lost_steps, 30);
        assert_eq!(l.jobs, 1);
        assert_eq!(l.swaps[0].replacement.as_deref(), Some("n4"));
        assert!((l.ettr() - 52.0 / 80.0).abs() < 1e-9);
    }

    #[test]
    fn hangs_and_failed_starts() {
        let events = vec![
            ev(
                0.0,
                "launch",
                "attempt_end",
                json!({"start_time": 0.0, "end_time": 5.0, "classification": "failed"}),
            ),
            ev(
                20.0,
                "launch",
                "attempt_end",
                json!({"start_time": 5.0, "end_time": 20.0, "first_advance_time": 6.0, "last_advance_time": 10.0, "classification": "hung-stalled"}),
            ),
        ];
        let b = ledger(&events).buckets;
        assert_eq!(b.startup, 5.0 + 1.0);
        assert_eq!(b.detection, 10.0);
        // No checkpoint: the hung attempt's work is all lost.
        assert_eq!(b.lost, 4.0);
        assert_eq!(b.productive, 0.0);
        assert_eq!(ledger(&[]).total, 0.0);
    }

    #[test]
    fn steps_are_lost_only_to_a_start_that_began_again_behind_them() {
        let end = |t0: f64, t1: f64, class: &str, last: u64| {
            let f = json!({"start_time": t0, "end_time": t1, "first_advance_time": t0 + 1.0,
                           "last_advance_time": t1 - 1.0, "classification": class,
                           "last_progress": last, "start_step": 0});
            ev(t1, "launch", "attempt_end", f)
        };
        let failed_start = |t0: f64, t1: f64| {
            let f = json!({"start_time": t0, "end_time": t1, "classification": "failed"});
            ev(t1, "launch", "attempt_end", f)
        };
        // The run ended in starts that failed: nothing was redone, so nothing counts as lost.
        let ended = [end(0.0, 50.0, "walltime", 300), failed_start(51.0, 52.0)];
        let l = ledger(&ended);
        assert_eq!((l.lost_steps, l.attempts[0].lost_steps), (0, None));
        // A fresh start after it (no checkpoint) redoes every step.
        let mut fresh = ended.to_vec();
        let start = json!({"step": 0, "resumed_from": null});
        fresh.push(ev(53.5, "train", "start", start));
        fresh.push(end(53.0, 60.0, "success", 400));
        let l = ledger(&fresh);
        assert_eq!((l.lost_steps, l.attempts[0].lost_steps), (300, Some(300)));
    }

    #[test]
    fn each_fault_has_its_detection_resume_tier_and_lost_work() {
        // Attempt 1 (10-40): rank 1 on n2 stops beating; the supervisor decides 1 s after its
        // last beat and the kill takes 0.5 s. Attempt 2 resumes from the memory snapshot of
        // step 120 (saved at 37) and succeeds.
        let events = vec![
            ev(10.5, "train", "start", json!({"step": 0})),
            ev(
                37.0,
                "train",
                "snapshot_saved",
                json!({"step": 120, "stall_s": 0.0}),
            ),
            ev(
                40.0,
                "launch",
                "attempt_end",
                json!({"start_time": 10.0, "end_time": 40.0, "first_advance_time": 12.0,
                       "last_advance_time": 38.4, "classification": "no-heartbeat",
                       "last_progress": 130, "detect_s": 1.0, "kill_s": 0.5,
                       "culprit_ranks": [1], "culprit_hosts": ["n2"]}),
            ),
            ev(41.0, "train", "start", json!({"step": 120})),
            ev(
                41.2,
                "train",
                "resume",
                json!({"step": 120, "tier": "memory"}),
            ),
            ev(
                60.0,
                "launch",
                "attempt_end",
                json!({"start_time": 40.5, "end_time": 60.0, "first_advance_time": 42.0,
                       "last_advance_time": 59.9, "classification": "success", "last_progress": 200}),
            ),
        ];
        let l = ledger(&events);
        let close = |a: f64, b: f64| (a - b).abs() < 1e-9;
        let b = l.buckets;
        assert!(close(b.detection, 1.5), "{b:?}");
        assert!(close(b.lost, 1.5), "{b:?}");
        assert!(close(b.productive, 25.0 + 18.0), "{b:?}");
        assert!(close(b.startup, 2.0 + 1.5), "{b:?}");
        let sum: f64 = b.rows().iter().map(|r| r.1).sum();
        assert!(close(sum, l.total));
        assert_eq!(l.faults.len(), 1);
        let fault = &l.faults[0];
        assert_eq!(fault.attempt, 1);
        assert!(close(fault.at, 28.5), "{fault:?}");
        assert_eq!(fault.classification, "no-heartbeat");
        assert_eq!(
            (fault.ranks.clone(), fault.hosts.clone()),
            (vec![1], vec!["n2".to_string()])
        );
        assert_eq!((fault.detect_s, fault.kill_s), (Some(1.0), Some(0.5)));
        assert_eq!(fault.resumed_from.as_deref(), Some("memory"));
        assert_eq!(
            (fault.resumed_step, fault.lost_steps),
            (Some(120), Some(10))
        );
        let step_s = (38.4 - 12.0) / 130.0;
        assert!(close(fault.step_s.unwrap(), step_s));
        // The fault's lost work is the bucket's: from the snapshot it resumed from to the
        // fault.
        assert!(close(fault.lost_s.unwrap(), b.lost), "{fault:?}");
    }

    /// A failed attempt of `class` from `t0` to `t1` that progressed from `first` (at
    /// `start_step`) to `last` (at `last_step`), decided `detect` s after its fault, killed
    /// in `kill` s.
    fn failed(
        (t0, t1): (f64, f64),
        (first, last): (f64, f64),
        (start_step, last_step): (u64, u64),
        (class, detect, kill): (&str, f64, f64),
    ) -> Event {
        ev(
            t1,
            "launch",
            "attempt_end",
            json!({"start_time": t0, "end_time": t1, "first_advance_time": first,
                   "last_advance_time": last, "classification": class, "start_step": start_step,
                   "last_progress": last_step, "detect_s": detect, "kill_s": kill,
                   "culprit_ranks": [1]}),
        )
    }

    /// Issue 46: a rank killed right after the checkpoint of step 100 was published but
    /// before its `checkpoint_saved` event. The next attempt resumed from that checkpoint:
    /// no step was redone, but the step in flight (0.6 s) was lost. The ledger's lost work
    /// and the fault's must be the same seconds.
    #[test]
    fn a_fault_loses_the_seconds_the_ledger_counts_as_lost_work() {
        let events = vec![
            ev(10.5, "train", "start", json!({"step": 0})),
            failed((10.0, 32.0), (11.0, 30.4), (0, 100), ("failed", 0.6, 0.4)),
            ev(33.0, "train", "start", json!({"step": 100})),
            ev(
                33.1,
                "train",
                "resume",
                json!({"step": 100, "tier": "persistent"}),
            ),
            ev(
                50.0,
                "launch",
                "attempt_end",
                json!({"start_time": 32.5, "end_time": 50.0, "first_advance_time": 34.0,
                       "last_advance_time": 49.0, "classification": "success", "last_progress": 200}),
            ),
        ];
        let l = ledger(&events);
        let close = |a: f64, b: f64| (a - b).abs() < 1e-9;
        let f = &l.faults[0];
        assert_eq!(f.lost_steps, Some(0));
        assert!(close(l.buckets.lost, 0.6), "{:?}", l.buckets);
        assert!(close(f.lost_s.unwrap(), 0.6), "{f:?}");
        assert!(close(l.attempts[0].lost_s, 0.6));
    }

    /// Held out: three faults of other kinds, resumed from other tiers and steps, with saves
    /// logged and not: every fault's lost seconds are its share of the bucket, and they add
    /// up to it.
    #[test]
    fn the_faults_lost_work_adds_up_to_the_bucket() {
        let events = vec![
            ev(0.5, "train", "start", json!({"step": 0})),
            ev(
                9.0,
                "train",
                "snapshot_saved",
                json!({"step": 40, "stall_s": 0.1}),
            ),
            failed(
                (0.0, 12.0),
                (1.0, 10.5),
                (0, 47),
                ("no-heartbeat", 0.3, 0.2),
            ),
            ev(
                12.7,
                "train",
                "resume",
                json!({"step": 40, "tier": "memory"}),
            ),
            failed(
                (12.5, 30.0),
                (13.0, 29.0),
                (40, 121),
                ("hung-stalled", 5.0, 1.0),
            ),
            ev(
                30.7,
                "train",
                "resume",
                json!({"step": 100, "tier": "peer"}),
            ),
            failed(
                (30.5, 40.0),
                (31.0, 39.5),
                (100, 150),
                ("failed", 0.05, 0.1),
            ),
            ev(
                40.7,
                "train",
                "resume",
                json!({"step": 150, "tier": "persistent"}),
            ),
            ev(
                60.0,
                "launch",
                "attempt_end",
                json!({"start_time": 40.5, "end_time": 60.0, "first_advance_time": 41.0,
                       "last_advance_time": 59.0, "classification": "success", "last_progress": 300}),
            ),
        ];
        let l = ledger(&events);
        assert_eq!(l.faults.len(), 3);
        let per_fault: f64 = l.faults.iter().map(|f| f.lost_s.unwrap()).sum();
        assert!(
            (per_fault - l.buckets.lost).abs() < 1e-9,
            "{per_fault} vs {:?}",
            l.buckets
        );
        for (f, a) in l.faults.iter().zip(&l.attempts) {
            assert!((f.lost_s.unwrap() - a.lost_s).abs() < 1e-12, "{f:?}");
            assert!(f.lost_s.unwrap() > 0.0, "{f:?}");
        }
        assert_eq!(
            l.faults.iter().map(|f| f.lost_steps).collect::<Vec<_>>(),
            [Some(7), Some(21), Some(0)]
        );
    }

    #[test]
    fn a_resume_from_a_snapshot_whose_save_was_never_logged_keeps_the_work_before_it() {
        // Attempt 1 reached step 260 (steps 0-260 from 12 to 38); its writer was stopped before
        // it logged a save, but the next attempt resumed from a snapshot of step `resumed`.
        for (resumed, kept) in [(260, 26.0), (130, 13.0)] {
            let events = vec![
                ev(10.5, "train", "start", json!({"step": 0})),
                ev(
                    40.0,
                    "launch",
                    "attempt_end",
                    json!({"start_time": 10.0, "end_time": 40.0, "first_advance_time": 12.0,
                           "last_advance_time": 38.0, "classification": "no-heartbeat",
                           "last_progress": 260, "detect_s": 1.0, "kill_s": 0.5}),
                ),
                ev(41.0, "train", "start", json!({"step": resumed})),
                ev(
                    41.2,
                    "train",
                    "resume",
                    json!({"step": resumed, "tier": "memory"}),
                ),
                ev(
                    50.0,
                    "launch",
                    "attempt_end",
                    json!({"start_time": 40.5, "end_time": 50.0, "first_advance_time": 42.0,
                           "last_advance_time": 49.9, "classification": "success", "last_progress": 300}),
                ),
            ];
            let b = ledger(&events).buckets;
            let close = |x: f64, y: f64| (x - y).abs() < 1e-9;
            assert!(close(b.productive, kept + 8.0), "{resumed}: {b:?}");
            assert!(close(b.lost, 26.0 - kept + 0.5), "{resumed}: {b:?}");
            assert!(close(b.detection, 1.5), "{resumed}: {b:?}");
        }
    }

    #[test]
    fn a_run_without_launch_counts_trainer_sessions() {
        let events = vec![
            ev(0.0, "train", "start", json!({"step": 0})),
            ev(
                9.0,
                "train",
                "checkpoint_saved",
                json!({"step": 10, "seconds": 0.5}),
            ),
            ev(10.0, "train", "exit", json!({"code": 0, "step": 10})),
        ];
        let l = ledger(&events);
        assert_eq!(l.buckets.productive, 9.5);
        assert_eq!(l.buckets.checkpoint, 0.5);
    }
}

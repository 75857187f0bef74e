//! The default limit of the stall watchdog (no `--stall-timeout`): a multiple of the step time
//! the ranks' beacons show, instead of a fixed number of seconds, so that a fast run's hang is
//! caught in seconds and a slow run's long steps are never taken for one.
//!
//! The limit is `max(STALL_FLOOR, STALL_FACTOR x the slowest recent step)`, where a step time
//! is the time between two beacon reads that saw a rank advance, divided by the steps it
//! advanced; "recent" is each rank's last [`RECENT`] such samples. A rank's first advance of
//! an attempt (its first step: warm-up, compilation) is not a sample, so the watchdog is armed
//! from the second one. Phases between steps ([`kiln_run::event::beacon_phase::OUTSIDE_STEPS`]:
//! eval, checkpoint) are timed by their own longest duration seen in this attempt times the same
//! factor; while a rank is in such a phase for the first time, the default does not fire (only
//! an explicit `--stall-timeout`, `--timeout` or the heartbeats do). Only beacon-reporting
//! ranks are timed: progress scraped from output says nothing of evals or saves.

use kiln_run::Beacon;
use kiln_run::event::beacon_phase;
use std::collections::{BTreeMap, VecDeque};
use std::time::{Duration, Instant};

/// The default limit is this many times the slowest recent step (or between-step phase).
pub const STALL_FACTOR: f64 = 10.0;

/// The default limit is never shorter than this: scheduling noise on a busy node, a page-cache
/// miss, a slow collective must not kill a fast run.
pub const STALL_FLOOR: Duration = Duration::from_secs(3);

/// The startup watchdog's default limit is this many times the slowest startup (attempt
/// start to first advance) of the launch's earlier attempts...
pub const STARTUP_FACTOR: f64 = 10.0;

/// ... and never shorter than this.
pub const STARTUP_FLOOR: Duration = Duration::from_secs(10);

/// The default startup limit of an attempt, from the slowest startup (seconds) of the
/// launch's earlier attempts that reached a step: `None` before any did (a first start may
/// index data or compile for minutes; nothing says how long is too long yet).
pub fn startup_limit(slowest: Option<f64>) -> Option<Duration> {
    let s = slowest.filter(|s| s.is_finite() && *s >= 0.0)?;
    Some(Duration::from_secs_f64((STARTUP_FACTOR * s).min(1e9)).max(STARTUP_FLOOR))
}

/// The slowest startup (attempt start to first advance, seconds) among the attempts in
/// `events` (a run directory's `attempt_end` events) that reached a step.
pub fn slowest_startup(events: &[kiln_run::Event]) -> Option<f64> {
    let num = |e: &kiln_run::Event, k: &str| e.fields.get(k).and_then(serde_json::Value::as_f64);
    events
        .iter()
        .filter(|e| e.event == kiln_run::event::ATTEMPT_END)
        .filter_map(|e| Some(num(e, "first_advance_time")? - num(e, "start_time")?))
        .filter(|s| s.is_finite() && *s >= 0.0)
        .reduce(f64::max)
}

/// Step-time samples kept per rank.
pub const RECENT: usize = 32;

/// Step times and between-step phase durations of one attempt, from its beacons.
#[derive(Debug, Default)]
pub struct StepClock {
    ranks: BTreeMap<usize, RankClock>,
    /// The longest time seen in each phase outside the steps, seconds.
    phases: BTreeMap<String, f64>,
}

#[derive(Debug)]
struct RankClock {
    step: u64,
    phase: String,
    /// When the read that saw the last advance happened.
    advanced: Instant,
    /// When the read that saw the current phase begin happened.
    phase_since: Instant,
    /// Advances seen (the first one is the first step, not a sample).
    advances: u64,
    /// Whether the rank stayed in step phases since its last advance.
    clean: bool,
    /// Seconds per step, newest last.
    recent: VecDeque<f64>,
}

fn outside_steps(phase: &str) -> bool {
    beacon_phase::OUTSIDE_STEPS.contains(&phase)
}

fn finished(phase: &str) -> bool {
    beacon_phase::FINISHED.contains(&phase)
}

impl StepClock {
    /// Records the beacons of one read at `now` (beacons older than the attempt, which
    /// started at Unix time `start_time`, are another attempt's and are skipped).
    pub fn observe(&mut self, beacons: &[Beacon], start_time: f64, now: Instant) {
        for b in beacons.iter().filter(|b| b.time + 1.0 >= start_time) {
            self.observe_one(b.rank, b.step, &b.phase, now);
        }
    }

    fn observe_one(&mut self, rank: usize, step: u64, phase: &str, now: Instant) {
        let r = self.ranks.entry(rank).or_insert_with(|| RankClock {
            step,
            phase: phase.to_string(),
            advanced: now,
            phase_since: now,
            advances: 0,
            clean: !outside_steps(phase),
            recent: VecDeque::new(),
        });
        if step > r.step {
            r.advances += 1;
            if r.advances > 1 && r.clean {
                let per_step =
                    now.duration_since(r.advanced).as_secs_f64() / (step - r.step) as f64;
                r.recent.push_back(per_step);
                if r.recent.len() > RECENT {
                    r.recent.pop_front();
                }
            }
            r.step = step;
            r.advanced = now;
            r.clean = true;
        }
        if phase != r.phase {
            if outside_steps(&r.phase) {
                let took = now.duration_since(r.phase_since).as_secs_f64();
                let longest = self.phases.entry(r.phase.clone()).or_insert(0.0);
                *longest = longest.max(took);
            }
            r.phase = phase.to_string();
            r.phase_since = now;
        }
        if outside_steps(phase) {
            r.clean = false;
        }
    }

    /// The default stall limit now, and how it was reached (for the watchdog's message);
    /// `None` while nothing says how long a step (or the phase a rank is in) takes.
    pub fn limit(&self) -> Option<(Duration, String)> {
        let slowest = self
            .ranks
            .values()
            .flat_map(|r| r.recent.iter().copied())
            .fold(None, |m: Option<f64>, s| Some(m.map_or(s, |m| m.max(s))))?;
        let mut limit = STALL_FACTOR * slowest;
        let mut how = format!("{STALL_FACTOR} x slowest recent step {slowest:.3} s");
        for r in self.ranks.values().filter(|r| !finished(&r.phase)) {
            if !outside_steps(&r.phase) {
                continue;
            }
            let longest = *self.phases.get(&r.phase)?;
            if STALL_FACTOR * longest > limit {
                limit = STALL_FACTOR * longest;
                how = format!("{STALL_FACTOR} x longest {} phase {longest:.3} s", r.phase);
            }
        }
        let floor = STALL_FLOOR.as_secs_f64();
        if limit < floor {
            how = format!("floor {floor} s; {how}");
        }
        let limit = Duration::try_from_secs_f64(limit.max(floor)).ok()?;
        Some((limit, format!("default: {how}")))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_startup_limit_is_a_multiple_of_the_slowest_startup_with_a_floor() {
        assert_eq!(startup_limit(None), None);
        assert_eq!(startup_limit(Some(0.4)), Some(STARTUP_FLOOR));
        assert_eq!(startup_limit(Some(3.0)), Some(Duration::from_secs(30)));
        assert_eq!(startup_limit(Some(f64::NAN)), None);
        assert_eq!(startup_limit(Some(-1.0)), None);
        assert!(startup_limit(Some(1e300)).is_some());
    }

    #[test]
    fn the_slowest_startup_of_a_run_directory_counts_attempts_that_reached_a_step() {
        let ev = |name: &str, fields: serde_json::Value| kiln_run::Event {
            time: 0.0,
            source: "launch".into(),
            event: name.into(),
            fields: fields.as_object().cloned().unwrap_or_default(),
        };
        let events = [
            ev(
                "attempt_end",
                serde_json::json!({"start_time": 10.0, "first_advance_time": 12.5}),
            ),
            ev(
                "attempt_end",
                serde_json::json!({"start_time": 20.0, "first_advance_time": null}),
            ),
            ev(
                "attempt_end",
                serde_json::json!({"start_time": 30.0, "first_advance_time": 30.5}),
            ),
            ev(
                "attempt_start",
                serde_json::json!({"start_time": 0.0, "first_advance_time": 99.0}),
            ),
        ];
        assert_eq!(slowest_startup(&events), Some(2.5));
        assert_eq!(slowest_startup(&events[1..2]), None);
    }

    fn at(t0: Instant, s: f64) -> Instant {
        t0 + Duration::from_secs_f64(s)
    }

    #[test]
    fn the_limit_is_a_multiple_of_the_slowest_recent_step_above_a_floor() {
        let t0 = Instant::now();
        let mut c = StepClock::default();
        c.observe_one(0, 0, "train", t0);
        assert!(c.limit().is_none(), "nothing measured yet");
        // The first advance is the first step (warm-up): not a sample.
        c.observe_one(0, 1, "train", at(t0, 30.0));
        assert!(c.limit().is_none());
        // 0.1 s per step: 10 x 0.1 = 1 s, under the floor.
        c.observe_one(0, 5, "train", at(t0, 30.4));
        let (l, how) = c.limit().unwrap();
        assert_eq!(l, STALL_FLOOR);
        assert!(how.contains("floor"), "{how}");
        // A slower step (2 s) raises it to 20 s.
        c.observe_one(0, 6, "train", at(t0, 32.4));
        let (l, how) = c.limit().unwrap();
        assert!((l.as_secs_f64() - 20.0).abs() < 1e-6, "{l:?}");
        assert!(how.contains("slowest recent step 2.000"), "{how}");
        // It is forgotten after RECENT faster samples.
        let mut t = 32.4;
        for s in 7..7 + RECENT as u64 {
            t += 0.5;
            c.observe_one(0, s, "train", at(t0, t));
        }
        assert!((c.limit().unwrap().0.as_secs_f64() - 5.0).abs() < 1e-6);
    }

    #[test]
    fn phases_between_steps_are_timed_by_their_own_longest_duration() {
        let t0 = Instant::now();
        let mut c = StepClock::default();
        c.observe_one(0, 0, "train", t0);
        c.observe_one(0, 1, "train", at(t0, 1.0));
        c.observe_one(0, 2, "train", at(t0, 1.2));
        assert_eq!(c.limit().unwrap().0, STALL_FLOOR);
        // A first eval: nothing says how long one takes, so the default does not fire.
        c.observe_one(0, 2, "eval", at(t0, 1.6));
        assert!(c.limit().is_none());
        c.observe_one(0, 3, "train", at(t0, 9.6));
        // The interval that held the eval is not a step sample.
        assert_eq!(c.limit().unwrap().0, STALL_FLOOR);
        c.observe_one(0, 3, "eval", at(t0, 10.0));
        let (l, how) = c.limit().unwrap();
        assert!((l.as_secs_f64() - 80.0).abs() < 1e-6, "{l:?}");
        assert!(how.contains("longest eval phase"), "{how}");
    }

    #[test]
    fn finished_ranks_and_old_beacons_do_not_count() {
        let t0 = Instant::now();
        let mut c = StepClock::default();
        let b = |step, phase: &str, time| Beacon {
            work_s: None,
            rank: 1,
            step,
            phase: phase.into(),
            time,
            host: None,
        };
        // A beacon of an earlier attempt is ignored.
        c.observe(&[b(50, "train", 10.0)], 100.0, t0);
        assert!(c.ranks.is_empty());
        c.observe(&[b(0, "train", 100.0)], 100.0, t0);
        c.observe(&[b(1, "train", 101.0)], 100.0, at(t0, 1.0));
        c.observe(&[b(2, "train", 101.2)], 100.0, at(t0, 1.2));
        c.observe(&[b(2, "eval", 101.3)], 100.0, at(t0, 1.3));
        assert!(c.limit().is_none());
        c.observe(&[b(2, "done", 101.4)], 100.0, at(t0, 1.4));
        assert!(c.limit().is_some());
    }
}

//! The beacon's waiting mark: a rank's beacon says when it waits on the others. In a hung
//! collective every healthy rank waits at the same step as the one that stopped, so steps
//! alone cannot tell them apart;
//! the phase can. A collective engine marks each blocking call with [`waiting`]: one that
//! lasts longer than [`MARK_AFTER`] rewrites this process's beacon (the one it last wrote
//! with [`crate::write_beacon`]) with the phase [`COLLECTIVE`] at the same step, and when it
//! ends, back to the phase before. The supervisor then names the rank that is not in the
//! collective. Short collectives (nearly all) cost two uncontended locks and never touch a
//! file; a process that wrote no beacon is never marked.

use std::sync::{Mutex, OnceLock};
use std::time::{Duration, Instant};

/// The phase of a rank waiting in a collective (one of
/// [`crate::event::beacon_phase::WAITING`]).
pub const COLLECTIVE: &str = "collective";

/// How long a collective runs before the beacon says so.
pub const MARK_AFTER: Duration = Duration::from_millis(250);

/// How often the marker looks.
const LOOK_EVERY: Duration = Duration::from_millis(50);

/// Rewrites this process's last beacon (same rank, step and work time) with another phase,
/// now; whether it was written. Given by the beacon's writer, so this file needs no part of
/// the beacon format.
pub(crate) type Rewrite = Box<dyn Fn(&str) -> bool + Send>;

/// The beacon this process last wrote.
struct Last {
    phase: String,
    rewrite: Rewrite,
}

/// This process's collectives in flight and whether the beacon says so.
#[derive(Default)]
struct State {
    last: Option<Last>,
    /// Blocking calls in flight (a background thread's included), and since when.
    depth: usize,
    since: Option<Instant>,
    marked: bool,
}

fn state() -> &'static Mutex<State> {
    static STATE: OnceLock<Mutex<State>> = OnceLock::new();
    STATE.get_or_init(|| Mutex::new(State::default()))
}

/// Records the beacon this process wrote (see [`crate::write_beacon`]): its phase and how to
/// rewrite it; a mark in place is replaced by it.
pub(crate) fn wrote(phase: &str, rewrite: Rewrite) {
    wrote_into(state(), phase, rewrite);
}

fn wrote_into(st: &Mutex<State>, phase: &str, rewrite: Rewrite) {
    if let Ok(mut s) = st.lock() {
        s.last = Some(Last {
            phase: phase.to_string(),
            rewrite,
        });
        s.marked = false;
    }
}

/// A blocking collective in flight; see the module documentation. Dropping it ends it.
#[derive(Debug)]
#[must_use = "the collective is marked while the guard lives"]
pub struct Waiting(());

/// Marks the calling thread's blocking collective until the guard is dropped.
pub fn waiting() -> Waiting {
    if begin(state()) {
        start_marker();
    }
    Waiting(())
}

impl Drop for Waiting {
    fn drop(&mut self) {
        end(state());
    }
}

/// A collective starts; whether there is a beacon to mark.
fn begin(st: &Mutex<State>) -> bool {
    let Ok(mut s) = st.lock() else {
        return false;
    };
    if s.depth == 0 {
        s.since = Some(Instant::now());
    }
    s.depth += 1;
    s.last.is_some()
}

/// A collective ends; the last one in flight takes the mark back.
fn end(st: &Mutex<State>) {
    let Ok(mut s) = st.lock() else {
        return;
    };
    s.depth = s.depth.saturating_sub(1);
    if s.depth > 0 {
        return;
    }
    s.since = None;
    if std::mem::take(&mut s.marked)
        && let Some(l) = &s.last
    {
        (l.rewrite)(&l.phase);
    }
}

/// The thread that writes the mark once a collective lasted [`MARK_AFTER`] (started once).
fn start_marker() {
    static STARTED: OnceLock<()> = OnceLock::new();
    STARTED.get_or_init(|| {
        let _ = std::thread::Builder::new()
            .name("kiln-collective-mark".into())
            .spawn(|| {
                loop {
                    std::thread::sleep(LOOK_EVERY);
                    mark_if_due(state(), Instant::now());
                }
            });
    });
}

/// Writes the mark when a collective has been in flight for [`MARK_AFTER`] at `now`.
fn mark_if_due(st: &Mutex<State>, now: Instant) {
    let Ok(mut s) = st.lock() else {
        return;
    };
    let due = s
        .since
        .is_some_and(|t| now.saturating_duration_since(t) >= MARK_AFTER);
    if !due || s.marked {
        return;
    }
    if let Some(l) = &s.last
        && (l.rewrite)(COLLECTIVE)
    {
        s.marked = true;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// On a state of its own (the process's is shared by every test): a short collective
    /// leaves the beacon alone, a long one is marked at the same step and unmarked when it
    /// ends, nested calls end with the outermost, and a beacon written meanwhile (the next
    /// step) wins.
    #[test]
    fn a_long_collective_marks_the_beacon_and_its_end_restores_it() {
        let st = Mutex::new(State::default());
        let dir = tempfile::tempdir().unwrap();
        let read = || {
            let b = crate::beacon::read_beacons(dir.path())[0].clone();
            (b.rank, b.step, b.phase)
        };
        let write = |step, phase: &str| {
            let at = dir.path().to_path_buf();
            let rewrite = move |p: &str| crate::beacon::write_beacon(&at, 3, step, p, 0.0).is_ok();
            assert!(rewrite(phase));
            wrote_into(&st, phase, Box::new(rewrite));
        };
        assert!(!begin(&st), "no beacon yet: nothing to mark");
        end(&st);
        write(41, "train");
        assert!(begin(&st));
        let t0 = Instant::now();
        mark_if_due(&st, t0);
        end(&st);
        assert_eq!(read(), (3, 41, "train".into()), "a short one is not marked");
        begin(&st);
        begin(&st);
        mark_if_due(&st, Instant::now() + MARK_AFTER);
        assert_eq!(read(), (3, 41, COLLECTIVE.into()));
        end(&st);
        assert_eq!(
            read(),
            (3, 41, COLLECTIVE.into()),
            "the outer one is in flight"
        );
        end(&st);
        assert_eq!(read(), (3, 41, "train".into()));
        begin(&st);
        mark_if_due(&st, Instant::now() + MARK_AFTER);
        write(42, "eval");
        end(&st);
        assert_eq!(read(), (3, 42, "eval".into()));
    }
}

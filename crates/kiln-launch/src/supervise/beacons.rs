//! Per-rank progress from beacon files (`$KILN_PROGRESS_DIR/rank-<R>`): the step, phase and
//! host each rank last reported, when it last advanced, and when any beacon last changed.

use super::cadence::{BEACON_EVERY, Cadence};
use kiln_run::Beacon;
use std::collections::BTreeMap;
use std::time::Instant;

/// What one rank's beacon said.
pub(super) struct Tracked {
    pub(super) step: u64,
    pub(super) first_step: u64,
    pub(super) phase: String,
    pub(super) host: Option<String>,
    pub(super) last_advance: Instant,
}

impl Tracked {
    /// The rank waits on the others (in a collective).
    pub(super) fn waiting(&self) -> bool {
        kiln_run::event::beacon_phase::WAITING.contains(&self.phase.as_str())
    }

    /// The rank finished: it is not stalled.
    pub(super) fn finished(&self) -> bool {
        kiln_run::event::beacon_phase::FINISHED.contains(&self.phase.as_str())
    }
}

/// The beacons of an attempt's ranks.
pub(super) struct Beacons {
    pub(super) ranks: BTreeMap<usize, Tracked>,
    /// When a beacon last changed (a rank advanced, appeared or changed phase).
    pub(super) last_change: Instant,
    cadence: Cadence,
}

impl Beacons {
    pub(super) fn new(start: Instant) -> Self {
        Beacons {
            ranks: BTreeMap::new(),
            last_change: start,
            cadence: Cadence::new(BEACON_EVERY),
        }
    }

    /// Whether the beacons are due to be read at `now` (every [`BEACON_EVERY`]).
    pub(super) fn due(&mut self, now: Instant) -> bool {
        self.cadence.due(now)
    }

    /// Merges fresh beacons; returns whether a rank advanced. A beacon's first step is where
    /// the rank started, not progress. Beacons older than the attempt are another attempt's
    /// and are ignored.
    pub(super) fn update(&mut self, fresh: Vec<Beacon>, start_time: f64, now: Instant) -> bool {
        let (mut changed, mut advanced) = (false, false);
        for b in fresh.into_iter().filter(|b| b.time + 1.0 >= start_time) {
            let Some(t) = self.ranks.get_mut(&b.rank) else {
                let first = Tracked {
                    step: b.step,
                    first_step: b.step,
                    phase: b.phase,
                    host: b.host,
                    last_advance: now,
                };
                self.ranks.insert(b.rank, first);
                changed = true;
                continue;
            };
            if b.step > t.step {
                t.step = b.step;
                t.last_advance = now;
                changed = true;
                advanced = true;
            }
            if b.phase != t.phase {
                t.phase = b.phase;
                changed = true;
            }
            if b.host.is_some() {
                t.host = b.host;
            }
        }
        if changed {
            self.last_change = now;
        }
        advanced
    }
}

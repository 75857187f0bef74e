//! How often the watch loop looks at each thing: the tick that bounds detection latency, and
//! the slower cadences of the reads of the progress directory.

use std::time::{Duration, Instant};

/// How often the loop checks children, signals and watchdogs: bounds detection latency.
pub(super) const TICK: Duration = Duration::from_millis(25);
/// How often beacon files (and liveness records) are read.
pub(super) const BEACON_EVERY: Duration = Duration::from_millis(200);
/// How often the progress directory is read for lost and exit records.
pub(super) const LIVENESS_EVERY: Duration = Duration::from_millis(100);

/// Something done at most once per period, the first time at once.
pub(super) struct Cadence {
    every: Duration,
    last: Option<Instant>,
}

impl Cadence {
    pub(super) fn new(every: Duration) -> Self {
        Cadence { every, last: None }
    }

    /// Whether it is due at `now`; if so, the period starts again from `now`.
    pub(super) fn due(&mut self, now: Instant) -> bool {
        let due = self
            .last
            .is_none_or(|t| now.duration_since(t) >= self.every);
        if due {
            self.last = Some(now);
        }
        due
    }
}

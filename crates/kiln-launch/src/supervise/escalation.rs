//! Kill escalation: SIGTERM to every process group of the attempt now, SIGKILL once the grace
//! period is over and something is still left.

use crate::groups::kill_groups;
use nix::sys::signal::Signal;
use nix::unistd::Pid;
use std::time::{Duration, Instant};

/// When the attempt's processes get SIGKILL, if they are still there.
pub(super) struct Escalation {
    grace: Duration,
    kill_at: Option<Instant>,
}

impl Escalation {
    pub(super) fn new(grace: Duration) -> Self {
        Escalation {
            grace,
            kill_at: None,
        }
    }

    /// SIGTERM to every group now; SIGKILL after `grace` (shorter than the attempt's after a
    /// lost rank, see [`crate::groups::grace_after_loss`]).
    pub(super) fn terminate_within(&mut self, groups: &[Pid], now: Instant, grace: Duration) {
        kill_groups(groups, Signal::SIGTERM);
        self.kill_at = Some(now + grace);
    }

    /// SIGKILL when the grace period is over (the stop was delivered some other way).
    pub(super) fn arm(&mut self, now: Instant) {
        self.kill_at = Some(now + self.grace);
    }

    /// Whether a SIGKILL is scheduled.
    pub(super) fn armed(&self) -> bool {
        self.kill_at.is_some()
    }

    /// Sends the scheduled SIGKILL once it is due; whether it did.
    pub(super) fn tick(&mut self, groups: &[Pid], now: Instant) -> bool {
        let due = self.kill_at.is_some_and(|at| now >= at);
        if due {
            kill_groups(groups, Signal::SIGKILL);
            self.kill_at = None;
        }
        due
    }
}

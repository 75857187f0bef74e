//! The watch loop of one attempt: every tick it takes the exits, and asks each handler in turn
//! (a stop kiln received, the walltime, the progress directory, liveness, the watchdogs)
//! whether the attempt must end; the first [`Verdict`] stops the ranks (SIGTERM, then SIGKILL
//! after the grace period, see [`Escalation`]). It returns once every process exited.

use super::beacons::Beacons;
use super::cadence::TICK;
use super::config::AttemptConfig;
use super::escalation::Escalation;
use super::exits::{Ours, ranks_already_exited};
use super::liveness::{LiveRanks, lost_verdict};
use super::outcome::Verdict;
use super::output::Shared;
use super::spawn::Running;
use super::watchdog::watchdog;
use crate::classify::Classification;
use crate::groups::{grace_after_loss, kill_groups};
use crate::signals::StopRequest;
use nix::sys::signal::Signal;
use std::os::unix::process::ExitStatusExt;
use std::process::ExitStatus;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// One running attempt, as the loop and its handlers see it.
pub(super) struct Attempt<'a> {
    pub(super) cfg: &'a AttemptConfig,
    pub(super) running: &'a Running,
    pub(super) shared: &'a Arc<Mutex<Shared>>,
    /// Signals kiln received (see [`crate::stop_requested`]).
    pub(super) stop: &'a dyn Fn() -> Option<StopRequest>,
    /// The attempt's start, in both clocks.
    pub(super) start: Instant,
    pub(super) start_time: f64,
}

impl Attempt<'_> {
    /// Which of the ranks' records are this attempt's.
    pub(super) fn ours(&self) -> Ours<'_> {
        Ours {
            token: self.cfg.attempt.as_deref(),
            start_time: self.start_time,
        }
    }
}

/// The supervision state of one attempt.
pub(super) struct Watch {
    pub(super) statuses: Vec<Option<ExitStatus>>,
    /// Exits received but not yet taken.
    pending: Vec<(usize, ExitStatus, Instant)>,
    pub(super) first_failure: Option<usize>,
    /// Seconds from the first failing rank's exit to kiln stopping the others.
    pub(super) failure_detect_s: Option<f64>,
    /// When the last process exited.
    pub(super) ended: Option<Instant>,
    pub(super) verdict: Option<Verdict>,
    /// The first stop signal kiln forwarded.
    pub(super) stop_signal: Option<i32>,
    handled_stops: u32,
    pub(super) beacons: Beacons,
    live: LiveRanks,
    kill: Escalation,
    /// Step times from the beacons: the stall watchdog's default limit.
    steps: crate::stall::StepClock,
    /// Work times from the beacons: ranks slower than their peers.
    stragglers: crate::straggler::StragglerWatch,
    /// A straggler named while [`AttemptConfig::straggler_ends_attempt`], not yet acted on.
    straggler: Option<crate::straggler::Straggler>,
}

impl Watch {
    /// Stop requests counted up to `handled_stops` arrived before this attempt (during
    /// backoff): they are the caller's to handle; only new ones count here.
    pub(super) fn new(a: &Attempt<'_>, handled_stops: u32) -> Self {
        Watch {
            statuses: vec![None; a.running.ranks.len()],
            pending: Vec::new(),
            first_failure: None,
            failure_detect_s: None,
            ended: None,
            verdict: None,
            stop_signal: None,
            handled_stops,
            beacons: Beacons::new(a.start),
            live: LiveRanks::new(),
            kill: Escalation::new(a.cfg.grace),
            steps: crate::stall::StepClock::default(),
            stragglers: crate::straggler::StragglerWatch::costing(a.cfg.straggler_cost),
            straggler: None,
        }
    }

    /// Watches until every process exited, acting on failures, stops, the walltime and
    /// the watchdogs.
    pub(super) fn run(&mut self, a: &Attempt<'_>) {
        loop {
            let now = Instant::now();
            self.take_exits(a, now);
            if self.statuses.iter().all(Option::is_some) {
                self.last_look(a, now);
                return;
            }
            let stopped = self.stop_request(a, now);
            self.verdict = self.verdict.take().or(stopped);
            let walltime = self.walltime(a, now);
            self.stop_ranks(a, walltime, now);
            self.read_progress_dir(a, now);
            let hung = self.liveness(a, now).or_else(|| self.watchdog(a, now));
            self.stop_ranks(a, hung, now);
            let slow = self.straggler_verdict(a, now);
            self.stop_ranks(a, slow, now);
            if self.kill.tick(&a.running.groups, now) {
                // SIGKILL reached the launcher (srun, mpirun); ranks on other nodes, blocked
                // in a collective and deaf to SIGTERM, would outlive it until the scheduler's
                // own clean-up (Slurm's KillWait, 30 s by default) and hold the run
                // directory's lock against the next attempt: their shims kill them now.
                deliver_through_shims(a, Signal::SIGKILL);
            }
            self.pending
                .extend(a.running.exit_rx.recv_timeout(TICK).ok());
        }
    }

    /// Ends the attempt for `verdict`, if there is one: SIGTERM now, SIGKILL after the grace.
    /// After a lost rank (silent, or killed by a signal) the others are likely blocked in a
    /// collective and ignore SIGTERM: they get at most a short grace.
    ///
    /// After a rank *exited with a code*, a launcher such as mpirun is already ending the job
    /// on its own, and OpenMPI's mpirun segfaults (in `PMIx_Finalize`) when a SIGTERM reaches
    /// it mid-abort: every rank failure printed its backtrace. There the ranks' shims deliver
    /// the SIGTERM and the launcher is left alone until the SIGKILL after the grace.
    ///
    /// A straggler's ranks are healthy and are to checkpoint before the attempt ends; srun,
    /// sent SIGTERM, kills its step at once ("forcing job termination": SIGKILL to every
    /// task), which lost that checkpoint whenever a rank took more than a few milliseconds
    /// to save. There too the shims deliver the SIGTERM.
    fn stop_ranks(&mut self, a: &Attempt<'_>, verdict: Option<Verdict>, now: Instant) {
        if let Some(v) = verdict {
            let by_shims = v.classification.is_from_exit_code()
                || v.classification == Classification::Straggler;
            if by_shims && deliver_through_shims(a, Signal::SIGTERM) {
                self.kill.arm(now);
            } else {
                let grace = verdict_grace(a.cfg, &v);
                self.kill.terminate_within(&a.running.groups, now, grace);
            }
            self.verdict = Some(v);
        }
    }

    /// Whether a handler may still end the attempt: nothing decided, no rank failed.
    fn undecided(&self) -> bool {
        self.verdict.is_none() && self.first_failure.is_none()
    }

    /// Records the processes that exited. One dead rank leaves the rest blocked in a
    /// collective: the first failure stops them all.
    fn take_exits(&mut self, a: &Attempt<'_>, now: Instant) {
        self.pending.extend(a.running.exit_rx.try_iter());
        for (i, status, at) in std::mem::take(&mut self.pending) {
            self.statuses[i] = Some(status);
            if !status.success() && self.first_failure.is_none() {
                self.first_failure = Some(i);
                self.failure_detect_s = Some(now.saturating_duration_since(at).as_secs_f64());
                if self.statuses.iter().any(Option::is_none) && !self.kill.armed() {
                    let grace = grace_after_loss(a.cfg.grace, status.signal().is_some());
                    self.kill.terminate_within(&a.running.groups, now, grace);
                }
            }
        }
    }

    /// Every process exited. The launcher may have ended the job before the lost record was
    /// read: read it now.
    fn last_look(&mut self, a: &Attempt<'_>, now: Instant) {
        self.ended = Some(now);
        if self.verdict.is_none()
            && let (Some(r), Some(bound)) = (a.cfg.reports(), a.cfg.heartbeat_timeout)
        {
            self.verdict = lost_verdict(r.files(), bound, a.ours(), now);
        }
    }

    /// A new stop request: the first is forwarded to the ranks (with SIGKILL after the
    /// grace) and decides the ending; a second one (Ctrl-C twice) means "now".
    fn stop_request(&mut self, a: &Attempt<'_>, now: Instant) -> Option<Verdict> {
        let req = (a.stop)().filter(|r| r.count > self.handled_stops)?;
        self.handled_stops = req.count;
        if self.stop_signal.is_some() {
            kill_groups(&a.running.groups, Signal::SIGKILL);
            return None;
        }
        self.stop_signal = Some(req.signal);
        let sig = Signal::try_from(req.signal).unwrap_or(Signal::SIGTERM);
        tracing::info!("forwarding {sig} to the ranks");
        forward_stop(a, sig);
        self.kill.arm(now);
        let classification = if req.signal == libc::SIGUSR1 {
            Classification::Walltime
        } else {
            Classification::Interrupted
        };
        Some(Verdict {
            classification,
            at: now,
            detect_s: None,
            culprits: Vec::new(),
            culprit_source: None,
            message: Some(format!(
                "kiln received {sig}: forwarded it to the ranks; not retrying"
            )),
            exit_code: None,
        })
    }

    /// The walltime (`AttemptConfig::deadline`) is over: stop so the ranks can checkpoint.
    fn walltime(&self, a: &Attempt<'_>, now: Instant) -> Option<Verdict> {
        if self.verdict.is_some() || a.cfg.deadline.is_none_or(|d| now < d) {
            return None;
        }
        Some(Verdict {
            classification: Classification::Walltime,
            at: now,
            detect_s: None,
            culprits: Vec::new(),
            culprit_source: None,
            message: Some("walltime reached: sent SIGTERM so the ranks can checkpoint".into()),
            exit_code: None,
        })
    }

    /// Reads beacons (progress) and liveness records, every [`super::cadence::BEACON_EVERY`].
    fn read_progress_dir(&mut self, a: &Attempt<'_>, now: Instant) {
        let Some(reports) = a.cfg.reports() else {
            return;
        };
        if !self.beacons.due(now) {
            return;
        }
        let fresh = kiln_run::read_beacons(reports.files());
        for s in self.stragglers.observe(&fresh, a.start_time) {
            crate::straggler::report(a.cfg.echo, &a.cfg.log_path, &s);
            if a.cfg.straggler_ends_attempt {
                self.straggler.get_or_insert(s);
            }
        }
        self.steps.observe(&fresh, a.start_time, now);
        let advanced = (self.beacons).update(fresh, a.start_time, now);
        if advanced && let Ok(mut s) = a.shared.lock() {
            s.advanced(now);
        }
        self.live.sample(reports.files(), a.running, a.ours(), now);
    }

    /// A rank that is gone or fell silent (see [`LiveRanks::verdict`]).
    fn liveness(&mut self, a: &Attempt<'_>, now: Instant) -> Option<Verdict> {
        if !self.undecided() {
            return None;
        }
        let v = (self.live).verdict(a.cfg, a.running, &self.statuses, a.ours(), now)?;
        announce(a.cfg, &v);
        Some(v)
    }

    /// A straggler named under `--straggler-is-node-failure`: the ranks are stopped as at the
    /// walltime (SIGTERM: they checkpoint), its rank named for the retry loop to swap its host.
    fn straggler_verdict(&mut self, a: &Attempt<'_>, now: Instant) -> Option<Verdict> {
        if !self.undecided() {
            return None;
        }
        let s = self.straggler.take()?;
        let v = Verdict {
            classification: Classification::Straggler,
            at: now,
            detect_s: None,
            culprits: vec![s.rank],
            culprit_source: Some(super::source::BEACON),
            message: Some(format!(
                "rank {} is a straggler ({:.2} x its peers' work per step): ending the attempt to go on without its host",
                s.rank, s.ratio
            )),
            exit_code: None,
        };
        announce(a.cfg, &v);
        Some(v)
    }

    /// The silence and stall watchdogs, unless every rank already exited on its own.
    fn watchdog(&self, a: &Attempt<'_>, now: Instant) -> Option<Verdict> {
        if !self.undecided() {
            return None;
        }
        let v = watchdog(
            a.cfg,
            a.shared,
            (&self.beacons, &self.live.ranks),
            &self.steps,
            (a.start, now),
        )?;
        let v = ranks_already_exited(a.cfg, a.ours()).unwrap_or(v);
        announce(a.cfg, &v);
        Some(v)
    }
}

/// Delivers a stop signal kiln received to the ranks. Under a launcher whose ranks run the
/// `--as-rank` shim, the shims deliver it (see [`kiln_run::write_stop_request`]); the launcher
/// is not signalled, because it would kill ranks that are still checkpointing. Otherwise the
/// process groups get it.
fn forward_stop(a: &Attempt<'_>, sig: Signal) {
    if !deliver_through_shims(a, sig) {
        kill_groups(&a.running.groups, sig);
    }
}

/// Under a launcher whose ranks run the `--as-rank` shim, asks every shim to send `sig` to
/// its rank (a newer request supersedes an older one); whether it could.
fn deliver_through_shims(a: &Attempt<'_>, sig: Signal) -> bool {
    let shimmed = a.cfg.rank_shims && a.running.ranks.iter().all(Option::is_none);
    let (true, Some(reports)) = (shimmed, a.cfg.reports()) else {
        return false;
    };
    match reports.request_stop(sig as i32, a.cfg.attempt.as_deref()) {
        Ok(()) => true,
        Err(e) => {
            tracing::warn!("{e}: signalling the launcher instead");
            false
        }
    }
}

/// The grace the others get after `v`: short when a rank was lost (see
/// [`grace_after_loss`]).
fn verdict_grace(cfg: &AttemptConfig, v: &Verdict) -> Duration {
    let lost = matches!(
        v.classification,
        Classification::NoHeartbeat | Classification::Signaled
    );
    grace_after_loss(cfg.grace, lost)
}

/// Says a verdict now, not after the grace period: the operator watching wants to know.
fn announce(cfg: &AttemptConfig, v: &Verdict) {
    if cfg.echo
        && let Some(m) = &v.message
    {
        eprintln!(
            "kiln: {m}; stopping the ranks (SIGTERM, SIGKILL after {:.1} s)",
            verdict_grace(cfg, v).as_secs_f64()
        );
    }
}

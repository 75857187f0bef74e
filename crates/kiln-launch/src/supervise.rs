//! One attempt: start the processes (each in its own process group, stdout on a pty),
//! capture and tee their output, watch for silence, stalled progress and lost heartbeats,
//! and kill whole process trees. [`run_attempt`] is the attempt from start to end; each
//! concern is a module of its own:
//! - [`config`] what to run and how to watch it, [`outcome`] how it ended;
//! - [`spawn`] starting the processes, [`output`] reading, teeing and scanning their output;
//! - [`watch`] the loop, a tick over small handlers that judge by [`beacons`], [`liveness`],
//!   the [`watchdog`]s and the ranks' [`exits`]; [`escalation`] SIGTERM, grace, SIGKILL;
//! - [`ending`] the outcome from what the loop saw.

mod beacons;
mod cadence;
mod config;
mod ending;
mod escalation;
mod exits;
mod liveness;
mod outcome;
mod output;
mod reports;
mod spawn;
mod watch;
mod watchdog;

pub use config::{AttemptConfig, SuperviseError};
pub use outcome::{AttemptOutcome, RankProgress, source};

use crate::signals::StopRequest;
use kiln_run::unix_time;
use output::Shared;
use std::fs::File;
use std::io::Write;
use std::sync::{Arc, Mutex};
use std::time::Instant;
use watch::{Attempt, Watch};

/// Runs one attempt to the end. `stop` reports signals kiln received (see
/// [`crate::stop_requested`]); they are forwarded to every process group.
pub fn run_attempt(
    cfg: &AttemptConfig,
    stop: &dyn Fn() -> Option<StopRequest>,
) -> Result<AttemptOutcome, SuperviseError> {
    let start = Instant::now();
    let start_time = unix_time();
    let log = File::create(&cfg.log_path).map_err(|source| SuperviseError::Log {
        path: cfg.log_path.clone(),
        source,
    })?;
    let log = Arc::new(Mutex::new(log));
    if let Some(r) = cfg.reports() {
        r.begin(cfg);
    }
    let handled_stops = stop().map_or(0, |s| s.count);
    let shared = Arc::new(Mutex::new(Shared::started(start)));
    let running = match spawn::start_all(cfg, &log, &shared) {
        Ok(r) => r,
        Err(outcome) => return Ok(*outcome),
    };
    let attempt = Attempt {
        cfg,
        running: &running,
        shared: &shared,
        stop,
        start,
        start_time,
    };
    let mut w = Watch::new(&attempt, handled_stops);
    w.run(&attempt);
    running.finish(cfg);
    if let Ok(mut f) = log.lock() {
        let _ = f.flush();
    }
    Ok(w.outcome(&attempt))
}

//! What one attempt runs and how it is watched ([`AttemptConfig`]), and the errors that keep
//! kiln from supervising it at all ([`SuperviseError`]).

use crate::plan::ProcSpec;
use crate::progress::ProgressRegex;
use std::path::PathBuf;
use std::time::{Duration, Instant};

/// How to run and watch one attempt.
#[derive(Debug, Clone)]
pub struct AttemptConfig {
    /// The processes to start.
    pub procs: Vec<ProcSpec>,
    /// Where the raw output of all processes is teed (`RUN_DIR/attempt-<i>.log`).
    pub log_path: PathBuf,
    /// `--timeout`: kill after this long with no output and no beacon update.
    pub silence_timeout: Option<Duration>,
    /// `--stall-timeout`: kill after this long without progress, once progress was seen.
    pub stall_timeout: Option<Duration>,
    /// Without `stall_timeout`, stop progress stalls after a multiple of the observed step
    /// time of the beacon-reporting ranks (see [`crate::stall`]).
    pub stall_auto: bool,
    /// Progress regex over output lines (`None`: beacons only).
    pub progress_regex: Option<ProgressRegex>,
    /// Beacon directory (`$KILN_PROGRESS_DIR`).
    pub progress_dir: Option<PathBuf>,
    /// Remove stale beacons and exit records from `progress_dir` before starting.
    pub clear_progress_dir: bool,
    /// The control plane's server (`--control-plane tcp`): the ranks report to it through
    /// their node agents instead of into `progress_dir` (see [`crate::plane`]).
    pub plane: Option<std::sync::Arc<crate::plane::server::Server>>,
    /// This attempt's token, exported to its ranks as [`kiln_run::ATTEMPT_ENV`]: the rank
    /// shims' records that carry another token are an earlier attempt's (`None`: records
    /// are told apart by their time only).
    pub attempt: Option<String>,
    /// Time between SIGTERM and SIGKILL.
    pub grace: Duration,
    /// Walltime: stop (SIGTERM, grace, SIGKILL) at this instant.
    pub deadline: Option<Instant>,
    /// Pass output through to kiln's stdout/stderr.
    pub echo: bool,
    /// Kill and reap processes that escaped the process group and were re-parented to kiln
    /// (needs [`crate::become_subreaper`]; only for a process that owns all its children,
    /// i.e. the CLI).
    pub reap_orphans: bool,
    /// Give each process a pseudo-terminal as stdout, so that it flushes every line (falls
    /// back to a pipe where no pty can be opened).
    pub stdout_pty: bool,
    /// Ranks the attempt runs; when every one of them has left an exit record
    /// (`kiln launch --as-rank` writes them) the attempt is classified by those exits even if
    /// the launcher still runs.
    pub expected_ranks: Option<usize>,
    /// Each rank of a launcher runs under `kiln launch --as-rank`, which carries kiln's stop
    /// request to its rank (see [`kiln_run::write_stop_request`]).
    pub rank_shims: bool,
    /// `--heartbeat-timeout`: a rank that beat and then fell silent this long is killed and
    /// ends the attempt (see [`kiln_run::Heartbeat`]); `None`: heartbeats are not watched.
    pub heartbeat_timeout: Option<Duration>,
    /// A rank named a straggler ends the attempt (`--straggler-is-node-failure`): see
    /// [`crate::straggler`].
    pub straggler_ends_attempt: bool,
    /// The share of the job's speed a rank must cost it to be named a straggler
    /// (`--straggler-cost`, [`crate::straggler::COST`] by default).
    pub straggler_cost: f64,
    /// Startup watchdog: kill when no rank advanced this long after the attempt started (a
    /// wire-up or launch that hangs before the first step); set per attempt by the retry
    /// loop (see [`crate::stall::startup_limit`]); `None`: off.
    pub startup_timeout: Option<Duration>,
    /// Without `--startup-timeout`, the retry loop sets `startup_timeout` from the launch's
    /// earlier startups.
    pub startup_auto: bool,
}

/// Errors that prevent supervising at all (not failures of the program).
#[derive(Debug, thiserror::Error)]
pub enum SuperviseError {
    /// The attempt log could not be created.
    #[error("attempt log {path}: {source}")]
    Log {
        /// The file.
        path: PathBuf,
        /// The cause.
        source: std::io::Error,
    },
}

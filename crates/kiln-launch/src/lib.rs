//! Builds launcher argv (mpiexec, srun, mpirun, local) and supervises attempts: output
//! capture, watchdogs, process-group kill, retries.
//!
//! Layers, each usable alone: [`prepare`] (flags + environment -> processes to start),
//! [`run_attempt`] (start, watch and end one attempt), [`run_with_retries`] (the retry loop
//! writing `events.jsonl`).

mod classify;
mod plan;
mod probe;
mod progress;
mod retry;
mod setup;
mod shim;
mod signals;
mod supervise;

pub use classify::{
    Classification, NOT_EXECUTABLE_EXIT, NOT_FOUND_EXIT, WALLTIME_EXIT, WATCHDOG_EXIT,
    classify_exit, exit_code_of,
};
pub use plan::{
    Launcher, PlanError, PlanRequest, ProcSpec, SizeRequest, Sizes, build_plan, resolve_sizes,
};
pub use probe::{find_in_path, probe_tool};
pub use progress::{DEFAULT_PROGRESS_REGEX, LineSplitter, ProgressRegex, strip_ansi};
pub use retry::{
    AUTO_RETRY_NO_PROGRESS, Backoff, LaunchResult, RetryConfig, RetryLimit, outcome_json,
    run_with_retries,
};
pub use setup::{LaunchOptions, Setup, SetupError, prepare};
pub use shim::{ShimError, exec_as_rank, free_port, running_as_root};
pub use signals::{StopRequest, install_stop_handlers, stop_requested};
pub use supervise::{
    AttemptConfig, AttemptOutcome, RankProgress, SuperviseError, become_subreaper, run_attempt,
};

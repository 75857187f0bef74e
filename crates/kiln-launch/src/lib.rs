//! Launch and recovery: builds launcher argv (mpiexec, srun, mpirun, local), supervises
//! attempts (output capture, watchdogs, process-group kill), and recovers them at process
//! scope (retry), node scope (name the culprit host, swap a spare, quarantine) and job scope
//! (batch scripts that stop before the walltime and chain).
//!
//! Layers, each usable alone: [`prepare`] (flags + environment -> processes to start),
//! [`run_attempt`] (start, watch and end one attempt), [`run_with_retries`] (the recovery
//! loop writing `events.jsonl`), [`launch`] (all of `kiln launch`), [`submit()`] (`kiln submit`).

mod backoff;
mod classify;
mod culprit;
mod dry_run;
mod flags;
mod groups;
mod health;
mod heartbeat;
mod launch;
mod limits;
mod mpi_shm;
mod plan;
pub mod plane;
mod pool;
mod probe;
mod progress;
mod pty;
mod release;
mod retry;
mod setup;
mod shim;
mod signals;
mod stall;
pub mod straggler;
mod submit;
mod supervise;

pub use backoff::Backoff;
pub use classify::{
    Classification, ENDINGS, EndedAs, Ending, ExitOf, classify_code, classify_exit, exit_code_of,
};
pub use culprit::{
    Cause, Clues, Diagnosis, Evidence, LOG_PATTERNS, LogPattern, diagnose, error_signature,
    scan_log,
};
pub use flags::{TopologyFlags, kiln_flags};
pub use groups::become_subreaper;
pub use health::{HostHealth, NoHealth, PbsHealth, SlurmHealth, slurm_bad_nodes, slurm_job_nodes};
pub use launch::{
    LaunchEnd, LaunchError, LaunchRequest, default_run_dir, launch, local_cpus, split_command,
};
pub use limits::seconds as limits_seconds;
pub use limits::{
    LOCAL_RANKS_MIN, LOCAL_RANKS_PER_CPU, MAX_LOCAL_RANKS, MAX_PER_NODE, MAX_RANKS, MAX_SECONDS,
};
pub use plan::{
    Launcher, PlanError, PlanRequest, ProcSpec, SizeRequest, Sizes, build_plan, resolve_sizes,
};
pub use pool::{
    HostPool, QuarantineEntry, QuarantineError, Replacement, append_quarantine, quarantined_hosts,
    read_quarantine, same_host,
};
pub use probe::{Lookup, find_in_path, lookup_program, probe_tool};
pub use progress::{
    DEFAULT_PROGRESS_REGEX, LineSplitter, MAX_PLAUSIBLE_STEP, ProgressRegex, StepCounter,
    strip_ansi,
};
pub use release::{NodeRelease, release_node};
pub use retry::{
    AUTO_RETRY_NO_PROGRESS, Decision, History, LaunchResult, NodeScope, RetryConfig, RetryLimit,
    decide, outcome_json, run_with_retries,
};
pub use setup::{
    AttemptPlan, DEFAULT_MASTER_PORT, LaunchOptions, Setup, SetupError, default_spares, prepare,
};
pub use shim::{RankExit, ShimError, exit_like, free_port, run_as_rank, running_as_root};
pub use signals::{StopRequest, install_stop_handlers, stop_requested};
pub use stall::{STALL_FACTOR, STALL_FLOOR, StepClock};
pub use submit::{
    BatchScheduler, CHAIN_INDEX_ENV, ChainJob, SubmitError, SubmitRequest, Submitted, batch_script,
    continue_chain, launch_argv, parse_time, shell_quote, shell_quote_bytes, submit, submit_script,
};
pub use supervise::source as evidence_source;
pub use supervise::{AttemptConfig, AttemptOutcome, RankProgress, SuperviseError, run_attempt};

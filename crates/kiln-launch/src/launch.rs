//! `kiln launch` as a library: from the command line's values to a finished launch (run
//! directory, events, the recovery loop, the chain). The CLI only parses flags into a
//! [`LaunchRequest`] and prints what comes back.

use crate::backoff::Backoff;
use crate::culprit::Diagnosis;
pub use crate::flags::LaunchRequest;
use crate::groups::become_subreaper;
use crate::health::{HostHealth, NoHealth, PbsHealth, SlurmHealth};
use crate::plan::Launcher;
use crate::pool::{HostPool, quarantined_hosts};
use crate::probe::{Lookup, lookup_program, probe_tool};
use crate::progress::ProgressRegex;
use crate::retry::{LaunchResult, NodeScope, RetryConfig, RetryLimit, run_with_retries};
use crate::setup::{DEFAULT_MASTER_PORT, LaunchOptions, Setup, prepare};
use crate::shim::{free_port, running_as_root};
use crate::signals::{install_stop_handlers, stop_requested};
use crate::submit::{BatchScheduler, CHAIN_INDEX_ENV, ChainJob, continue_chain};
use crate::supervise::{AttemptConfig, AttemptOutcome};
use crate::{classify::Classification, limits};
use kiln_run::{EventLog, event, exit, layout};
use kiln_topology::Scheduler;
use serde_json::json;
use std::path::PathBuf;
use std::time::{Duration, Instant};

/// Why a launch did not run; each says what to fix.
#[derive(Debug, thiserror::Error)]
pub enum LaunchError {
    /// Bad flags, sizes, hostfile; nothing started (exit 2).
    #[error("{0}")]
    Usage(String),
    /// The program or launcher is missing (127) or not executable (126).
    #[error("{message}")]
    Program {
        /// What is wrong.
        message: String,
        /// 126 or 127.
        code: i32,
    },
    /// The run directory or the event log could not be written (exit 1).
    #[error("{0}")]
    Io(String),
}

impl exit::ExitCoded for LaunchError {
    fn exit_code(&self) -> i32 {
        LaunchError::exit_code(self)
    }
}

impl LaunchError {
    /// The exit code kiln ends with.
    pub fn exit_code(&self) -> i32 {
        match self {
            LaunchError::Usage(_) => exit::USAGE,
            LaunchError::Program { code, .. } => *code,
            LaunchError::Io(_) => exit::FAILURE,
        }
    }
}

/// How a launch ended.
#[derive(Debug)]
pub enum LaunchEnd {
    /// `--dry-run`: what would run, to print.
    DryRun(String),
    /// The launch ran.
    Done {
        /// kiln's exit code.
        exit_code: i32,
        /// How many attempts ran.
        attempts: u32,
        /// The last attempt's classification.
        classification: Classification,
        /// Why recovery stopped early, if it did.
        stop_reason: Option<String>,
        /// The run directory.
        run_dir: PathBuf,
    },
}

/// Splits `[LAUNCHER FLAGS] -- PROGRAM ...`. clap consumed the `--` if nothing came before it;
/// launcher flags always start with `-`, a program never does.
pub fn split_command(args: &[String]) -> Result<(Vec<String>, Vec<String>), String> {
    match args.first() {
        None => Err(
            "no program given: write it after `--`, e.g. `kiln launch -- python train.py`".into(),
        ),
        Some(first) if first.starts_with('-') => {
            let Some(sep) = args.iter().position(|a| a == "--") else {
                return Err(format!(
                    "{first:?} is not a kiln flag, and no `--` follows to mark where the program starts; \
                     write launcher flags, then `--`, then the program"
                ));
            };
            let launcher = args[..sep].to_vec();
            let kiln_flags = crate::flags::kiln_flags();
            if let Some(flag) = launcher.iter().find(|a| {
                let name = a.split('=').next().unwrap_or(a);
                kiln_flags.iter().any(|k| k == name)
            }) {
                return Err(format!(
                    "{flag} is a kiln flag but comes after the launcher flag {first:?}; put kiln's flags first"
                ));
            }
            let command = args[sep + 1..].to_vec();
            if command.is_empty() {
                return Err("no program given after `--`".into());
            }
            Ok((launcher, command))
        }
        Some(_) => Ok((Vec::new(), args.to_vec())),
    }
}

/// `runs/launch-YYYYmmdd-HHMMSS` (UTC), computed without a date crate; `-2`, `-3`, ... when
/// taken.
pub fn default_run_dir() -> PathBuf {
    let secs = kiln_run::unix_time() as i64;
    let (days, rem) = (secs.div_euclid(86_400), secs.rem_euclid(86_400));
    // Howard Hinnant's days-to-civil algorithm.
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    let base = format!(
        "runs/launch-{y:04}{m:02}{d:02}-{:02}{:02}{:02}",
        rem / 3600,
        rem / 60 % 60,
        rem % 60
    );
    let mut dir = PathBuf::from(&base);
    let mut n = 2;
    while dir.exists() {
        dir = PathBuf::from(format!("{base}-{n}"));
        n += 1;
    }
    dir
}

/// Checked durations and patterns of a request.
struct Timing {
    silence: Option<Duration>,
    stall: Option<Duration>,
    stall_auto: bool,
    startup: Option<Duration>,
    startup_auto: bool,
    grace: Duration,
    heartbeat: Duration,
    regex: ProgressRegex,
    backoff: Backoff,
    walltime: Option<Duration>,
    straggler_cost: f64,
}

fn timing(req: &LaunchRequest) -> Result<Timing, String> {
    let opt = |flag: &str, v: Option<f64>| v.map(|s| limits::seconds(flag, s, false)).transpose();
    // --stall-timeout: the default is a multiple of the step time; --startup-timeout: of the
    // launch's earlier startups.
    let (stall, stall_auto) = auto_limit("--stall-timeout", req.stall_timeout)?;
    let (startup, startup_auto) = auto_limit("--startup-timeout", req.startup_timeout)?;
    Ok(Timing {
        silence: opt("--timeout", req.timeout)?,
        stall,
        stall_auto,
        startup,
        startup_auto,
        grace: limits::seconds("--grace", req.grace, true)?,
        heartbeat: limits::seconds("--heartbeat-timeout", req.heartbeat_timeout, false)?,
        regex: ProgressRegex::new(&req.progress_regex)?,
        backoff: Backoff::parse(&req.backoff)?,
        walltime: req
            .walltime
            .as_deref()
            .map(|w| limits::clock_time("--walltime", w))
            .transpose()?,
        straggler_cost: match req.straggler_cost {
            None => crate::straggler::COST,
            Some(c) if c > 0.0 && c < 1.0 => c,
            Some(c) => {
                return Err(format!(
                    "--straggler-cost {c}: must be a share of the job's speed in (0, 1), e.g. 0.25"
                ));
            }
        },
    })
}

/// A watchdog limit whose default is derived from the run: `S` fixes it (`(Some, false)`),
/// 0 turns it off (`(None, false)`), no value leaves it to the default (`(None, true)`).
fn auto_limit(flag: &str, v: Option<f64>) -> Result<(Option<Duration>, bool), String> {
    let fixed = v.map(|s| limits::seconds(flag, s, true)).transpose()?;
    Ok((fixed.filter(|s| !s.is_zero()), fixed.is_none()))
}

fn env_var(k: &str) -> Option<String> {
    std::env::var(k).ok()
}

/// CPUs of this machine.
pub fn local_cpus() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get())
}

/// The quarantine files a launch reads and appends to.
pub(crate) fn quarantine_files(
    run_dir: &std::path::Path,
    shared: &Option<PathBuf>,
) -> Vec<PathBuf> {
    let mut v = vec![run_dir.join(layout::QUARANTINE)];
    v.extend(shared.clone());
    v
}

/// Everything before the first attempt: checks, detection, the plan.
fn set_up(req: &LaunchRequest, dirs: &Dirs) -> Result<(Setup, Vec<String>), LaunchError> {
    let (launcher_args, command) = split_command(&req.command).map_err(LaunchError::Usage)?;
    let files = quarantine_files(&dirs.run, &req.quarantine_file);
    let exclude = quarantined_hosts(&files).map_err(|e| LaunchError::Usage(e.to_string()))?;
    let master_port = req
        .master_port
        .unwrap_or_else(|| free_port().unwrap_or(DEFAULT_MASTER_PORT));
    let opts = LaunchOptions {
        request: LaunchRequest {
            master_port: Some(master_port),
            command: Vec::new(),
            ..req.clone()
        },
        launcher_args,
        command: command.clone(),
        rank_shim: rank_shim(req)?,
        progress_dir: dirs.progress.clone(),
        run_dir: dirs.run.clone(),
        exclude,
        python_unbuffered_set: std::env::var_os("PYTHONUNBUFFERED").is_some(),
    };
    let setup = prepare(
        &opts,
        &env_var,
        &probe_tool,
        local_cpus(),
        running_as_root(),
    )
    .map_err(|e| LaunchError::Usage(e.to_string()))?;
    if let Some(m) = req.min_nodes
        && (m == 0 || m > setup.active.len())
    {
        return Err(LaunchError::Usage(format!(
            "--min-nodes {m}: must be from 1 to the {} active host(s)",
            setup.active.len()
        )));
    }
    Ok((setup, command))
}

/// Variable naming the address the ranks reach this machine's control-plane server at
/// [default: 127.0.0.1 when every rank runs here, else this machine's host name].
pub const PLANE_HOST_ENV: &str = "KILN_PLANE_HOST";

/// Starts the control plane's server under `--control-plane tcp`, when ranks run under a
/// launcher through their shims (a local launch's ranks are kiln's own children: it watches
/// them directly), and tells `setup` to export its address and secret to the ranks.
fn start_plane(
    req: &LaunchRequest,
    setup: &mut Setup,
) -> Result<Option<std::sync::Arc<crate::plane::server::Server>>, LaunchError> {
    use crate::plane::server::Server;
    if req.control_plane != crate::plane::TCP
        || req.no_rank_env
        || setup.launcher == Launcher::Local
    {
        return Ok(None);
    }
    let local = setup.all_local();
    let host = env_var(PLANE_HOST_ENV)
        .filter(|h| !h.trim().is_empty())
        .unwrap_or_else(|| match local {
            true => "127.0.0.1".into(),
            false => kiln_run::host_name(),
        });
    let bind: std::net::IpAddr = match local {
        true => std::net::Ipv4Addr::LOCALHOST.into(),
        false => std::net::Ipv4Addr::UNSPECIFIED.into(),
    };
    let server = Server::start((bind, 0).into())
        .map_err(|e| LaunchError::Io(format!("control plane: listening on {bind}: {e}")))?;
    setup.use_plane(
        format!("{host}:{}", server.port()),
        server.secret().to_string(),
    );
    Ok(Some(std::sync::Arc::new(server)))
}

/// What each rank runs first under a launcher: `kiln launch --as-rank` with the flags it
/// needs, written from the flags' one definition; nothing with `--no-rank-env`.
fn rank_shim(req: &LaunchRequest) -> Result<Vec<String>, LaunchError> {
    let exe = match std::env::current_exe() {
        Ok(exe) if !req.no_rank_env => exe,
        _ => return Ok(Vec::new()),
    };
    let as_rank = LaunchRequest {
        as_rank: true,
        heartbeat_timeout: req.heartbeat_timeout,
        ..Default::default()
    };
    let mut argv = vec![exe.display().to_string(), "launch".into()];
    let flags = as_rank.to_argv().map_err(LaunchError::Usage)?;
    argv.extend(flags.iter().map(|f| f.to_string_lossy().into_owned()));
    argv.push("--".into());
    Ok(argv)
}

/// Errors a person can act on, before anything starts: a missing program or launcher.
fn check_programs(setup: &Setup, command: &[String]) -> Result<(), LaunchError> {
    let first = setup
        .procs
        .first()
        .and_then(|p| p.argv.first())
        .cloned()
        .unwrap_or_default();
    let mut checks = vec![(first, true)];
    if setup.launcher != Launcher::Local
        && let Some(program) = command.first()
    {
        checks.push((program.clone(), false));
    }
    for (program, is_first) in checks {
        let hint = match (is_first, setup.launcher) {
            (false, _) | (true, Launcher::Local) => String::new(),
            (true, Launcher::Mpirun) => {
                " (install OpenMPI, e.g. `apt-get install openmpi-bin`, or drop --mpi)".into()
            }
            (true, l) => format!(
                " (the {} launcher is not in PATH: load the site's MPI/Slurm module)",
                l.name()
            ),
        };
        match lookup_program(&program) {
            Lookup::Found(_) => {}
            Lookup::NotExecutable(p) => {
                return Err(LaunchError::Program {
                    message: format!(
                        "{program}: permission denied: {} is not an executable file (chmod +x it, or run it through its interpreter)",
                        p.display()
                    ),
                    code: exit::NOT_EXECUTABLE,
                });
            }
            Lookup::NotFound => {
                return Err(LaunchError::Program {
                    message: format!("{program}: command not found{hint}"),
                    code: exit::NOT_FOUND,
                });
            }
        }
    }
    Ok(())
}

fn health_of(scheduler: &Scheduler) -> Box<dyn HostHealth> {
    match scheduler {
        Scheduler::Slurm { job_id, .. } => Box::new(SlurmHealth {
            job_id: job_id.clone(),
        }),
        Scheduler::Pbs { .. } => Box::new(PbsHealth),
        Scheduler::None => Box::new(NoHealth),
    }
}

fn job_id_of(scheduler: &Scheduler) -> Option<String> {
    match scheduler {
        Scheduler::Slurm { job_id, .. } | Scheduler::Pbs { job_id, .. } => Some(job_id.clone()),
        Scheduler::None => None,
    }
}

/// Runs `kiln launch` (not `--as-rank`). `on_attempt_end` is told about every attempt (the
/// CLI prints one line).
pub fn launch(
    req: &LaunchRequest,
    on_attempt_end: &dyn Fn(u32, &AttemptOutcome, &Diagnosis),
) -> Result<LaunchEnd, LaunchError> {
    let t = timing(req).map_err(LaunchError::Usage)?;
    if let Some(k) = req.chain
        && (k == 0 || req.chain_script.is_none())
    {
        return Err(LaunchError::Usage(
            "--chain needs a count of at least 1 and --chain-script (kiln submit writes both)"
                .into(),
        ));
    }
    let started = Instant::now();
    let dirs = Dirs::of(req);
    let (setup, command) = set_up(req, &dirs)?;
    if req.dry_run {
        return Ok(LaunchEnd::DryRun(crate::dry_run::describe(
            &setup, &dirs.run,
        )));
    }
    check_programs(&setup, &command)?;
    let mut run = Running::start(req, setup, dirs, started, &command)?;
    let result = run.recover(t, on_attempt_end)?;
    run.release_nodes();
    Ok(run.finish(result))
}

/// Where a launch writes: the run directory, and the directory ranks write beacons to.
pub(crate) struct Dirs {
    /// The run directory, absolute.
    pub(crate) run: PathBuf,
    /// `KILN_PROGRESS_DIR`.
    pub(crate) progress: PathBuf,
    /// Whether kiln chose `progress` (not a caller's `KILN_PROGRESS_DIR`): it creates and
    /// clears it.
    pub(crate) own_progress: bool,
}

impl Dirs {
    fn of(req: &LaunchRequest) -> Self {
        let run = req.run_dir.clone().unwrap_or_else(default_run_dir);
        // Absolute, because ranks on other hosts may not start in this directory and must
        // still find KILN_PROGRESS_DIR and the hostfile.
        let run = std::path::absolute(&run).unwrap_or(run);
        // A caller's own KILN_PROGRESS_DIR (a wrapper, a test harness) is respected and not
        // cleared.
        match kiln_run::progress_dir() {
            Some(progress) => Dirs {
                run,
                progress,
                own_progress: false,
            },
            None => Dirs {
                progress: run.join(layout::PROGRESS),
                run,
                own_progress: true,
            },
        }
    }

    fn create(&self) -> Result<(), LaunchError> {
        let io = |what: &str, path: &std::path::Path, e: std::io::Error| {
            LaunchError::Io(format!("{what} {}: {e}", path.display()))
        };
        std::fs::create_dir_all(&self.run).map_err(|e| io("creating run dir", &self.run, e))?;
        if self.own_progress {
            std::fs::create_dir_all(&self.progress)
                .map_err(|e| io("creating progress dir", &self.progress, e))?;
        }
        Ok(())
    }
}

/// A launch that passed its checks, from its start events through the recovery loop to
/// `launch_end` and the chain.
pub(crate) struct Running<'a> {
    pub(crate) req: &'a LaunchRequest,
    pub(crate) setup: Setup,
    pub(crate) dirs: Dirs,
    pub(crate) events: EventLog,
    /// The batch job this launch runs in.
    pub(crate) job_id: Option<String>,
    /// The control plane's server, under `--control-plane tcp` with a launcher.
    pub(crate) plane: Option<std::sync::Arc<crate::plane::server::Server>>,
    /// The job's place in a chain of batch jobs (`kiln submit`).
    pub(crate) chain: Option<ChainJob>,
    pub(crate) started: Instant,
}

impl<'a> Running<'a> {
    /// Creates the directories, opens the event log, writes the start events and installs
    /// the stop handlers.
    fn start(
        req: &'a LaunchRequest,
        setup: Setup,
        dirs: Dirs,
        started: Instant,
        command: &[String],
    ) -> Result<Self, LaunchError> {
        dirs.create()?;
        let events = EventLog::open(&dirs.run, event::source::LAUNCH)
            .map_err(|e| LaunchError::Io(e.to_string()))?;
        let job_id = job_id_of(&setup.scheduler.value);
        let chain = chain_job(req, &setup, job_id.as_deref());
        let mut setup = setup;
        let plane = start_plane(req, &mut setup)?;
        let mut run = Running {
            req,
            setup,
            dirs,
            events,
            job_id,
            plane,
            chain,
            started,
        };
        run.emit_job_start()?;
        run.emit_start(command)?;
        install_stop_handlers().map_err(|e| LaunchError::Io(format!("signal handlers: {e}")))?;
        Ok(run)
    }

    /// The settings every attempt starts from (its processes and log are set per attempt).
    fn attempt_config(&self, t: Timing) -> AttemptConfig {
        AttemptConfig {
            procs: Vec::new(),
            log_path: self.dirs.run.join(layout::attempt_log(1)),
            silence_timeout: t.silence,
            stall_timeout: t.stall,
            stall_auto: t.stall_auto,
            startup_timeout: t.startup,
            startup_auto: t.startup_auto,
            progress_regex: Some(t.regex),
            progress_dir: Some(self.dirs.progress.clone()),
            clear_progress_dir: self.dirs.own_progress,
            plane: self.plane.clone(),
            attempt: None,
            grace: t.grace,
            deadline: t.walltime.map(|w| self.started + w),
            echo: true,
            // Grandchildren that escape the process group (setsid, daemonize) are
            // re-parented to kiln, which then kills them when the attempt ends.
            reap_orphans: become_subreaper(),
            stdout_pty: true,
            expected_ranks: None,
            rank_shims: !self.req.no_rank_env,
            heartbeat_timeout: Some(t.heartbeat),
            straggler_ends_attempt: self.req.straggler_is_node_failure,
            straggler_cost: t.straggler_cost,
        }
    }

    /// Runs attempts, and recovers them, until one succeeds or recovery stops.
    fn recover(
        &mut self,
        t: Timing,
        on_attempt_end: &dyn Fn(u32, &AttemptOutcome, &Diagnosis),
    ) -> Result<LaunchResult, LaunchError> {
        let (req, backoff) = (self.req, t.backoff);
        let attempt = self.attempt_config(t);
        let setup = &self.setup;
        let health = health_of(&setup.scheduler.value);
        let planner = |hosts: &[kiln_topology::Host]| setup.plan_for(hosts);
        let prior_startup = self.prior_startup();
        run_with_retries(RetryConfig {
            attempt,
            run_dir: self.dirs.run.clone(),
            limit: if req.auto_retry {
                RetryLimit::Auto
            } else {
                RetryLimit::Count(req.retries.unwrap_or(0))
            },
            backoff,
            scope: NodeScope {
                pool: HostPool {
                    active: setup.active.clone(),
                    spares: setup.spares.clone(),
                    min_active: req.min_nodes.unwrap_or(setup.active.len()),
                },
                health: health.as_ref(),
                quarantine_files: quarantine_files(&self.dirs.run, &req.quarantine_file),
                job_id: self.job_id.clone(),
            },
            swap_hosts: req.node_scope(),
            strikes: req.strikes,
            planner: &planner,
            events: &mut self.events,
            stop: &stop_requested,
            on_attempt_end,
            prior_startup,
        })
        .map_err(|e| LaunchError::Io(e.to_string()))
    }

    /// For a later job of a chain (the same command again): the slowest startup its run
    /// directory recorded.
    fn prior_startup(&self) -> Option<f64> {
        self.chain.as_ref().filter(|c| c.index > 1)?;
        crate::stall::slowest_startup(&kiln_run::read_events(&self.dirs.run).ok()?)
    }

    /// Writes `launch_end` and, for a job of a chain, submits the next job when it should;
    /// then says how the launch ended.
    fn finish(mut self, result: LaunchResult) -> LaunchEnd {
        let last = &result.last;
        let _ = self.events.emit(
            event::LAUNCH_END,
            json!({
                "attempts": result.attempts,
                "exit_code": last.exit_code,
                "classification": last.classification.name(),
                "last_progress": last.last_progress,
                "stop_reason": result.stop_reason,
                "swaps": result.swaps.len(),
                "blind_swaps": result.swaps.iter().filter(|s| s.2).count(),
                "wall_s": self.started.elapsed().as_secs_f64(),
                "job_id": self.job_id,
            }),
        );
        if let Some(job) = &self.chain {
            let run_dir = &self.dirs.run;
            let made_progress = events_made_progress(run_dir, self.started);
            let files = quarantine_files(run_dir, &self.req.quarantine_file);
            let exclude = quarantined_hosts(&files).unwrap_or_default();
            let (_, reason) = continue_chain(
                job,
                last.exit_code,
                made_progress,
                &exclude,
                &mut self.events,
            );
            eprintln!("kiln: chain job {} of {}: {reason}", job.index, job.limit);
        }
        LaunchEnd::Done {
            exit_code: last.exit_code,
            attempts: result.attempts,
            classification: last.classification,
            stop_reason: result.stop_reason,
            run_dir: self.dirs.run,
        }
    }

    /// `job_start`, for a launch inside a batch job: its scheduler, its place in a chain,
    /// and how long it waited in the queue since `kiln submit` (or the previous job)
    /// submitted it.
    fn emit_job_start(&mut self) -> Result<(), LaunchError> {
        let chain = self.chain.as_ref();
        let Some(job) = chain.map(|c| c.job_id.clone()).or(self.job_id.clone()) else {
            return Ok(());
        };
        let submitted = kiln_run::read_events(&self.dirs.run)
            .unwrap_or_default()
            .into_iter()
            .rev()
            .find(|e| {
                e.event == event::JOB_SUBMITTED
                    && e.fields.get("job_id").and_then(|v| v.as_str()) == Some(job.as_str())
            })
            .map(|e| e.time);
        let now = kiln_run::unix_time();
        self.events
            .emit(
                event::JOB_START,
                json!({"job_id": job, "scheduler": self.setup.scheduler.value.name(), "chain_index": chain.map(|c| c.index), "chain_limit": chain.map(|c| c.limit), "submit_time": submitted, "queue_s": submitted.map(|s| (now - s).max(0.0))}),
            )
            .map_err(|e| LaunchError::Io(e.to_string()))
    }

    /// `launch_start` (what was detected and decided), and `host_pool` under node scope.
    fn emit_start(&mut self, command: &[String]) -> Result<(), LaunchError> {
        let (setup, req) = (&self.setup, self.req);
        let acc = setup.accelerators.value;
        let err = |e: kiln_run::EventLogError| LaunchError::Io(e.to_string());
        self.events
            .emit(
                event::LAUNCH_START,
                json!({
                    "scheduler": setup.scheduler.value.name(),
                    "scheduler_reason": setup.scheduler.reason,
                    "hosts": setup.used_hosts,
                    "hosts_reason": setup.hosts.reason,
                    "accelerator": acc.kind.name(),
                    "accelerators_per_node": acc.count,
                    "accelerators_reason": setup.accelerators.reason,
                    "launcher": setup.launcher.name(),
                    "np": setup.sizes.np, "ppn": setup.sizes.ppn, "nnodes": setup.sizes.nnodes,
                    "argv": setup.procs.iter().map(|p| &p.argv).collect::<Vec<_>>(),
                    "command": command,
                    "progress_dir": self.dirs.progress,
                    "control_plane": self.plane.as_ref().map_or("files", |_| "tcp"),
                    "control_plane_port": self.plane.as_ref().map(|p| p.port()),
                    "kiln_version": env!("CARGO_PKG_VERSION"),
                }),
            )
            .map_err(err)?;
        if req.node_scope() {
            self.events
                .emit(
                    event::HOST_POOL,
                    json!({
                        "active": setup.used_hosts,
                        "spares": setup.spares.iter().map(|h| &h.name).collect::<Vec<_>>(),
                        "quarantined": setup.excluded,
                        "min_nodes": req.min_nodes.unwrap_or(setup.active.len()),
                    }),
                )
                .map_err(err)?;
        }
        Ok(())
    }
}

/// Whether any attempt of this launch (since `started`) completed a step.
fn events_made_progress(run_dir: &std::path::Path, started: Instant) -> bool {
    let since = kiln_run::unix_time() - started.elapsed().as_secs_f64() - 1.0;
    kiln_run::read_events(run_dir)
        .unwrap_or_default()
        .iter()
        .filter(|e| e.event == event::ATTEMPT_END && e.time >= since)
        .any(|e| {
            e.fields
                .get("first_advance_time")
                .is_some_and(|v| !v.is_null())
        })
}

fn chain_job(req: &LaunchRequest, setup: &Setup, job_id: Option<&str>) -> Option<ChainJob> {
    let limit = req.chain?;
    let scheduler = match setup.scheduler.value {
        Scheduler::Slurm { .. } => BatchScheduler::Slurm,
        Scheduler::Pbs { .. } => BatchScheduler::Pbs,
        Scheduler::None => return None,
    };
    let index = env_var(CHAIN_INDEX_ENV)
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(1);
    Some(ChainJob {
        scheduler,
        job_id: job_id?.to_string(),
        index,
        limit,
        script: req.chain_script.clone()?,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn v(s: &[&str]) -> Vec<String> {
        s.iter().map(|x| x.to_string()).collect()
    }

    #[test]
    fn command_split() {
        assert_eq!(
            split_command(&v(&["a", "--", "b"])).unwrap(),
            (vec![], v(&["a", "--", "b"]))
        );
        assert_eq!(
            split_command(&v(&["--mca", "x", "--", "a", "-v"])).unwrap(),
            (v(&["--mca", "x"]), v(&["a", "-v"]))
        );
        assert!(
            split_command(&v(&["--bind-to", "core", "--np", "2", "--", "a"]))
                .unwrap_err()
                .contains("--np")
        );
        assert!(split_command(&v(&["--weird"])).is_err());
        assert!(split_command(&[]).is_err());
    }

    #[test]
    fn run_dir_is_dated() {
        assert!(
            default_run_dir()
                .display()
                .to_string()
                .starts_with("runs/launch-20")
        );
    }
}

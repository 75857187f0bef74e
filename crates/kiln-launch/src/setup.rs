//! From flags and environment to the processes of a launch: detect the scheduler, hosts and
//! accelerators (flags override each), split the hosts into active and spare, resolve sizes,
//! choose the launcher, build argv. [`Setup::plan_for`] rebuilds the plan for another set of
//! hosts (after a node swap), so every attempt runs on its own active set.

use crate::flags::LaunchRequest;
use crate::limits;
use crate::plan::{
    Launcher, PlanError, PlanRequest, ProcSpec, SizeRequest, Sizes, build_plan, resolve_sizes,
};
use crate::pool::same_host;
use kiln_topology::{
    AcceleratorKind, Accelerators, Detected, Host, HostsError, Probe, Scheduler,
    VisibleDevicesError, allocation_hosts, detect_accelerators, detect_scheduler,
};
use std::path::PathBuf;

/// The rendezvous port when the request names none (torchrun's default); `kiln launch`
/// picks a port free on this machine instead, before it prepares.
pub const DEFAULT_MASTER_PORT: u16 = 29500;

/// What a launch is asked for: the flags as given (`auto` or `None` means "detect"), and
/// what the caller worked out from them and the environment.
#[derive(Debug, Clone, Default)]
pub struct LaunchOptions {
    /// The flags of `kiln launch`: sizes, scheduler, hostfile, accelerators, CPU binding,
    /// master address and port, node scope and spares. Its `command` is not read: see
    /// `launcher_args` and `command` here.
    pub request: LaunchRequest,
    /// Unknown flags before `--`, for the launcher.
    pub launcher_args: Vec<String>,
    /// The user's command.
    pub command: Vec<String>,
    /// Prefix that maps rank variables on each rank (see [`PlanRequest::rank_shim`]).
    pub rank_shim: Vec<String>,
    /// Directory ranks write progress beacons to.
    pub progress_dir: PathBuf,
    /// The run directory (a generated hostfile goes there).
    pub run_dir: PathBuf,
    /// Hosts not to use (quarantined by earlier attempts or jobs).
    pub exclude: Vec<String>,
    /// `PYTHONUNBUFFERED` as kiln sees it: when unset, ranks get `PYTHONUNBUFFERED=1`.
    pub python_unbuffered_set: bool,
}

/// The sizes the request asks for (`--np`, `--ppn`, `--nnodes`).
fn size_request(r: &LaunchRequest) -> SizeRequest {
    SizeRequest {
        np: r.np,
        ppn: r.ppn,
        nnodes: r.nnodes,
    }
}

/// Everything decided before the first attempt, with the reasons, for `--dry-run` and
/// `events.jsonl`.
#[derive(Debug, Clone)]
pub struct Setup {
    /// The scheduler and why.
    pub scheduler: Detected<Scheduler>,
    /// All hosts of the allocation and where they came from.
    pub hosts: Detected<Vec<Host>>,
    /// Accelerators per node and why.
    pub accelerators: Detected<Accelerators>,
    /// Resolved sizes (of the active hosts).
    pub sizes: Sizes,
    /// The launcher.
    pub launcher: Launcher,
    /// Hosts the first attempt runs on.
    pub active: Vec<Host>,
    /// Hosts kept to replace failed ones (node scope).
    pub spares: Vec<Host>,
    /// Hosts of the allocation left out because they are quarantined.
    pub excluded: Vec<String>,
    /// Names of the hosts actually used (`active`).
    pub used_hosts: Vec<String>,
    /// A hostfile kiln must write before launching: (path, contents).
    pub hostfile_to_write: Option<(PathBuf, String)>,
    /// The processes to start (for `active`).
    pub procs: Vec<ProcSpec>,
    planning: Planning,
    /// The control plane's address and secret for the ranks' shims (set once its server
    /// runs; empty under the `files` plane): exported to every attempt, never printed.
    plane_env: Vec<(String, String)>,
}

/// What [`Setup::plan_for`] makes every attempt's plan from, besides the detected facts.
#[derive(Debug, Clone)]
struct Planning {
    /// The plan without hosts, hostfile and variables.
    template: PlanRequest,
    /// The hostfile the hosts came from (`--hostfile`, or PBS's nodefile).
    source_file: Option<PathBuf>,
    /// Whether `source_file` is the user's `--hostfile`.
    user_hostfile: bool,
    master_addr: Option<String>,
    master_port: u16,
    progress_dir: PathBuf,
    /// Where a generated hostfile goes.
    run_dir: PathBuf,
    python_unbuffered_set: bool,
    /// The device variable of each local rank (empty: nothing to choose); see
    /// [`kiln_topology::device_for_local_rank`]. Ranks under a launcher get theirs in the
    /// shim, from [`kiln_run::host::ACCELERATORS_ENV`].
    rank_devices: Vec<Option<(&'static str, String)>>,
}

impl Planning {
    fn new(
        opts: &LaunchOptions,
        scheduler: &Scheduler,
        template: PlanRequest,
        rank_devices: Vec<Option<(&'static str, String)>>,
    ) -> Self {
        let req = &opts.request;
        let source_file = req.topology.hostfile.clone().or(match scheduler {
            Scheduler::Pbs { nodefile, .. } => nodefile.clone(),
            _ => None,
        });
        Planning {
            template,
            source_file,
            user_hostfile: req.topology.hostfile.is_some(),
            master_addr: req.master_addr.clone(),
            master_port: req.master_port.unwrap_or(DEFAULT_MASTER_PORT),
            progress_dir: opts.progress_dir.clone(),
            run_dir: opts.run_dir.clone(),
            python_unbuffered_set: opts.python_unbuffered_set,
            rank_devices,
        }
    }
}

/// The processes of one attempt on a given set of hosts.
#[derive(Debug, Clone)]
pub struct AttemptPlan {
    /// Sizes on these hosts.
    pub sizes: Sizes,
    /// The processes to start.
    pub procs: Vec<ProcSpec>,
    /// A hostfile to write first: (path, contents).
    pub hostfile_to_write: Option<(PathBuf, String)>,
    /// The host names, in rank order (block distribution: `ppn` ranks per host).
    pub hosts: Vec<String>,
    /// The attempt's token, exported to every rank as [`kiln_run::ATTEMPT_ENV`].
    pub attempt: String,
}

/// Why a launch cannot be set up; the message says which flag or file to fix.
#[derive(Debug, thiserror::Error)]
pub enum SetupError {
    /// Hosts could not be listed.
    #[error(transparent)]
    Hosts(#[from] HostsError),
    /// A visible-device variable is malformed.
    #[error(transparent)]
    Devices(#[from] VisibleDevicesError),
    /// Sizes or launcher choice conflict.
    #[error(transparent)]
    Plan(#[from] PlanError),
    /// A flag value is not one of the accepted ones, or out of bounds.
    #[error("{0}")]
    Flag(String),
}

/// Spares kept by default under node scope: about 2 % of the hosts, at least one when there
/// are two or more (as the seeds' launchers do).
pub fn default_spares(usable_hosts: usize) -> usize {
    if usable_hosts < 2 {
        return 0;
    }
    ((usable_hosts as f64 * 0.02).round() as usize).max(1)
}

fn scheduler_choice(
    opts: &LaunchOptions,
    vars: &dyn Fn(&str) -> Option<String>,
) -> Result<Detected<Scheduler>, SetupError> {
    Ok(match opts.request.topology.scheduler.as_str() {
        "auto" => detect_scheduler(vars),
        "none" => Detected {
            value: Scheduler::None,
            reason: "--scheduler none".into(),
        },
        "pbs" => Detected {
            value: Scheduler::Pbs {
                job_id: vars("PBS_JOBID").unwrap_or_else(|| "(unset)".into()),
                nodefile: vars("PBS_NODEFILE").map(PathBuf::from),
            },
            reason: "--scheduler pbs".into(),
        },
        "slurm" => Detected {
            value: Scheduler::Slurm {
                job_id: vars("SLURM_JOB_ID").unwrap_or_else(|| "(unset)".into()),
                nodelist: vars("SLURM_JOB_NODELIST").or_else(|| vars("SLURM_NODELIST")),
            },
            reason: "--scheduler slurm".into(),
        },
        other => {
            return Err(SetupError::Flag(format!(
                "--scheduler {other:?}: expected auto, pbs, slurm or none"
            )));
        }
    })
}

/// Decides everything about a launch. `vars` reads the environment, `probe` runs a GPU tool,
/// `local_cpus` and `as_root` describe this machine.
pub fn prepare(
    opts: &LaunchOptions,
    vars: &dyn Fn(&str) -> Option<String>,
    probe: Probe<'_>,
    local_cpus: usize,
    as_root: bool,
) -> Result<Setup, SetupError> {
    let req = &opts.request;
    check_flags(req)?;
    let scheduler = scheduler_choice(opts, vars)?;
    let hosts = allocation_hosts(&scheduler.value, req.topology.hostfile.as_deref())?;
    let accelerators = accelerators(opts, vars, probe)?;
    limits::per_node("accelerators per node", accelerators.value.count)
        .map_err(SetupError::Flag)?;
    let launcher = launcher_for(&scheduler.value, req)?;
    let pool = Usable::of(opts, &hosts)?;
    let default_ppn = accelerators.value.count.max(1);
    let sizes = resolve_sizes(
        size_request(req),
        pool.candidates(),
        &pool.reason,
        default_ppn,
    )?;
    let local = matches!(launcher, Launcher::Local)
        || (launcher == Launcher::Mpirun && req.topology.hostfile.is_none());
    limits::ranks(sizes.np, local.then_some(local_cpus), req.oversubscribe)
        .map_err(SetupError::Flag)?;
    let (active, spares) = pool.split(sizes.nnodes, req.node_scope());
    let acc = accelerators.value;
    let template = plan_template(opts, launcher, sizes, acc.count, local_cpus, as_root);
    let rank_devices = (0..sizes.ppn)
        .map(|r| kiln_topology::device_for_local_rank(acc, vars, r))
        .collect::<Result<Vec<_>, _>>()?;
    let mut setup = Setup {
        planning: Planning::new(opts, &scheduler.value, template, rank_devices),
        plane_env: Vec::new(),
        scheduler,
        hosts,
        accelerators,
        sizes,
        launcher,
        active,
        spares,
        excluded: pool.excluded,
        used_hosts: Vec::new(),
        hostfile_to_write: None,
        procs: Vec::new(),
    };
    let first = setup.plan_for(&setup.active)?;
    (setup.used_hosts, setup.hostfile_to_write, setup.procs) =
        (first.hosts, first.hostfile_to_write, first.procs);
    Ok(setup)
}

/// The flags' own bounds, before anything is detected: ranks per node, accelerators per node,
/// ranks, and a port ranks can meet on.
fn check_flags(req: &LaunchRequest) -> Result<(), SetupError> {
    for (flag, v) in [
        ("--ppn", req.ppn),
        ("--gpus-per-node", req.topology.gpus_per_node),
    ] {
        if let Some(v) = v {
            limits::per_node(flag, v).map_err(SetupError::Flag)?;
        }
    }
    if let Some(np) = req.np {
        limits::ranks(np, None, true).map_err(SetupError::Flag)?;
    }
    if req.master_port == Some(0) {
        return Err(SetupError::Flag(
            "--master-port 0 is not a port ranks can meet on; omit the flag to let kiln pick a free port".into(),
        ));
    }
    Ok(())
}

/// The launcher: the scheduler's own, else mpirun with `--mpi`, else local processes.
fn launcher_for(scheduler: &Scheduler, req: &LaunchRequest) -> Result<Launcher, SetupError> {
    let launcher = match (scheduler, req.topology.mpi) {
        (Scheduler::Pbs { .. }, _) => Launcher::Mpiexec,
        (Scheduler::Slurm { .. }, _) => Launcher::Srun,
        (Scheduler::None, true) => Launcher::Mpirun,
        (Scheduler::None, false) => Launcher::Local,
    };
    // A hostfile without a scheduler describes other machines: only mpirun can reach them.
    if launcher == Launcher::Local && req.topology.hostfile.is_some() {
        return Err(SetupError::Flag(
            "--hostfile without a scheduler needs --mpi (kiln starts ranks on other hosts through mpirun)".into(),
        ));
    }
    Ok(launcher)
}

/// The hosts of the allocation a launch may use: those not quarantined, of which
/// `min_spares` are kept back as spares.
struct Usable {
    /// The hosts not quarantined, in allocation order.
    hosts: Vec<Host>,
    /// The hosts left out because they are quarantined.
    excluded: Vec<String>,
    /// Hosts kept as spares at least (`--spares`, or the default under node scope).
    min_spares: usize,
    /// Where the hosts came from, with the counts when some are left out or kept.
    reason: String,
}

impl Usable {
    fn of(opts: &LaunchOptions, hosts: &Detected<Vec<Host>>) -> Result<Self, SetupError> {
        let req = &opts.request;
        let (usable, excluded): (Vec<Host>, Vec<Host>) = hosts
            .value
            .iter()
            .cloned()
            .partition(|h| !opts.exclude.iter().any(|x| same_host(x, &h.name)));
        let excluded: Vec<String> = excluded.into_iter().map(|h| h.name).collect();
        if usable.is_empty() {
            return Err(SetupError::Flag(format!(
                "every host of the allocation is quarantined ({}); see the quarantine file",
                excluded.join(", ")
            )));
        }
        let min_spares = match (req.spares, req.node_scope()) {
            (Some(s), _) if s >= usable.len() => {
                return Err(SetupError::Flag(format!(
                    "--spares {s} leaves no active host: {} usable host(s) ({})",
                    usable.len(),
                    hosts.reason
                )));
            }
            (Some(s), _) => s,
            (None, true) if req.nnodes.is_none() => default_spares(usable.len()),
            (None, _) => 0,
        };
        let reason = if min_spares > 0 || !excluded.is_empty() {
            let n = usable.len();
            format!("{} ({n} usable, {min_spares} kept as spares)", hosts.reason)
        } else {
            hosts.reason.clone()
        };
        Ok(Usable {
            hosts: usable,
            excluded,
            min_spares,
            reason,
        })
    }

    /// How many hosts the active set may take.
    fn candidates(&self) -> usize {
        self.hosts.len() - self.min_spares
    }

    /// The first `nnodes` hosts, active, and the rest, spares under node scope.
    fn split(&self, nnodes: usize, node_scope: bool) -> (Vec<Host>, Vec<Host>) {
        let (active, rest) = self.hosts.split_at(nnodes.min(self.hosts.len()));
        let spares = if node_scope {
            rest.to_vec()
        } else {
            Vec::new()
        };
        (active.to_vec(), spares)
    }
}

/// What every attempt's plan starts from; [`Setup::plan_for`] fills in the hosts.
fn plan_template(
    opts: &LaunchOptions,
    launcher: Launcher,
    sizes: Sizes,
    gpus_per_node: usize,
    local_cpus: usize,
    as_root: bool,
) -> PlanRequest {
    let cpu_bind = opts
        .request
        .cpu_bind
        .clone()
        .or_else(|| (launcher == Launcher::Mpiexec).then(|| "depth".to_string()));
    PlanRequest {
        launcher,
        sizes,
        hosts: Vec::new(),
        hostfile: None,
        explicit_hosts: false,
        cpu_bind,
        // Cores per rank: share this node's cores evenly, as ezpz does for PBS.
        depth: Some((local_cpus / sizes.ppn.max(1)).max(1)),
        gpus_per_node,
        launcher_args: opts.launcher_args.clone(),
        rank_shim: match launcher {
            Launcher::Local => Vec::new(),
            _ => opts.rank_shim.clone(),
        },
        command: opts.command.clone(),
        exports: Vec::new(),
        as_root,
        local_cpus,
    }
}

impl Setup {
    /// The plan of an attempt on `hosts` (a subset of the allocation, in rank order): the
    /// same ranks per node as the first attempt, as many nodes as `hosts` holds.
    pub fn plan_for(&self, hosts: &[Host]) -> Result<AttemptPlan, PlanError> {
        if hosts.is_empty() {
            return Err(PlanError("no host left to run on".into()));
        }
        let ppn = self.sizes.ppn;
        let nnodes = hosts.len();
        let np = if nnodes == self.sizes.nnodes {
            self.sizes.np
        } else {
            (nnodes * ppn).min(self.sizes.np)
        };
        let sizes = Sizes { np, ppn, nnodes };
        let all_hosts = hosts.len() == self.hosts.value.len()
            && hosts
                .iter()
                .zip(&self.hosts.value)
                .all(|(a, b)| a.name == b.name);
        let (hostfile, hostfile_to_write) =
            self.hostfile_for(hosts, all_hosts, kiln_run::layout::HOSTFILE);
        let names: Vec<String> = hosts.iter().map(|h| h.name.clone()).collect();
        let p = &self.planning;
        let mut req = p.template.clone();
        req.sizes = sizes;
        req.hosts = hosts.to_vec();
        req.hostfile = hostfile;
        req.explicit_hosts = p.user_hostfile || !all_hosts;
        let attempt = attempt_token();
        req.exports = self.exports(&names, &attempt);
        let mut procs = build_plan(&req)?;
        for proc in &mut procs {
            let device = proc.rank.and_then(|r| p.rank_devices.get(r)?.clone());
            proc.env
                .extend(device.map(|(var, value)| (var.to_string(), value)));
            // Ranks sharing one GPU as NCCL hosts of their own, when asked.
            let vars = |k: &str| std::env::var(k).ok();
            let nccl = proc
                .rank
                .map(|r| kiln_topology::ranks_as_nccl_hosts(&vars, r));
            (proc.env).extend(nccl.into_iter().flatten().map(|(k, v)| (k.to_string(), v)));
        }
        Ok(AttemptPlan {
            sizes,
            procs,
            hostfile_to_write,
            hosts: names,
            attempt,
        })
    }

    /// The processes that run `command` once on each of `hosts` (a subset of the
    /// allocation), through the attempts' launcher (no rank shim, no binding, no GPUs): how a
    /// launch releases its nodes at the end. Its hostfile, when it needs one, is
    /// [`kiln_run::layout::RELEASE_HOSTFILE`].
    pub fn plan_once_per_node(
        &self,
        hosts: &[Host],
        command: Vec<String>,
    ) -> Result<AttemptPlan, PlanError> {
        if hosts.is_empty() {
            return Err(PlanError("no host to run on".into()));
        }
        let n = hosts.len();
        let all_hosts = n == self.hosts.value.len()
            && hosts
                .iter()
                .zip(&self.hosts.value)
                .all(|(a, b)| a.name == b.name);
        let (hostfile, hostfile_to_write) =
            self.hostfile_for(hosts, all_hosts, kiln_run::layout::RELEASE_HOSTFILE);
        let names: Vec<String> = hosts.iter().map(|h| h.name.clone()).collect();
        let mut req = self.planning.template.clone();
        req.sizes = Sizes {
            np: n,
            ppn: 1,
            nnodes: n,
        };
        req.hosts = hosts.to_vec();
        req.hostfile = hostfile;
        req.explicit_hosts = true;
        req.cpu_bind = None;
        req.gpus_per_node = 0;
        req.rank_shim = Vec::new();
        req.command = command;
        let attempt = attempt_token();
        req.exports = self.exports(&names, &attempt);
        Ok(AttemptPlan {
            sizes: req.sizes,
            procs: build_plan(&req)?,
            hostfile_to_write,
            hosts: names,
            attempt,
        })
    }

    /// The hostfile mpiexec or mpirun reads for `hosts` (`all_hosts`: the whole allocation),
    /// and the one kiln must write first (named `name` in the run directory), if any:
    /// (path, contents).
    fn hostfile_for(
        &self,
        hosts: &[Host],
        all_hosts: bool,
        name: &str,
    ) -> (Option<PathBuf>, Option<(PathBuf, String)>) {
        let p = &self.planning;
        let ppn = self.sizes.ppn;
        match self.launcher {
            Launcher::Mpiexec | Launcher::Mpirun
                if self.launcher == Launcher::Mpiexec || p.user_hostfile =>
            {
                // The scheduler's own nodefile is in its launcher's syntax; a user's hostfile
                // may be in any syntax kiln reads (`host:N`, `host slots=N`, repeated
                // lines), so the launcher gets kiln's rewrite in its own syntax.
                match (&p.source_file, all_hosts) {
                    (Some(f), true) if !p.user_hostfile => (Some(f.clone()), None),
                    _ => {
                        let path = p.run_dir.join(name);
                        let text: String = match self.launcher {
                            Launcher::Mpirun => hosts
                                .iter()
                                .map(|h| format!("{} slots={ppn}\n", h.name))
                                .collect(),
                            _ => hosts.iter().map(|h| format!("{}\n", h.name)).collect(),
                        };
                        (Some(path.clone()), Some((path, text)))
                    }
                }
            }
            _ => (None, None),
        }
    }

    /// Exports the control plane's `host:port` and secret to every later attempt's ranks.
    pub fn use_plane(&mut self, addr: String, secret: String) {
        self.plane_env = vec![
            (crate::plane::ADDR_ENV.to_string(), addr),
            (crate::plane::SECRET_ENV.to_string(), secret),
        ];
    }

    /// Whether the ranks run on this machine only (the control plane is then reached on the
    /// loopback address).
    pub fn all_local(&self) -> bool {
        match self.launcher {
            Launcher::Local => true,
            Launcher::Mpirun => !self.planning.user_hostfile,
            _ => false,
        }
    }

    /// The variables every rank of an attempt on the hosts `names` sees.
    fn exports(&self, names: &[String], attempt: &str) -> Vec<(String, String)> {
        let p = &self.planning;
        let master_addr = p
            .master_addr
            .clone()
            .unwrap_or_else(|| match self.launcher {
                Launcher::Local => "127.0.0.1".into(),
                Launcher::Mpirun if !p.user_hostfile => "127.0.0.1".into(),
                _ => names.first().cloned().unwrap_or_else(|| "127.0.0.1".into()),
            });
        let mut exports = vec![
            ("MASTER_ADDR".to_string(), master_addr),
            ("MASTER_PORT".to_string(), p.master_port.to_string()),
            (
                kiln_run::PROGRESS_DIR_ENV.to_string(),
                p.progress_dir.display().to_string(),
            ),
            (kiln_run::ATTEMPT_ENV.to_string(), attempt.to_string()),
        ];
        exports.extend(self.plane_env.iter().cloned());
        // Python block-buffers stdout into a pipe: a rank whose output kiln watches must
        // flush every line, or the silence watchdog sees nothing (ezpz does the same).
        if !p.python_unbuffered_set {
            exports.push(("PYTHONUNBUFFERED".to_string(), "1".to_string()));
        }
        if self.accelerators.value.kind != AcceleratorKind::Cpu {
            let acc = kiln_topology::accelerators_to_env(self.accelerators.value);
            exports.push((kiln_run::host::ACCELERATORS_ENV.to_string(), acc));
        }
        exports
    }
}

/// A token no other attempt has: this process, the time, and a count of the attempts it
/// planned.
fn attempt_token() -> String {
    use std::sync::atomic::{AtomicU64, Ordering};
    static PLANNED: AtomicU64 = AtomicU64::new(0);
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    let n = PLANNED.fetch_add(1, Ordering::Relaxed);
    format!("{:x}-{nanos:x}-{n}", std::process::id())
}

/// The kind `--accelerator` names; `None` for `auto`.
fn accelerator_kind(flag: &str) -> Result<Option<AcceleratorKind>, SetupError> {
    Ok(match flag {
        "auto" => None,
        "nvidia" => Some(AcceleratorKind::Nvidia),
        "amd" => Some(AcceleratorKind::Amd),
        "intel" => Some(AcceleratorKind::Intel),
        "cpu" => Some(AcceleratorKind::Cpu),
        other => {
            return Err(SetupError::Flag(format!(
                "--accelerator {other:?}: expected auto, nvidia, amd, intel or cpu"
            )));
        }
    })
}

/// Accelerators per node: detected, or as `--accelerator` and `--gpus-per-node` override.
fn accelerators(
    opts: &LaunchOptions,
    vars: &dyn Fn(&str) -> Option<String>,
    probe: Probe<'_>,
) -> Result<Detected<Accelerators>, SetupError> {
    let kind = accelerator_kind(&opts.request.topology.accelerator)?;
    // Only run the GPU tools when the flags leave something to detect.
    let detected = match (kind, opts.request.topology.gpus_per_node) {
        (Some(k), Some(n)) => {
            return Ok(Detected {
                value: Accelerators { kind: k, count: n },
                reason: "--accelerator, --gpus-per-node".into(),
            });
        }
        (Some(AcceleratorKind::Cpu), None) => {
            return Ok(Detected {
                value: Accelerators {
                    kind: AcceleratorKind::Cpu,
                    count: 0,
                },
                reason: "--accelerator cpu".into(),
            });
        }
        _ => detect_accelerators(vars, probe)?,
    };
    let mut d = detected;
    if let Some(k) = kind {
        d.value.kind = k;
        d.reason = format!("--accelerator {}; count: {}", k.name(), d.reason);
    }
    if let Some(n) = opts.request.topology.gpus_per_node {
        d.value.count = n;
        if n == 0 {
            d.value.kind = AcceleratorKind::Cpu;
        } else if d.value.kind == AcceleratorKind::Cpu && kind.is_none() {
            // A GPU count with nothing detected (a login node preparing a job): the kind is
            // unknown, NVIDIA is the common case; --accelerator says otherwise.
            d.value.kind = AcceleratorKind::Nvidia;
        }
        d.reason = format!("--gpus-per-node {n}; kind: {}", d.reason);
    }
    Ok(d)
}

//! From flags and environment to the processes of a launch: detect the scheduler, hosts and
//! accelerators (flags override each), resolve sizes, choose the launcher, build argv.

use crate::plan::{
    Launcher, PlanError, PlanRequest, ProcSpec, SizeRequest, Sizes, build_plan, resolve_sizes,
};
use kiln_topology::{
    AcceleratorKind, Accelerators, Detected, Host, HostsError, Probe, Scheduler, allocation_hosts,
    detect_accelerators, detect_scheduler,
};
use std::path::PathBuf;

/// What the command line asked for; `None` means "detect".
#[derive(Debug, Clone, Default)]
pub struct LaunchOptions {
    /// `--scheduler pbs|slurm|none`.
    pub scheduler: Option<String>,
    /// `--hostfile`.
    pub hostfile: Option<PathBuf>,
    /// `--np`, `--ppn`, `--nnodes`.
    pub sizes: SizeRequest,
    /// `--mpi`: use `mpirun` when there is no scheduler.
    pub mpi: bool,
    /// `--accelerator nvidia|amd|intel|cpu`.
    pub accelerator: Option<String>,
    /// `--gpus-per-node N`.
    pub gpus_per_node: Option<usize>,
    /// `--cpu-bind`.
    pub cpu_bind: Option<String>,
    /// Unknown flags before `--`, for the launcher.
    pub launcher_args: Vec<String>,
    /// Prefix that maps rank variables on each rank (see [`PlanRequest::rank_shim`]).
    pub rank_shim: Vec<String>,
    /// The user's command.
    pub command: Vec<String>,
    /// `--master-addr`.
    pub master_addr: Option<String>,
    /// The rendezvous port (the caller picks a free one unless `--master-port` is given).
    pub master_port: u16,
    /// Directory ranks write progress beacons to.
    pub progress_dir: PathBuf,
    /// The run directory (a generated hostfile goes there).
    pub run_dir: PathBuf,
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
    /// Resolved sizes.
    pub sizes: Sizes,
    /// The launcher.
    pub launcher: Launcher,
    /// Hosts actually used (the first `sizes.nnodes`).
    pub used_hosts: Vec<String>,
    /// A hostfile kiln must write before launching: (path, contents).
    pub hostfile_to_write: Option<(PathBuf, String)>,
    /// The processes to start each attempt.
    pub procs: Vec<ProcSpec>,
}

/// Why a launch cannot be set up; the message says which flag or file to fix.
#[derive(Debug, thiserror::Error)]
pub enum SetupError {
    /// Hosts could not be listed.
    #[error(transparent)]
    Hosts(#[from] HostsError),
    /// Sizes or launcher choice conflict.
    #[error(transparent)]
    Plan(#[from] PlanError),
    /// A flag value is not one of the accepted ones.
    #[error("{0}")]
    Flag(String),
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
    let detected = detect_scheduler(vars);
    let scheduler = match opts.scheduler.as_deref() {
        None | Some("auto") => detected,
        Some("none") => Detected {
            value: Scheduler::None,
            reason: "--scheduler none".into(),
        },
        Some("pbs") => Detected {
            value: Scheduler::Pbs {
                job_id: vars("PBS_JOBID").unwrap_or_else(|| "(unset)".into()),
                nodefile: vars("PBS_NODEFILE").map(PathBuf::from),
            },
            reason: "--scheduler pbs".into(),
        },
        Some("slurm") => Detected {
            value: Scheduler::Slurm {
                job_id: vars("SLURM_JOB_ID").unwrap_or_else(|| "(unset)".into()),
                nodelist: vars("SLURM_JOB_NODELIST").or_else(|| vars("SLURM_NODELIST")),
            },
            reason: "--scheduler slurm".into(),
        },
        Some(other) => {
            return Err(SetupError::Flag(format!(
                "--scheduler {other:?}: expected auto, pbs, slurm or none"
            )));
        }
    };
    let hosts = allocation_hosts(&scheduler.value, opts.hostfile.as_deref())?;
    let accelerators = accelerators(opts, vars, probe)?;
    let launcher = match (&scheduler.value, opts.mpi) {
        (Scheduler::Pbs { .. }, _) => Launcher::Mpiexec,
        (Scheduler::Slurm { .. }, _) => Launcher::Srun,
        (Scheduler::None, true) => Launcher::Mpirun,
        (Scheduler::None, false) => Launcher::Local,
    };
    // A hostfile without a scheduler describes other machines: only mpirun can reach them.
    if launcher == Launcher::Local && opts.hostfile.is_some() {
        return Err(SetupError::Flag(
            "--hostfile without a scheduler needs --mpi (kiln starts ranks on other hosts through mpirun)".into(),
        ));
    }
    let default_ppn = accelerators.value.count.max(1);
    let sizes = resolve_sizes(opts.sizes, hosts.value.len(), &hosts.reason, default_ppn)?;
    let used: Vec<Host> = hosts.value.iter().take(sizes.nnodes).cloned().collect();
    let used_hosts: Vec<String> = used.iter().map(|h| h.name.clone()).collect();
    let all_hosts = sizes.nnodes == hosts.value.len();
    let source_file = opts.hostfile.clone().or(match &scheduler.value {
        Scheduler::Pbs { nodefile, .. } => nodefile.clone(),
        _ => None,
    });
    let mut hostfile_to_write = None;
    let hostfile = match launcher {
        Launcher::Mpiexec | Launcher::Mpirun
            if launcher == Launcher::Mpiexec || opts.hostfile.is_some() =>
        {
            match (&source_file, all_hosts) {
                (Some(f), true) => Some(f.clone()),
                _ => {
                    let path = opts.run_dir.join("hostfile");
                    let text: String = match launcher {
                        Launcher::Mpirun => used
                            .iter()
                            .map(|h| format!("{} slots={}\n", h.name, sizes.ppn))
                            .collect(),
                        _ => used.iter().map(|h| format!("{}\n", h.name)).collect(),
                    };
                    hostfile_to_write = Some((path.clone(), text));
                    Some(path)
                }
            }
        }
        _ => None,
    };
    let master_addr = opts.master_addr.clone().unwrap_or_else(|| match launcher {
        Launcher::Local => "127.0.0.1".into(),
        Launcher::Mpirun if opts.hostfile.is_none() => "127.0.0.1".into(),
        _ => used_hosts
            .first()
            .cloned()
            .unwrap_or_else(|| "127.0.0.1".into()),
    });
    let exports = vec![
        ("MASTER_ADDR".to_string(), master_addr),
        ("MASTER_PORT".to_string(), opts.master_port.to_string()),
        (
            kiln_run::PROGRESS_DIR_ENV.to_string(),
            opts.progress_dir.display().to_string(),
        ),
    ];
    let cpu_bind = opts
        .cpu_bind
        .clone()
        .or_else(|| (launcher == Launcher::Mpiexec).then(|| "depth".to_string()));
    let req = PlanRequest {
        launcher,
        sizes,
        hosts: used,
        hostfile,
        explicit_hosts: opts.hostfile.is_some() || !all_hosts,
        cpu_bind,
        // Cores per rank: share this node's cores evenly, as ezpz does for PBS.
        depth: Some((local_cpus / sizes.ppn.max(1)).max(1)),
        gpus_per_node: accelerators.value.count,
        launcher_args: opts.launcher_args.clone(),
        rank_shim: if launcher == Launcher::Local {
            Vec::new()
        } else {
            opts.rank_shim.clone()
        },
        command: opts.command.clone(),
        exports,
        as_root,
        local_cpus,
    };
    let procs = build_plan(&req)?;
    Ok(Setup {
        scheduler,
        hosts,
        accelerators,
        sizes,
        launcher,
        used_hosts,
        hostfile_to_write,
        procs,
    })
}

fn accelerators(
    opts: &LaunchOptions,
    vars: &dyn Fn(&str) -> Option<String>,
    probe: Probe<'_>,
) -> Result<Detected<Accelerators>, SetupError> {
    let kind = match opts.accelerator.as_deref() {
        None | Some("auto") => None,
        Some("nvidia") => Some(AcceleratorKind::Nvidia),
        Some("amd") => Some(AcceleratorKind::Amd),
        Some("intel") => Some(AcceleratorKind::Intel),
        Some("cpu") => Some(AcceleratorKind::Cpu),
        Some(other) => {
            return Err(SetupError::Flag(format!(
                "--accelerator {other:?}: expected auto, nvidia, amd, intel or cpu"
            )));
        }
    };
    // Only run the GPU tools when the flags leave something to detect.
    let detected = match (kind, opts.gpus_per_node) {
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
        _ => detect_accelerators(vars, probe),
    };
    let mut d = detected;
    if let Some(k) = kind {
        d.value.kind = k;
        d.reason = format!("--accelerator {}; count: {}", k.name(), d.reason);
    }
    if let Some(n) = opts.gpus_per_node {
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

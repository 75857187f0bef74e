//! What to run: rank counts and the launcher argv (always a list, never a shell string).

use kiln_topology::Host;
use std::path::PathBuf;

/// Errors in the requested sizes or launcher choice; each names the flags involved.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct PlanError(pub String);

/// Rank counts as requested on the command line (`--np`, `--ppn`, `--nnodes`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SizeRequest {
    /// `--np`: total ranks.
    pub np: Option<usize>,
    /// `--ppn`: ranks per node.
    pub ppn: Option<usize>,
    /// `--nnodes`: nodes to use.
    pub nnodes: Option<usize>,
}

/// Resolved rank counts: `np` ranks over `nnodes` nodes, at most `ppn` per node.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Sizes {
    /// Total ranks.
    pub np: usize,
    /// Ranks per node (the last node may hold fewer when `np` is not a multiple).
    pub ppn: usize,
    /// Nodes used.
    pub nnodes: usize,
}

/// Resolves sizes against `hosts` available hosts (`hosts_from` names where they came from,
/// for messages) and `default_ppn` (accelerators per node, or 1 on CPU nodes).
///
/// Rules: nothing given -> every host, `default_ppn` each. `--np` alone -> as few hosts as
/// `default_ppn` allows, ranks spread evenly. `--np` + `--ppn` -> `ceil(np/ppn)` hosts.
/// `--np` + `--nnodes` -> `np/nnodes` per node, which must divide. All three -> they must agree.
pub fn resolve_sizes(
    req: SizeRequest,
    hosts: usize,
    hosts_from: &str,
    default_ppn: usize,
) -> Result<Sizes, PlanError> {
    let err = |m: String| Err(PlanError(m));
    check_request(&req, hosts, hosts_from)?;
    let default_ppn = default_ppn.max(1);
    let sizes = match (req.np, req.ppn, req.nnodes) {
        (None, ppn, nnodes) => {
            let nnodes = nnodes.unwrap_or(hosts);
            let ppn = ppn.unwrap_or(default_ppn);
            let Some(np) = nnodes.checked_mul(ppn) else {
                return err(format!(
                    "{nnodes} nodes x {ppn} ranks per node is too many ranks"
                ));
            };
            Sizes { np, ppn, nnodes }
        }
        (Some(np), None, None) => {
            let nnodes = np.div_ceil(default_ppn).min(hosts).max(1);
            Sizes {
                np,
                ppn: np.div_ceil(nnodes),
                nnodes,
            }
        }
        (Some(np), Some(ppn), None) => {
            let nnodes = np.div_ceil(ppn);
            if nnodes > hosts {
                return err(format!(
                    "--np {np} with --ppn {ppn} needs {nnodes} hosts but {hosts_from} has {hosts}; \
                     lower --np, raise --ppn, or give a larger --hostfile"
                ));
            }
            Sizes { np, ppn, nnodes }
        }
        (Some(np), None, Some(nnodes)) => {
            if np % nnodes != 0 {
                return err(format!(
                    "--np {np} does not divide evenly over --nnodes {nnodes}; give --ppn as well to allow an uneven last node"
                ));
            }
            Sizes {
                np,
                ppn: np / nnodes,
                nnodes,
            }
        }
        (Some(np), Some(ppn), Some(nnodes)) => all_three(np, ppn, nnodes)?,
    };
    Ok(sizes)
}

/// Counts of 0, and more nodes than there are hosts, are refused whatever the other flags.
fn check_request(req: &SizeRequest, hosts: usize, hosts_from: &str) -> Result<(), PlanError> {
    for (flag, v) in [
        ("--np", req.np),
        ("--ppn", req.ppn),
        ("--nnodes", req.nnodes),
    ] {
        if v == Some(0) {
            return Err(PlanError(format!("{flag} must be at least 1")));
        }
    }
    match req.nnodes {
        Some(n) if n > hosts => Err(PlanError(format!(
            "--nnodes {n} asks for more hosts than {hosts_from} has ({hosts})"
        ))),
        _ => Ok(()),
    }
}

/// `--np`, `--ppn` and `--nnodes` all given: they must agree (only the last node may be
/// partly filled).
fn all_three(np: usize, ppn: usize, nnodes: usize) -> Result<Sizes, PlanError> {
    if nnodes.checked_mul(ppn).is_none_or(|total| np > total) {
        return Err(PlanError(format!(
            "--np {np} is more than --nnodes {nnodes} x --ppn {ppn} = {}",
            nnodes.saturating_mul(ppn)
        )));
    }
    if np <= (nnodes - 1).saturating_mul(ppn) {
        return Err(PlanError(format!(
            "--np {np} with --ppn {ppn} fills only {} of --nnodes {nnodes}; these three flags conflict",
            np.div_ceil(ppn)
        )));
    }
    Ok(Sizes { np, ppn, nnodes })
}

/// The program that starts the ranks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Launcher {
    /// kiln spawns each rank itself (no scheduler, no `--mpi`).
    Local,
    /// OpenMPI's `mpirun` (no scheduler, `--mpi`).
    Mpirun,
    /// `mpiexec` under PBS (Cray PALS or MPICH Hydra).
    Mpiexec,
    /// `srun` under Slurm.
    Srun,
}

impl Launcher {
    /// Lowercase name as written on the command line: `local`, `mpirun`, `mpiexec`, `srun`.
    pub fn name(self) -> &'static str {
        match self {
            Launcher::Local => "local",
            Launcher::Mpirun => "mpirun",
            Launcher::Mpiexec => "mpiexec",
            Launcher::Srun => "srun",
        }
    }
}

/// Everything needed to build the process list of one launch.
#[derive(Debug, Clone)]
pub struct PlanRequest {
    /// Which launcher.
    pub launcher: Launcher,
    /// Resolved sizes.
    pub sizes: Sizes,
    /// The hosts to use (already cut to `sizes.nnodes`).
    pub hosts: Vec<Host>,
    /// Hostfile handed to `mpiexec`/`mpirun` (listing exactly `hosts`), if any.
    pub hostfile: Option<PathBuf>,
    /// Whether the hosts were chosen explicitly (`--hostfile`, `--nnodes` below the
    /// allocation): then `srun` is told `--nodelist`.
    pub explicit_hosts: bool,
    /// CPU binding (`depth`, `cores`, `none`, ...); `None` or `none` adds no flag.
    pub cpu_bind: Option<String>,
    /// Cores per rank for `mpiexec --cpu-bind depth -d N`.
    pub depth: Option<usize>,
    /// GPUs per node to request from `srun` (0: no flag).
    pub gpus_per_node: usize,
    /// Flags given before `--` that kiln does not know: passed to the launcher verbatim.
    pub launcher_args: Vec<String>,
    /// Prefix run on each rank in front of the command so that it sees RANK & co. under
    /// any launcher (kiln's `launch --as-rank --`); empty for none.
    pub rank_shim: Vec<String>,
    /// The user's program and its arguments.
    pub command: Vec<String>,
    /// Variables every rank must see (MASTER_ADDR, MASTER_PORT, KILN_PROGRESS_DIR, ...).
    pub exports: Vec<(String, String)>,
    /// Whether kiln runs as root (OpenMPI then needs its explicit consent).
    pub as_root: bool,
    /// CPUs on this machine: a local `mpirun` beyond that needs `--oversubscribe`.
    pub local_cpus: usize,
}

/// One process kiln starts: the launcher (one) or a rank (local spawn, `np` of them).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ProcSpec {
    /// argv; `argv[0]` is looked up in PATH.
    pub argv: Vec<String>,
    /// Variables added to kiln's own environment for it.
    pub env: Vec<(String, String)>,
    /// The rank it runs, when it is exactly one rank (local spawn).
    pub rank: Option<usize>,
}

/// Builds the processes of one attempt.
pub fn build_plan(req: &PlanRequest) -> Result<Vec<ProcSpec>, PlanError> {
    if req.command.is_empty() {
        return Err(PlanError(
            "no command given: write it after `--`, e.g. `kiln launch -- python train.py`".into(),
        ));
    }
    let (argv, env) = match req.launcher {
        Launcher::Local => return local_procs(req),
        Launcher::Mpirun => mpirun(req),
        Launcher::Mpiexec => (mpiexec(req), req.exports.clone()),
        Launcher::Srun => (srun(req), req.exports.clone()),
    };
    let mut argv = argv;
    argv.extend(req.launcher_args.iter().cloned());
    argv.extend(req.rank_shim.iter().cloned());
    argv.extend(req.command.iter().cloned());
    Ok(vec![ProcSpec {
        argv,
        env,
        rank: None,
    }])
}

/// Owned text, for the argument lists.
fn s(x: &str) -> String {
    x.to_string()
}

/// The binding asked for (`--cpu-bind`), none when it is `none`.
fn bind(req: &PlanRequest) -> Option<&str> {
    req.cpu_bind.as_deref().filter(|b| *b != "none")
}

/// No launcher: one process a rank on this host, with torchrun's variables.
fn local_procs(req: &PlanRequest) -> Result<Vec<ProcSpec>, PlanError> {
    let Sizes { np, nnodes, .. } = req.sizes;
    if !req.launcher_args.is_empty() {
        return Err(PlanError(format!(
            "launcher flags {:?} were given but no launcher runs (no scheduler, no --mpi); \
             kiln's own flags must come before them",
            req.launcher_args
        )));
    }
    if nnodes > 1 {
        return Err(PlanError(format!(
            "{nnodes} nodes requested without a scheduler: pass --mpi to start ranks on other hosts with mpirun"
        )));
    }
    Ok((0..np)
        .map(|rank| {
            let mut env = vec![
                (s("RANK"), rank.to_string()),
                (s("LOCAL_RANK"), rank.to_string()),
                (s("WORLD_SIZE"), np.to_string()),
                (s("LOCAL_WORLD_SIZE"), np.to_string()),
            ];
            env.extend(req.exports.iter().cloned());
            ProcSpec {
                argv: req.command.clone(),
                env,
                rank: Some(rank),
            }
        })
        .collect())
}

/// OpenMPI's `mpirun`, its arguments before the command and its environment.
fn mpirun(req: &PlanRequest) -> (Vec<String>, Vec<(String, String)>) {
    let Sizes { np, ppn, .. } = req.sizes;
    let mut argv = vec![s("mpirun"), s("-np"), np.to_string()];
    let mut env = req.exports.clone();
    if let Some(f) = &req.hostfile {
        argv.extend([s("--hostfile"), f.display().to_string()]);
        argv.extend([s("--map-by"), format!("ppr:{ppn}:node")]);
    } else if np > req.local_cpus {
        // OpenMPI refuses more ranks than cores on the local machine by default;
        // a local run is a test or a workstation, where that is what the user wants.
        argv.push(s("--oversubscribe"));
    }
    if let Some(b) = bind(req) {
        argv.extend([s("--bind-to"), b.to_string()]);
    }
    // -x NAME forwards kiln's value of NAME to ranks on every host.
    for (k, _) in &req.exports {
        argv.extend([s("-x"), k.clone()]);
    }
    if req.as_root {
        // OpenMPI refuses to run as root (containers, CI) without explicit consent;
        // the variables work for OpenMPI 4 and 5 alike, unlike the flag spelling.
        env.push((s("OMPI_ALLOW_RUN_AS_ROOT"), s("1")));
        env.push((s("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM"), s("1")));
    }
    (argv, env)
}

/// `mpiexec` under PBS (Cray PALS or MPICH Hydra), its arguments before the command.
fn mpiexec(req: &PlanRequest) -> Vec<String> {
    let Sizes { np, ppn, .. } = req.sizes;
    let mut argv = vec![
        s("mpiexec"),
        s("--envall"),
        s("-n"),
        np.to_string(),
        s("-ppn"),
        ppn.to_string(),
    ];
    if let Some(f) = &req.hostfile {
        argv.extend([s("--hostfile"), f.display().to_string()]);
    }
    if let Some(b) = bind(req) {
        argv.extend([s("--cpu-bind"), b.to_string()]);
        if b == "depth" {
            argv.extend([s("-d"), req.depth.unwrap_or(1).max(1).to_string()]);
        }
    }
    argv
}

/// Slurm's `srun`, its arguments before the command.
fn srun(req: &PlanRequest) -> Vec<String> {
    let Sizes { np, ppn, nnodes } = req.sizes;
    let mut argv = vec![
        s("srun"),
        format!("--nodes={nnodes}"),
        format!("--ntasks={np}"),
        format!("--ntasks-per-node={ppn}"),
    ];
    if req.gpus_per_node > 0 {
        argv.push(format!("--gpus-per-node={}", req.gpus_per_node));
    }
    if let Some(b) = bind(req) {
        argv.push(format!("--cpu-bind={b}"));
    }
    if req.explicit_hosts {
        let names: Vec<&str> = req.hosts.iter().map(|h| h.name.as_str()).collect();
        argv.push(format!("--nodelist={}", names.join(",")));
    }
    // One dead rank leaves the others blocked in a collective: end the step at once
    // so the watchdog and the retry loop see the failure, not a hang.
    argv.push(s("--kill-on-bad-exit=1"));
    // A restarted attempt reuses the nodes of the step it replaces, whose ranks are
    // already dead but whose step Slurm ends only after its clean-up (KillWait and
    // more: 5-7 s measured, up to 30 s with the default KillWait); without this the
    // new step waits for it ("Requested nodes are busy"). kiln runs one step at a
    // time, so sharing the nodes' resources with a dying step is safe (Slurm 20.11+).
    argv.push(s("--overlap"));
    argv
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sizes(
        np: Option<usize>,
        ppn: Option<usize>,
        nnodes: Option<usize>,
        hosts: usize,
        dflt: usize,
    ) -> Result<Sizes, PlanError> {
        resolve_sizes(SizeRequest { np, ppn, nnodes }, hosts, "the hostfile", dflt)
    }

    #[test]
    fn sizes_resolve() {
        let t = |np, ppn, nnodes| (np, ppn, nnodes);
        let r = |s: Sizes| t(s.np, s.ppn, s.nnodes);
        assert_eq!(r(sizes(None, None, None, 4, 4).unwrap()), t(16, 4, 4));
        assert_eq!(r(sizes(None, Some(2), Some(3), 4, 4).unwrap()), t(6, 2, 3));
        assert_eq!(r(sizes(Some(6), None, None, 4, 4).unwrap()), t(6, 3, 2));
        assert_eq!(r(sizes(Some(3), None, None, 1, 1).unwrap()), t(3, 3, 1));
        assert_eq!(r(sizes(Some(5), Some(2), None, 4, 1).unwrap()), t(5, 2, 3));
        assert_eq!(r(sizes(Some(8), None, Some(2), 4, 1).unwrap()), t(8, 4, 2));
        assert_eq!(
            r(sizes(Some(7), Some(4), Some(2), 2, 1).unwrap()),
            t(7, 4, 2)
        );
    }

    #[test]
    fn conflicting_sizes_name_the_flags() {
        for (res, needle) in [
            (
                sizes(Some(5), Some(2), Some(2), 4, 1),
                "--nnodes 2 x --ppn 2",
            ),
            (sizes(Some(2), Some(2), Some(2), 4, 1), "conflict"),
            (sizes(Some(5), None, Some(2), 4, 1), "--nnodes 2"),
            (sizes(Some(8), Some(2), None, 2, 1), "needs 4 hosts"),
            (sizes(None, None, Some(3), 2, 1), "--nnodes 3"),
            (sizes(Some(0), None, None, 2, 1), "--np must be at least 1"),
        ] {
            let e = res.unwrap_err().to_string();
            assert!(e.contains(needle), "{e}");
        }
    }
}

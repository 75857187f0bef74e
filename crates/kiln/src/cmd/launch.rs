//! `kiln launch` and `kiln doctor`: flags in, a [`kiln_launch::LaunchRequest`] to the
//! library, lines out. All logic lives in kiln-topology and kiln-launch.

use kiln_launch::{
    Diagnosis, LaunchEnd, LaunchOptions, LaunchRequest, Setup, TopologyFlags, find_in_path,
    local_cpus, prepare, probe_tool,
};
use kiln_topology::RankEnv;
use std::process::ExitCode;

/// What `kiln launch --help` says after the flags, before its exit codes.
const LAUNCH_ABOUT: &str = "\
Usage:
  kiln launch [KILN FLAGS] [LAUNCHER FLAGS] -- PROGRAM [ARGS...]

  Flags before `--` that kiln does not know are passed to the launcher (mpiexec, srun,
  mpirun) verbatim, after kiln's own; kiln's flags must come first.

Launcher (chosen from the detected scheduler, see `kiln doctor`):
  PBS (PBS_JOBID)     mpiexec --envall -n NP -ppn PPN --hostfile $PBS_NODEFILE --cpu-bind depth -d D
  Slurm (SLURM_JOB_ID) srun --nodes --ntasks --ntasks-per-node [--gpus-per-node] [--cpu-bind]
                       [--nodelist] --kill-on-bad-exit=1 --overlap
  none                ranks spawned locally (at most 4 per CPU, at least 8, unless
                      --oversubscribe); with --mpi: mpirun -np NP (-x forwards variables; as
                      root kiln sets OMPI_ALLOW_RUN_AS_ROOT=1, OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1)
  Under a launcher every rank runs `kiln launch --as-rank -- PROGRAM ...`, which sets RANK,
  LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE from the launcher's variables, runs PROGRAM,
  records its exit in $KILN_PROGRESS_DIR/exit-<rank> (with the host), ends whatever PROGRAM
  left running (a leftover holding the output would keep the launcher waiting), and exits
  as PROGRAM did. Every rank also sees MASTER_ADDR, MASTER_PORT (a free port unless
  --master-port; 0 is refused), KILN_PROGRESS_DIR, and PYTHONUNBUFFERED=1 unless it is set.
  Locally spawned ranks write stdout to a pseudo-terminal (as under mpirun), so buffered
  programs flush every line.

Progress and watchdogs:
  Progress is the largest step number matched by --progress-regex in the output (ANSI codes
  stripped, invalid UTF-8 tolerated), and per-rank beacon files $KILN_PROGRESS_DIR/rank-<R>
  holding `<step> <phase> <unix_time> <host> [<work_s>]` (kiln's trainer writes them; any
  program may). `<work_s>`, the seconds the rank worked on its step before (its step less
  its wait for the others), names stragglers: a rank that costs the job a quarter of its
  speed for 20 steps in a row (a `straggler` event, with --straggler-is-node-failure a node
  failure).
  --timeout fires on silence (no output, no beacon update); --stall-timeout fires when output
  continues but progress stops, armed once the first progress is seen. Without
  --stall-timeout, ranks that write beacons are stopped when progress stalls for 10 x the
  slowest of their recent step times (at least 3 s; an eval or checkpoint phase: 10 x its
  longest duration seen, not timed the first time); --stall-timeout 0 turns it off. When one
  fires, kiln names the ranks that stopped advancing first (a rank whose beacon phase is
  allreduce, collective, barrier or wait is waiting on the others and is named only if every
  rank is; kiln's trainer is marked `collective` while it waits in one); ranks that output
  alone cannot tell apart (the same last step) are not named, nor is any rank when all are
  tied; each piece of evidence says where it came from (beacon, output, liveness, heartbeat,
  exit-record, exit-status). It then sends SIGTERM to every process group, waits --grace seconds (at most 1 s after a
  rank was lost: killed by a signal or silent), then SIGKILL. Every duration is a positive
  number of seconds, at most a year.";

/// What `kiln launch --help` says about recovery, after its exit codes.
const LAUNCH_RECOVERY: &str = "\
Node scope (--auto-retry, or --spares N):
  The allocation is split into active hosts and spares (--spares, default about 2 %, at least
  1 when there are two or more hosts; with --nnodes, every host beyond it is a spare); hosts in
  the quarantine file(s) are left out. After a failed attempt kiln names the culprit host from,
  strongest first: the scheduler (a host that left the job or is down/drained), log lines (srun
  `Node failure on nX` and `nX: task N: Exited with exit code`, PALS `rank N died from
  signal`/shepherd, OpenMPI `on node X exited on signal`/lost daemon, gloo `Connection closed by
  peer [X]`, NCCL `remote peer X<port>`, Hydra `[proxy:..@X]`), the trainer's replica_mismatch
  event, per-rank beacons (the rank that stopped advancing first, on its host; when ranks
  stopped together, as in a collective, the one whose process is stopped or uses no CPU while
  the others spin, from $KILN_PROGRESS_DIR/live-<rank> written by the rank shim), per-rank
  exit records (the rank that failed first). Evidence that blames every host names none. Then:
    culprit named   a node failure or a replica mismatch: swap it for a spare (same rank
                    positions), quarantine it, relaunch; a crash or a hang: retry on the same
                    hosts, and swap the host so at its --strikes'th (default 2) such failure in
                    the launch. With no spare left, drop it if --min-nodes allows, else stop
                    with 69. Before any step only a node failure or a replica mismatch is worth
                    a spare
    no evidence     after progress: swap rank 0's host as a guess (a blind swap, counted apart);
                    before any step, or a preemption: retry on the same hosts
    deterministic   exit 2/65/73/78, two attempts in a row that completed no step, or the same
                    error twice in a row (before any step, or at the same step): stop with the
                    program's code; no spare is used
  Quarantined hosts go to RUN_DIR/quarantine.jsonl and --quarantine-file (a shared file later
  jobs read: `kiln launch` skips and `kiln submit` excludes the hosts it lists).
  Node state: when the launch ends for good (success, recovery given up, a stop, the
  walltime), it removes the memory snapshots its ranks recorded (RUN_DIR/progress/node-*) on
  every node an attempt used but quarantined ones: its own host directly, the others through
  the launcher, once per node (event nodes_released). Whether the job resumes on the same
  nodes decides (--memory-tier-at-end, default auto): under a scheduler the allocation ends
  with the job and a chained job runs elsewhere, so they go; without one the same command
  resumes on the same machines, so they stay (that run deletes the ones its persistent
  checkpoint made stale). Open MPI shared-memory segments (/dev/shm/vader_segment.*) of ranks
  that did not finalise always go: each shim removes its rank's, the launcher the rest of
  each attempt's.
  Job scope (`kiln submit`) adds --chain/--chain-script: at the end of a batch job whose exit is
  75 or 69, if it made progress and the chain limit allows, kiln submits the next job.

Events (RUN_DIR/events.jsonl): launch_start, job_start, host_pool, attempt_start, attempt_end
(argv, hosts, times, exit code, classification, progress, culprit ranks and hosts, evidence,
time to detect), node_swap, quarantine, shrink, backoff, stopped, nodes_released, launch_end,
job_submitted, chain.";

const LAUNCH_EXAMPLES: &str = "\
Examples:
  kiln launch --timeout 600 --stall-timeout 300 --retries 3 -- kiln train configs/tiny.toml
  kiln launch --auto-retry --spares 2 --stall-timeout 300 --run-dir runs/a -- kiln train --run-dir runs/a
  kiln launch --mpi --np 2 -- python -m torchtitan.train --job.config_file cfg.toml
  kiln launch --dry-run --nnodes 2 --ppn 4 -- python train.py     # print the argv only
  kiln launch --np 8 --ppn 4 --cpu-bind none --no-vni -- ./a.out  # --no-vni goes to mpiexec";

/// What `kiln launch --help` says after the flags; the exit codes come from kiln-launch's
/// table of endings, the run directory from kiln-run's table.
fn launch_help() -> String {
    format!(
        "{LAUNCH_ABOUT}\n\nExit codes and classifications (classification is written to \
         RUN_DIR/events.jsonl):\n{}\n\n{LAUNCH_RECOVERY}\n\nRun directory (--run-dir; give \
         the trainer the same directory so `kiln status` sees both):\n{}\n\n{LAUNCH_EXAMPLES}",
        super::help::launch_exit_listing(),
        super::help::run_dir_listing()
    )
}

/// Arguments of `kiln launch`.
#[derive(Debug, clap::Args)]
#[command(after_long_help = launch_help())]
pub struct LaunchArgs {
    /// kiln's own flags (defined in kiln-launch); boxed so the CLI's command enum stays small.
    #[command(flatten)]
    pub flags: Box<LaunchRequest>,

    /// [LAUNCHER FLAGS] -- PROGRAM [ARGS...]: the program to run on every rank, after `--`.
    #[arg(
        value_name = "ARGS",
        trailing_var_arg = true,
        allow_hyphen_values = true
    )]
    pub command: Vec<String>,
}

/// Arguments of `kiln doctor`.
#[derive(Debug, clap::Args)]
#[command(after_long_help = "\
Prints, with the reason for each: the scheduler (PBS_JOBID/PBS_NODEFILE, SLURM_JOB_ID/
SLURM_JOB_NODELIST, or none), the hosts, the accelerators per node (CUDA_VISIBLE_DEVICES,
ROCR_VISIBLE_DEVICES, HIP_VISIBLE_DEVICES, ZE_AFFINITY_MASK, or nvidia-smi/rocm-smi/xpu-smi),
this process's rank environment (from RANK, OMPI_COMM_WORLD_*, PMI_*, PALS_*, SLURM_*), the
launchers found in PATH, the launcher `kiln launch` would use, and the memory tiers this node
holds (each run's memory snapshots: its run directory, steps, size, and whether the next kiln
start here reclaims it; see docs/recovery.md).

With --device, it also checks that device before a long run trusts it: each of kiln's fused
kernels against its composed twin (values and every gradient; f32, and bf16 where the device
has it), and on CUDA that NCCL opens, joins and reduces (one rank).

Exit codes:
  0  everything detected (and every device check passed)
  1  something could not be detected (malformed hostfile or nodelist, bad rank variables), or a
     device check failed; the report says what")]
pub struct DoctorArgs {
    /// The flags that override detection, as `kiln launch` takes them (defined once, in
    /// kiln-launch).
    #[command(flatten)]
    pub topology: TopologyFlags,
    /// Also check this device (as `training.device` names it: cuda, rocm, vulkan, wgpu, metal,
    /// cubecl-cpu, flex): kiln's fused kernels against their composed twins, and NCCL on CUDA.
    #[arg(long, value_name = "DEVICE")]
    pub device: Option<String>,
    /// The node-local snapshot directory whose memory tiers to list (as
    /// `checkpoint.snapshot_dir`; default /dev/shm, else the system's temporary directory).
    #[arg(long, value_name = "DIR", default_value = "")]
    pub snapshot_dir: String,
}

fn env_var(k: &str) -> Option<String> {
    std::env::var(k).ok()
}

fn print_attempt_end(i: u32, o: &kiln_launch::AttemptOutcome, d: &Diagnosis) {
    let progress = o
        .last_progress
        .map_or(String::new(), |s| format!(", last step {s}"));
    let msg = o
        .message
        .as_deref()
        .map_or(String::new(), |m| format!(": {m}"));
    let culprit = if d.hosts.is_empty() {
        String::new()
    } else {
        format!("; {} on {}", d.cause, d.hosts.join(", "))
    };
    eprintln!(
        "kiln: attempt {i} {} (exit {}{progress}){msg}{culprit}",
        o.classification.name(),
        o.exit_code
    );
}

/// `kiln launch`.
pub fn run(args: LaunchArgs) -> anyhow::Result<ExitCode> {
    let LaunchArgs { flags, command } = args;
    let flags = LaunchRequest { command, ..*flags };
    if flags.as_rank {
        return Ok(as_rank(&flags));
    }
    if flags.release_node {
        return Ok(super::exit_code(kiln_launch::release_node(
            flags.memory_tier_at_end == "keep",
        )));
    }
    match kiln_launch::launch(&flags, &print_attempt_end) {
        Ok(LaunchEnd::DryRun(text)) => {
            print!("{text}");
            Ok(ExitCode::SUCCESS)
        }
        Ok(LaunchEnd::Done {
            exit_code,
            attempts,
            classification,
            stop_reason,
            run_dir,
        }) => {
            if let Some(reason) = stop_reason {
                eprintln!("kiln: stopped: {reason}");
            }
            if classification != kiln_launch::Classification::Success && attempts > 1 {
                eprintln!(
                    "kiln: giving up after {attempts} attempts; see {}",
                    run_dir.join(kiln_run::layout::EVENTS).display()
                );
            }
            Ok(super::exit_code(exit_code))
        }
        Err(e) => Err(anyhow::Error::new(e).context("launch")),
    }
}

/// `kiln launch --as-rank`: what each rank runs under a launcher. It reports its own errors
/// (prefixed with `--as-rank`, as the launcher mixes every rank's output) and exits as the
/// program did.
fn as_rank(flags: &LaunchRequest) -> ExitCode {
    let usage = |e: String| {
        eprintln!("kiln launch --as-rank: error: {e}");
        super::exit_code(kiln_run::exit::USAGE)
    };
    let command = match kiln_launch::split_command(&flags.command) {
        Ok((_, c)) => c,
        Err(e) => return usage(e),
    };
    let beat =
        match kiln_launch::limits_seconds("--heartbeat-timeout", flags.heartbeat_timeout, false) {
            Ok(b) => b,
            Err(e) => return usage(e),
        };
    match kiln_launch::run_as_rank(&command, Some(beat)) {
        Ok(end) => kiln_launch::exit_like(end),
        Err(e) => {
            eprintln!("kiln launch --as-rank: {e}");
            super::exit_code(e.exit_code())
        }
    }
}

/// `kiln doctor`: what `kiln launch` would detect and use here, each with its reason.
pub fn doctor(args: DoctorArgs) -> anyhow::Result<ExitCode> {
    let dir = std::env::temp_dir();
    let opts = LaunchOptions {
        request: LaunchRequest {
            topology: args.topology,
            ..LaunchRequest::default()
        },
        command: vec!["PROGRAM".into()],
        progress_dir: dir.join(kiln_run::layout::PROGRESS),
        run_dir: dir,
        ..LaunchOptions::default()
    };
    let setup = prepare(
        &opts,
        &env_var,
        &probe_tool,
        local_cpus(),
        kiln_launch::running_as_root(),
    );
    let mut ok = true;
    match setup {
        Ok(s) => print_setup(&s)?,
        Err(e) => {
            ok = false;
            println!("topology:      ERROR {e}");
        }
    }
    ok &= print_rank_env();
    for tool in [
        "mpiexec",
        "mpirun",
        "srun",
        "nvidia-smi",
        "rocm-smi",
        "xpu-smi",
    ] {
        let at = find_in_path(tool).map_or("not found".to_string(), |p| p.display().to_string());
        println!("{:<14} {at}", format!("{tool}:"));
    }
    print_memory_tiers(&args.snapshot_dir);
    if let Some(name) = &args.device {
        ok &= print_device_checks(name)?;
    }
    Ok(if ok {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    })
}

/// The memory tiers this node holds in `snapshot_dir`, each with what the next kiln start here
/// does with it (see `kiln_train::components::checkpoints::snapshot::tiers`).
fn print_memory_tiers(snapshot_dir: &str) {
    use kiln_train::components::checkpoints::snapshot::tiers;
    let base = tiers::base_dir(snapshot_dir);
    let held = tiers::survey(&base);
    let total: u64 = held.iter().map(|h| h.bytes).sum();
    println!(
        "memory tiers:  {} in {} ({})",
        held.len(),
        base.display(),
        kiln_run::host::human_bytes(total as f64)
    );
    for h in held {
        println!("  {}", h.describe());
    }
}

/// `kiln doctor --device`: each kernel check (kiln_train::kernels::selfcheck) in f32 and, where
/// the device has it, bf16, then NCCL's one-rank check; under `kiln launch` with several ranks
/// (`WORLD_SIZE` > 1), only NCCL across the ranks (each collective kiln uses, on known values;
/// the kernel checks are one rank's, a plain `kiln doctor`). Whether all passed (on every
/// rank).
fn print_device_checks(name: &str) -> anyhow::Result<bool> {
    let device = kiln_train::model::session::parse_device(name)?;
    let env = RankEnv::from_process_env()?;
    if env.world_size > 1 {
        let comm = kiln_dist::init(&env, false)?;
        let mut ok = true;
        let r = comm.rank();
        match kiln_train::parallel::nccl::check_ranks(comm.as_ref(), &device) {
            Ok(None) => println!("nccl:          rank {r}: not used on {name}"),
            Ok(Some(c)) => {
                let verdict = if c.passed() { "ok" } else { "FAIL" };
                println!(
                    "nccl:          rank {r} of {}: all-reduce {:.1e}, reduce-scatter {:.1e}, all-gather {:.1e} (relative to the known answer) {verdict}",
                    c.ranks, c.all_reduce, c.reduce_scatter, c.all_gather
                );
                ok &= c.passed();
            }
            Err(e) => {
                ok = false;
                println!("nccl:          rank {r}: ERROR {e}");
            }
        }
        // Every rank's verdict: a rank that failed fails the job.
        let mut failed = [u64::from(!ok)];
        comm.all_reduce_max_u64(&mut failed);
        return Ok(failed[0] == 0);
    }
    let mut ok = print_kernel_checks(name)?;
    match kiln_train::parallel::nccl::check_one_rank(&device) {
        Ok(None) => {
            println!("nccl:          not used on {name} (gradients staged through host memory)")
        }
        Ok(Some(0.0)) => {
            println!("nccl:          ok (one rank: joined, reduced, handed back)")
        }
        Ok(Some(d)) => {
            ok = false;
            println!("nccl:          FAIL (one rank changed the gradients by {d:.2e})");
        }
        Err(e) => {
            ok = false;
            println!("nccl:          ERROR {e}");
        }
    }
    Ok(ok)
}

/// Each kernel check in f32 and, where the device has it, bf16; whether all passed.
fn print_kernel_checks(name: &str) -> anyhow::Result<bool> {
    let device = kiln_train::model::session::parse_device(name)?;
    let mut ok = true;
    for (dtype, checks) in kiln_train::kernels::selfcheck::run_each_type(&device) {
        let checks = match checks {
            Ok(checks) => checks,
            Err(why) => {
                println!("kernels {dtype}: skipped ({why})");
                continue;
            }
        };
        println!("kernels {dtype} on {name} (relative difference to the composed twin):");
        for c in checks {
            let verdict = if c.passed() { "ok" } else { "FAIL" };
            println!(
                "  {:<34} {:<5} {:>9.2e} (tolerance {:.0e}, {} values) {verdict}",
                c.kernel, c.part, c.rel_diff, c.tolerance, c.values
            );
            ok &= c.passed();
        }
    }
    Ok(ok)
}

/// The scheduler, hosts, accelerators and launcher `kiln doctor` found, each with why.
fn print_setup(s: &Setup) -> anyhow::Result<()> {
    println!(
        "scheduler:     {}  ({})",
        s.scheduler.value.name(),
        s.scheduler.reason
    );
    let names: Vec<String> = s
        .hosts
        .value
        .iter()
        .map(|h| format!("{}[{}]", h.name, h.slots))
        .collect();
    println!(
        "hosts:         {} host(s): {}  ({})",
        names.len(),
        names.join(" "),
        s.hosts.reason
    );
    let a = s.accelerators.value;
    println!(
        "accelerators:  {} x {} per node  ({})",
        a.count,
        a.kind.name(),
        s.accelerators.reason
    );
    println!("cpus here:     {}", local_cpus());
    println!(
        "kiln launch:   {} with np {}, ppn {}, nnodes {}",
        s.launcher.name(),
        s.sizes.np,
        s.sizes.ppn,
        s.sizes.nnodes
    );
    if let Some(p) = s.procs.first() {
        println!("  argv:        {}", serde_json::to_string(&p.argv)?);
    }
    Ok(())
}

/// This process's rank environment; false when its variables are malformed.
fn print_rank_env() -> bool {
    match RankEnv::from_process_env() {
        Ok(r) => {
            println!(
                "rank env:      rank {} of {}, local {} of {}, master {}:{}  (source: {})",
                r.rank,
                r.world_size,
                r.local_rank,
                r.local_world_size,
                r.master_addr.as_deref().unwrap_or("(unset)"),
                r.master_port
                    .map_or("(unset)".to_string(), |p| p.to_string()),
                r.source
            );
            true
        }
        Err(e) => {
            println!("rank env:      ERROR {e}");
            false
        }
    }
}

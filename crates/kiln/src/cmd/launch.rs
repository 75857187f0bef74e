//! `kiln launch` and `kiln doctor`: flags in, a [`kiln_launch::LaunchRequest`] to the
//! library, lines out. All logic lives in kiln-topology and kiln-launch.

use kiln_launch::{
    Diagnosis, LaunchEnd, LaunchOptions, LaunchRequest, find_in_path, local_cpus, prepare,
    probe_tool,
};
use kiln_topology::RankEnv;
use std::path::PathBuf;
use std::process::ExitCode;

const LAUNCH_ABOUT: &str = "\
Usage:
  kiln launch [KILN FLAGS] [LAUNCHER FLAGS] -- PROGRAM [ARGS...]

  Flags before `--` that kiln does not know are passed to the launcher (mpiexec, srun,
  mpirun) verbatim, after kiln's own; kiln's flags must come first.

Launcher (chosen from the detected scheduler, see `kiln doctor`):
  PBS (PBS_JOBID)     mpiexec --envall -n NP -ppn PPN --hostfile $PBS_NODEFILE --cpu-bind depth -d D
  Slurm (SLURM_JOB_ID) srun --nodes --ntasks --ntasks-per-node [--gpus-per-node] [--cpu-bind]
                       [--nodelist] --kill-on-bad-exit=1
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
  holding `<step> <phase> <unix_time> <host>` (kiln's trainer writes them; any program may).
  --timeout fires on silence (no output, no beacon update); --stall-timeout fires when output
  continues but progress stops, armed once the first progress is seen. Without
  --stall-timeout, ranks that write beacons are stopped when progress stalls for 10 x the
  slowest of their recent step times (at least 3 s; an eval or checkpoint phase: 10 x its
  longest duration seen, not timed the first time); --stall-timeout 0 turns it off. When one
  fires, kiln names the ranks that stopped advancing first (a rank whose beacon phase is
  allreduce, collective, barrier or wait is waiting on the others and is named only if every
  rank is), sends SIGTERM to every process group, waits --grace seconds, then SIGKILL. Every
  duration is a positive number of seconds, at most a year.

Exit codes and classifications (classification is written to RUN_DIR/events.jsonl):
  0        success           every rank exited 0
  N        failed            the program's own non-zero exit code (the first rank to fail)
  N        deterministic     a rank exited 2, 65, 73 or 78 (usage, guard stop, run directory
                             locked, invalid config or input): the same input fails the same
                             way, so it is never retried and no spare is used
  76       replica-mismatch  data-parallel replicas disagree; retried, and under node scope
                             the host of the named rank is swapped
  124      hung-silent       --timeout: no output for S seconds
  124      hung-stalled      --stall-timeout (or its default, a multiple of the step time):
                             progress did not advance
  124      no-heartbeat      --heartbeat-timeout: a rank that beat fell silent (stopped,
                             wedged); it was killed and the rank and host are named
  128+N    killed-by-signal  a rank died of signal N kiln did not send (137: SIGKILL, e.g. OOM)
  75       preempted         the program exited 75 (checkpointed, resumable) and no retry is left
  75       walltime          --walltime ran out or kiln got SIGUSR1; ranks got SIGTERM/SIGUSR1
  69       (spares exhausted) node scope had no healthy host left to replace a failed one and
                             --min-nodes forbids shrinking; a new allocation resumes the run
  127      not-found         the program or the launcher does not exist
  126      not-found         the program exists but cannot be executed
  130/143/129 interrupted    kiln got SIGINT/SIGTERM/SIGHUP, forwarded it and stopped retrying;
                             if the ranks exited with a code after that, that code (75: resumable)
  2        (usage)           bad flags, conflicting or absurd sizes, malformed hostfile or
                             visible-device list; nothing started
  Retried (with --retries/--auto-retry): failed, replica-mismatch, hung-silent, hung-stalled,
  no-heartbeat, killed-by-signal, preempted. Never retried: success, deterministic, not-found, walltime,
  interrupted. A launcher that keeps running after every rank left its exit record is
  classified by the ranks' exits, not as a hang.

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
    culprit named   swap it for a spare (same rank positions), quarantine it, relaunch; with no
                    spare left, drop it if --min-nodes allows, else stop with 69. Before any
                    step only a node failure or a replica mismatch is worth a spare
    no evidence     after progress: swap rank 0's host as a guess (a blind swap, counted apart);
                    before any step, or a preemption: retry on the same hosts
    deterministic   exit 2/65/73/78, two attempts in a row that completed no step, or the same
                    error twice in a row (before any step, or at the same step): stop with the
                    program's code; no spare is used
  Quarantined hosts go to RUN_DIR/quarantine.jsonl and --quarantine-file (a shared file later
  jobs read: `kiln launch` skips and `kiln submit` excludes the hosts it lists).
  Job scope (`kiln submit`) adds --chain/--chain-script: at the end of a batch job whose exit is
  75 or 69, if it made progress and the chain limit allows, kiln submits the next job.

Events (RUN_DIR/events.jsonl): launch_start, job_start, host_pool, attempt_start, attempt_end
(argv, hosts, times, exit code, classification, progress, culprit ranks and hosts, evidence,
time to detect), node_swap, quarantine, shrink, backoff, stopped, launch_end, job_submitted,
chain.";

const LAUNCH_EXAMPLES: &str = "\
Examples:
  kiln launch --timeout 600 --stall-timeout 300 --retries 3 -- kiln train configs/tiny.toml
  kiln launch --auto-retry --spares 2 --stall-timeout 300 --run-dir runs/a -- kiln train --run-dir runs/a
  kiln launch --mpi --np 2 -- python -m torchtitan.train --job.config_file cfg.toml
  kiln launch --dry-run --nnodes 2 --ppn 4 -- python train.py     # print the argv only
  kiln launch --np 8 --ppn 4 --cpu-bind none --no-vni -- ./a.out  # --no-vni goes to mpiexec";

/// What `kiln launch --help` says after the flags; the run directory comes from kiln-run's
/// table.
fn launch_help() -> String {
    format!(
        "{LAUNCH_ABOUT}\n\nRun directory (--run-dir; give the trainer the same directory so \
         `kiln status` sees both):\n{}\n\n{LAUNCH_EXAMPLES}",
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
launchers found in PATH, and the launcher `kiln launch` would use.

Exit codes:
  0  everything detected
  1  something could not be detected (malformed hostfile or nodelist, bad rank variables);
     the report says what")]
pub struct DoctorArgs {
    /// Hostfile to check instead of the scheduler's host list.
    #[arg(long, value_name = "FILE")]
    pub hostfile: Option<PathBuf>,
    /// Scheduler, overriding detection.
    #[arg(long, value_name = "NAME", value_parser = ["auto", "pbs", "slurm", "none"], default_value = "auto")]
    pub scheduler: String,
    /// Accelerator kind, overriding detection.
    #[arg(long, value_name = "KIND", value_parser = ["auto", "nvidia", "amd", "intel", "cpu"], default_value = "auto")]
    pub accelerator: String,
    /// Accelerators per node, overriding detection.
    #[arg(long, value_name = "N")]
    pub gpus_per_node: Option<usize>,
    /// Report what `--mpi` would use when there is no scheduler.
    #[arg(long)]
    pub mpi: bool,
}

fn exit(code: i32) -> ExitCode {
    ExitCode::from(u8::try_from(code).unwrap_or(1))
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
    let command = &flags.command;
    if flags.as_rank {
        let command = match kiln_launch::split_command(command) {
            Ok((_, c)) => c,
            Err(e) => {
                eprintln!("kiln launch --as-rank: error: {e}");
                return Ok(exit(kiln_run::exit::USAGE));
            }
        };
        let beat =
            kiln_launch::limits_seconds("--heartbeat-timeout", flags.heartbeat_timeout, false);
        let beat = match beat {
            Ok(b) => b,
            Err(e) => {
                eprintln!("kiln launch --as-rank: error: {e}");
                return Ok(exit(kiln_run::exit::USAGE));
            }
        };
        return match kiln_launch::run_as_rank(&command, Some(beat)) {
            Ok(end) => kiln_launch::exit_like(end),
            Err(e) => {
                eprintln!("kiln launch --as-rank: {e}");
                Ok(exit(e.exit_code()))
            }
        };
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
            Ok(exit(exit_code))
        }
        Err(e) => Err(anyhow::Error::new(e).context("launch")),
    }
}

/// `kiln doctor`.
pub fn doctor(args: DoctorArgs) -> anyhow::Result<ExitCode> {
    let mut ok = true;
    let dir = std::env::temp_dir();
    let opts = LaunchOptions {
        request: LaunchRequest {
            scheduler: args.scheduler,
            hostfile: args.hostfile,
            mpi: args.mpi,
            accelerator: args.accelerator,
            gpus_per_node: args.gpus_per_node,
            ..LaunchRequest::default()
        },
        command: vec!["PROGRAM".into()],
        progress_dir: dir.join(kiln_run::layout::PROGRESS),
        run_dir: dir,
        ..LaunchOptions::default()
    };
    match prepare(
        &opts,
        &env_var,
        &probe_tool,
        local_cpus(),
        kiln_launch::running_as_root(),
    ) {
        Ok(s) => {
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
        }
        Err(e) => {
            ok = false;
            println!("topology:      ERROR {e}");
        }
    }
    match RankEnv::from_process_env() {
        Ok(r) => println!(
            "rank env:      rank {} of {}, local {} of {}, master {}:{}  (source: {})",
            r.rank,
            r.world_size,
            r.local_rank,
            r.local_world_size,
            r.master_addr.as_deref().unwrap_or("(unset)"),
            r.master_port
                .map_or("(unset)".to_string(), |p| p.to_string()),
            r.source
        ),
        Err(e) => {
            ok = false;
            println!("rank env:      ERROR {e}");
        }
    }
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
    Ok(if ok {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    })
}

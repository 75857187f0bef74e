//! `kiln launch` and `kiln doctor`: flags in, a [`kiln_launch::Setup`] and the retry loop out.
//! All logic lives in kiln-topology and kiln-launch; this file maps flags and prints.

use anyhow::Context;
use kiln_launch::{
    AttemptConfig, AttemptOutcome, Backoff, Classification, DEFAULT_PROGRESS_REGEX, LaunchOptions,
    Launcher, ProgressRegex, RetryConfig, RetryLimit, SizeRequest, find_in_path, prepare,
    probe_tool,
};
use kiln_run::{EventLog, PROGRESS_DIR_ENV};
use kiln_topology::RankEnv;
use serde_json::json;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::{Duration, Instant};

/// Exit code for bad flags, hostfiles or sizes (as clap uses for usage errors).
const USAGE_EXIT: u8 = 2;

const LAUNCH_HELP: &str = "\
Usage:
  kiln launch [KILN FLAGS] [LAUNCHER FLAGS] -- PROGRAM [ARGS...]

  Flags before `--` that kiln does not know are passed to the launcher (mpiexec, srun,
  mpirun) verbatim, after kiln's own; kiln's flags must come first.

Launcher (chosen from the detected scheduler, see `kiln doctor`):
  PBS (PBS_JOBID)     mpiexec --envall -n NP -ppn PPN --hostfile $PBS_NODEFILE --cpu-bind depth -d D
  Slurm (SLURM_JOB_ID) srun --nodes --ntasks --ntasks-per-node [--gpus-per-node] [--cpu-bind]
                       --kill-on-bad-exit=1
  none                ranks spawned locally; with --mpi: mpirun -np NP (-x forwards variables;
                      as root kiln sets OMPI_ALLOW_RUN_AS_ROOT=1, OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1)
  Under a launcher every rank runs `kiln launch --as-rank -- PROGRAM ...`, which sets RANK,
  LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE from the launcher's variables and execs PROGRAM.
  Every rank also sees MASTER_ADDR, MASTER_PORT and KILN_PROGRESS_DIR.

Progress and watchdogs:
  Progress is the largest step number matched by --progress-regex in the output (ANSI codes
  stripped, invalid UTF-8 tolerated), and per-rank beacon files $KILN_PROGRESS_DIR/rank-<R>
  holding `<step> <phase> <unix_time>` (kiln's trainer writes them; any program may).
  --timeout fires on silence (no output, no beacon update); --stall-timeout fires when output
  continues but progress stops, armed once the first progress is seen. When one fires, kiln
  names the ranks that stopped advancing first, sends SIGTERM to every process group, waits
  --grace seconds, then SIGKILL.

Exit codes and classifications (classification is written to RUN_DIR/events.jsonl):
  0        success           every rank exited 0
  N        failed            the program's own non-zero exit code (the first rank to fail)
  124      hung-silent       --timeout: no output for S seconds
  124      hung-stalled      --stall-timeout: progress did not advance for S seconds
  128+N    killed-by-signal  a rank died of signal N kiln did not send (137: SIGKILL, e.g. OOM)
  75       preempted         the program exited 75 (checkpointed, resumable) and no retry is left
  75       walltime          --walltime ran out or kiln got SIGUSR1; ranks got SIGTERM/SIGUSR1
  127      not-found         the program or the launcher does not exist
  126      not-found         the program exists but cannot be executed
  130/143/129 interrupted    kiln got SIGINT/SIGTERM/SIGHUP, forwarded it and stopped retrying;
                             if the ranks exited with a code after that, that code (75: resumable)
  2        (usage)           bad flags, conflicting sizes, malformed hostfile; nothing started
  Retried (with --retries/--auto-retry): failed, hung-silent, hung-stalled, killed-by-signal,
  preempted. Never retried: success, not-found, walltime, interrupted.

Run directory (--run-dir):
  events.jsonl      launch_start, attempt_start, attempt_end (argv, hosts, start/end time,
                    exit code, classification, last progress, culprit ranks, time to detect),
                    backoff, launch_end
  attempt-<i>.log   raw bytes of attempt i's output (stdout and stderr)
  progress/         $KILN_PROGRESS_DIR, cleared before each attempt (unless set by the caller)
  hostfile          the hosts used, when fewer than the allocation's

Examples:
  kiln launch --timeout 600 --stall-timeout 300 --retries 3 -- kiln train configs/tiny.toml
  kiln launch --mpi --np 2 -- python -m torchtitan.train --job.config_file cfg.toml
  kiln launch --dry-run --nnodes 2 --ppn 4 -- python train.py     # print the argv only
  kiln launch --np 8 --ppn 4 --cpu-bind none --no-vni -- ./a.out  # --no-vni goes to mpiexec";

/// Arguments of `kiln launch`.
#[derive(Debug, clap::Args)]
#[command(after_long_help = LAUNCH_HELP)]
pub struct LaunchArgs {
    /// kiln's own flags; boxed so the CLI's command enum stays small.
    #[command(flatten)]
    pub flags: Box<LaunchFlags>,

    /// [LAUNCHER FLAGS] -- PROGRAM [ARGS...]: the program to run on every rank, after `--`.
    #[arg(
        value_name = "ARGS",
        trailing_var_arg = true,
        allow_hyphen_values = true
    )]
    pub command: Vec<String>,
}

/// The flags of `kiln launch`.
#[derive(Debug, clap::Args)]
pub struct LaunchFlags {
    /// Total number of ranks [default: nodes x ranks per node].
    #[arg(long, value_name = "N", help_heading = "Sizes")]
    pub np: Option<usize>,
    /// Ranks per node [default: accelerators per node, or 1 on CPU nodes; all ranks locally].
    #[arg(long, value_name = "N", help_heading = "Sizes")]
    pub ppn: Option<usize>,
    /// Number of nodes to use [default: every host of the allocation, or as --np needs].
    #[arg(long, value_name = "N", help_heading = "Sizes")]
    pub nnodes: Option<usize>,
    /// Hosts to use instead of the scheduler's: `host`, `host slots=N` or `host:N` per line.
    #[arg(long, value_name = "FILE", help_heading = "Sizes")]
    pub hostfile: Option<PathBuf>,

    /// Scheduler, overriding detection from PBS_JOBID / SLURM_JOB_ID.
    #[arg(long, value_name = "NAME", value_parser = ["auto", "pbs", "slurm", "none"], default_value = "auto", help_heading = "Topology")]
    pub scheduler: String,
    /// Without a scheduler, start ranks with OpenMPI's mpirun instead of spawning them.
    #[arg(long, help_heading = "Topology")]
    pub mpi: bool,
    /// Accelerator kind, overriding detection (visible-device variables, nvidia-smi, rocm-smi, xpu-smi).
    #[arg(long, value_name = "KIND", value_parser = ["auto", "nvidia", "amd", "intel", "cpu"], default_value = "auto", help_heading = "Topology")]
    pub accelerator: String,
    /// Accelerators per node, overriding detection (0: CPU only); also srun's --gpus-per-node.
    #[arg(long, value_name = "N", help_heading = "Topology")]
    pub gpus_per_node: Option<usize>,
    /// CPU binding for the launcher (mpiexec --cpu-bind, srun --cpu-bind, mpirun --bind-to);
    /// `none` adds no flag [default: depth under PBS, none elsewhere].
    #[arg(long, value_name = "BIND", help_heading = "Topology")]
    pub cpu_bind: Option<String>,
    /// MASTER_ADDR for the ranks [default: 127.0.0.1 locally, else the first host].
    #[arg(long, value_name = "HOST", help_heading = "Topology")]
    pub master_addr: Option<String>,
    /// MASTER_PORT for the ranks [default: a port free on this machine].
    #[arg(long, value_name = "PORT", help_heading = "Topology")]
    pub master_port: Option<u16>,
    /// Under a launcher, run PROGRAM directly instead of through `kiln launch --as-rank`
    /// (then the program must read the launcher's own rank variables).
    #[arg(long, help_heading = "Topology")]
    pub no_rank_env: bool,

    /// Silence watchdog: kill when there is no output and no beacon update for S seconds.
    #[arg(long, value_name = "S", help_heading = "Watchdogs")]
    pub timeout: Option<f64>,
    /// Stall watchdog: kill when progress has not advanced for S seconds although output
    /// continues (armed once the first progress is seen).
    #[arg(long, value_name = "S", help_heading = "Watchdogs")]
    pub stall_timeout: Option<f64>,
    /// Regex whose first capture group (or group `step`) is the step number.
    #[arg(long, value_name = "REGEX", default_value = DEFAULT_PROGRESS_REGEX, help_heading = "Watchdogs")]
    pub progress_regex: String,
    /// Seconds between SIGTERM and SIGKILL when kiln stops the ranks.
    #[arg(
        long,
        value_name = "S",
        default_value_t = 10.0,
        help_heading = "Watchdogs"
    )]
    pub grace: f64,
    /// Stop the job after this long, all attempts together (SIGTERM so ranks can checkpoint);
    /// seconds or H:MM:SS.
    #[arg(long, value_name = "TIME", help_heading = "Watchdogs")]
    pub walltime: Option<String>,

    /// Retry a failed or hung attempt up to N times [default: 0].
    #[arg(
        long,
        value_name = "N",
        conflicts_with = "auto_retry",
        help_heading = "Retries"
    )]
    pub retries: Option<u32>,
    /// Retry without a fixed count while attempts keep making new progress; give up after 3
    /// attempts in a row that got no further.
    #[arg(long, help_heading = "Retries")]
    pub auto_retry: bool,
    /// Backoff between retries, BASE[,CAP] seconds: BASE, doubling, at most CAP
    /// [default: 5,60 = 5, 10, 20, 40, 60, 60 ...].
    #[arg(
        long,
        value_name = "BASE[,CAP]",
        default_value = "5,60",
        help_heading = "Retries"
    )]
    pub backoff: String,

    /// Run directory for events.jsonl and attempt logs [default: runs/launch-<UTC time>].
    #[arg(long, value_name = "DIR")]
    pub run_dir: Option<PathBuf>,
    /// Print what was detected and the exact argv (and added variables), then exit.
    #[arg(long)]
    pub dry_run: bool,
    /// Internal, what each rank runs under a launcher: set RANK/LOCAL_RANK/WORLD_SIZE/
    /// LOCAL_WORLD_SIZE from the launcher's variables and exec PROGRAM in place.
    #[arg(long)]
    pub as_rank: bool,
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

/// kiln's own long flags, to catch them after a launcher flag (where they would silently be
/// handed to the launcher).
const KILN_FLAGS: &[&str] = &[
    "--np",
    "--ppn",
    "--nnodes",
    "--hostfile",
    "--scheduler",
    "--mpi",
    "--accelerator",
    "--gpus-per-node",
    "--cpu-bind",
    "--master-addr",
    "--master-port",
    "--no-rank-env",
    "--timeout",
    "--stall-timeout",
    "--progress-regex",
    "--grace",
    "--walltime",
    "--retries",
    "--auto-retry",
    "--backoff",
    "--run-dir",
    "--dry-run",
    "--as-rank",
];

/// Splits `[LAUNCHER FLAGS] -- PROGRAM ...`. clap consumed the `--` if nothing came before it;
/// launcher flags always start with `-`, a program never does.
fn split_command(args: &[String]) -> Result<(Vec<String>, Vec<String>), String> {
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
            if let Some(flag) = launcher.iter().find(|a| {
                let name = a.split('=').next().unwrap_or(a);
                KILN_FLAGS.contains(&name)
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

fn seconds(flag: &str, v: Option<f64>) -> Result<Option<Duration>, String> {
    match v {
        None => Ok(None),
        Some(s) if s.is_finite() && s > 0.0 => Ok(Some(Duration::from_secs_f64(s))),
        Some(s) => Err(format!("{flag} {s}: must be a positive number of seconds")),
    }
}

/// `3600`, `90.5` or `H:MM:SS` / `MM:SS`.
fn parse_walltime(s: &str) -> Result<Duration, String> {
    let bad = || format!("--walltime {s:?}: expected seconds or H:MM:SS");
    let total = if s.contains(':') {
        let mut total = 0.0;
        for part in s.split(':') {
            let v: f64 = part.parse().map_err(|_| bad())?;
            total = total * 60.0 + v;
        }
        total
    } else {
        s.parse().map_err(|_| bad())?
    };
    if !(total.is_finite() && total > 0.0) {
        return Err(bad());
    }
    Ok(Duration::from_secs_f64(total))
}

/// `runs/launch-YYYYmmdd-HHMMSS` (UTC), computed without a date crate.
fn default_run_dir() -> PathBuf {
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

fn usage_error(message: impl std::fmt::Display) -> anyhow::Result<ExitCode> {
    eprintln!("kiln launch: error: {message}");
    Ok(ExitCode::from(USAGE_EXIT))
}

fn exit(code: i32) -> ExitCode {
    ExitCode::from(u8::try_from(code).unwrap_or(1))
}

fn env_var(k: &str) -> Option<String> {
    std::env::var(k).ok()
}

fn local_cpus() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get())
}

/// `kiln launch`.
pub fn run(args: LaunchArgs) -> anyhow::Result<ExitCode> {
    let LaunchArgs {
        flags,
        command: raw_command,
    } = args;
    let args = *flags;
    if args.as_rank {
        let (_, command) = match split_command(&raw_command) {
            Ok(c) => c,
            Err(e) => return usage_error(e),
        };
        let err = kiln_launch::exec_as_rank(&command);
        eprintln!("kiln launch --as-rank: {err}");
        return Ok(exit(err.exit_code()));
    }
    let (launcher_args, command) = match split_command(&raw_command) {
        Ok(c) => c,
        Err(e) => return usage_error(e),
    };
    let checked = (|| -> Result<_, String> {
        let silence = seconds("--timeout", args.timeout)?;
        let stall = seconds("--stall-timeout", args.stall_timeout)?;
        if !(args.grace.is_finite() && args.grace >= 0.0) {
            return Err(format!(
                "--grace {}: must be zero or a positive number of seconds",
                args.grace
            ));
        }
        let grace = Duration::from_secs_f64(args.grace);
        let regex = ProgressRegex::new(&args.progress_regex)?;
        let backoff = Backoff::parse(&args.backoff)?;
        let walltime = args.walltime.as_deref().map(parse_walltime).transpose()?;
        Ok((silence, stall, grace, regex, backoff, walltime))
    })();
    let (silence, stall, grace, regex, backoff, walltime) = match checked {
        Ok(v) => v,
        Err(e) => return usage_error(e),
    };
    let started = Instant::now();

    let run_dir = args.run_dir.clone().unwrap_or_else(default_run_dir);
    // Absolute, because ranks on other hosts may not start in this directory and must still
    // find KILN_PROGRESS_DIR and the hostfile.
    let run_dir = std::path::absolute(&run_dir).unwrap_or(run_dir);
    // A caller's own KILN_PROGRESS_DIR (a wrapper, a test harness) is respected and not cleared.
    let (progress_dir, own_progress_dir) = match env_var(PROGRESS_DIR_ENV).filter(|v| !v.is_empty())
    {
        Some(d) => (PathBuf::from(d), false),
        None => (run_dir.join("progress"), true),
    };
    let master_port = args
        .master_port
        .or_else(kiln_launch::free_port)
        .unwrap_or(29500);
    let shim = match std::env::current_exe() {
        Ok(exe) if !args.no_rank_env => {
            vec![
                exe.display().to_string(),
                "launch".into(),
                "--as-rank".into(),
                "--".into(),
            ]
        }
        _ => Vec::new(),
    };
    let opts = LaunchOptions {
        scheduler: Some(args.scheduler.clone()),
        hostfile: args.hostfile.clone(),
        sizes: SizeRequest {
            np: args.np,
            ppn: args.ppn,
            nnodes: args.nnodes,
        },
        mpi: args.mpi,
        accelerator: Some(args.accelerator.clone()),
        gpus_per_node: args.gpus_per_node,
        cpu_bind: args.cpu_bind.clone(),
        launcher_args,
        rank_shim: shim,
        command: command.clone(),
        master_addr: args.master_addr.clone(),
        master_port,
        progress_dir: progress_dir.clone(),
        run_dir: run_dir.clone(),
    };
    let setup = match prepare(
        &opts,
        &env_var,
        &probe_tool,
        local_cpus(),
        kiln_launch::running_as_root(),
    ) {
        Ok(s) => s,
        Err(e) => return usage_error(e),
    };

    if args.dry_run {
        println!(
            "scheduler:    {} ({})",
            setup.scheduler.value.name(),
            setup.scheduler.reason
        );
        println!(
            "hosts:        {} ({})",
            setup.used_hosts.join(","),
            setup.hosts.reason
        );
        let acc = setup.accelerators.value;
        println!(
            "accelerators: {} x {} per node ({})",
            acc.count,
            acc.kind.name(),
            setup.accelerators.reason
        );
        println!(
            "launcher:     {} (np {}, ppn {}, nnodes {})",
            setup.launcher.name(),
            setup.sizes.np,
            setup.sizes.ppn,
            setup.sizes.nnodes
        );
        println!("run dir:      {}", run_dir.display());
        if let Some((path, text)) = &setup.hostfile_to_write {
            println!("hostfile:     {} would contain {:?}", path.display(), text);
        }
        for p in &setup.procs {
            let rank = p.rank.map_or(String::new(), |r| format!(" (rank {r})"));
            println!("argv{rank}: {}", serde_json::to_string(&p.argv)?);
            let env: Vec<String> = p.env.iter().map(|(k, v)| format!("{k}={v}")).collect();
            println!("env{rank}:  {}", serde_json::to_string(&env)?);
        }
        return Ok(ExitCode::SUCCESS);
    }

    // Errors a person can act on, before anything starts: a missing program or launcher.
    let first = setup
        .procs
        .first()
        .and_then(|p| p.argv.first())
        .cloned()
        .unwrap_or_default();
    if find_in_path(&first).is_none() {
        let hint = match setup.launcher {
            Launcher::Local => String::new(),
            Launcher::Mpirun => {
                " (install OpenMPI, e.g. `apt-get install openmpi-bin`, or drop --mpi)".into()
            }
            l => format!(
                " (the {} launcher is not in PATH: load the site's MPI/Slurm module)",
                l.name()
            ),
        };
        eprintln!("kiln launch: {first}: command not found{hint}");
        return Ok(exit(kiln_launch::NOT_FOUND_EXIT));
    }
    if setup.launcher != Launcher::Local && find_in_path(&command[0]).is_none() {
        eprintln!("kiln launch: {}: command not found", command[0]);
        return Ok(exit(kiln_launch::NOT_FOUND_EXIT));
    }

    std::fs::create_dir_all(&run_dir)
        .with_context(|| format!("creating run dir {}", run_dir.display()))?;
    if own_progress_dir {
        std::fs::create_dir_all(&progress_dir)
            .with_context(|| format!("creating progress dir {}", progress_dir.display()))?;
    }
    if let Some((path, text)) = &setup.hostfile_to_write {
        std::fs::write(path, text).with_context(|| format!("writing {}", path.display()))?;
    }
    let mut events = EventLog::open(&run_dir, "launch")?;
    let acc = setup.accelerators.value;
    events.emit(
        "launch_start",
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
            "progress_dir": progress_dir,
            "kiln_version": env!("CARGO_PKG_VERSION"),
        }),
    )?;

    kiln_launch::install_stop_handlers().context("installing signal handlers")?;
    // Grandchildren that escape the process group (setsid, daemonize) are re-parented to
    // kiln, which then kills them when the attempt ends.
    let reap = kiln_launch::become_subreaper();
    let attempt = AttemptConfig {
        procs: setup.procs.clone(),
        log_path: run_dir.join("attempt-1.log"),
        silence_timeout: silence,
        stall_timeout: stall,
        progress_regex: Some(regex),
        progress_dir: Some(progress_dir),
        clear_progress_dir: own_progress_dir,
        grace,
        deadline: walltime.map(|w| started + w),
        echo: true,
        reap_orphans: reap,
    };
    let on_end = |i: u32, o: &AttemptOutcome| {
        let progress = o
            .last_progress
            .map_or(String::new(), |s| format!(", last step {s}"));
        let msg = o
            .message
            .as_deref()
            .map_or(String::new(), |m| format!(": {m}"));
        eprintln!(
            "kiln: attempt {i} {} (exit {}{progress}){msg}",
            o.classification.name(),
            o.exit_code
        );
    };
    let result = kiln_launch::run_with_retries(RetryConfig {
        attempt,
        run_dir: run_dir.clone(),
        limit: if args.auto_retry {
            RetryLimit::Auto
        } else {
            RetryLimit::Count(args.retries.unwrap_or(0))
        },
        backoff,
        hosts: setup.used_hosts.clone(),
        events: &mut events,
        stop: &kiln_launch::stop_requested,
        on_attempt_end: &on_end,
    })?;
    let last = &result.last;
    events.emit(
        "launch_end",
        json!({
            "attempts": result.attempts,
            "exit_code": last.exit_code,
            "classification": last.classification.name(),
            "last_progress": last.last_progress,
            "wall_s": started.elapsed().as_secs_f64(),
        }),
    )?;
    if last.classification != Classification::Success && result.attempts > 1 {
        eprintln!(
            "kiln: giving up after {} attempts; see {}",
            result.attempts,
            run_dir.join("events.jsonl").display()
        );
    }
    Ok(exit(last.exit_code))
}

/// `kiln doctor`.
pub fn doctor(args: DoctorArgs) -> anyhow::Result<ExitCode> {
    let mut ok = true;
    let dir = std::env::temp_dir();
    let opts = LaunchOptions {
        scheduler: Some(args.scheduler),
        hostfile: args.hostfile,
        mpi: args.mpi,
        accelerator: Some(args.accelerator),
        gpus_per_node: args.gpus_per_node,
        command: vec!["PROGRAM".into()],
        master_port: 29500,
        progress_dir: dir.join("progress"),
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
    fn walltime_and_run_dir() {
        assert_eq!(
            parse_walltime("1:00:30").unwrap(),
            Duration::from_secs(3630)
        );
        assert_eq!(parse_walltime("90").unwrap(), Duration::from_secs(90));
        assert!(parse_walltime("soon").is_err());
        assert!(
            default_run_dir()
                .display()
                .to_string()
                .starts_with("runs/launch-20")
        );
    }
}

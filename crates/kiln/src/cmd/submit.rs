//! `kiln submit`: flags in, a [`kiln_launch::SubmitRequest`] to the library, the script or
//! the job id out.

use kiln_launch::{BatchScheduler, SubmitRequest, batch_script, parse_time, quarantined_hosts};
use std::path::PathBuf;
use std::process::ExitCode;

/// Arguments of `kiln submit`.
#[derive(Debug, clap::Args)]
#[command(after_long_help = "\
Writes a batch script into the run directory (RUN_DIR/job.sbatch or RUN_DIR/job.pbs), submits
it, and chains: every job runs `kiln launch --auto-retry --spares S` (node scope: culprit
hosts are swapped for spares and quarantined), stops the ranks resumably before the walltime
(Slurm: `--signal=B:USR1@LEAD` to kiln, forwarded to the ranks; PBS: kiln's own --walltime
LEAD seconds early; the trainer checkpoints and exits 75), and, when the job ended resumably
(75, or 69: no healthy spare left) and made progress, submits the next job of the chain
(`--dependency=afterany`/`-W depend=afterany` on itself, hosts in the quarantine files
excluded) until the run completes or --chain jobs ran. Give the program the same run
directory (e.g. `kiln train --run-dir RUN_DIR`) so it resumes there and `kiln status RUN_DIR`
shows every job's goodput.

Exit codes: 0 submitted (or printed, with --dry-run); 2 bad flags; 1 the scheduler refused.

Examples:
  kiln submit --scheduler slurm --nodes 8 --spares 1 --time 12:00:00 --chain 10 \\
      --run-dir runs/a -- kiln train configs/tiny.toml --run-dir runs/a
  kiln submit --scheduler pbs --nodes 2 --time 1:00:00 --account proj --queue debug \\
      --scheduler-arg '-l filesystems=home' --dry-run -- python train.py")]
pub struct SubmitArgs {
    /// The batch scheduler.
    #[arg(long, value_name = "NAME", value_parser = ["slurm", "pbs"])]
    pub scheduler: String,
    /// Active nodes of each job.
    #[arg(long, value_name = "N")]
    pub nodes: usize,
    /// Spare nodes on top of --nodes, swapped in for failed ones.
    #[arg(long, value_name = "N", default_value_t = 1)]
    pub spares: usize,
    /// Walltime of each job: seconds or H:MM:SS (at least 1 minute).
    #[arg(long, value_name = "TIME")]
    pub time: String,
    /// Most jobs in the chain (1: no resubmission).
    #[arg(long, value_name = "K", default_value_t = 1)]
    pub chain: u32,
    /// Seconds before the walltime at which the ranks are told to checkpoint
    /// [default: a tenth of --time, 30 s to 5 min].
    #[arg(long, value_name = "S")]
    pub signal_lead: Option<f64>,
    /// Run directory: the script, events, job output [default: runs/launch-<UTC time>].
    #[arg(long, value_name = "DIR")]
    pub run_dir: Option<PathBuf>,
    /// Job name [default: kiln-<run dir name>].
    #[arg(long, value_name = "NAME")]
    pub job_name: Option<String>,
    /// Account / project to charge.
    #[arg(long, value_name = "NAME")]
    pub account: Option<String>,
    /// Slurm partition or PBS queue.
    #[arg(long, value_name = "NAME")]
    pub queue: Option<String>,
    /// Extra scheduler directive, one #SBATCH/#PBS line each (repeatable), e.g.
    /// `--scheduler-arg=--gpus-per-node=4` or `--scheduler-arg='-l filesystems=home'`.
    #[arg(long, value_name = "ARG", allow_hyphen_values = true)]
    pub scheduler_arg: Vec<String>,
    /// Extra `kiln launch` flag for every job (repeatable), e.g. `--launch-arg=--timeout=600`.
    #[arg(long, value_name = "ARG", allow_hyphen_values = true)]
    pub launch_arg: Vec<String>,
    /// Shared quarantine file: its hosts are excluded, and node scope appends to it.
    #[arg(long, value_name = "FILE")]
    pub quarantine_file: Option<PathBuf>,
    /// Print the script and submit nothing.
    #[arg(long)]
    pub dry_run: bool,
    /// -- PROGRAM [ARGS...]: what every job runs on every rank.
    #[arg(
        value_name = "ARGS",
        trailing_var_arg = true,
        allow_hyphen_values = true,
        required = true
    )]
    pub command: Vec<String>,
}

/// A bad flag: a usage error (exit 2, mapped in main).
fn usage(message: impl std::fmt::Display) -> anyhow::Error {
    kiln_launch::SubmitError::Usage(format!("submit: {message}")).into()
}

/// `kiln submit`.
pub fn run(args: SubmitArgs) -> anyhow::Result<ExitCode> {
    let dry_run = args.dry_run;
    let req = request(args)?;
    req.validate().map_err(usage)?;
    if dry_run {
        let exclude = quarantined_hosts(&req.quarantine_files()).map_err(usage)?;
        print!("{}", batch_script(&req, &exclude).map_err(usage)?);
        return Ok(ExitCode::SUCCESS);
    }
    let s = kiln_launch::submit(&req).map_err(|e| anyhow::Error::new(e).context("submit"))?;
    let excluded = match s.excluded.is_empty() {
        true => String::new(),
        false => format!("; excluded quarantined {}", s.excluded.join(",")),
    };
    println!(
        "submitted job {} ({} chain of at most {}); script {}{excluded}",
        s.job_id,
        req.scheduler.name(),
        req.chain,
        s.script.display(),
    );
    println!("watch it with: kiln status {}", req.run_dir.display());
    Ok(ExitCode::SUCCESS)
}

/// The submission the flags ask for (not yet validated).
fn request(args: SubmitArgs) -> anyhow::Result<SubmitRequest> {
    let scheduler = BatchScheduler::parse(&args.scheduler).map_err(usage)?;
    let time = parse_time(&args.time).map_err(usage)?;
    let signal_lead = args
        .signal_lead
        .map(|s| kiln_launch::limits_seconds("--signal-lead", s, false))
        .transpose()
        .map_err(usage)?;
    let command = match args.command.first().map(String::as_str) {
        Some("--") => args.command[1..].to_vec(),
        _ => args.command.clone(),
    };
    let run_dir = args.run_dir.unwrap_or_else(kiln_launch::default_run_dir);
    let run_dir = std::path::absolute(&run_dir).unwrap_or(run_dir);
    let name = run_dir
        .file_name()
        .map_or("run".into(), |n| n.to_string_lossy().into_owned());
    Ok(SubmitRequest {
        scheduler,
        nodes: args.nodes,
        spares: args.spares,
        time,
        chain: args.chain,
        signal_lead,
        workdir: std::env::current_dir()?,
        kiln: std::env::current_exe()?,
        job_name: args.job_name.unwrap_or_else(|| format!("kiln-{name}")),
        account: args.account,
        queue: args.queue,
        scheduler_args: args.scheduler_arg,
        launch_args: args.launch_arg,
        quarantine_file: args
            .quarantine_file
            .map(|q| std::path::absolute(&q).unwrap_or(q)),
        command,
        run_dir,
    })
}

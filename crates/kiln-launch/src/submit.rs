//! Job scope: batch scripts for Slurm and PBS that run `kiln launch` with node scope, stop
//! resumably before the walltime, and chain: each job submits its successor until the run
//! completes, the chain limit is hit, or a job made no progress.
//!
//! Slurm delivers the walltime warning itself (`--signal=B:USR1@LEAD` reaches the batch
//! shell, which is `kiln launch` by `exec`; kiln forwards it to the ranks, which checkpoint
//! and exit 75). PBS has no such warning, so kiln's own `--walltime` stops the ranks LEAD
//! seconds before the end. Either way the job ends with 75, and the chain continues.

use crate::limits;
use kiln_run::{EventLog, event, exit, layout};
use serde_json::json;
use std::path::{Path, PathBuf};
use std::time::Duration;

/// The batch schedulers `kiln submit` writes scripts for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BatchScheduler {
    /// Slurm: `sbatch`.
    Slurm,
    /// PBS Pro / OpenPBS: `qsub`.
    Pbs,
}

impl BatchScheduler {
    /// `slurm` or `pbs`.
    pub fn name(self) -> &'static str {
        match self {
            BatchScheduler::Slurm => "slurm",
            BatchScheduler::Pbs => "pbs",
        }
    }

    /// Parses `slurm` or `pbs`.
    pub fn parse(s: &str) -> Result<Self, String> {
        match s {
            "slurm" => Ok(BatchScheduler::Slurm),
            "pbs" => Ok(BatchScheduler::Pbs),
            other => Err(format!("--scheduler {other:?}: expected slurm or pbs")),
        }
    }

    /// The submit command.
    pub fn submit_program(self) -> &'static str {
        match self {
            BatchScheduler::Slurm => "sbatch",
            BatchScheduler::Pbs => "qsub",
        }
    }
}

/// Variable holding the position of a job in its chain (1 for the first job).
pub const CHAIN_INDEX_ENV: &str = "KILN_CHAIN_INDEX";

/// What `kiln submit` was asked for.
#[derive(Debug, Clone)]
pub struct SubmitRequest {
    /// Slurm or PBS.
    pub scheduler: BatchScheduler,
    /// Active nodes.
    pub nodes: usize,
    /// Spare nodes on top (node scope swaps failed nodes for them).
    pub spares: usize,
    /// Walltime of each job.
    pub time: Duration,
    /// Most jobs in the chain (1: no resubmission).
    pub chain: u32,
    /// Seconds before the walltime at which ranks are told to checkpoint and stop.
    pub signal_lead: Option<Duration>,
    /// The run directory (absolute).
    pub run_dir: PathBuf,
    /// Directory the job runs in (absolute; relative paths of the command resolve there).
    pub workdir: PathBuf,
    /// The kiln binary the job runs (absolute).
    pub kiln: PathBuf,
    /// Job name.
    pub job_name: String,
    /// `--account` / `-A`.
    pub account: Option<String>,
    /// Slurm partition / PBS queue.
    pub queue: Option<String>,
    /// Extra scheduler directives, each written as one `#SBATCH`/`#PBS` line.
    pub scheduler_args: Vec<String>,
    /// Extra `kiln launch` flags (for example `--timeout=600`).
    pub launch_args: Vec<String>,
    /// A quarantine file shared between runs (read for `--exclude`, appended by node scope).
    pub quarantine_file: Option<PathBuf>,
    /// The program and its arguments.
    pub command: Vec<String>,
}

/// Errors of `kiln submit` and of chaining.
#[derive(Debug, thiserror::Error)]
pub enum SubmitError {
    /// Bad flags.
    #[error("{0}")]
    Usage(String),
    /// A file could not be written or read.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The cause.
        source: std::io::Error,
    },
    /// The scheduler refused the job or its answer was not a job id.
    #[error("{0}")]
    Scheduler(String),
}

impl kiln_run::exit::ExitCoded for SubmitError {
    /// Bad flags are usage errors (2); a failed write or a refusing scheduler, 1.
    fn exit_code(&self) -> i32 {
        match self {
            SubmitError::Usage(_) => kiln_run::exit::USAGE,
            SubmitError::Io { .. } | SubmitError::Scheduler(_) => kiln_run::exit::FAILURE,
        }
    }
}

impl SubmitRequest {
    /// Checks the request before anything is written.
    pub fn validate(&self) -> Result<(), SubmitError> {
        let usage = |m: String| Err(SubmitError::Usage(m));
        if self.command.is_empty() {
            return usage("no program given: write it after `--`".into());
        }
        if self.nodes == 0 {
            return usage("--nodes must be at least 1".into());
        }
        if self.nodes.saturating_add(self.spares) > kiln_topology::MAX_HOSTS {
            return usage(format!(
                "--nodes {} + --spares {}: at most {} hosts",
                self.nodes,
                self.spares,
                kiln_topology::MAX_HOSTS
            ));
        }
        if self.time < Duration::from_secs(60) {
            return usage(format!(
                "--time {} s: a batch job needs at least 1 minute (schedulers count in minutes)",
                self.time.as_secs_f64()
            ));
        }
        if self.chain == 0 {
            return usage("--chain must be at least 1".into());
        }
        if self.lead() * 2 > self.time {
            return usage(format!(
                "--signal-lead {} s leaves less than half of --time {} s to train",
                self.lead().as_secs(),
                self.time.as_secs()
            ));
        }
        check_script_values(self, &[])
    }

    /// The walltime warning lead: `--signal-lead`, else a tenth of the walltime, 30 s to 5 min
    /// (at most half the walltime).
    pub fn lead(&self) -> Duration {
        self.signal_lead.unwrap_or_else(|| {
            let tenth = self.time.as_secs() / 10;
            Duration::from_secs(tenth.clamp(30, 300).min(self.time.as_secs() / 2))
        })
    }

    /// The shared and run-directory quarantine files.
    pub fn quarantine_files(&self) -> Vec<PathBuf> {
        let mut v = vec![self.run_dir.join(layout::QUARANTINE)];
        v.extend(self.quarantine_file.clone());
        v
    }
}

/// Quotes `s` as one word of a bash script (see [`shell_quote_bytes`]).
pub fn shell_quote(s: &str) -> String {
    shell_quote_bytes(s.as_bytes())
}

/// Quotes `bytes` as one word of a bash script that never spans lines: bare when every byte
/// is safe, in single quotes when it is printable text, else in ANSI-C quotes (`$'...'`, the
/// scripts are bash) with `\xHH` for control characters and bytes that are not UTF-8, so a
/// newline in a value can never end its line and every byte reaches the program unchanged.
pub fn shell_quote_bytes(bytes: &[u8]) -> String {
    const SAFE: &[u8] = b"-_./=:,+@%";
    if !bytes.is_empty()
        && bytes
            .iter()
            .all(|b| b.is_ascii_alphanumeric() || SAFE.contains(b))
    {
        return String::from_utf8_lossy(bytes).into_owned();
    }
    match std::str::from_utf8(bytes) {
        Ok(s) if s.chars().all(|c| !breaks_line(c)) => {
            format!("'{}'", s.replace('\'', r"'\''"))
        }
        _ => {
            let mut out = String::from("$'");
            for &b in bytes {
                match b {
                    b'\\' | b'\'' => {
                        out.push('\\');
                        out.push(b as char);
                    }
                    0x20..=0x7e => out.push(b as char),
                    _ => out.push_str(&format!("\\x{b:02x}")),
                }
            }
            out.push('\'');
            out
        }
    }
}

/// Whether `c` ends or disturbs a line for some reader of the script (bash, sbatch, qsub, an
/// editor): control characters and the Unicode line and paragraph separators.
fn breaks_line(c: char) -> bool {
    c.is_control() || matches!(c, '\u{2028}' | '\u{2029}')
}

/// Refuses a value written bare into a directive or a comment of the script if it could end
/// its line there.
fn one_line(what: &str, value: &str) -> Result<(), SubmitError> {
    match value.chars().find(|&c| breaks_line(c)) {
        None => Ok(()),
        Some(c) => Err(SubmitError::Usage(format!(
            "{what} {value:?} contains the control character {c:?}; a value written into a \
             batch-script directive or comment must be one line of printable text"
        ))),
    }
}

/// The path as text for a directive or a comment: UTF-8 and one line.
fn one_line_path<'a>(what: &str, path: &'a Path) -> Result<&'a str, SubmitError> {
    let text = path.to_str().ok_or_else(|| {
        SubmitError::Usage(format!(
            "{what} {path:?} is not UTF-8; the batch script's directives need a UTF-8 path"
        ))
    })?;
    one_line(what, text)?;
    Ok(text)
}

/// Quotes a path for the script, byte for byte.
fn quote_path(path: &Path) -> String {
    use std::os::unix::ffi::OsStrExt;
    shell_quote_bytes(path.as_os_str().as_bytes())
}

fn hms(d: Duration) -> String {
    let s = d.as_secs();
    format!("{}:{:02}:{:02}", s / 3600, s / 60 % 60, s % 60)
}

/// Checks every value that is written bare into a directive or a comment of the script
/// (names, account, queue, directives, the run directory, the excluded hosts): each must be
/// one line of printable text, so that no value can end its line and start a command.
fn check_script_values(req: &SubmitRequest, exclude: &[String]) -> Result<(), SubmitError> {
    one_line_path("--run-dir", &req.run_dir)?;
    one_line("--job-name", &req.job_name)?;
    for (what, value) in [("--account", &req.account), ("--queue", &req.queue)] {
        if let Some(v) = value {
            one_line(what, v)?;
        }
    }
    for a in &req.scheduler_args {
        one_line("--scheduler-arg", a)?;
    }
    for h in exclude {
        one_line("quarantined host", h)?;
    }
    Ok(())
}

/// The `#SBATCH`/`#PBS` directives.
fn directives(req: &SubmitRequest, exclude: &[String]) -> Vec<String> {
    let total = req.nodes + req.spares;
    let q = shell_quote;
    let mut d = Vec::new();
    match req.scheduler {
        BatchScheduler::Slurm => {
            d.push(format!("#SBATCH --job-name={}", q(&req.job_name)));
            d.push(format!("#SBATCH --nodes={total}"));
            d.push(format!("#SBATCH --time={}", hms(req.time)));
            // B: the batch shell (kiln launch, by exec) gets USR1 LEAD seconds before the end.
            d.push(format!("#SBATCH --signal=B:USR1@{}", req.lead().as_secs()));
            // A failed node must not end the job: node scope swaps in a spare.
            d.push("#SBATCH --no-kill".into());
            let output = req.run_dir.join(layout::JOB_OUTPUT_PATTERN);
            d.push(format!("#SBATCH --output={}", quote_path(&output)));
            d.push("#SBATCH --open-mode=append".into());
            if let Some(a) = &req.account {
                d.push(format!("#SBATCH --account={}", q(a)));
            }
            if let Some(p) = &req.queue {
                d.push(format!("#SBATCH --partition={}", q(p)));
            }
            if !exclude.is_empty() {
                d.push(format!("#SBATCH --exclude={}", exclude.join(",")));
            }
            d.extend(req.scheduler_args.iter().map(|a| format!("#SBATCH {a}")));
        }
        BatchScheduler::Pbs => {
            d.push(format!("#PBS -N {}", q(&req.job_name)));
            d.push(format!("#PBS -l select={total}"));
            d.push("#PBS -l place=scatter".into());
            d.push(format!("#PBS -l walltime={}", hms(req.time)));
            d.push("#PBS -j oe".into());
            d.push(format!(
                "#PBS -o {}",
                quote_path(&req.run_dir.join("pbs.out"))
            ));
            if let Some(a) = &req.account {
                d.push(format!("#PBS -A {}", q(a)));
            }
            if let Some(p) = &req.queue {
                d.push(format!("#PBS -q {}", q(p)));
            }
            d.extend(req.scheduler_args.iter().map(|a| format!("#PBS {a}")));
        }
    }
    d
}

/// The argv every job of the chain `exec`s: `kiln launch` with node and job scope, then the
/// program.
pub fn launch_argv(req: &SubmitRequest) -> Result<Vec<std::ffi::OsString>, SubmitError> {
    // Slurm's USR1 is the warning; kiln's own walltime is the fallback a little later. PBS has
    // no warning: kiln's walltime is the only one.
    let own = match req.scheduler {
        BatchScheduler::Slurm => req.time.saturating_sub(req.lead() / 3),
        BatchScheduler::Pbs => req.time.saturating_sub(req.lead()),
    };
    // The flags come from kiln launch's own definition (see crate::flags), never spelled here.
    let launch = crate::flags::LaunchRequest {
        walltime: Some(own.as_secs().to_string()),
        auto_retry: true,
        spares: Some(req.spares),
        quarantine_file: req.quarantine_file.clone(),
        chain: Some(req.chain),
        chain_script: Some(req.run_dir.join(layout::batch_script(req.scheduler.name()))),
        run_dir: Some(req.run_dir.clone()),
        ..Default::default()
    };
    let mut argv: Vec<std::ffi::OsString> = vec![req.kiln.clone().into(), "launch".into()];
    argv.extend(launch.to_argv().map_err(SubmitError::Usage)?);
    argv.extend(req.launch_args.iter().map(Into::into));
    argv.push("--".into());
    argv.extend(req.command.iter().map(Into::into));
    Ok(argv)
}

/// The batch script. `exclude`: hosts to keep out (quarantined). Refuses a request whose
/// values could end a line of the script (see [`SubmitRequest::validate`]); every other value
/// is quoted, byte for byte, on one line.
pub fn batch_script(req: &SubmitRequest, exclude: &[String]) -> Result<String, SubmitError> {
    req.validate()?;
    check_script_values(req, exclude)?;
    let mut lines = vec!["#!/bin/bash".to_string()];
    lines.extend(directives(req, exclude));
    lines.push(String::new());
    lines.push(format!(
        "# Written by `kiln submit`; kept as {}. Every job of the chain runs this script:",
        req.run_dir
            .join(layout::batch_script(req.scheduler.name()))
            .display()
    ));
    lines.push(
        "# kiln launch recovers failed nodes from the spares, stops the ranks resumably before"
            .into(),
    );
    lines.push(format!(
        "# the walltime, and submits the next job (chain of at most {}) while the run is unfinished.",
        req.chain
    ));
    lines.push("set -u".into());
    if req.scheduler == BatchScheduler::Pbs {
        let out = quote_path(&req.run_dir);
        lines.push(format!(
            "exec >> {out}/job-\"${{PBS_JOBID:-local}}\".out 2>&1"
        ));
    }
    lines.push(format!("cd {}", quote_path(&req.workdir)));
    let quoted: Vec<String> = launch_argv(req)?
        .iter()
        .map(|a| quote_path(Path::new(a)))
        .collect();
    lines.push(format!("exec {}", quoted.join(" ")));
    let mut s = lines.join("\n");
    s.push('\n');
    Ok(s)
}

/// Runs the submit command; returns the job id it printed.
fn run_submit(program: &str, args: &[String]) -> Result<String, SubmitError> {
    let out = std::process::Command::new(program)
        .args(args)
        .stdin(std::process::Stdio::null())
        .output()
        .map_err(|e| {
            SubmitError::Scheduler(format!(
                "{program}: {e} (is the {program} command of the scheduler in PATH?)"
            ))
        })?;
    let stdout = String::from_utf8_lossy(&out.stdout);
    if !out.status.success() {
        return Err(SubmitError::Scheduler(format!(
            "{program} {} failed ({}): {}{}",
            args.join(" "),
            out.status,
            String::from_utf8_lossy(&out.stderr).trim(),
            stdout.trim()
        )));
    }
    // sbatch --parsable: `123` or `123;cluster`; qsub: `123.server`.
    let id = stdout
        .lines()
        .rev()
        .map(str::trim)
        .find(|l| !l.is_empty())
        .and_then(|l| l.split(';').next())
        .map(str::to_string)
        .filter(|id| id.chars().next().is_some_and(|c| c.is_ascii_digit()))
        .ok_or_else(|| {
            SubmitError::Scheduler(format!("{program} printed no job id: {:?}", stdout.trim()))
        })?;
    Ok(id)
}

/// Submits `script` as chain job `index`, after `after` (a job id) if given.
pub fn submit_script(
    scheduler: BatchScheduler,
    script: &Path,
    index: u32,
    after: Option<&str>,
    exclude: &[String],
) -> Result<String, SubmitError> {
    let mut args: Vec<String> = Vec::new();
    match scheduler {
        BatchScheduler::Slurm => {
            args.push("--parsable".into());
            args.push(format!("--export=ALL,{CHAIN_INDEX_ENV}={index}"));
            if let Some(id) = after {
                args.push(format!("--dependency=afterany:{id}"));
            }
            if !exclude.is_empty() {
                args.push(format!("--exclude={}", exclude.join(",")));
            }
        }
        BatchScheduler::Pbs => {
            args.extend(["-v".into(), format!("{CHAIN_INDEX_ENV}={index}")]);
            if let Some(id) = after {
                args.extend(["-W".into(), format!("depend=afterany:{id}")]);
            }
        }
    }
    args.push(script.display().to_string());
    run_submit(scheduler.submit_program(), &args)
}

/// What `kiln submit` did.
#[derive(Debug, Clone)]
pub struct Submitted {
    /// The script's path.
    pub script: PathBuf,
    /// The first job's id.
    pub job_id: String,
    /// Hosts excluded as quarantined.
    pub excluded: Vec<String>,
}

/// Writes the script into the run directory and submits the first job of the chain.
pub fn submit(req: &SubmitRequest) -> Result<Submitted, SubmitError> {
    req.validate()?;
    let exclude = crate::pool::quarantined_hosts(&req.quarantine_files())
        .map_err(|e| SubmitError::Usage(e.to_string()))?;
    let io = |path: &Path| {
        let path = path.to_path_buf();
        move |source| SubmitError::Io { path, source }
    };
    std::fs::create_dir_all(&req.run_dir).map_err(io(&req.run_dir))?;
    let script = req.run_dir.join(layout::batch_script(req.scheduler.name()));
    kiln_run::files::write_atomic(
        &script,
        batch_script(req, &exclude)?.as_bytes(),
        kiln_run::files::Atomic {
            durable: true,
            mode: 0o755,
        },
    )
    .map_err(io(&script))?;
    let job_id = submit_script(req.scheduler, &script, 1, None, &[])?;
    if let Ok(mut log) = EventLog::open(&req.run_dir, kiln_run::event::source::SUBMIT) {
        let _ = log.emit(
            event::JOB_SUBMITTED,
            json!({"job_id": job_id, "scheduler": req.scheduler.name(), "chain_index": 1, "chain_limit": req.chain, "script": script, "excluded": exclude, "nodes": req.nodes, "spares": req.spares, "time_s": req.time.as_secs()}),
        );
    }
    Ok(Submitted {
        script,
        job_id,
        excluded: exclude,
    })
}

/// The chain position of the running job, from the script's settings and the environment.
#[derive(Debug, Clone)]
pub struct ChainJob {
    /// The scheduler.
    pub scheduler: BatchScheduler,
    /// This job's id.
    pub job_id: String,
    /// 1-based position.
    pub index: u32,
    /// Most jobs.
    pub limit: u32,
    /// The script to resubmit.
    pub script: PathBuf,
}

/// Decides, at the end of a chain job, whether to submit the next one, and does. Returns
/// the decision and the reason (also written as a `chain` event).
pub fn continue_chain(
    job: &ChainJob,
    exit_code: i32,
    made_progress: bool,
    exclude: &[String],
    events: &mut EventLog,
) -> (bool, String) {
    let (next, reason) = if exit_code == exit::SUCCESS {
        (false, "the run completed".to_string())
    } else if !exit::is_resumable(exit_code) {
        (
            false,
            format!(
                "the job ended with exit {exit_code} ({}), which a new job would not fix",
                exit::describe(exit_code)
            ),
        )
    } else if job.index >= job.limit {
        (false, format!("chain limit {} reached", job.limit))
    } else if !made_progress {
        (
            false,
            "this job made no progress; a new job would not either".into(),
        )
    } else {
        (
            true,
            format!(
                "resumable exit {exit_code}; submitting job {} of {}",
                job.index + 1,
                job.limit
            ),
        )
    };
    let mut fields = json!({"job_id": job.job_id, "chain_index": job.index, "chain_limit": job.limit, "exit_code": exit_code, "decision": if next {"next"} else {"end"}, "reason": reason});
    if next {
        match submit_script(
            job.scheduler,
            &job.script,
            job.index + 1,
            Some(&job.job_id),
            exclude,
        ) {
            Ok(id) => {
                let _ = events.emit(
                    event::JOB_SUBMITTED,
                    json!({"job_id": id, "scheduler": job.scheduler.name(), "chain_index": job.index + 1, "chain_limit": job.limit, "script": job.script, "after": job.job_id, "excluded": exclude}),
                );
                fields["next_job_id"] = json!(id);
            }
            Err(e) => {
                let reason = format!("could not submit the next job: {e}");
                fields["decision"] = json!("end");
                fields["reason"] = json!(reason);
                let _ = events.emit(event::CHAIN, fields);
                return (false, reason);
            }
        }
    }
    let _ = events.emit(event::CHAIN, fields);
    (next, reason)
}

/// Validates `--time` for `kiln submit`: seconds or `[[H:]MM:]SS`, at least a minute.
pub fn parse_time(text: &str) -> Result<Duration, String> {
    limits::clock_time("--time", text)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn req(s: BatchScheduler) -> SubmitRequest {
        SubmitRequest {
            scheduler: s,
            nodes: 3,
            spares: 1,
            time: Duration::from_secs(3600),
            chain: 4,
            signal_lead: None,
            run_dir: "/runs/a b".into(),
            workdir: "/work".into(),
            kiln: "/bin/kiln".into(),
            job_name: "kiln-a".into(),
            account: Some("proj".into()),
            queue: None,
            scheduler_args: vec![],
            launch_args: vec!["--timeout=600".into()],
            quarantine_file: None,
            command: vec![
                "kiln".into(),
                "train".into(),
                "--set".into(),
                "x='1 2'".into(),
            ],
        }
    }

    #[test]
    fn scripts_carry_the_walltime_signal_spares_and_the_chain() {
        let s = batch_script(&req(BatchScheduler::Slurm), &["n7".into()]).unwrap();
        for line in [
            "#SBATCH --nodes=4",
            "#SBATCH --time=1:00:00",
            "#SBATCH --signal=B:USR1@300",
            "#SBATCH --no-kill",
            "#SBATCH --exclude=n7",
            "#SBATCH --account=proj",
            "#SBATCH --output='/runs/a b/job-%j.out'",
            "exec /bin/kiln launch --walltime=3500 --auto-retry --spares=1 --chain=4 '--chain-script=/runs/a b/job.sbatch' '--run-dir=/runs/a b' --timeout=600 -- kiln train --set 'x='\\''1 2'\\'''",
        ] {
            assert!(s.contains(line), "missing {line:?} in\n{s}");
        }
        let p = batch_script(&req(BatchScheduler::Pbs), &[]).unwrap();
        for line in [
            "#PBS -l select=4",
            "#PBS -l walltime=1:00:00",
            "#PBS -A proj",
            "--walltime=3300",
        ] {
            assert!(p.contains(line), "missing {line:?} in\n{p}");
        }
    }

    #[test]
    fn requests_are_validated() {
        let mut r = req(BatchScheduler::Slurm);
        r.time = Duration::from_secs(30);
        assert!(r.validate().unwrap_err().to_string().contains("1 minute"));
        let mut r = req(BatchScheduler::Slurm);
        r.chain = 0;
        assert!(r.validate().is_err());
        let mut r = req(BatchScheduler::Slurm);
        r.time = Duration::from_secs(60);
        assert_eq!(r.lead(), Duration::from_secs(30));
        assert!(r.validate().is_ok());
        assert_eq!(shell_quote("it's"), r"'it'\''s'");
    }
}

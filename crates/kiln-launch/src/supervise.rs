//! One attempt: start the processes (each in its own process group), capture and tee their
//! output, watch for silence and stalled progress, and kill whole process trees.

use crate::classify::{
    Classification, NOT_EXECUTABLE_EXIT, NOT_FOUND_EXIT, WALLTIME_EXIT, WATCHDOG_EXIT,
    classify_exit, exit_code_of,
};
use crate::plan::ProcSpec;
use crate::progress::{LineSplitter, ProgressRegex};
use crate::signals::StopRequest;
use kiln_run::{Beacon, read_beacons, unix_time};
use nix::sys::signal::{Signal, killpg};
use nix::unistd::Pid;
use std::collections::BTreeMap;
use std::fs::File;
use std::io::{Read, Write};
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::path::PathBuf;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// How often the loop checks children, signals and watchdogs: bounds detection latency.
const TICK: Duration = Duration::from_millis(25);
/// How often beacon files are read.
const BEACON_EVERY: Duration = Duration::from_millis(200);

/// How to run and watch one attempt.
#[derive(Debug, Clone)]
pub struct AttemptConfig {
    /// The processes to start.
    pub procs: Vec<ProcSpec>,
    /// Where the raw output of all processes is teed (`RUN_DIR/attempt-<i>.log`).
    pub log_path: PathBuf,
    /// `--timeout`: kill after this long with no output and no beacon update.
    pub silence_timeout: Option<Duration>,
    /// `--stall-timeout`: kill after this long without progress, once progress was seen.
    pub stall_timeout: Option<Duration>,
    /// Progress regex over output lines (`None`: beacons only).
    pub progress_regex: Option<ProgressRegex>,
    /// Beacon directory (`$KILN_PROGRESS_DIR`).
    pub progress_dir: Option<PathBuf>,
    /// Remove stale `rank-*` beacons from `progress_dir` before starting.
    pub clear_progress_dir: bool,
    /// Time between SIGTERM and SIGKILL.
    pub grace: Duration,
    /// Walltime: stop (SIGTERM, grace, SIGKILL) at this instant.
    pub deadline: Option<Instant>,
    /// Pass output through to kiln's stdout/stderr.
    pub echo: bool,
    /// Kill and reap processes that escaped the process group and were re-parented to kiln
    /// (needs [`become_subreaper`]; only for a process that owns all its children, i.e. the CLI).
    pub reap_orphans: bool,
}

/// Progress of one rank (or of the merged output, rank `None`).
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct RankProgress {
    /// The rank, when known.
    pub rank: Option<usize>,
    /// Largest step seen.
    pub step: u64,
    /// Phase from the beacon (`None` for output-derived progress).
    pub phase: Option<String>,
    /// Seconds since it last advanced, when the attempt ended or the watchdog fired.
    pub idle_s: f64,
    /// Where it came from: `beacon` or `output`.
    pub source: &'static str,
}

/// The result of one attempt.
#[derive(Debug, Clone)]
pub struct AttemptOutcome {
    /// How it ended.
    pub classification: Classification,
    /// What kiln exits with if this is the last attempt.
    pub exit_code: i32,
    /// The signal that killed the deciding process, if one did.
    pub signal: Option<i32>,
    /// Unix start and end times.
    pub start_time: f64,
    /// See `start_time`.
    pub end_time: f64,
    /// Largest step seen by any means.
    pub last_progress: Option<u64>,
    /// Per-rank (or merged) progress.
    pub progress: Vec<RankProgress>,
    /// Ranks that stopped advancing first (watchdog only).
    pub culprits: Vec<usize>,
    /// Seconds from the last activity/advance to the watchdog firing.
    pub detect_s: Option<f64>,
    /// Seconds from the watchdog firing (or stop) until every process was gone.
    pub kill_s: Option<f64>,
    /// A human sentence about the ending (watchdog message, spawn error, ...).
    pub message: Option<String>,
}

/// Errors that prevent supervising at all (not failures of the program).
#[derive(Debug, thiserror::Error)]
pub enum SuperviseError {
    /// The attempt log could not be created.
    #[error("attempt log {path}: {source}")]
    Log {
        /// The file.
        path: PathBuf,
        /// The cause.
        source: std::io::Error,
    },
}

/// Makes this process adopt orphaned descendants (Linux `PR_SET_CHILD_SUBREAPER`), so that a
/// grandchild that left the process group (`setsid`) still cannot outlive the attempt.
pub fn become_subreaper() -> bool {
    #[cfg(target_os = "linux")]
    {
        // SAFETY: prctl with integer arguments has no memory-safety preconditions.
        unsafe { libc::prctl(libc::PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0 }
    }
    #[cfg(not(target_os = "linux"))]
    {
        false
    }
}

#[derive(Default)]
struct Shared {
    last_output: Option<Instant>,
    /// Output-derived progress per source (rank for local spawns, `None` for a launcher).
    output_progress: BTreeMap<Option<usize>, (u64, Instant)>,
}

struct Tracked {
    step: u64,
    phase: String,
    last_advance: Instant,
}

/// What the watchdog or a stop decided, before the processes are gone.
struct Verdict {
    classification: Classification,
    at: Instant,
    detect_s: Option<f64>,
    culprits: Vec<usize>,
    message: Option<String>,
}

/// Runs one attempt to the end. `stop` reports signals kiln received (see
/// [`crate::stop_requested`]); they are forwarded to every process group.
pub fn run_attempt(
    cfg: &AttemptConfig,
    stop: &dyn Fn() -> Option<StopRequest>,
) -> Result<AttemptOutcome, SuperviseError> {
    let start = Instant::now();
    let start_time = unix_time();
    let log = File::create(&cfg.log_path).map_err(|source| SuperviseError::Log {
        path: cfg.log_path.clone(),
        source,
    })?;
    let log = Arc::new(Mutex::new(log));
    if let (Some(dir), true) = (&cfg.progress_dir, cfg.clear_progress_dir) {
        clear_beacons(dir);
    }
    // Stop requests that arrived before this attempt (during backoff) are the caller's to
    // handle; only new ones count here.
    let mut handled_stops = stop().map_or(0, |s| s.count);
    let shared = Arc::new(Mutex::new(Shared {
        last_output: Some(start),
        ..Shared::default()
    }));
    let (done_tx, done_rx) = mpsc::channel::<()>();
    let mut readers = 0usize;
    let mut children: Vec<(Child, Option<usize>)> = Vec::new();
    let mut groups: Vec<Pid> = Vec::new();

    for spec in &cfg.procs {
        match spawn(spec) {
            Ok(mut child) => {
                let pid = Pid::from_raw(child.id() as i32);
                groups.push(pid);
                for (pipe, to_stderr) in [
                    (
                        child
                            .stdout
                            .take()
                            .map(|p| Box::new(p) as Box<dyn Read + Send>),
                        false,
                    ),
                    (
                        child
                            .stderr
                            .take()
                            .map(|p| Box::new(p) as Box<dyn Read + Send>),
                        true,
                    ),
                ] {
                    if let Some(pipe) = pipe {
                        let ctx = ReaderCtx {
                            echo: cfg.echo,
                            to_stderr,
                            log: Arc::clone(&log),
                            shared: Arc::clone(&shared),
                            regex: cfg.progress_regex.clone(),
                            source: spec.rank,
                        };
                        let tx = done_tx.clone();
                        std::thread::spawn(move || {
                            read_stream(pipe, ctx);
                            let _ = tx.send(());
                        });
                        readers += 1;
                    }
                }
                children.push((child, spec.rank));
            }
            Err(e) => {
                // Nothing half-started may survive a failed spawn of a later rank.
                kill_groups(&groups, Signal::SIGKILL);
                for (c, _) in &mut children {
                    let _ = c.wait();
                }
                let program = spec.argv.first().cloned().unwrap_or_default();
                let (classification, code, what) = match e.kind() {
                    std::io::ErrorKind::NotFound => (
                        Classification::NotFound,
                        NOT_FOUND_EXIT,
                        "command not found",
                    ),
                    std::io::ErrorKind::PermissionDenied => (
                        Classification::NotFound,
                        NOT_EXECUTABLE_EXIT,
                        "permission denied (not executable)",
                    ),
                    _ => (Classification::Failed, NOT_EXECUTABLE_EXIT, "cannot start"),
                };
                let message = format!("{program}: {what}: {e}");
                return Ok(AttemptOutcome {
                    classification,
                    exit_code: code,
                    signal: None,
                    start_time,
                    end_time: unix_time(),
                    last_progress: None,
                    progress: Vec::new(),
                    culprits: Vec::new(),
                    detect_s: None,
                    kill_s: None,
                    message: Some(message),
                });
            }
        }
    }
    drop(done_tx);

    let mut statuses: Vec<Option<ExitStatus>> = vec![None; children.len()];
    let ranks: Vec<Option<usize>> = children.iter().map(|(_, r)| *r).collect();
    // One waiter thread per child: an exit wakes the loop at once instead of at the next
    // tick, which is most of the overhead of launching a short program.
    let (exit_tx, exit_rx) = mpsc::channel::<(usize, ExitStatus)>();
    for (i, (mut child, _)) in children.into_iter().enumerate() {
        let tx = exit_tx.clone();
        std::thread::spawn(move || {
            // An error means the child can no longer be waited for (reaped elsewhere):
            // count it as a failed exit rather than waiting forever.
            let status = child.wait().unwrap_or(ExitStatus::from_raw(1 << 8));
            let _ = tx.send((i, status));
        });
    }
    drop(exit_tx);
    let mut exited: Vec<(usize, ExitStatus)> = Vec::new();
    let mut first_failure: Option<usize> = None;
    let mut verdict: Option<Verdict> = None;
    let mut stop_signal: Option<i32> = None;
    let mut kill_at: Option<Instant> = None;
    let mut beacons: BTreeMap<usize, Tracked> = BTreeMap::new();
    let mut last_beacon_read: Option<Instant> = None;
    let mut last_beacon_change = start;

    loop {
        let now = Instant::now();
        exited.extend(exit_rx.try_iter());
        for (i, status) in exited.drain(..) {
            statuses[i] = Some(status);
            if !status.success() && first_failure.is_none() {
                first_failure = Some(i);
                // One dead rank leaves the rest blocked in a collective: stop them all.
                if statuses.iter().any(Option::is_none) && kill_at.is_none() {
                    kill_groups(&groups, Signal::SIGTERM);
                    kill_at = Some(now + cfg.grace);
                }
            }
        }
        if statuses.iter().all(Option::is_some) {
            break;
        }

        if let Some(req) = stop()
            && req.count > handled_stops
        {
            handled_stops = req.count;
            if stop_signal.is_none() {
                stop_signal = Some(req.signal);
                let sig = Signal::try_from(req.signal).unwrap_or(Signal::SIGTERM);
                tracing::info!("forwarding {sig} to the ranks");
                kill_groups(&groups, sig);
                kill_at = Some(now + cfg.grace);
                let classification = if req.signal == libc::SIGUSR1 {
                    Classification::Walltime
                } else {
                    Classification::Interrupted
                };
                verdict.get_or_insert(Verdict {
                    classification,
                    at: now,
                    detect_s: None,
                    culprits: Vec::new(),
                    message: Some(format!(
                        "kiln received {sig}: forwarded it to the ranks; not retrying"
                    )),
                });
            } else {
                // A second Ctrl-C means "now".
                kill_groups(&groups, Signal::SIGKILL);
            }
        }

        if verdict.is_none()
            && let Some(deadline) = cfg.deadline
            && now >= deadline
        {
            kill_groups(&groups, Signal::SIGTERM);
            kill_at = Some(now + cfg.grace);
            verdict = Some(Verdict {
                classification: Classification::Walltime,
                at: now,
                detect_s: None,
                culprits: Vec::new(),
                message: Some("walltime reached: sent SIGTERM so the ranks can checkpoint".into()),
            });
        }

        if let Some(dir) = &cfg.progress_dir
            && last_beacon_read.is_none_or(|t| now.duration_since(t) >= BEACON_EVERY)
        {
            last_beacon_read = Some(now);
            if update_beacons(&mut beacons, read_beacons(dir), start_time, now) {
                last_beacon_change = now;
            }
        }

        if verdict.is_none() && first_failure.is_none() {
            verdict = watchdog(cfg, &shared, &beacons, last_beacon_change, now);
            if let Some(v) = &verdict {
                // Say it now, not after the grace period: the operator watching wants to know.
                if cfg.echo
                    && let Some(m) = &v.message
                {
                    eprintln!(
                        "kiln: {m}; stopping the ranks (SIGTERM, SIGKILL after {:.1} s)",
                        cfg.grace.as_secs_f64()
                    );
                }
                kill_groups(&groups, Signal::SIGTERM);
                kill_at = Some(now + cfg.grace);
            }
        }

        if let Some(at) = kill_at
            && now >= at
        {
            kill_groups(&groups, Signal::SIGKILL);
            kill_at = None;
        }
        if let Ok(e) = exit_rx.recv_timeout(TICK) {
            exited.push(e);
        }
    }

    // The direct children are gone; their descendants may not be. Nothing may outlive the
    // attempt: SIGTERM what is left, give it the grace period, then SIGKILL.
    finish_groups(&groups, cfg.grace, cfg.reap_orphans);
    if cfg.reap_orphans {
        reap_adopted();
    }
    let deadline = Instant::now() + Duration::from_secs(2);
    for _ in 0..readers {
        let left = deadline.saturating_duration_since(Instant::now());
        if done_rx.recv_timeout(left).is_err() {
            tracing::warn!(
                "output readers did not finish: a process outside the group still holds the pipe"
            );
            break;
        }
    }
    if let Ok(mut f) = log.lock() {
        let _ = f.flush();
    }
    let end = Instant::now();

    // The deciding status: the first failure, else the launcher/rank 0.
    let decide = first_failure.unwrap_or(0);
    let status = statuses.get(decide).copied().flatten();
    let code = status.and_then(|s| s.code());
    let signal = status.and_then(|s| s.signal());
    let progress = progress_report(&shared, &beacons, verdict.as_ref().map_or(end, |v| v.at));
    let last_progress = progress.iter().map(|p| p.step).max();
    let (classification, exit_code, detect_s, culprits, message, at) = match verdict {
        Some(v) => {
            let exit_code = match v.classification {
                Classification::HungSilent | Classification::HungStalled => WATCHDOG_EXIT,
                Classification::Walltime => WALLTIME_EXIT,
                // After forwarding a stop, a rank that checkpointed and exited with a code
                // tells the truth about where it stands (75: resumable); pass it through.
                _ => match (code, stop_signal) {
                    (Some(c), _) => c,
                    (None, Some(s)) => 128 + s,
                    (None, None) => exit_code_of(code, signal),
                },
            };
            (
                v.classification,
                exit_code,
                v.detect_s,
                v.culprits,
                v.message,
                Some(v.at),
            )
        }
        None => (
            classify_exit(code, signal),
            exit_code_of(code, signal),
            None,
            Vec::new(),
            None,
            None,
        ),
    };
    let message = message.or_else(
        || match (classification, first_failure, ranks.get(decide)) {
            (Classification::Failed | Classification::Signaled, Some(_), Some(Some(rank)))
                if ranks.len() > 1 =>
            {
                Some(format!(
                    "rank {rank} failed first ({}); the other ranks were stopped",
                    describe(code, signal)
                ))
            }
            _ => None,
        },
    );
    Ok(AttemptOutcome {
        classification,
        exit_code,
        signal,
        start_time,
        end_time: start_time + end.duration_since(start).as_secs_f64(),
        last_progress,
        progress,
        culprits,
        detect_s,
        kill_s: at.map(|a| end.duration_since(a).as_secs_f64()),
        message,
    })
}

fn describe(code: Option<i32>, signal: Option<i32>) -> String {
    match (code, signal) {
        (Some(c), _) => format!("exit code {c}"),
        (None, Some(s)) => format!("killed by signal {s}"),
        _ => "unknown status".into(),
    }
}

fn spawn(spec: &ProcSpec) -> std::io::Result<Child> {
    let Some((program, args)) = spec.argv.split_first() else {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidInput,
            "empty argv",
        ));
    };
    let mut cmd = Command::new(program);
    cmd.args(args)
        .envs(spec.env.iter().map(|(k, v)| (k, v)))
        // Ranks must not read kiln's terminal: several would race for it, and a background
        // process group reading a tty is stopped by SIGTTIN.
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        // Its own process group: the whole tree is signalled as one, and the terminal's
        // Ctrl-C reaches kiln only, which forwards it deliberately.
        .process_group(0);
    #[cfg(target_os = "linux")]
    {
        // If kiln itself is SIGKILLed, its direct children must not run on unsupervised.
        // SAFETY: prctl is async-signal-safe and touches no memory of the parent.
        unsafe {
            cmd.pre_exec(|| {
                libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL, 0, 0, 0);
                Ok(())
            });
        }
    }
    cmd.spawn()
}

struct ReaderCtx {
    echo: bool,
    to_stderr: bool,
    log: Arc<Mutex<File>>,
    shared: Arc<Mutex<Shared>>,
    regex: Option<ProgressRegex>,
    source: Option<usize>,
}

/// Reads raw bytes until EOF: echo, tee, and scan for progress. Invalid UTF-8 or escape codes
/// cannot stop it; write errors (a closed terminal) only stop the echo.
fn read_stream(mut pipe: Box<dyn Read + Send>, ctx: ReaderCtx) {
    let mut buf = vec![0u8; 64 * 1024];
    let mut splitter = LineSplitter::default();
    let mut echo = ctx.echo;
    loop {
        let n = match pipe.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(_) => break,
        };
        let chunk = &buf[..n];
        if echo {
            let ok = if ctx.to_stderr {
                let mut e = std::io::stderr().lock();
                e.write_all(chunk).and_then(|()| e.flush())
            } else {
                let mut o = std::io::stdout().lock();
                o.write_all(chunk).and_then(|()| o.flush())
            };
            echo = ok.is_ok();
        }
        if let Ok(mut f) = ctx.log.lock() {
            let _ = f.write_all(chunk);
        }
        let now = Instant::now();
        let mut steps = Vec::new();
        if let Some(re) = &ctx.regex {
            splitter.feed(chunk, |line| steps.extend(re.find(line)));
        }
        if let Ok(mut s) = ctx.shared.lock() {
            s.last_output = Some(now);
            for step in steps {
                advance(&mut s.output_progress, ctx.source, step, now);
            }
        }
    }
    if let Some(re) = &ctx.regex {
        let mut steps = Vec::new();
        splitter.finish(|line| steps.extend(re.find(line)));
        if let Ok(mut s) = ctx.shared.lock() {
            for step in steps {
                advance(&mut s.output_progress, ctx.source, step, Instant::now());
            }
        }
    }
}

fn advance(
    map: &mut BTreeMap<Option<usize>, (u64, Instant)>,
    source: Option<usize>,
    step: u64,
    now: Instant,
) {
    match map.get_mut(&source) {
        Some((s, t)) if step > *s => {
            *s = step;
            *t = now;
        }
        Some(_) => {}
        None => {
            map.insert(source, (step, now));
        }
    }
}

fn clear_beacons(dir: &std::path::Path) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for e in entries.filter_map(Result::ok) {
        if e.file_name().to_string_lossy().starts_with("rank-") {
            let _ = std::fs::remove_file(e.path());
        }
    }
}

/// Merges fresh beacons; returns whether any rank advanced (or appeared). Beacons older than
/// the attempt are another attempt's and are ignored.
fn update_beacons(
    tracked: &mut BTreeMap<usize, Tracked>,
    fresh: Vec<Beacon>,
    start_time: f64,
    now: Instant,
) -> bool {
    let mut changed = false;
    for b in fresh.into_iter().filter(|b| b.time + 1.0 >= start_time) {
        match tracked.get_mut(&b.rank) {
            Some(t) => {
                if b.step > t.step {
                    t.step = b.step;
                    t.last_advance = now;
                    changed = true;
                }
                if b.phase != t.phase {
                    t.phase = b.phase;
                    changed = true;
                }
            }
            None => {
                tracked.insert(
                    b.rank,
                    Tracked {
                        step: b.step,
                        phase: b.phase,
                        last_advance: now,
                    },
                );
                changed = true;
            }
        }
    }
    changed
}

/// A rank whose beacon says it finished is not stalled.
fn finished(phase: &str) -> bool {
    matches!(phase, "done" | "finished" | "exit")
}

fn watchdog(
    cfg: &AttemptConfig,
    shared: &Arc<Mutex<Shared>>,
    beacons: &BTreeMap<usize, Tracked>,
    last_beacon_change: Instant,
    now: Instant,
) -> Option<Verdict> {
    let (last_output, output_progress) = {
        let s = shared.lock().ok()?;
        (s.last_output, s.output_progress.clone())
    };
    // Stall: any tracked rank (beacon) or output source that has not advanced for S.
    if let Some(limit) = cfg.stall_timeout {
        let mut idle: Vec<(Option<usize>, u64, f64)> = Vec::new();
        for (rank, t) in beacons.iter().filter(|(_, t)| !finished(&t.phase)) {
            idle.push((
                Some(*rank),
                t.step,
                now.duration_since(t.last_advance).as_secs_f64(),
            ));
        }
        if beacons.is_empty() {
            for (src, (step, at)) in &output_progress {
                idle.push((*src, *step, now.duration_since(*at).as_secs_f64()));
            }
        }
        let worst = idle.iter().map(|i| i.2).fold(0.0, f64::max);
        if !idle.is_empty() && worst >= limit.as_secs_f64() {
            let (culprits, who) = culprits(beacons, &output_progress, now);
            let step = idle.iter().map(|i| i.1).max().unwrap_or(0);
            return Some(Verdict {
                classification: Classification::HungStalled,
                at: now,
                detect_s: Some(worst),
                culprits,
                message: Some(format!(
                    "watchdog: progress stalled for {worst:.1} s (--stall-timeout {}) although the job is still running; \
                     last step {step}; {who}",
                    limit.as_secs_f64()
                )),
            });
        }
    }
    if let Some(limit) = cfg.silence_timeout {
        let last = last_output.unwrap_or(now).max(last_beacon_change);
        let quiet = now.duration_since(last).as_secs_f64();
        if quiet >= limit.as_secs_f64() {
            let (culprits, who) = culprits(beacons, &output_progress, now);
            let step = output_progress
                .values()
                .map(|p| p.0)
                .chain(beacons.values().map(|t| t.step))
                .max();
            let step = step.map_or("no progress seen".to_string(), |s| format!("last step {s}"));
            return Some(Verdict {
                classification: Classification::HungSilent,
                at: now,
                detect_s: Some(quiet),
                culprits,
                message: Some(format!(
                    "watchdog: no output for {quiet:.1} s (--timeout {}); {step}; {who}",
                    limit.as_secs_f64()
                )),
            });
        }
    }
    None
}

/// Names the ranks that stopped advancing first: the lowest step; among equals, those whose
/// last advance is within half a second of the earliest. Beacons win over output.
fn culprits(
    beacons: &BTreeMap<usize, Tracked>,
    output: &BTreeMap<Option<usize>, (u64, Instant)>,
    now: Instant,
) -> (Vec<usize>, String) {
    let ranks: Vec<(usize, u64, Instant, &str)> = if !beacons.is_empty() {
        beacons
            .iter()
            .filter(|(_, t)| !finished(&t.phase))
            .map(|(r, t)| (*r, t.step, t.last_advance, "beacon"))
            .collect()
    } else {
        output
            .iter()
            .filter_map(|(r, (s, t))| Some(((*r)?, *s, *t, "output")))
            .collect()
    };
    if ranks.is_empty() {
        return (
            Vec::new(),
            "no per-rank progress (write beacons to $KILN_PROGRESS_DIR/rank-<R> to name the rank)"
                .into(),
        );
    }
    let min_step = ranks.iter().map(|r| r.1).min().unwrap_or(0);
    let lowest: Vec<_> = ranks.iter().filter(|r| r.1 == min_step).collect();
    let earliest = lowest.iter().map(|r| r.2).min().unwrap_or(now);
    let first: Vec<usize> = lowest
        .iter()
        .filter(|r| r.2.duration_since(earliest) <= Duration::from_millis(500))
        .map(|r| r.0)
        .collect();
    let detail: Vec<String> = ranks
        .iter()
        .map(|(r, s, t, _)| {
            format!(
                "rank {r} step {s} ({:.1} s ago)",
                now.duration_since(*t).as_secs_f64()
            )
        })
        .collect();
    let list: Vec<String> = first.iter().map(usize::to_string).collect();
    let who = format!(
        "ranks that stopped advancing first: {} (from {}s: {})",
        list.join(", "),
        ranks[0].3,
        detail.join(", ")
    );
    (first, who)
}

fn progress_report(
    shared: &Arc<Mutex<Shared>>,
    beacons: &BTreeMap<usize, Tracked>,
    at: Instant,
) -> Vec<RankProgress> {
    let mut out: Vec<RankProgress> = beacons
        .iter()
        .map(|(r, t)| RankProgress {
            rank: Some(*r),
            step: t.step,
            phase: Some(t.phase.clone()),
            idle_s: at.saturating_duration_since(t.last_advance).as_secs_f64(),
            source: "beacon",
        })
        .collect();
    if let Ok(s) = shared.lock() {
        out.extend(s.output_progress.iter().map(|(r, (step, t))| RankProgress {
            rank: *r,
            step: *step,
            phase: None,
            idle_s: at.saturating_duration_since(*t).as_secs_f64(),
            source: "output",
        }));
    }
    out
}

fn kill_groups(groups: &[Pid], sig: Signal) {
    for &pg in groups {
        // ESRCH (group already empty) is the normal case at the end; nothing to report.
        let _ = killpg(pg, sig);
    }
}

fn any_alive(groups: &[Pid]) -> bool {
    groups.iter().any(|&pg| killpg(pg, None).is_ok())
}

/// Ends whatever is left in the groups: SIGTERM, up to `grace`, SIGKILL, up to one second.
fn finish_groups(groups: &[Pid], grace: Duration, reap: bool) {
    if !any_alive(groups) {
        return;
    }
    kill_groups(groups, Signal::SIGTERM);
    let until = Instant::now() + grace;
    while any_alive(groups) && Instant::now() < until {
        if reap {
            reap_any_adopted_zombies();
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    if any_alive(groups) {
        kill_groups(groups, Signal::SIGKILL);
        let until = Instant::now() + Duration::from_secs(1);
        while any_alive(groups) && Instant::now() < until {
            reap_any_adopted_zombies();
            std::thread::sleep(Duration::from_millis(10));
        }
    }
}

/// Children of this process that are not ones we spawned: descendants re-parented to us.
fn adopted_children() -> Vec<i32> {
    let me = std::process::id() as i32;
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    entries
        .filter_map(Result::ok)
        .filter_map(|e| e.file_name().to_str()?.parse::<i32>().ok())
        .filter(|&pid| {
            std::fs::read_to_string(format!("/proc/{pid}/stat"))
                .ok()
                .and_then(|s| {
                    // Fields after the command name, which may itself contain spaces and ')'.
                    let rest = &s[s.rfind(')')? + 1..];
                    rest.split_whitespace().nth(1)?.parse::<i32>().ok()
                })
                == Some(me)
        })
        .collect()
}

/// Reaps adopted zombies (a killed grandchild whose parent was already gone is re-parented to
/// us as subreaper; until reaped it still counts as a member of its group).
fn reap_any_adopted_zombies() {
    use nix::sys::wait::{WaitPidFlag, waitpid};
    for pid in adopted_children() {
        let _ = waitpid(Pid::from_raw(pid), Some(WaitPidFlag::WNOHANG));
    }
}

/// Kills and reaps every adopted descendant, repeating while killing one orphans another.
fn reap_adopted() {
    use nix::sys::wait::waitpid;
    for _ in 0..16 {
        let pids = adopted_children();
        if pids.is_empty() {
            return;
        }
        for &pid in &pids {
            let _ = nix::sys::signal::kill(Pid::from_raw(pid), Signal::SIGKILL);
        }
        for pid in pids {
            let _ = waitpid(Pid::from_raw(pid), None);
        }
    }
}

//! One attempt: start the processes (each in its own process group, stdout on a pty),
//! capture and tee their output, watch for silence and stalled progress, and kill whole
//! process trees.

use crate::classify::{Classification, classify_code, classify_exit, exit_code_of};
use crate::groups::{finish_groups, grace_after_loss, kill_groups, reap_adopted};
use crate::plan::ProcSpec;
use crate::progress::{LineSplitter, ProgressRegex, StepCounter};
use crate::signals::StopRequest;
use kiln_run::{Beacon, ExitRecord, exit, read_beacons, read_exit_records, unix_time};
use nix::sys::signal::Signal;
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
    /// Without `stall_timeout`, stop progress stalls after a multiple of the observed step
    /// time of the beacon-reporting ranks (see [`crate::stall`]).
    pub stall_auto: bool,
    /// Progress regex over output lines (`None`: beacons only).
    pub progress_regex: Option<ProgressRegex>,
    /// Beacon directory (`$KILN_PROGRESS_DIR`).
    pub progress_dir: Option<PathBuf>,
    /// Remove stale beacons and exit records from `progress_dir` before starting.
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
    /// Give each process a pseudo-terminal as stdout, so that it flushes every line (falls
    /// back to a pipe where no pty can be opened).
    pub stdout_pty: bool,
    /// Ranks the attempt runs; when every one of them has left an exit record
    /// (`kiln launch --as-rank` writes them) the attempt is classified by those exits even if
    /// the launcher still runs.
    pub expected_ranks: Option<usize>,
    /// Each rank of a launcher runs under `kiln launch --as-rank`, which carries kiln's stop
    /// request to its rank (see [`kiln_run::write_stop_request`]).
    pub rank_shims: bool,
    /// `--heartbeat-timeout`: a rank that beat and then fell silent this long is killed and
    /// ends the attempt (see [`kiln_run::Heartbeat`]); `None`: heartbeats are not watched.
    pub heartbeat_timeout: Option<Duration>,
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
    /// Host from the beacon, when it said.
    pub host: Option<String>,
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
    /// The step the ranks started from (the lowest first beacon), when beacons say.
    pub start_step: Option<u64>,
    /// Unix time progress first advanced in this attempt (a step completed).
    pub first_advance_time: Option<f64>,
    /// Unix time progress last advanced.
    pub last_advance_time: Option<f64>,
    /// Per-rank (or merged) progress.
    pub progress: Vec<RankProgress>,
    /// Ranks that stopped advancing first (watchdog only).
    pub culprits: Vec<usize>,
    /// How each rank's program ended, from the exit records of `kiln launch --as-rank`.
    pub rank_exits: Vec<ExitRecord>,
    /// Seconds from the last activity/advance to the watchdog firing.
    pub detect_s: Option<f64>,
    /// Seconds from the watchdog firing (or stop) until every process was gone.
    pub kill_s: Option<f64>,
    /// A human sentence about the ending (watchdog message, spawn error, ...).
    pub message: Option<String>,
}

impl AttemptOutcome {
    /// Whether any step completed during this attempt.
    pub fn advanced(&self) -> bool {
        self.first_advance_time.is_some()
    }

    /// The outcome of an attempt that could not start: exit `code` (classified by it),
    /// `message` says why.
    pub fn not_started(code: i32, message: String) -> Self {
        Self::spawn_failure(classify_code(code, false), code, message)
    }

    fn spawn_failure(classification: Classification, code: i32, message: String) -> Self {
        let now = unix_time();
        AttemptOutcome {
            classification,
            exit_code: code,
            signal: None,
            start_time: now,
            end_time: now,
            last_progress: None,
            start_step: None,
            first_advance_time: None,
            last_advance_time: None,
            progress: Vec::new(),
            culprits: Vec::new(),
            rank_exits: Vec::new(),
            detect_s: None,
            kill_s: None,
            message: Some(message),
        }
    }
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

#[derive(Default)]
struct Shared {
    last_output: Option<Instant>,
    /// Output-derived progress per source (rank for local spawns, `None` for a launcher).
    output_progress: BTreeMap<Option<usize>, (u64, Instant)>,
    /// Each output source's step counter (what counts as progress).
    output_counters: BTreeMap<Option<usize>, StepCounter>,
    /// When progress first and last advanced (output or beacons).
    first_advance: Option<Instant>,
    last_advance: Option<Instant>,
}

impl Shared {
    fn advanced(&mut self, now: Instant) {
        self.first_advance.get_or_insert(now);
        self.last_advance = Some(now);
    }
}

struct Tracked {
    step: u64,
    first_step: u64,
    phase: String,
    host: Option<String>,
    last_advance: Instant,
}

/// What the watchdog or a stop decided, before the processes are gone.
struct Verdict {
    classification: Classification,
    at: Instant,
    detect_s: Option<f64>,
    culprits: Vec<usize>,
    message: Option<String>,
    /// An exit code that overrides the usual one for the classification.
    exit_code: Option<i32>,
}

/// The processes of a running attempt.
struct Running {
    groups: Vec<Pid>,
    ranks: Vec<Option<usize>>,
    exit_rx: mpsc::Receiver<(usize, ExitStatus, Instant)>,
    done_rx: mpsc::Receiver<()>,
    readers: usize,
    /// Heartbeat listeners of ranks kiln spawned itself: `(index in groups, rank, listener)`.
    beats: Vec<(usize, usize, crate::heartbeat::Listener)>,
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
        kiln_run::clear_rank_files(dir);
    }
    if let Some(dir) = &cfg.progress_dir {
        kiln_run::clear_stop_request(dir);
    }
    // Stop requests that arrived before this attempt (during backoff) are the caller's to
    // handle; only new ones count here.
    let handled_stops = stop().map_or(0, |s| s.count);
    let shared = Arc::new(Mutex::new(Shared {
        last_output: Some(start),
        ..Shared::default()
    }));
    let running = match start_all(cfg, &log, &shared) {
        Ok(r) => r,
        Err(outcome) => return Ok(*outcome),
    };
    let mut w = Watch {
        statuses: vec![None; running.ranks.len()],
        first_failure: None,
        verdict: None,
        stop_signal: None,
        beacons: BTreeMap::new(),
        live: BTreeMap::new(),
        handled_stops,
        failure_detect_s: None,
        ended: None,
        liveness_read: None,
        steps: crate::stall::StepClock::default(),
    };
    w.run(cfg, &running, &shared, stop, start, start_time);

    // The direct children are gone; their descendants may not be. Nothing may outlive the
    // attempt: SIGTERM what is left, give it the grace period, then SIGKILL.
    finish_groups(&running.groups, cfg.grace, cfg.reap_orphans);
    if cfg.reap_orphans {
        reap_adopted();
    }
    let deadline = Instant::now() + Duration::from_secs(2);
    for _ in 0..running.readers {
        let left = deadline.saturating_duration_since(Instant::now());
        if running.done_rx.recv_timeout(left).is_err() {
            tracing::warn!(
                "output readers did not finish: a process outside the group still holds the pipe"
            );
            break;
        }
    }
    if let Ok(mut f) = log.lock() {
        let _ = f.flush();
    }
    Ok(w.outcome(cfg, &running, &shared, start, start_time))
}

/// Starts every process; on a spawn failure, kills what already started and returns the
/// outcome to report.
fn start_all(
    cfg: &AttemptConfig,
    log: &Arc<Mutex<File>>,
    shared: &Arc<Mutex<Shared>>,
) -> Result<Running, Box<AttemptOutcome>> {
    let (done_tx, done_rx) = mpsc::channel::<()>();
    let mut readers = 0usize;
    let mut children: Vec<(Child, Option<usize>)> = Vec::new();
    let mut groups: Vec<Pid> = Vec::new();
    let mut beats = Vec::new();
    for spec in &cfg.procs {
        let beat_pipe = match (spec.rank, cfg.heartbeat_timeout) {
            (Some(_), Some(_)) => crate::heartbeat::pipe().ok(),
            _ => None,
        };
        let spawned = spawn(spec, cfg.stdout_pty, beat_pipe.as_ref().map(|p| &p.1));
        if let (Some((read, _write)), Some(rank), Ok(_)) = (beat_pipe, spec.rank, &spawned) {
            beats.push((groups.len(), rank, crate::heartbeat::Listener::start(read)));
        }
        let (mut child, stdout) = match spawned {
            Ok(c) => c,
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
                        exit::NOT_FOUND,
                        "command not found",
                    ),
                    std::io::ErrorKind::PermissionDenied => (
                        Classification::NotFound,
                        exit::NOT_EXECUTABLE,
                        "permission denied (not executable)",
                    ),
                    _ => (Classification::Failed, exit::NOT_EXECUTABLE, "cannot start"),
                };
                return Err(Box::new(AttemptOutcome::spawn_failure(
                    classification,
                    code,
                    format!("{program}: {what}: {e}"),
                )));
            }
        };
        groups.push(Pid::from_raw(child.id() as i32));
        let stderr = child
            .stderr
            .take()
            .map(|p| Box::new(p) as Box<dyn Read + Send>);
        for (pipe, to_stderr) in [(stdout, false), (stderr, true)] {
            let Some(pipe) = pipe else { continue };
            let ctx = ReaderCtx {
                echo: cfg.echo,
                to_stderr,
                log: Arc::clone(log),
                shared: Arc::clone(shared),
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
        children.push((child, spec.rank));
    }
    let ranks: Vec<Option<usize>> = children.iter().map(|(_, r)| *r).collect();
    // One waiter thread per child: an exit wakes the loop at once instead of at the next
    // tick, which is most of the overhead of launching a short program.
    let (exit_tx, exit_rx) = mpsc::channel::<(usize, ExitStatus, Instant)>();
    for (i, (mut child, _)) in children.into_iter().enumerate() {
        let tx = exit_tx.clone();
        std::thread::spawn(move || {
            // An error means the child can no longer be waited for (reaped elsewhere):
            // count it as a failed exit rather than waiting forever.
            let status = child.wait().unwrap_or(ExitStatus::from_raw(1 << 8));
            let _ = tx.send((i, status, Instant::now()));
        });
    }
    Ok(Running {
        groups,
        ranks,
        exit_rx,
        done_rx,
        readers,
        beats,
    })
}

/// The supervision state of one attempt.
struct Watch {
    statuses: Vec<Option<ExitStatus>>,
    first_failure: Option<usize>,
    verdict: Option<Verdict>,
    stop_signal: Option<i32>,
    beacons: BTreeMap<usize, Tracked>,
    live: BTreeMap<usize, Live>,
    handled_stops: u32,
    /// Seconds from the first failing rank's exit to kiln stopping the others.
    failure_detect_s: Option<f64>,
    /// When the last process exited.
    ended: Option<Instant>,
    /// When the progress directory was last read for lost and exit records.
    liveness_read: Option<Instant>,
    /// Step times from the beacons: the stall watchdog's default limit.
    steps: crate::stall::StepClock,
}

/// A rank's process as its shim last reported it.
#[derive(Debug, Clone)]
struct Live {
    state: char,
    cpu_ticks: u64,
    cpu_changed: Instant,
}

/// Merges fresh liveness records.
fn update_liveness(
    live: &mut BTreeMap<usize, Live>,
    fresh: Vec<kiln_run::Liveness>,
    start_time: f64,
    now: Instant,
) {
    for l in fresh.into_iter().filter(|l| l.time + 1.0 >= start_time) {
        let entry = live.entry(l.rank).or_insert(Live {
            state: l.state,
            cpu_ticks: l.cpu_ticks,
            cpu_changed: now,
        });
        if l.cpu_ticks != entry.cpu_ticks {
            entry.cpu_ticks = l.cpu_ticks;
            entry.cpu_changed = now;
        }
        entry.state = l.state;
    }
}

/// How often the progress directory is read for lost and exit records.
const LIVENESS_EVERY: Duration = Duration::from_millis(100);

impl Watch {
    /// See [`liveness_verdict`]; the progress directory is read every [`LIVENESS_EVERY`].
    fn liveness(
        &mut self,
        cfg: &AttemptConfig,
        running: &Running,
        start_time: f64,
        now: Instant,
    ) -> Option<Verdict> {
        let read_dir = self
            .liveness_read
            .is_none_or(|t| now.duration_since(t) >= LIVENESS_EVERY);
        if read_dir {
            self.liveness_read = Some(now);
        }
        let dir = cfg.progress_dir.as_deref().filter(|_| read_dir);
        liveness_verdict(cfg, running, &self.statuses, dir, start_time, now)
    }

    /// Watches until every process exited, acting on failures, stops, the walltime and
    /// the watchdogs.
    fn run(
        &mut self,
        cfg: &AttemptConfig,
        running: &Running,
        shared: &Arc<Mutex<Shared>>,
        stop: &dyn Fn() -> Option<StopRequest>,
        start: Instant,
        start_time: f64,
    ) {
        let groups = &running.groups;
        let mut exited: Vec<(usize, ExitStatus, Instant)> = Vec::new();
        let mut kill_at: Option<Instant> = None;
        let mut last_beacon_read: Option<Instant> = None;
        let mut last_beacon_change = start;
        loop {
            let now = Instant::now();
            exited.extend(running.exit_rx.try_iter());
            for (i, status, at) in exited.drain(..) {
                self.statuses[i] = Some(status);
                if !status.success() && self.first_failure.is_none() {
                    self.first_failure = Some(i);
                    self.failure_detect_s = Some(now.saturating_duration_since(at).as_secs_f64());
                    // One dead rank leaves the rest blocked in a collective: stop them all.
                    if self.statuses.iter().any(Option::is_none) && kill_at.is_none() {
                        kill_groups(groups, Signal::SIGTERM);
                        kill_at =
                            Some(now + grace_after_loss(cfg.grace, status.signal().is_some()));
                    }
                }
            }
            if self.statuses.iter().all(Option::is_some) {
                self.ended = Some(now);
                // The launcher may have ended the job before the lost record was read.
                if self.verdict.is_none()
                    && let (Some(dir), Some(bound)) = (&cfg.progress_dir, cfg.heartbeat_timeout)
                {
                    self.verdict = lost_verdict(dir, bound, start_time, now);
                }
                return;
            }
            if let Some(req) = stop()
                && req.count > self.handled_stops
            {
                self.handled_stops = req.count;
                if self.stop_signal.is_none() {
                    self.stop_signal = Some(req.signal);
                    let sig = Signal::try_from(req.signal).unwrap_or(Signal::SIGTERM);
                    tracing::info!("forwarding {sig} to the ranks");
                    forward_stop(cfg, running, sig);
                    kill_at = Some(now + cfg.grace);
                    let classification = if req.signal == libc::SIGUSR1 {
                        Classification::Walltime
                    } else {
                        Classification::Interrupted
                    };
                    self.verdict.get_or_insert(Verdict {
                        classification,
                        at: now,
                        detect_s: None,
                        culprits: Vec::new(),
                        message: Some(format!(
                            "kiln received {sig}: forwarded it to the ranks; not retrying"
                        )),
                        exit_code: None,
                    });
                } else {
                    // A second Ctrl-C means "now".
                    kill_groups(groups, Signal::SIGKILL);
                }
            }
            if self.verdict.is_none()
                && let Some(deadline) = cfg.deadline
                && now >= deadline
            {
                kill_groups(groups, Signal::SIGTERM);
                kill_at = Some(now + cfg.grace);
                self.verdict = Some(Verdict {
                    classification: Classification::Walltime,
                    at: now,
                    detect_s: None,
                    culprits: Vec::new(),
                    message: Some(
                        "walltime reached: sent SIGTERM so the ranks can checkpoint".into(),
                    ),
                    exit_code: None,
                });
            }
            if let Some(dir) = &cfg.progress_dir
                && last_beacon_read.is_none_or(|t| now.duration_since(t) >= BEACON_EVERY)
            {
                last_beacon_read = Some(now);
                let fresh = read_beacons(dir);
                self.steps.observe(&fresh, start_time, now);
                let (changed, advanced) = update_beacons(&mut self.beacons, fresh, start_time, now);
                if changed {
                    last_beacon_change = now;
                }
                if advanced && let Ok(mut s) = shared.lock() {
                    s.advanced(now);
                }
                // Ranks kiln spawned itself have no shim to report them: sample them here.
                let mut fresh = kiln_run::read_liveness(dir);
                for (pg, rank) in running.groups.iter().zip(&running.ranks) {
                    if let (Some(rank), Some((state, cpu_ticks))) =
                        (rank, crate::groups::group_liveness(pg.as_raw()))
                    {
                        fresh.push(kiln_run::Liveness {
                            rank: *rank,
                            state,
                            cpu_ticks,
                            time: kiln_run::unix_time(),
                            host: kiln_run::this_host().to_string(),
                        });
                    }
                }
                update_liveness(&mut self.live, fresh, start_time, now);
            }
            if self.verdict.is_none()
                && self.first_failure.is_none()
                && let Some(v) = self.liveness(cfg, running, start_time, now)
            {
                let lost = matches!(
                    v.classification,
                    Classification::NoHeartbeat | Classification::Signaled
                );
                let grace = grace_after_loss(cfg.grace, lost);
                eprintln_verdict(cfg, &v, grace);
                kill_groups(groups, Signal::SIGTERM);
                kill_at = Some(now + grace);
                self.verdict = Some(v);
            }
            if self.verdict.is_none() && self.first_failure.is_none() {
                self.verdict = watchdog(
                    cfg,
                    shared,
                    &self.beacons,
                    &self.live,
                    &self.steps,
                    last_beacon_change,
                    now,
                )
                .map(|v| ranks_already_exited(cfg).unwrap_or(v));
                if let Some(v) = &self.verdict {
                    eprintln_verdict(cfg, v, cfg.grace);
                    kill_groups(groups, Signal::SIGTERM);
                    kill_at = Some(now + cfg.grace);
                }
            }
            if let Some(at) = kill_at
                && now >= at
            {
                kill_groups(groups, Signal::SIGKILL);
                kill_at = None;
            }
            if let Ok(e) = running.exit_rx.recv_timeout(TICK) {
                exited.push(e);
            }
        }
    }

    /// The outcome, once every process is gone.
    fn outcome(
        self,
        cfg: &AttemptConfig,
        running: &Running,
        shared: &Arc<Mutex<Shared>>,
        start: Instant,
        start_time: f64,
    ) -> AttemptOutcome {
        let end = Instant::now();
        let rank_exits = cfg
            .progress_dir
            .as_deref()
            .map(read_exit_records)
            .unwrap_or_default()
            .into_iter()
            .filter(|r| r.time + 1.0 >= start_time)
            .collect::<Vec<_>>();
        // The deciding status: the first failure, else the launcher/rank 0.
        let decide = self.first_failure.unwrap_or(0);
        let status = self.statuses.get(decide).copied().flatten();
        let code = status.and_then(|s| s.code());
        let signal = status.and_then(|s| s.signal());
        let at_time = self.verdict.as_ref().map_or(end, |v| v.at);
        let progress = progress_report(shared, &self.beacons, at_time);
        let last_progress = progress.iter().map(|p| p.step).max();
        let start_step = self.beacons.values().map(|t| t.first_step).min();
        let stop_signal = self.stop_signal;
        let ranks_code = stop_signal.and(ranks_exit_code(cfg, &rank_exits));
        let (classification, exit_code, detect_s, culprits, message, at) = match self.verdict {
            Some(v) => {
                let exit_code = v.exit_code.unwrap_or(match v.classification {
                    Classification::HungSilent | Classification::HungStalled => exit::WATCHDOG,
                    Classification::Walltime => exit::PREEMPTED,
                    // After forwarding a stop, the ranks that checkpointed and exited tell the
                    // truth about where they stand (75: resumable): their own exits decide, not
                    // the launcher's.
                    _ => ranks_code.unwrap_or(match (code, stop_signal) {
                        (Some(c), _) => c,
                        (None, Some(s)) => 128 + s,
                        (None, None) => exit_code_of(code, signal),
                    }),
                });
                (
                    v.classification,
                    exit_code,
                    v.detect_s,
                    v.culprits,
                    v.message,
                    Some(v.at),
                )
            }
            None => {
                let (class, code, msg) = by_rank_exits(code, signal, &rank_exits);
                let ended = unix_at(self.ended.unwrap_or(end), start, start_time);
                let detect = self
                    .failure_detect_s
                    .or_else(|| first_failed(&rank_exits).map(|r| (ended - r.time).max(0.0)));
                let culprit = match self.first_failure.and_then(|i| running.ranks.get(i)) {
                    Some(Some(rank)) => Some(*rank),
                    _ => first_failed(&rank_exits).map(|r| r.rank),
                };
                let culprits = culprit
                    .into_iter()
                    .filter(|_| class != Classification::Success);
                (class, code, detect, culprits.collect(), msg, None)
            }
        };
        let message = message.or_else(|| {
            match (
                classification,
                self.first_failure,
                running.ranks.get(decide),
            ) {
                (
                    Classification::Failed
                    | Classification::Signaled
                    | Classification::Deterministic,
                    Some(_),
                    Some(Some(rank)),
                ) if running.ranks.len() > 1 => Some(format!(
                    "rank {rank} on {} failed first ({}); the other ranks were stopped",
                    kiln_run::this_host(),
                    describe(code, signal)
                )),
                _ => None,
            }
        });
        let (first_advance, last_advance) = shared
            .lock()
            .map(|s| (s.first_advance, s.last_advance))
            .unwrap_or((None, None));
        let unix = |i: Instant| start_time + i.saturating_duration_since(start).as_secs_f64();
        AttemptOutcome {
            classification,
            exit_code,
            signal,
            start_time,
            end_time: unix(end),
            last_progress,
            start_step,
            first_advance_time: first_advance.map(unix),
            last_advance_time: last_advance.map(unix),
            progress,
            culprits,
            rank_exits,
            detect_s,
            kill_s: at.map(|a| end.duration_since(a).as_secs_f64()),
            message,
        }
    }
}

/// Unix time of `i`, from the attempt's start in both clocks.
fn unix_at(i: Instant, start: Instant, start_time: f64) -> f64 {
    start_time + i.saturating_duration_since(start).as_secs_f64()
}

/// The rank that failed first by its exit record.
fn first_failed(records: &[ExitRecord]) -> Option<&ExitRecord> {
    records
        .iter()
        .filter(|r| r.shell_code() != 0)
        .min_by(|a, b| a.time.total_cmp(&b.time))
}

/// Says a verdict now, not after the grace period: the operator watching wants to know.
fn eprintln_verdict(cfg: &AttemptConfig, v: &Verdict, grace: Duration) {
    if cfg.echo
        && let Some(m) = &v.message
    {
        eprintln!(
            "kiln: {m}; stopping the ranks (SIGTERM, SIGKILL after {:.1} s)",
            grace.as_secs_f64()
        );
    }
}

/// Liveness apart from progress: a rank kiln spawned whose heartbeat fell silent for
/// `--heartbeat-timeout` (killed here at once: it is stopped or wedged), a rank a shim gave up
/// on (`lost-<R>`), or a rank under a launcher that exited with a failure while the launcher
/// still runs. Each ends the attempt at once, naming the rank and host, with the detection
/// time.
fn liveness_verdict(
    cfg: &AttemptConfig,
    running: &Running,
    statuses: &[Option<ExitStatus>],
    dir: Option<&std::path::Path>,
    start_time: f64,
    now: Instant,
) -> Option<Verdict> {
    let bound = cfg.heartbeat_timeout?;
    for (i, rank, l) in &running.beats {
        let Some(silent) = l.silent_for(now).filter(|s| *s >= bound) else {
            continue;
        };
        if statuses.get(*i).copied().flatten().is_some() {
            continue;
        }
        kill_groups(&running.groups[*i..=*i], Signal::SIGKILL);
        let host = kiln_run::this_host().to_string();
        return Some(no_heartbeat(*rank, &host, silent.as_secs_f64(), bound, now));
    }
    let dir = dir?;
    lost_verdict(dir, bound, start_time, now).or_else(|| failed_rank_verdict(dir, start_time, now))
}

/// A rank a shim gave up on for its silence (`lost-<R>`).
fn lost_verdict(
    dir: &std::path::Path,
    bound: Duration,
    start_time: f64,
    now: Instant,
) -> Option<Verdict> {
    let l = kiln_run::read_lost_records(dir)
        .into_iter()
        .find(|l| l.time + 1.0 >= start_time)?;
    let detect = l.silent_s + (unix_time() - l.time).max(0.0);
    Some(no_heartbeat(l.rank, &l.host, detect, bound, now))
}

/// A rank under a launcher that exited with a failure (its exit record) while the launcher
/// still runs.
fn failed_rank_verdict(dir: &std::path::Path, start_time: f64, now: Instant) -> Option<Verdict> {
    let exits: Vec<ExitRecord> = read_exit_records(dir)
        .into_iter()
        .filter(|r| r.time + 1.0 >= start_time)
        .collect();
    let r = first_failed(&exits)?;
    let code = r.shell_code();
    Some(Verdict {
        classification: classify_code(code, r.signal.is_some()),
        at: now,
        detect_s: Some((unix_time() - r.time).max(0.0)),
        culprits: vec![r.rank],
        message: Some(format!(
            "rank {} on {} failed first ({}); the other ranks were stopped",
            r.rank,
            r.host,
            describe(r.code, r.signal)
        )),
        exit_code: Some(code),
    })
}

fn no_heartbeat(rank: usize, host: &str, detect_s: f64, bound: Duration, now: Instant) -> Verdict {
    Verdict {
        classification: Classification::NoHeartbeat,
        at: now,
        detect_s: Some(detect_s),
        culprits: vec![rank],
        message: Some(format!(
            "rank {rank} on {host} sent no heartbeat for {detect_s:.2} s (--heartbeat-timeout {}): \
             stopped, wedged or gone",
            bound.as_secs_f64()
        )),
        exit_code: Some(exit::WATCHDOG),
    }
}

/// Classifies an attempt that ended on its own: by the launcher's (or the deciding rank's)
/// exit, unless the ranks' exit records tell more: the earliest rank to fail decides (a
/// launcher reports its own code, e.g. srun 137 after killing the other ranks).
fn by_rank_exits(
    code: Option<i32>,
    signal: Option<i32>,
    records: &[ExitRecord],
) -> (Classification, i32, Option<String>) {
    let launcher = (classify_exit(code, signal), exit_code_of(code, signal));
    if launcher.0 == Classification::Success {
        return (launcher.0, launcher.1, None);
    }
    let first = records
        .iter()
        .filter(|r| r.shell_code() != 0)
        .min_by(|a, b| a.time.total_cmp(&b.time));
    match first {
        Some(r) => {
            let c = r.shell_code();
            (
                classify_code(c, r.signal.is_some()),
                c,
                Some(format!(
                    "rank {} on {} failed first ({})",
                    r.rank,
                    r.host,
                    describe(r.code, r.signal)
                )),
            )
        }
        None => (launcher.0, launcher.1, None),
    }
}

/// Delivers a stop signal kiln received to the ranks. Under a launcher whose ranks run the
/// `--as-rank` shim, the shims deliver it (see [`kiln_run::write_stop_request`]); the launcher
/// is not signalled, because it would kill ranks that are still checkpointing. Otherwise the
/// process groups get it.
fn forward_stop(cfg: &AttemptConfig, running: &Running, sig: Signal) {
    let shimmed = cfg.rank_shims && running.ranks.iter().all(Option::is_none);
    if let (true, Some(dir)) = (shimmed, &cfg.progress_dir) {
        match kiln_run::write_stop_request(dir, sig as i32, unix_time()) {
            Ok(()) => return,
            Err(e) => tracing::warn!("{e}: signalling the launcher instead"),
        }
    }
    kill_groups(&running.groups, sig);
}

/// The code the ranks' own exits give, once every expected rank left an exit record: 0 if all
/// succeeded, else the code of the rank that failed first.
fn ranks_exit_code(cfg: &AttemptConfig, records: &[ExitRecord]) -> Option<i32> {
    let n = cfg.expected_ranks.filter(|&n| n > 0)?;
    if (0..n).any(|r| !records.iter().any(|x| x.rank == r)) {
        return None;
    }
    let first = records
        .iter()
        .filter(|r| r.shell_code() != 0)
        .min_by(|a, b| a.time.total_cmp(&b.time));
    Some(first.map_or(0, ExitRecord::shell_code))
}

/// When a watchdog fires but every rank has already exited (it left an exit record), the
/// ranks' exits decide, not the silence: a launcher can hang on a leftover process that
/// holds its output after the ranks are done.
fn ranks_already_exited(cfg: &AttemptConfig) -> Option<Verdict> {
    let n = cfg.expected_ranks?;
    let records = read_exit_records(cfg.progress_dir.as_deref()?);
    if n == 0 || (0..n).any(|r| !records.iter().any(|x| x.rank == r)) {
        return None;
    }
    let (classification, code, msg) = by_rank_exits(Some(1), None, &records);
    let (classification, code) = if records.iter().all(|r| r.shell_code() == 0) {
        (Classification::Success, 0)
    } else {
        (classification, code)
    };
    Some(Verdict {
        classification,
        at: Instant::now(),
        detect_s: None,
        culprits: Vec::new(),
        message: Some(msg.unwrap_or_else(|| {
            format!(
                "all {n} ranks exited 0, but the launcher kept running (a leftover process holds its output); stopped it"
            )
        })),
        exit_code: Some(code),
    })
}

fn describe(code: Option<i32>, signal: Option<i32>) -> String {
    match (code, signal) {
        (Some(c), _) => format!("exit code {c}"),
        (None, Some(s)) => format!("killed by signal {s}"),
        _ => "unknown status".into(),
    }
}

/// A process's stdout as kiln reads it.
type Stream = Option<Box<dyn Read + Send>>;

fn spawn(
    spec: &ProcSpec,
    pty: bool,
    heartbeat: Option<&std::os::fd::OwnedFd>,
) -> std::io::Result<(Child, Stream)> {
    let Some((program, args)) = spec.argv.split_first() else {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidInput,
            "empty argv",
        ));
    };
    let pty = if pty {
        crate::pty::open_raw_pty()
    } else {
        None
    };
    let mut cmd = Command::new(program);
    let (stdout, master) = match pty {
        Some(p) => (Stdio::from(p.slave), Some(p.master)),
        None => (Stdio::piped(), None),
    };
    cmd.args(args)
        .envs(spec.env.iter().map(|(k, v)| (k, v)))
        // Ranks must not read kiln's terminal: several would race for it, and a background
        // process group reading a tty is stopped by SIGTTIN.
        .stdin(Stdio::null())
        .stdout(stdout)
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
    if let Some(write) = heartbeat {
        crate::heartbeat::hand_to_child(&mut cmd, write);
    }
    let mut child = cmd.spawn()?;
    // `cmd` holds the pty's slave end: drop it, so the terminal closes when the child's
    // side does.
    drop(cmd);
    let stdout: Stream = match master {
        Some(m) => Some(Box::new(m)),
        None => child
            .stdout
            .take()
            .map(|p| Box::new(p) as Box<dyn Read + Send>),
    };
    Ok((child, stdout))
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
            let mut moved = false;
            for step in steps {
                moved |= advance(&mut s, ctx.source, step, now);
            }
            if moved {
                s.advanced(now);
            }
        }
    }
    if let Some(re) = &ctx.regex {
        let mut steps = Vec::new();
        splitter.finish(|line| steps.extend(re.find(line)));
        if let Ok(mut s) = ctx.shared.lock() {
            let now = Instant::now();
            let mut moved = false;
            for step in steps {
                moved |= advance(&mut s, ctx.source, step, now);
            }
            if moved {
                s.advanced(now);
            }
        }
    }
}

/// Records a step seen in the output; returns whether it is progress (see [`StepCounter`]:
/// a printed step means a step completed, so the first one counts too).
fn advance(s: &mut Shared, source: Option<usize>, step: u64, now: Instant) -> bool {
    if !s.output_counters.entry(source).or_default().observe(step) {
        return false;
    }
    s.output_progress.insert(source, (step, now));
    true
}

/// Merges fresh beacons; returns whether anything changed (a rank advanced, appeared or
/// changed phase) and whether a rank advanced. A beacon's first step is where the rank
/// started, not progress. Beacons older than the attempt are another attempt's and are
/// ignored.
fn update_beacons(
    tracked: &mut BTreeMap<usize, Tracked>,
    fresh: Vec<Beacon>,
    start_time: f64,
    now: Instant,
) -> (bool, bool) {
    let (mut changed, mut advanced) = (false, false);
    for b in fresh.into_iter().filter(|b| b.time + 1.0 >= start_time) {
        match tracked.get_mut(&b.rank) {
            Some(t) => {
                if b.step > t.step {
                    t.step = b.step;
                    t.last_advance = now;
                    changed = true;
                    advanced = true;
                }
                if b.phase != t.phase {
                    t.phase = b.phase;
                    changed = true;
                }
                if b.host.is_some() {
                    t.host = b.host;
                }
            }
            None => {
                tracked.insert(
                    b.rank,
                    Tracked {
                        step: b.step,
                        first_step: b.step,
                        phase: b.phase,
                        host: b.host,
                        last_advance: now,
                    },
                );
                changed = true;
            }
        }
    }
    (changed, advanced)
}

fn waiting(phase: &str) -> bool {
    kiln_run::event::beacon_phase::WAITING.contains(&phase)
}

/// A rank whose beacon says it finished is not stalled.
fn finished(phase: &str) -> bool {
    kiln_run::event::beacon_phase::FINISHED.contains(&phase)
}

fn watchdog(
    cfg: &AttemptConfig,
    shared: &Arc<Mutex<Shared>>,
    beacons: &BTreeMap<usize, Tracked>,
    live: &BTreeMap<usize, Live>,
    steps: &crate::stall::StepClock,
    last_beacon_change: Instant,
    now: Instant,
) -> Option<Verdict> {
    let (last_output, output_progress) = {
        let s = shared.lock().ok()?;
        (s.last_output, s.output_progress.clone())
    };
    // Stall: any tracked rank (beacon) or output source that has not advanced for S.
    let stall = match cfg.stall_timeout {
        Some(s) => Some((s, format!("--stall-timeout {}", s.as_secs_f64()))),
        None => steps.limit().filter(|_| cfg.stall_auto),
    };
    if let Some((limit, how)) = stall {
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
            let (culprits, who) = culprits(beacons, live, &output_progress, now);
            let step = idle.iter().map(|i| i.1).max().unwrap_or(0);
            return Some(Verdict {
                exit_code: None,
                classification: Classification::HungStalled,
                at: now,
                detect_s: Some(worst),
                culprits,
                message: Some(format!(
                    "watchdog: progress stalled for {worst:.1} s (limit {:.1} s: {how}) although the job is still running; \
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
            let (culprits, who) = culprits(beacons, live, &output_progress, now);
            let step = output_progress
                .values()
                .map(|p| p.0)
                .chain(beacons.values().map(|t| t.step))
                .max();
            let step = step.map_or("no progress seen".to_string(), |s| format!("last step {s}"));
            return Some(Verdict {
                exit_code: None,
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
    live: &BTreeMap<usize, Live>,
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
    // In a collective every healthy rank waits for the stuck one at the same step: a rank
    // whose beacon says it waits on the others is not the culprit when some rank does not.
    let working: Vec<usize> = beacons
        .iter()
        .filter(|(_, t)| !waiting(&t.phase) && !finished(&t.phase))
        .map(|(r, _)| *r)
        .collect();
    let suspects: Vec<&(usize, u64, Instant, &str)> = if !working.is_empty()
        && working.len() < ranks.len()
        && ranks.iter().all(|r| r.3 == "beacon")
    {
        ranks.iter().filter(|r| working.contains(&r.0)).collect()
    } else {
        ranks.iter().collect()
    };
    let min_step = suspects.iter().map(|r| r.1).min().unwrap_or(0);
    let lowest: Vec<_> = suspects
        .iter()
        .filter(|r| r.1 == min_step)
        .copied()
        .collect();
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
    let (first, how) = narrow_by_liveness(first, live, now);
    let list: Vec<String> = first.iter().map(usize::to_string).collect();
    let who = format!(
        "ranks that stopped advancing first: {} (from {}s{how}: {})",
        list.join(", "),
        ranks[0].3,
        detail.join(", ")
    );
    (first, who)
}

/// Among ranks that stopped at the same step at the same time (a collective: the healthy
/// ones wait for the stuck one), the stuck one is the process that does nothing: stopped, or
/// using no CPU while the others spin in MPI. Returns the narrowed list (unchanged when the
/// processes do not tell them apart) and how it was narrowed.
fn narrow_by_liveness(
    tied: Vec<usize>,
    live: &BTreeMap<usize, Live>,
    now: Instant,
) -> (Vec<usize>, &'static str) {
    if tied.len() < 2 || !tied.iter().all(|r| live.contains_key(r)) {
        return (tied, "");
    }
    let strict = |v: &Vec<usize>| !v.is_empty() && v.len() < tied.len();
    let stopped: Vec<usize> = tied
        .iter()
        .copied()
        .filter(|r| matches!(live[r].state, 'T' | 't'))
        .collect();
    if strict(&stopped) {
        return (stopped, " and process states: stopped");
    }
    let idle_for = |r: &usize| now.saturating_duration_since(live[r].cpu_changed);
    let busy = tied.iter().any(|r| idle_for(r) < Duration::from_secs(1));
    let idle: Vec<usize> = tied
        .iter()
        .copied()
        .filter(|r| idle_for(r) >= Duration::from_secs(2))
        .collect();
    if busy && strict(&idle) {
        return (idle, " and CPU use: no CPU while the others spin");
    }
    (tied, "")
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
            host: t.host.clone(),
            idle_s: at.saturating_duration_since(t.last_advance).as_secs_f64(),
            source: "beacon",
        })
        .collect();
    if let Ok(s) = shared.lock() {
        out.extend(s.output_progress.iter().map(|(r, (step, t))| RankProgress {
            rank: *r,
            step: *step,
            phase: None,
            host: None,
            idle_s: at.saturating_duration_since(*t).as_secs_f64(),
            source: "output",
        }));
    }
    out
}

//! Starting an attempt's processes: each in its own process group (stdout on a pty, stderr on
//! a pipe, a heartbeat pipe for ranks kiln spawns itself), a reader thread per stream and a
//! waiter thread per child; and, at the end, ending whatever of them is left.

use super::config::AttemptConfig;
use super::outcome::AttemptOutcome;
use super::output::{ReaderCtx, Shared, read_stream};
use crate::classify::Classification;
use crate::groups::{finish_groups, kill_groups, reap_adopted};
use crate::heartbeat::Listener;
use crate::plan::ProcSpec;
use kiln_run::exit;
use nix::sys::signal::Signal;
use nix::unistd::Pid;
use std::fs::File;
use std::io::Read;
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// A process's stdout as kiln reads it.
type Stream = Option<Box<dyn Read + Send>>;

/// The processes of a running attempt.
pub(super) struct Running {
    pub(super) groups: Vec<Pid>,
    pub(super) ranks: Vec<Option<usize>>,
    pub(super) exit_rx: mpsc::Receiver<(usize, ExitStatus, Instant)>,
    done_rx: mpsc::Receiver<()>,
    readers: usize,
    /// Heartbeat listeners of ranks kiln spawned itself: `(index in groups, rank, listener)`.
    pub(super) beats: Vec<(usize, usize, Listener)>,
}

/// Starts every process; on a spawn failure, kills what already started and returns the
/// outcome to report.
pub(super) fn start_all(
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
            beats.push((groups.len(), rank, Listener::start(read)));
        }
        let (mut child, stdout) = match spawned {
            Ok(c) => c,
            Err(e) => {
                // Nothing half-started may survive a failed spawn of a later rank.
                kill_groups(&groups, Signal::SIGKILL);
                for (c, _) in &mut children {
                    let _ = c.wait();
                }
                return Err(Box::new(spawn_failed(spec, &e)));
            }
        };
        groups.push(Pid::from_raw(child.id() as i32));
        let stderr = child
            .stderr
            .take()
            .map(|p| Box::new(p) as Box<dyn Read + Send>);
        for (pipe, to_stderr) in [(stdout, false), (stderr, true)] {
            let Some(pipe) = pipe else { continue };
            start_reader(
                pipe,
                reader(cfg, spec, to_stderr, log, shared),
                done_tx.clone(),
            );
            readers += 1;
        }
        children.push((child, spec.rank));
    }
    let ranks: Vec<Option<usize>> = children.iter().map(|(_, r)| *r).collect();
    Ok(Running {
        groups,
        ranks,
        exit_rx: start_waiters(children),
        done_rx,
        readers,
        beats,
    })
}

/// The outcome of an attempt whose process `spec` could not be started.
fn spawn_failed(spec: &ProcSpec, e: &std::io::Error) -> AttemptOutcome {
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
    AttemptOutcome::spawn_failure(classification, code, format!("{program}: {what}: {e}"))
}

/// Where the reader of one of `spec`'s streams sends what it reads.
fn reader(
    cfg: &AttemptConfig,
    spec: &ProcSpec,
    to_stderr: bool,
    log: &Arc<Mutex<File>>,
    shared: &Arc<Mutex<Shared>>,
) -> ReaderCtx {
    ReaderCtx {
        echo: cfg.echo,
        to_stderr,
        log: Arc::clone(log),
        shared: Arc::clone(shared),
        regex: cfg.progress_regex.clone(),
        source: spec.rank,
    }
}

/// A thread that reads one stream to its end, then says so on `done`.
fn start_reader(pipe: Box<dyn Read + Send>, ctx: ReaderCtx, done: mpsc::Sender<()>) {
    std::thread::spawn(move || {
        read_stream(pipe, ctx);
        let _ = done.send(());
    });
}

/// One waiter thread per child: an exit wakes the loop at once instead of at the next tick,
/// which is most of the overhead of launching a short program.
fn start_waiters(
    children: Vec<(Child, Option<usize>)>,
) -> mpsc::Receiver<(usize, ExitStatus, Instant)> {
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
    exit_rx
}

impl Running {
    /// Once the direct children are gone: their descendants may not be, and nothing may
    /// outlive the attempt: SIGTERM what is left, give it the grace period, then SIGKILL;
    /// then wait (briefly) for the output readers to drain.
    pub(super) fn finish(&self, cfg: &AttemptConfig) {
        finish_groups(&self.groups, cfg.grace, cfg.reap_orphans);
        if cfg.reap_orphans {
            reap_adopted();
        }
        let deadline = Instant::now() + Duration::from_secs(2);
        for _ in 0..self.readers {
            let left = deadline.saturating_duration_since(Instant::now());
            if self.done_rx.recv_timeout(left).is_err() {
                tracing::warn!(
                    "output readers did not finish: a process outside the group still holds the pipe"
                );
                break;
            }
        }
    }
}

/// Starts one process in its own process group.
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
    die_with_parent(&mut cmd);
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

/// If kiln itself is SIGKILLed, its direct children must not run on unsupervised.
fn die_with_parent(cmd: &mut Command) {
    #[cfg(target_os = "linux")]
    {
        // SAFETY: prctl is async-signal-safe and touches no memory of the parent.
        unsafe {
            cmd.pre_exec(|| {
                libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL, 0, 0, 0);
                Ok(())
            });
        }
    }
    #[cfg(not(target_os = "linux"))]
    let _ = cmd;
}

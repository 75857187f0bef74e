//! What runs on each rank under a launcher (`kiln launch --as-rank -- PROGRAM`): map the
//! launcher's rank variables onto RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE (keeping
//! MASTER_ADDR/PORT), run the program, and when it ends:
//! - record how it ended in `$KILN_PROGRESS_DIR/exit-<rank>` (with the host), so kiln
//!   classifies the job by its ranks' exits and names the host of the rank that failed;
//! - end whatever the program left behind (background processes, daemons that escaped with
//!   `setsid`): a leftover holding the rank's stdout keeps `mpirun`/`srun` waiting, and the
//!   job would look hung although every rank is done; and remove its Open MPI
//!   shared-memory segment, which a rank killed before `MPI_Finalize` leaves in `/dev/shm`
//!   (see [`crate::mpi_shm`]);
//! - exit with the program's code, or die of the program's signal.
//!
//! Signals the launcher sends the rank (SIGTERM before a kill, Slurm's `--signal`) are
//! forwarded to the program's process group.

use kiln_run::{PROGRESS_DIR_ENV, unix_time, write_exit_record};
use kiln_topology::{RankEnv, RankEnvError};
use nix::sys::signal::{SaFlags, SigAction, SigHandler, SigSet, Signal, killpg, sigaction};
use nix::unistd::Pid;
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::path::PathBuf;
use std::process::Command;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicI32, Ordering};
use std::time::{Duration, Instant};

/// How long leftovers get between SIGTERM and SIGKILL once the program has exited.
const LEFTOVER_GRACE: Duration = Duration::from_secs(2);

/// Signals forwarded from the shim to the program.
const FORWARDED: [Signal; 7] = [
    Signal::SIGTERM,
    Signal::SIGINT,
    Signal::SIGHUP,
    Signal::SIGQUIT,
    Signal::SIGUSR1,
    Signal::SIGUSR2,
    Signal::SIGALRM,
];

/// The program's process group, for the signal handler.
static CHILD_GROUP: AtomicI32 = AtomicI32::new(0);

extern "C" fn forward(sig: libc::c_int) {
    let pg = CHILD_GROUP.load(Ordering::SeqCst);
    if pg > 0 {
        // SAFETY: kill(2) is async-signal-safe; a negative pid names a process group.
        unsafe { libc::kill(-pg, sig) };
        // A stopped program (SIGSTOP, a debugger) would keep a termination request pending
        // forever: continue it so it can act on it, as Slurm's own cancel does.
        if matches!(
            sig,
            libc::SIGTERM | libc::SIGINT | libc::SIGHUP | libc::SIGUSR1
        ) {
            // SAFETY: as above.
            unsafe { libc::kill(-pg, libc::SIGCONT) };
        }
    }
}

/// Why the rank program could not be started.
#[derive(Debug, thiserror::Error)]
pub enum ShimError {
    /// The launcher's rank variables are unusable.
    #[error("rank environment: {0}")]
    RankEnv(#[from] RankEnvError),
    /// The node's visible-device list, from which this rank takes its device, is malformed.
    #[error("device binding: {0}")]
    Devices(#[from] kiln_topology::VisibleDevicesError),
    /// No command given.
    #[error("no command given after `--`")]
    NoCommand,
    /// The program could not be started.
    #[error("{program}: {source}")]
    Exec {
        /// The program.
        program: String,
        /// The cause.
        source: std::io::Error,
    },
}

impl ShimError {
    /// Exit code as a shell would give: 127 not found, 126 not executable, 2 otherwise.
    pub fn exit_code(&self) -> i32 {
        match self {
            ShimError::Exec { source, .. } if source.kind() == std::io::ErrorKind::NotFound => 127,
            ShimError::Exec { .. } => 126,
            _ => 2,
        }
    }
}

/// How the rank's program ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RankExit {
    /// It exited with this code.
    Code(i32),
    /// It was killed by this signal.
    Signal(i32),
}

/// Runs `command` as this rank (see the module docs) and returns how it ended; the caller
/// exits with [`RankExit::Code`] or dies of [`RankExit::Signal`] (see [`exit_like`]).
///
/// With `heartbeat_timeout`, the program gets a heartbeat pipe (see [`kiln_run::Heartbeat`]);
/// once it beat, a silence that long SIGKILLs it (a stopped or wedged rank) after recording
/// `lost-<rank>`, so the job ends at once and kiln names the rank and host.
pub fn run_as_rank(
    command: &[String],
    heartbeat_timeout: Option<Duration>,
) -> Result<RankExit, ShimError> {
    let env = RankEnv::from_process_env()?;
    let Some((program, args)) = command.split_first() else {
        return Err(ShimError::NoCommand);
    };
    let reports = RankReports::take(env.rank);
    // Orphans of the program (daemons that left its group) are re-parented to the shim.
    crate::groups::become_subreaper();
    if let Some(dir) = &reports.shared {
        crate::mpi_shm::record_job(dir, env.rank);
    }
    let mut cmd = rank_command(program, args, &env)?;
    reports.hand_to(&mut cmd);
    let beat_pipe = heartbeat_timeout.and_then(|_| crate::heartbeat::pipe().ok());
    if let Some((_, write)) = &beat_pipe {
        crate::heartbeat::hand_to_child(&mut cmd, write);
    }
    let spawned = cmd.spawn();
    let listener = beat_pipe.map(|(read, _write)| crate::heartbeat::Listener::start(read));
    let mut child = match spawned {
        Ok(c) => c,
        Err(source) => {
            let program = program.clone();
            let e = ShimError::Exec { program, source };
            reports.record(RankExit::Code(e.exit_code()));
            reports.leave();
            return Err(e);
        }
    };
    let pgid = child.id() as i32;
    CHILD_GROUP.store(pgid, Ordering::SeqCst);
    install_forwarding();
    let sampling = Arc::new(AtomicBool::new(true));
    {
        let (dir, rank, on) = (reports.dir(), env.rank, Arc::clone(&sampling));
        let beats = listener.zip(heartbeat_timeout);
        std::thread::spawn(move || watch_rank(dir.as_deref(), rank, pgid, beats, &on));
    }
    let exit = wait_exit(&mut child);
    sampling.store(false, Ordering::SeqCst);
    let recorded = reports.record(exit);
    end_leftovers(Pid::from_raw(pgid));
    // A rank killed before MPI_Finalize leaves its Open MPI segment in /dev/shm (4 MiB).
    crate::mpi_shm::remove_own_segment(env.local_rank);
    // The node agent's shim stays until the node's other ranks are done and reported.
    reports.leave();
    Ok(exit_to_launcher(exit, recorded))
}

/// Where this rank reports: under the `tcp` control plane its node's directory (its seat,
/// which the node agent forwards), else the run's progress directory (`shared`, where the
/// node records go either way).
struct RankReports {
    rank: usize,
    shared: Option<PathBuf>,
    seat: Option<crate::plane::node::Seat>,
}

impl RankReports {
    fn take(rank: usize) -> Self {
        RankReports {
            rank,
            shared: kiln_run::progress_dir(),
            seat: take_seat(),
        }
    }

    /// The directory of the rank's records and its program's beacons.
    fn dir(&self) -> Option<PathBuf> {
        match &self.seat {
            Some(s) => Some(s.dir().to_path_buf()),
            None => self.shared.clone(),
        }
    }

    /// The program's progress directory (its node's) and node-records directory (the run's).
    fn hand_to(&self, cmd: &mut Command) {
        if let (Some(s), Some(shared)) = (&self.seat, &self.shared) {
            cmd.env(PROGRESS_DIR_ENV, s.dir());
            cmd.env(kiln_run::node_state::NODE_STATE_DIR_ENV, shared);
        }
    }

    /// Records how the program ended (`exit-<rank>`); whether it could.
    fn record(&self, exit: RankExit) -> bool {
        let Some(dir) = self.dir() else {
            return false;
        };
        let (code, signal) = match exit {
            RankExit::Code(c) => (Some(c), None),
            RankExit::Signal(s) => (None, Some(s)),
        };
        match write_exit_record(&dir, self.rank, code, signal, unix_time()) {
            Ok(()) => true,
            Err(e) => {
                eprintln!("kiln launch --as-rank: {e}");
                false
            }
        }
    }

    fn leave(self) {
        if let Some(s) = self.seat {
            s.leave();
        }
    }
}

/// This rank's seat on its node under the `tcp` control plane (see [`crate::plane::node`]);
/// `None` under the `files` plane, or when the node directory cannot be made (said on stderr:
/// the rank then reports nowhere, and the launch's watchdogs see a silent rank).
fn take_seat() -> Option<crate::plane::node::Seat> {
    let cfg = crate::plane::agent_config_from_env(kiln_run::this_attempt())?;
    let dir = cfg.dir.clone();
    match crate::plane::node::Seat::take(cfg) {
        Ok(s) => Some(s),
        Err(e) => {
            eprintln!(
                "kiln launch --as-rank: the node's control-plane directory {}: {e}",
                dir.display()
            );
            None
        }
    }
}

/// The program as this rank: its rank variables, its own process group, its local rank's
/// accelerator, and (on Linux) killed when the shim dies.
fn rank_command(program: &str, args: &[String], env: &RankEnv) -> Result<Command, ShimError> {
    let mut cmd = Command::new(program);
    cmd.args(args).envs(env.to_vars()).process_group(0);
    // Each local rank its own GPU, from the accelerators `kiln launch` detected.
    let vars = |k: &str| std::env::var(k).ok();
    if let Some((var, device)) = kiln_topology::rank_device(&vars, env.local_rank)? {
        cmd.env(var, device);
    }
    // Ranks sharing one GPU as NCCL hosts of their own, when asked (tests, benchmarks).
    cmd.envs(kiln_topology::ranks_as_nccl_hosts(&vars, env.rank));
    #[cfg(target_os = "linux")]
    // SAFETY: prctl is async-signal-safe and touches no memory of the parent.
    unsafe {
        cmd.pre_exec(|| {
            libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL, 0, 0, 0);
            Ok(())
        });
    }
    Ok(cmd)
}

/// Waits for the program to end (through interruptions by forwarded signals).
fn wait_exit(child: &mut std::process::Child) -> RankExit {
    let status = loop {
        match child.wait() {
            Ok(s) => break s,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(_) => break std::process::ExitStatus::from_raw(1 << 8),
        }
    };
    match (status.code(), status.signal()) {
        (Some(c), _) => RankExit::Code(c),
        (None, Some(s)) => RankExit::Signal(s),
        (None, None) => RankExit::Code(1),
    }
}

/// Set once kiln's stop request reached this rank (see [`kiln_run::write_stop_request`]).
static STOP_FORWARDED: AtomicBool = AtomicBool::new(false);

/// What the shim tells the launcher. After kiln's stop request, a rank that recorded how it
/// ended exits 0 to the launcher: mpirun aborts the whole job on the first non-zero exit, which
/// would kill the ranks still writing their part of the checkpoint. kiln reads the true exit
/// (75: preempted) from the record.
fn exit_to_launcher(exit: RankExit, recorded: bool) -> RankExit {
    if recorded && STOP_FORWARDED.load(Ordering::SeqCst) {
        RankExit::Code(0)
    } else {
        exit
    }
}

/// How often a rank's process state and CPU time are written for the supervisor.
const LIVENESS_EVERY: Duration = Duration::from_millis(500);

/// How often the shim looks for kiln's stop request and at its rank's heartbeat (one small
/// file read: every 25 ms costs nothing next to a step, and a stop or a silence found 75 ms
/// sooner is 75 ms less of every fault).
const STOP_POLL: Duration = Duration::from_millis(25);

/// While `on` holds: forwards kiln's stop request to the program's group (once) and writes
/// `live-<rank>` every [`LIVENESS_EVERY`].
/// With `beats`, SIGKILLs the program once its heartbeat stayed silent for the bound.
fn watch_rank(
    dir: Option<&std::path::Path>,
    rank: usize,
    pgid: i32,
    beats: Option<(crate::heartbeat::Listener, Duration)>,
    on: &AtomicBool,
) {
    let mut last_live: Option<Instant> = None;
    let mut forwarded = None;
    while on.load(Ordering::SeqCst) {
        if let Some((listener, bound)) = &beats
            && give_up_on_silence(dir, rank, pgid, listener, *bound)
        {
            return;
        }
        let Some(dir) = dir else {
            std::thread::sleep(STOP_POLL);
            continue;
        };
        forward_stop_request(dir, pgid, &mut forwarded);
        if last_live.is_none_or(|t| t.elapsed() >= LIVENESS_EVERY) {
            last_live = Some(Instant::now());
            if let Some((state, cpu)) = crate::groups::group_liveness(pgid) {
                let _ = kiln_run::write_liveness(dir, rank, state, cpu, unix_time());
            }
        }
        std::thread::sleep(STOP_POLL);
    }
}

/// Records and kills a rank whose heartbeat has been silent for `bound`; returns whether it
/// did.
fn give_up_on_silence(
    dir: Option<&std::path::Path>,
    rank: usize,
    pgid: i32,
    listener: &crate::heartbeat::Listener,
    bound: Duration,
) -> bool {
    let Some(silent) = listener.silent_for(Instant::now()).filter(|s| *s >= bound) else {
        return false;
    };
    if let Some(dir) = dir
        && let Err(e) = kiln_run::write_lost_record(dir, rank, silent.as_secs_f64(), unix_time())
    {
        eprintln!("kiln launch --as-rank: {e}");
    }
    eprintln!(
        "kiln launch --as-rank: rank {rank} on {} sent no heartbeat for {:.2} s; killing it",
        kiln_run::this_host(),
        silent.as_secs_f64()
    );
    let _ = killpg(Pid::from_raw(pgid), Signal::SIGKILL);
    true
}

/// Signals the program's group once kiln asked the ranks to stop, and again for each newer
/// request (kiln's escalation to SIGKILL), continuing it so that it can act on the signal.
fn forward_stop_request(
    dir: &std::path::Path,
    pgid: i32,
    forwarded: &mut Option<kiln_run::StopRecord>,
) {
    let Some(req) = kiln_run::read_stop_request(dir) else {
        return;
    };
    if !req.addressed_to(kiln_run::this_attempt()) || forwarded.as_ref() == Some(&req) {
        return;
    }
    *forwarded = Some(req.clone());
    STOP_FORWARDED.store(true, Ordering::SeqCst);
    let sig = Signal::try_from(req.signal).unwrap_or(Signal::SIGTERM);
    let _ = killpg(Pid::from_raw(pgid), sig);
    let _ = killpg(Pid::from_raw(pgid), Signal::SIGCONT);
}

fn install_forwarding() {
    let action = SigAction::new(
        SigHandler::Handler(forward),
        SaFlags::SA_RESTART,
        SigSet::empty(),
    );
    for sig in FORWARDED {
        // SAFETY: the handler only reads an atomic and calls kill(2), both async-signal-safe.
        let _ = unsafe { sigaction(sig, &action) };
    }
}

/// SIGTERM the program's group and every adopted orphan, wait up to [`LEFTOVER_GRACE`],
/// then SIGKILL what is left.
fn end_leftovers(group: Pid) {
    let groups = [group];
    let adopted = crate::groups::adopted_children;
    if !crate::groups::any_alive(&groups) && adopted().is_empty() {
        return;
    }
    crate::groups::kill_groups(&groups, Signal::SIGTERM);
    for pid in adopted() {
        let _ = nix::sys::signal::kill(Pid::from_raw(pid), Signal::SIGTERM);
    }
    let until = Instant::now() + LEFTOVER_GRACE;
    while (crate::groups::any_alive(&groups) || !adopted().is_empty()) && Instant::now() < until {
        crate::groups::reap_any_adopted_zombies();
        std::thread::sleep(Duration::from_millis(10));
    }
    let _ = killpg(group, Signal::SIGKILL);
    crate::groups::reap_adopted();
}

/// Ends this process the way the program ended: the same exit code, or the same signal
/// (so the launcher sees a rank killed by SIGKILL as killed, not as exit 137).
pub fn exit_like(exit: RankExit) -> ! {
    match exit {
        RankExit::Code(c) => std::process::exit(c),
        RankExit::Signal(s) => {
            if let Ok(sig) = Signal::try_from(s) {
                // SAFETY: restoring the default action of a signal has no preconditions.
                let _ = unsafe { nix::sys::signal::signal(sig, SigHandler::SigDfl) };
                let _ = nix::sys::signal::raise(sig);
            }
            std::process::exit(128 + s)
        }
    }
}

/// A TCP port free on this machine right now, for MASTER_PORT (the OS picks it).
pub fn free_port() -> Option<u16> {
    std::net::TcpListener::bind(("0.0.0.0", 0))
        .ok()?
        .local_addr()
        .ok()
        .map(|a| a.port())
}

/// Whether kiln runs as root (OpenMPI then needs explicit consent).
pub fn running_as_root() -> bool {
    // SAFETY: geteuid has no preconditions and cannot fail.
    unsafe { libc::geteuid() == 0 }
}

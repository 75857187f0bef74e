//! Liveness apart from progress: a rank's heartbeat thread writes one byte every
//! [`HEARTBEAT_EVERY`] into a pipe its node's launcher (`kiln launch`, or the `--as-rank`
//! shim under mpirun/srun/mpiexec) handed it as `$KILN_HEARTBEAT_FD`. A rank in a long step
//! still beats; a stopped (SIGSTOP) or vanished rank does not, and the launcher ends the
//! attempt within its heartbeat timeout, naming the rank and host.
//!
//! A launcher that stopped hearing a rank records it in `$KILN_PROGRESS_DIR/lost-<R>`
//! (`<silent_s> <unix_time> <host>`), so the supervisor names the rank, its host and the
//! detection time even when another process made the decision.

use crate::beacon::{BeaconError, RankFiles, this_host};
use crate::layout;
use std::os::fd::RawFd;
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

/// Environment variable naming the inherited file descriptor (a pipe's write end) a rank
/// beats into.
pub const HEARTBEAT_FD_ENV: &str = "KILN_HEARTBEAT_FD";

/// How often a rank beats.
pub const HEARTBEAT_EVERY: Duration = Duration::from_millis(100);

/// A running heartbeat thread; it stops when this is dropped. Inert when the process was not
/// started by a launcher that listens (no or an unusable `$KILN_HEARTBEAT_FD`).
#[derive(Debug)]
pub struct Heartbeat {
    on: Arc<AtomicBool>,
}

impl Heartbeat {
    /// Starts beating into `$KILN_HEARTBEAT_FD`, if the launcher gave one.
    pub fn start() -> Heartbeat {
        let on = Arc::new(AtomicBool::new(false));
        let Some(fd) = inherited_fd() else {
            return Heartbeat { on };
        };
        on.store(true, Ordering::SeqCst);
        let running = Arc::clone(&on);
        let spawned = std::thread::Builder::new()
            .name("kiln-heartbeat".into())
            .spawn(move || beat(fd, &running));
        if spawned.is_err() {
            on.store(false, Ordering::SeqCst);
        }
        Heartbeat { on }
    }

    /// Whether a launcher listens to this heartbeat.
    pub fn active(&self) -> bool {
        self.on.load(Ordering::SeqCst)
    }
}

impl Drop for Heartbeat {
    fn drop(&mut self) {
        self.on.store(false, Ordering::SeqCst);
    }
}

/// The inherited pipe: a valid descriptor of a FIFO, made non-blocking (a full pipe must not
/// block the thread) and close-on-exec (the rank's own children must not hold it).
fn inherited_fd() -> Option<RawFd> {
    let fd: RawFd = std::env::var(HEARTBEAT_FD_ENV).ok()?.trim().parse().ok()?;
    if fd < 3 {
        return None;
    }
    // SAFETY: fstat/fcntl on an integer descriptor touch only the stat buffer we own.
    unsafe {
        let mut st: libc::stat = std::mem::zeroed();
        if libc::fstat(fd, &mut st) != 0 || st.st_mode & libc::S_IFMT != libc::S_IFIFO {
            return None;
        }
        let fl = libc::fcntl(fd, libc::F_GETFL);
        libc::fcntl(fd, libc::F_SETFL, fl | libc::O_NONBLOCK);
        libc::fcntl(fd, libc::F_SETFD, libc::FD_CLOEXEC);
    }
    Some(fd)
}

fn beat(fd: RawFd, on: &AtomicBool) {
    while on.load(Ordering::SeqCst) {
        // SAFETY: writes one byte from a local buffer to a descriptor this thread owns.
        let n = unsafe { libc::write(fd, b".".as_ptr().cast(), 1) };
        let err = std::io::Error::last_os_error().raw_os_error();
        if n < 0 && !matches!(err, Some(libc::EAGAIN) | Some(libc::EINTR)) {
            break; // the launcher is gone
        }
        std::thread::sleep(HEARTBEAT_EVERY);
    }
}

/// A rank whose heartbeat stopped, as its launcher recorded it.
#[derive(Debug, Clone, PartialEq)]
pub struct LostRecord {
    /// The rank (from the file name).
    pub rank: usize,
    /// Seconds since its last beat when the launcher gave up on it (the detection time).
    pub silent_s: f64,
    /// When the launcher gave up, Unix seconds.
    pub time: f64,
    /// The host the rank ran on.
    pub host: String,
    /// The attempt token of its writer ([`crate::ATTEMPT_ENV`]), if it had one.
    pub attempt: Option<String>,
}

/// Atomically writes `dir/lost-<rank>`: `<silent_s> <time> <host> [<attempt>]` (host:
/// [`crate::this_host`]).
pub fn write_lost_record(
    dir: &Path,
    rank: usize,
    silent_s: f64,
    time: f64,
) -> Result<(), BeaconError> {
    let name = layout::lost_record(rank);
    let path = dir.join(&name);
    let io = |source| BeaconError::Io {
        path: path.clone(),
        source,
    };
    let line = format!(
        "{silent_s:.3} {time:.3} {}{}\n",
        this_host(),
        crate::beacon::attempt_field()
    );
    crate::files::write_atomic(&path, line.as_bytes(), crate::files::Atomic::RECORD).map_err(io)
}

/// Reads every `lost-<R>` record in `dir`, sorted by rank; unparsable files are ignored.
pub fn read_lost_records(dir: &(impl RankFiles + ?Sized)) -> Vec<LostRecord> {
    let mut v: Vec<LostRecord> = (dir.rank_files(layout::LOST_PREFIX))
        .into_iter()
        .filter_map(|(rank, text)| {
            let mut it = text.split_whitespace();
            Some(LostRecord {
                rank,
                silent_s: it.next()?.parse().ok()?,
                time: it.next()?.parse().ok()?,
                host: it.next()?.to_string(),
                attempt: it.next().map(str::to_string),
            })
        })
        .collect();
    v.sort_by_key(|r| r.rank);
    v
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lost_records_round_trip() {
        let dir = tempfile::tempdir().unwrap();
        write_lost_record(dir.path(), 1, 1.05, 10.0).unwrap();
        std::fs::write(dir.path().join("lost-3"), "x").unwrap();
        let r = read_lost_records(dir.path());
        assert_eq!(r.len(), 1);
        assert_eq!((r[0].rank, r[0].silent_s, r[0].time), (1, 1.05, 10.0));
        assert_eq!(r[0].host, crate::this_host());
        crate::clear_rank_files(dir.path());
        assert!(read_lost_records(dir.path()).is_empty());
    }

    #[test]
    fn without_a_launcher_the_heartbeat_is_inert() {
        // SAFETY: tests of this module do not read the variable concurrently.
        unsafe { std::env::remove_var(HEARTBEAT_FD_ENV) };
        assert!(!Heartbeat::start().active());
    }
}

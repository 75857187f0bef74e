//! The launcher's side of rank heartbeats (see [`kiln_run::Heartbeat`]): a pipe per rank whose
//! write end the rank inherits as `$KILN_HEARTBEAT_FD`, and a thread per pipe that notes when
//! the last beat arrived. A rank that never beats (a program that is not kiln's trainer) is
//! never judged by it.

use std::io::Read;
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::process::CommandExt;
use std::process::Command;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// A pipe for one rank: `(read end, write end)`, both close-on-exec in this process.
pub(crate) fn pipe() -> std::io::Result<(OwnedFd, OwnedFd)> {
    nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC).map_err(std::io::Error::from)
}

/// Lets the child of `cmd` inherit `write` (only that child: close-on-exec is cleared after
/// the fork) and tells it where it is.
pub(crate) fn hand_to_child(cmd: &mut Command, write: &OwnedFd) {
    let fd = write.as_raw_fd();
    cmd.env(kiln_run::HEARTBEAT_FD_ENV, fd.to_string());
    // SAFETY: fcntl is async-signal-safe and touches no memory of the parent.
    unsafe {
        cmd.pre_exec(move || {
            libc::fcntl(fd, libc::F_SETFD, 0);
            Ok(())
        });
    }
}

/// When one rank last beat.
#[derive(Debug, Clone)]
pub(crate) struct Listener {
    last: Arc<Mutex<Option<Instant>>>,
}

impl Listener {
    /// Listens on `read` until every writer closed it.
    pub(crate) fn start(read: OwnedFd) -> Listener {
        let last = Arc::new(Mutex::new(None));
        let seen = Arc::clone(&last);
        std::thread::spawn(move || {
            let mut pipe = std::fs::File::from(read);
            let mut buf = [0u8; 64];
            loop {
                match pipe.read(&mut buf) {
                    Ok(0) => break,
                    Ok(_) => {
                        if let Ok(mut l) = seen.lock() {
                            *l = Some(Instant::now());
                        }
                    }
                    Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                    Err(_) => break,
                }
            }
        });
        Listener { last }
    }

    /// How long since the last beat; `None` until the first one.
    pub(crate) fn silent_for(&self, now: Instant) -> Option<Duration> {
        let last = (*self.last.lock().ok()?)?;
        Some(now.saturating_duration_since(last))
    }
}

//! A node's side of the control plane: its progress directory in node-local memory, one per
//! job attempt and node (`/dev/shm/kiln-plane-<16 hex>`), and who on the node is the agent.
//!
//! Every rank shim takes a seat ([`Seat::take`]): it holds a shared lock on the directory's
//! `ranks.lock` for as long as it runs, and tries for `agent.lock`; the one that gets it runs
//! the node's [`Agent`] (a thread). When its own program has ended, the agent's shim waits for
//! the shared locks of the others to go (the kernel drops them when a process dies, however
//! it dies), sends the last records, says goodbye and removes the directory. A directory
//! left by an agent that was killed is removed by the next agent or `--release-node` on the
//! node ([`sweep`]), once no process holds its locks.

use super::agent::{Agent, AgentConfig};
use sha2::{Digest, Sha256};
use std::fs::File;
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::time::Duration;

/// Name prefix of the node-local progress directories.
const PREFIX: &str = "kiln-plane-";
const RANKS_LOCK: &str = "ranks.lock";
const AGENT_LOCK: &str = "agent.lock";

/// A directory whose locks nobody holds is removed by an agent's [`sweep`] only when it is
/// older than this: another job's shim may have just created it.
pub const SWEEP_AFTER: Duration = Duration::from_secs(60);

/// The age [`sweep`] needs at the end of an attempt or a launch, when no shim of the job runs
/// any more (another job's shim may still have just created its directory).
pub const SWEEP_AT_END: Duration = Duration::from_secs(2);

/// Node-local memory: `/dev/shm` where it exists, else the temporary directory.
pub fn base_dir() -> PathBuf {
    let shm = Path::new("/dev/shm");
    if shm.is_dir() {
        shm.to_path_buf()
    } else {
        std::env::temp_dir()
    }
}

/// The node-local progress directory of an attempt on `host` (the host is in the name for the
/// simulation, where many "nodes" share one machine).
pub fn local_dir(base: &Path, secret: &str, attempt: Option<&str>, host: &str) -> PathBuf {
    let mut h = Sha256::new();
    for part in [secret, attempt.unwrap_or("-"), host] {
        h.update(part.as_bytes());
        h.update(b"\n");
    }
    base.join(format!("{PREFIX}{}", &hex::encode(h.finalize())[..16]))
}

/// A rank shim's place on its node (see the module docs).
pub struct Seat {
    dir: PathBuf,
    ranks_lock: Option<File>,
    agent: Option<(File, Agent)>,
}

impl Seat {
    /// Takes a seat in `cfg.dir` (created if needed), starting the node's agent if no other
    /// shim of the node runs it.
    pub fn take(cfg: AgentConfig) -> std::io::Result<Seat> {
        create_private_dir(&cfg.dir)?;
        let ranks_lock = open_lock(&cfg.dir.join(RANKS_LOCK))?;
        lock(&ranks_lock, libc::LOCK_SH)?;
        let agent_lock = open_lock(&cfg.dir.join(AGENT_LOCK))?;
        let agent = match try_lock(&agent_lock, libc::LOCK_EX)? {
            true => {
                if let Some(base) = cfg.dir.parent() {
                    sweep(base, SWEEP_AFTER);
                }
                Some((agent_lock, Agent::spawn(cfg.clone())?))
            }
            false => None,
        };
        Ok(Seat {
            dir: cfg.dir,
            ranks_lock: Some(ranks_lock),
            agent,
        })
    }

    /// The node-local progress directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Whether this shim's agent lost the supervisor (the launch is gone).
    pub fn supervisor_gone(&self) -> bool {
        self.agent.as_ref().is_some_and(|(_, a)| a.gone())
    }

    /// Leaves the seat. The agent's shim first waits for the node's other shims to leave (or
    /// the supervisor to go), then sends the last records and removes the directory.
    pub fn leave(mut self) {
        drop(self.ranks_lock.take());
        let Some((agent_lock, agent)) = self.agent.take() else {
            return;
        };
        if let Ok(ranks) = open_lock(&self.dir.join(RANKS_LOCK)) {
            while !agent.gone() && !try_lock(&ranks, libc::LOCK_EX).unwrap_or(true) {
                std::thread::sleep(Duration::from_millis(20));
            }
        }
        agent.finish();
        let _ = std::fs::remove_dir_all(&self.dir);
        drop(agent_lock);
    }
}

/// Removes the node-local progress directories under `base` that no process uses any more
/// (both locks free; an agent killed with its shim leaves its directory) and that are older
/// than `older_than`; returns them.
pub fn sweep(base: &Path, older_than: Duration) -> Vec<PathBuf> {
    let Ok(entries) = std::fs::read_dir(base) else {
        return Vec::new();
    };
    let mut removed = Vec::new();
    for e in entries.filter_map(Result::ok) {
        let name = e.file_name();
        if !name.to_string_lossy().starts_with(PREFIX) {
            continue;
        }
        let dir = e.path();
        let old = std::fs::symlink_metadata(&dir)
            .ok()
            .filter(|m| m.is_dir())
            .and_then(|m| m.modified().ok())
            .and_then(|t| t.elapsed().ok())
            .is_some_and(|age| age >= older_than);
        if old && unused(&dir) && std::fs::remove_dir_all(&dir).is_ok() {
            removed.push(dir);
        }
    }
    removed
}

/// Removes the node directories of `attempt` on this machine for `hosts` that no process
/// uses (an agent killed with its rank leaves its directory).
pub fn remove_unused<'h>(secret: &str, attempt: &str, hosts: impl IntoIterator<Item = &'h str>) {
    let base = base_dir();
    for host in hosts {
        let dir = local_dir(&base, secret, Some(attempt), host);
        if dir.exists() && unused(&dir) {
            let _ = std::fs::remove_dir_all(&dir);
        }
    }
}

/// Whether no process holds either lock of `dir` (a missing lock file counts as free).
fn unused(dir: &Path) -> bool {
    [RANKS_LOCK, AGENT_LOCK].iter().all(|l| {
        match std::fs::OpenOptions::new().read(true).open(dir.join(l)) {
            Ok(f) => try_lock(&f, libc::LOCK_EX).unwrap_or(false),
            Err(e) => e.kind() == std::io::ErrorKind::NotFound,
        }
    })
}

fn create_private_dir(dir: &Path) -> std::io::Result<()> {
    use std::os::unix::fs::{DirBuilderExt, MetadataExt};
    match std::fs::DirBuilder::new().mode(0o700).create(dir) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {
            let m = std::fs::symlink_metadata(dir)?;
            // SAFETY: geteuid has no preconditions and cannot fail.
            let me = unsafe { libc::geteuid() };
            if m.is_dir() && m.uid() == me {
                Ok(())
            } else {
                Err(std::io::Error::other(format!(
                    "{} exists and is not this user's directory",
                    dir.display()
                )))
            }
        }
        Err(e) => Err(e),
    }
}

fn open_lock(path: &Path) -> std::io::Result<File> {
    std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(path)
}

/// `flock(2)`, blocking.
fn lock(f: &File, how: libc::c_int) -> std::io::Result<()> {
    loop {
        // SAFETY: flock on a descriptor this process owns.
        if unsafe { libc::flock(f.as_raw_fd(), how) } == 0 {
            return Ok(());
        }
        let e = std::io::Error::last_os_error();
        if e.kind() != std::io::ErrorKind::Interrupted {
            return Err(e);
        }
    }
}

/// `flock(2)` without waiting: whether it was taken.
fn try_lock(f: &File, how: libc::c_int) -> std::io::Result<bool> {
    // SAFETY: flock on a descriptor this process owns.
    if unsafe { libc::flock(f.as_raw_fd(), how | libc::LOCK_NB) } == 0 {
        return Ok(true);
    }
    let e = std::io::Error::last_os_error();
    match e.raw_os_error() {
        Some(libc::EWOULDBLOCK) | Some(libc::EINTR) => Ok(false),
        _ => Err(e),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_directory_names_the_attempt_and_host_not_the_secret() {
        let base = Path::new("/b");
        let a = local_dir(base, "s", Some("a1"), "n1");
        assert_ne!(a, local_dir(base, "s", Some("a2"), "n1"));
        assert_ne!(a, local_dir(base, "s", Some("a1"), "n2"));
        assert_eq!(a, local_dir(base, "s", Some("a1"), "n1"));
    }

    #[test]
    fn sweep_removes_only_old_directories_nobody_holds() {
        let base = tempfile::tempdir().unwrap();
        let held = base.path().join(format!("{PREFIX}held"));
        let free = base.path().join(format!("{PREFIX}free"));
        let young = base.path().join(format!("{PREFIX}young"));
        let other = base.path().join("kiln-0123456789abcdef");
        for d in [&held, &free, &young, &other] {
            std::fs::create_dir(d).unwrap();
        }
        let lock_file = open_lock(&held.join(RANKS_LOCK)).unwrap();
        lock(&lock_file, libc::LOCK_SH).unwrap();
        let old = std::time::SystemTime::now() - Duration::from_secs(120);
        for d in [&held, &free, &other] {
            File::open(d).unwrap().set_modified(old).unwrap();
        }
        assert_eq!(sweep(base.path(), SWEEP_AFTER), vec![free.clone()]);
        assert!(held.exists() && young.exists() && other.exists() && !free.exists());
    }
}

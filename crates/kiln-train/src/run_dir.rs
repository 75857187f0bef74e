//! The run directory as the trainer writes it: one writer at a time (an exclusive `flock` on
//! `train.lock`, held for the whole run), and no write that follows a link someone planted:
//! whole files are written to a temporary name and renamed over the target (which replaces a
//! symlink instead of writing through it); append-only logs are opened with `O_NOFOLLOW` and
//! a torn last line is cut off (see [`kiln_run::jsonl`]).
//!
//! The lock is advisory and needs a file system with working `flock` (local disks, Lustre
//! mounted with `flock`, NFSv4; not Lustre's `localflock` across nodes).

use kiln_run::layout;
use nix::fcntl::{Flock, FlockArg};
use std::fs::File;
use std::io::{Read, Seek, Write};
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};

/// Errors of the run directory.
#[derive(Debug, thiserror::Error)]
pub enum RunDirError {
    /// Another process holds the lock.
    #[error(
        "run directory {path} is in use by another trainer ({holder}, for over {} s); wait for it to finish, stop it, or use another --run-dir",
        waited.as_secs_f64()
    )]
    Locked {
        /// The run directory.
        path: PathBuf,
        /// `pid <P> on <host>` as the holder wrote it.
        holder: String,
        /// How long this process waited for it to let go.
        waited: std::time::Duration,
    },
    /// Filesystem error on a file of the run directory.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The cause.
        source: std::io::Error,
    },
}

fn io(path: &Path) -> impl FnOnce(std::io::Error) -> RunDirError + '_ {
    move |source| RunDirError::Io {
        path: path.to_path_buf(),
        source,
    }
}

/// How long a trainer waits for the run directory's lock: a restarted attempt can start
/// while the previous attempt's trainer is still being killed (its launcher ended, its
/// process not yet), and must not take that for another run.
pub const LOCK_WAIT: std::time::Duration = std::time::Duration::from_secs(10);

/// The exclusive lock of `file`, waiting up to `wait` for its holder to let go.
fn lock_within(
    mut file: File,
    wait: std::time::Duration,
) -> Result<Flock<File>, (File, nix::errno::Errno)> {
    let until = std::time::Instant::now() + wait;
    loop {
        match Flock::lock(file, FlockArg::LockExclusiveNonblock) {
            Err((f, nix::errno::Errno::EWOULDBLOCK)) if std::time::Instant::now() < until => {
                file = f;
                std::thread::sleep(std::time::Duration::from_millis(20));
            }
            other => return other,
        }
    }
}

/// A run directory held by this process (the writer rank of a run).
#[derive(Debug)]
pub struct RunDir {
    path: PathBuf,
    _lock: Flock<File>,
}

impl RunDir {
    /// Creates `path` if needed and takes its lock; fails, naming the holder, if another
    /// process still has it after [`LOCK_WAIT`].
    pub fn lock(path: &Path) -> Result<Self, RunDirError> {
        Self::lock_waiting(path, LOCK_WAIT)
    }

    fn lock_waiting(path: &Path, wait: std::time::Duration) -> Result<Self, RunDirError> {
        std::fs::create_dir_all(path).map_err(io(path))?;
        let lock_path = path.join(layout::LOCK);
        let file = std::fs::OpenOptions::new()
            .create(true)
            .read(true)
            .write(true)
            .truncate(false)
            .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
            .open(&lock_path)
            .map_err(io(&lock_path))?;
        let mut lock = match lock_within(file, wait) {
            Ok(lock) => lock,
            Err((mut file, errno)) if errno == nix::errno::Errno::EWOULDBLOCK => {
                let mut holder = String::new();
                let _ = file.read_to_string(&mut holder);
                let holder = holder.trim();
                return Err(RunDirError::Locked {
                    path: path.to_path_buf(),
                    holder: if holder.is_empty() {
                        "holder unknown".into()
                    } else {
                        holder.to_string()
                    },
                    waited: wait,
                });
            }
            Err((_, errno)) => return Err(io(&lock_path)(std::io::Error::from(errno))),
        };
        let me = format!("pid {} on {}\n", std::process::id(), kiln_run::host_name());
        lock.set_len(0)
            .and_then(|()| lock.rewind())
            .and_then(|()| lock.write_all(me.as_bytes()))
            .map_err(io(&lock_path))?;
        Ok(Self {
            path: path.to_path_buf(),
            _lock: lock,
        })
    }

    /// The directory.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Replaces `name` with `bytes` atomically (temporary file, fsync, rename). A symlink at
    /// `name` is replaced, never followed.
    pub fn write_file(&self, name: &str, bytes: &[u8]) -> Result<PathBuf, RunDirError> {
        write_replacing(&self.path, name, bytes)
    }

    /// Opens `name` (a JSON-lines log) for appending; returns the bytes of a torn last line
    /// that were cut off.
    pub fn open_log(&self, name: &str) -> Result<(File, u64), RunDirError> {
        let path = self.path.join(name);
        kiln_run::jsonl::open_append(&path).map_err(io(&path))
    }
}

/// Writes `dir/name` through a temporary file and a rename.
pub fn write_replacing(dir: &Path, name: &str, bytes: &[u8]) -> Result<PathBuf, RunDirError> {
    let target = dir.join(name);
    kiln_run::files::write_atomic(&target, bytes, kiln_run::files::Atomic::DURABLE)
        .map_err(io(&target))?;
    Ok(target)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn second_lock_names_the_holder_and_release_lets_the_next_in() {
        let dir = tempfile::tempdir().unwrap();
        let short = std::time::Duration::from_millis(100);
        let first = RunDir::lock(dir.path()).unwrap();
        let err = RunDir::lock_waiting(dir.path(), short)
            .unwrap_err()
            .to_string();
        assert!(
            err.contains(&format!("pid {}", std::process::id())),
            "{err}"
        );
        drop(first);
        let second = RunDir::lock(dir.path()).unwrap();
        // A holder that lets go while the next waits (the trainer of an attempt being
        // killed) hands the lock over.
        let t0 = std::time::Instant::now();
        let release = std::thread::spawn(move || {
            std::thread::sleep(std::time::Duration::from_millis(300));
            drop(second);
        });
        RunDir::lock(dir.path()).unwrap();
        assert!(t0.elapsed() >= std::time::Duration::from_millis(300));
        release.join().unwrap();
    }

    #[test]
    fn writes_replace_symlinks_instead_of_following_them() {
        let dir = tempfile::tempdir().unwrap();
        let victim = dir.path().join("victim");
        std::fs::write(&victim, "precious").unwrap();
        let run = RunDir::lock(&dir.path().join("run")).unwrap();
        std::os::unix::fs::symlink(&victim, run.path().join("config.toml")).unwrap();
        run.write_file("config.toml", b"x = 1\n").unwrap();
        assert_eq!(std::fs::read_to_string(&victim).unwrap(), "precious");
        assert_eq!(
            std::fs::read_to_string(run.path().join("config.toml")).unwrap(),
            "x = 1\n"
        );
    }
}

//! Running a detection tool (`nvidia-smi -L`) with a deadline, and PATH look-ups.

use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// How long a GPU tool may take: a wedged driver can make `nvidia-smi` hang for minutes,
/// and detection must not hang a launch.
const PROBE_TIMEOUT: Duration = Duration::from_secs(5);

/// How long a scheduler query may take: `sinfo` and `scontrol` wait on slurmctld, which is
/// slowest exactly when nodes fail (it is killing steps and updating node states), and each
/// RPC of theirs waits up to Slurm's `MessageTimeout` (10 s by default). A query that gave up
/// after 5 s there lost the one piece of evidence that tells a node failure from a crash.
pub const SCHEDULER_TIMEOUT: Duration = Duration::from_secs(30);

/// Runs `program args`; its stdout if it exits 0 within 5 s, else `None` (absent, failed or
/// hung; a hung tool is killed).
pub fn probe_tool(program: &str, args: &[&str]) -> Option<String> {
    probe_tool_within(program, args, PROBE_TIMEOUT)
}

/// [`probe_tool`] with its own deadline.
pub fn probe_tool_within(program: &str, args: &[&str], timeout: Duration) -> Option<String> {
    find_in_path(program)?;
    let mut child = Command::new(program)
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .ok()?;
    let mut stdout = child.stdout.take()?;
    let reader = std::thread::spawn(move || {
        let mut out = Vec::new();
        let _ = stdout.read_to_end(&mut out);
        out
    });
    let until = Instant::now() + timeout;
    let status = loop {
        match child.try_wait() {
            Ok(Some(s)) => break Some(s),
            Ok(None) if Instant::now() < until => std::thread::sleep(Duration::from_millis(10)),
            _ => {
                let _ = child.kill();
                let _ = child.wait();
                break None;
            }
        }
    };
    let out = reader.join().ok()?;
    status
        .filter(|s| s.success())
        .map(|_| String::from_utf8_lossy(&out).into_owned())
}

/// What a program name resolves to, as a shell would find it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Lookup {
    /// An executable file.
    Found(PathBuf),
    /// A file or directory exists but cannot be executed (shells exit 126 for it).
    NotExecutable(PathBuf),
    /// Nothing by that name (shells exit 127).
    NotFound,
}

/// Resolves `program` as a shell does: itself if it contains a `/`, else the first
/// executable match in `PATH`; a non-executable match is reported when nothing executable
/// is found.
pub fn lookup_program(program: &str) -> Lookup {
    use std::os::unix::fs::PermissionsExt;
    let state = |p: &Path| match p.metadata() {
        Ok(m) if m.is_file() && m.permissions().mode() & 0o111 != 0 => Some(true),
        Ok(_) => Some(false),
        Err(_) => None,
    };
    if program.is_empty() {
        return Lookup::NotFound;
    }
    if program.contains('/') {
        let p = PathBuf::from(program);
        return match state(&p) {
            Some(true) => Lookup::Found(p),
            Some(false) => Lookup::NotExecutable(p),
            None => Lookup::NotFound,
        };
    }
    let Some(path) = std::env::var_os("PATH") else {
        return Lookup::NotFound;
    };
    let mut not_executable = None;
    for dir in std::env::split_paths(&path) {
        let p = dir.join(program);
        match state(&p) {
            Some(true) => return Lookup::Found(p),
            Some(false) if not_executable.is_none() && p.is_file() => not_executable = Some(p),
            _ => {}
        }
    }
    not_executable.map_or(Lookup::NotFound, Lookup::NotExecutable)
}

/// Where `program` would be executed from: itself if it contains a `/`, else the first
/// executable match in `PATH`.
pub fn find_in_path(program: &str) -> Option<PathBuf> {
    match lookup_program(program) {
        Lookup::Found(p) => Some(p),
        _ => None,
    }
}

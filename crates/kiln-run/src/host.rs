//! What this machine can give a process: memory that is free to use, and CPU cores. The
//! trainer and the data layer check their estimates against these before allocating, so a
//! size that cannot fit is refused with a message instead of an abort deep in an allocator.
//!
//! Memory available is the smallest of:
//! - `MemAvailable` in `/proc/meminfo` (what the kernel says can be allocated without
//!   swapping);
//! - the room left under every cgroup memory limit on this process's path to the root
//!   (v2 `memory.max - memory.current`, v1 `memory.limit_in_bytes - memory.usage_in_bytes`),
//!   as batch schedulers and containers enforce them;
//! - `$KILN_MEMORY_LIMIT` (bytes, or with a K/M/G/T suffix), for an operator who shares a
//!   node (several ranks per node each get their own share) or wants a stricter budget.
//!
//! Reading these files is a few lines of parsing; the crates that do it (sysinfo, procfs)
//! pull in far more than that.

use std::path::{Path, PathBuf};

/// Environment variable that caps the memory kiln budgets for.
pub const MEMORY_LIMIT_ENV: &str = "KILN_MEMORY_LIMIT";

/// Environment variable through which `kiln launch` tells each rank the accelerators it
/// detected on the node (`nvidia:4`), so that the rank takes its own one.
pub const ACCELERATORS_ENV: &str = "KILN_ACCELERATORS";

/// Memory this process may still use, and where that number came from.
#[derive(Debug, Clone, PartialEq)]
pub struct MemoryLimit {
    /// Bytes.
    pub bytes: u64,
    /// Where the number comes from, for messages (`MemAvailable in /proc/meminfo`, ...).
    pub source: String,
}

/// Bytes as a short human-readable string (`1.5 GiB`).
pub fn human_bytes(bytes: f64) -> String {
    const UNITS: [&str; 7] = ["B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB"];
    let mut v = bytes;
    let mut u = 0;
    while v >= 1024.0 && u + 1 < UNITS.len() {
        v /= 1024.0;
        u += 1;
    }
    if u == 0 {
        format!("{v:.0} B")
    } else {
        format!("{v:.1} {}", UNITS[u])
    }
}

/// Parses `123`, `512K`, `64M`, `2G`, `1.5T` (powers of 1024) into bytes.
pub fn parse_bytes(text: &str) -> Option<u64> {
    let t = text.trim();
    let (num, mult) = match t.char_indices().last()? {
        (i, c) if c.is_ascii_alphabetic() => {
            let m: u64 = match c.to_ascii_uppercase() {
                'K' => 1 << 10,
                'M' => 1 << 20,
                'G' => 1 << 30,
                'T' => 1 << 40,
                _ => return None,
            };
            (&t[..i], m)
        }
        _ => (t, 1),
    };
    let v: f64 = num.trim().parse().ok()?;
    let bytes = v * mult as f64;
    (v.is_finite() && v >= 0.0 && bytes < u64::MAX as f64).then_some(bytes as u64)
}

/// Memory available to this process now (see the module docs), or `None` if nothing could
/// be read (not Linux): callers then skip their check rather than guess.
pub fn available_memory() -> Option<MemoryLimit> {
    let mut best: Option<MemoryLimit> = None;
    let mut consider = |bytes: u64, source: String| {
        if best.as_ref().is_none_or(|b| bytes < b.bytes) {
            best = Some(MemoryLimit { bytes, source });
        }
    };
    if let Some(kib) = std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|t| meminfo_available_kib(&t))
    {
        consider(
            kib.saturating_mul(1024),
            "MemAvailable in /proc/meminfo".into(),
        );
    }
    if let Ok(cgroups) = std::fs::read_to_string("/proc/self/cgroup") {
        for (dir, v2) in cgroup_dirs(&cgroups, Path::new("/sys/fs/cgroup")) {
            if let Some((room, what)) = cgroup_room(&dir, v2) {
                consider(room, what);
            }
        }
    }
    if let Ok(text) = std::env::var(MEMORY_LIMIT_ENV) {
        match parse_bytes(&text) {
            Some(bytes) => consider(bytes, format!("${MEMORY_LIMIT_ENV}={text}")),
            None => warn_bad_override(&text),
        }
    }
    best
}

/// Whether `path` (or, when it does not exist yet, its nearest existing ancestor) is on a
/// file system kept in memory (tmpfs, ramfs: `/dev/shm`), so that files there use RAM and
/// count against the memory this process may use.
pub fn in_memory_fs(path: &Path) -> bool {
    let Some(existing) = path.ancestors().find(|p| p.exists()) else {
        return false;
    };
    on_memory_fs(existing)
}

#[cfg(target_os = "linux")]
fn on_memory_fs(path: &Path) -> bool {
    use std::os::unix::ffi::OsStrExt;
    let Ok(c) = std::ffi::CString::new(path.as_os_str().as_bytes()) else {
        return false;
    };
    // SAFETY: statfs writes into the zeroed struct we own; `c` is a valid C string.
    unsafe {
        let mut st: libc::statfs = std::mem::zeroed();
        if libc::statfs(c.as_ptr(), &mut st) != 0 {
            return false;
        }
        // TMPFS_MAGIC and RAMFS_MAGIC of statfs(2); f_type's width differs by platform.
        matches!(st.f_type as u64 & 0xffff_ffff, 0x0102_1994 | 0x8584_58f6)
    }
}

#[cfg(not(target_os = "linux"))]
fn on_memory_fs(_path: &Path) -> bool {
    false
}

// kiln-run has no logging dependency; a malformed override is reported once on stderr.
fn warn_bad_override(text: &str) {
    eprintln!(
        "kiln: warning: ignoring ${MEMORY_LIMIT_ENV}={text:?} (expected bytes, or a number with K, M, G or T)"
    );
}

/// `MemAvailable` from the text of `/proc/meminfo`, in KiB.
fn meminfo_available_kib(text: &str) -> Option<u64> {
    let line = text.lines().find(|l| l.starts_with("MemAvailable:"))?;
    line.split_whitespace().nth(1)?.parse().ok()
}

/// The memory cgroup directories of this process and their ancestors, from the text of
/// `/proc/self/cgroup`, under the cgroup mount `root`; `true` marks cgroup v2.
fn cgroup_dirs(proc_cgroup: &str, root: &Path) -> Vec<(PathBuf, bool)> {
    let mut out = Vec::new();
    for line in proc_cgroup.lines() {
        let mut parts = line.splitn(3, ':');
        let (Some(_), Some(controllers), Some(path)) = (parts.next(), parts.next(), parts.next())
        else {
            continue;
        };
        let (base, v2) = if controllers.is_empty() {
            (root.to_path_buf(), true)
        } else if controllers.split(',').any(|c| c == "memory") {
            (root.join("memory"), false)
        } else {
            continue;
        };
        // The process's own cgroup and every ancestor up to the mount's root: a limit set
        // on any of them applies.
        let mut p = Path::new(path.trim_start_matches('/'));
        loop {
            out.push((base.join(p), v2));
            match p.parent() {
                Some(parent) => p = parent,
                None => break,
            }
        }
    }
    out
}

/// Room left under the memory limit of one cgroup directory, if it has a limit.
fn cgroup_room(dir: &Path, v2: bool) -> Option<(u64, String)> {
    let (limit_file, usage_file) = if v2 {
        ("memory.max", "memory.current")
    } else {
        ("memory.limit_in_bytes", "memory.usage_in_bytes")
    };
    let read = |f: &str| -> Option<u64> {
        std::fs::read_to_string(dir.join(f))
            .ok()?
            .trim()
            .parse()
            .ok()
    };
    // v2 says "max" when unlimited (no parse); v1 says a number near i64::MAX.
    let limit = read(limit_file).filter(|&l| l < (1u64 << 60))?;
    let usage = read(usage_file).unwrap_or(0);
    Some((
        limit.saturating_sub(usage),
        format!(
            "cgroup limit {} ({}) minus usage ({})",
            dir.join(limit_file).display(),
            human_bytes(limit as f64),
            human_bytes(usage as f64)
        ),
    ))
}

/// CPU cores this process may run on (`available_parallelism`: the affinity mask and cgroup
/// CPU quota), at least 1.
pub fn cores() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get())
}

/// Worker threads may be at most this many times [`cores`]: more only adds contention, and
/// a count like 100k exhausts the process's limits (thread spawn failure, or memory).
pub const THREADS_PER_CORE: usize = 4;

/// The most worker threads a thread-count setting (`training.threads`, `--threads`,
/// `--workers`) may ask for on this machine.
pub fn max_threads() -> usize {
    THREADS_PER_CORE * cores()
}

/// Checks a thread-count setting named `what`: 0 (the default: one per core) or
/// `1..=max_threads()`; the error says the allowed range.
pub fn check_threads(what: &str, threads: usize) -> Result<(), String> {
    let max = max_threads();
    if threads <= max {
        return Ok(());
    }
    Err(format!(
        "{what} = {threads}: must be 0 (one per core) or at most {max} ({THREADS_PER_CORE} x the {} cores this process may use)",
        cores()
    ))
}

/// Bytes free for an unprivileged user on the file system holding `path` (`statvfs`), if it
/// can be read.
pub fn disk_available(path: &Path) -> Option<u64> {
    use std::os::unix::ffi::OsStrExt;
    let c = std::ffi::CString::new(path.as_os_str().as_bytes()).ok()?;
    let mut st: libc::statvfs = unsafe { std::mem::zeroed() };
    // SAFETY: `c` is a valid NUL-terminated path and `st` a writable statvfs.
    if unsafe { libc::statvfs(c.as_ptr(), &mut st) } != 0 {
        return None;
    }
    Some((st.f_bavail as u64).saturating_mul(st.f_frsize as u64))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn memory_file_systems_are_told_apart_from_disks_and_proc() {
        // A path not created yet is judged by its nearest existing ancestor.
        let shm = Path::new("/dev/shm");
        assert_eq!(
            in_memory_fs(&shm.join("kiln-none/rank-0")),
            in_memory_fs(shm)
        );
        assert!(!in_memory_fs(Path::new("/proc/self")));
    }

    #[test]
    fn parses_meminfo_and_byte_sizes() {
        let t = "MemTotal:       24000000 kB\nMemFree: 1 kB\nMemAvailable:   22746228 kB\n";
        assert_eq!(meminfo_available_kib(t), Some(22_746_228));
        assert_eq!(meminfo_available_kib("MemTotal: 1 kB\n"), None);
        assert_eq!(parse_bytes("123"), Some(123));
        assert_eq!(parse_bytes("2G"), Some(2 << 30));
        assert_eq!(parse_bytes("1.5k"), Some(1536));
        assert_eq!(parse_bytes("-1G"), None);
        assert_eq!(parse_bytes("lots"), None);
        assert_eq!(parse_bytes("nan"), None);
        assert_eq!(human_bytes(1536.0 * 1024.0 * 1024.0), "1.5 GiB");
        assert_eq!(human_bytes(12.0), "12 B");
    }

    #[test]
    fn finds_cgroup_limits_on_the_path_to_the_root() {
        let root = tempfile::tempdir().unwrap();
        // v2: a limit on the parent, none on the leaf.
        let leaf = root.path().join("job/step");
        std::fs::create_dir_all(&leaf).unwrap();
        std::fs::write(leaf.join("memory.max"), "max\n").unwrap();
        std::fs::write(root.path().join("job/memory.max"), "1000\n").unwrap();
        std::fs::write(root.path().join("job/memory.current"), "400\n").unwrap();
        let dirs = cgroup_dirs("0::/job/step\n", root.path());
        assert_eq!(dirs.len(), 3, "{dirs:?}");
        let rooms: Vec<u64> = dirs
            .iter()
            .filter_map(|(d, v2)| cgroup_room(d, *v2).map(|r| r.0))
            .collect();
        assert_eq!(rooms, vec![600]);
        // v1: the memory controller's hierarchy; other controllers are ignored.
        let v1 = cgroup_dirs("4:memory:/a\n3:cpu:/b\n", root.path());
        assert_eq!(
            v1,
            vec![
                (root.path().join("memory/a"), false),
                (root.path().join("memory"), false)
            ]
        );
    }

    #[test]
    fn this_machine_reports_some_memory_disk_and_cores() {
        let m = available_memory().expect("Linux has /proc/meminfo");
        assert!(m.bytes > 0, "{m:?}");
        assert!(cores() >= 1);
        assert!(disk_available(Path::new("/")).is_some());
        assert!(disk_available(Path::new("/no/such/dir")).is_none());
        assert!(check_threads("t", 0).is_ok());
        assert!(check_threads("t", max_threads()).is_ok());
        let e = check_threads("training.threads", 100_000).unwrap_err();
        assert!(e.starts_with("training.threads = 100000: must be 0"), "{e}");
    }
}

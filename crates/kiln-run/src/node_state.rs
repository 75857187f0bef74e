//! What a run's ranks keep on their nodes between attempts (the memory tier's snapshots in
//! `/dev/shm`: RAM), and its release when the job ends there for good.
//!
//! Each rank that keeps such state records it in the progress directory,
//! `$KILN_PROGRESS_DIR/node-<rank>-<host>` ([`write_node_record`]): the host (as the
//! scheduler names it, [`crate::this_host`]) and the directories. The records are not
//! cleared between attempts, so a launch knows every node any of its attempts used. When
//! the launch ends for good, `kiln launch` runs [`release`] on each of those nodes (itself
//! for its own host; through the launcher, once per node, for the others): it removes the
//! directories recorded for that host, and the records with them.
//!
//! Only directories named as the memory tier names them (`kiln-<16 hex digits>`, see
//! [`crate::layout::snapshot_root`]) are removed, never through a symbolic link: a record
//! someone else wrote cannot make kiln delete anything else.
//!
//! The rank shims record the Open MPI job of each attempt the same way
//! (`node-<R>-<host>-mpi-<jobid>`, [`write_mpi_record`]): a rank killed before
//! `MPI_Finalize` leaves its shared-memory segment in `/dev/shm`
//! (`vader_segment.<host>.<uid>.<jobid>.<local rank>`, 4 MiB; `sm_segment.` in Open MPI
//! 5). The launcher removes those of its own host after each attempt ([`release_mpi`]) and
//! every node's at the end ([`release`]); only files of this user named for a recorded job
//! are touched. The same records name the job's Open MPI session directory on the node
//! (`$TMPDIR/ompi.<host>.<uid>/pid.<mpirun's pid>`, 8 MiB of PMIx stores, which `mpirun`
//! removes only when it exits on its own: one that kiln stops with SIGKILL, after a hang or
//! when its ranks ignore SIGTERM, leaves it); it goes the same way, once no process of that
//! pid runs on the node ([`mpi_session_removable`]).

use crate::layout;
use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};

/// Variable naming the directory that holds the node records when it is not
/// `$KILN_PROGRESS_DIR`: under `kiln launch`'s TCP control plane a rank's progress directory
/// is node-local (its node agent reads it), while the records must reach the launch, in the
/// run's own progress directory.
pub const NODE_STATE_DIR_ENV: &str = "KILN_NODE_STATE_DIR";

/// Where this rank records what it keeps on its node: `$KILN_NODE_STATE_DIR`, else
/// `$KILN_PROGRESS_DIR`; `None` outside `kiln launch`.
pub fn records_dir() -> Option<PathBuf> {
    let own = std::env::var_os(NODE_STATE_DIR_ENV).filter(|d| !d.is_empty());
    own.map(PathBuf::from).or_else(crate::progress_dir)
}

/// One rank's record of what it keeps on its node.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct NodeRecord {
    /// The node.
    pub host: String,
    /// The rank that wrote it.
    pub rank: usize,
    /// The directories to remove when the job ends on the node.
    #[serde(default)]
    pub paths: Vec<PathBuf>,
    /// Open MPI job ids (as `OMPI_MCA_ess_base_jobid` gives them) whose shared-memory
    /// segments on the node go once the attempt ended.
    #[serde(default)]
    pub mpi_jobs: Vec<String>,
    /// Open MPI session directories of those jobs on the node (Open MPI 4's
    /// `OMPI_MCA_orte_jobfam_session_dir`), removed with the segments.
    #[serde(default)]
    pub mpi_sessions: Vec<PathBuf>,
    /// When it was written, Unix seconds.
    pub time: f64,
}

/// The record file of `rank` on `host`.
fn record_name(rank: usize, host: &str) -> String {
    format!("{}{rank}-{host}", layout::NODE_RECORD_PREFIX)
}

/// Records (atomically) in `dir` that `rank` keeps `paths` on this host.
pub fn write_node_record(dir: &Path, rank: usize, paths: &[PathBuf]) -> std::io::Result<()> {
    let host = crate::this_host();
    let record = NodeRecord {
        host: host.to_string(),
        rank,
        paths: paths.to_vec(),
        mpi_jobs: Vec::new(),
        mpi_sessions: Vec::new(),
        time: crate::unix_time(),
    };
    write_record(&dir.join(record_name(rank, host)), &record)
}

/// Records (atomically) in `dir` that `rank` runs on this host in Open MPI job `jobid`, whose
/// session directory here is `session`.
pub fn write_mpi_record(
    dir: &Path,
    rank: usize,
    jobid: &str,
    session: Option<&Path>,
) -> std::io::Result<()> {
    let host = crate::this_host();
    let jobid: String = jobid.chars().filter(char::is_ascii_digit).collect();
    let record = NodeRecord {
        host: host.to_string(),
        rank,
        paths: Vec::new(),
        mpi_jobs: vec![jobid.clone()],
        mpi_sessions: session.into_iter().map(Path::to_path_buf).collect(),
        time: crate::unix_time(),
    };
    let name = format!("{}-mpi-{jobid}", record_name(rank, host));
    write_record(&dir.join(name), &record)
}

fn write_record(path: &Path, record: &NodeRecord) -> std::io::Result<()> {
    let text = serde_json::to_string(record).map_err(std::io::Error::other)? + "\n";
    crate::files::write_atomic(path, text.as_bytes(), crate::files::Atomic::RECORD)
}

/// Where Open MPI puts its shared-memory segments (its default backing directory).
pub const MPI_SHM_DIR: &str = "/dev/shm";

/// File-name prefixes of Open MPI's shared-memory segments (4.x, 5.x).
const MPI_SEGMENT_PREFIXES: [&str; 2] = ["vader_segment.", "sm_segment."];

/// The shared-memory segment files in `shm` of Open MPI job `jobid` (decimal, as
/// `OMPI_MCA_ess_base_jobid` says it), owned by `uid`: those of local rank `local_rank`,
/// or of every local rank.
pub fn mpi_segments(shm: &Path, jobid: &str, uid: u32, local_rank: Option<usize>) -> Vec<PathBuf> {
    use std::os::unix::fs::MetadataExt;
    let Ok(id) = jobid.trim().parse::<u32>() else {
        return Vec::new();
    };
    let mark = format!(".{uid}.{id:x}.");
    let Ok(entries) = std::fs::read_dir(shm) else {
        return Vec::new();
    };
    let ours = |name: &str| {
        let Some(prefix) = MPI_SEGMENT_PREFIXES.iter().find(|p| name.starts_with(*p)) else {
            return false;
        };
        let Some(at) = name[prefix.len()..].rfind(&mark).map(|i| i + prefix.len()) else {
            return false;
        };
        let rank = &name[at + mark.len()..];
        !rank.is_empty()
            && rank.bytes().all(|b| b.is_ascii_digit())
            && local_rank.is_none_or(|r| rank == r.to_string())
    };
    entries
        .filter_map(Result::ok)
        .filter(|e| ours(&e.file_name().to_string_lossy()))
        .filter(|e| {
            std::fs::symlink_metadata(e.path()).is_ok_and(|m| m.is_file() && m.uid() == uid)
        })
        .map(|e| e.path())
        .collect()
}

/// Whether `path` may be removed as an ended Open MPI job's session directory: a directory
/// (not a link) of this user named `pid.<P>` inside `ompi.<host>.<uid>`, where no process
/// `P` runs on this node (`mpirun`'s, or its daemon's, is gone).
pub fn mpi_session_removable(path: &Path, uid: u32) -> bool {
    use std::ffi::OsStr;
    use std::os::unix::fs::MetadataExt;
    let pid = path
        .file_name()
        .and_then(OsStr::to_str)
        .and_then(|n| n.strip_prefix("pid."))
        .and_then(|p| p.parse::<i32>().ok())
        .filter(|&p| p > 0);
    let top = path
        .parent()
        .and_then(Path::file_name)
        .and_then(OsStr::to_str)
        .and_then(|n| n.strip_prefix("ompi."))
        .and_then(|rest| rest.rsplit_once('.'))
        .is_some_and(|(_, u)| u == uid.to_string());
    let Some(pid) = pid.filter(|_| top) else {
        return false;
    };
    // SAFETY: kill with signal 0 sends nothing; it only asks whether the process exists.
    let gone = unsafe { libc::kill(pid, 0) } != 0
        && std::io::Error::last_os_error().raw_os_error() == Some(libc::ESRCH);
    gone && std::fs::symlink_metadata(path)
        .is_ok_and(|m| m.is_dir() && !m.file_type().is_symlink() && m.uid() == uid)
}

/// This process's user id.
fn uid() -> u32 {
    // SAFETY: getuid has no preconditions and cannot fail.
    unsafe { libc::getuid() }
}

/// Every record in `dir` (files that do not parse are skipped), with the file each came
/// from.
pub fn read_node_records(dir: &Path) -> Vec<(PathBuf, NodeRecord)> {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return Vec::new();
    };
    let mut records: Vec<(PathBuf, NodeRecord)> = entries
        .filter_map(Result::ok)
        .filter(|e| {
            e.file_name()
                .to_string_lossy()
                .starts_with(layout::NODE_RECORD_PREFIX)
        })
        .filter_map(|e| {
            let text =
                crate::files::read_to_string_limited(&e.path(), 1 << 20, "a node record").ok()?;
            Some((e.path(), serde_json::from_str(text.trim()).ok()?))
        })
        .collect();
    records.sort_by(|a, b| (&a.1.host, a.1.rank).cmp(&(&b.1.host, b.1.rank)));
    records
}

/// The hosts of `dir`'s records, each once, sorted.
pub fn recorded_hosts(dir: &Path) -> Vec<String> {
    let mut hosts: Vec<String> = read_node_records(dir)
        .into_iter()
        .map(|(_, r)| r.host)
        .collect();
    hosts.dedup();
    hosts
}

/// Whether two host names are the same host, up to the domain (as the launcher compares
/// them).
fn same_host(a: &str, b: &str) -> bool {
    let short = |s: &str| s.split('.').next().unwrap_or(s).to_ascii_lowercase();
    a.eq_ignore_ascii_case(b) || short(a) == short(b)
}

/// Whether `path` may be removed as a run's node state: a directory (not a link) named
/// `kiln-<16 hex digits>`.
fn removable(path: &Path) -> bool {
    let named = path
        .file_name()
        .and_then(|n| n.to_str())
        .and_then(|n| n.strip_prefix(layout::SNAPSHOT_ROOT_PREFIX))
        .is_some_and(|key| key.len() == 16 && key.bytes().all(|b| b.is_ascii_hexdigit()));
    named
        && std::fs::symlink_metadata(path).is_ok_and(|m| m.is_dir() && !m.file_type().is_symlink())
}

/// What [`release`] did on one host.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct Released {
    /// Directories removed.
    pub removed: Vec<PathBuf>,
    /// Directories that could not be removed, with why.
    pub failed: Vec<(PathBuf, String)>,
}

/// Removes what the records in `dir` for host `host` name (see the module documentation):
/// the memory tier's directories and the Open MPI segments; then those records. A record
/// whose directories could not all be removed stays.
pub fn release(dir: &Path, host: &str) -> Released {
    release_in(dir, host, Path::new(MPI_SHM_DIR), true)
}

/// [`release`] of the Open MPI segments alone (after an attempt: the memory tier stays
/// for the next one).
pub fn release_mpi(dir: &Path, host: &str) -> Released {
    release_in(dir, host, Path::new(MPI_SHM_DIR), false)
}

/// [`release`] with the Open MPI segments in `shm`; the memory tier's directories too when
/// `tiers`.
fn release_in(dir: &Path, host: &str, shm: &Path, tiers: bool) -> Released {
    let mut out = Released::default();
    for (file, record) in read_node_records(dir) {
        if !same_host(&record.host, host) || (!tiers && record.mpi_jobs.is_empty()) {
            continue;
        }
        for job in &record.mpi_jobs {
            for seg in mpi_segments(shm, job, uid(), None) {
                match std::fs::remove_file(&seg) {
                    Ok(()) => out.removed.push(seg),
                    Err(e) => out.failed.push((seg, e.to_string())),
                }
            }
        }
        for session in &record.mpi_sessions {
            if out.removed.contains(session) || !mpi_session_removable(session, uid()) {
                continue;
            }
            match std::fs::remove_dir_all(session) {
                Ok(()) => out.removed.push(session.clone()),
                Err(e) => out.failed.push((session.clone(), e.to_string())),
            }
        }
        if !tiers {
            let _ = std::fs::remove_file(file);
            continue;
        }
        let mut all = true;
        for path in &record.paths {
            if out.removed.contains(path) || !path.exists() {
                continue;
            }
            if !removable(path) {
                out.failed.push((
                    path.clone(),
                    "not a memory-tier directory (kiln-<hex>)".into(),
                ));
                all = false;
                continue;
            }
            match std::fs::remove_dir_all(path) {
                Ok(()) => out.removed.push(path.clone()),
                Err(e) => {
                    out.failed.push((path.clone(), e.to_string()));
                    all = false;
                }
            }
        }
        if all {
            let _ = std::fs::remove_file(file);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn release_removes_the_hosts_recorded_tiers_and_nothing_else() {
        let progress = tempfile::tempdir().unwrap();
        let shm = tempfile::tempdir().unwrap();
        let tier = |key: &str| {
            let p = shm.path().join(key);
            std::fs::create_dir_all(p.join("rank-0/step-5")).unwrap();
            p
        };
        let (mine, other) = (tier("kiln-00112233aabbccdd"), tier("kiln-ffeeddccbbaa9988"));
        let odd = tier("not-a-tier");
        let link = shm.path().join("kiln-0123456789abcdef");
        std::os::unix::fs::symlink(&odd, &link).unwrap();
        let write = |rank: usize, host: &str, paths: Vec<PathBuf>| {
            let r = NodeRecord {
                host: host.into(),
                rank,
                paths,
                mpi_jobs: Vec::new(),
                mpi_sessions: Vec::new(),
                time: 1.0,
            };
            let text = serde_json::to_string(&r).unwrap();
            std::fs::write(progress.path().join(record_name(rank, host)), text).unwrap();
        };
        write(0, "n1", vec![mine.clone()]);
        write(1, "n1", vec![mine.clone(), odd.clone(), link.clone()]);
        write(2, "n2", vec![other.clone()]);
        assert_eq!(recorded_hosts(progress.path()), ["n1", "n2"]);
        let r = release(progress.path(), "n1.cluster.example");
        assert_eq!(r.removed, vec![mine.clone()]);
        assert_eq!(r.failed.len(), 2, "{r:?}");
        assert!(!mine.exists() && other.exists() && odd.exists() && link.exists());
        // The clean record goes; the one that named what kiln would not remove stays.
        let left: Vec<usize> = read_node_records(progress.path())
            .into_iter()
            .map(|(_, r)| r.rank)
            .collect();
        assert_eq!(left, [1, 2]);
        // Written by a rank: this host, read back.
        write_node_record(progress.path(), 7, std::slice::from_ref(&other)).unwrap();
        let r = release(progress.path(), crate::this_host());
        assert_eq!(r.removed, vec![other.clone()]);
    }

    #[test]
    fn only_recorded_jobs_segments_of_this_user_are_named_and_released() {
        let shm = tempfile::tempdir().unwrap();
        let progress = tempfile::tempdir().unwrap();
        let me = uid();
        let names = [
            format!("vader_segment.vm.{me}.4c20001.0"),
            format!("vader_segment.vm.{me}.4c20001.1"),
            format!("vader_segment.vm.{me}.4c20002.1"),
            format!("vader_segment.vm.{}.4c20001.1", me + 1),
            format!("sm_segment.n1.{me}.4c20001.12"),
            format!("other.vm.{me}.4c20001.1"),
            format!("vader_segment.vm.{me}.4c20001.1x"),
        ];
        for n in &names {
            std::fs::write(shm.path().join(n), b"x").unwrap();
        }
        let sorted = |mut v: Vec<PathBuf>| {
            v.sort();
            v
        };
        let at = |i: &[usize]| sorted(i.iter().map(|&i| shm.path().join(&names[i])).collect());
        // 79822849 is 0x4c20001.
        assert_eq!(
            sorted(mpi_segments(shm.path(), "79822849", me, Some(1))),
            at(&[1])
        );
        assert_eq!(
            sorted(mpi_segments(shm.path(), "79822849", me, None)),
            at(&[4, 0, 1])
        );
        assert!(mpi_segments(shm.path(), "not a number", me, None).is_empty());
        // After an attempt: the recorded job's segments go, the memory tier's record stays.
        write_mpi_record(progress.path(), 3, "79822849", None).unwrap();
        let tier = shm.path().join("kiln-00112233aabbccdd");
        std::fs::create_dir(&tier).unwrap();
        write_node_record(progress.path(), 3, std::slice::from_ref(&tier)).unwrap();
        let r = release_in(progress.path(), crate::this_host(), shm.path(), false);
        assert_eq!(sorted(r.removed), at(&[4, 0, 1]));
        assert!(tier.exists());
        assert_eq!(read_node_records(progress.path()).len(), 1);
        assert!(shm.path().join(&names[2]).exists() && shm.path().join(&names[3]).exists());
    }

    /// A pid that no process has: a child's, once it was waited for.
    fn ended_pid() -> u32 {
        let mut child = std::process::Command::new("true").spawn().unwrap();
        let pid = child.id();
        child.wait().unwrap();
        pid
    }

    #[test]
    fn only_ended_jobs_session_directories_of_this_user_are_released() {
        let tmp = tempfile::tempdir().unwrap();
        let progress = tempfile::tempdir().unwrap();
        let me = uid();
        let (dead, live) = (ended_pid(), std::process::id());
        let session = |top: &str, leaf: String| {
            let p = tmp.path().join(top).join(leaf);
            std::fs::create_dir_all(p.join("0/1")).unwrap();
            std::fs::write(p.join("pmix_dstor_ds21"), b"x").unwrap();
            p
        };
        let top = format!("ompi.vm.{me}");
        let ended = session(&top, format!("pid.{dead}"));
        let running = session(&top, format!("pid.{live}"));
        let odd = session(&top, "pid.x".into());
        let elsewhere = session(&format!("other.vm.{me}"), format!("pid.{dead}"));
        let other_user = session(&format!("ompi.vm.{}", me + 1), format!("pid.{dead}"));
        let link = tmp.path().join(&top).join(format!("pid.{}", ended_pid()));
        std::os::unix::fs::symlink(&odd, &link).unwrap();
        assert!(mpi_session_removable(&ended, me));
        for kept in [&running, &odd, &elsewhere, &other_user, &link] {
            assert!(!mpi_session_removable(kept, me), "{}", kept.display());
        }
        for (rank, path) in [&ended, &running, &odd, &elsewhere, &link]
            .into_iter()
            .enumerate()
        {
            write_mpi_record(progress.path(), rank, &format!("{}", 7 + rank), Some(path)).unwrap();
        }
        let r = release_mpi(progress.path(), crate::this_host());
        assert_eq!(r.removed, vec![ended.clone()], "{r:?}");
        assert!(r.failed.is_empty(), "{r:?}");
        assert!(!ended.exists());
        assert!(running.exists() && odd.exists() && elsewhere.exists() && other_user.exists());
        assert!(read_node_records(progress.path()).is_empty());
    }
}

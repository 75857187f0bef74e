//! Open MPI's shared-memory segments of a rank that did not finalise. Each local rank of an
//! Open MPI job creates one 4 MiB file in `/dev/shm` for its peers on the node
//! (`vader_segment.<host>.<uid>.<jobid>.<local rank>`; `sm_segment.` in Open MPI 5) and
//! unlinks it in `MPI_Finalize`: a rank killed before that leaves it behind, and a job with
//! hundreds of faults accumulates hundreds. The rank shim removes its own rank's segment
//! once its program has ended ([`remove_own_segment`]): the job id (which mpirun gives every
//! rank as `OMPI_MCA_ess_base_jobid`) and the local rank name exactly that file, so no other
//! job's or rank's segment is touched, and the peers that still run have it mapped already
//! (they attach in `MPI_Init`; an unlinked file stays valid while mapped).

use std::path::{Path, PathBuf};

/// Where Open MPI puts its segments (`shmem_mmap_backing_file_base_dir`'s default).
pub const SHM_DIR: &str = "/dev/shm";

/// The variable in which Open MPI tells a rank its job id (decimal).
pub const JOBID_ENV: &str = "OMPI_MCA_ess_base_jobid";

/// File-name prefixes of Open MPI's shared-memory segments (4.x, 5.x).
const PREFIXES: [&str; 2] = ["vader_segment.", "sm_segment."];

/// The segment files in `dir` of Open MPI job `jobid` (as `OMPI_MCA_ess_base_jobid` says
/// it) and local rank `local_rank`, owned by `uid`.
pub fn own_segments(dir: &Path, jobid: &str, local_rank: usize, uid: u32) -> Vec<PathBuf> {
    use std::os::unix::fs::MetadataExt;
    let Ok(id) = jobid.trim().parse::<u32>() else {
        return Vec::new();
    };
    let suffix = format!(".{uid}.{id:x}.{local_rank}");
    let Ok(entries) = std::fs::read_dir(dir) else {
        return Vec::new();
    };
    entries
        .filter_map(Result::ok)
        .filter(|e| {
            let name = e.file_name();
            let name = name.to_string_lossy();
            PREFIXES.iter().any(|p| name.starts_with(p)) && name.ends_with(&suffix)
        })
        .filter(|e| {
            std::fs::symlink_metadata(e.path()).is_ok_and(|m| m.is_file() && m.uid() == uid)
        })
        .map(|e| e.path())
        .collect()
}

/// Removes this process's rank's segment (see the module documentation); returns what it
/// removed. Nothing outside an Open MPI job.
pub fn remove_own_segment(local_rank: usize) -> Vec<PathBuf> {
    let Ok(jobid) = std::env::var(JOBID_ENV) else {
        return Vec::new();
    };
    // SAFETY: getuid has no preconditions and cannot fail.
    let uid = unsafe { libc::getuid() };
    own_segments(Path::new(SHM_DIR), &jobid, local_rank, uid)
        .into_iter()
        .filter(|p| std::fs::remove_file(p).is_ok())
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_this_jobs_and_ranks_segments_are_named() {
        let dir = tempfile::tempdir().unwrap();
        // SAFETY: as above.
        let uid = unsafe { libc::getuid() };
        let names = [
            format!("vader_segment.vm.{uid}.4c20001.0"),
            format!("vader_segment.vm.{uid}.4c20001.1"),
            format!("vader_segment.vm.{uid}.4c20002.1"),
            format!("vader_segment.vm.{}.4c20001.1", uid + 1),
            format!("sm_segment.n1.{uid}.4c20001.1"),
            format!("other.vm.{uid}.4c20001.1"),
            format!("vader_segment.vm.{uid}.4c20001.11"),
        ];
        for n in &names {
            std::fs::write(dir.path().join(n), b"x").unwrap();
        }
        let mut found = own_segments(dir.path(), "79822849", 1, uid);
        found.sort();
        let want: Vec<PathBuf> = [&names[4], &names[1]]
            .iter()
            .map(|n| dir.path().join(n))
            .collect();
        assert_eq!(found, want);
        assert!(own_segments(dir.path(), "not a number", 1, uid).is_empty());
    }
}

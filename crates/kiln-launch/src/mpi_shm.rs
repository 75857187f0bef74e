//! Open MPI's shared-memory segments of a rank that did not finalise. Each local rank of an
//! Open MPI job creates one 4 MiB file in `/dev/shm` for its peers on the node
//! (`vader_segment.<host>.<uid>.<jobid>.<local rank>`; `sm_segment.` in Open MPI 5) and
//! unlinks it in `MPI_Finalize`: a rank killed before that leaves it behind, and a job with
//! hundreds of faults accumulates hundreds. Two things remove them:
//! - the rank shim, once its program ended, removes its own rank's ([`remove_own_segment`]);
//!   the peers that still run have it mapped already (they attach in `MPI_Init`, and an
//!   unlinked file stays valid while mapped);
//! - a shim that is itself killed with the attempt (mpirun's abort) cannot, so each shim
//!   records its job at start ([`record_job`], see [`kiln_run::node_state`]), and the
//!   launcher removes every segment of the attempt's jobs on its own host once the attempt
//!   ended, and on every node when the launch ends.
//!
//! The job id (which mpirun gives every rank as `OMPI_MCA_ess_base_jobid`) names exactly
//! those files: no other job's segment is touched. The record also names the job's session
//! directory on the node, which a SIGKILLed `mpirun` leaves in `$TMPDIR` (8 MiB), and which
//! goes with the segments (see [`kiln_run::node_state`]).

use kiln_run::node_state::{MPI_SHM_DIR, mpi_segments, write_mpi_record};
use std::path::{Path, PathBuf};

/// The variable in which Open MPI tells a rank its job id (decimal).
pub const JOBID_ENV: &str = "OMPI_MCA_ess_base_jobid";

/// This rank's Open MPI job id, if it runs in one.
fn jobid() -> Option<String> {
    std::env::var(JOBID_ENV)
        .ok()
        .filter(|j| !j.trim().is_empty())
}

/// The variable in which Open MPI 4 tells a rank its job's session directory on the node
/// (`$TMPDIR/ompi.<host>.<uid>/pid.<mpirun's pid>`).
pub const SESSION_ENV: &str = "OMPI_MCA_orte_jobfam_session_dir";

/// Records, in the progress directory `dir`, that `rank` runs on this host in this Open MPI
/// job, and the job's session directory here (nothing outside one).
pub fn record_job(dir: &Path, rank: usize) {
    let session = std::env::var_os(SESSION_ENV).map(PathBuf::from);
    if let Some(job) = jobid()
        && let Err(e) = write_mpi_record(dir, rank, &job, session.as_deref())
    {
        eprintln!(
            "kiln launch --as-rank: recording the MPI job in {}: {e}",
            dir.display()
        );
    }
}

/// Removes this process's rank's segment (see the module documentation); returns what it
/// removed. Nothing outside an Open MPI job.
pub fn remove_own_segment(local_rank: usize) -> Vec<PathBuf> {
    let Some(job) = jobid() else {
        return Vec::new();
    };
    // SAFETY: getuid has no preconditions and cannot fail.
    let uid = unsafe { libc::getuid() };
    mpi_segments(Path::new(MPI_SHM_DIR), &job, uid, Some(local_rank))
        .into_iter()
        .filter(|p| std::fs::remove_file(p).is_ok())
        .collect()
}

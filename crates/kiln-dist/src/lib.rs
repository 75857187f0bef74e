//! Collectives between the ranks of a job, behind one small trait ([`Collective`]), on the
//! engine every HPC site already has: MPI (cargo feature `mpi`). One rank needs no engine
//! ([`Solo`]); tests run several ranks as threads of one process ([`Threads`]). The trait and
//! its errors live in [`collective`], below every engine that implements it; this file picks
//! the engine of a process ([`init`]). (Device buffers travel over NCCL or RCCL in
//! kiln-train's wires, which take their ids over a [`Collective`].)
//!
//! Determinism: a sum all-reduce is repeatable bit for bit for a fixed MPI library, rank
//! count, message size and reduction algorithm (measured: OpenMPI 4.1 picks its algorithm
//! from the message and communicator size, so repeated runs agree; forcing other algorithms
//! gives other bit patterns). kiln cuts gradients into buckets of a fixed size
//! ([`BucketedAllReduce`]), so a run and its resume make the same calls. Across rank counts
//! results differ by reduction order only.

mod collective;
pub use collective::{Collective, DistError};

mod solo;
pub use solo::Solo;

mod threads;
pub use threads::Threads;

#[cfg(feature = "mpi")]
mod mpi_engine;
#[cfg(feature = "mpi")]
pub use mpi_engine::Mpi;

mod mesh;
pub use mesh::{DeviceMesh, Dim, Dims, MeshShape};

mod flat;
pub use flat::{BucketedAllReduce, Sharded};

mod background;
pub use background::{Background, Pending};

use kiln_topology::RankEnv;

/// The collective for this process: [`Solo`] for one rank, MPI for several (started by an MPI
/// launcher). Checks that MPI's view of the job matches the launcher's rank variables.
/// `concurrent`: ask MPI for MPI_THREAD_MULTIPLE (for [`Background`]); only when it is
/// needed: asked for in every run, one CI run had a rank segfault at start over Open MPI
/// 4.1's TCP transport (a Slurm test; not reproduced, cause not established).
pub fn init(env: &RankEnv, concurrent: bool) -> Result<Box<dyn Collective>, DistError> {
    if env.world_size <= 1 {
        return Ok(Box::new(Solo));
    }
    #[cfg(feature = "mpi")]
    {
        let mpi = Mpi::init(concurrent)?;
        if mpi.rank() != env.rank || mpi.size() != env.world_size {
            return Err(DistError::Mismatch {
                env_rank: env.rank,
                env_size: env.world_size,
                mpi_rank: mpi.rank(),
                mpi_size: mpi.size(),
            });
        }
        Ok(Box::new(mpi))
    }
    #[cfg(not(feature = "mpi"))]
    {
        let _ = concurrent;
        Err(DistError::NoEngine(env.world_size))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn solo_is_the_identity_and_one_rank_needs_no_engine() {
        let env = kiln_topology::rank_env_from(|_| None).unwrap();
        let c = init(&env, false).unwrap();
        assert_eq!((c.rank(), c.size()), (0, 1));
        let g = [1.0f32, -2.0, 3.5];
        assert_eq!(BucketedAllReduce::new(8).mean(c.as_ref(), &g), g);
        assert_eq!(c.all_gather_u64(7), vec![7]);
        let sh = Sharded::new(5, 1, 8);
        assert_eq!(sh.range(0), 0..5);
        assert_eq!(
            sh.reduce_scatter_mean(c.as_ref(), &mut [[1.0, 2.0, 3.0, 4.0, 5.0]]),
            [1.0, 2.0, 3.0, 4.0, 5.0]
        );
        assert_eq!(
            sh.all_gather(c.as_ref(), &[1.0, 2.0, 3.0, 4.0, 5.0]),
            [1.0, 2.0, 3.0, 4.0, 5.0]
        );
        let mut m = [3u64, 9];
        c.all_reduce_max_u64(&mut m);
        assert_eq!(m, [3, 9]);
    }

    #[cfg(not(feature = "mpi"))]
    #[test]
    fn several_ranks_without_mpi_is_a_clear_error() {
        let mut env = kiln_topology::rank_env_from(|_| None).unwrap();
        env.world_size = 2;
        let err = init(&env, false).err().unwrap().to_string();
        assert!(err.contains("--features mpi"), "{err}");
    }
}

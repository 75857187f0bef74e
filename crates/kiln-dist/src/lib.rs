//! Collectives between the ranks of a job, behind one small trait ([`Collective`]), on the
//! engine every HPC site already has: MPI (cargo feature `mpi`). One rank needs no engine
//! ([`Solo`]); tests run several ranks as threads of one process ([`Threads`]). A GPU engine
//! (NCCL through `cudarc`, its unique id broadcast over MPI) would be one more
//! implementation of the same trait.
//!
//! Determinism: a sum all-reduce is repeatable bit for bit for a fixed MPI library, rank
//! count, message size and reduction algorithm (measured: OpenMPI 4.1 picks its algorithm
//! from the message and communicator size, so repeated runs agree; forcing other algorithms
//! gives other bit patterns). kiln cuts gradients into buckets of a fixed size
//! ([`BucketedAllReduce`]), so a run and its resume make the same calls. Across rank counts
//! results differ by reduction order only.

mod solo;
pub use solo::Solo;

mod threads;
pub use threads::Threads;

#[cfg(feature = "mpi")]
mod mpi_engine;
#[cfg(feature = "mpi")]
pub use mpi_engine::Mpi;

pub mod yeet;

mod mesh;
pub use mesh::Mesh;

use kiln_topology::RankEnv;

/// Errors setting up collectives.
#[derive(Debug, thiserror::Error)]
pub enum DistError {
    /// The ranks cannot be cut into equal replicas.
    #[error(
        "parallelism.dp_replicate = {replicas} does not divide the {ranks} ranks of this job into equal replicas; use a divisor of {ranks}"
    )]
    Replicas {
        /// Replicas asked for.
        replicas: usize,
        /// Ranks of the job.
        ranks: usize,
    },
    /// More than one rank, but this kiln has no MPI.
    #[error(
        "WORLD_SIZE={0} but this kiln was built without MPI; rebuild with `cargo build --release --features mpi` (needs an MPI dev package and libclang-dev)"
    )]
    NoEngine(usize),
    /// MPI could not be initialised (twice in one process, or the library failed).
    #[error("MPI could not be initialised: {0}")]
    Init(String),
    /// The launcher's rank variables disagree with MPI's own view of the job.
    #[error(
        "the rank environment says rank {env_rank} of {env_size} but MPI says rank {mpi_rank} of {mpi_size}; start the ranks with an MPI launcher (`kiln launch --mpi`, mpirun, mpiexec or srun), not as independent processes"
    )]
    Mismatch {
        /// RANK from the environment.
        env_rank: usize,
        /// WORLD_SIZE from the environment.
        env_size: usize,
        /// MPI's rank.
        mpi_rank: usize,
        /// MPI's size.
        mpi_size: usize,
    },
}

/// Collective operations among the ranks of a job. Every rank must make the same calls in the
/// same order with the same sizes (the MPI rule); results are identical on every rank.
pub trait Collective: Send {
    /// This rank, `0..size()`.
    fn rank(&self) -> usize;
    /// Number of ranks.
    fn size(&self) -> usize;
    /// Name of the engine (`solo`, `mpi: Open MPI v4.1.4 ...`), for the event log.
    fn describe(&self) -> String;
    /// Element-wise sum of `buf` over all ranks, written back into `buf`.
    fn all_reduce_sum_f32(&self, buf: &mut [f32]);
    /// Element-wise sum of `send` over all ranks, written into `recv` (the same length).
    /// Engines that reduce into a separate buffer anyway (MPI without `MPI_IN_PLACE`) write
    /// `recv` directly, one copy less than [`Collective::all_reduce_sum_f32`].
    fn all_reduce_sum_f32_into(&self, send: &[f32], recv: &mut [f32]) {
        recv.copy_from_slice(send);
        self.all_reduce_sum_f32(recv);
    }
    /// Element-wise sum of `buf` over all ranks (f64), written back into `buf`.
    fn all_reduce_sum_f64(&self, buf: &mut [f64]);
    /// Element-wise maximum of `buf` over all ranks, written back into `buf`.
    fn all_reduce_max_u64(&self, buf: &mut [u64]);
    /// Element-wise sum of `send` over all ranks, of which this rank receives block
    /// `rank()` (`send` is `size()` blocks of `recv.len()` elements: MPI_Reduce_scatter_block).
    fn reduce_scatter_sum_f32(&self, send: &[f32], recv: &mut [f32]);
    /// Every rank's `send` (all the same length), concatenated in rank order into `recv`
    /// (`size()` times as long: MPI_Allgather).
    fn all_gather_f32(&self, send: &[f32], recv: &mut [f32]);
    /// Every rank's `value`, in rank order.
    fn all_gather_u64(&self, value: u64) -> Vec<u64>;
    /// Copies `buf` of rank `root` into `buf` of every rank (all ranks pass the same length).
    fn broadcast_bytes(&self, root: usize, buf: &mut [u8]);
    /// Waits until every rank got here.
    fn barrier(&self);
    /// Ends every rank of the job with `code` (MPI_Abort): for an error on one rank that the
    /// others cannot know about, so that none of them waits forever in a collective.
    fn abort(&self, code: i32) -> !;
    /// This rank's index among the ranks of its node, and how many ranks its node has (for
    /// yeet's one writer per node).
    fn node_local_rank(&self) -> (usize, usize) {
        (0, 1)
    }
    /// The ranks that pass the same `color`, as a job of their own, numbered in the order of
    /// their `key` (MPI_Comm_split). Every rank calls it.
    fn split(&self, color: usize, key: usize) -> Box<dyn Collective>;
}

/// The collective for this process: [`Solo`] for one rank, MPI for several (started by an MPI
/// launcher). Checks that MPI's view of the job matches the launcher's rank variables.
pub fn init(env: &RankEnv) -> Result<Box<dyn Collective>, DistError> {
    if env.world_size <= 1 {
        return Ok(Box::new(Solo));
    }
    #[cfg(feature = "mpi")]
    {
        let mpi = Mpi::init()?;
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
        Err(DistError::NoEngine(env.world_size))
    }
}

/// All-reduce of one long buffer in buckets of a fixed number of elements: bounded message
/// sizes (as PyTorch DDP's 25 MB buckets), and the same calls on every run, which keeps the
/// reduction repeatable.
#[derive(Debug, Clone, Copy)]
pub struct BucketedAllReduce {
    bucket_elems: usize,
}

impl BucketedAllReduce {
    /// Buckets of `bucket_bytes` bytes of f32 (at least one element).
    pub fn new(bucket_bytes: usize) -> Self {
        Self {
            bucket_elems: (bucket_bytes / 4).max(1),
        }
    }

    /// The mean over ranks of `send` (sum, then times 1/size: the same scaling on every
    /// rank and every run), in a new buffer that the engine reduces into directly: besides
    /// the engine's own work, one pass over the data (the scaling).
    pub fn mean(&self, comm: &dyn Collective, send: &[f32]) -> Vec<f32> {
        if comm.size() == 1 {
            return send.to_vec();
        }
        let mut out = vec![0.0f32; send.len()];
        let buckets = send.chunks(self.bucket_elems);
        for (s, r) in buckets.zip(out.chunks_mut(self.bucket_elems)) {
            comm.all_reduce_sum_f32_into(s, r);
        }
        let inv = 1.0 / comm.size() as f32;
        for v in out.iter_mut() {
            *v *= inv;
        }
        out
    }
}

/// A flat buffer sharded over the ranks for sharded data parallelism: `len` elements, padded
/// to `size` equal contiguous shards; rank `r` owns `[r * shard, (r + 1) * shard)`. The
/// collectives move one bucket at a time, `bucket / size` elements of every shard per call,
/// so message sizes stay bounded and a run and its resume make the same calls (repeatable).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Sharded {
    /// Elements of the (unpadded) buffer.
    pub len: usize,
    /// Elements per shard (the last one padded).
    pub shard: usize,
    /// Elements of every shard that one call moves.
    chunk: usize,
    /// Bytes of the buckets.
    bucket_bytes: usize,
}

impl Sharded {
    /// `len` elements over `ranks` ranks, moved in buckets of `bucket_bytes` bytes of f32.
    pub fn new(len: usize, ranks: usize, bucket_bytes: usize) -> Self {
        let ranks = ranks.max(1);
        let shard = len.div_ceil(ranks);
        Self {
            len,
            shard,
            chunk: (bucket_bytes / 4 / ranks).max(1),
            bucket_bytes,
        }
    }

    /// The range of the flat buffer rank `rank` owns (its padding excluded).
    pub fn range(&self, rank: usize) -> std::ops::Range<usize> {
        let start = (rank * self.shard).min(self.len);
        start..((rank + 1) * self.shard).min(self.len)
    }

    /// This rank's shard of the mean over ranks of `full` (`len` elements): bucketed
    /// reduce-scatter, then times 1/size (the same scaling on every rank and every run).
    /// Padding comes back as zeros past the buffer's end.
    pub fn reduce_scatter_mean(&self, comm: &dyn Collective, full: &[f32]) -> Vec<f32> {
        let n = comm.size();
        let mut out = vec![0.0f32; self.shard];
        let mut send = Vec::with_capacity(self.chunk * n);
        for lo in (0..self.shard).step_by(self.chunk) {
            let hi = (lo + self.chunk).min(self.shard);
            send.clear();
            for r in 0..n {
                let (a, b) = (r * self.shard + lo, r * self.shard + hi);
                let have = &full[a.min(self.len)..b.min(self.len)];
                send.extend_from_slice(have);
                send.resize(send.len() + (hi - lo) - have.len(), 0.0);
            }
            comm.reduce_scatter_sum_f32(&send, &mut out[lo..hi]);
        }
        let inv = 1.0 / n as f32;
        for v in out.iter_mut() {
            *v *= inv;
        }
        out
    }

    /// The whole buffer (`len` elements) from every rank's shard (`shard` elements each):
    /// bucketed all-gather.
    pub fn all_gather(&self, comm: &dyn Collective, mine: &[f32]) -> Vec<f32> {
        let n = comm.size();
        let mut full = vec![0.0f32; self.shard * n];
        let mut recv = vec![0.0f32; self.chunk * n];
        for lo in (0..self.shard).step_by(self.chunk) {
            let hi = (lo + self.chunk).min(self.shard);
            let w = hi - lo;
            comm.all_gather_f32(&mine[lo..hi], &mut recv[..w * n]);
            for r in 0..n {
                let at = r * self.shard + lo;
                full[at..at + w].copy_from_slice(&recv[r * w..(r + 1) * w]);
            }
        }
        full.truncate(self.len);
        full
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn solo_is_the_identity_and_one_rank_needs_no_engine() {
        let env = kiln_topology::rank_env_from(|_| None).unwrap();
        let c = init(&env).unwrap();
        assert_eq!((c.rank(), c.size()), (0, 1));
        let g = [1.0f32, -2.0, 3.5];
        assert_eq!(BucketedAllReduce::new(8).mean(c.as_ref(), &g), g);
        assert_eq!(c.all_gather_u64(7), vec![7]);
        let sh = Sharded::new(5, 1, 8);
        assert_eq!(sh.range(0), 0..5);
        assert_eq!(
            sh.reduce_scatter_mean(c.as_ref(), &[1.0, 2.0, 3.0, 4.0, 5.0]),
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

    #[test]
    fn shards_cover_the_buffer_once_whatever_the_rank_count() {
        for len in [0usize, 1, 7, 100, 101] {
            for ranks in 1..=5 {
                let sh = Sharded::new(len, ranks, 12);
                let mut next = 0;
                for r in 0..ranks {
                    let range = sh.range(r);
                    assert_eq!(range.start, next, "len {len} ranks {ranks}");
                    assert!(range.len() <= sh.shard);
                    next = range.end;
                }
                assert_eq!(next, len);
            }
        }
    }

    #[cfg(not(feature = "mpi"))]
    #[test]
    fn several_ranks_without_mpi_is_a_clear_error() {
        let mut env = kiln_topology::rank_env_from(|_| None).unwrap();
        env.world_size = 2;
        let err = init(&env).err().unwrap().to_string();
        assert!(err.contains("--features mpi"), "{err}");
    }
}

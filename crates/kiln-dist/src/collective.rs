//! The [`Collective`] trait every engine implements, and the errors of setting one up.

/// Errors setting up collectives.
#[derive(Debug, thiserror::Error)]
pub enum DistError {
    /// A mesh whose dims do not multiply to the job's ranks.
    #[error("the device mesh {mesh} does not have the {ranks} rank(s) of this job")]
    Shape {
        /// The mesh's dims and sizes.
        mesh: String,
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
    /// Element-wise maximum of `buf` over all ranks (f32), written back into `buf`.
    fn all_reduce_max_f32(&self, buf: &mut [f32]);
    /// Element-wise sum of `send` over all ranks, of which this rank receives block
    /// `rank()` (`send` is `size()` blocks of `recv.len()` elements: MPI_Reduce_scatter_block).
    fn reduce_scatter_sum_f32(&self, send: &[f32], recv: &mut [f32]);
    /// Every rank's `send` (all the same length), concatenated in rank order into `recv`
    /// (`size()` times as long: MPI_Allgather).
    fn all_gather_f32(&self, send: &[f32], recv: &mut [f32]);
    /// Every rank's `value`, in rank order.
    fn all_gather_u64(&self, value: u64) -> Vec<u64>;
    /// `send` is `size()` blocks of equal length, block `r` for rank `r`; `recv` (as long)
    /// gets block `r` from rank `r` (MPI_Alltoall).
    fn all_to_all_f32(&self, send: &[f32], recv: &mut [f32]) {
        let n = self.size();
        let counts = vec![send.len() / n.max(1); n];
        self.all_to_allv_f32(send, &counts, recv, &counts);
    }
    /// [`Collective::all_to_all_f32`] with blocks of their own lengths: `send` is
    /// `send_counts[r]` elements for each rank `r` in rank order, `recv` gets
    /// `recv_counts[r]` elements from each rank `r` in rank order (MPI_Alltoallv). The
    /// counts must agree: rank `a`'s `send_counts[b]` is rank `b`'s `recv_counts[a]`.
    fn all_to_allv_f32(
        &self,
        send: &[f32],
        send_counts: &[usize],
        recv: &mut [f32],
        recv_counts: &[usize],
    );
    /// Sends `send` to rank `to` and receives `recv` (exactly its length) from rank `from`
    /// at once (MPI_Sendrecv): what a pipeline's neighbours exchange without either blocking
    /// the other. Rank `to` must make the matching call with this rank as its `from`.
    fn send_recv_f32(&self, to: usize, send: &[f32], from: usize, recv: &mut [f32]);
    /// Sends `buf` to rank `to` (MPI_Send; may wait until `to` receives it). Every send is
    /// matched by a [`Collective::recv_f32`] on `to`, in order.
    fn send_f32(&self, to: usize, buf: &[f32]);
    /// Receives `buf` (exactly its length) from rank `from` (MPI_Recv).
    fn recv_f32(&self, from: usize, buf: &mut [f32]);
    /// Copies `buf` of rank `root` into `buf` of every rank (all ranks pass the same length).
    fn broadcast_bytes(&self, root: usize, buf: &mut [u8]);
    /// Copies `buf` of rank `root` into `buf` of every rank, whatever its length elsewhere:
    /// the length first, then the bytes.
    fn broadcast_vec(&self, root: usize, buf: &mut Vec<u8>) {
        let mut len = (buf.len() as u64).to_le_bytes();
        self.broadcast_bytes(root, &mut len);
        let n = usize::try_from(u64::from_le_bytes(len)).unwrap_or(0);
        buf.resize(n, 0);
        if n > 0 {
            self.broadcast_bytes(root, buf);
        }
    }
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
    /// Whether a communicator split from this one may make calls on another thread while
    /// this one makes its own (MPI_THREAD_MULTIPLE): what [`Background`] needs.
    fn concurrent(&self) -> bool {
        false
    }
}

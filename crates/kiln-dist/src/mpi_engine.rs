//! The MPI engine (rsmpi on the system's MPI library).
//!
//! rsmpi has no in-place all-reduce (`MPI_IN_PLACE` is `(void*)1` in OpenMPI and `(void*)-1`
//! in MPICH, and bindgen cannot see either), so each call reduces into a scratch buffer and
//! copies back; with bucketed calls the scratch stays one bucket long. The gradient path
//! reduces into a buffer of its own instead (`all_reduce_sum_f32_into`), without that copy.
//!
//! Every blocking call is marked with [`kiln_run::waiting_mark::waiting`]: a rank that waits
//! long on the others says so in its progress beacon, so a hang names the rank that is not
//! in the collective.
//!
//! Empty buffers are never handed to MPI: an empty `Vec<u8>`'s pointer is the dangling
//! `0x1`, which OpenMPI takes for `MPI_IN_PLACE` and rejects (MPI_ERR_ARG). Every rank
//! knows the length, so every rank skips the same call.

use crate::collective::{Collective, DistError};
use mpi::collective::SystemOperation;
use mpi::topology::{Communicator, SimpleCommunicator};
use mpi::traits::*;
use std::cell::RefCell;
use std::sync::Arc;

/// A communicator of this process: MPI_COMM_WORLD, or a group split from it
/// ([`Collective::split`]). MPI is finalised when the last of them is dropped.
pub struct Mpi {
    // Field order matters: the communicators must be freed before the universe finalises.
    world: SimpleCommunicator,
    node: SimpleCommunicator,
    scratch_f32: RefCell<Vec<f32>>,
    /// Whether the library runs calls of several threads at once (MPI_THREAD_MULTIPLE).
    multiple: bool,
    universe: Arc<mpi::environment::Universe>,
}

// SAFETY: one communicator is used by one thread at a time (the trainer's main thread, or
// the one thread of a `Background`); `Send` lets its owner move it to that thread. Two
// threads use two communicators at once only when the library granted
// MPI_THREAD_MULTIPLE (`concurrent`).
unsafe impl Send for Mpi {}

impl Mpi {
    /// Initialises MPI (once per process); with `multiple`, asking for MPI_THREAD_MULTIPLE
    /// so that sharded runs can gather the next stage's weights on a second thread (a
    /// library that grants less still works, without that overlap), else funneled.
    pub fn init(multiple: bool) -> Result<Self, DistError> {
        let level = match multiple {
            true => mpi::Threading::Multiple,
            false => mpi::Threading::Funneled,
        };
        let (universe, level) = mpi::initialize_with_threading(level)
            .ok_or_else(|| DistError::Init("MPI was already initialised in this process".into()))?;
        let world = universe.world();
        let multiple = level == mpi::Threading::Multiple;
        Ok(Self::on(world, multiple, Arc::new(universe)))
    }

    /// The engine on communicator `world` of `universe`.
    fn on(
        world: SimpleCommunicator,
        multiple: bool,
        universe: Arc<mpi::environment::Universe>,
    ) -> Self {
        let node = world.split_shared(world.rank());
        Self {
            world,
            node,
            scratch_f32: RefCell::new(Vec::new()),
            multiple,
            universe,
        }
    }
}

impl Mpi {
    /// `buf` reduced by `op` over the ranks, written back (through the scratch buffer: see
    /// the module documentation).
    fn all_reduce_f32(&self, buf: &mut [f32], op: SystemOperation) {
        if buf.is_empty() {
            return;
        }
        let _waiting = kiln_run::waiting_mark::waiting();
        let mut scratch = self.scratch_f32.borrow_mut();
        scratch.clear();
        scratch.resize(buf.len(), 0.0);
        self.world.all_reduce_into(&*buf, &mut scratch[..], op);
        buf.copy_from_slice(&scratch);
    }
}

impl Collective for Mpi {
    fn rank(&self) -> usize {
        self.world.rank() as usize
    }
    fn size(&self) -> usize {
        self.world.size() as usize
    }
    fn describe(&self) -> String {
        let lib = mpi::environment::library_version().unwrap_or_default();
        let first = lib.lines().next().unwrap_or("").trim().to_string();
        let threads = if self.multiple { "" } else { ", one thread" };
        format!("mpi ({first}{threads})")
    }
    fn all_reduce_sum_f32(&self, buf: &mut [f32]) {
        self.all_reduce_f32(buf, SystemOperation::sum());
    }
    fn all_reduce_sum_f32_into(&self, send: &[f32], recv: &mut [f32]) {
        if send.is_empty() {
            return;
        }
        let _waiting = kiln_run::waiting_mark::waiting();
        self.world
            .all_reduce_into(send, recv, SystemOperation::sum());
    }
    fn all_reduce_sum_f64(&self, buf: &mut [f64]) {
        if buf.is_empty() {
            return;
        }
        let _waiting = kiln_run::waiting_mark::waiting();
        let mut out = vec![0.0f64; buf.len()];
        self.world
            .all_reduce_into(&*buf, &mut out[..], SystemOperation::sum());
        buf.copy_from_slice(&out);
    }
    fn all_reduce_max_u64(&self, buf: &mut [u64]) {
        if buf.is_empty() {
            return;
        }
        let _waiting = kiln_run::waiting_mark::waiting();
        let mut out = vec![0u64; buf.len()];
        self.world
            .all_reduce_into(&*buf, &mut out[..], SystemOperation::max());
        buf.copy_from_slice(&out);
    }
    fn all_reduce_max_f32(&self, buf: &mut [f32]) {
        self.all_reduce_f32(buf, SystemOperation::max());
    }
    fn reduce_scatter_sum_f32(&self, send: &[f32], recv: &mut [f32]) {
        if recv.is_empty() {
            return;
        }
        let _waiting = kiln_run::waiting_mark::waiting();
        self.world
            .reduce_scatter_block_into(send, recv, SystemOperation::sum());
    }
    fn all_gather_f32(&self, send: &[f32], recv: &mut [f32]) {
        if send.is_empty() {
            return;
        }
        let _waiting = kiln_run::waiting_mark::waiting();
        self.world.all_gather_into(send, recv);
    }
    fn all_gather_u64(&self, value: u64) -> Vec<u64> {
        let _waiting = kiln_run::waiting_mark::waiting();
        let mut out = vec![0u64; self.size()];
        self.world.all_gather_into(&value, &mut out[..]);
        out
    }
    fn all_to_allv_f32(
        &self,
        send: &[f32],
        send_counts: &[usize],
        recv: &mut [f32],
        recv_counts: &[usize],
    ) {
        // MPI counts and displacements are C ints: a block past 2^31 elements is refused by
        // the conversion (every rank knows the counts, so every rank stops the same way).
        let ints = |counts: &[usize]| -> Option<(Vec<i32>, Vec<i32>)> {
            let counts: Vec<i32> = counts
                .iter()
                .map(|&c| i32::try_from(c).ok())
                .collect::<Option<_>>()?;
            let mut at = 0i32;
            let displs = counts
                .iter()
                .map(|&c| {
                    let d = at;
                    at = at.saturating_add(c);
                    d
                })
                .collect();
            Some((counts, displs))
        };
        let (Some((sc, sd)), Some((rc, rd))) = (ints(send_counts), ints(recv_counts)) else {
            self.abort(70);
        };
        let _waiting = kiln_run::waiting_mark::waiting();
        // Empty buffers are not handed to MPI (see the module documentation): a one-element
        // stand-in, of which zero counts move nothing.
        let (stand_in, mut stand_in_mut) = ([0.0f32], [0.0f32]);
        let send = if send.is_empty() { &stand_in[..] } else { send };
        let recv = if recv.is_empty() {
            &mut stand_in_mut[..]
        } else {
            recv
        };
        let sb = mpi::datatype::Partition::new(send, &sc[..], &sd[..]);
        let mut rb = mpi::datatype::PartitionMut::new(recv, &rc[..], &rd[..]);
        self.world.all_to_all_varcount_into(&sb, &mut rb);
    }
    fn send_recv_f32(&self, to: usize, send: &[f32], from: usize, recv: &mut [f32]) {
        let _waiting = kiln_run::waiting_mark::waiting();
        let (dest, source) = (
            self.world.process_at_rank(to as i32),
            self.world.process_at_rank(from as i32),
        );
        mpi::point_to_point::send_receive_into(send, &dest, recv, &source);
    }
    fn send_f32(&self, to: usize, buf: &[f32]) {
        let _waiting = kiln_run::waiting_mark::waiting();
        self.world.process_at_rank(to as i32).send(buf);
    }
    fn recv_f32(&self, from: usize, buf: &mut [f32]) {
        let _waiting = kiln_run::waiting_mark::waiting();
        self.world.process_at_rank(from as i32).receive_into(buf);
    }
    fn broadcast_bytes(&self, root: usize, buf: &mut [u8]) {
        if buf.is_empty() {
            return;
        }
        let _waiting = kiln_run::waiting_mark::waiting();
        self.world.process_at_rank(root as i32).broadcast_into(buf);
    }
    fn barrier(&self) {
        let _waiting = kiln_run::waiting_mark::waiting();
        self.world.barrier();
    }
    fn abort(&self, code: i32) -> ! {
        self.world.abort(code)
    }
    fn node_local_rank(&self) -> (usize, usize) {
        (self.node.rank() as usize, self.node.size() as usize)
    }
    fn split(&self, color: usize, key: usize) -> Box<dyn Collective> {
        let color = mpi::topology::Color::with_value(color as i32);
        // `None` only for MPI_UNDEFINED, which a color made from a value never is.
        match self.world.split_by_color_with_key(color, key as i32) {
            Some(group) => Box::new(Self::on(group, self.multiple, Arc::clone(&self.universe))),
            None => self.abort(70),
        }
    }
    fn concurrent(&self) -> bool {
        self.multiple
    }
}

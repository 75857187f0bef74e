//! NCCL on CUDA devices: the [`Wire`] under [`super::collective::OnDevice`] when a run's
//! ranks are on CUDA devices, so that gradients and weights stay on the GPU (an all-reduce,
//! reduce-scatter or all-gather over a flat device buffer, instead of a copy to host memory,
//! MPI and a copy back).
//!
//! Rank 0 of each group mints NCCL's unique id and kiln's MPI broadcasts it (the job's ranks are
//! already an MPI world, so no second rendezvous is needed); each rank joins with the GPU its
//! device names (`CUDA_VISIBLE_DEVICES` leaves one per rank, see kiln-launch). A run joins one
//! communicator over the job and, in a hybrid-sharded run, one over the ranks of its replica
//! and one over the ranks holding its shard in the other replicas.
//!
//! **Ordering without synchronising.** The collectives read and write buffers CubeCL
//! allocated, through their raw device addresses, on one stream of kiln's own. CubeCL runs each
//! host thread's work on a stream of its own, which the patched `cubecl-cuda` names with every
//! buffer it resolves (as for kiln's cuBLAS products). A collective is queued after an event
//! recorded on CubeCL's stream (so it sees the kernels that wrote its input), and an event
//! recorded after it is what CubeCL's stream waits on when the caller waits for the result
//! ([`InFlight::wait`]); until then the kept buffers cannot be reused. The host never waits
//! for the device, and CubeCL's kernels queued between the two (the next stage's
//! recomputation) run while NCCL communicates.
//!
//! NCCL's ring gives every rank the same bits, and the same calls in every run give the same
//! bits again (exact resume), as the host path's fixed buckets do.

use super::wire::{InFlight, Over, Ranks, Wire};
use crate::error::TrainError;
use burn::tensor::{Device, Tensor};
use kiln_dist::{Collective, Sharded};

/// NCCL communicators on this rank's CUDA device (see the module documentation).
pub struct Nccl {
    #[cfg(feature = "cuda")]
    mesh: std::sync::Mutex<cuda::Mesh>,
    #[cfg(not(feature = "cuda"))]
    never: std::convert::Infallible,
}

impl Nccl {
    /// Joins every rank of `comm` (a collective: every rank calls it) when `device` is a CUDA
    /// device; `None` on other devices, or in a kiln built without CUDA.
    pub fn join(comm: &dyn Collective, device: &Device) -> Result<Option<Self>, TrainError> {
        Self::join_mesh(Ranks::replicated(comm), device)
    }

    /// Joins the communicators of `ranks` (the job's; the replica's and the shard's where they
    /// are other ranks); `None` off CUDA devices.
    pub fn join_mesh(ranks: Ranks, device: &Device) -> Result<Option<Self>, TrainError> {
        #[cfg(feature = "cuda")]
        return Ok(cuda::Mesh::join(ranks, device)?.map(|m| Self {
            mesh: std::sync::Mutex::new(m),
        }));
        #[cfg(not(feature = "cuda"))]
        {
            let _ = (ranks, device);
            Ok(None)
        }
    }

    /// The mean over the job's ranks of each of `grads` (f32 or bf16, on this rank's device),
    /// in one flat buffer, waited for.
    pub fn mean(&self, grads: Vec<Tensor<1>>) -> Result<Vec<Tensor<1>>, TrainError> {
        let lengths: Vec<usize> = grads.iter().map(|g| g.dims()[0]).collect();
        let flat = Tensor::cat(grads, 0);
        let flat = self.all_reduce(Over::Dp, flat, false)?.wait()?;
        let mut at = 0;
        Ok(lengths
            .into_iter()
            .map(|n| {
                at += n;
                flat.clone().slice(at - n..at)
            })
            .collect())
    }

    fn all_reduce(
        &self,
        over: Over,
        buf: Tensor<1>,
        in_place: bool,
    ) -> Result<InFlight<Tensor<1>>, TrainError> {
        #[cfg(feature = "cuda")]
        return self.locked().all_reduce_mean(over, buf, in_place);
        #[cfg(not(feature = "cuda"))]
        {
            let _ = (over, buf, in_place);
            match self.never {}
        }
    }

    #[cfg(feature = "cuda")]
    fn locked(&self) -> std::sync::MutexGuard<'_, cuda::Mesh> {
        // Poisoned only by a panic in a collective's setup; the communicators are still whole.
        self.mesh
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

impl Wire for Nccl {
    fn describe(&self) -> String {
        #[cfg(feature = "cuda")]
        return self.locked().describe();
        #[cfg(not(feature = "cuda"))]
        match self.never {}
    }

    fn all_reduce_mean(
        &self,
        _ranks: Ranks,
        over: Over,
        buf: Tensor<1>,
        in_place: bool,
    ) -> Result<InFlight<Tensor<1>>, TrainError> {
        self.all_reduce(over, buf, in_place)
    }

    fn reduce_scatter_mean(
        &self,
        _ranks: Ranks,
        flat: &Sharded,
        send: Tensor<1>,
    ) -> Result<InFlight<Tensor<1>>, TrainError> {
        #[cfg(feature = "cuda")]
        return self.locked().reduce_scatter_mean(flat, send);
        #[cfg(not(feature = "cuda"))]
        {
            let _ = (flat, send);
            match self.never {}
        }
    }

    fn all_gather(
        &self,
        _ranks: Ranks,
        flat: &Sharded,
        mine: Tensor<1>,
    ) -> Result<InFlight<Tensor<1>>, TrainError> {
        #[cfg(feature = "cuda")]
        return self.locked().all_gather(flat, mine);
        #[cfg(not(feature = "cuda"))]
        {
            let _ = (flat, mine);
            match self.never {}
        }
    }

    fn busy_s(&self) -> f64 {
        #[cfg(feature = "cuda")]
        return self.locked().take_busy_s();
        #[cfg(not(feature = "cuda"))]
        match self.never {}
    }
}

/// On a CUDA device, NCCL joined as a one-rank communicator reduces gradients of several
/// sizes in one flat buffer and hands each back unchanged (the mean over one rank): the
/// library opens, the communicator forms, the device addresses and the views are right.
/// `Ok(None)` off CUDA devices; else the largest relative difference (0 when right).
pub fn check_one_rank(device: &Device) -> Result<Option<f32>, TrainError> {
    use crate::kernels::selfcheck::{host, random, rel_diff};
    let Some(nccl) = Nccl::join(&kiln_dist::Solo, device)? else {
        return Ok(None);
    };
    let data: Vec<Vec<f32>> = [1usize, 300, 4097]
        .iter()
        .zip(70..)
        .map(|(&n, seed)| random(n, seed, burn::tensor::FloatDType::F32))
        .collect();
    let grads = data
        .iter()
        .map(|x| {
            Tensor::<1>::from_data(burn::tensor::TensorData::new(x.clone(), [x.len()]), device)
        })
        .collect();
    let back = nccl.mean(grads)?;
    Ok(Some(
        back.iter().zip(&data).fold(0.0f32, |worst, (got, want)| {
            worst.max(rel_diff(&host(got), want))
        }),
    ))
}

/// What [`check_ranks`] measured: the largest relative difference from the known answer of
/// each collective (0 when exact).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RanksCheck {
    /// Ranks that took part.
    pub ranks: usize,
    /// The all-reduce mean.
    pub all_reduce: f32,
    /// The reduce-scatter mean.
    pub reduce_scatter: f32,
    /// The all-gather.
    pub all_gather: f32,
}

impl RanksCheck {
    /// Whether every collective gave the known answer (the means within f32 rounding of a
    /// division by the rank count, the all-gather exactly).
    pub fn passed(&self) -> bool {
        self.all_reduce <= 1e-6 && self.reduce_scatter <= 1e-6 && self.all_gather == 0.0
    }
}

/// Every rank of `comm` (a collective: all call it) joins NCCL on `device` and runs each
/// collective kiln uses on known values (rank `r` holds `(r + 1) x (i % 7 + 1)` at `i`, over
/// an odd number of elements so that the shards are padded; about 4 MiB a buffer):
/// `Ok(None)` off CUDA devices. What `kiln doctor --device cuda` runs under `kiln launch`
/// before a long run trusts NCCL across its ranks.
pub fn check_ranks(
    comm: &dyn Collective,
    device: &Device,
) -> Result<Option<RanksCheck>, TrainError> {
    use crate::tensor::{from_vec, to_vec};
    let ranks = Ranks::replicated(comm);
    let Some(nccl) = Nccl::join_mesh(ranks, device)? else {
        return Ok(None);
    };
    let (n, size, rank) = (1usize << 20 | 3, comm.size(), comm.rank());
    let base = |i: usize| (i % 7 + 1) as f32;
    let mine: Vec<f32> = (0..n).map(|i| (rank + 1) as f32 * base(i)).collect();
    // The mean over ranks of (r + 1) x b is b x (size + 1) / 2.
    let mean = |i: usize| base(i) * (size + 1) as f32 / 2.0;
    let worst = |got: &[f32], want: &dyn Fn(usize) -> f32| {
        got.iter().enumerate().fold(0.0f32, |w, (i, &g)| {
            let want = want(i);
            w.max((g - want).abs() / want.abs().max(1e-30))
        })
    };
    let reduced = (nccl.all_reduce(Over::Dp, from_vec(mine.clone(), device), false)?).wait()?;
    let all_reduce = worst(&to_vec(&reduced), &mean);
    let flat = Sharded::new(n, size, 1 << 20);
    let padded = {
        let mut v = mine.clone();
        v.resize(size * flat.shard, 0.0);
        from_vec(v, device)
    };
    let shard = nccl.reduce_scatter_mean(ranks, &flat, padded)?.wait()?;
    let range = flat.range(rank);
    let got = to_vec(&shard);
    let reduce_scatter = worst(&got[..range.len()], &|i| mean(range.start + i)).max(
        got[range.len()..]
            .iter()
            .fold(0.0f32, |w, v| w.max(v.abs())),
    );
    let own = from_vec(
        mine[range.clone()]
            .iter()
            .copied()
            .chain(std::iter::repeat_n(0.0, flat.shard - range.len()))
            .collect(),
        device,
    );
    let whole = nccl.all_gather(ranks, &flat, own)?.wait()?;
    // Rank q's shard holds (q + 1) x b: every element's owner is i / shard.
    let got = to_vec(&whole);
    let all_gather = worst(&got[..n], &|i| (i / flat.shard + 1) as f32 * base(i));
    Ok(Some(RanksCheck {
        ranks: size,
        all_reduce,
        reduce_scatter,
        all_gather,
    }))
}

#[cfg(feature = "cuda")]
mod cuda {
    use super::*;
    use burn::backend::{Cube, DispatchDevice};
    use burn::tensor::DType;
    use burn_cubecl::ops::numeric::empty_device_contiguous_dtype;
    use burn_cubecl::tensor::CubeTensor;
    use cubecl::cuda::CudaRuntime;
    use cubecl_runtime::runtime::Runtime;
    use cudarc::driver::result as driver;
    use cudarc::driver::sys::{CUevent, CUevent_flags, CUevent_wait_flags, CUstream};
    use cudarc::nccl::{result as nccl, sys};
    use std::ffi::c_void;

    type Server = <CudaRuntime as Runtime>::Server;

    /// Bytes of NCCL's unique id, then one status byte (1: rank 0 minted it).
    const ID_BYTES: usize = 128;

    fn error(what: impl std::fmt::Display) -> TrainError {
        TrainError::Device("cuda".into(), format!("NCCL: {what}"))
    }

    fn failed(what: &str, e: impl std::fmt::Debug) -> TrainError {
        TrainError::Collective(format!("NCCL {what}: {e:?}"))
    }

    /// The ordinal of `device` when it is a CUDA device.
    fn ordinal(device: &Device) -> Option<usize> {
        match device.as_dispatch().clone().inner() {
            DispatchDevice::Cube(cubecl::Device::Cuda(d)) => Some(d.index),
            _ => None,
        }
    }

    /// NCCL's unique id, minted by rank 0 and broadcast over `comm`; an error on every rank
    /// when rank 0 could not mint one (so none waits for a communicator that never forms).
    fn shared_id(comm: &dyn Collective) -> Result<sys::ncclUniqueId, TrainError> {
        let mut buf = [0u8; ID_BYTES + 1];
        let mut minted = Err(String::new());
        if comm.rank() == 0 {
            minted = nccl::get_uniqueid().map_err(|e| format!("{e:?}"));
            if let Ok(id) = &minted {
                for (b, c) in buf.iter_mut().zip(id.internal) {
                    *b = c as u8;
                }
                buf[ID_BYTES] = 1;
            }
        }
        comm.broadcast_bytes(0, &mut buf);
        if buf[ID_BYTES] != 1 {
            let why = minted.err().unwrap_or_default();
            return Err(error(format!("rank 0 could not mint a unique id {why}")));
        }
        let mut id = sys::ncclUniqueId {
            internal: [0; ID_BYTES],
        };
        for (c, b) in id.internal.iter_mut().zip(buf) {
            *c = b as std::ffi::c_char;
        }
        Ok(id)
    }

    /// One NCCL communicator.
    struct Comm {
        comm: sys::ncclComm_t,
        ranks: usize,
    }

    impl Comm {
        /// Joins the ranks of `comm` (every one of them calls it).
        fn join(comm: &dyn Collective) -> Result<Self, TrainError> {
            let id = shared_id(comm)?;
            let mut handle = std::mem::MaybeUninit::uninit();
            // SAFETY: `handle` is written by a successful init, which `assume_init` follows.
            unsafe {
                nccl::comm_init_rank(
                    handle.as_mut_ptr(),
                    comm.size() as i32,
                    id,
                    comm.rank() as i32,
                )
                .map_err(|e| error(format!("joining {} ranks: {e:?}", comm.size())))?;
                Ok(Self {
                    comm: handle.assume_init(),
                    ranks: comm.size(),
                })
            }
        }
    }

    impl Drop for Comm {
        fn drop(&mut self) {
            // SAFETY: created by `join`, not used after this.
            unsafe {
                let _ = nccl::comm_destroy(self.comm);
            }
        }
    }

    /// The communicators of a run and the stream their collectives run on.
    pub(super) struct Mesh {
        job: Comm,
        /// Over the replica's ranks, when they are not the job's.
        shard: Option<Comm>,
        /// Over the ranks holding this shard in the other replicas, when there are others.
        replica: Option<Comm>,
        /// Timing events around each collective queued since [`Mesh::take_busy_s`].
        timed: Vec<(CUevent, CUevent)>,
        /// Dropped after the communicators (field order).
        stream: Stream,
    }

    struct Stream(CUstream);

    impl Drop for Stream {
        fn drop(&mut self) {
            // SAFETY: created by `Mesh::join`; the communicators using it are gone.
            unsafe {
                let _ = driver::stream::destroy(self.0);
            }
        }
    }

    // SAFETY: communicators and streams are handles any thread may use, provided calls on
    // them do not overlap; `Nccl` keeps its `Mesh` behind a mutex, which serialises them.
    unsafe impl Send for Mesh {}

    impl Mesh {
        pub(super) fn join(ranks: Ranks, device: &Device) -> Result<Option<Self>, TrainError> {
            let Some(ordinal) = ordinal(device) else {
                return Ok(None);
            };
            // SAFETY: only probes for the library (dlopen), calls nothing in it.
            let present = unsafe { sys::is_culib_present() };
            // Every rank learns whether any lacks the library, so none waits for the others
            // in a communicator that never forms.
            let mut missing = [u64::from(!present)];
            ranks.dp.all_reduce_max_u64(&mut missing);
            if missing[0] != 0 {
                return Err(error(
                    "its library was not found as libnccl.so (or libnccl.so.<CUDA major>) on \
                     every rank: install NCCL (a CUDA toolkit's, or pip's nvidia-nccl-cu13) and \
                     put a directory holding a libnccl.so link to its libnccl.so.2 on \
                     LD_LIBRARY_PATH",
                ));
            }
            // NCCL works on the thread's current context: CubeCL's, the device's primary one.
            driver::init().map_err(|e| error(format!("CUDA driver: {e:?}")))?;
            let dev = driver::device::get(ordinal as i32)
                .map_err(|e| error(format!("CUDA device {ordinal}: {e:?}")))?;
            // SAFETY: `dev` is a device the driver just returned; the primary context it
            // retains lives as long as the process (CubeCL retains the same one).
            unsafe {
                let ctx = driver::primary_ctx::retain(dev).map_err(|e| error(format!("{e:?}")))?;
                driver::ctx::set_current(ctx).map_err(|e| error(format!("{e:?}")))?;
            }
            let stream = Stream(
                driver::stream::create(driver::stream::StreamKind::NonBlocking)
                    .map_err(|e| error(format!("stream: {e:?}")))?,
            );
            let job = Comm::join(ranks.dp)?;
            let shard = (ranks.shard.size() != ranks.dp.size())
                .then(|| Comm::join(ranks.shard))
                .transpose()?;
            let replica = (ranks.replica.size() > 1)
                .then(|| Comm::join(ranks.replica))
                .transpose()?;
            let mesh = Self {
                job,
                shard,
                replica,
                timed: Vec::new(),
                stream,
            };
            tracing::info!(
                version = nccl::get_nccl_version().unwrap_or(0),
                ranks = ranks.dp.size(),
                "collectives on the device over NCCL: {}",
                mesh.describe()
            );
            Ok(Some(mesh))
        }

        pub(super) fn describe(&self) -> String {
            let version = nccl::get_nccl_version().unwrap_or(0);
            let mut s = format!("NCCL {version} on the device, {} ranks", self.job.ranks);
            if let (Some(sh), Some(r)) = (&self.shard, &self.replica) {
                s += &format!(" ({} replicas of {})", r.ranks, sh.ranks);
            }
            s
        }

        /// The communicator over the ranks a state is cut over.
        fn shards(&self) -> &Comm {
            self.shard.as_ref().unwrap_or(&self.job)
        }

        /// Queues `call` on NCCL's stream after the work CubeCL has queued on this thread's
        /// stream, with the device addresses of `bufs`; what waits for it.
        fn queue(
            &mut self,
            bufs: &[&CubeTensor],
            call: impl FnOnce(&[*mut c_void], CUstream) -> Result<(), TrainError>,
        ) -> Result<Queued, TrainError> {
            let resources = bufs
                .iter()
                .map(|t| t.client.get_resource::<Server>(t.handle.clone()))
                .collect::<Result<Vec<_>, _>>()
                .map_err(|e| failed("buffer", e))?;
            let cube = resources
                .first()
                .map_or(std::ptr::null_mut(), |r| r.resource().stream);
            if cube.is_null() {
                return Err(failed(
                    "stream",
                    "the CUDA server reported none (an unpatched cubecl-cuda)",
                ));
            }
            let ptrs: Vec<*mut c_void> = resources
                .iter()
                .map(|r| r.resource().ptr as *mut c_void)
                .collect();
            let ready = event()?;
            // SAFETY: `cube` is CubeCL's live stream for this thread, `self.stream` ours, the
            // event new; destroying a recorded event frees it once it has fired.
            unsafe {
                driver::event::record(ready, cube).map_err(|e| failed("event", e))?;
                let waited = driver::stream::wait_event(
                    self.stream.0,
                    ready,
                    CUevent_wait_flags::CU_EVENT_WAIT_DEFAULT,
                );
                let _ = driver::event::destroy(ready);
                waited.map_err(|e| failed("wait", e))?;
            }
            // Timed: when NCCL's stream starts the call and when it is done.
            let start = timing_event()?;
            // SAFETY: as above.
            unsafe { driver::event::record(start, self.stream.0) }
                .map_err(|e| failed("event", e))?;
            call(&ptrs, self.stream.0)?;
            let end = timing_event()?;
            let done = event()?;
            // SAFETY: as above.
            unsafe {
                driver::event::record(end, self.stream.0).map_err(|e| failed("event", e))?;
                driver::event::record(done, self.stream.0).map_err(|e| failed("event", e))?;
            }
            self.timed.push((start, end));
            drop(resources);
            Ok(Queued {
                done,
                keep: bufs.iter().map(|t| (*t).clone()).collect(),
            })
        }

        pub(super) fn all_reduce_mean(
            &mut self,
            over: Over,
            buf: Tensor<1>,
            in_place: bool,
        ) -> Result<InFlight<Tensor<1>>, TrainError> {
            let (c, ranks) = match over {
                Over::Dp => (self.job.comm, self.job.ranks),
                Over::Replica => match &self.replica {
                    Some(r) => (r.comm, r.ranks),
                    None => return Ok(InFlight::ready(buf)),
                },
            };
            let (send, ty) = buffer(buf)?;
            let n = send.meta.shape()[0];
            // In place when the buffer is the caller's own (a packed bucket): no second one.
            let out = if in_place {
                send.clone()
            } else {
                empty(&send, n)
            };
            let q = self.queue(&[&send, &out], |p, s| {
                // SAFETY: `n` live elements of `ty` each (contiguous buffers kept by `Queued`
                // until CubeCL's stream has waited for this call; the same one in place).
                unsafe { nccl::all_reduce(p[0], p[1], n, ty, sys::ncclRedOp_t::ncclSum, c, s as _) }
                    .map(drop)
                    .map_err(|e| failed("all-reduce", e))
            })?;
            Ok(q.then(out, 1.0 / ranks as f64))
        }

        pub(super) fn reduce_scatter_mean(
            &mut self,
            flat: &Sharded,
            send: Tensor<1>,
        ) -> Result<InFlight<Tensor<1>>, TrainError> {
            let (send, ty) = buffer(send)?;
            let n = flat.shard;
            let out = empty(&send, n);
            let (sc, shards) = (self.shards().comm, self.shards().ranks);
            let rc = self.replica.as_ref().map(|r| r.comm);
            let replicas = self.replica.as_ref().map_or(1, |r| r.ranks);
            let q = self.queue(&[&send, &out], |p, s| {
                // SAFETY: `send` holds `ranks x n` elements, `out` `n`, both kept by `Queued`.
                unsafe {
                    let sum = sys::ncclRedOp_t::ncclSum;
                    nccl::reduce_scatter(p[0], p[1], n, ty, sum, sc, s as _)
                        .map_err(|e| failed("reduce-scatter", e))?;
                    if let Some(rc) = rc {
                        nccl::all_reduce(p[1], p[1], n, ty, sum, rc, s as _)
                            .map_err(|e| failed("all-reduce over replicas", e))?;
                    }
                }
                Ok(())
            })?;
            Ok(q.then(out, 1.0 / (shards * replicas) as f64))
        }

        pub(super) fn all_gather(
            &mut self,
            flat: &Sharded,
            mine: Tensor<1>,
        ) -> Result<InFlight<Tensor<1>>, TrainError> {
            let (mine, ty) = buffer(mine)?;
            let n = flat.shard;
            let (c, shards) = (self.shards().comm, self.shards().ranks);
            let out = empty(&mine, shards * n);
            let q = self.queue(&[&mine, &out], |p, s| {
                // SAFETY: `mine` holds `n` elements, `out` `ranks x n`, both kept by `Queued`.
                unsafe { nccl::all_gather(p[0], p[1], n, ty, c, s as _) }
                    .map(drop)
                    .map_err(|e| failed("all-gather", e))
            })?;
            Ok(q.then(out, 1.0))
        }
    }

    fn event() -> Result<CUevent, TrainError> {
        driver::event::create(CUevent_flags::CU_EVENT_DISABLE_TIMING)
            .map_err(|e| failed("event", e))
    }

    fn timing_event() -> Result<CUevent, TrainError> {
        driver::event::create(CUevent_flags::CU_EVENT_DEFAULT).map_err(|e| failed("event", e))
    }

    impl Mesh {
        /// Seconds NCCL's stream spent in the collectives queued since the last call: waits
        /// for the last of them (the host reads the step's loss and norm right after anyway).
        pub(super) fn take_busy_s(&mut self) -> f64 {
            let Some(&(_, last)) = self.timed.last() else {
                return 0.0;
            };
            // SAFETY: the events were created and recorded by `queue`, destroyed once here.
            unsafe {
                let _ = driver::event::synchronize(last);
                let mut ms = 0.0f64;
                for (start, end) in self.timed.drain(..) {
                    ms += f64::from(driver::event::elapsed(start, end).unwrap_or(0.0));
                    let _ = driver::event::destroy(start);
                    let _ = driver::event::destroy(end);
                }
                ms / 1e3
            }
        }
    }

    /// `t`'s contiguous CubeCL buffer and its NCCL type.
    fn buffer(t: Tensor<1>) -> Result<(CubeTensor, sys::ncclDataType_t), TrainError> {
        let prim = t
            .try_into_primitive::<Cube>()
            .map_err(|_| failed("input", "the tensor is not on a CubeCL device"))?;
        let prim = burn_cubecl::kernel::into_contiguous(prim);
        let ty = match prim.dtype {
            DType::F32 => sys::ncclDataType_t::ncclFloat32,
            DType::BF16 => sys::ncclDataType_t::ncclBfloat16,
            other => return Err(failed("input", format!("tensors of type {other:?}"))),
        };
        Ok((prim, ty))
    }

    /// A new contiguous buffer of `n` elements of `like`'s type on its device.
    fn empty(like: &CubeTensor, n: usize) -> CubeTensor {
        empty_device_contiguous_dtype(
            like.client.clone(),
            like.device.clone(),
            [n].into(),
            like.dtype,
        )
    }

    /// A queued collective: the event after it and the buffers it reads and writes, kept
    /// until CubeCL's stream waits for the event (on [`Queued::release`], or when dropped).
    struct Queued {
        done: CUevent,
        keep: Vec<CubeTensor>,
    }

    impl Queued {
        /// Makes this thread's CubeCL stream wait for the collective (once).
        fn release(&mut self) -> Result<(), TrainError> {
            if self.done.is_null() {
                return Ok(());
            }
            let Some(t) = self.keep.first() else {
                return Ok(());
            };
            let r = t
                .client
                .get_resource::<Server>(t.handle.clone())
                .map_err(|e| failed("buffer", e))?;
            let cube = r.resource().stream;
            // SAFETY: `cube` is CubeCL's live stream for this thread; `done` was recorded on
            // ours and is destroyed once (a pending event is freed when it fires).
            unsafe {
                driver::stream::wait_event(
                    cube,
                    self.done,
                    CUevent_wait_flags::CU_EVENT_WAIT_DEFAULT,
                )
                .map_err(|e| failed("wait", e))?;
                let _ = driver::event::destroy(self.done);
            }
            self.done = std::ptr::null_mut();
            Ok(())
        }

        /// The result `out` times `scale`, once CubeCL's stream waited for the collective.
        fn then(self, out: CubeTensor, scale: f64) -> InFlight<Tensor<1>> {
            let mut q = self;
            InFlight::later(move || {
                q.release()?;
                drop(q);
                let out = Tensor::<1>::from_primitive::<Cube>(out);
                Ok(if scale == 1.0 {
                    out
                } else {
                    out.mul_scalar(scale)
                })
            })
        }
    }

    impl Drop for Queued {
        fn drop(&mut self) {
            if let Err(e) = self.release() {
                // CubeCL could reuse the buffers while NCCL still works on them: never
                // hand them back.
                tracing::error!(
                    "an NCCL collective was not waited for ({e}); its buffers are leaked"
                );
                std::mem::forget(std::mem::take(&mut self.keep));
            }
        }
    }
}

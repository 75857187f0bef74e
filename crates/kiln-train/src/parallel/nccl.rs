//! The gradient average on CUDA devices over NCCL: the gradients stay on the GPU, one
//! all-reduce over a flat device buffer, instead of a copy to host memory, MPI and a copy back.
//!
//! Rank 0 mints NCCL's unique id and kiln's MPI broadcasts it (the job's ranks are already an
//! MPI world, so no second rendezvous is needed); each rank joins with the GPU its device names
//! (`CUDA_VISIBLE_DEVICES` leaves one per rank, see kiln-launch). The all-reduce reads and
//! writes the buffer CubeCL allocated, through its raw device address, on a stream of kiln's
//! own: CubeCL's queue is drained first and NCCL's stream is waited on after, so both see the
//! buffer whole. NCCL's ring gives every rank the same bits, and the same calls in every run
//! give the same bits again (exact resume), as the host path's fixed buckets do.
//!
//! Every other backend stages the gradients through host memory over MPI (`Step::average`),
//! as do the sharded modes for now (their reduce-scatter and all-gather over NCCL are the
//! sharding issue's).

use crate::error::TrainError;
use burn::tensor::{Device, Tensor};
use kiln_dist::Collective;

/// An NCCL communicator over every rank of the job, on this rank's CUDA device.
pub struct Nccl {
    #[cfg(feature = "cuda")]
    comm: std::sync::Mutex<cuda::Comm>,
    #[cfg(not(feature = "cuda"))]
    never: std::convert::Infallible,
}

impl Nccl {
    /// Joins every rank of `comm` (a collective: every rank calls it) when `device` is a CUDA
    /// device; `None` on other devices, or in a kiln built without CUDA.
    pub fn join(comm: &dyn Collective, device: &Device) -> Result<Option<Self>, TrainError> {
        #[cfg(feature = "cuda")]
        return Ok(cuda::Comm::join(comm, device)?.map(|c| Self {
            comm: std::sync::Mutex::new(c),
        }));
        #[cfg(not(feature = "cuda"))]
        {
            let _ = (comm, device);
            Ok(None)
        }
    }

    /// The mean over the ranks of each of `grads` (f32 or bf16, on this rank's device).
    pub fn mean(&self, grads: Vec<Tensor<1>>) -> Result<Vec<Tensor<1>>, TrainError> {
        #[cfg(feature = "cuda")]
        {
            let comm = self
                .comm
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            comm.mean(grads)
        }
        #[cfg(not(feature = "cuda"))]
        {
            let _ = grads;
            match self.never {}
        }
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

#[cfg(feature = "cuda")]
mod cuda {
    use super::*;
    use burn::backend::{Cube, DispatchDevice};
    use burn::tensor::DType;
    use cubecl::cuda::CudaRuntime;
    use cubecl_runtime::runtime::Runtime;
    use cudarc::driver::result as driver;
    use cudarc::nccl::{result as nccl, sys};
    use std::ffi::c_void;

    /// Bytes of NCCL's unique id, then one status byte (1: rank 0 minted it).
    const ID_BYTES: usize = 128;

    /// An NCCL communicator and the stream its collectives run on.
    pub(super) struct Comm {
        comm: sys::ncclComm_t,
        stream: cudarc::driver::sys::CUstream,
        ranks: usize,
    }

    // SAFETY: a communicator and a stream are handles any thread may use, provided calls on
    // them do not overlap; `Nccl` keeps its `Comm` behind a mutex, which serialises them.
    unsafe impl Send for Comm {}

    impl Drop for Comm {
        fn drop(&mut self) {
            // SAFETY: both were created by `join` and are not used after this.
            unsafe {
                let _ = nccl::comm_destroy(self.comm);
                let _ = driver::stream::destroy(self.stream);
            }
        }
    }

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

    impl Comm {
        pub(super) fn join(
            comm: &dyn Collective,
            device: &Device,
        ) -> Result<Option<Self>, TrainError> {
            let Some(ordinal) = ordinal(device) else {
                return Ok(None);
            };
            // SAFETY: only probes for the library (dlopen), calls nothing in it.
            if !unsafe { sys::is_culib_present() } {
                return Err(error(
                    "its library was not found as libnccl.so (or libnccl.so.<CUDA major>): install NCCL \
                     (a CUDA toolkit's, or pip's nvidia-nccl-cu13) and put a directory holding a \
                     libnccl.so link to its libnccl.so.2 on LD_LIBRARY_PATH",
                ));
            }
            let id = shared_id(comm)?;
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
            let stream = driver::stream::create(driver::stream::StreamKind::NonBlocking)
                .map_err(|e| error(format!("stream: {e:?}")))?;
            let mut handle = std::mem::MaybeUninit::uninit();
            // SAFETY: `handle` is written by a successful init, which `assume_init` follows.
            let joined = unsafe {
                nccl::comm_init_rank(
                    handle.as_mut_ptr(),
                    comm.size() as i32,
                    id,
                    comm.rank() as i32,
                )
            };
            if let Err(e) = joined {
                // SAFETY: created above, not used again.
                unsafe {
                    let _ = driver::stream::destroy(stream);
                }
                return Err(error(format!("joining {} ranks: {e:?}", comm.size())));
            }
            let version = nccl::get_nccl_version().unwrap_or(0);
            tracing::info!(
                version,
                ranks = comm.size(),
                "gradients all-reduced on the device over NCCL"
            );
            Ok(Some(Self {
                // SAFETY: the init succeeded.
                comm: unsafe { handle.assume_init() },
                stream,
                ranks: comm.size(),
            }))
        }

        /// One all-reduce (sum) of every gradient, flattened into one device buffer, then the
        /// same scaling by 1/ranks as the host path.
        pub(super) fn mean(&self, grads: Vec<Tensor<1>>) -> Result<Vec<Tensor<1>>, TrainError> {
            let lengths: Vec<usize> = grads.iter().map(|g| g.dims()[0]).collect();
            let flat = Tensor::cat(grads, 0);
            let count = flat.dims()[0];
            let prim = flat
                .clone()
                .try_into_primitive::<Cube>()
                .map_err(|_| failed("input", "the gradients are not on a CubeCL device"))?;
            let dtype = match prim.dtype {
                DType::F32 => sys::ncclDataType_t::ncclFloat32,
                DType::BF16 => sys::ncclDataType_t::ncclBfloat16,
                other => return Err(failed("input", format!("gradients of type {other:?}"))),
            };
            // The kernels that wrote the gradients have finished.
            cubecl::future::block_on(prim.client.sync()).map_err(|e| failed("sync", e))?;
            let resource = prim
                .client
                .get_resource::<<CudaRuntime as Runtime>::Server>(prim.handle.clone())
                .map_err(|e| failed("buffer", e))?;
            let ptr = resource.resource().ptr as *mut c_void;
            // SAFETY: `ptr` is `count` live elements of `dtype` (the contiguous buffer `cat`
            // just wrote, kept in place by `resource`), reduced in place on this
            // communicator's stream, which is waited on before the buffer is used again.
            unsafe {
                nccl::all_reduce(
                    ptr,
                    ptr,
                    count,
                    dtype,
                    sys::ncclRedOp_t::ncclSum,
                    self.comm,
                    self.stream as _,
                )
                .map_err(|e| failed("all-reduce", e))?;
                driver::stream::synchronize(self.stream).map_err(|e| failed("wait", e))?;
            }
            drop(resource);
            let flat = flat.mul_scalar(1.0 / self.ranks as f64);
            let mut at = 0;
            Ok(lengths
                .into_iter()
                .map(|n| {
                    at += n;
                    flat.clone().slice(at - n..at)
                })
                .collect())
        }
    }
}

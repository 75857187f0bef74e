//! RCCL on ROCm devices: the [`Wire`] under [`super::collective::OnDevice`] when a run's ranks
//! are on ROCm devices, as NCCL is on CUDA ([`super::nccl`]). RCCL is AMD's implementation of
//! NCCL's C API (the same functions, types and values, on HIP streams), so kiln opens
//! `librccl.so` at run time ([`libloading`]) and calls it by that API; nothing of ROCm is needed
//! to build.
//!
//! Chosen once per run ([`super::collective::choose`]): on ROCm devices with several ranks,
//! when every rank opens the library; when any rank does not, every rank logs why and the run
//! takes host-staged MPI (the fallback, the same bits as without RCCL). Rank 0 of each group
//! mints RCCL's unique id and kiln's MPI broadcasts it; each rank joins with the GPU its device
//! names, as over NCCL.
//!
//! **Ordering by synchronising.** CubeCL's HIP runtime does not name the stream a buffer was
//! written on (the patch that does so for CUDA, `patches/cubecl-cuda`, has no HIP twin), so
//! each collective waits for all of CubeCL's work on the device, runs on a stream of kiln's
//! own and is waited for before the result is handed back: correct, without the overlap NCCL's
//! events give (a step's collectives block the host). Nothing here has run on an AMD GPU.

use super::wire::{InFlight, Over, Ranks, Wire};
use crate::error::TrainError;
use burn::tensor::{Device, Tensor};
use kiln_dist::{Collective, Sharded};
use std::ffi::OsString;
use std::path::PathBuf;

/// Names the RCCL library to open (a path, or a name `dlopen` looks up), instead of the
/// default candidates.
pub const LIBRARY_VAR: &str = "KILN_RCCL_LIBRARY";

/// What [`Rccl`] opens, in order: [`LIBRARY_VAR`] alone when set; else `librccl.so` under
/// `$ROCM_PATH/lib` and `/opt/rocm/lib`, then `librccl.so` and `librccl.so.1` as `dlopen` finds
/// them (`LD_LIBRARY_PATH`, the loader's cache). `env` is the process environment's `var_os`.
pub fn library_candidates(env: &dyn Fn(&str) -> Option<OsString>) -> Vec<PathBuf> {
    if let Some(chosen) = env(LIBRARY_VAR).filter(|v| !v.is_empty()) {
        return vec![PathBuf::from(chosen)];
    }
    let roots = env("ROCM_PATH")
        .filter(|v| !v.is_empty())
        .map(PathBuf::from)
        .into_iter()
        .chain([PathBuf::from("/opt/rocm")]);
    roots
        .map(|root| root.join("lib/librccl.so"))
        .chain(["librccl.so", "librccl.so.1"].map(PathBuf::from))
        .collect()
}

/// The error when no candidate opened: each one tried, with why it did not open.
pub fn not_found(tried: &[(PathBuf, String)]) -> String {
    let tried: Vec<String> = tried
        .iter()
        .map(|(path, why)| format!("{} ({why})", path.display()))
        .collect();
    format!(
        "RCCL was not found: tried {}. Install ROCm's RCCL (librccl.so under $ROCM_PATH/lib), \
         put its directory on LD_LIBRARY_PATH, or set {LIBRARY_VAR} to the library",
        tried.join(", ")
    )
}

/// Whether every rank of `comm` has the library (`opened` is this rank's attempt); a
/// collective: every rank calls it. `Err` on every rank when any lacks it, this rank's reason
/// or that another rank had none, so that no rank waits for a communicator that never forms.
pub fn agree<L>(comm: &dyn Collective, opened: Result<L, String>) -> Result<L, String> {
    let mut missing = [u64::from(opened.is_err())];
    comm.all_reduce_max_u64(&mut missing);
    match opened {
        Ok(_) if missing[0] != 0 => Err("another rank could not open RCCL".into()),
        other => other,
    }
}

/// RCCL communicators on this rank's ROCm device (see the module documentation).
pub struct Rccl {
    #[cfg(feature = "rocm")]
    mesh: std::sync::Mutex<hip::Mesh>,
    #[cfg(not(feature = "rocm"))]
    never: std::convert::Infallible,
}

impl Rccl {
    /// Joins every rank of `comm` (a collective: every rank calls it) when `device` is a ROCm
    /// device; `None` on other devices, in a kiln built without ROCm, or without RCCL.
    pub fn join(comm: &dyn Collective, device: &Device) -> Result<Option<Self>, TrainError> {
        Self::join_mesh(Ranks::replicated(comm), device)
    }

    /// Joins the communicators of `ranks` (the job's; the replica's and the shard's where they
    /// are other ranks) when `device` is a ROCm device and every rank opens RCCL; `None` on
    /// other devices, in a kiln built without ROCm, or (logged) when a rank has no RCCL.
    pub fn join_mesh(ranks: Ranks, device: &Device) -> Result<Option<Self>, TrainError> {
        #[cfg(feature = "rocm")]
        return Ok(hip::Mesh::join(ranks, device)?.map(|m| Self {
            mesh: std::sync::Mutex::new(m),
        }));
        #[cfg(not(feature = "rocm"))]
        {
            let _ = (ranks, device);
            Ok(None)
        }
    }

    #[cfg(feature = "rocm")]
    fn locked(&self) -> std::sync::MutexGuard<'_, hip::Mesh> {
        // Poisoned only by a panic in a collective; the communicators are still whole.
        self.mesh
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

impl Wire for Rccl {
    fn describe(&self) -> String {
        #[cfg(feature = "rocm")]
        return self.locked().describe();
        #[cfg(not(feature = "rocm"))]
        match self.never {}
    }

    fn all_reduce_mean(
        &self,
        _ranks: Ranks,
        over: Over,
        buf: Tensor<1>,
        _in_place: bool,
    ) -> Result<InFlight<Tensor<1>>, TrainError> {
        #[cfg(feature = "rocm")]
        return self.locked().all_reduce_mean(over, buf);
        #[cfg(not(feature = "rocm"))]
        {
            let _ = (over, buf);
            match self.never {}
        }
    }

    fn reduce_scatter_mean(
        &self,
        _ranks: Ranks,
        flat: &Sharded,
        send: Tensor<1>,
    ) -> Result<InFlight<Tensor<1>>, TrainError> {
        #[cfg(feature = "rocm")]
        return self.locked().reduce_scatter_mean(flat, send);
        #[cfg(not(feature = "rocm"))]
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
        #[cfg(feature = "rocm")]
        return self.locked().all_gather(flat, mine);
        #[cfg(not(feature = "rocm"))]
        {
            let _ = (flat, mine);
            match self.never {}
        }
    }
}

/// RCCL's library, opened by [`library_candidates`]: `Err` naming each candidate tried.
#[cfg(feature = "rocm")]
pub fn open_library() -> Result<hip::Library, String> {
    hip::Library::open(&library_candidates(&|var| std::env::var_os(var)))
}

#[cfg(feature = "rocm")]
pub mod hip {
    //! The library's functions and the communicators, on HIP.

    use super::*;
    use burn::backend::{Cube, DispatchDevice};
    use burn::tensor::DType;
    use burn_cubecl::ops::numeric::empty_device_contiguous_dtype;
    use burn_cubecl::tensor::CubeTensor;
    use cubecl::hip::HipRuntime;
    use cubecl_hip_sys as sys;
    use cubecl_runtime::runtime::Runtime;
    use std::ffi::{c_char, c_int, c_void};
    use std::path::Path;

    type Server = <HipRuntime as Runtime>::Server;

    /// Bytes of NCCL's (and RCCL's) unique id.
    const ID_BYTES: usize = 128;

    #[repr(C)]
    #[derive(Clone, Copy)]
    struct UniqueId {
        internal: [c_char; ID_BYTES],
    }

    type Comm = *mut c_void;
    type Stream = sys::hipStream_t;
    /// `ncclResult_t`; 0 is success.
    type Status = c_int;
    /// `ncclDataType_t` values (NCCL's, which RCCL keeps).
    const FLOAT32: c_int = 7;
    const BFLOAT16: c_int = 9;
    /// `ncclRedOp_t`'s `ncclSum`.
    const SUM: c_int = 0;

    type AllReduce = unsafe extern "C" fn(
        *const c_void,
        *mut c_void,
        usize,
        c_int,
        c_int,
        Comm,
        Stream,
    ) -> Status;
    type AllGather =
        unsafe extern "C" fn(*const c_void, *mut c_void, usize, c_int, Comm, Stream) -> Status;

    /// RCCL's functions (NCCL's C API), resolved when the library opens.
    pub struct Library {
        get_version: unsafe extern "C" fn(*mut c_int) -> Status,
        get_unique_id: unsafe extern "C" fn(*mut UniqueId) -> Status,
        comm_init_rank: unsafe extern "C" fn(*mut Comm, c_int, UniqueId, c_int) -> Status,
        comm_destroy: unsafe extern "C" fn(Comm) -> Status,
        all_reduce: AllReduce,
        reduce_scatter: AllReduce,
        all_gather: AllGather,
        error_string: unsafe extern "C" fn(Status) -> *const c_char,
        /// Keeps the functions above loaded; dropped last.
        _lib: libloading::Library,
    }

    impl Library {
        /// The first of `candidates` that opens and has NCCL's functions.
        pub fn open(candidates: &[PathBuf]) -> Result<Self, String> {
            let mut tried = Vec::new();
            for path in candidates {
                match Self::open_one(path) {
                    Ok(lib) => return Ok(lib),
                    Err(why) => tried.push((path.clone(), why)),
                }
            }
            Err(not_found(&tried))
        }

        fn open_one(path: &Path) -> Result<Self, String> {
            // SAFETY: loading RCCL runs its initialisers, which have no preconditions; the
            // symbols are NCCL's C API, declared with its signatures above.
            unsafe {
                let lib = libloading::Library::new(path).map_err(|e| e.to_string())?;
                macro_rules! sym {
                    ($name:literal) => {
                        *lib.get($name).map_err(|e| e.to_string())?
                    };
                }
                Ok(Self {
                    get_version: sym!(b"ncclGetVersion\0"),
                    get_unique_id: sym!(b"ncclGetUniqueId\0"),
                    comm_init_rank: sym!(b"ncclCommInitRank\0"),
                    comm_destroy: sym!(b"ncclCommDestroy\0"),
                    all_reduce: sym!(b"ncclAllReduce\0"),
                    reduce_scatter: sym!(b"ncclReduceScatter\0"),
                    all_gather: sym!(b"ncclAllGather\0"),
                    error_string: sym!(b"ncclGetErrorString\0"),
                    _lib: lib,
                })
            }
        }

        /// RCCL's version (`NCCL_VERSION_CODE`), 0 if it does not say.
        pub fn version(&self) -> i32 {
            let mut v = 0;
            // SAFETY: writes one int.
            let _ = unsafe { (self.get_version)(&mut v) };
            v
        }

        /// `Ok` for success, else RCCL's message for `status`.
        fn check(&self, what: &str, status: Status) -> Result<(), TrainError> {
            if status == 0 {
                return Ok(());
            }
            // SAFETY: RCCL returns a static NUL-terminated string for any status.
            let text = unsafe {
                let p = (self.error_string)(status);
                if p.is_null() {
                    String::new()
                } else {
                    std::ffi::CStr::from_ptr(p).to_string_lossy().into_owned()
                }
            };
            Err(TrainError::Collective(format!(
                "RCCL {what}: error {status} ({text})"
            )))
        }
    }

    fn device_error(what: impl std::fmt::Display) -> TrainError {
        TrainError::Device("rocm".into(), format!("RCCL: {what}"))
    }

    fn hip_check(what: &str, status: sys::hipError_t) -> Result<(), TrainError> {
        if status == sys::HIP_SUCCESS {
            Ok(())
        } else {
            Err(TrainError::Collective(format!(
                "HIP {what}: error {status}"
            )))
        }
    }

    /// The ordinal of `device` when it is a ROCm device.
    fn ordinal(device: &Device) -> Option<usize> {
        match device.as_dispatch().clone().inner() {
            DispatchDevice::Cube(cubecl::Device::Hip(d)) => Some(d.index),
            _ => None,
        }
    }

    /// One communicator.
    struct Communicator {
        comm: Comm,
        ranks: usize,
    }

    /// The communicators of a run and the stream their collectives run on.
    pub(super) struct Mesh {
        job: Communicator,
        /// Over the replica's ranks, when they are not the job's.
        shard: Option<Communicator>,
        /// Over the ranks holding this shard in the other replicas, when there are others.
        replica: Option<Communicator>,
        stream: Stream,
        lib: Library,
    }

    // SAFETY: communicators and streams are handles any thread may use, provided calls on
    // them do not overlap; `Rccl` keeps its `Mesh` behind a mutex, which serialises them.
    unsafe impl Send for Mesh {}

    impl Drop for Mesh {
        fn drop(&mut self) {
            // SAFETY: created by `join`, not used after this; the communicators go first.
            unsafe {
                for c in [Some(&self.job), self.shard.as_ref(), self.replica.as_ref()]
                    .into_iter()
                    .flatten()
                    .filter(|c| !c.comm.is_null())
                {
                    let _ = (self.lib.comm_destroy)(c.comm);
                }
                let _ = sys::hipStreamDestroy(self.stream);
            }
        }
    }

    impl Mesh {
        pub(super) fn join(ranks: Ranks, device: &Device) -> Result<Option<Self>, TrainError> {
            let Some(ordinal) = ordinal(device) else {
                return Ok(None);
            };
            let lib = match agree(ranks.dp, open_library()) {
                Ok(lib) => lib,
                Err(why) => {
                    tracing::warn!("collectives over host-staged MPI, not RCCL: {why}");
                    return Ok(None);
                }
            };
            // SAFETY: plain HIP calls on this thread's device (CubeCL's for this rank).
            let stream = unsafe {
                hip_check("set device", sys::hipSetDevice(ordinal as c_int))?;
                let mut stream: Stream = std::ptr::null_mut();
                hip_check("stream", sys::hipStreamCreate(&mut stream))?;
                stream
            };
            let mut mesh = Self {
                job: Communicator {
                    comm: std::ptr::null_mut(),
                    ranks: 0,
                },
                shard: None,
                replica: None,
                stream,
                lib,
            };
            mesh.job = mesh.communicator(ranks.dp)?;
            if ranks.shard.size() != ranks.dp.size() {
                mesh.shard = Some(mesh.communicator(ranks.shard)?);
            }
            if ranks.replica.size() > 1 {
                mesh.replica = Some(mesh.communicator(ranks.replica)?);
            }
            tracing::info!(
                version = mesh.lib.version(),
                ranks = ranks.dp.size(),
                "collectives on the device over RCCL: {}",
                mesh.describe()
            );
            Ok(Some(mesh))
        }

        /// Joins the ranks of `comm` (every one of them calls it).
        fn communicator(&self, comm: &dyn Collective) -> Result<Communicator, TrainError> {
            let mut buf = [0u8; ID_BYTES + 1];
            let mut minted = String::new();
            if comm.rank() == 0 {
                let mut id = UniqueId {
                    internal: [0; ID_BYTES],
                };
                // SAFETY: writes one unique id.
                match self
                    .lib
                    .check("unique id", unsafe { (self.lib.get_unique_id)(&mut id) })
                {
                    Ok(()) => {
                        for (b, c) in buf.iter_mut().zip(id.internal) {
                            *b = c as u8;
                        }
                        buf[ID_BYTES] = 1;
                    }
                    Err(e) => minted = e.to_string(),
                }
            }
            comm.broadcast_bytes(0, &mut buf);
            if buf[ID_BYTES] != 1 {
                return Err(device_error(format!(
                    "rank 0 could not mint a unique id {minted}"
                )));
            }
            let mut id = UniqueId {
                internal: [0; ID_BYTES],
            };
            for (c, b) in id.internal.iter_mut().zip(buf) {
                *c = b as c_char;
            }
            let mut handle: Comm = std::ptr::null_mut();
            // SAFETY: `handle` is written by a successful init.
            let status = unsafe {
                (self.lib.comm_init_rank)(
                    &mut handle,
                    comm.size() as c_int,
                    id,
                    comm.rank() as c_int,
                )
            };
            self.lib
                .check(&format!("joining {} ranks", comm.size()), status)?;
            Ok(Communicator {
                comm: handle,
                ranks: comm.size(),
            })
        }

        pub(super) fn describe(&self) -> String {
            let mut s = format!(
                "RCCL {} on the device, {} ranks",
                self.lib.version(),
                self.job.ranks
            );
            if let (Some(sh), Some(r)) = (&self.shard, &self.replica) {
                s += &format!(" ({} replicas of {})", r.ranks, sh.ranks);
            }
            s
        }

        fn shards(&self) -> &Communicator {
            self.shard.as_ref().unwrap_or(&self.job)
        }

        /// Runs `call` with the device addresses of `bufs` once CubeCL's work on the device is
        /// done, and waits for it.
        fn run(
            &self,
            bufs: &[&CubeTensor],
            call: impl FnOnce(&[*mut c_void]) -> Result<(), TrainError>,
        ) -> Result<(), TrainError> {
            let client = &bufs[0].client;
            cubecl::future::block_on(client.sync())
                .map_err(|e| TrainError::Collective(format!("RCCL: CubeCL's sync: {e:?}")))?;
            let resources = bufs
                .iter()
                .map(|t| t.client.get_resource::<Server>(t.handle.clone()))
                .collect::<Result<Vec<_>, _>>()
                .map_err(|e| TrainError::Collective(format!("RCCL buffer: {e:?}")))?;
            let ptrs: Vec<*mut c_void> = resources.iter().map(|r| r.resource().ptr).collect();
            // SAFETY: waits for every stream of this thread's device (CubeCL's included).
            hip_check("device sync", unsafe { sys::hipDeviceSynchronize() })?;
            call(&ptrs)?;
            // SAFETY: our stream, live until the mesh drops.
            hip_check("stream sync", unsafe {
                sys::hipStreamSynchronize(self.stream)
            })?;
            drop(resources);
            Ok(())
        }

        pub(super) fn all_reduce_mean(
            &self,
            over: Over,
            buf: Tensor<1>,
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
            let out = empty(&send, n);
            self.run(&[&send, &out], |p| {
                // SAFETY: `n` elements of `ty` in each live, contiguous buffer.
                let status =
                    unsafe { (self.lib.all_reduce)(p[0], p[1], n, ty, SUM, c, self.stream) };
                self.lib.check("all-reduce", status)
            })?;
            Ok(InFlight::ready(scaled(out, 1.0 / ranks as f64)))
        }

        pub(super) fn reduce_scatter_mean(
            &self,
            flat: &Sharded,
            send: Tensor<1>,
        ) -> Result<InFlight<Tensor<1>>, TrainError> {
            let (send, ty) = buffer(send)?;
            let n = flat.shard;
            let out = empty(&send, n);
            let (sc, shards) = (self.shards().comm, self.shards().ranks);
            let rc = self.replica.as_ref().map(|r| r.comm);
            let replicas = self.replica.as_ref().map_or(1, |r| r.ranks);
            self.run(&[&send, &out], |p| {
                // SAFETY: `send` holds `ranks x n` elements, `out` `n`.
                let status =
                    unsafe { (self.lib.reduce_scatter)(p[0], p[1], n, ty, SUM, sc, self.stream) };
                self.lib.check("reduce-scatter", status)?;
                if let Some(rc) = rc {
                    // SAFETY: in place on `out`'s `n` elements.
                    let status =
                        unsafe { (self.lib.all_reduce)(p[1], p[1], n, ty, SUM, rc, self.stream) };
                    self.lib.check("all-reduce over replicas", status)?;
                }
                Ok(())
            })?;
            Ok(InFlight::ready(scaled(
                out,
                1.0 / (shards * replicas) as f64,
            )))
        }

        pub(super) fn all_gather(
            &self,
            flat: &Sharded,
            mine: Tensor<1>,
        ) -> Result<InFlight<Tensor<1>>, TrainError> {
            let (mine, ty) = buffer(mine)?;
            let n = flat.shard;
            let (c, shards) = (self.shards().comm, self.shards().ranks);
            let out = empty(&mine, shards * n);
            self.run(&[&mine, &out], |p| {
                // SAFETY: `mine` holds `n` elements, `out` `ranks x n`.
                let status = unsafe { (self.lib.all_gather)(p[0], p[1], n, ty, c, self.stream) };
                self.lib.check("all-gather", status)
            })?;
            Ok(InFlight::ready(scaled(out, 1.0)))
        }
    }

    /// `t`'s contiguous CubeCL buffer and its RCCL type.
    fn buffer(t: Tensor<1>) -> Result<(CubeTensor, c_int), TrainError> {
        let prim = t.try_into_primitive::<Cube>().map_err(|_| {
            TrainError::Collective("RCCL input: the tensor is not on a CubeCL device".into())
        })?;
        let prim = burn_cubecl::kernel::into_contiguous(prim);
        let ty = match prim.dtype {
            DType::F32 => FLOAT32,
            DType::BF16 => BFLOAT16,
            other => {
                return Err(TrainError::Collective(format!(
                    "RCCL input: tensors of type {other:?}"
                )));
            }
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

    fn scaled(out: CubeTensor, scale: f64) -> Tensor<1> {
        let out = Tensor::<1>::from_primitive::<Cube>(out);
        if scale == 1.0 {
            out
        } else {
            out.mul_scalar(scale)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env_of<'a>(pairs: &'a [(&'a str, &'a str)]) -> impl Fn(&str) -> Option<OsString> + 'a {
        move |var| {
            pairs
                .iter()
                .find(|(k, _)| *k == var)
                .map(|(_, v)| OsString::from(v))
        }
    }

    #[test]
    fn the_library_is_looked_for_under_rocm_then_by_the_loader() {
        let found = library_candidates(&env_of(&[("ROCM_PATH", "/x/rocm-7")]));
        let found: Vec<String> = found.iter().map(|p| p.display().to_string()).collect();
        assert_eq!(
            found,
            [
                "/x/rocm-7/lib/librccl.so",
                "/opt/rocm/lib/librccl.so",
                "librccl.so",
                "librccl.so.1"
            ]
        );
    }

    #[test]
    fn a_chosen_library_is_the_only_candidate() {
        let found = library_candidates(&env_of(&[
            (LIBRARY_VAR, "/lib/my-rccl.so"),
            ("ROCM_PATH", "/x"),
        ]));
        assert_eq!(found, [PathBuf::from("/lib/my-rccl.so")]);
    }

    #[test]
    fn not_found_names_each_candidate_and_the_fix() {
        let err = not_found(&[
            (
                PathBuf::from("/opt/rocm/lib/librccl.so"),
                "no such file".into(),
            ),
            (PathBuf::from("librccl.so"), "not found".into()),
        ]);
        assert!(
            err.contains("/opt/rocm/lib/librccl.so (no such file)"),
            "{err}"
        );
        assert!(err.contains("librccl.so (not found)"), "{err}");
        assert!(
            err.contains(LIBRARY_VAR) && err.contains("LD_LIBRARY_PATH"),
            "{err}"
        );
    }

    #[test]
    fn a_rank_without_the_library_sends_every_rank_to_the_fallback() {
        assert_eq!(agree(&kiln_dist::Solo, Ok::<_, String>(3)), Ok(3));
        assert_eq!(
            agree::<u8>(&kiln_dist::Solo, Err("missing".into())),
            Err("missing".into())
        );
    }
}

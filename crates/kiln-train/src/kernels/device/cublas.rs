//! Matrix products on CUDA devices by cuBLAS, as PyTorch takes them: NVIDIA's own GEMM kernels
//! (wgmma and TMA on Hopper), f32 accumulation, bf16 or f32 out. Why: no crate gives
//! Hopper-class GEMMs in CubeCL yet, and the products are most of a step; cuBLAS is what every
//! PyTorch user's GPU already has (`bench/gpu/results/h200.md` measures both). Other runtimes
//! (ROCm, Vulkan/wgpu, Metal, the CPU runtime) keep CubeCL's.
//!
//! The call runs on CubeCL's own stream for this thread (the stream the patched `cubecl-cuda`
//! reports with each buffer it resolves, after any wait for the stream that wrote it), so it
//! is ordered after the kernels launched before it and before those launched after, with no
//! host synchronisation: to CubeCL's queue it is one more launch. Operands are read through
//! their strides ([`crate::kernels::blas::plan`]); the output is a new contiguous tensor, or
//! (attention's `dk`, `dv` over chunks) a prefix of an accumulator that the product adds into.
//!
//! `kernels.cuda_gemm = "cubecl"` turns it off (CubeCL's matmul everywhere, for comparison);
//! without `libcublas.so.<CUDA major>` it is off, said once. f32 products are exact f32
//! (cuBLAS's default math mode: no TF32), unlike burn's matmul on CUDA.

use crate::config::CudaGemm;
use crate::kernels::blas::{Gemm, plan};
use crate::kernels::settings;
use burn::tensor::DType;
use burn_cubecl::ops::numeric::empty_device_contiguous_dtype;
use burn_cubecl::tensor::CubeTensor;
use cubecl::cuda::CudaRuntime;
use cubecl_runtime::runtime::Runtime;
use cudarc::cublas::{result as blas, sys};
use cudarc::driver::result as driver;
use std::cell::RefCell;
use std::ffi::c_void;
use std::io::Write;
use std::sync::{Mutex, OnceLock};

type Server = <CudaRuntime as Runtime>::Server;

/// `a @ b` with its output in `out` (f32, or the inputs' type) by cuBLAS, when `a` and `b` are
/// on a CUDA device, of one float type, and one strided-batched call covers their layouts;
/// `None` otherwise (the caller takes CubeCL's matmul).
pub(super) fn product(a: &CubeTensor, b: &CubeTensor, out: DType) -> Option<CubeTensor> {
    let (g, ordinal) = prepare(a, b, out)?;
    let shape = g.out_shape.clone();
    let c = empty_device_contiguous_dtype(a.client.clone(), a.device.clone(), shape.into(), out);
    went_through(launch(&g, a, b, &c, 0.0, ordinal)).then_some(c)
}

/// `c += a @ b` in place, for `c` a view cuBLAS can write ([`Gemm::into_view`]: a prefix of
/// an accumulator) of f32 or the inputs' type; `None` (nothing done) where it cannot.
pub(super) fn accumulate(a: &CubeTensor, b: &CubeTensor, c: &CubeTensor) -> Option<()> {
    if c.meta.is_tiled() {
        return None;
    }
    let (g, ordinal) = prepare(a, b, c.dtype)?;
    let g = g.into_view(c.meta.shape(), c.meta.strides())?;
    went_through(launch(&g, a, b, c, 1.0, ordinal)).then_some(())
}

/// The call for `a @ b` written in `out` and the CUDA device's ordinal, where cuBLAS takes it:
/// a CUDA device, cuBLAS on, one float type in, f32 or that type out, one strided-batched
/// call for the layouts.
fn prepare(a: &CubeTensor, b: &CubeTensor, out: DType) -> Option<(Gemm, usize)> {
    let cubecl::Device::Cuda(device) = &a.device else {
        return None;
    };
    data_type(a.dtype)?;
    let types = b.dtype == a.dtype && (out == a.dtype || out == DType::F32);
    if !types || !enabled() || a.meta.is_tiled() || b.meta.is_tiled() {
        return None;
    }
    let (ma, mb) = (&a.meta, &b.meta);
    let g = plan(ma.shape(), ma.strides(), mb.shape(), mb.strides())?;
    Some((g, device.index))
}

/// Whether the call went through; a refusal is said once (the caller takes CubeCL's matmul).
fn went_through(called: Result<(), String>) -> bool {
    match called {
        Ok(()) => true,
        Err(e) => {
            static ONCE: std::sync::Once = std::sync::Once::new();
            ONCE.call_once(
                || tracing::warn!(error = %e, "cuBLAS refused a product; CubeCL's matmul takes it"),
            );
            false
        }
    }
}

/// cuBLAS's name for a burn float type it multiplies.
fn data_type(d: DType) -> Option<sys::cudaDataType> {
    match d {
        DType::F32 => Some(sys::cudaDataType::CUDA_R_32F),
        DType::BF16 => Some(sys::cudaDataType::CUDA_R_16BF),
        DType::F16 => Some(sys::cudaDataType::CUDA_R_16F),
        _ => None,
    }
}

/// Whether products go to cuBLAS: `kernels.cuda_gemm` says so, and its library loads
/// (checked once).
fn enabled() -> bool {
    if settings::current().cuda_gemm == CudaGemm::Cubecl {
        static ONCE: std::sync::Once = std::sync::Once::new();
        ONCE.call_once(|| {
            tracing::info!("kernels.cuda_gemm = cubecl: matrix products on CubeCL's matmul")
        });
        return false;
    }
    static FOUND: OnceLock<bool> = OnceLock::new();
    *FOUND.get_or_init(|| {
        // SAFETY: only probes for the library (dlopen), calls nothing in it.
        let found = unsafe { sys::is_culib_present() };
        if found {
            tracing::info!("matrix products on cuBLAS");
        } else {
            tracing::warn!(
                "cuBLAS not found (libcublas.so or libcublas.so.<CUDA major> on the loader's path): \
                 matrix products on CubeCL's matmul, several times slower on tensor-core GPUs"
            );
        }
        found
    })
}

/// This thread's cuBLAS handle (made on first use, with the device's primary context current,
/// the one CubeCL works in).
struct Handle(sys::cublasHandle_t);

impl Drop for Handle {
    fn drop(&mut self) {
        // SAFETY: made by `create_handle`, used by this thread only, not used after this.
        unsafe {
            let _ = blas::destroy_handle(self.0);
        }
    }
}

thread_local! {
    static HANDLE: RefCell<Option<Handle>> = const { RefCell::new(None) };
}

/// This thread's handle (one device a process: the first call's `ordinal`).
fn handle(ordinal: usize) -> Result<sys::cublasHandle_t, String> {
    HANDLE.with(|h| {
        if let Some(h) = h.borrow().as_ref() {
            return Ok(h.0);
        }
        driver::init().map_err(|e| format!("CUDA driver: {e:?}"))?;
        let dev =
            driver::device::get(ordinal as i32).map_err(|e| format!("device {ordinal}: {e:?}"))?;
        // SAFETY: `dev` is a device the driver returned; its primary context (CubeCL's) lives
        // as long as the process.
        unsafe {
            let ctx = driver::primary_ctx::retain(dev).map_err(|e| format!("{e:?}"))?;
            driver::ctx::set_current(ctx).map_err(|e| format!("{e:?}"))?;
        }
        let made = blas::create_handle().map_err(|e| format!("cublasCreate: {e}"))?;
        *h.borrow_mut() = Some(Handle(made));
        Ok(made)
    })
}

/// Runs `g` on `a`, `b` into `c` (`c = beta c + a b`) on CubeCL's stream for this thread.
fn launch(
    g: &Gemm,
    a: &CubeTensor,
    b: &CubeTensor,
    c: &CubeTensor,
    beta: f32,
    ordinal: usize,
) -> Result<(), String> {
    let types = (data_type(a.dtype), data_type(c.dtype));
    let (Some(ty), Some(out)) = types else {
        return Err(format!("types {:?} and {:?}", a.dtype, c.dtype));
    };
    let resolve = |t: &CubeTensor| {
        t.client
            .get_resource::<Server>(t.handle.clone())
            .map_err(|e| format!("buffer: {e}"))
    };
    // Held until the call is queued: the buffers stay in place meanwhile.
    let (ra, rb, rc) = (resolve(a)?, resolve(b)?, resolve(c)?);
    let stream = rc.resource().stream;
    if stream.is_null() {
        return Err("the CUDA server reported no stream (an unpatched cubecl-cuda)".into());
    }
    let h = handle(ordinal)?;
    let ptrs = [rb.resource().ptr, ra.resource().ptr, rc.resource().ptr];
    let timed = profile_log().map(|log| {
        wait(stream);
        (log, std::time::Instant::now())
    });
    // SAFETY: the pointers are live device buffers of `ty` (`out` for `c`) that `plan` sized
    // from the tensors' shapes and strides (every element it addresses lies in its tensor),
    // kept in place by the resources held to the end of this function; the call is queued on
    // the stream CubeCL orders its own launches on, so no kernel reuses them before it runs.
    let called = unsafe { gemm(h, stream, g, ptrs, [ty, out], beta) };
    if let Some((log, t0)) = timed {
        wait(stream);
        let us = t0.elapsed().as_secs_f64() * 1e6;
        if let Ok(mut f) = log.lock() {
            let what = format!("{:?} {}x{}x{} x{}", ty, g.m, g.n, g.k, g.batch);
            let _ = writeln!(f, "| {us:.3}us | cuBLAS gemm {what}");
        }
    }
    called
}

/// cuBLAS's strided-batched GEMM for `g` on `stream`: `C = beta C + op(A) op(B)` with `A`, `B`,
/// `C` at the device addresses `ptrs`, of the types `[A and B, C]`, f32 accumulation.
///
/// # Safety
///
/// `ptrs` must be live device buffers of those types holding every element `g` addresses, not
/// reused before the call has run on `stream`.
unsafe fn gemm(
    h: sys::cublasHandle_t,
    stream: cudarc::driver::sys::CUstream,
    g: &Gemm,
    [pa, pb, pc]: [u64; 3],
    [ty, out]: [sys::cudaDataType; 2],
    beta: f32,
) -> Result<(), String> {
    let one = 1.0f32;
    let op = |t: bool| match t {
        true => sys::cublasOperation_t::CUBLAS_OP_T,
        false => sys::cublasOperation_t::CUBLAS_OP_N,
    };
    let int = |v: usize| v as i32;
    // SAFETY: the caller's contract.
    unsafe {
        blas::set_stream(h, stream as sys::cudaStream_t)
            .map_err(|e| format!("cublasSetStream: {e}"))?;
        blas::gemm_strided_batched_ex(
            h,
            op(g.trans_a),
            op(g.trans_b),
            int(g.m),
            int(g.n),
            int(g.k),
            &one as *const f32 as *const c_void,
            pa as *const c_void,
            ty,
            int(g.lda),
            g.stride_a as i64,
            pb as *const c_void,
            ty,
            int(g.ldb),
            g.stride_b as i64,
            &beta as *const f32 as *const c_void,
            pc as *mut c_void,
            out,
            int(g.ldc),
            g.stride_c as i64,
            int(g.batch),
            sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
            sys::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
        )
        .map_err(|e| format!("cublasGemmStridedBatchedEx: {e}"))
    }
}

/// With `kernels.cublas_profile` set (bench/gpu's profiled runs, beside CubeCL's profiling
/// logger, which waits on every launch): each product is waited on and its time appended to
/// that file in the logger's format (`| 12.3us | name`), so the per-kernel table has cuBLAS's
/// share and CubeCL's kernels are not charged for the products queued before them. The file
/// is the one set when the first product runs.
fn profile_log() -> Option<&'static Mutex<std::fs::File>> {
    static LOG: OnceLock<Option<Mutex<std::fs::File>>> = OnceLock::new();
    LOG.get_or_init(|| {
        let path = settings::current().cublas_profile.clone()?;
        let file = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&path);
        file.map(Mutex::new)
            .map_err(|e| {
                tracing::warn!(error = %e, path = %path.display(), "kernels.cublas_profile: cannot open the log")
            })
            .ok()
    })
    .as_ref()
}

/// Waits for `stream`'s queued work (profiling only).
fn wait(stream: cudarc::driver::sys::CUstream) {
    // SAFETY: `stream` is CubeCL's live stream for this thread.
    let _ = unsafe { driver::stream::synchronize(stream) };
}

//! Matrix products on CUDA devices by cuBLAS, as PyTorch takes them: NVIDIA's own GEMM kernels
//! (wgmma and TMA on Hopper), f32 accumulation, bf16 or f32 out.
//!
//! Why not CubeCL's matmul there: on an H200 burn's autotuned CubeCL matmul (LLVM NVPTX
//! backend, no wgmma or TMA) ran the 1B-class model's products at about 120 TFLOP/s against
//! cuBLAS's 380-750, and the products were 85% of the step (`bench/gpu/results/h200.md`). No
//! crate gives Hopper-class GEMMs in CubeCL yet; cuBLAS is what every PyTorch user's GPU
//! already has. Other runtimes (ROCm, Vulkan/wgpu, Metal, the CPU runtime) keep CubeCL's.
//!
//! The call runs on CubeCL's own stream for this thread (the stream the patched `cubecl-cuda`
//! reports with each buffer it resolves, after any wait for the stream that wrote it), so it
//! is ordered after the kernels launched before it and before those launched after, with no
//! host synchronisation: to CubeCL's queue it is one more launch. Operands are read through
//! their strides ([`super::super::blas::plan`]); the output is a new contiguous tensor.
//!
//! `KILN_CUDA_GEMM=cubecl` turns it off (CubeCL's matmul everywhere, for comparison); without
//! `libcublas.so.<CUDA major>` it is off, said once. f32 products are exact f32 (cuBLAS's
//! default math mode: no TF32), unlike burn's matmul on CUDA.

use super::super::blas::{Gemm, plan};
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
    let cubecl::Device::Cuda(device) = &a.device else {
        return None;
    };
    let ty = data_type(a.dtype)?;
    if b.dtype != a.dtype || (out != a.dtype && out != DType::F32) || !enabled() {
        return None;
    }
    if a.meta.is_tiled() || b.meta.is_tiled() {
        return None;
    }
    let g = plan(
        a.meta.shape(),
        a.meta.strides(),
        b.meta.shape(),
        b.meta.strides(),
    )?;
    let shape = g.out_shape.clone();
    let c = empty_device_contiguous_dtype(a.client.clone(), a.device.clone(), shape.into(), out);
    let called = launch(&g, a, b, &c, ty, data_type(out)?, 0.0, device.index);
    went_through(called).then_some(c)
}

/// `c += a @ b` in place, for `c` a view cuBLAS can write ([`Gemm::into_view`]: a prefix of
/// an accumulator) of f32 or the inputs' type; `None` (nothing done) where it cannot.
pub(super) fn accumulate(a: &CubeTensor, b: &CubeTensor, c: &CubeTensor) -> Option<()> {
    let cubecl::Device::Cuda(device) = &a.device else {
        return None;
    };
    let ty = data_type(a.dtype)?;
    if b.dtype != a.dtype || (c.dtype != a.dtype && c.dtype != DType::F32) || !enabled() {
        return None;
    }
    if a.meta.is_tiled() || b.meta.is_tiled() || c.meta.is_tiled() {
        return None;
    }
    let g = plan(
        a.meta.shape(),
        a.meta.strides(),
        b.meta.shape(),
        b.meta.strides(),
    )?;
    let g = g.into_view(c.meta.shape(), c.meta.strides())?;
    let called = launch(&g, a, b, c, ty, data_type(c.dtype)?, 1.0, device.index);
    went_through(called).then_some(())
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

/// Whether products go to cuBLAS: not turned off, and its library loads (checked once).
fn enabled() -> bool {
    static ON: OnceLock<bool> = OnceLock::new();
    *ON.get_or_init(|| {
        if std::env::var("KILN_CUDA_GEMM").is_ok_and(|v| v == "cubecl") {
            tracing::info!("KILN_CUDA_GEMM=cubecl: matrix products on CubeCL's matmul");
            return false;
        }
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
#[allow(clippy::too_many_arguments)]
fn launch(
    g: &Gemm,
    a: &CubeTensor,
    b: &CubeTensor,
    c: &CubeTensor,
    ty: sys::cudaDataType,
    out: sys::cudaDataType,
    beta: f32,
    ordinal: usize,
) -> Result<(), String> {
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
    let timed = profile_log().map(|log| {
        wait(stream);
        (log, std::time::Instant::now())
    });
    let one = 1.0f32;
    let op = |t: bool| {
        if t {
            sys::cublasOperation_t::CUBLAS_OP_T
        } else {
            sys::cublasOperation_t::CUBLAS_OP_N
        }
    };
    let int = |v: usize| v as i32;
    // SAFETY: the pointers are live device buffers of `ty` (`out` for `c`) that `plan` sized
    // from the tensors' shapes and strides (every element it addresses lies in its tensor),
    // kept in place by the resources held to the end of this function; the call is queued on
    // the stream CubeCL orders its own launches on, so no kernel reuses them before it runs.
    let called = unsafe {
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
            rb.resource().ptr as *const c_void,
            ty,
            int(g.lda),
            g.stride_a as i64,
            ra.resource().ptr as *const c_void,
            ty,
            int(g.ldb),
            g.stride_b as i64,
            &beta as *const f32 as *const c_void,
            rc.resource().ptr as *mut c_void,
            out,
            int(g.ldc),
            g.stride_c as i64,
            int(g.batch),
            sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
            sys::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
        )
        .map_err(|e| format!("cublasGemmStridedBatchedEx: {e}"))
    };
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

/// With `KILN_CUBLAS_PROFILE=<file>` (bench/gpu's profiled runs, beside CubeCL's profiling
/// logger, which waits on every launch): each product is waited on and its time appended to
/// that file in the logger's format (`| 12.3us | name`), so the per-kernel table has cuBLAS's
/// share and CubeCL's kernels are not charged for the products queued before them.
fn profile_log() -> Option<&'static Mutex<std::fs::File>> {
    static LOG: OnceLock<Option<Mutex<std::fs::File>>> = OnceLock::new();
    LOG.get_or_init(|| {
        let path = std::env::var_os("KILN_CUBLAS_PROFILE")?;
        let file = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&path);
        file.map(Mutex::new)
            .map_err(|e| tracing::warn!(error = %e, "KILN_CUBLAS_PROFILE: cannot open the log"))
            .ok()
    })
    .as_ref()
}

/// Waits for `stream`'s queued work (profiling only).
fn wait(stream: cudarc::driver::sys::CUstream) {
    // SAFETY: `stream` is CubeCL's live stream for this thread.
    let _ = unsafe { driver::stream::synchronize(stream) };
}

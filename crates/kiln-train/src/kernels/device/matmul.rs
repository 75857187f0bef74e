//! The device's matrix products: on CUDA cuBLAS's ([`super::cublas`]), and elsewhere a kernel
//! that is not chosen by timing where the bits must not depend on it.
//!
//! burn's matmul on CubeCL devices is autotuned: each process times the candidate kernels and
//! keeps the fastest, and candidates split the inner sum differently. Two things follow.
//!
//! - Two data-parallel ranks orthogonalising the same all-reduced momentum (Muon's
//!   Newton-Schulz) could take different kernels and come out an ulp apart, and the replica
//!   check would stop the run. [`matmul_fixed`] takes CubeCL's default strategy there, picked
//!   from the device's properties alone, so every rank with the same GPU runs the same one.
//! - On CubeCL's CPU runtime (CI's driver for the GPU code path) two candidates are close in
//!   time for the default model's shapes, so fresh processes of one command could pick
//!   differently and part from the same bits within a few steps. [`product`], which the
//!   model's projections and the output head use, runs CubeCL's CPU GEMM there, whatever the
//!   timings: a fresh run has the same bits every time on a machine. On GPUs it stays
//!   autotuned (speed; a resumed process reads its picks back from the run's device cache, so
//!   resume stays exact).

use super::tensors::{dense, elem, empty_like};
use burn::backend::ops::FloatTensorOps;
use burn::backend::{Cube, FloatDType, calculate_matmul_output};
use burn::tensor::DType;
use burn_cubecl::CubeBackend;
use burn_cubecl::kernel::matmul::{MatmulStrategy, matmul};
use burn_cubecl::tensor::CubeTensor;
use cubek::matmul::definition::{MatmulElems, MatmulGlobalElems};
use cubek::matmul::multi_level::Strategy as Routine;
use cubek::matmul::routine::BlueprintStrategy;
use cubek::matmul::strategy::Strategy;
use cubek::matmul::tiled::{Strategy as Tiled, cpu_gemm::CpuGemmStrategy};
use cubek::std::InputBinding;

/// A burn tensor (cubecl's prelude names its own `Tensor`).
type Host2 = burn::tensor::Tensor<2>;

/// `a @ b` by CubeCL's default strategy when both are on a CubeCL device; `None` otherwise,
/// or when that strategy cannot run the shapes (reported once). On CubeCL's CPU runtime,
/// where that strategy is a generic fallback (minutes a step), [`product`]'s CPU GEMM.
pub(in crate::kernels) fn matmul_fixed(a: &Host2, b: &Host2) -> Option<Host2> {
    let pa = dense(a.clone().try_into_primitive::<Cube>().ok()?);
    let pb = dense(b.clone().try_into_primitive::<Cube>().ok()?);
    if on_cpu_runtime(&pa) {
        return Some(Host2::from_primitive::<Cube>(product(pa, pb)));
    }
    let dtype = pa.dtype;
    // cuBLAS picks its kernel by heuristics, not timing: the same on every rank's GPU too.
    if let Some(out) = vendor(&pa, &pb, dtype) {
        return Some(Host2::from_primitive::<Cube>(out));
    }
    match matmul(pa, pb, None, MatmulStrategy::Cube, dtype) {
        Ok(out) => Some(Host2::from_primitive::<Cube>(out)),
        Err(e) => {
            static ONCE: std::sync::Once = std::sync::Once::new();
            ONCE.call_once(|| {
                tracing::warn!(
                    error = %e,
                    "CubeCL's default matmul cannot run these shapes; the autotuned one takes over, so data-parallel replicas may drift apart (the replica check names it)"
                )
            });
            None
        }
    }
}

/// `a @ b` (`[.., m, k] @ [.., k, n]`, same element type): on CubeCL's CPU runtime by a kernel
/// fixed in advance (CubeCL's CPU GEMM, or its general GEMM for shapes that one refuses), on
/// CUDA by cuBLAS ([`vendor`]), elsewhere burn's autotuned matmul.
pub(in crate::kernels) fn product(a: CubeTensor, b: CubeTensor) -> CubeTensor {
    if on_cpu_runtime(&a) {
        let cpu_gemm = Tiled::CpuGemm(BlueprintStrategy::Inferred(CpuGemmStrategy::default()));
        let general = Routine::Gemm(BlueprintStrategy::Inferred(Default::default()));
        for strategy in [Strategy::from(cpu_gemm), Strategy::from(general)] {
            if let Some(out) = launch(&strategy, &a, &b) {
                return out;
            }
        }
    }
    if let Some(out) = vendor(&a, &b, a.dtype) {
        return out;
    }
    CubeBackend::float_matmul(a, b)
}

/// `a @ b` written in `out`: the vendor's BLAS where it can write `out` from these inputs
/// (cuBLAS: bf16 in, f32 out, nothing rounded to bf16 between), else [`product`] and a cast.
pub(in crate::kernels) fn product_into(a: CubeTensor, b: CubeTensor, out: DType) -> CubeTensor {
    if let Some(c) = vendor(&a, &b, out) {
        return c;
    }
    CubeBackend::float_cast(product(a, b), FloatDType::from(out))
}

/// `c += a @ b` in place by the vendor's BLAS (`c` a view it can write: a prefix of an
/// accumulator); false, with nothing done, where it cannot (the caller adds a product).
pub(in crate::kernels) fn accumulate(a: &CubeTensor, b: &CubeTensor, c: &CubeTensor) -> bool {
    #[cfg(feature = "cuda")]
    return super::cublas::accumulate(a, b, c).is_some();
    #[cfg(not(feature = "cuda"))]
    {
        let _ = (a, b, c);
        false
    }
}

/// `a @ b` written in `out` (f32, or the inputs' type) by the GPU vendor's BLAS where kiln
/// has it (cuBLAS on CUDA, [`super::cublas`]); `None` elsewhere.
pub(in crate::kernels) fn vendor(a: &CubeTensor, b: &CubeTensor, out: DType) -> Option<CubeTensor> {
    #[cfg(feature = "cuda")]
    return super::cublas::product(a, b, out);
    #[cfg(not(feature = "cuda"))]
    {
        let _ = (a, b, out);
        None
    }
}

/// Whether `t` lives on CubeCL's CPU runtime (the only runtime that reports CPU cores).
fn on_cpu_runtime(t: &CubeTensor) -> bool {
    t.client.properties().hardware.num_cpu_cores.is_some()
}

/// `a @ b` by `strategy` into a new contiguous tensor; `None` when the strategy refuses the
/// problem (its checks run before anything is launched).
fn launch(strategy: &Strategy, a: &CubeTensor, b: &CubeTensor) -> Option<CubeTensor> {
    let shape = calculate_matmul_output(a.meta.shape(), b.meta.shape()).ok()?;
    let out = empty_like(a, shape);
    let storage = elem(a);
    let mut dtypes = MatmulElems::from_globals(&MatmulGlobalElems {
        lhs: storage,
        rhs: elem(b),
        out: storage,
    });
    cubek::matmul::launch::launch_ref(
        strategy,
        &a.client,
        InputBinding::new(a.clone().binding(), storage),
        InputBinding::new(b.clone().binding(), elem(b)),
        out.clone().binding(),
        &mut dtypes,
    )
    .ok()
    .map(|()| out)
}

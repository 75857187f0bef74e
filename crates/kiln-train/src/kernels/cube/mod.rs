//! kiln's fused kernels written once in CubeCL, so the same source runs on every CubeCL
//! runtime: CUDA, ROCm, Vulkan/wgpu, Metal, and CubeCL's CPU runtime (the CI driver).
//!
//! Each operation is the same function as its CPU kernel and its composed twin
//! ([`super::composed`]): a forward kernel, backward kernels, and one backward step registered
//! with burn's autodiff (`Autodiff<CubeBackend, C>`), through a backend extension of its own
//! (`DeviceOps`, on burn's `Cube` backend), as the CPU kernels register theirs on flex.
//!
//! What is covered: RMSNorm, SwiGLU, RoPE with the head transpose, and causal grouped-query
//! attention that never materialises the `T x T` scores (forward saves the log-sum-exp per
//! row; backward recomputes the probabilities from it), so its memory grows linearly with
//! the sequence length; the output head with cross-entropy, chunked over the vocabulary (burn's
//! matmul per chunk, kernels for the running log-sum-exp and the logits' gradient), so the
//! `[tokens, vocab]` logits are never whole; and the AdamW update with clipping, one kernel
//! over a parameter's device buffers. For arithmetic on replicated state, where every rank
//! must get the same bits: the gradients' sum of squares (clipping) and Muon's Frobenius
//! norm in a fixed order (burn's device sum may use atomics), and a matmul whose kernel is
//! not picked by timing (Muon's Newton-Schulz). The bias-free projection is one autodiff op
//! whose products (and the head's) take a kernel fixed in advance on CubeCL's CPU runtime, so a
//! run there has the same bits every time (`fixed_matmul`). The rest of Muon and SophiaG take
//! burn's generic ops on devices.
//!
//! Numerics: every kernel reads its element type and accumulates in f32, then writes its
//! element type, so bf16 inputs keep f32 sums. Work is one unit per output row or element and
//! every sum runs in a fixed order with no atomics, so results are deterministic on a device.
//!
//! Speed: on GPUs attention goes by matrix products over chunks of query positions
//! (`attention_mm`: tensor cores, the same function and saved state as the row kernels of
//! `attention`, which CubeCL's CPU runtime keeps); the others are a cube per row or a unit per
//! element, without vectorised loads or tensor cores. Products on CUDA are cuBLAS's
//! (`cublas`), elsewhere burn's. On an H200 (1B-class, bf16) the step is 151 ms against
//! PyTorch eager's 120; attention by products (its f32 chunk scores written and read by the
//! products and two row kernels) is about 50 ms of it, against about 9 ms of PyTorch's flash
//! attention (`bench/gpu/results/h200.md`). `KILN_ATTENTION=flash` takes the flash kernels
//! instead (`flash`: tiled, the tiles' products on tensor-core fragments, nothing of the scores
//! in global memory); they are checked on CubeCL's CPU runtime by their unit-by-unit products
//! and by `kiln doctor` on a GPU, and stay opt-in until their speed is measured there.

pub(super) mod adamw;
pub(super) mod attention;
pub(super) mod attention_mm;
mod cross_entropy;
#[cfg(feature = "cuda")]
mod cublas;
pub(super) mod fixed_matmul;
pub(super) mod flash;
mod heads;
mod linear;
mod norm;
mod rope;
pub(super) mod square_sum;

use super::attention::Dims;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::cubecl::dtype_to_storage_type;
use burn::backend::tensor::{FloatTensor, IntTensor};
use burn::backend::{Autodiff, Backend, Dispatch, DispatchDevice, backend_extension};
use burn::tensor::{DType, Int, Shape, Tensor};
use burn_cubecl::CubeBackend;
use burn_cubecl::kernel::into_contiguous;
use burn_cubecl::ops::numeric::empty_device_contiguous_dtype;
use burn_cubecl::tensor::CubeTensor;
use cubecl::prelude::*;

/// The kernels on CubeCL devices. `CubeBackend` is burn's `Cube` backend as kiln builds it
/// (without burn's fusion feature).
#[backend_extension(Cube, Autodiff)]
pub trait DeviceOps: Backend {
    /// `x @ w` (see `KilnOps::kiln_linear`), by a kernel fixed in advance on CubeCL's CPU
    /// runtime (`fixed_matmul::product`).
    fn device_linear(x: FloatTensor<Self>, w: FloatTensor<Self>) -> FloatTensor<Self>;
    /// `x @ w` with both cast to `compute`, written in `out` (mixed precision's projection,
    /// `linear::mixed_autodiff`).
    fn device_mixed_linear(
        x: FloatTensor<Self>,
        w: FloatTensor<Self>,
        compute: DType,
        out: DType,
    ) -> FloatTensor<Self>;
    /// RMSNorm over the last dimension (see `KilnOps::kiln_rms_norm`).
    fn device_rms_norm(x: FloatTensor<Self>, w: FloatTensor<Self>, eps: f64) -> FloatTensor<Self>;
    /// `silu(gate) * up`.
    fn device_swiglu(gate: FloatTensor<Self>, up: FloatTensor<Self>) -> FloatTensor<Self>;
    /// Rotate-half RoPE of `x` `[b, t, heads * hd]`, returned as `[b, heads, t, hd]`.
    fn device_rope(
        x: FloatTensor<Self>,
        cos: FloatTensor<Self>,
        sin: FloatTensor<Self>,
        heads: usize,
    ) -> FloatTensor<Self>;
    /// Causal grouped-query attention (see `KilnOps::kiln_causal_attention`).
    fn device_causal_attention(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        scale: f64,
    ) -> FloatTensor<Self>;
    /// Mean cross-entropy of `h @ w` against `targets`, `columns` logits columns at a time.
    fn device_linear_cross_entropy(
        h: FloatTensor<Self>,
        w: FloatTensor<Self>,
        targets: IntTensor<Self>,
        columns: usize,
    ) -> FloatTensor<Self>;
}

/// Whether the CubeCL kernels cover an operation on `t` whose other inputs have the element
/// types `others`: f32 or bf16 on a CubeCL device, every input the same type (a kernel is
/// compiled for one), kernels enabled. (bf16 reads and writes bf16 and accumulates in f32;
/// CI checks both instances on CubeCL's CPU runtime, `kiln doctor --device` on a GPU.)
pub(super) fn covers<const D: usize>(t: &Tensor<D>, others: &[DType]) -> bool {
    super::enabled()
        && matches!(t.dtype(), DType::F32 | DType::BF16)
        && others.iter().all(|d| *d == t.dtype())
        && on_cube_device(&t.device())
}

/// Whether `device` is a CubeCL device (where these kernels run).
pub(super) fn on_cube_device(device: &burn::tensor::Device) -> bool {
    matches!(
        device.as_dispatch().clone().inner(),
        DispatchDevice::Cube(_)
    )
}

/// Whether `device` is a CubeCL GPU (not CubeCL's CPU runtime).
pub(super) fn on_gpu(device: &burn::tensor::Device) -> bool {
    matches!(
        device.as_dispatch().clone().inner(),
        DispatchDevice::Cube(d) if !matches!(d, cubecl::Device::Cpu(_))
    )
}

pub(super) fn linear<const D: usize>(x: Tensor<D>, w: Tensor<2>) -> Tensor<D> {
    Tensor::from_dispatch(Dispatch::device_linear(
        x.into_dispatch(),
        w.into_dispatch(),
    ))
}

pub(super) fn mixed_linear<const D: usize>(
    x: Tensor<D>,
    w: Tensor<2>,
    compute: DType,
    out: DType,
) -> Tensor<D> {
    Tensor::from_dispatch(Dispatch::device_mixed_linear(
        x.into_dispatch(),
        w.into_dispatch(),
        compute,
        out,
    ))
}

pub(super) fn rms_norm<const D: usize>(x: Tensor<D>, w: Tensor<1>, eps: f64) -> Tensor<D> {
    Tensor::from_dispatch(Dispatch::device_rms_norm(
        x.into_dispatch(),
        w.into_dispatch(),
        eps,
    ))
}

pub(super) fn swiglu<const D: usize>(gate: Tensor<D>, up: Tensor<D>) -> Tensor<D> {
    Tensor::from_dispatch(Dispatch::device_swiglu(
        gate.into_dispatch(),
        up.into_dispatch(),
    ))
}

pub(super) fn rope(x: Tensor<3>, cos: Tensor<2>, sin: Tensor<2>, heads: usize) -> Tensor<4> {
    Tensor::from_dispatch(Dispatch::device_rope(
        x.into_dispatch(),
        cos.into_dispatch(),
        sin.into_dispatch(),
        heads,
    ))
}

pub(super) fn causal_attention(q: Tensor<4>, k: Tensor<4>, v: Tensor<3>, scale: f64) -> Tensor<3> {
    Tensor::from_dispatch(Dispatch::device_causal_attention(
        q.into_dispatch(),
        k.into_dispatch(),
        v.into_dispatch(),
        scale,
    ))
}

/// Mean cross-entropy of `h @ w` against `targets`, at most `columns` logits columns live at
/// once (`None`: as many as [`cross_entropy::chunk_columns`] allows).
pub(super) fn linear_cross_entropy(
    h: Tensor<2>,
    w: Tensor<2>,
    targets: Tensor<1, Int>,
    columns: Option<usize>,
) -> Tensor<1> {
    let (n, vocab) = (h.dims()[0], w.dims()[1]);
    let columns = columns.unwrap_or_else(|| cross_entropy::chunk_columns(n, vocab));
    Tensor::from_dispatch(Dispatch::device_linear_cross_entropy(
        h.into_dispatch(),
        w.into_dispatch(),
        targets.into_dispatch(),
        columns.max(1),
    ))
}

// ---------------------------------------------------------------------------------------
// CubeBackend: forward only.

impl DeviceOps for CubeBackend {
    fn device_linear(x: CubeTensor, w: CubeTensor) -> CubeTensor {
        linear::forward(x, w)
    }

    fn device_mixed_linear(x: CubeTensor, w: CubeTensor, compute: DType, out: DType) -> CubeTensor {
        linear::mixed_forward(x, w, compute, out)
    }

    fn device_rms_norm(x: CubeTensor, w: CubeTensor, eps: f64) -> CubeTensor {
        norm::rms_norm_forward(x, w, eps).0
    }

    fn device_swiglu(gate: CubeTensor, up: CubeTensor) -> CubeTensor {
        norm::swiglu_forward(gate, up)
    }

    fn device_rope(x: CubeTensor, cos: CubeTensor, sin: CubeTensor, heads: usize) -> CubeTensor {
        rope::forward(x, cos, sin, heads)
    }

    fn device_causal_attention(
        q: CubeTensor,
        k: CubeTensor,
        v: CubeTensor,
        scale: f64,
    ) -> CubeTensor {
        attention::forward(q, k, v, scale).0
    }

    fn device_linear_cross_entropy(
        h: CubeTensor,
        w: CubeTensor,
        targets: CubeTensor,
        columns: usize,
    ) -> CubeTensor {
        cross_entropy::forward(h, w, targets, columns).0
    }
}

// ---------------------------------------------------------------------------------------
// Autodiff over CubeBackend: forward plus one backward step per kernel.

impl<C: CheckpointStrategy> DeviceOps for Autodiff<CubeBackend, C> {
    fn device_linear(x: FloatTensor<Self>, w: FloatTensor<Self>) -> FloatTensor<Self> {
        linear::autodiff::<C>(x, w)
    }

    fn device_mixed_linear(
        x: FloatTensor<Self>,
        w: FloatTensor<Self>,
        compute: DType,
        out: DType,
    ) -> FloatTensor<Self> {
        linear::mixed_autodiff::<C>(x, w, compute, out)
    }

    fn device_rms_norm(x: FloatTensor<Self>, w: FloatTensor<Self>, eps: f64) -> FloatTensor<Self> {
        norm::rms_norm_autodiff::<C>(x, w, eps)
    }

    fn device_swiglu(gate: FloatTensor<Self>, up: FloatTensor<Self>) -> FloatTensor<Self> {
        norm::swiglu_autodiff::<C>(gate, up)
    }

    fn device_rope(
        x: FloatTensor<Self>,
        cos: FloatTensor<Self>,
        sin: FloatTensor<Self>,
        heads: usize,
    ) -> FloatTensor<Self> {
        rope::autodiff::<C>(x, cos, sin, heads)
    }

    fn device_causal_attention(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        scale: f64,
    ) -> FloatTensor<Self> {
        attention::autodiff::<C>(q, k, v, scale)
    }

    fn device_linear_cross_entropy(
        h: FloatTensor<Self>,
        w: FloatTensor<Self>,
        targets: IntTensor<Self>,
        columns: usize,
    ) -> FloatTensor<Self> {
        cross_entropy::autodiff::<C>(h, w, targets, columns)
    }
}

// ---------------------------------------------------------------------------------------
// Helpers shared by the kernels' launchers.

/// The sizes of causal attention (`super::attention::Dims`) of device tensors `q` and `k`.
fn attention_dims(q: &CubeTensor, k: &CubeTensor) -> Dims {
    Dims::from_shapes(&dims(q), &dims(k))
}

/// Units per cube for the one-unit-per-row and one-unit-per-element launches.
const UNITS: u32 = 128;

/// The dimensions of a device tensor.
fn dims(t: &CubeTensor) -> Vec<usize> {
    t.meta.shape().iter().copied().collect()
}

/// A new contiguous tensor of `shape` on `like`'s device, with `like`'s element type.
///
/// Contiguous, not CubeCL's default layout: on CUDA that default pads each row to an
/// alignment (a pitched layout), and the kernels write row `r` at `r * width`. Seen on an H200:
/// with the default layout every kernel output whose row was not a multiple of the alignment
/// read back as other rows' values or uninitialised memory (`kiln doctor --device cuda`);
/// CubeCL's CPU runtime never pads, so CI could not see it.
fn empty_like(like: &CubeTensor, shape: impl Into<Shape>) -> CubeTensor {
    empty_device_contiguous_dtype(
        like.client.clone(),
        like.device.clone(),
        shape.into(),
        like.dtype,
    )
}

/// An f32 vector of `n` on `like`'s device: per-row statistics (1/rms, log-sum-exp) stay f32
/// whatever the element type.
fn f32_vector(like: &CubeTensor, n: usize) -> CubeTensor {
    empty_device_contiguous_dtype(
        like.client.clone(),
        like.device.clone(),
        [n].into(),
        DType::F32,
    )
}

/// `(cube count, cube dim)` for `n` units, one-dimensional.
fn launch_1d(n: usize) -> (CubeCount, CubeDim) {
    let cubes = n.div_ceil(UNITS as usize).max(1);
    (
        CubeCount::Static(cubes as u32, 1, 1),
        CubeDim::new_1d(UNITS),
    )
}

/// The storage type the kernels are compiled for.
fn elem(t: &CubeTensor) -> ElemType {
    dtype_to_storage_type(t.dtype)
}

/// Contiguous (the kernels index rows directly).
fn dense(t: CubeTensor) -> CubeTensor {
    into_contiguous(t)
}

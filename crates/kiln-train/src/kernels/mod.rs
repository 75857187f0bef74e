//! Fused CPU kernels for the model's hot spots, with their own backward passes.
//!
//! burn's autodiff records every primitive op of a composed function (RMSNorm is seven,
//! log-softmax six, SiLU three), and each primitive op on the flex backend is one
//! single-threaded pass over memory that allocates its output; the backward pass doubles
//! that. Each kernel here does one such function in one or two multithreaded passes, and
//! registers one backward step with burn's autodiff (`burn::backend::autodiff::ops::Backward`)
//! through a backend extension (`#[backend_extension]`), so a model mixes them freely with
//! burn's own ops.
//!
//! Every kernel has a composed twin in [`composed`], built from burn tensor ops: it is the
//! reference the tests compare values and gradients against, and the path taken where no
//! kernel covers a tensor (dtypes other than f32, and on CubeCL devices the ops `cube` does
//! not have yet), so the model code runs unchanged everywhere. On CubeCL devices (CUDA,
//! ROCm, Vulkan/wgpu, Metal, CubeCL's CPU runtime) the `cube` module's kernels, written once
//! in CubeCL, take RMSNorm, SwiGLU, RoPE and causal attention.
//!
//! Determinism: work is cut into fixed-size blocks of rows whatever the thread count, and
//! partial sums are combined in block order, so results are bit-identical for any number of
//! threads. Reductions accumulate in 16 explicit lanes and the kernels use no fused
//! multiply-add, so the AVX-512, AVX2 and SSE builds of a kernel (chosen at run time by
//! `multiversion`) give the same bits too.
//!
//! Upstream: each module says what burn would need for its kernel to go away. In short: burn's
//! autodiff should use the backend's fused forward ops (flex already has a fused softmax and
//! layer norm forward) and give them fused backward ops, and flex's element-wise ops should be
//! multithreaded.

pub mod adamw;
mod attention;
#[cfg(any(test, feature = "cuda"))]
mod blas;
pub mod composed;
mod cross_entropy;
#[cfg(feature = "cube")]
mod cube;
mod linear;
mod math;
mod matmul;
mod rms_norm;
mod rope;
pub mod selfcheck;
mod softmax;
mod swiglu;

use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::flex::{FlexTensor, Layout};
use burn::backend::tensor::{FloatTensor, IntTensor};
use burn::backend::{Autodiff, Backend, Dispatch, Flex, backend_extension};
use burn::tensor::{Bytes, DType, Int, Shape, Tensor};
use std::sync::atomic::{AtomicBool, Ordering};

/// The operations kiln fuses. Each is implemented for flex (forward only) and for autodiff
/// over flex (forward plus a backward step); the `kernels::*` functions route to them.
#[backend_extension(Flex, Autodiff)]
pub trait KilnOps: Backend {
    /// `x @ w` for `x` `[.., in]`, `w` `[in, out]`.
    fn kiln_linear(x: FloatTensor<Self>, w: FloatTensor<Self>) -> FloatTensor<Self>;
    /// RMSNorm over the last dimension: `x / sqrt(mean(x^2) + eps) * w`.
    fn kiln_rms_norm(x: FloatTensor<Self>, w: FloatTensor<Self>, eps: f64) -> FloatTensor<Self>;
    /// SwiGLU's gate: `silu(gate) * up`.
    fn kiln_swiglu(gate: FloatTensor<Self>, up: FloatTensor<Self>) -> FloatTensor<Self>;
    /// Rotate-half RoPE of `x` `[b, t, heads * hd]`, returned as `[b, heads, t, hd]`.
    fn kiln_rope(
        x: FloatTensor<Self>,
        cos: FloatTensor<Self>,
        sin: FloatTensor<Self>,
        heads: usize,
    ) -> FloatTensor<Self>;
    /// Causal grouped-query attention `softmax(q k^T * scale, causal) v` for `q`
    /// `[b, kv, groups * t, hd]` (the query heads sharing a K/V head stacked along the
    /// sequence), `k` `[b, kv, t, hd]` and `v` `[b, t, kv * hd]`; returns `[b, t, heads * hd]`.
    fn kiln_causal_attention(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        scale: f64,
    ) -> FloatTensor<Self>;
    /// Softmax over the last dimension of `scores * scale` under a causal mask: row `r` may
    /// see columns `0..=r % t` (`t` = the last dimension).
    fn kiln_causal_softmax(scores: FloatTensor<Self>, scale: f64) -> FloatTensor<Self>;
    /// Mean cross-entropy of the logits `h @ w` (`h` `[n, d]`, `w` `[d, vocab]`) against
    /// `targets` `[n]`, as a one-element tensor; the logits are never materialised whole.
    fn kiln_linear_cross_entropy(
        h: FloatTensor<Self>,
        w: FloatTensor<Self>,
        targets: IntTensor<Self>,
    ) -> FloatTensor<Self>;
}

/// `x @ w (+ bias)`, as burn's `linear` (`w` is `[in, out]`); the kernel covers the
/// bias-free case.
pub fn linear<const D: usize>(x: Tensor<D>, w: Tensor<2>, bias: Option<Tensor<1>>) -> Tensor<D> {
    // Not switched off by `training.fused_kernels` on devices: it is for exact bits, not speed.
    #[cfg(feature = "cube")]
    if bias.is_none() && cube::on_cube_device(&x.device()) && x.dtype() == w.dtype() {
        return cube::linear(x, w);
    }
    if bias.is_some() || !fusable(&x) || !fusable(&w) {
        return burn::tensor::module::linear(x, w, bias);
    }
    Tensor::from_dispatch(Dispatch::kiln_linear(x.into_dispatch(), w.into_dispatch()))
}

/// Mixed precision's projection: `x @ w` with both in the compute dtype `compute`, the result
/// in `out`. On CubeCL devices one op (the casts inside it, the product written in `out` by
/// the device's BLAS where it can: `cube::linear`); elsewhere the casts around [`linear`].
/// With `compute` f32 and `out` f32 it is [`linear`].
pub fn mixed_linear<const D: usize>(
    x: Tensor<D>,
    w: Tensor<2>,
    compute: DType,
    out: DType,
) -> Tensor<D> {
    #[cfg(feature = "cube")]
    if cube::on_cube_device(&x.device()) {
        return cube::mixed_linear(x, w, compute, out);
    }
    let compute_float = burn::tensor::FloatDType::from(compute);
    linear(x.cast(compute_float), w.cast(compute_float), None)
        .cast(burn::tensor::FloatDType::from(out))
}

/// RMSNorm over the last dimension (see [`KilnOps::kiln_rms_norm`]).
pub fn rms_norm<const D: usize>(x: Tensor<D>, w: Tensor<1>, eps: f64) -> Tensor<D> {
    #[cfg(feature = "cube")]
    if cube::covers(&x, &[w.dtype()]) {
        return cube::rms_norm(x, w, eps);
    }
    if !fusable(&x) {
        return composed::rms_norm(x, w, eps);
    }
    Tensor::from_dispatch(Dispatch::kiln_rms_norm(
        x.into_dispatch(),
        w.into_dispatch(),
        eps,
    ))
}

/// `silu(gate) * up`.
pub fn swiglu<const D: usize>(gate: Tensor<D>, up: Tensor<D>) -> Tensor<D> {
    #[cfg(feature = "cube")]
    if cube::covers(&gate, &[up.dtype()]) {
        return cube::swiglu(gate, up);
    }
    if !fusable(&gate) {
        return composed::swiglu(gate, up);
    }
    Tensor::from_dispatch(Dispatch::kiln_swiglu(
        gate.into_dispatch(),
        up.into_dispatch(),
    ))
}

/// Rotate-half RoPE of the heads in `x` `[b, t, heads * hd]` with tables `cos`, `sin`
/// `[t, hd]`, returned head-major: `[b, heads, t, hd]`.
pub fn rope(x: Tensor<3>, cos: Tensor<2>, sin: Tensor<2>, heads: usize) -> Tensor<4> {
    #[cfg(feature = "cube")]
    if cube::covers(&x, &[cos.dtype(), sin.dtype()]) {
        return cube::rope(x, cos, sin, heads);
    }
    if !fusable(&x) {
        return composed::rope(x, cos, sin, heads);
    }
    Tensor::from_dispatch(Dispatch::kiln_rope(
        x.into_dispatch(),
        cos.into_dispatch(),
        sin.into_dispatch(),
        heads,
    ))
}

/// Causal softmax of attention scores `[.., rows, t]` (see [`KilnOps::kiln_causal_softmax`]).
pub fn causal_softmax(scores: Tensor<4>, scale: f64) -> Tensor<4> {
    if !fusable(&scores) {
        return composed::causal_softmax(scores, scale);
    }
    Tensor::from_dispatch(Dispatch::kiln_causal_softmax(scores.into_dispatch(), scale))
}

/// Causal grouped-query attention (see [`KilnOps::kiln_causal_attention`]).
pub fn causal_attention(q: Tensor<4>, k: Tensor<4>, v: Tensor<3>, scale: f64) -> Tensor<3> {
    #[cfg(feature = "cube")]
    if cube::covers(&q, &[k.dtype(), v.dtype()]) {
        return cube::causal_attention(q, k, v, scale);
    }
    if !fusable(&q) {
        return composed::causal_attention(q, k, v, scale);
    }
    Tensor::from_dispatch(Dispatch::kiln_causal_attention(
        q.into_dispatch(),
        k.into_dispatch(),
        v.into_dispatch(),
        scale,
    ))
}

/// Mean cross-entropy of `h @ w` against `targets` (see
/// [`KilnOps::kiln_linear_cross_entropy`]), as a one-element tensor.
pub fn linear_cross_entropy(h: Tensor<2>, w: Tensor<2>, targets: Tensor<1, Int>) -> Tensor<1> {
    #[cfg(feature = "cube")]
    if cube::covers(&h, &[w.dtype()]) {
        return cube::linear_cross_entropy(h, w, targets, None);
    }
    if !fusable(&h) || !fusable(&w) {
        return composed::linear_cross_entropy(h, w, targets);
    }
    Tensor::from_dispatch(Dispatch::kiln_linear_cross_entropy(
        h.into_dispatch(),
        w.into_dispatch(),
        targets.into_dispatch(),
    ))
}

/// The fused AdamW update of one parameter (with clipping): the CubeCL kernel on CubeCL
/// devices, the CPU pass on flex; `Err` hands the tensors back for the composed update.
pub fn adamw_update(
    p: Tensor<1>,
    g: Tensor<1>,
    m: Tensor<1>,
    v: Tensor<1>,
    s: &adamw::AdamWScalars,
) -> adamw::Fused {
    #[cfg(feature = "cube")]
    let (p, g, m, v) = match cube::adamw::update(p, g, m, v, s) {
        Ok(done) => return Ok(done),
        Err(back) => *back,
    };
    adamw::update(p, g, m, v, s)
}

/// The sum of squares of every element of `tensors` in an order fixed by their sizes alone,
/// when they are on a CubeCL device (whose generic sum is autotuned and may use atomics, so its
/// bits differ between ranks and processes); `None` elsewhere, where the caller's own sum is
/// already deterministic. Not switched off by `training.fused_kernels`: it is for exactness,
/// not speed.
pub fn device_square_sum(tensors: &[Tensor<1>]) -> Option<f64> {
    #[cfg(feature = "cube")]
    return cube::square_sum::square_sum(tensors);
    #[cfg(not(feature = "cube"))]
    {
        let _ = tensors;
        None
    }
}

/// `a @ b` for arithmetic on replicated state (Muon's Newton-Schulz): on CubeCL devices by a
/// kernel chosen from the device's properties, not by timing (burn's matmul there is
/// autotuned per process, so two ranks could multiply the same matrices with different
/// kernels and drift apart); burn's matmul elsewhere.
pub fn replicated_matmul(a: Tensor<2>, b: Tensor<2>) -> Tensor<2> {
    #[cfg(feature = "cube")]
    if let Some(out) = cube::fixed_matmul::matmul_fixed(&a, &b) {
        return out;
    }
    a.matmul(b)
}

/// The Frobenius norm of `x` as a one-element tensor on its device, with no read-back: on
/// CubeCL devices the fixed-order sum of [`device_square_sum`], else burn's sum.
pub fn frobenius_norm(x: &Tensor<2>) -> Tensor<1> {
    #[cfg(feature = "cube")]
    if let Some(s) =
        cube::square_sum::on_device(&x.clone().reshape([x.dims().iter().product::<usize>()]))
    {
        return s.sqrt();
    }
    x.clone().powi_scalar(2).sum().sqrt()
}

/// Whether kiln has bf16 kernels on `device`: its CubeCL kernels, where the device has bf16
/// (flex's kernels cover f32 only; bf16 tensors there take the composed ops).
pub fn has_bf16_kernels(device: &burn::tensor::Device) -> bool {
    #[cfg(feature = "cube")]
    return cube::on_cube_device(device) && device.supports_dtype(burn::tensor::FloatDType::BF16);
    #[cfg(not(feature = "cube"))]
    {
        let _ = device;
        false
    }
}

/// Whether the mixed-precision model (bf16 matmuls on f32 activations) takes kiln's kernels
/// for attention and the output head on `device`: kernels on and kiln's CubeCL kernels there
/// (which take bf16). Then attention never holds the `T x T` scores and the head never the
/// whole logits, so activation memory grows linearly with the sequence. Elsewhere (flex, whose
/// kernels are f32 only) the model composes both, their matmuls in the compute dtype.
pub fn fuses_mixed(device: &burn::tensor::Device) -> bool {
    enabled() && has_bf16_kernels(device)
}

/// Sets how many query (or key) rows one cube of the attention kernels takes on CubeCL's CPU
/// runtime (default 1, where a cube barrier costs a spinning thread per unit; GPUs take 64):
/// for tests of the kernels' cooperative shared-memory paths. No effect without `cube`.
pub fn set_cpu_attention_block(rows: usize) {
    #[cfg(feature = "cube")]
    cube::attention::set_cpu_block(rows);
    #[cfg(not(feature = "cube"))]
    let _ = rows;
}

/// Takes the flash attention kernels (`cube::flash`, GPUs' path under `KILN_ATTENTION=flash`)
/// on CubeCL's CPU runtime too, by their unit-by-unit tile products: cubes of `rows` query
/// rows against tiles of `cols` keys, `units` units a cube (sizes rounded up to 16; 0 rows
/// restores the default, the row kernels there). For tests of that path. No effect without
/// `cube`.
pub fn set_cpu_flash_attention(rows: usize, cols: usize, units: usize) {
    #[cfg(feature = "cube")]
    cube::flash::set_cpu(rows, cols, units);
    #[cfg(not(feature = "cube"))]
    let _ = (rows, cols, units);
}

/// The PTX of the flash attention kernels (forward, `dq`, `dk`/`dv`) for `sm_{arch}` at head
/// dimension `hd` in `dtype` (bf16 or f16), compiled without a device by the backend CubeCL's
/// CUDA runtime uses, with the tilings a GPU gets: for a test, on machines with no GPU, that
/// they compile and that their tile products are tensor-core instructions.
#[cfg(feature = "cuda")]
pub fn flash_attention_ptx(
    hd: usize,
    dtype: burn::tensor::FloatDType,
    arch: u32,
) -> Result<[String; 3], String> {
    use cubecl::ir::{ElemType, FloatKind};
    let elem = match dtype {
        burn::tensor::FloatDType::BF16 => ElemType::Float(FloatKind::BF16),
        burn::tensor::FloatDType::F16 => ElemType::Float(FloatKind::F16),
        other => {
            return Err(format!(
                "the flash kernels' fragments take bf16 or f16, not {other:?}"
            ));
        }
    };
    cube::flash::ptx(hd, elem, arch)
}

/// Checks the flash kernels' split of each tile product's output fragments among the planes
/// of a cube (`rows x cols` tiles, `planes` planes, head dimension `hd`): every fragment
/// computed once, by the slot whose operands it takes. The tensor-core path's bookkeeping,
/// which CubeCL's CPU runtime cannot run. No effect without `cube`.
pub fn check_flash_fragment_slots(
    rows: usize,
    cols: usize,
    planes: usize,
    hd: usize,
) -> Result<(), String> {
    #[cfg(feature = "cube")]
    return cube::flash::check_slots(rows, cols, planes, hd);
    #[cfg(not(feature = "cube"))]
    {
        let _ = (rows, cols, planes, hd);
        Ok(())
    }
}

/// Sets how many query positions a chunk of attention by products takes (`cube::attention_mm`,
/// GPUs' path), and takes that path on CubeCL's CPU runtime too; 0 restores the default (by
/// memory, GPUs only): for tests of that path. No effect without `cube`.
pub fn set_attention_product_chunk(positions: usize) {
    #[cfg(feature = "cube")]
    cube::attention_mm::set_chunk(positions);
    #[cfg(not(feature = "cube"))]
    let _ = positions;
}

/// As [`linear_cross_entropy`], with at most `columns` logits columns live at once where the
/// kernel chunks the vocabulary by a budget (CubeCL devices; elsewhere the same as
/// [`linear_cross_entropy`]): for tests and tuning.
pub fn linear_cross_entropy_in_chunks(
    h: Tensor<2>,
    w: Tensor<2>,
    targets: Tensor<1, Int>,
    columns: usize,
) -> Tensor<1> {
    #[cfg(feature = "cube")]
    if cube::covers(&h, &[w.dtype()]) {
        return cube::linear_cross_entropy(h, w, targets, Some(columns));
    }
    let _ = columns;
    linear_cross_entropy(h, w, targets)
}

static ENABLED: AtomicBool = AtomicBool::new(true);

/// Turns the fused kernels on or off for the whole process (`training.fused_kernels`); off,
/// every function here takes its composed path.
pub fn set_enabled(on: bool) {
    ENABLED.store(on, Ordering::Relaxed);
}

/// Whether the fused kernels are on (`training.fused_kernels`).
fn enabled() -> bool {
    ENABLED.load(Ordering::Relaxed)
}

/// Whether the fused CPU kernels cover this tensor: f32 on the flex backend (with or without
/// autodiff), and kernels enabled.
fn fusable<const D: usize>(t: &Tensor<D>) -> bool {
    enabled() && t.dtype() == DType::F32 && crate::tensor::on_host_threads(&t.device())
}

// ---------------------------------------------------------------------------------------
// Flex: forward only (no autodiff tracking).

impl KilnOps for Flex {
    fn kiln_linear(x: FlexTensor, w: FlexTensor) -> FlexTensor {
        linear::forward(&x, &w)
    }

    fn kiln_rms_norm(x: FlexTensor, w: FlexTensor, eps: f64) -> FlexTensor {
        rms_norm::forward(&x, &w, eps).0
    }

    fn kiln_swiglu(gate: FlexTensor, up: FlexTensor) -> FlexTensor {
        swiglu::forward(&gate, &up)
    }

    fn kiln_rope(x: FlexTensor, cos: FlexTensor, sin: FlexTensor, heads: usize) -> FlexTensor {
        rope::forward(&x, &cos, &sin, heads)
    }

    fn kiln_causal_attention(
        q: FlexTensor,
        k: FlexTensor,
        v: FlexTensor,
        scale: f64,
    ) -> FlexTensor {
        attention::forward_only(&q, &k, &v, scale)
    }

    fn kiln_causal_softmax(scores: FlexTensor, scale: f64) -> FlexTensor {
        softmax::forward(&scores, scale)
    }

    fn kiln_linear_cross_entropy(h: FlexTensor, w: FlexTensor, targets: FlexTensor) -> FlexTensor {
        cross_entropy::forward(&h, &w, &targets, (false, false)).loss
    }
}

// ---------------------------------------------------------------------------------------
// Autodiff over flex: forward plus one backward step per kernel.

impl<C: CheckpointStrategy> KilnOps for Autodiff<Flex, C> {
    fn kiln_linear(x: FloatTensor<Self>, w: FloatTensor<Self>) -> FloatTensor<Self> {
        linear::autodiff::<C>(x, w)
    }

    fn kiln_rms_norm(x: FloatTensor<Self>, w: FloatTensor<Self>, eps: f64) -> FloatTensor<Self> {
        rms_norm::autodiff::<C>(x, w, eps)
    }

    fn kiln_swiglu(gate: FloatTensor<Self>, up: FloatTensor<Self>) -> FloatTensor<Self> {
        swiglu::autodiff::<C>(gate, up)
    }

    fn kiln_rope(
        x: FloatTensor<Self>,
        cos: FloatTensor<Self>,
        sin: FloatTensor<Self>,
        heads: usize,
    ) -> FloatTensor<Self> {
        rope::autodiff::<C>(x, cos, sin, heads)
    }

    fn kiln_causal_attention(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        scale: f64,
    ) -> FloatTensor<Self> {
        attention::autodiff::<C>(q, k, v, scale)
    }

    fn kiln_causal_softmax(scores: FloatTensor<Self>, scale: f64) -> FloatTensor<Self> {
        softmax::autodiff::<C>(scores, scale)
    }

    fn kiln_linear_cross_entropy(
        h: FloatTensor<Self>,
        w: FloatTensor<Self>,
        targets: IntTensor<Self>,
    ) -> FloatTensor<Self> {
        cross_entropy::autodiff::<C>(h, w, targets)
    }
}

// ---------------------------------------------------------------------------------------
// Helpers shared by the kernels.

/// Rows per block of work: small enough to spread over threads, large enough to amortise
/// scheduling. Fixed, so results do not depend on the thread count.
const ROW_BLOCK: usize = 16;

/// `t` as a contiguous f32 slice (copies a strided view once).
fn contiguous(t: &FlexTensor) -> FlexTensor {
    assert_eq!(t.dtype(), DType::F32, "kiln kernels take f32 tensors");
    t.to_contiguous()
}

/// The f32 elements of a contiguous tensor.
fn values(t: &FlexTensor) -> &[f32] {
    t.as_slice::<f32>()
        .expect("kiln kernels: contiguous f32 tensor expected")
}

/// A contiguous f32 tensor owning `v`.
fn tensor(v: Vec<f32>, shape: impl Into<Shape>) -> FlexTensor {
    FlexTensor::new(
        Bytes::from_elems(v),
        Layout::contiguous(shape.into()),
        DType::F32,
    )
}

/// The dimensions of a flex tensor.
fn dims(t: &FlexTensor) -> Vec<usize> {
    t.layout().shape().iter().copied().collect()
}

/// The value of a one-element tensor (the upstream gradient of a scalar loss).
fn scalar(t: &FlexTensor) -> f32 {
    values(&contiguous(t))[0]
}

#[cfg(test)]
mod tests;

/// `RxCxP,RxCxP,RxCxP` as three `(rows, cols, planes)`: the flash attention kernels' tilings
/// (`KILN_FLASH_TILING`, read by `cube::flash`), parsed here so that CI's default build tests it.
#[cfg_attr(not(feature = "cube"), allow(dead_code))]
fn parse_flash_tiling(text: &str) -> Result<[(usize, usize, usize); 3], String> {
    let shapes = text
        .split(',')
        .map(|part| {
            let n: Vec<usize> = part
                .trim()
                .split('x')
                .map(|v| {
                    v.trim()
                        .parse::<usize>()
                        .map_err(|e| format!("{part:?}: {e}"))
                })
                .collect::<Result<_, _>>()?;
            let [rows, cols, planes] = n[..] else {
                return Err(format!("{part:?} is not ROWSxCOLSxPLANES"));
            };
            let size = |v: usize| v > 0 && v <= 256 && v.is_multiple_of(16);
            if !size(rows) || !size(cols) || !(1..=16).contains(&planes) {
                return Err(format!(
                    "{part:?}: sizes are multiples of 16 up to 256, planes 1 to 16"
                ));
            }
            Ok((rows, cols, planes))
        })
        .collect::<Result<Vec<_>, _>>()?;
    shapes
        .try_into()
        .map_err(|v: Vec<_>| format!("three tilings (forward, dq, dk/dv), not {}", v.len()))
}

#[cfg(test)]
mod flash_tiling_tests {
    use super::parse_flash_tiling as parse_tiling;

    #[test]
    fn tilings_parse_and_bad_ones_are_refused() {
        assert_eq!(
            parse_tiling("64x64x4, 64x32x4,32x32x2"),
            Ok([(64, 64, 4), (64, 32, 4), (32, 32, 2)])
        );
        for bad in [
            "",
            "64x64x4",
            "64x64x4,64x32x4",
            "64x64x4,64x32x4,32x32x4,16x16x1",
            "64x64,64x32x4,32x32x4",
            "60x64x4,64x32x4,32x32x4",
            "64x64x0,64x32x4,32x32x4",
            "512x64x4,64x32x4,32x32x4",
            "64x64xa,64x32x4,32x32x4",
        ] {
            assert!(parse_tiling(bad).is_err(), "{bad:?}");
        }
    }
}

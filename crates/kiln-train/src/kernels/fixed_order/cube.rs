//! The sum of squares of a set of device tensors (the gradients' global norm) in an order
//! fixed by the tensors' sizes alone.
//!
//! burn's device sum is autotuned: its candidates include a one-kernel sum with atomic adds
//! (whose order changes from launch to launch) and cube counts picked by timing (which differ
//! between processes). The clipping coefficient comes from this sum, so two data-parallel
//! ranks holding the same all-reduced gradients could clip them by coefficients one ulp apart
//! and drift apart (the replica check stops such a run), and a resumed run could differ from
//! the uninterrupted one. Here each unit sums a fixed, strided slice of its tensor in f32, the
//! partials are summed the same way until a few remain per tensor (written into one buffer at
//! each tensor's offset, read back once), and the host adds those in f64 in parameter order:
//! the same bits on every rank, in every process, with no autotuning.

use crate::kernels::device::tensors::{dense, elem, f32_vector, launch_1d};
use burn::backend::Cube;
use burn::tensor::DType;
use burn_cubecl::tensor::CubeTensor;
use cubecl::prelude::*;

/// Elements each unit sums (at least; fewer units than this many per element are launched).
const PER_UNIT: usize = 64;
/// The most units one pass launches.
const MAX_UNITS: usize = 1 << 16;

/// Unit `u` of `units` sums `x[u], x[u + units], x[u + 2 units], ...` (their squares when
/// `square`) in f32 into `out[base + u]`.
#[cube(launch)]
fn partial_sums_kernel<F: Float>(
    x: &Tensor<F>,
    out: &mut Tensor<f32>,
    n: u32,
    units: u32,
    base: u32,
    #[comptime] square: bool,
    #[define(F)] _dtype: ElemType,
) {
    let u = ABSOLUTE_POS;
    let (n, units) = (n as usize, units as usize);
    if u >= units {
        terminate!();
    }
    let steps = (n - u).div_ceil(units);
    let mut acc = 0.0f32;
    for s in 0..steps {
        let v = f32::cast_from(x[u + s * units]);
        if square {
            acc += v * v;
        } else {
            acc += v;
        }
    }
    out[base as usize + u] = acc;
}

/// Units for a pass over `n` values.
fn units_for(n: usize) -> usize {
    n.div_ceil(PER_UNIT).clamp(1, MAX_UNITS)
}

/// One pass: `units` partial sums of `x`'s `n` values (of their squares when `square`),
/// written at `out[base..base + units]`.
fn pass_into(x: &CubeTensor, n: usize, units: usize, square: bool, out: &CubeTensor, base: usize) {
    let (count, dim) = launch_1d(units);
    partial_sums_kernel::launch(
        &x.client,
        count,
        dim,
        x.clone().into_tensor_arg(),
        out.clone().into_tensor_arg(),
        n as u32,
        units as u32,
        base as u32,
        square,
        elem(x),
    );
}

/// One pass into a new tensor of `units` partial sums.
fn pass(x: &CubeTensor, n: usize, units: usize, square: bool) -> CubeTensor {
    let out = f32_vector(x, units);
    pass_into(x, n, units, square, &out, 0);
    out
}

/// How many partial sums [`partials_into`] leaves for `n` values: at most `PER_UNIT`.
fn partial_count(n: usize) -> usize {
    let mut len = units_for(n);
    while len > PER_UNIT {
        len = units_for(len);
    }
    len
}

/// The [`partial_count`] f32 partial sums of the squares of `x`'s `n` elements, written at
/// `out[base..]`: passes over `x` and then over its partials until at most `PER_UNIT`
/// remain, the last pass writing into `out` (so that every tensor's partials land in one
/// buffer, read back at once).
fn partials_into(x: &CubeTensor, n: usize, out: &CubeTensor, base: usize) {
    let (mut len, mut square) = (units_for(n), true);
    let mut sums = x.clone();
    let mut values = n;
    while len > PER_UNIT {
        sums = pass(&sums, values, len, square);
        (values, len, square) = (len, units_for(len), false);
    }
    pass_into(&sums, values, len, square, out, base);
}

/// At most `PER_UNIT` f32 partial sums of the squares of `x`'s `n` elements, and how many.
fn partials(x: CubeTensor, n: usize) -> (CubeTensor, usize) {
    let len = partial_count(n);
    let out = f32_vector(&x, len);
    partials_into(&x, n, &out, 0);
    (out, len)
}

/// The sum of squares of `x`'s elements as a one-element f32 tensor on its device, in the
/// same fixed order, with no read-back (Muon's Frobenius norm); `None` when `x` is empty or
/// not an f32 or bf16 tensor on a CubeCL device.
pub(super) fn on_device(x: &Host1) -> Option<Host1> {
    let n = x.dims()[0];
    if !matches!(x.dtype(), DType::F32 | DType::BF16) || n == 0 {
        return None;
    }
    let prim = dense(x.clone().try_into_primitive::<Cube>().ok()?);
    let (sums, len) = partials(prim, n);
    Some(Host1::from_primitive::<Cube>(pass(&sums, len, 1, false)))
}

/// A burn tensor (cubecl's prelude names its own `Tensor`).
type Host1 = burn::tensor::Tensor<1>;

/// The sum of squares of every element of `tensors`, when all are f32 or bf16 tensors on a
/// CubeCL device; `None` otherwise (nothing launched).
pub(super) fn square_sum(tensors: &[Host1]) -> Option<f64> {
    // Every tensor converted once; one that is not a device tensor of those types: `None`.
    let prims = tensors
        .iter()
        .map(|t| {
            matches!(t.dtype(), DType::F32 | DType::BF16)
                .then(|| t.clone().try_into_primitive::<Cube>().ok())
                .flatten()
        })
        .collect::<Option<Vec<_>>>()?;
    if prims.is_empty() {
        return None;
    }
    // Each non-empty tensor with its length and the number of partials it leaves.
    let pieces: Vec<(CubeTensor, usize, usize)> = prims
        .into_iter()
        .zip(tensors)
        .filter(|(_, t)| t.dims()[0] > 0)
        .map(|(prim, t)| (dense(prim), t.dims()[0], partial_count(t.dims()[0])))
        .collect();
    let Some((first, _, _)) = pieces.first() else {
        return Some(0.0);
    };
    // Every tensor's partials into one buffer, read back once and added in parameter order.
    let out = f32_vector(first, pieces.iter().map(|p| p.2).sum());
    let mut base = 0;
    for (x, n, count) in &pieces {
        partials_into(x, *n, &out, base);
        base += count;
    }
    let sums = Host1::from_primitive::<Cube>(out)
        .into_data()
        .try_to_vec::<f32>()
        .ok()?;
    Some(sums.iter().map(|&s| f64::from(s)).sum())
}

/// The kernels in `e`, defined for no device (see [`crate::kernels::device::offline`]).
#[cfg(any(feature = "cuda", feature = "rocm"))]
pub(in crate::kernels) fn offline(
    e: ElemType,
) -> Vec<(&'static str, Box<dyn cubecl_runtime::kernel::CubeKernel>)> {
    use crate::kernels::device::offline::{props, settings, tensor};
    let (p, t) = props(None);
    [("sums", false), ("square_sums", true)]
        .into_iter()
        .map(|(name, square)| {
            let k: Box<dyn cubecl_runtime::kernel::CubeKernel> =
                Box::new(partial_sums_kernel::PartialSumsKernel::new(
                    settings(256),
                    p.clone(),
                    t.clone(),
                    tensor(),
                    tensor(),
                    (),
                    (),
                    (),
                    square,
                    e,
                ));
            (name, k)
        })
        .collect()
}

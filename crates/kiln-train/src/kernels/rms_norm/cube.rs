//! RMSNorm in CubeCL: one cube per row forward and for `dx` (its units stride over the row, so
//! reads are coalesced, and add their partial sums in a fixed tree), then `dw` in two
//! fixed-order passes: one unit per column and block of rows, then one per column.

use crate::kernels::device::reduce::{cube_sum, launch_rows, row_units};
use crate::kernels::device::tensors::{
    UNITS, dense, dims, elem, empty_like, f32_vector, launch_1d,
};
use burn::backend::autodiff::checkpoint::{base::Checkpointer, strategy::CheckpointStrategy};
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn::backend::tensor::FloatTensor;
use burn::backend::{Autodiff, Backend, Dispatch, backend_extension};
use burn_cubecl::CubeBackend;
use burn_cubecl::tensor::CubeTensor;
use cubecl::prelude::*;

#[cube(launch)]
fn rms_norm_forward_kernel<F: Float>(
    x: &Tensor<F>,
    w: &Tensor<F>,
    y: &mut Tensor<F>,
    inv: &mut Tensor<f32>,
    rows: u32,
    width: u32,
    eps: f32,
    #[comptime] units: usize,
    #[define(F)] _dtype: ElemType,
) {
    // One cube a row; its units stride over the columns, so neighbouring units read
    // neighbouring elements.
    let r = CUBE_POS;
    if r >= rows as usize {
        terminate!();
    }
    let (d, u) = (width as usize, UNIT_POS as usize);
    let base = r * d;
    let mut sum = 0.0f32;
    let mut i = u;
    while i < d {
        let v = f32::cast_from(x[base + i]);
        sum += v * v;
        i += units;
    }
    let mut partial = Shared::<[f32]>::new_slice(units);
    let total = cube_sum(&mut partial, sum);
    let ri = 1.0f32 / (total / f32::cast_from(width) + eps).sqrt();
    if u == 0 {
        inv[r] = ri;
    }
    let mut i = u;
    while i < d {
        y[base + i] = F::cast_from(f32::cast_from(x[base + i]) * ri * f32::cast_from(w[i]));
        i += units;
    }
}

#[cube(launch)]
fn rms_norm_dx_kernel<F: Float>(
    dy: &Tensor<F>,
    x: &Tensor<F>,
    w: &Tensor<F>,
    inv: &Tensor<f32>,
    dx: &mut Tensor<F>,
    rows: u32,
    width: u32,
    #[comptime] units: usize,
    #[define(F)] _dtype: ElemType,
) {
    let r = CUBE_POS;
    if r >= rows as usize {
        terminate!();
    }
    let (d, u) = (width as usize, UNIT_POS as usize);
    let base = r * d;
    let ri = inv[r];
    let mut dot = 0.0f32;
    let mut i = u;
    while i < d {
        dot += f32::cast_from(dy[base + i]) * f32::cast_from(w[i]) * f32::cast_from(x[base + i]);
        i += units;
    }
    let mut partial = Shared::<[f32]>::new_slice(units);
    let total = cube_sum(&mut partial, dot);
    let c = ri * ri * total / f32::cast_from(width);
    let mut i = u;
    while i < d {
        let g = f32::cast_from(dy[base + i]) * f32::cast_from(w[i]);
        dx[base + i] = F::cast_from(ri * (g - f32::cast_from(x[base + i]) * c));
        i += units;
    }
}

/// `dw`, first pass: the sum for column `c` over one block of `block_rows` rows (the cube's
/// `y` position), into `part[block * width + c]`.
#[cube(launch)]
fn rms_norm_dw_partial_kernel<F: Float>(
    dy: &Tensor<F>,
    x: &Tensor<F>,
    inv: &Tensor<f32>,
    part: &mut Tensor<f32>,
    rows: u32,
    width: u32,
    block_rows: u32,
    #[define(F)] _dtype: ElemType,
) {
    let c = ABSOLUTE_POS_X as usize;
    let d = width as usize;
    if c >= d {
        terminate!();
    }
    let block = CUBE_POS_Y as usize;
    let r0 = block * block_rows as usize;
    let r1 = usize::min(r0 + block_rows as usize, rows as usize);
    let mut sum = 0.0f32;
    for r in r0..r1 {
        let at = r * d + c;
        sum += f32::cast_from(dy[at]) * f32::cast_from(x[at]) * inv[r];
    }
    part[block * d + c] = sum;
}

/// `dw`, second pass: column `c`'s block sums added in block order.
#[cube(launch)]
fn rms_norm_dw_finish_kernel<F: Float>(
    part: &Tensor<f32>,
    dw: &mut Tensor<F>,
    width: u32,
    blocks: u32,
    #[define(F)] _dtype: ElemType,
) {
    let c = ABSOLUTE_POS;
    let d = width as usize;
    if c >= d {
        terminate!();
    }
    let mut sum = 0.0f32;
    for b in 0..blocks as usize {
        sum += part[b * d + c];
    }
    dw[c] = F::cast_from(sum);
}

/// Rows a block of `dw`'s first pass sums: `rows` in one block on CubeCL's CPU runtime (column
/// order, as that runtime's smoke baseline was blessed), else 64 rows a block, at most 4096
/// blocks.
fn dw_block_rows(t: &CubeTensor, rows: usize) -> usize {
    match t.device {
        cubecl::Device::Cpu(_) => rows.max(1),
        _ => rows.div_ceil(4096).max(64),
    }
}

/// `(y, 1/rms per row in f32)` for `x` `[.., d]` and `w` `[d]`.
fn forward(x: CubeTensor, w: CubeTensor, eps: f64) -> (CubeTensor, CubeTensor) {
    let (x, w) = (dense(x), dense(w));
    let shape = dims(&x);
    let d = shape.last().copied().unwrap_or(1);
    let rows = shape.iter().product::<usize>() / d.max(1);
    let y = empty_like(&x, shape);
    let inv = f32_vector(&x, rows);
    let units = row_units(&x);
    let (count, dim) = launch_rows(rows, units);
    rms_norm_forward_kernel::launch(
        &x.client,
        count,
        dim,
        x.clone().into_tensor_arg(),
        w.into_tensor_arg(),
        y.clone().into_tensor_arg(),
        inv.clone().into_tensor_arg(),
        rows as u32,
        d as u32,
        eps as f32,
        units,
        elem(&x),
    );
    (y, inv)
}

/// `(dx, dw)` for the upstream gradient `dy`, from the saved `x`, `w` and `1/rms`.
fn backward(
    dy: CubeTensor,
    x: &CubeTensor,
    w: &CubeTensor,
    inv: &CubeTensor,
) -> (CubeTensor, CubeTensor) {
    let dy = dense(dy);
    let shape = dims(x);
    let d = shape.last().copied().unwrap_or(1);
    let rows = shape.iter().product::<usize>() / d.max(1);
    let dx = empty_like(x, shape);
    let units = row_units(x);
    let (count, dim) = launch_rows(rows, units);
    rms_norm_dx_kernel::launch(
        &x.client,
        count,
        dim,
        dy.clone().into_tensor_arg(),
        x.clone().into_tensor_arg(),
        w.clone().into_tensor_arg(),
        inv.clone().into_tensor_arg(),
        dx.clone().into_tensor_arg(),
        rows as u32,
        d as u32,
        units,
        elem(x),
    );
    (dx, dw(dy, x, inv, rows, d))
}

/// `dw` `[d]`: per column, the sum over rows of `dy * x / rms`, in two passes (blocks of rows,
/// then the blocks in order) so that a GPU has `d` times the blocks of units at work, not `d`.
fn dw(dy: CubeTensor, x: &CubeTensor, inv: &CubeTensor, rows: usize, d: usize) -> CubeTensor {
    let block_rows = dw_block_rows(x, rows);
    let blocks = rows.div_ceil(block_rows).max(1);
    let part = f32_vector(x, blocks * d);
    let (count, dim) = launch_1d(d);
    let columns = d.div_ceil(UNITS as usize).max(1) as u32;
    rms_norm_dw_partial_kernel::launch(
        &x.client,
        CubeCount::Static(columns, blocks as u32, 1),
        dim,
        dy.into_tensor_arg(),
        x.clone().into_tensor_arg(),
        inv.clone().into_tensor_arg(),
        part.clone().into_tensor_arg(),
        rows as u32,
        d as u32,
        block_rows as u32,
        elem(x),
    );
    let dw = empty_like(x, [d]);
    rms_norm_dw_finish_kernel::launch(
        &x.client,
        count,
        dim,
        part.into_tensor_arg(),
        dw.clone().into_tensor_arg(),
        d as u32,
        blocks as u32,
        elem(x),
    );
    dw
}

type Ad<C> = Autodiff<CubeBackend, C>;

/// RMSNorm recorded as one autodiff op.
fn autodiff<C: CheckpointStrategy>(
    x: FloatTensor<Ad<C>>,
    w: FloatTensor<Ad<C>>,
    eps: f64,
) -> FloatTensor<Ad<C>> {
    #[derive(Debug)]
    struct RmsNormBackward;

    impl Backward<CubeBackend, 2> for RmsNormBackward {
        /// `x`, `w` (contiguous), `1/rms` per row.
        type State = (CubeTensor, CubeTensor, CubeTensor);

        fn backward(self, ops: Ops<Self::State, 2>, grads: &mut Gradients, _: &mut Checkpointer) {
            let dy = grads.consume::<CubeBackend>(&ops.node);
            let (x, w, inv) = ops.state;
            let (dx, dw) = backward(dy, &x, &w, &inv);
            for (node, g) in ops.parents.into_iter().zip([dx, dw]) {
                if let Some(node) = node {
                    grads.register::<CubeBackend>(node.id, g);
                }
            }
        }
    }

    match RmsNormBackward
        .prepare::<C>([x.node(), w.node()])
        .compute_bound()
        .stateful()
    {
        OpsKind::Tracked(prep) => {
            let (xc, wc) = (dense(x.primitive().clone()), dense(w.primitive().clone()));
            let (y, inv) = forward(xc.clone(), wc.clone(), eps);
            prep.finish((xc, wc, inv), y)
        }
        OpsKind::UnTracked(prep) => {
            prep.finish(forward(x.primitive().clone(), w.primitive().clone(), eps).0)
        }
    }
}

/// RMSNorm as one op on burn's `Cube` backend (forward) and on autodiff over it (forward and
/// one backward step), registered through a backend extension.
#[backend_extension(Cube, Autodiff)]
pub trait CubeRmsNorm: Backend {
    /// RMSNorm over the last dimension: `x / sqrt(mean(x^2) + eps) * w`.
    fn device_rms_norm(x: FloatTensor<Self>, w: FloatTensor<Self>, eps: f64) -> FloatTensor<Self>;
}

impl CubeRmsNorm for CubeBackend {
    fn device_rms_norm(x: CubeTensor, w: CubeTensor, eps: f64) -> CubeTensor {
        forward(x, w, eps).0
    }
}

impl<C: CheckpointStrategy> CubeRmsNorm for Autodiff<CubeBackend, C> {
    fn device_rms_norm(x: FloatTensor<Self>, w: FloatTensor<Self>, eps: f64) -> FloatTensor<Self> {
        autodiff::<C>(x, w, eps)
    }
}

/// RMSNorm of `x` on a CubeCL device ([`CubeRmsNorm`]).
pub(super) fn rms_norm<const D: usize>(
    x: burn::tensor::Tensor<D>,
    w: burn::tensor::Tensor<1>,
    eps: f64,
) -> burn::tensor::Tensor<D> {
    burn::tensor::Tensor::from_dispatch(Dispatch::device_rms_norm(
        x.into_dispatch(),
        w.into_dispatch(),
        eps,
    ))
}

/// The kernels in `e`, defined for no device (see [`crate::kernels::device::offline`]): a row's cube
/// of 256 units.
#[cfg(any(feature = "cuda", feature = "rocm"))]
pub(in crate::kernels) fn offline(
    e: ElemType,
) -> Vec<(&'static str, Box<dyn cubecl_runtime::kernel::CubeKernel>)> {
    use crate::kernels::device::offline::{props, settings, tensor};
    let (p, t) = props(None);
    let units = 256;
    let s = || settings(units);
    vec![
        (
            "forward",
            Box::new(rms_norm_forward_kernel::RmsNormForwardKernel::new(
                s(),
                p.clone(),
                t.clone(),
                tensor(),
                tensor(),
                tensor(),
                tensor(),
                (),
                (),
                (),
                units,
                e,
            )),
        ),
        (
            "dx",
            Box::new(rms_norm_dx_kernel::RmsNormDxKernel::new(
                s(),
                p.clone(),
                t.clone(),
                tensor(),
                tensor(),
                tensor(),
                tensor(),
                tensor(),
                (),
                (),
                units,
                e,
            )),
        ),
        (
            "dw_partial",
            Box::new(rms_norm_dw_partial_kernel::RmsNormDwPartialKernel::new(
                s(),
                p.clone(),
                t.clone(),
                tensor(),
                tensor(),
                tensor(),
                tensor(),
                (),
                (),
                (),
                e,
            )),
        ),
        (
            "dw_finish",
            Box::new(rms_norm_dw_finish_kernel::RmsNormDwFinishKernel::new(
                s(),
                p,
                t,
                tensor(),
                tensor(),
                (),
                (),
                e,
            )),
        ),
    ]
}

//! RMSNorm and SwiGLU in CubeCL: one unit per row (RMSNorm, forward and `dx`), one per
//! column (`dw`, a fixed-order sum over the rows), one per element (SwiGLU).

use super::{dense, dims, elem, empty_like, launch_1d};
use burn::backend::Autodiff;
use burn::backend::autodiff::checkpoint::{base::Checkpointer, strategy::CheckpointStrategy};
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn::backend::tensor::FloatTensor;
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
    #[define(F)] _dtype: ElemType,
) {
    let r = ABSOLUTE_POS;
    if r >= rows as usize {
        terminate!();
    }
    let d = width as usize;
    let base = r * d;
    let mut sum = 0.0f32;
    for i in 0..d {
        let v = f32::cast_from(x[base + i]);
        sum += v * v;
    }
    let ri = 1.0f32 / (sum / f32::cast_from(width) + eps).sqrt();
    inv[r] = ri;
    for i in 0..d {
        y[base + i] = F::cast_from(f32::cast_from(x[base + i]) * ri * f32::cast_from(w[i]));
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
    #[define(F)] _dtype: ElemType,
) {
    let r = ABSOLUTE_POS;
    if r >= rows as usize {
        terminate!();
    }
    let d = width as usize;
    let base = r * d;
    let ri = inv[r];
    let mut dot = 0.0f32;
    for i in 0..d {
        dot += f32::cast_from(dy[base + i]) * f32::cast_from(w[i]) * f32::cast_from(x[base + i]);
    }
    let c = ri * ri * dot / f32::cast_from(width);
    for i in 0..d {
        let g = f32::cast_from(dy[base + i]) * f32::cast_from(w[i]);
        dx[base + i] = F::cast_from(ri * (g - f32::cast_from(x[base + i]) * c));
    }
}

#[cube(launch)]
fn rms_norm_dw_kernel<F: Float>(
    dy: &Tensor<F>,
    x: &Tensor<F>,
    inv: &Tensor<f32>,
    dw: &mut Tensor<F>,
    rows: u32,
    width: u32,
    #[define(F)] _dtype: ElemType,
) {
    let c = ABSOLUTE_POS;
    let d = width as usize;
    if c >= d {
        terminate!();
    }
    let mut sum = 0.0f32;
    for r in 0..rows as usize {
        let at = r * d + c;
        sum += f32::cast_from(dy[at]) * f32::cast_from(x[at]) * inv[r];
    }
    dw[c] = F::cast_from(sum);
}

#[cube(launch)]
fn swiglu_forward_kernel<F: Float>(
    gate: &Tensor<F>,
    up: &Tensor<F>,
    y: &mut Tensor<F>,
    n: u32,
    #[define(F)] _dtype: ElemType,
) {
    let i = ABSOLUTE_POS;
    if i >= n as usize {
        terminate!();
    }
    let g = f32::cast_from(gate[i]);
    let s = 1.0f32 / (1.0f32 + (-g).exp());
    y[i] = F::cast_from(g * s * f32::cast_from(up[i]));
}

#[cube(launch)]
fn swiglu_backward_kernel<F: Float>(
    dy: &Tensor<F>,
    gate: &Tensor<F>,
    up: &Tensor<F>,
    dgate: &mut Tensor<F>,
    dup: &mut Tensor<F>,
    n: u32,
    #[define(F)] _dtype: ElemType,
) {
    let i = ABSOLUTE_POS;
    if i >= n as usize {
        terminate!();
    }
    let g = f32::cast_from(gate[i]);
    let u = f32::cast_from(up[i]);
    let d = f32::cast_from(dy[i]);
    let s = 1.0f32 / (1.0f32 + (-g).exp());
    dgate[i] = F::cast_from(d * u * s * (1.0f32 + g * (1.0f32 - s)));
    dup[i] = F::cast_from(d * g * s);
}

/// `(y, 1/rms per row in f32)` for `x` `[.., d]` and `w` `[d]`.
pub(super) fn rms_norm_forward(x: CubeTensor, w: CubeTensor, eps: f64) -> (CubeTensor, CubeTensor) {
    let (x, w) = (dense(x), dense(w));
    let shape = dims(&x);
    let d = shape.last().copied().unwrap_or(1);
    let rows = shape.iter().product::<usize>() / d.max(1);
    let y = empty_like(&x, shape);
    let inv = super::f32_vector(&x, rows);
    let (count, dim) = launch_1d(rows);
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
        elem(&x),
    );
    (y, inv)
}

/// `(dx, dw)` for the upstream gradient `dy`, from the saved `x`, `w` and `1/rms`.
fn rms_norm_backward(
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
    let dw = empty_like(x, [d]);
    let (count, dim) = launch_1d(rows);
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
        elem(x),
    );
    let (count, dim) = launch_1d(d);
    rms_norm_dw_kernel::launch(
        &x.client,
        count,
        dim,
        dy.into_tensor_arg(),
        x.clone().into_tensor_arg(),
        inv.clone().into_tensor_arg(),
        dw.clone().into_tensor_arg(),
        rows as u32,
        d as u32,
        elem(x),
    );
    (dx, dw)
}

pub(super) fn swiglu_forward(gate: CubeTensor, up: CubeTensor) -> CubeTensor {
    let (gate, up) = (dense(gate), dense(up));
    let shape = dims(&gate);
    let n = shape.iter().product::<usize>();
    let y = empty_like(&gate, shape);
    let (count, dim) = launch_1d(n);
    swiglu_forward_kernel::launch(
        &gate.client,
        count,
        dim,
        gate.clone().into_tensor_arg(),
        up.into_tensor_arg(),
        y.clone().into_tensor_arg(),
        n as u32,
        elem(&gate),
    );
    y
}

fn swiglu_backward(dy: CubeTensor, gate: &CubeTensor, up: &CubeTensor) -> (CubeTensor, CubeTensor) {
    let dy = dense(dy);
    let shape = dims(gate);
    let n = shape.iter().product::<usize>();
    let (dgate, dup) = (empty_like(gate, shape.clone()), empty_like(gate, shape));
    let (count, dim) = launch_1d(n);
    swiglu_backward_kernel::launch(
        &gate.client,
        count,
        dim,
        dy.into_tensor_arg(),
        gate.clone().into_tensor_arg(),
        up.clone().into_tensor_arg(),
        dgate.clone().into_tensor_arg(),
        dup.clone().into_tensor_arg(),
        n as u32,
        elem(gate),
    );
    (dgate, dup)
}

type Ad<C> = Autodiff<CubeBackend, C>;

/// RMSNorm recorded as one autodiff op.
pub(super) fn rms_norm_autodiff<C: CheckpointStrategy>(
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
            let (dx, dw) = rms_norm_backward(dy, &x, &w, &inv);
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
            let (y, inv) = rms_norm_forward(xc.clone(), wc.clone(), eps);
            prep.finish((xc, wc, inv), y)
        }
        OpsKind::UnTracked(prep) => {
            prep.finish(rms_norm_forward(x.primitive().clone(), w.primitive().clone(), eps).0)
        }
    }
}

/// SwiGLU recorded as one autodiff op.
pub(super) fn swiglu_autodiff<C: CheckpointStrategy>(
    gate: FloatTensor<Ad<C>>,
    up: FloatTensor<Ad<C>>,
) -> FloatTensor<Ad<C>> {
    #[derive(Debug)]
    struct SwigluBackward;

    impl Backward<CubeBackend, 2> for SwigluBackward {
        /// `gate`, `up` (contiguous).
        type State = (CubeTensor, CubeTensor);

        fn backward(self, ops: Ops<Self::State, 2>, grads: &mut Gradients, _: &mut Checkpointer) {
            let dy = grads.consume::<CubeBackend>(&ops.node);
            let (gate, up) = ops.state;
            let (dgate, dup) = swiglu_backward(dy, &gate, &up);
            for (node, g) in ops.parents.into_iter().zip([dgate, dup]) {
                if let Some(node) = node {
                    grads.register::<CubeBackend>(node.id, g);
                }
            }
        }
    }

    match SwigluBackward
        .prepare::<C>([gate.node(), up.node()])
        .compute_bound()
        .stateful()
    {
        OpsKind::Tracked(prep) => {
            let (g, u) = (
                dense(gate.primitive().clone()),
                dense(up.primitive().clone()),
            );
            let y = swiglu_forward(g.clone(), u.clone());
            prep.finish((g, u), y)
        }
        OpsKind::UnTracked(prep) => prep.finish(swiglu_forward(
            gate.primitive().clone(),
            up.primitive().clone(),
        )),
    }
}

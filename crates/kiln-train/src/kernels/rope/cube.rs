//! Rotate-half RoPE with the head transpose in CubeCL: one unit per output element, forward
//! (`[b, t, heads * hd]` in, `[b, heads, t, hd]` out) and backward (the reverse).

use crate::kernels::device::tensors::{dense, dims, elem, empty_like, launch_1d};
use burn::backend::autodiff::checkpoint::{base::Checkpointer, strategy::CheckpointStrategy};
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn::backend::tensor::FloatTensor;
use burn::backend::{Autodiff, Backend, Dispatch, backend_extension};
use burn_cubecl::CubeBackend;
use burn_cubecl::tensor::CubeTensor;
use cubecl::prelude::*;

/// `y[b, h, p, j] = x[b, p, h, j] cos[p, j] + rot(x)[b, p, h, j] sin[p, j]`, with
/// `rot(x)_j = -x_{j + hd/2}` for the first half and `x_{j - hd/2}` for the second.
#[cube(launch)]
fn rope_forward_kernel<F: Float>(
    x: &Tensor<F>,
    cos: &Tensor<F>,
    sin: &Tensor<F>,
    y: &mut Tensor<F>,
    n: u32,
    seq: u32,
    heads: u32,
    head_dim: u32,
    #[define(F)] _dtype: ElemType,
) {
    let o = ABSOLUTE_POS;
    if o >= n as usize {
        terminate!();
    }
    let (t, nh, hd) = (seq as usize, heads as usize, head_dim as usize);
    let half = hd / 2;
    let j = o % hd;
    let p = (o / hd) % t;
    let h = (o / (hd * t)) % nh;
    let b = o / (hd * t * nh);
    let src = (b * t + p) * nh * hd + h * hd;
    let mut rot = 0.0f32;
    if j < half {
        rot -= f32::cast_from(x[src + j + half]);
    } else {
        rot += f32::cast_from(x[src + j - half]);
    }
    let c = f32::cast_from(cos[p * hd + j]);
    let s = f32::cast_from(sin[p * hd + j]);
    y[o] = F::cast_from(f32::cast_from(x[src + j]) * c + rot * s);
}

/// The transpose of the forward map: `dx_j = dy_j cos_j + dy_{j+hd/2} sin_{j+hd/2}` for the
/// first half, `dy_j cos_j - dy_{j-hd/2} sin_{j-hd/2}` for the second.
#[cube(launch)]
fn rope_backward_kernel<F: Float>(
    dy: &Tensor<F>,
    cos: &Tensor<F>,
    sin: &Tensor<F>,
    dx: &mut Tensor<F>,
    n: u32,
    seq: u32,
    heads: u32,
    head_dim: u32,
    #[define(F)] _dtype: ElemType,
) {
    let i = ABSOLUTE_POS;
    if i >= n as usize {
        terminate!();
    }
    let (t, nh, hd) = (seq as usize, heads as usize, head_dim as usize);
    let half = hd / 2;
    let j = i % hd;
    let h = (i / hd) % nh;
    let p = (i / (hd * nh)) % t;
    let b = i / (hd * nh * t);
    let src = ((b * nh + h) * t + p) * hd;
    let row = p * hd;
    let mut acc = f32::cast_from(dy[src + j]) * f32::cast_from(cos[row + j]);
    if j < half {
        acc += f32::cast_from(dy[src + j + half]) * f32::cast_from(sin[row + j + half]);
    } else {
        acc -= f32::cast_from(dy[src + j - half]) * f32::cast_from(sin[row + j - half]);
    }
    dx[i] = F::cast_from(acc);
}

/// `(b, t, heads, hd)` of `x` `[b, t, heads * hd]`.
fn shape_of(x: &CubeTensor, heads: usize) -> [usize; 4] {
    let d = dims(x);
    [d[0], d[1], heads, d[2] / heads.max(1)]
}

fn forward(x: CubeTensor, cos: CubeTensor, sin: CubeTensor, heads: usize) -> CubeTensor {
    let (x, cos, sin) = (dense(x), dense(cos), dense(sin));
    let [b, t, nh, hd] = shape_of(&x, heads);
    let n = b * t * nh * hd;
    let y = empty_like(&x, [b, nh, t, hd]);
    let (count, dim) = launch_1d(n);
    rope_forward_kernel::launch(
        &x.client,
        count,
        dim,
        x.clone().into_tensor_arg(),
        cos.into_tensor_arg(),
        sin.into_tensor_arg(),
        y.clone().into_tensor_arg(),
        n as u32,
        t as u32,
        nh as u32,
        hd as u32,
        elem(&x),
    );
    y
}

fn backward(dy: CubeTensor, cos: &CubeTensor, sin: &CubeTensor, shape: [usize; 4]) -> CubeTensor {
    let dy = dense(dy);
    let [b, t, nh, hd] = shape;
    let n = b * t * nh * hd;
    let dx = empty_like(&dy, [b, t, nh * hd]);
    let (count, dim) = launch_1d(n);
    rope_backward_kernel::launch(
        &dy.client,
        count,
        dim,
        dy.clone().into_tensor_arg(),
        cos.clone().into_tensor_arg(),
        sin.clone().into_tensor_arg(),
        dx.clone().into_tensor_arg(),
        n as u32,
        t as u32,
        nh as u32,
        hd as u32,
        elem(&dy),
    );
    dx
}

/// RoPE recorded as one autodiff op (the tables are constants: no gradient).
fn autodiff<C: CheckpointStrategy>(
    x: FloatTensor<Autodiff<CubeBackend, C>>,
    cos: FloatTensor<Autodiff<CubeBackend, C>>,
    sin: FloatTensor<Autodiff<CubeBackend, C>>,
    heads: usize,
) -> FloatTensor<Autodiff<CubeBackend, C>> {
    #[derive(Debug)]
    struct RopeBackward;

    impl Backward<CubeBackend, 1> for RopeBackward {
        /// cos, sin (contiguous), `(b, t, heads, hd)`.
        type State = (CubeTensor, CubeTensor, [usize; 4]);

        fn backward(self, ops: Ops<Self::State, 1>, grads: &mut Gradients, _: &mut Checkpointer) {
            let [node_x] = ops.parents;
            let dy = grads.consume::<CubeBackend>(&ops.node);
            let (cos, sin, shape) = ops.state;
            if let Some(node) = node_x {
                grads.register::<CubeBackend>(node.id, backward(dy, &cos, &sin, shape));
            }
        }
    }

    let (c, s) = (
        dense(cos.primitive().clone()),
        dense(sin.primitive().clone()),
    );
    match RopeBackward
        .prepare::<C>([x.node()])
        .compute_bound()
        .stateful()
    {
        OpsKind::Tracked(prep) => {
            let shape = shape_of(x.primitive(), heads);
            let y = forward(x.primitive().clone(), c.clone(), s.clone(), heads);
            prep.finish((c, s, shape), y)
        }
        OpsKind::UnTracked(prep) => prep.finish(forward(x.primitive().clone(), c, s, heads)),
    }
}

/// RoPE as one op on burn's `Cube` backend (forward) and on autodiff over it (forward and one
/// backward step), registered through a backend extension.
#[backend_extension(Cube, Autodiff)]
pub trait CubeRope: Backend {
    /// Rotate-half RoPE of `x` `[b, t, heads * hd]`, returned as `[b, heads, t, hd]`.
    fn device_rope(
        x: FloatTensor<Self>,
        cos: FloatTensor<Self>,
        sin: FloatTensor<Self>,
        heads: usize,
    ) -> FloatTensor<Self>;
}

impl CubeRope for CubeBackend {
    fn device_rope(x: CubeTensor, cos: CubeTensor, sin: CubeTensor, heads: usize) -> CubeTensor {
        forward(x, cos, sin, heads)
    }
}

impl<C: CheckpointStrategy> CubeRope for Autodiff<CubeBackend, C> {
    fn device_rope(
        x: FloatTensor<Self>,
        cos: FloatTensor<Self>,
        sin: FloatTensor<Self>,
        heads: usize,
    ) -> FloatTensor<Self> {
        autodiff::<C>(x, cos, sin, heads)
    }
}

/// Rotate-half RoPE on a CubeCL device ([`CubeRope`]).
pub(super) fn rope(
    x: burn::tensor::Tensor<3>,
    cos: burn::tensor::Tensor<2>,
    sin: burn::tensor::Tensor<2>,
    heads: usize,
) -> burn::tensor::Tensor<4> {
    burn::tensor::Tensor::from_dispatch(Dispatch::device_rope(
        x.into_dispatch(),
        cos.into_dispatch(),
        sin.into_dispatch(),
        heads,
    ))
}

/// The kernels in `e`, defined for no device (see [`crate::kernels::device::offline`]).
#[cfg(any(feature = "cuda", feature = "rocm"))]
pub(in crate::kernels) fn offline(
    e: ElemType,
) -> Vec<(&'static str, Box<dyn cubecl_runtime::kernel::CubeKernel>)> {
    use crate::kernels::device::offline::{props, settings, tensor};
    let (p, t) = props(None);
    let s = || settings(256);
    vec![
        (
            "forward",
            Box::new(rope_forward_kernel::RopeForwardKernel::new(
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
                (),
                e,
            )),
        ),
        (
            "backward",
            Box::new(rope_backward_kernel::RopeBackwardKernel::new(
                s(),
                p,
                t,
                tensor(),
                tensor(),
                tensor(),
                tensor(),
                (),
                (),
                (),
                (),
                e,
            )),
        ),
    ]
}

//! SwiGLU's gate in CubeCL: one unit per element, forward and backward.

use crate::kernels::device::tensors::{dense, dims, elem, empty_like, launch_1d};
use burn::backend::autodiff::checkpoint::{base::Checkpointer, strategy::CheckpointStrategy};
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn::backend::tensor::FloatTensor;
use burn::backend::{Autodiff, Backend, Dispatch, backend_extension};
use burn_cubecl::CubeBackend;
use burn_cubecl::tensor::CubeTensor;
use cubecl::prelude::*;

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

fn forward(gate: CubeTensor, up: CubeTensor) -> CubeTensor {
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

fn backward(dy: CubeTensor, gate: &CubeTensor, up: &CubeTensor) -> (CubeTensor, CubeTensor) {
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

/// SwiGLU recorded as one autodiff op.
fn autodiff<C: CheckpointStrategy>(
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
            let (dgate, dup) = backward(dy, &gate, &up);
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
            let y = forward(g.clone(), u.clone());
            prep.finish((g, u), y)
        }
        OpsKind::UnTracked(prep) => {
            prep.finish(forward(gate.primitive().clone(), up.primitive().clone()))
        }
    }
}

/// SwiGLU's gate as one op on burn's `Cube` backend (forward) and on autodiff over it
/// (forward and one backward step), registered through a backend extension.
#[backend_extension(Cube, Autodiff)]
pub trait CubeSwiglu: Backend {
    /// `silu(gate) * up`.
    fn device_swiglu(gate: FloatTensor<Self>, up: FloatTensor<Self>) -> FloatTensor<Self>;
}

impl CubeSwiglu for CubeBackend {
    fn device_swiglu(gate: CubeTensor, up: CubeTensor) -> CubeTensor {
        forward(gate, up)
    }
}

impl<C: CheckpointStrategy> CubeSwiglu for Autodiff<CubeBackend, C> {
    fn device_swiglu(gate: FloatTensor<Self>, up: FloatTensor<Self>) -> FloatTensor<Self> {
        autodiff::<C>(gate, up)
    }
}

/// `silu(gate) * up` on a CubeCL device ([`CubeSwiglu`]).
pub(super) fn swiglu<const D: usize>(
    gate: burn::tensor::Tensor<D>,
    up: burn::tensor::Tensor<D>,
) -> burn::tensor::Tensor<D> {
    burn::tensor::Tensor::from_dispatch(Dispatch::device_swiglu(
        gate.into_dispatch(),
        up.into_dispatch(),
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
            Box::new(swiglu_forward_kernel::SwigluForwardKernel::new(
                s(),
                p.clone(),
                t.clone(),
                tensor(),
                tensor(),
                tensor(),
                (),
                e,
            )),
        ),
        (
            "backward",
            Box::new(swiglu_backward_kernel::SwigluBackwardKernel::new(
                s(),
                p,
                t,
                tensor(),
                tensor(),
                tensor(),
                tensor(),
                tensor(),
                (),
                e,
            )),
        ),
    ]
}

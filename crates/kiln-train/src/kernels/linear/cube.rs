//! `x @ w` (a projection without bias) on CubeCL devices, recorded as one autodiff op whose
//! backward is two products: `dx = dy @ w^T` and `dw = x^T @ dy` over the flattened rows (one
//! matmul for the weight gradient, where burn's batched matmul backward sums per-batch
//! products). Every product is [`product`]: on CubeCL's CPU runtime a kernel fixed in advance,
//! so a run's bits do not depend on which candidate autotune timed fastest in that process.
//!
//! Mixed precision's projection ([`mixed_autodiff`]) is the same op with the casts inside it:
//! `x` and `w` cast to the compute dtype, the product written in the output dtype the caller
//! asks for (f32 for the residual stream) straight from the product where the device's BLAS
//! can (cuBLAS: bf16 inputs, f32 accumulation and output), and the gradients of `x` and `w`
//! written in their own dtypes the same way. Composed, each projection is six cast launches
//! (the two inputs, the output, and each one's gradient); this op does the three that change
//! data (the inputs, and the output's gradient), fewer where they already have the dtype.

use crate::kernels::device::matmul::{product, product_into};
use crate::kernels::device::tensors::{dense, dims};
use burn::backend::autodiff::checkpoint::{base::Checkpointer, strategy::CheckpointStrategy};
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn::backend::ops::FloatTensorOps;
use burn::backend::tensor::FloatTensor;
use burn::backend::{Autodiff, Backend, Dispatch, FloatDType, backend_extension};
use burn::tensor::DType;
use burn_cubecl::CubeBackend;
use burn_cubecl::tensor::CubeTensor;

type Ad<C> = Autodiff<CubeBackend, C>;

/// `x` `[.., in]` as `[rows, in]`.
fn rows(x: CubeTensor) -> CubeTensor {
    let d = dims(&x);
    let inner = d[d.len() - 1];
    let n = d.iter().product::<usize>() / inner.max(1);
    CubeBackend::float_reshape(dense(x), [n, inner].into())
}

/// `x @ w` for `x` `[.., in]` and `w` `[in, out]`: `[.., out]`.
fn forward(x: CubeTensor, w: CubeTensor) -> CubeTensor {
    let shape = dims(&x);
    project(rows(x), w, shape)
}

/// `x2 @ w` for `x2` (`x` as [`rows`]) reshaped to `x`'s leading dimensions `x_shape`.
fn project(x2: CubeTensor, w: CubeTensor, mut x_shape: Vec<usize>) -> CubeTensor {
    if let Some(last) = x_shape.last_mut() {
        *last = dims(&w)[1];
    }
    CubeBackend::float_reshape(product(x2, w), x_shape.into())
}

/// The projection recorded as one autodiff op.
fn autodiff<C: CheckpointStrategy>(
    x: FloatTensor<Ad<C>>,
    w: FloatTensor<Ad<C>>,
) -> FloatTensor<Ad<C>> {
    #[derive(Debug)]
    struct LinearBackward;

    impl Backward<CubeBackend, 2> for LinearBackward {
        /// `x` as `[rows, in]`, `w`, and `x`'s shape.
        type State = (CubeTensor, CubeTensor, Vec<usize>);

        fn backward(self, ops: Ops<Self::State, 2>, grads: &mut Gradients, _: &mut Checkpointer) {
            let dy = rows(grads.consume::<CubeBackend>(&ops.node));
            let (x, w, x_shape) = ops.state;
            let [x_node, w_node] = ops.parents;
            if let Some(node) = x_node {
                let dx = product(dy.clone(), CubeBackend::float_transpose(w));
                grads.register::<CubeBackend>(
                    node.id,
                    CubeBackend::float_reshape(dx, x_shape.into()),
                );
            }
            if let Some(node) = w_node {
                let dw = product(CubeBackend::float_transpose(x), dy);
                grads.register::<CubeBackend>(node.id, dw);
            }
        }
    }

    match LinearBackward
        .prepare::<C>([x.node(), w.node()])
        .compute_bound()
        .stateful()
    {
        OpsKind::Tracked(prep) => {
            let (x2, wp) = (rows(x.primitive().clone()), w.primitive().clone());
            let shape = dims(x.primitive());
            let y = project(x2.clone(), wp.clone(), shape.clone());
            prep.finish((x2, wp, shape), y)
        }
        OpsKind::UnTracked(prep) => {
            prep.finish(forward(x.primitive().clone(), w.primitive().clone()))
        }
    }
}

/// `t` in `dtype` (no launch when it already is).
fn cast(t: CubeTensor, dtype: DType) -> CubeTensor {
    CubeBackend::float_cast(t, FloatDType::from(dtype))
}

/// `x @ w` with both in `compute`, written in `out`, for `x` `[.., in]` and `w` `[in, out]`.
fn mixed_forward(x: CubeTensor, w: CubeTensor, compute: DType, out: DType) -> CubeTensor {
    let shape = dims(&x);
    let (x2, wc) = (rows(cast(x, compute)), cast(w, compute));
    mixed_project(x2, wc, shape, out)
}

/// [`project`] written in `out`.
fn mixed_project(
    x2: CubeTensor,
    wc: CubeTensor,
    mut x_shape: Vec<usize>,
    out: DType,
) -> CubeTensor {
    if let Some(last) = x_shape.last_mut() {
        *last = dims(&wc)[1];
    }
    CubeBackend::float_reshape(product_into(x2, wc, out), x_shape.into())
}

/// The mixed-precision projection recorded as one autodiff op (see the module's docs).
fn mixed_autodiff<C: CheckpointStrategy>(
    x: FloatTensor<Ad<C>>,
    w: FloatTensor<Ad<C>>,
    compute: DType,
    out: DType,
) -> FloatTensor<Ad<C>> {
    #[derive(Debug)]
    struct MixedLinearBackward;

    /// `x` as `[rows, in]` and `w`, both in the compute dtype; `x`'s shape; the dtypes of
    /// `x` and `w` (their gradients').
    type State = (CubeTensor, CubeTensor, Vec<usize>, DType, DType);

    impl Backward<CubeBackend, 2> for MixedLinearBackward {
        type State = State;

        fn backward(self, ops: Ops<Self::State, 2>, grads: &mut Gradients, _: &mut Checkpointer) {
            let (x2, wc, x_shape, x_dtype, w_dtype) = ops.state;
            let dy = cast(rows(grads.consume::<CubeBackend>(&ops.node)), x2.dtype);
            let [x_node, w_node] = ops.parents;
            if let Some(node) = x_node {
                let dx = product_into(dy.clone(), CubeBackend::float_transpose(wc), x_dtype);
                grads.register::<CubeBackend>(
                    node.id,
                    CubeBackend::float_reshape(dx, x_shape.into()),
                );
            }
            if let Some(node) = w_node {
                let dw = product_into(CubeBackend::float_transpose(x2), dy, w_dtype);
                grads.register::<CubeBackend>(node.id, dw);
            }
        }
    }

    match MixedLinearBackward
        .prepare::<C>([x.node(), w.node()])
        .compute_bound()
        .stateful()
    {
        OpsKind::Tracked(prep) => {
            let (xp, wp) = (x.primitive().clone(), w.primitive().clone());
            let (x_dtype, w_dtype, shape) = (xp.dtype, wp.dtype, dims(&xp));
            let (x2, wc) = (rows(cast(xp, compute)), cast(wp, compute));
            let y = mixed_project(x2.clone(), wc.clone(), shape.clone(), out);
            prep.finish((x2, wc, shape, x_dtype, w_dtype), y)
        }
        OpsKind::UnTracked(prep) => prep.finish(mixed_forward(
            x.primitive().clone(),
            w.primitive().clone(),
            compute,
            out,
        )),
    }
}

/// The projection and mixed precision's projection as ops on burn's `Cube` backend (forward)
/// and on autodiff over it (forward and one backward step), registered through a backend
/// extension.
#[backend_extension(Cube, Autodiff)]
pub trait CubeLinear: Backend {
    /// `x @ w` for `x` `[.., in]`, `w` `[in, out]`.
    fn device_linear(x: FloatTensor<Self>, w: FloatTensor<Self>) -> FloatTensor<Self>;
    /// `x @ w` with both cast to `compute`, written in `out`.
    fn device_mixed_linear(
        x: FloatTensor<Self>,
        w: FloatTensor<Self>,
        compute: DType,
        out: DType,
    ) -> FloatTensor<Self>;
}

impl CubeLinear for CubeBackend {
    fn device_linear(x: CubeTensor, w: CubeTensor) -> CubeTensor {
        forward(x, w)
    }

    fn device_mixed_linear(x: CubeTensor, w: CubeTensor, compute: DType, out: DType) -> CubeTensor {
        mixed_forward(x, w, compute, out)
    }
}

impl<C: CheckpointStrategy> CubeLinear for Autodiff<CubeBackend, C> {
    fn device_linear(x: FloatTensor<Self>, w: FloatTensor<Self>) -> FloatTensor<Self> {
        autodiff::<C>(x, w)
    }

    fn device_mixed_linear(
        x: FloatTensor<Self>,
        w: FloatTensor<Self>,
        compute: DType,
        out: DType,
    ) -> FloatTensor<Self> {
        mixed_autodiff::<C>(x, w, compute, out)
    }
}

/// `x @ w` on a CubeCL device ([`CubeLinear`]).
pub(super) fn linear<const D: usize>(
    x: burn::tensor::Tensor<D>,
    w: burn::tensor::Tensor<2>,
) -> burn::tensor::Tensor<D> {
    burn::tensor::Tensor::from_dispatch(Dispatch::device_linear(
        x.into_dispatch(),
        w.into_dispatch(),
    ))
}

/// `x @ w` in `compute`, written in `out`, on a CubeCL device ([`CubeLinear`]).
pub(super) fn mixed_linear<const D: usize>(
    x: burn::tensor::Tensor<D>,
    w: burn::tensor::Tensor<2>,
    compute: DType,
    out: DType,
) -> burn::tensor::Tensor<D> {
    burn::tensor::Tensor::from_dispatch(Dispatch::device_mixed_linear(
        x.into_dispatch(),
        w.into_dispatch(),
        compute,
        out,
    ))
}

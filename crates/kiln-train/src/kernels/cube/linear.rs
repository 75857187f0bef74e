//! `x @ w` (a projection without bias) on CubeCL devices, recorded as one autodiff op whose
//! backward is two products: `dx = dy @ w^T` and `dw = x^T @ dy` over the flattened rows (one
//! matmul for the weight gradient, where burn's batched matmul backward sums per-batch
//! products). Every product is [`product`]: on CubeCL's CPU runtime a kernel fixed in advance,
//! so a run's bits do not depend on which candidate autotune timed fastest in that process.

use super::dims;
use super::fixed_matmul::product;
use burn::backend::Autodiff;
use burn::backend::autodiff::checkpoint::{base::Checkpointer, strategy::CheckpointStrategy};
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn::backend::ops::FloatTensorOps;
use burn::backend::tensor::FloatTensor;
use burn_cubecl::CubeBackend;
use burn_cubecl::tensor::CubeTensor;

type Ad<C> = Autodiff<CubeBackend, C>;

/// `x` `[.., in]` as `[rows, in]`.
fn rows(x: CubeTensor) -> CubeTensor {
    let d = dims(&x);
    let inner = d[d.len() - 1];
    let n = d.iter().product::<usize>() / inner.max(1);
    CubeBackend::float_reshape(super::dense(x), [n, inner].into())
}

/// `x @ w` for `x` `[.., in]` and `w` `[in, out]`: `[.., out]`.
pub(super) fn forward(x: CubeTensor, w: CubeTensor) -> CubeTensor {
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
pub(super) fn autodiff<C: CheckpointStrategy>(
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

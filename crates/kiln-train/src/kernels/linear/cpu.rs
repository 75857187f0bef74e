//! `x @ w` (a projection without bias) on flex and its backward, on
//! [`crate::kernels::host::matmul`]: the same multiplies burn's `linear` runs, without flex's
//! zero-fill and copy of every output, and with the input gradient and the weight gradient
//! each written once.
//!
//! Upstream: with flex's matmul output allocation fixed this kernel would only save the
//! shape bookkeeping; burn's own `linear` would do.

use crate::kernels::host::matmul::{View, product};
use crate::kernels::host::tensors::{contiguous, dims, tensor, values};
use burn::backend::autodiff::checkpoint::{base::Checkpointer, strategy::CheckpointStrategy};
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn::backend::flex::FlexTensor;
use burn::backend::tensor::FloatTensor;
use burn::backend::{Autodiff, Backend, Dispatch, Flex, backend_extension};
use burn::tensor::Tensor;

/// `x` `[.., in]` as rows, contiguous.
fn rows_of(x: &FlexTensor, w: &FlexTensor) -> (FlexTensor, Vec<usize>, usize, usize) {
    let x = contiguous(x);
    let shape = dims(&x);
    let [d_in, d_out]: [usize; 2] = dims(w).try_into().expect("linear: w must be [in, out]");
    assert_eq!(
        shape.last().copied(),
        Some(d_in),
        "linear: x {shape:?} by w [{d_in}, {d_out}]"
    );
    (x, shape, d_in, d_out)
}

fn forward(x: &FlexTensor, w: &FlexTensor) -> FlexTensor {
    let (x, mut shape, d_in, d_out) = rows_of(x, w);
    let rows = values(&x).len() / d_in.max(1);
    let y = product(View::rows(values(&x), rows, d_in), View::of(w), true);
    if let Some(last) = shape.last_mut() {
        *last = d_out;
    }
    tensor(y, shape)
}

/// `(dx, dw)` as asked for.
fn backward(
    dy: &FlexTensor,
    x: &FlexTensor,
    w: &FlexTensor,
    need: (bool, bool),
) -> (Option<FlexTensor>, Option<FlexTensor>) {
    let dy = contiguous(dy);
    let x_shape = dims(x);
    let [d_in, d_out]: [usize; 2] = dims(w).try_into().expect("linear: w must be [in, out]");
    let rows = values(x).len() / d_in.max(1);
    let dyv = View::rows(values(&dy), rows, d_out);
    let dx = need
        .0
        .then(|| tensor(product(dyv, View::of(w).t(), true), x_shape));
    let dw = need.1.then(|| {
        let xt = View::rows(values(x), rows, d_in).t();
        tensor(product(xt, dyv, true), [d_in, d_out])
    });
    (dx, dw)
}

/// The projection recorded as one autodiff op.
fn autodiff<C: CheckpointStrategy>(
    x: FloatTensor<Autodiff<Flex, C>>,
    w: FloatTensor<Autodiff<Flex, C>>,
) -> FloatTensor<Autodiff<Flex, C>> {
    #[derive(Debug)]
    struct LinearBackward;

    impl Backward<Flex, 2> for LinearBackward {
        /// `x` (contiguous) and `w`.
        type State = (FlexTensor, FlexTensor);

        fn backward(
            self,
            ops: Ops<Self::State, 2>,
            grads: &mut Gradients,
            _checkpointer: &mut Checkpointer,
        ) {
            let [node_x, node_w] = ops.parents;
            let dy = grads.consume::<Flex>(&ops.node);
            let (x, w) = ops.state;
            let (dx, dw) = backward(&dy, &x, &w, (node_x.is_some(), node_w.is_some()));
            if let (Some(node), Some(dx)) = (node_x, dx) {
                grads.register::<Flex>(node.id, dx);
            }
            if let (Some(node), Some(dw)) = (node_w, dw) {
                grads.register::<Flex>(node.id, dw);
            }
        }
    }

    match LinearBackward
        .prepare::<C>([x.node(), w.node()])
        .compute_bound()
        .stateful()
    {
        OpsKind::Tracked(prep) => {
            let xc = contiguous(x.primitive());
            let y = forward(&xc, w.primitive());
            prep.finish((xc, w.primitive().clone()), y)
        }
        OpsKind::UnTracked(prep) => prep.finish(forward(x.primitive(), w.primitive())),
    }
}

/// The bias-free projection as one op on flex (forward) and on autodiff over flex (forward and
/// one backward step), registered through a backend extension so a model mixes it freely with burn's ops.
#[backend_extension(Flex, Autodiff)]
pub trait FlexLinear: Backend {
    /// `x @ w` for `x` `[.., in]`, `w` `[in, out]`.
    fn kiln_linear(x: FloatTensor<Self>, w: FloatTensor<Self>) -> FloatTensor<Self>;
}

impl FlexLinear for Flex {
    fn kiln_linear(x: FlexTensor, w: FlexTensor) -> FlexTensor {
        forward(&x, &w)
    }
}

impl<C: CheckpointStrategy> FlexLinear for Autodiff<Flex, C> {
    fn kiln_linear(x: FloatTensor<Self>, w: FloatTensor<Self>) -> FloatTensor<Self> {
        autodiff::<C>(x, w)
    }
}

/// `x @ w` on flex ([`FlexLinear`]).
pub(super) fn linear<const D: usize>(x: Tensor<D>, w: Tensor<2>) -> Tensor<D> {
    Tensor::from_dispatch(Dispatch::kiln_linear(x.into_dispatch(), w.into_dispatch()))
}

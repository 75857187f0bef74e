//! The causal softmax of attention scores on flex: scale, mask and softmax in one pass
//! forward, one pass backward, touching only the unmasked part of each row.
//!
//! Composed, it is a scalar multiply, the add of a `-inf` mask, and softmax as burn's
//! autodiff records it (max, subtract, exp, sum, divide: burn-autodiff does not use flex's
//! fused softmax), with about ten backward ops, each a full pass over `[b, heads, t, t]`.
//!
//! Upstream: burn-autodiff would need to keep `softmax` as one op (using the backend's fused
//! forward) with the usual `y * (dy - sum(dy * y))` backward; a masked or causal variant (or
//! a fused attention op on flex with a backward) would remove the mask pass too.

use crate::kernels::host::math::{exp, lane_max, lane_sum};
use crate::kernels::host::tensors::{ROW_BLOCK, contiguous, dims, tensor, values};
use burn::backend::autodiff::checkpoint::{base::Checkpointer, strategy::CheckpointStrategy};
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn::backend::flex::FlexTensor;
use burn::backend::tensor::FloatTensor;
use burn::backend::{Autodiff, Backend, Dispatch, Flex, backend_extension};
use burn::tensor::Tensor;
use multiversion::multiversion;
use rayon::prelude::*;

/// Softmax of `scores * scale`; row `r` of each matrix keeps columns `0..=r % t`, the rest
/// are zero.
fn forward(scores: &FlexTensor, scale: f64) -> FlexTensor {
    let s = contiguous(scores);
    let shape = dims(&s);
    let (rows, t) = matrix_dims(&shape);
    let xs = values(&s);
    let mut y = vec![0.0f32; xs.len()];
    y.par_chunks_mut(ROW_BLOCK * t)
        .enumerate()
        .for_each(|(b, yb)| {
            let first_row = b * ROW_BLOCK;
            let x = &xs[first_row * t..][..yb.len()];
            forward_block(x, yb, (rows, t), first_row, scale as f32);
        });
    tensor(y, shape)
}

#[multiversion(targets("x86_64+avx512f+avx512vl+avx512dq+avx512bw", "x86_64+avx2+fma"))]
fn forward_block(x: &[f32], y: &mut [f32], (rows, t): (usize, usize), first: usize, scale: f32) {
    for (i, (xr, yr)) in x.chunks_exact(t).zip(y.chunks_exact_mut(t)).enumerate() {
        let n = (first + i) % rows % t + 1;
        let m = lane_max(n, |j| xr[j] * scale);
        for j in 0..n {
            yr[j] = exp(xr[j] * scale - m);
        }
        let sum = lane_sum(n, |j| yr[j]);
        for v in &mut yr[..n] {
            *v /= sum;
        }
    }
}

/// Rows per matrix and columns (`t`) of a `[.., rows, t]` shape.
fn matrix_dims(shape: &[usize]) -> (usize, usize) {
    let n = shape.len();
    assert!(n >= 2, "causal softmax: scores must be [.., rows, t]");
    (shape[n - 2], shape[n - 1])
}

/// `d scores = scale * y * (dy - sum(dy * y))` over the unmasked columns.
fn backward(dy: &FlexTensor, y: &FlexTensor, scale: f64) -> FlexTensor {
    let dy = contiguous(dy);
    let shape = dims(y);
    let (rows, t) = matrix_dims(&shape);
    let (dys, ys) = (values(&dy), values(y));
    let mut dx = vec![0.0f32; ys.len()];
    dx.par_chunks_mut(ROW_BLOCK * t)
        .enumerate()
        .for_each(|(b, db)| {
            let first_row = b * ROW_BLOCK;
            let at = first_row * t;
            let n = db.len();
            let (dy, y) = (&dys[at..][..n], &ys[at..][..n]);
            backward_block(dy, y, db, (rows, t), first_row, scale as f32);
        });
    tensor(dx, shape)
}

#[multiversion(targets("x86_64+avx512f+avx512vl+avx512dq+avx512bw", "x86_64+avx2+fma"))]
fn backward_block(
    dy: &[f32],
    y: &[f32],
    dx: &mut [f32],
    (rows, t): (usize, usize),
    first: usize,
    scale: f32,
) {
    let pairs = dy.chunks_exact(t).zip(y.chunks_exact(t));
    for (i, ((dyr, yr), dxr)) in pairs.zip(dx.chunks_exact_mut(t)).enumerate() {
        let n = (first + i) % rows % t + 1;
        let dot = lane_sum(n, |j| dyr[j] * yr[j]);
        for j in 0..n {
            dxr[j] = scale * (yr[j] * (dyr[j] - dot));
        }
    }
}

/// The causal softmax recorded as one autodiff op.
fn autodiff<C: CheckpointStrategy>(
    scores: FloatTensor<Autodiff<Flex, C>>,
    scale: f64,
) -> FloatTensor<Autodiff<Flex, C>> {
    #[derive(Debug)]
    struct CausalSoftmaxBackward;

    impl Backward<Flex, 1> for CausalSoftmaxBackward {
        /// The output and the scale.
        type State = (FlexTensor, f64);

        fn backward(
            self,
            ops: Ops<Self::State, 1>,
            grads: &mut Gradients,
            _checkpointer: &mut Checkpointer,
        ) {
            let [node] = ops.parents;
            let dy = grads.consume::<Flex>(&ops.node);
            let (y, scale) = ops.state;
            if let Some(node) = node {
                grads.register::<Flex>(node.id, backward(&dy, &y, scale));
            }
        }
    }

    match CausalSoftmaxBackward
        .prepare::<C>([scores.node()])
        .compute_bound()
        .stateful()
    {
        OpsKind::Tracked(prep) => {
            let y = forward(scores.primitive(), scale);
            prep.finish((y.clone(), scale), y)
        }
        OpsKind::UnTracked(prep) => prep.finish(forward(scores.primitive(), scale)),
    }
}

/// The causal softmax as one op on flex (forward) and on autodiff over flex (forward and one
/// backward step), registered through a backend extension so a model mixes it freely with burn's ops.
#[backend_extension(Flex, Autodiff)]
pub trait FlexCausalSoftmax: Backend {
    /// Softmax over the last dimension of `scores * scale` under a causal mask: row `r` may
    /// see columns `0..=r % t` (`t` = the last dimension).
    fn kiln_causal_softmax(scores: FloatTensor<Self>, scale: f64) -> FloatTensor<Self>;
}

impl FlexCausalSoftmax for Flex {
    fn kiln_causal_softmax(scores: FlexTensor, scale: f64) -> FlexTensor {
        forward(&scores, scale)
    }
}

impl<C: CheckpointStrategy> FlexCausalSoftmax for Autodiff<Flex, C> {
    fn kiln_causal_softmax(scores: FloatTensor<Self>, scale: f64) -> FloatTensor<Self> {
        autodiff::<C>(scores, scale)
    }
}

/// The causal softmax on flex ([`FlexCausalSoftmax`]).
pub(super) fn causal_softmax(scores: Tensor<4>, scale: f64) -> Tensor<4> {
    Tensor::from_dispatch(Dispatch::kiln_causal_softmax(scores.into_dispatch(), scale))
}

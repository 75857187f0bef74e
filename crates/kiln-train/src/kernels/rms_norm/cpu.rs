//! RMSNorm on flex, forward and backward, one pass each.
//!
//! Composed from burn ops it is seven recorded ops forward (square, mean, add, sqrt, recip,
//! two multiplies), each a full pass allocating a tensor, and about twice that backward.
//! Here: forward reads `x` once and writes `y` and the per-row `1/rms`; backward reads `dy`,
//! `x` once and writes `dx` and per-block partial sums of `dw`.
//!
//! Upstream: burn would need an `rms_norm` op in its backend API with a fused backward in
//! burn-autodiff (flex already fuses `layer_norm`'s forward), and multithreaded flex
//! element-wise kernels.

use crate::kernels::host::math::lane_sum;
use crate::kernels::host::tensors::{ROW_BLOCK, contiguous, dims, tensor, values, written};
use burn::backend::autodiff::checkpoint::{base::Checkpointer, strategy::CheckpointStrategy};
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn::backend::flex::FlexTensor;
use burn::backend::tensor::FloatTensor;
use burn::backend::{Autodiff, Backend, Dispatch, Flex, backend_extension};
use burn::tensor::Tensor;
use multiversion::multiversion;
use rayon::prelude::*;
use std::mem::MaybeUninit;

/// `(y, inv_rms, x contiguous)` for `x` `[.., d]` and `w` `[d]`.
fn forward(x: &FlexTensor, w: &FlexTensor, eps: f64) -> (FlexTensor, FlexTensor) {
    let (y, inv, _) = forward_keep(x, w, eps);
    (y, inv)
}

fn forward_keep(x: &FlexTensor, w: &FlexTensor, eps: f64) -> (FlexTensor, FlexTensor, FlexTensor) {
    let x = contiguous(x);
    let w = contiguous(w);
    let shape = dims(&x);
    let d = shape.last().copied().unwrap_or(1);
    let (xs, ws) = (values(&x), values(&w));
    assert_eq!(
        ws.len(),
        d,
        "rms_norm: weight of {} for rows of {d}",
        ws.len()
    );
    let rows = xs.len() / d.max(1);
    // Written whole: the blocks tile `y` (rows of `d`) and `inv` (one per row), and each
    // writes every row of its block.
    let (y, (inv, ())) = written(xs.len(), |y| {
        written(rows, |inv| {
            y.par_chunks_mut(ROW_BLOCK * d)
                .zip(inv.par_chunks_mut(ROW_BLOCK))
                .enumerate()
                .for_each(|(b, (yb, ib))| {
                    let xb = &xs[b * ROW_BLOCK * d..][..yb.len()];
                    forward_block(xb, ws, yb, ib, eps as f32);
                })
        })
    });
    (tensor(y, shape), tensor(inv, [rows]), x)
}

#[multiversion(targets("x86_64+avx512f+avx512vl+avx512dq+avx512bw", "x86_64+avx2+fma"))]
fn forward_block(
    x: &[f32],
    w: &[f32],
    y: &mut [MaybeUninit<f32>],
    inv: &mut [MaybeUninit<f32>],
    eps: f32,
) {
    let d = w.len();
    for ((xr, yr), ir) in x
        .chunks_exact(d)
        .zip(y.chunks_exact_mut(d))
        .zip(inv.iter_mut())
    {
        let mean = lane_sum(d, |i| xr[i] * xr[i]) / d as f32;
        let r = 1.0 / (mean + eps).sqrt();
        ir.write(r);
        for ((yv, xv), wv) in yr.iter_mut().zip(xr).zip(w) {
            yv.write(xv * r * wv);
        }
    }
}

/// `(dx, dw)` for the upstream gradient `dy`.
fn backward(
    dy: &FlexTensor,
    x: &FlexTensor,
    w: &FlexTensor,
    inv: &FlexTensor,
) -> (FlexTensor, FlexTensor) {
    let dy = contiguous(dy);
    let shape = dims(x);
    let (dys, xs, ws, invs) = (values(&dy), values(x), values(w), values(inv));
    let d = ws.len();
    // Written whole: the blocks tile `dx` and each writes every row of its block.
    let (dx, dw_parts) = written(xs.len(), |dx| {
        dx.par_chunks_mut(ROW_BLOCK * d)
            .enumerate()
            .map(|(b, dxb)| {
                let at = b * ROW_BLOCK * d;
                let mut dw = vec![0.0f32; d];
                backward_block(
                    &dys[at..][..dxb.len()],
                    &xs[at..][..dxb.len()],
                    ws,
                    &invs[b * ROW_BLOCK..],
                    dxb,
                    &mut dw,
                );
                dw
            })
            .collect::<Vec<Vec<f32>>>()
    });
    let mut dw = vec![0.0f32; d];
    for part in &dw_parts {
        for (a, p) in dw.iter_mut().zip(part) {
            *a += p;
        }
    }
    (tensor(dx, shape), tensor(dw, [d]))
}

#[multiversion(targets("x86_64+avx512f+avx512vl+avx512dq+avx512bw", "x86_64+avx2+fma"))]
fn backward_block(
    dy: &[f32],
    x: &[f32],
    w: &[f32],
    inv: &[f32],
    dx: &mut [MaybeUninit<f32>],
    dw: &mut [f32],
) {
    let d = w.len();
    let rows = dy.chunks_exact(d).zip(x.chunks_exact(d));
    for (((dyr, xr), dx), &r) in rows.zip(dx.chunks_exact_mut(d)).zip(inv) {
        let dot = lane_sum(d, |i| dyr[i] * w[i] * xr[i]);
        let c = r * r * dot / d as f32;
        for i in 0..d {
            dx[i].write(r * (dyr[i] * w[i] - xr[i] * c));
            dw[i] += dyr[i] * xr[i] * r;
        }
    }
}

/// RMSNorm recorded as one autodiff op.
fn autodiff<C: CheckpointStrategy>(
    x: FloatTensor<Autodiff<Flex, C>>,
    w: FloatTensor<Autodiff<Flex, C>>,
    eps: f64,
) -> FloatTensor<Autodiff<Flex, C>> {
    #[derive(Debug)]
    struct RmsNormBackward;

    impl Backward<Flex, 2> for RmsNormBackward {
        /// `x` (contiguous), `w`, `1/rms` per row.
        type State = (FlexTensor, FlexTensor, FlexTensor);

        fn backward(
            self,
            ops: Ops<Self::State, 2>,
            grads: &mut Gradients,
            _checkpointer: &mut Checkpointer,
        ) {
            let [node_x, node_w] = ops.parents;
            let dy = grads.consume::<Flex>(&ops.node);
            let (x, w, inv) = ops.state;
            let (dx, dw) = backward(&dy, &x, &contiguous(&w), &inv);
            if let Some(node) = node_x {
                grads.register::<Flex>(node.id, dx);
            }
            if let Some(node) = node_w {
                grads.register::<Flex>(node.id, dw);
            }
        }
    }

    match RmsNormBackward
        .prepare::<C>([x.node(), w.node()])
        .compute_bound()
        .stateful()
    {
        OpsKind::Tracked(prep) => {
            let (y, inv, xc) = forward_keep(x.primitive(), w.primitive(), eps);
            prep.finish((xc, w.primitive().clone(), inv), y)
        }
        OpsKind::UnTracked(prep) => prep.finish(forward(x.primitive(), w.primitive(), eps).0),
    }
}

/// RMSNorm as one op on flex (forward) and on autodiff over flex (forward and one backward
/// step), registered through a backend extension so a model mixes it freely with burn's ops.
#[backend_extension(Flex, Autodiff)]
pub trait FlexRmsNorm: Backend {
    /// RMSNorm over the last dimension: `x / sqrt(mean(x^2) + eps) * w`.
    fn kiln_rms_norm(x: FloatTensor<Self>, w: FloatTensor<Self>, eps: f64) -> FloatTensor<Self>;
}

impl FlexRmsNorm for Flex {
    fn kiln_rms_norm(x: FlexTensor, w: FlexTensor, eps: f64) -> FlexTensor {
        forward(&x, &w, eps).0
    }
}

impl<C: CheckpointStrategy> FlexRmsNorm for Autodiff<Flex, C> {
    fn kiln_rms_norm(x: FloatTensor<Self>, w: FloatTensor<Self>, eps: f64) -> FloatTensor<Self> {
        autodiff::<C>(x, w, eps)
    }
}

/// RMSNorm of `x` on flex ([`FlexRmsNorm`]).
pub(super) fn rms_norm<const D: usize>(x: Tensor<D>, w: Tensor<1>, eps: f64) -> Tensor<D> {
    Tensor::from_dispatch(Dispatch::kiln_rms_norm(
        x.into_dispatch(),
        w.into_dispatch(),
        eps,
    ))
}

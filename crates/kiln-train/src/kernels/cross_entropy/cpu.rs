//! The output head and the cross-entropy loss fused on flex: `mean(logsumexp(h @ w) - (h @ w)[target])`,
//! computed a block of rows at a time, so the `[tokens, vocab]` logits (2048 x 8192 floats,
//! 64 MiB, in the reference model) are never held whole, and neither is any probability
//! matrix.
//!
//! As in Liger-Kernel's fused linear cross-entropy, the gradients are computed during the
//! forward pass, while each block's logits are at hand: the gradient of the loss with
//! respect to a block's logits is `(softmax - onehot) / tokens`, written over the logits in
//! place, and immediately multiplied into `d h` (`dlogits @ w^T`) and accumulated into `d w`
//! (`h^T @ dlogits`). The backward step then only scales the two by the upstream gradient.
//! The loss is a scalar, so nothing is lost by computing them early; an untracked forward
//! (evaluation) computes the loss alone.
//!
//! Composed, the loss is the logits matmul, six recorded ops for log-softmax, a gather, a
//! mean, and their backward ops: a dozen full passes over the logits, each allocating them.
//!
//! Upstream: burn would need a cross-entropy op in its backend API taking logits and targets
//! (log-softmax, gather and their backward in one pass), and for the memory saving a fused
//! linear + cross-entropy op (the matmul is inside the loop over blocks).

use crate::kernels::host::math::{exp, lane_max, lane_sum};
use crate::kernels::host::matmul::{View, gemm_into, gemm_write, product};
use crate::kernels::host::tensors::{ROW_BLOCK, contiguous, dims, scalar, tensor, values, written};
use burn::backend::autodiff::checkpoint::{base::Checkpointer, strategy::CheckpointStrategy};
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn::backend::flex::FlexTensor;
use burn::backend::tensor::{FloatTensor, IntTensor};
use burn::backend::{Autodiff, Backend, Dispatch, Flex, backend_extension};
use burn::tensor::DType;
use burn::tensor::{Int, Tensor};
use multiversion::multiversion;
use rayon::prelude::*;
use std::mem::MaybeUninit;

/// Token rows per block: the block's logits are `CHUNK * vocab` floats (16 MiB at a
/// vocabulary of 8192). Fixed, so results do not depend on the thread count.
const CHUNK: usize = 512;

/// The loss (a one-element tensor) and, when asked for, the gradients of the loss with
/// respect to `h` and `w`.
pub(super) struct Output {
    pub loss: FlexTensor,
    pub dh: Option<FlexTensor>,
    pub dw: Option<FlexTensor>,
}

fn targets_of(targets: &FlexTensor) -> Vec<usize> {
    let t = targets.to_contiguous();
    let as_usize = |v: i64| usize::try_from(v).expect("cross-entropy: negative target");
    match t.dtype() {
        DType::I64 => values_of::<i64>(&t).iter().map(|&v| as_usize(v)).collect(),
        DType::I32 => values_of::<i32>(&t)
            .iter()
            .map(|&v| as_usize(v.into()))
            .collect(),
        DType::U32 => values_of::<u32>(&t).iter().map(|&v| v as usize).collect(),
        other => panic!("cross-entropy: targets of dtype {other:?}"),
    }
}

fn values_of<E: burn::tensor::Element + bytemuck::Pod>(t: &FlexTensor) -> &[E] {
    t.as_slice::<E>()
        .expect("cross-entropy: contiguous targets expected")
}

/// The loss, and `d loss / d h`, `d loss / d w` when `need` says so.
fn forward(h: &FlexTensor, w: &FlexTensor, targets: &FlexTensor, need: (bool, bool)) -> Output {
    let h = contiguous(h);
    let [n, d]: [usize; 2] = dims(&h)
        .try_into()
        .expect("cross-entropy: h must be [n, d]");
    let [wd, v]: [usize; 2] = dims(w)
        .try_into()
        .expect("cross-entropy: w must be [d, vocab]");
    assert_eq!(d, wd, "cross-entropy: h has {d} columns, w has {wd} rows");
    assert_eq!(w.dtype(), DType::F32, "cross-entropy: f32 weights expected");
    let tg = targets_of(targets);
    assert_eq!(
        tg.len(),
        n,
        "cross-entropy: {} targets for {n} rows",
        tg.len()
    );
    if let Some(&bad) = tg.iter().find(|&&t| t >= v) {
        panic!("cross-entropy: target {bad} outside the vocabulary of {v}");
    }
    let hs = values(&h);
    let wm = View::of(w);
    let (need_dh, need_dw) = need;
    let grads = need_dh || need_dw;
    let inv_n = 1.0 / n as f32;
    // Written whole: every row's loss by `rows_block`, every row of `dh` by its chunk's
    // product, and `dw` by the first chunk's product (the later ones add to it).
    let (row_loss, (dh, dw)) = written(n, |row_loss| {
        let dh_len = if need_dh { n * d } else { 0 };
        written(dh_len, |dh| {
            let mut logits: Vec<f32> = Vec::new();
            let mut dw: Option<Vec<f32>> = None;
            for (c, start) in (0..n).step_by(CHUNK).enumerate() {
                let rows = CHUNK.min(n - start);
                let hc = View::rows(hs, n, d).row_range(start, rows);
                // logits = h[block] @ w; the first block (the largest) makes the buffer.
                if c == 0 {
                    logits = product(hc, wm, true);
                } else {
                    gemm_into(&mut logits[..rows * v], v, hc, wm, false, true);
                }
                let lc = &mut logits[..rows * v];
                lc.par_chunks_mut(ROW_BLOCK * v)
                    .zip(row_loss[start..start + rows].par_chunks_mut(ROW_BLOCK))
                    .enumerate()
                    .for_each(|(b, (lb, loss))| {
                        let first = start + b * ROW_BLOCK;
                        rows_block(lb, &tg[first..first + loss.len()], loss, v, inv_n, grads);
                    });
                let dlogits = View::rows(lc, rows, v);
                if need_dh {
                    // d h[block] = dlogits @ w^T
                    gemm_write(&mut dh[start * d..], d, dlogits, wm.t(), true);
                }
                if need_dw {
                    // d w += h[block]^T @ dlogits
                    match &mut dw {
                        None => dw = Some(product(hc.t(), dlogits, true)),
                        Some(acc) => gemm_into(acc, v, hc.t(), dlogits, true, true),
                    }
                }
            }
            // No rows: no product wrote it, and the gradient of no rows is zero.
            dw.unwrap_or_else(|| vec![0.0; if need_dw { d * v } else { 0 }])
        })
    });
    let total: f64 = row_loss.iter().map(|&l| f64::from(l)).sum();
    Output {
        loss: tensor(vec![(total / n as f64) as f32], [1]),
        dh: need_dh.then(|| tensor(dh, [n, d])),
        dw: need_dw.then(|| tensor(dw, [d, v])),
    }
}

/// Per row: the loss `logsumexp - logit[target]`, and with `grads` the row's logits
/// replaced by `(softmax - onehot(target)) / n`.
#[multiversion(targets("x86_64+avx512f+avx512vl+avx512dq+avx512bw", "x86_64+avx2+fma"))]
fn rows_block(
    l: &mut [f32],
    targets: &[usize],
    loss: &mut [MaybeUninit<f32>],
    v: usize,
    inv_n: f32,
    grads: bool,
) {
    for ((row, &t), out) in l.chunks_exact_mut(v).zip(targets).zip(loss.iter_mut()) {
        let target_logit = row[t];
        let m = lane_max(v, |j| row[j]);
        let sum = if grads {
            for x in row.iter_mut() {
                *x = exp(*x - m);
            }
            lane_sum(v, |j| row[j])
        } else {
            lane_sum(v, |j| exp(row[j] - m))
        };
        out.write(m + sum.ln() - target_logit);
        if grads {
            let k = inv_n / sum;
            for x in row.iter_mut() {
                *x *= k;
            }
            row[t] -= inv_n;
        }
    }
}

/// `t * g` (`t` itself when `g` is 1).
fn scaled(t: FlexTensor, g: f32) -> FlexTensor {
    if g == 1.0 {
        return t;
    }
    let shape = dims(&t);
    let mut v = values(&t).to_vec();
    v.par_chunks_mut(1 << 14).for_each(|c| {
        for x in c {
            *x *= g;
        }
    });
    tensor(v, shape)
}

/// The fused head and loss recorded as one autodiff op.
fn autodiff<C: CheckpointStrategy>(
    h: FloatTensor<Autodiff<Flex, C>>,
    w: FloatTensor<Autodiff<Flex, C>>,
    targets: FlexTensor,
) -> FloatTensor<Autodiff<Flex, C>> {
    #[derive(Debug)]
    struct LinearCrossEntropyBackward;

    impl Backward<Flex, 2> for LinearCrossEntropyBackward {
        /// `d loss / d h` and `d loss / d w`, computed in the forward pass.
        type State = (Option<FlexTensor>, Option<FlexTensor>);

        fn backward(
            self,
            ops: Ops<Self::State, 2>,
            grads: &mut Gradients,
            _checkpointer: &mut Checkpointer,
        ) {
            let [node_h, node_w] = ops.parents;
            let g = scalar(&grads.consume::<Flex>(&ops.node));
            let (dh, dw) = ops.state;
            if let (Some(node), Some(dh)) = (node_h, dh) {
                grads.register::<Flex>(node.id, scaled(dh, g));
            }
            if let (Some(node), Some(dw)) = (node_w, dw) {
                grads.register::<Flex>(node.id, scaled(dw, g));
            }
        }
    }

    let need = (h.is_tracked(), w.is_tracked());
    match LinearCrossEntropyBackward
        .prepare::<C>([h.node(), w.node()])
        .compute_bound()
        .stateful()
    {
        OpsKind::Tracked(prep) => {
            let out = forward(h.primitive(), w.primitive(), &targets, need);
            prep.finish((out.dh, out.dw), out.loss)
        }
        OpsKind::UnTracked(prep) => {
            prep.finish(forward(h.primitive(), w.primitive(), &targets, (false, false)).loss)
        }
    }
}

/// The output head with cross-entropy as one op on flex (forward) and on autodiff over flex
/// (forward, whose pass computes the gradients too, and one backward step), registered through a backend extension so a model mixes it freely with burn's ops.
#[backend_extension(Flex, Autodiff)]
pub trait FlexLinearCrossEntropy: Backend {
    /// Mean cross-entropy of the logits `h @ w` (`h` `[n, d]`, `w` `[d, vocab]`) against
    /// `targets` `[n]`, as a one-element tensor; the logits are never materialised whole.
    fn kiln_linear_cross_entropy(
        h: FloatTensor<Self>,
        w: FloatTensor<Self>,
        targets: IntTensor<Self>,
    ) -> FloatTensor<Self>;
}

impl FlexLinearCrossEntropy for Flex {
    fn kiln_linear_cross_entropy(h: FlexTensor, w: FlexTensor, targets: FlexTensor) -> FlexTensor {
        forward(&h, &w, &targets, (false, false)).loss
    }
}

impl<C: CheckpointStrategy> FlexLinearCrossEntropy for Autodiff<Flex, C> {
    fn kiln_linear_cross_entropy(
        h: FloatTensor<Self>,
        w: FloatTensor<Self>,
        targets: IntTensor<Self>,
    ) -> FloatTensor<Self> {
        autodiff::<C>(h, w, targets)
    }
}

/// Mean cross-entropy of `h @ w` against `targets` on flex ([`FlexLinearCrossEntropy`]).
pub(super) fn linear_cross_entropy(
    h: Tensor<2>,
    w: Tensor<2>,
    targets: Tensor<1, Int>,
) -> Tensor<1> {
    Tensor::from_dispatch(Dispatch::kiln_linear_cross_entropy(
        h.into_dispatch(),
        w.into_dispatch(),
        targets.into_dispatch(),
    ))
}

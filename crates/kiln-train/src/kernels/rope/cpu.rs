//! Rotate-half RoPE on flex, fused with the head transpose: `[b, t, heads * hd]` (a projection's
//! output) in, `[b, heads, t, hd]` (what attention multiplies) out, in one pass; the
//! backward pass rotates back and transposes back in one pass too.
//!
//! Composed, it is a transpose copy, two narrows, a negation, a concatenation, two
//! multiplies and an add (each a pass and an allocation), and their backward ops.
//!
//! Upstream: burn would need a rotary-embedding op in its backend API that supports the
//! rotate-half layout (burn-nn's `RotaryEncoding` is the interleaved one and is composed),
//! with a fused backward.

use crate::kernels::host::tensors::{contiguous, dims, tensor, values, written};
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

/// Shape facts: batch, positions, heads, head dim.
#[derive(Debug, Clone, Copy)]
struct Dims {
    b: usize,
    t: usize,
    heads: usize,
    hd: usize,
}

impl Dims {
    fn of(x: &FlexTensor, heads: usize) -> Self {
        let s = dims(x);
        assert_eq!(s.len(), 3, "rope: x must be [b, t, heads * hd]");
        assert!(
            heads > 0 && s[2].is_multiple_of(heads),
            "rope: {} columns for {heads} heads",
            s[2]
        );
        let hd = s[2] / heads;
        assert!(hd.is_multiple_of(2), "rope: odd head dim {hd}");
        Self {
            b: s[0],
            t: s[1],
            heads,
            hd,
        }
    }
}

fn forward(x: &FlexTensor, cos: &FlexTensor, sin: &FlexTensor, heads: usize) -> FlexTensor {
    let x = contiguous(x);
    let (cos, sin) = (contiguous(cos), contiguous(sin));
    let d = Dims::of(&x, heads);
    let (xs, cs, ss) = (values(&x), values(&cos), values(&sin));
    assert!(
        cs.len() >= d.t * d.hd,
        "rope: tables shorter than the sequence"
    );
    let row = d.heads * d.hd;
    // One task per (batch, head): its output [t, hd] is contiguous. Written whole: the tasks
    // tile `y` and `rotate` writes every element of each row.
    let (y, ()) = written(xs.len(), |y| {
        y.par_chunks_mut(d.t * d.hd)
            .enumerate()
            .for_each(|(bh, out)| {
                let (bi, h) = (bh / d.heads, bh % d.heads);
                for (s, o) in out.chunks_exact_mut(d.hd).enumerate() {
                    let src = &xs[(bi * d.t + s) * row + h * d.hd..][..d.hd];
                    let table = s * d.hd..(s + 1) * d.hd;
                    rotate(src, &cs[table.clone()], &ss[table], o);
                }
            })
    });
    tensor(y, [d.b, d.heads, d.t, d.hd])
}

/// `o = x * cos + rotate_half(x) * sin`, `rotate_half(x) = [-x2, x1]`.
#[multiversion(targets("x86_64+avx512f+avx512vl+avx512dq+avx512bw", "x86_64+avx2+fma"))]
fn rotate(x: &[f32], c: &[f32], s: &[f32], o: &mut [MaybeUninit<f32>]) {
    let half = x.len() / 2;
    for j in 0..half {
        o[j].write(x[j] * c[j] + (-x[j + half]) * s[j]);
    }
    for j in half..x.len() {
        o[j].write(x[j] * c[j] + x[j - half] * s[j]);
    }
}

/// The transpose of [`rotate`]: `dx = dy * cos + [dy2 * sin2, -dy1 * sin1]`.
#[multiversion(targets("x86_64+avx512f+avx512vl+avx512dq+avx512bw", "x86_64+avx2+fma"))]
fn rotate_back(dy: &[f32], c: &[f32], s: &[f32], dx: &mut [MaybeUninit<f32>]) {
    let half = dy.len() / 2;
    for j in 0..half {
        dx[j].write(dy[j] * c[j] + dy[j + half] * s[j + half]);
    }
    for j in half..dy.len() {
        dx[j].write(dy[j] * c[j] - dy[j - half] * s[j - half]);
    }
}

fn backward(dy: &FlexTensor, cos: &FlexTensor, sin: &FlexTensor, d: Dims) -> FlexTensor {
    let dy = contiguous(dy);
    let (dys, cs, ss) = (values(&dy), values(cos), values(sin));
    let row = d.heads * d.hd;
    // One task per (batch, position) row of dx. Written whole: the rows tile `dx` (`row` is
    // `heads` chunks of `hd`) and `rotate_back` writes every element of each chunk.
    let (dx, ()) = written(dys.len(), |dx| {
        dx.par_chunks_mut(row).enumerate().for_each(|(bs, out)| {
            let (bi, s) = (bs / d.t, bs % d.t);
            let table = s * d.hd..(s + 1) * d.hd;
            for (h, o) in out.chunks_exact_mut(d.hd).enumerate() {
                let src = &dys[((bi * d.heads + h) * d.t + s) * d.hd..][..d.hd];
                rotate_back(src, &cs[table.clone()], &ss[table.clone()], o);
            }
        })
    });
    tensor(dx, [d.b, d.t, row])
}

/// RoPE recorded as one autodiff op (the tables are constants: no gradient flows to them).
fn autodiff<C: CheckpointStrategy>(
    x: FloatTensor<Autodiff<Flex, C>>,
    cos: FloatTensor<Autodiff<Flex, C>>,
    sin: FloatTensor<Autodiff<Flex, C>>,
    heads: usize,
) -> FloatTensor<Autodiff<Flex, C>> {
    #[derive(Debug)]
    struct RopeBackward;

    impl Backward<Flex, 1> for RopeBackward {
        /// cos, sin (contiguous), shape facts.
        type State = (FlexTensor, FlexTensor, (usize, usize, usize, usize));

        fn backward(
            self,
            ops: Ops<Self::State, 1>,
            grads: &mut Gradients,
            _checkpointer: &mut Checkpointer,
        ) {
            let [node_x] = ops.parents;
            let dy = grads.consume::<Flex>(&ops.node);
            let (cos, sin, (b, t, heads, hd)) = ops.state;
            if let Some(node) = node_x {
                let dx = backward(&dy, &cos, &sin, Dims { b, t, heads, hd });
                grads.register::<Flex>(node.id, dx);
            }
        }
    }

    match RopeBackward
        .prepare::<C>([x.node()])
        .compute_bound()
        .stateful()
    {
        OpsKind::Tracked(prep) => {
            let (c, s) = (contiguous(cos.primitive()), contiguous(sin.primitive()));
            let d = Dims::of(x.primitive(), heads);
            let y = forward(x.primitive(), &c, &s, heads);
            prep.finish((c, s, (d.b, d.t, d.heads, d.hd)), y)
        }
        OpsKind::UnTracked(prep) => prep.finish(forward(
            x.primitive(),
            cos.primitive(),
            sin.primitive(),
            heads,
        )),
    }
}

/// RoPE as one op on flex (forward) and on autodiff over flex (forward and one backward
/// step), registered through a backend extension so a model mixes it freely with burn's ops.
#[backend_extension(Flex, Autodiff)]
pub trait FlexRope: Backend {
    /// Rotate-half RoPE of `x` `[b, t, heads * hd]`, returned as `[b, heads, t, hd]`.
    fn kiln_rope(
        x: FloatTensor<Self>,
        cos: FloatTensor<Self>,
        sin: FloatTensor<Self>,
        heads: usize,
    ) -> FloatTensor<Self>;
}

impl FlexRope for Flex {
    fn kiln_rope(x: FlexTensor, cos: FlexTensor, sin: FlexTensor, heads: usize) -> FlexTensor {
        forward(&x, &cos, &sin, heads)
    }
}

impl<C: CheckpointStrategy> FlexRope for Autodiff<Flex, C> {
    fn kiln_rope(
        x: FloatTensor<Self>,
        cos: FloatTensor<Self>,
        sin: FloatTensor<Self>,
        heads: usize,
    ) -> FloatTensor<Self> {
        autodiff::<C>(x, cos, sin, heads)
    }
}

/// Rotate-half RoPE on flex ([`FlexRope`]).
pub(super) fn rope(x: Tensor<3>, cos: Tensor<2>, sin: Tensor<2>, heads: usize) -> Tensor<4> {
    Tensor::from_dispatch(Dispatch::kiln_rope(
        x.into_dispatch(),
        cos.into_dispatch(),
        sin.into_dispatch(),
        heads,
    ))
}

//! Causal grouped-query attention on flex, `softmax(q k^T * scale + causal mask) v`, forward
//! and backward, computing only the unmasked (lower-triangular) blocks.
//!
//! Composed, it is a batched `q @ k^T` over all `t x t` scores, the causal softmax, a
//! batched `p @ v` over all of them, and the copies that bring `v` to head-major layout and
//! the result back to `[b, t, heads * hd]`; about half of those multiplies are with masked
//! (zero) probabilities. Here each block of 64 query rows multiplies only against the keys
//! it can see (0.56 of the full square at t = 256), reads `v` and writes the result in the
//! projections' `[b, t, heads * hd]` layout directly (strided matrix views: no copies), and
//! the backward does the same with its four products.
//!
//! The probabilities are kept for the backward (as the composed version keeps them): no
//! recomputation, the composed version's memory.
//!
//! Determinism: every output element is written by one task, and the key/value gradients of
//! one (batch, kv head) are summed by one task in a fixed order, so the bits do not depend on
//! the thread count.
//!
//! Upstream: burn's `attention` module op (flex has a forward) would need a causal flag with
//! block skipping and a backward registered in burn-autodiff (today it is decomposed), and
//! grouped-query support without repeating K/V.

use super::dims::Dims;
use crate::kernels::host::math::{exp, lane_max, lane_sum};
use crate::kernels::host::matmul::{View, product, raw};
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

/// Query rows per block of work.
const ROWS: usize = 64;

impl Dims {
    /// From flex tensors `q`, `k` and `v`, checked against each other.
    fn of(q: &FlexTensor, k: &FlexTensor, v: &FlexTensor) -> Self {
        let [b, kv, gt, hd]: [usize; 4] = dims(q).try_into().expect("attention: q must be 4-D");
        let kd = dims(k);
        let t = kd.get(2).copied().unwrap_or(0);
        assert!(
            kd == [b, kv, t, hd] && t > 0 && gt % t == 0,
            "attention: q {:?} and k {kd:?} do not match",
            dims(q)
        );
        assert_eq!(dims(v), [b, t, kv * hd], "attention: v does not match k");
        Self::from_shapes(&dims(q), &kd)
    }

    /// The blocks of query rows: (batch, kv head, group, first position, rows).
    fn blocks(&self) -> Vec<Block> {
        let mut out = Vec::new();
        for b in 0..self.b {
            for kv in 0..self.kv {
                for g in 0..self.groups {
                    for i0 in (0..self.t).step_by(ROWS) {
                        out.push(Block {
                            b,
                            kv,
                            g,
                            i0,
                            rows: ROWS.min(self.t - i0),
                        });
                    }
                }
            }
        }
        out
    }

    /// Row of `q` (as `[.., hd]` rows) / of the probabilities (as `[.., t]` rows) where a
    /// block starts.
    fn q_row(&self, blk: &Block) -> usize {
        ((blk.b * self.kv + blk.kv) * self.groups + blk.g) * self.t + blk.i0
    }

    /// `k` rows `0..n` of (batch, kv head), `[n, hd]`.
    fn k_view<'a>(&self, k: &'a [f32], b: usize, kv: usize, n: usize) -> View<'a> {
        View::new(
            k,
            (b * self.kv + kv) * self.t * self.hd,
            (n, self.hd),
            (self.hd as isize, 1),
        )
    }

    /// `v` rows `0..n` of (batch, kv head), `[n, hd]`, strided inside `[b, t, kv * hd]`.
    fn v_view<'a>(&self, v: &'a [f32], b: usize, kv: usize, n: usize) -> View<'a> {
        let ld = self.kv * self.hd;
        View::new(
            v,
            b * self.t * ld + kv * self.hd,
            (n, self.hd),
            (ld as isize, 1),
        )
    }

    /// Offset and row stride of a block's rows in a `[b, t, heads * hd]` tensor.
    fn out_at(&self, blk: &Block) -> (usize, usize) {
        let ld = self.heads() * self.hd;
        let head = blk.kv * self.groups + blk.g;
        ((blk.b * self.t + blk.i0) * ld + head * self.hd, ld)
    }
}

/// A block of query rows: positions `i0..i0 + rows` of query head `kv * groups + g`.
#[derive(Debug, Clone, Copy)]
struct Block {
    b: usize,
    kv: usize,
    g: usize,
    i0: usize,
    rows: usize,
}

impl Block {
    /// Keys visible to the block's last row.
    fn cols(&self) -> usize {
        self.i0 + self.rows
    }
}

/// A buffer that parallel tasks write in disjoint parts.
#[derive(Clone, Copy)]
struct Shared(*mut f32, usize);
// SAFETY: the pointer is only used to write disjoint regions from different tasks (each
// call site says which) while the owning Vec outlives the parallel loop.
unsafe impl Send for Shared {}
unsafe impl Sync for Shared {}

impl Shared {
    fn of(v: &mut [f32]) -> Self {
        Self(v.as_mut_ptr(), v.len())
    }

    /// A buffer that may be uninitialised: only written through the pointer.
    fn of_uninit(v: &mut [MaybeUninit<f32>]) -> Self {
        Self(v.as_mut_ptr().cast(), v.len())
    }

    /// The start of the buffer (a method, so closures capture the whole `Shared`, which is
    /// `Sync`, rather than its raw pointer field).
    fn ptr(self) -> *mut f32 {
        self.0
    }
}

/// `dst (+)= a @ b` into `dst` at `offset` with row stride `ld`, on this thread.
///
/// # Safety
/// No other task may access the `a.rows x b.cols` region at `offset`/`ld` concurrently.
unsafe fn gemm_at(dst: Shared, offset: usize, ld: usize, a: View, b: View, accumulate: bool) {
    let (m, n) = (a.n_rows(), b.n_cols());
    if m == 0 || n == 0 {
        return;
    }
    assert!(
        offset + (m - 1) * ld + n <= dst.1,
        "attention: destination out of range"
    );
    // SAFETY: in range (checked above); exclusive per the caller's contract.
    unsafe { raw(dst.ptr().add(offset), ld, a, b, accumulate, false) }
}

/// Scale, mask and softmax of a block's scores in place: row `r` (position `i0 + r`) keeps
/// columns `0..=i0 + r`, the rest become 0. The same arithmetic as `softmax.rs`.
#[multiversion(targets("x86_64+avx512f+avx512vl+avx512dq+avx512bw", "x86_64+avx2+fma"))]
fn softmax_rows(s: &mut [f32], cols: usize, i0: usize, scale: f32) {
    for (r, row) in s.chunks_exact_mut(cols).enumerate() {
        let n = i0 + r + 1;
        let m = lane_max(n, |j| row[j] * scale);
        for x in &mut row[..n] {
            *x = exp(*x * scale - m);
        }
        let sum = lane_sum(n, |j| row[j]);
        for x in &mut row[..n] {
            *x /= sum;
        }
        row[n..].fill(0.0);
    }
}

/// `ds = scale * p * (dp - sum(dp * p))` over a block's unmasked columns, in place over `dp`.
#[multiversion(targets("x86_64+avx512f+avx512vl+avx512dq+avx512bw", "x86_64+avx2+fma"))]
fn softmax_rows_backward(dp: &mut [f32], p: &[f32], cols: usize, t: usize, i0: usize, scale: f32) {
    for (r, (d, pr)) in dp.chunks_exact_mut(cols).zip(p.chunks(t)).enumerate() {
        let n = i0 + r + 1;
        let dot = lane_sum(n, |j| d[j] * pr[j]);
        for j in 0..n {
            d[j] = scale * (pr[j] * (d[j] - dot));
        }
        d[n..].fill(0.0);
    }
}

/// `(y, p)`: the output `[b, t, heads * hd]` and the probabilities `[b, kv, groups * t, t]`.
fn forward(q: &FlexTensor, k: &FlexTensor, v: &FlexTensor, scale: f64) -> (FlexTensor, FlexTensor) {
    let d = Dims::of(q, k, v);
    let (q, k, v) = (contiguous(q), contiguous(k), contiguous(v));
    let (qs, ks, vs) = (values(&q), values(&k), values(&v));
    let t = d.t;
    // Written whole: the blocks cover every (batch, head, position), and each writes its
    // rows of `y` (a product, not accumulated) and its rows of `p`, visible columns and zeros.
    let (y, (p, ())) = written(d.b * t * d.heads() * d.hd, |y| {
        written(d.b * d.kv * d.groups * t * t, |p| {
            forward_into(&d, (qs, ks, vs), scale, y, p)
        })
    });
    let heads = d.heads();
    (
        tensor(y, [d.b, t, heads * d.hd]),
        tensor(p, [d.b, d.kv, d.groups * t, t]),
    )
}

/// [`forward`]'s blocks, writing every element of `y` and `p`.
fn forward_into(
    d: &Dims,
    (qs, ks, vs): (&[f32], &[f32], &[f32]),
    scale: f64,
    y: &mut [MaybeUninit<f32>],
    p: &mut [MaybeUninit<f32>],
) {
    let t = d.t;
    let (ys, ps) = (Shared::of_uninit(y), Shared::of_uninit(p));
    d.blocks().par_iter().for_each(|blk| {
        let (row0, cols) = (d.q_row(blk), blk.cols());
        let qv = View::new(qs, row0 * d.hd, (blk.rows, d.hd), (d.hd as isize, 1));
        let mut s = product(qv, d.k_view(ks, blk.b, blk.kv, cols).t(), false);
        softmax_rows(&mut s, cols, blk.i0, scale as f32);
        let probs = View::rows(&s, blk.rows, cols);
        let (at, ld) = d.out_at(blk);
        // SAFETY: a block's output rows (its head's columns at its positions) and its rows of
        // the probabilities belong to it alone.
        unsafe {
            gemm_at(ys, at, ld, probs, d.v_view(vs, blk.b, blk.kv, cols), false);
            for r in 0..blk.rows {
                let dst = ps.ptr().add((row0 + r) * t);
                std::ptr::copy_nonoverlapping(s.as_ptr().add(r * cols), dst, cols);
                std::ptr::write_bytes(dst.add(cols), 0, t - cols);
            }
        }
    });
}

/// `(dq, dk, dv)` from the output gradient `dy` and the forward's inputs and probabilities.
fn backward(
    dy: &FlexTensor,
    (q, k, v, p): (&FlexTensor, &FlexTensor, &FlexTensor, &FlexTensor),
    scale: f64,
) -> (FlexTensor, FlexTensor, FlexTensor) {
    let d = Dims::of(q, k, v);
    let dy = contiguous(dy);
    let (dys, qs, ks, vs, ps) = (values(&dy), values(q), values(k), values(v), values(p));
    let t = d.t;
    // Per block of query rows: ds = softmax backward of (dy @ v^T), and dq = ds @ k.
    // Written whole: the blocks cover every row of `ds` (visible columns and zeros) and of
    // `dq` (a product, not accumulated).
    let (ds, (dq, ())) = written(ps.len(), |ds| {
        written(qs.len(), |dq| {
            ds_dq_into(&d, (dys, ks, vs, ps), scale, ds, dq)
        })
    });
    let (dk, dv) = dk_dv(&d, (dys, qs, ps), &ds);
    (
        tensor(dq, dims(q)),
        tensor(dk, dims(k)),
        tensor(dv, [d.b, t, d.kv * d.hd]),
    )
}

/// Per block of query rows: `ds` = softmax backward of (dy @ v^T), and `dq = ds @ k`; writes
/// every element of both.
fn ds_dq_into(
    d: &Dims,
    (dys, ks, vs, ps): (&[f32], &[f32], &[f32], &[f32]),
    scale: f64,
    ds: &mut [MaybeUninit<f32>],
    dq: &mut [MaybeUninit<f32>],
) {
    let t = d.t;
    let (dss, dqs) = (Shared::of_uninit(ds), Shared::of_uninit(dq));
    d.blocks().par_iter().for_each(|blk| {
        let (row0, cols) = (d.q_row(blk), blk.cols());
        let (at, ld) = d.out_at(blk);
        let dyv = View::new(dys, at, (blk.rows, d.hd), (ld as isize, 1));
        let mut g = product(dyv, d.v_view(vs, blk.b, blk.kv, cols).t(), false);
        let prow = &ps[row0 * t..(row0 + blk.rows) * t];
        softmax_rows_backward(&mut g, prow, cols, t, blk.i0, scale as f32);
        let dsv = View::rows(&g, blk.rows, cols);
        // SAFETY: a block's rows of dq and of ds belong to it alone.
        unsafe {
            gemm_at(
                dqs,
                row0 * d.hd,
                d.hd,
                dsv,
                d.k_view(ks, blk.b, blk.kv, cols),
                false,
            );
            for r in 0..blk.rows {
                let dst = dss.ptr().add((row0 + r) * t);
                std::ptr::copy_nonoverlapping(g.as_ptr().add(r * cols), dst, cols);
                std::ptr::write_bytes(dst.add(cols), 0, t - cols);
            }
        }
    });
}

/// Per (batch, kv head), over its blocks in order: `dk += ds^T @ q`, `dv += p^T @ dy`.
fn dk_dv(d: &Dims, (dys, qs, ps): (&[f32], &[f32], &[f32]), ds: &[f32]) -> (Vec<f32>, Vec<f32>) {
    let t = d.t;
    let (ks_len, vs_len) = (d.b * d.kv * t * d.hd, d.b * t * d.kv * d.hd);
    let mut dk = vec![0.0f32; ks_len];
    let mut dv = vec![0.0f32; vs_len];
    let (dks, dvs) = (Shared::of(&mut dk), Shared::of(&mut dv));
    let blocks = d.blocks();
    let per_head = blocks.len() / (d.b * d.kv).max(1);
    blocks.par_chunks(per_head.max(1)).for_each(|head_blocks| {
        for blk in head_blocks {
            let (row0, cols) = (d.q_row(blk), blk.cols());
            // The block's rows of a `[.., t]` matrix (ds or p), visible columns only.
            let rows_t = |m| View::new(m, row0 * t, (blk.rows, cols), (t as isize, 1));
            let qv = View::new(qs, row0 * d.hd, (blk.rows, d.hd), (d.hd as isize, 1));
            let (at, ld) = d.out_at(blk);
            let dyv = View::new(dys, at, (blk.rows, d.hd), (ld as isize, 1));
            let k_at = (blk.b * d.kv + blk.kv) * t * d.hd;
            let v_at = blk.b * t * d.kv * d.hd + blk.kv * d.hd;
            // SAFETY: the dk rows and dv rows of one (batch, kv head) are written only by the
            // task that holds all of that head's blocks.
            unsafe {
                gemm_at(dks, k_at, d.hd, rows_t(ds).t(), qv, true);
                gemm_at(dvs, v_at, d.kv * d.hd, rows_t(ps).t(), dyv, true);
            }
        }
    });
    (dk, dv)
}

/// The attention core recorded as one autodiff op over `q`, `k`, `v`.
fn autodiff<C: CheckpointStrategy>(
    q: FloatTensor<Autodiff<Flex, C>>,
    k: FloatTensor<Autodiff<Flex, C>>,
    v: FloatTensor<Autodiff<Flex, C>>,
    scale: f64,
) -> FloatTensor<Autodiff<Flex, C>> {
    #[derive(Debug)]
    struct AttentionBackward;

    impl Backward<Flex, 3> for AttentionBackward {
        /// `q`, `k`, `v` (contiguous), the probabilities and the scale.
        type State = (FlexTensor, FlexTensor, FlexTensor, FlexTensor, f64);

        fn backward(
            self,
            ops: Ops<Self::State, 3>,
            grads: &mut Gradients,
            _checkpointer: &mut Checkpointer,
        ) {
            let [nq, nk, nv] = ops.parents;
            let dy = grads.consume::<Flex>(&ops.node);
            let (q, k, v, p, scale) = ops.state;
            let (dq, dk, dv) = backward(&dy, (&q, &k, &v, &p), scale);
            for (node, g) in [(nq, dq), (nk, dk), (nv, dv)] {
                if let Some(node) = node {
                    grads.register::<Flex>(node.id, g);
                }
            }
        }
    }

    match AttentionBackward
        .prepare::<C>([q.node(), k.node(), v.node()])
        .compute_bound()
        .stateful()
    {
        OpsKind::Tracked(prep) => {
            let (q, k, v) = (
                contiguous(q.primitive()),
                contiguous(k.primitive()),
                contiguous(v.primitive()),
            );
            let (y, p) = forward(&q, &k, &v, scale);
            prep.finish((q, k, v, p, scale), y)
        }
        OpsKind::UnTracked(prep) => {
            prep.finish(forward(q.primitive(), k.primitive(), v.primitive(), scale).0)
        }
    }
}

/// Causal attention as one op on flex (forward) and on autodiff over flex (forward and one
/// backward step), registered through a backend extension so a model mixes it freely with
/// burn's ops.
#[backend_extension(Flex, Autodiff)]
pub trait FlexCausalAttention: Backend {
    /// Causal grouped-query attention `softmax(q k^T * scale, causal) v` (layouts as
    /// [`Dims`] says); returns `[b, t, heads * hd]`.
    fn kiln_causal_attention(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        scale: f64,
    ) -> FloatTensor<Self>;
}

impl FlexCausalAttention for Flex {
    fn kiln_causal_attention(
        q: FlexTensor,
        k: FlexTensor,
        v: FlexTensor,
        scale: f64,
    ) -> FlexTensor {
        forward(&q, &k, &v, scale).0
    }
}

impl<C: CheckpointStrategy> FlexCausalAttention for Autodiff<Flex, C> {
    fn kiln_causal_attention(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        scale: f64,
    ) -> FloatTensor<Self> {
        autodiff::<C>(q, k, v, scale)
    }
}

/// Causal attention on flex ([`FlexCausalAttention`]).
pub(super) fn causal_attention(q: Tensor<4>, k: Tensor<4>, v: Tensor<3>, scale: f64) -> Tensor<3> {
    Tensor::from_dispatch(Dispatch::kiln_causal_attention(
        q.into_dispatch(),
        k.into_dispatch(),
        v.into_dispatch(),
        scale,
    ))
}

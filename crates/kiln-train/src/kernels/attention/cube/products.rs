//! Causal grouped-query attention by matrix products, for GPUs: the same function as the
//! row kernels ([`super::rows`]: same inputs, output and saved log-sum-exp), cut into chunks of
//! query positions so that at most `[chunk, t]` scores per head live at once (memory grows
//! linearly with the sequence length, as the kernels'), while the four products of each chunk
//! (`S = q k^T`, `O = P v`; backward `dP = dO v^T`, `dq = dS k`, `dk += dS^T q`,
//! `dv += P^T dO`) run on burn's matmul: tensor cores on GPUs, where the row kernels compute
//! every product one scalar at a time.
//!
//! Why: the row kernels compute every product a scalar at a time (each unit holds up to four
//! 128-wide rows in registers, spilled, and reads one shared value per multiply), far from the
//! tensor cores' rate (`bench/gpu/results/h200.md` measured them).
//!
//! A chunk of positions `[p0, p1)` takes keys `[0, p1)` only (causal), so the work is within
//! `1 + chunk / t` of the causal minimum. Two small kernels do the rest: a row softmax that
//! writes `P` and the row's log-sum-exp, and a row pass that writes `P` and
//! `dS = P (dP - D) scale` from the recomputed scores; both skip keys past the row's position.
//! Scores and their gradients are f32 (the products write f32 from bf16 inputs); `P` and `dS`
//! go into the second products in the element type, as flash attention's do. `dk` and `dv` are
//! summed over chunks in f32, in chunk order, so the sum order is fixed.
//!
//! Layouts as [`crate::kernels::attention::dims`] says, log-sum-exp per query row
//! `[b, kv, groups, t]`.

use super::layout::dims_of;
use crate::kernels::attention::dims::Dims;
use crate::kernels::device::matmul::{accumulate, vendor};
use crate::kernels::device::reduce::{cube_max, cube_sum, launch_rows, row_units};
use crate::kernels::device::tensors::{dense, dims, elem, empty_like, f32_vector};
use burn::backend::ops::FloatTensorOps;
use burn::backend::{FloatDType, Slice};
use burn::tensor::DType;
use burn_cubecl::CubeBackend;
use burn_cubecl::kernel::matmul::{MatmulStrategy, matmul};
use burn_cubecl::tensor::CubeTensor;
use cubecl::prelude::*;

type B = CubeBackend;

/// Bytes of f32 scores a chunk may hold (`[b, heads, chunk, t]`); at least 16 positions a chunk.
const CHUNK_BYTES: usize = 256 << 20;

/// A row of a chunk: its query position, and its index among all query rows
/// (`[b, kv, groups, t]`), where its log-sum-exp and `D` live.
#[derive(CubeType)]
struct Row {
    pos: usize,
    at: usize,
}

/// Row `r` of a chunk of `chunk` positions from `p0` (`[b, kv, groups, chunk]` rows).
#[cube]
fn row_of(r: usize, chunk: u32, p0: u32, seq: u32) -> Row {
    let c = chunk as usize;
    let pos = p0 as usize + r % c;
    Row {
        pos,
        at: (r / c) * (seq as usize) + pos,
    }
}

/// One cube a row of scores `s` `[rows, n]`: `p = softmax(s * scale)` over the keys up to the
/// row's position (zero after it), and the row's log-sum-exp.
#[cube(launch)]
fn softmax_rows_kernel<F: Float>(
    s: &Tensor<f32>,
    p: &mut Tensor<F>,
    lse: &mut Tensor<f32>,
    rows: u32,
    n: u32,
    chunk: u32,
    p0: u32,
    seq: u32,
    scale: f32,
    #[comptime] units: usize,
    #[define(F)] _dtype: ElemType,
) {
    let r = CUBE_POS;
    if r >= rows as usize {
        terminate!();
    }
    let row = row_of(r, chunk, p0, seq);
    let (pos, at) = (row.pos, row.at);
    let (width, u) = (n as usize, UNIT_POS as usize);
    let base = r * width;
    let mut partial = Shared::<[f32]>::new_slice(units);
    let mut mx = f32::new(-3.0e38);
    let mut j = u;
    while j <= pos {
        mx = f32::max(mx, s[base + j] * scale);
        j += units;
    }
    let m = cube_max(&mut partial, mx);
    let mut sum = 0.0f32;
    let mut j = u;
    while j <= pos {
        sum += (s[base + j] * scale - m).exp();
        j += units;
    }
    let row_lse = m + cube_sum(&mut partial, sum).ln();
    if u == 0 {
        lse[at] = row_lse;
    }
    let mut j = u;
    while j < width {
        let mut e = 0.0f32;
        if j <= pos {
            e = (s[base + j] * scale - row_lse).exp();
        }
        p[base + j] = F::cast_from(e);
        j += units;
    }
}

/// One cube a row: from the recomputed scores `s` and `dp = dO v^T` (`[rows, n]`), `p` (the
/// probabilities) and `ds = p (dp - D) scale`, both zero past the row's position.
#[cube(launch)]
fn score_grads_kernel<F: Float>(
    s: &Tensor<f32>,
    dp: &Tensor<f32>,
    lse: &Tensor<f32>,
    delta: &Tensor<f32>,
    p: &mut Tensor<F>,
    ds: &mut Tensor<F>,
    rows: u32,
    n: u32,
    chunk: u32,
    p0: u32,
    seq: u32,
    scale: f32,
    #[comptime] units: usize,
    #[define(F)] _dtype: ElemType,
) {
    let r = CUBE_POS;
    if r >= rows as usize {
        terminate!();
    }
    let row = row_of(r, chunk, p0, seq);
    let (pos, at) = (row.pos, row.at);
    let (width, base) = (n as usize, r * (n as usize));
    let (row_lse, d) = (lse[at], delta[at]);
    let mut j = UNIT_POS as usize;
    while j < width {
        let mut pr = 0.0f32;
        let mut g = 0.0f32;
        if j <= pos {
            pr = (s[base + j] * scale - row_lse).exp();
            g = pr * (dp[base + j] - d) * scale;
        }
        p[base + j] = F::cast_from(pr);
        ds[base + j] = F::cast_from(g);
        j += units;
    }
}

impl Dims {
    /// Query positions a chunk takes: `set`, or (0) as many as [`CHUNK_BYTES`] of scores hold.
    fn chunk(&self, set: usize) -> usize {
        let per_position = self.rows() * 4;
        let by_memory = (CHUNK_BYTES / per_position.max(1)).max(16);
        (if set > 0 { set } else { by_memory }).clamp(1, self.t)
    }

    /// `[b, kv, groups, t, hd]`: a query-side tensor with its heads' rows apart.
    fn heads5(&self) -> [usize; 5] {
        [self.b, self.kv, self.groups, self.t, self.hd]
    }
}

/// `a @ b` written in `out` (f32 for scores and summed gradients): cuBLAS on CUDA, elsewhere
/// burn's autotuned matmul, or burn's plain matmul and a cast if that cannot write `out` from
/// these inputs.
fn product(a: CubeTensor, b: CubeTensor, out: DType) -> CubeTensor {
    if let Some(y) = vendor(&a, &b, out) {
        return y;
    }
    match matmul(a.clone(), b.clone(), None, MatmulStrategy::default(), out) {
        Ok(y) => y,
        Err(_) => B::float_cast(B::float_matmul(a, b), FloatDType::from(out)),
    }
}

/// Positions `[p0, p1)` of a `[b, kv, groups, t, hd]` tensor as `[b, kv, groups * c, hd]`.
fn rows_of(x5: &CubeTensor, p0: usize, p1: usize, d: &Dims) -> CubeTensor {
    let full = Slice::full();
    let part = B::float_slice(x5.clone(), &[full, full, full, Slice::from(p0..p1), full]);
    B::float_reshape(dense(part), [d.b, d.kv, d.groups * (p1 - p0), d.hd].into())
}

/// Keys (or values) `[0, p1)` of a `[b, kv, t, hd]` tensor.
fn prefix(x: &CubeTensor, p1: usize) -> CubeTensor {
    let full = Slice::full();
    B::float_slice(x.clone(), &[full, full, Slice::from(0..p1), full])
}

/// Adds `a @ b` (`[b, kv, p1, hd]`, in f32) to the first `p1` positions of `acc`
/// (`[b, kv, t, hd]`, f32): in place by the vendor's BLAS where it can (no product tensor,
/// add or copy), else a product and [`add_prefix`].
fn add_product(acc: CubeTensor, a: CubeTensor, b: CubeTensor, p1: usize) -> CubeTensor {
    if accumulate(&a, &b, &prefix_view(&acc, p1)) {
        return acc;
    }
    add_prefix(acc, product(a, b, DType::F32), p1)
}

/// The first `p1` positions of `acc` (`[b, kv, t, hd]`, contiguous) as a view of its buffer,
/// never a copy (burn's slice copies when the cut is not at an aligned offset), for products
/// that add into it in place.
fn prefix_view(acc: &CubeTensor, p1: usize) -> CubeTensor {
    let mut view = acc.clone();
    view.meta.shape[2] = p1;
    view
}

/// Adds `part` (`[b, kv, p1, hd]`) to the first `p1` positions of `acc` (`[b, kv, t, hd]`).
fn add_prefix(acc: CubeTensor, part: CubeTensor, p1: usize) -> CubeTensor {
    let full = Slice::full();
    let slices = [full, full, Slice::from(0..p1), full];
    let sum = B::float_add(B::float_slice(acc.clone(), &slices), part);
    B::float_slice_assign(acc, &slices, sum)
}

/// `v` `[b, t, kv * hd]` as `[b, kv, t, hd]`, contiguous.
fn heads_of_v(v: CubeTensor, d: &Dims) -> CubeTensor {
    let v4 = B::float_reshape(v, [d.b, d.t, d.kv, d.hd].into());
    dense(B::float_permute(v4, &[0, 2, 1, 3]))
}

/// `x` `[b, t, heads * hd]` (the output's layout) as `[b, kv, groups, t, hd]`, contiguous.
fn heads_of_out(x: CubeTensor, d: &Dims) -> CubeTensor {
    let x5 = B::float_reshape(x, [d.b, d.t, d.kv, d.groups, d.hd].into());
    dense(B::float_permute(x5, &[0, 2, 3, 1, 4]))
}

/// A zero tensor of `shape` in `dtype` on `like`'s device.
fn zeros(like: &CubeTensor, shape: &[usize], dtype: DType) -> CubeTensor {
    B::float_zeros(shape.into(), &like.device, FloatDType::from(dtype))
}

/// `(output, log-sum-exp per query row)`, `chunk` query positions a chunk (0: by memory).
pub(super) fn forward(
    q: CubeTensor,
    k: CubeTensor,
    v: CubeTensor,
    scale: f64,
    chunk: usize,
) -> (CubeTensor, CubeTensor) {
    let (q, k) = (dense(q), dense(k));
    let d = dims_of(&q, &k);
    let q5 = B::float_reshape(q.clone(), d.heads5().into());
    let vh = heads_of_v(dense(v), &d);
    let lse = f32_vector(&q, d.rows());
    let mut out5 = empty_like(&q, d.heads5());
    let units = row_units(&q);
    let c = d.chunk(chunk);
    for p0 in (0..d.t).step_by(c) {
        let p1 = (p0 + c).min(d.t);
        let s = product(
            rows_of(&q5, p0, p1, &d),
            B::float_transpose(prefix(&k, p1)),
            DType::F32,
        );
        let rows = d.b * d.kv * d.groups * (p1 - p0);
        let p = empty_like(&q, [d.b, d.kv, d.groups * (p1 - p0), p1]);
        let (count, dim) = launch_rows(rows, units);
        softmax_rows_kernel::launch(
            &q.client,
            count,
            dim,
            s.into_tensor_arg(),
            p.clone().into_tensor_arg(),
            lse.clone().into_tensor_arg(),
            rows as u32,
            p1 as u32,
            (p1 - p0) as u32,
            p0 as u32,
            d.t as u32,
            scale as f32,
            units,
            elem(&q),
        );
        let o = product(p, prefix(&vh, p1), q.dtype);
        let o5 = B::float_reshape(o, [d.b, d.kv, d.groups, p1 - p0, d.hd].into());
        let full = Slice::full();
        let at = [full, full, full, Slice::from(p0..p1), full];
        out5 = B::float_slice_assign(out5, &at, o5);
    }
    let out = dense(B::float_permute(out5, &[0, 3, 1, 2, 4]));
    let heads = d.kv * d.groups;
    (B::float_reshape(out, [d.b, d.t, heads * d.hd].into()), lse)
}

/// `D = dO . O` per query row, f32, `[b, kv, groups, t]` flattened.
fn row_deltas(dout5: &CubeTensor, out: CubeTensor, d: &Dims) -> CubeTensor {
    let f32s = |x: CubeTensor| B::float_cast(x, FloatDType::F32);
    let o5 = heads_of_out(out, d);
    let prod = B::float_mul(f32s(dout5.clone()), f32s(o5));
    let sums = B::float_sum_dim(prod, 4);
    dense(B::float_reshape(sums, [d.rows()].into()))
}

/// `(dq, dk, dv)` for the upstream gradient `dout`, from the saved inputs, output and
/// log-sum-exp, `chunk` query positions a chunk (0: by memory).
pub(super) fn backward(
    dout: CubeTensor,
    (q, k, v, out, lse): (CubeTensor, CubeTensor, CubeTensor, CubeTensor, CubeTensor),
    scale: f64,
    chunk: usize,
) -> (CubeTensor, CubeTensor, CubeTensor) {
    let d = dims_of(&q, &k);
    let dtype = q.dtype;
    let q5 = B::float_reshape(q.clone(), d.heads5().into());
    let vh = heads_of_v(v, &d);
    let do5 = heads_of_out(dense(dout), &d);
    let delta = row_deltas(&do5, out, &d);
    let mut dq5 = empty_like(&q, d.heads5());
    let kv_shape = [d.b, d.kv, d.t, d.hd];
    let (mut dk, mut dv) = (
        zeros(&q, &kv_shape, DType::F32),
        zeros(&q, &kv_shape, DType::F32),
    );
    let units = row_units(&q);
    let c = d.chunk(chunk);
    for p0 in (0..d.t).step_by(c) {
        let p1 = (p0 + c).min(d.t);
        let (qc, doc) = (rows_of(&q5, p0, p1, &d), rows_of(&do5, p0, p1, &d));
        let (kp, vp) = (prefix(&k, p1), prefix(&vh, p1));
        let s = product(qc.clone(), B::float_transpose(kp.clone()), DType::F32);
        let dp = product(doc.clone(), B::float_transpose(vp), DType::F32);
        let rows = d.b * d.kv * d.groups * (p1 - p0);
        let shape = [d.b, d.kv, d.groups * (p1 - p0), p1];
        let (p, ds) = (empty_like(&q, shape), empty_like(&q, shape));
        let (count, dim) = launch_rows(rows, units);
        score_grads_kernel::launch(
            &q.client,
            count,
            dim,
            s.into_tensor_arg(),
            dp.into_tensor_arg(),
            lse.clone().into_tensor_arg(),
            delta.clone().into_tensor_arg(),
            p.clone().into_tensor_arg(),
            ds.clone().into_tensor_arg(),
            rows as u32,
            p1 as u32,
            (p1 - p0) as u32,
            p0 as u32,
            d.t as u32,
            scale as f32,
            units,
            elem(&q),
        );
        let dqc = product(ds.clone(), kp, dtype);
        let full = Slice::full();
        let at = [full, full, full, Slice::from(p0..p1), full];
        let dqc5 = B::float_reshape(dqc, [d.b, d.kv, d.groups, p1 - p0, d.hd].into());
        dq5 = B::float_slice_assign(dq5, &at, dqc5);
        dk = add_product(dk, B::float_transpose(ds), qc, p1);
        dv = add_product(dv, B::float_transpose(p), doc, p1);
    }
    let cast = |x: CubeTensor| B::float_cast(x, FloatDType::from(dtype));
    let dq = B::float_reshape(dq5, dims(&q).into());
    let dv = dense(B::float_permute(cast(dv), &[0, 2, 1, 3]));
    let dv = B::float_reshape(dv, [d.b, d.t, d.kv * d.hd].into());
    (dq, cast(dk), dv)
}

/// The kernels in `e`, a row's cube of 256 units, defined for no device (see
/// [`crate::kernels::device::offline`]).
#[cfg(any(feature = "cuda", feature = "rocm"))]
pub(super) fn offline(
    e: ElemType,
) -> Vec<(&'static str, Box<dyn cubecl_runtime::kernel::CubeKernel>)> {
    use crate::kernels::device::offline::{props, settings, tensor};
    let (p, t) = props(None);
    let units = 256;
    vec![
        (
            "softmax_rows",
            Box::new(softmax_rows_kernel::SoftmaxRowsKernel::new(
                settings(units),
                p.clone(),
                t.clone(),
                tensor(),
                tensor(),
                tensor(),
                (),
                (),
                (),
                (),
                (),
                (),
                units,
                e,
            )),
        ),
        (
            "score_grads",
            Box::new(score_grads_kernel::ScoreGradsKernel::new(
                settings(units),
                p,
                t,
                tensor(),
                tensor(),
                tensor(),
                tensor(),
                tensor(),
                tensor(),
                (),
                (),
                (),
                (),
                (),
                (),
                units,
                e,
            )),
        ),
    ]
}

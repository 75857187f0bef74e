//! Causal grouped-query attention in CubeCL by row kernels, flash-style: the `T x T` scores
//! and probabilities are never stored. Forward runs one unit per query row with an online
//! softmax and saves the row's log-sum-exp; backward recomputes each probability from it, one
//! unit per query row for `dq` (and the row's `D = dO . O`), then one unit per key row for `dk`
//! and `dv`, summing over the query rows of every head in its group. Memory beyond the inputs
//! and outputs: two floats per query row. Every product is a scalar at a time: CubeCL's CPU
//! runtime's path; GPUs take the products or the flash kernels.
//!
//! Tiled: a cube takes a block of rows of one K/V head (one unit each) and walks the other
//! side in tiles of [`TILE`] rows that its units load into shared memory together, so each key
//! (or query) row is read from global memory once a cube instead of once a unit. Tiles past
//! the cube's last causal position are skipped. Sums still run in a fixed order (tile by tile,
//! row by row) with no atomics, and the block size changes no sum, only who loads what.
//! CubeCL's CPU runtime runs a cube barrier as one spinning thread per unit, so there a block
//! is one row (`kernels::settings::Settings::attention_rows` sets more, for tests of the cooperative
//! loads); GPUs take [`GPU_BLOCK`].
//!
//! Layouts as [`crate::kernels::attention::dims`] says.

use super::layout::{Head, dims_of, head_of, out_row};
use crate::kernels::attention::dims::Dims;
use crate::kernels::device::tensors::{dense, dims, elem, empty_like, f32_vector};
use burn_cubecl::tensor::CubeTensor;
use cubecl::prelude::*;

/// Rows of one K/V head a cube takes on GPUs, one unit each (two warps).
pub(super) const GPU_BLOCK: usize = 64;
/// Rows of the other side a shared-memory tile holds.
const TILE: usize = 32;

impl Dims {
    /// Cubes of `block` units for `per_head` rows of every K/V head of every batch row.
    fn launch(&self, per_head: usize, block: usize) -> (CubeCount, CubeDim) {
        let blocks = per_head.div_ceil(block).max(1) as u32;
        (
            CubeCount::Static(blocks, (self.b * self.kv) as u32, 1),
            CubeDim::new_1d(block as u32),
        )
    }
}

/// The last position among rows `[r0, r0 + block)` of a slice of `rows` rows of `t`
/// positions each (the block may cross from one query head into the next).
#[cube]
fn last_position(r0: usize, rows: usize, t: usize, #[comptime] block: usize) -> usize {
    let last = usize::min(r0 + block, rows) - 1;
    let mut p = t - 1;
    if r0 / t == last / t {
        p = last % t;
    }
    p
}

/// This unit's query row in its cube's block of a K/V head's slice: the row `r` (a unit past
/// the slice's end is not `active` and only helps load tiles), its index `u` among all query
/// rows, its position `p`, and how many key tiles the block needs.
#[derive(CubeType)]
struct QueryBlock {
    r: usize,
    active: bool,
    u: usize,
    p: usize,
    tiles: usize,
}

#[cube]
fn query_block(groups: u32, seq: u32, #[comptime] block: usize) -> QueryBlock {
    let (t, rows) = (seq as usize, (groups * seq) as usize);
    let r0 = CUBE_POS_X as usize * block;
    let r = r0 + UNIT_POS as usize;
    QueryBlock {
        r,
        active: r < rows,
        u: CUBE_POS_Y as usize * rows + r,
        p: r % t,
        tiles: last_position(r0, rows, t, block) / TILE + 1,
    }
}

/// Loads keys and values `[k0, k0 + TILE)` of head `h` into `ks`, `vs` as f32, the cube's
/// units together; rows past the sequence are left as they are (never read).
#[cube]
#[allow(clippy::too_many_arguments)]
fn load_kv<F: Float>(
    k: &Tensor<F>,
    v: &Tensor<F>,
    ks: &mut Shared<[f32]>,
    vs: &mut Shared<[f32]>,
    h: &Head,
    k0: usize,
    t: usize,
    #[comptime] hd: usize,
    #[comptime] block: usize,
) {
    let n = comptime!(TILE * hd);
    for step in 0..comptime!(n.div_ceil(block)) {
        let i = step * block + UNIT_POS as usize;
        let key = k0 + i / hd;
        if i < n && key < t {
            let j = i % hd;
            ks[i] = f32::cast_from(k[h.kb + key * hd + j]);
            vs[i] = f32::cast_from(v[h.vb + key * h.vrow + j]);
        }
    }
}

/// `a[a_at..] . s[s_at..]` over a head, `a` in registers, `s` in shared memory.
#[cube]
fn dot_shared(a: &Array<f32>, s: &Shared<[f32]>, s_at: usize, #[comptime] hd: usize) -> f32 {
    let mut acc = 0.0f32;
    for j in 0..hd {
        acc += a[j] * s[s_at + j];
    }
    acc
}

/// Row `at` of `x` (a head's width), as f32 in registers; zeros when not `active`.
#[cube]
fn load_row<F: Float>(x: &Tensor<F>, at: usize, active: bool, #[comptime] hd: usize) -> Array<f32> {
    let mut row = Array::<f32>::new(hd);
    for j in 0..hd {
        row[j] = 0.0f32;
        if active {
            row[j] = f32::cast_from(x[at + j]);
        }
    }
    row
}

/// An f32 array of `hd` zeros.
#[cube]
fn zeros(#[comptime] hd: usize) -> Array<f32> {
    let mut a = Array::<f32>::new(hd);
    for j in 0..hd {
        a[j] = 0.0f32;
    }
    a
}

#[cube(launch)]
fn attention_forward_kernel<F: Float>(
    q: &Tensor<F>,
    k: &Tensor<F>,
    v: &Tensor<F>,
    out: &mut Tensor<F>,
    lse: &mut Tensor<f32>,
    kv: u32,
    groups: u32,
    seq: u32,
    scale: f32,
    #[comptime] hd: usize,
    #[comptime] block: usize,
    #[define(F)] _dtype: ElemType,
) {
    let t = seq as usize;
    let h = head_of(CUBE_POS_Y as usize, kv, seq, hd);
    let qb = query_block(groups, seq, block);
    let (r, active, u, p) = (qb.r, qb.active, qb.u, qb.p);
    let qrow = load_row::<F>(q, u * hd, active, hd);
    let mut ks = Shared::<[f32]>::new_slice(comptime!(TILE * hd));
    let mut vs = Shared::<[f32]>::new_slice(comptime!(TILE * hd));
    // Key 0 is always visible: it starts the running max below.
    let mut m = 0.0f32;
    let mut l = 0.0f32;
    let mut acc = zeros(hd);
    for tile in 0..qb.tiles {
        let k0 = tile * TILE;
        load_kv::<F>(k, v, &mut ks, &mut vs, &h, k0, t, hd, block);
        sync_cube();
        if active && p >= k0 {
            for key in k0..usize::min(p + 1, k0 + TILE) {
                let at = (key - k0) * hd;
                let s = dot_shared(&qrow, &ks, at, hd) * scale;
                if key == 0 {
                    m = s;
                }
                let m_new = f32::max(m, s);
                let keep = (m - m_new).exp();
                let e = (s - m_new).exp();
                l = l * keep + e;
                for j in 0..hd {
                    acc[j] = acc[j] * keep + e * vs[at + j];
                }
                m = m_new;
            }
        }
        sync_cube();
    }
    if active {
        let ob = out_row(&h, r, kv, groups, seq, hd);
        for j in 0..hd {
            out[ob + j] = F::cast_from(acc[j] / l);
        }
        lse[u] = m + l.ln();
    }
}

/// One unit per query row: `D = dO . O` (saved for the key kernel) and
/// `dq = scale * sum_k p (dO . v_k - D) k_k`.
#[cube(launch)]
fn attention_dq_kernel<F: Float>(
    q: &Tensor<F>,
    k: &Tensor<F>,
    v: &Tensor<F>,
    out: &Tensor<F>,
    dout: &Tensor<F>,
    lse: &Tensor<f32>,
    delta: &mut Tensor<f32>,
    dq: &mut Tensor<F>,
    kv: u32,
    groups: u32,
    seq: u32,
    scale: f32,
    #[comptime] hd: usize,
    #[comptime] block: usize,
    #[define(F)] _dtype: ElemType,
) {
    let t = seq as usize;
    let h = head_of(CUBE_POS_Y as usize, kv, seq, hd);
    let qb = query_block(groups, seq, block);
    let (r, active, u, p) = (qb.r, qb.active, qb.u, qb.p);
    let ob = out_row(&h, r, kv, groups, seq, hd);
    let qrow = load_row::<F>(q, u * hd, active, hd);
    let dorow = load_row::<F>(dout, ob, active, hd);
    let orow = load_row::<F>(out, ob, active, hd);
    let mut d = 0.0f32;
    let mut row_lse = 0.0f32;
    if active {
        for j in 0..hd {
            d += dorow[j] * orow[j];
        }
        delta[u] = d;
        row_lse = lse[u];
    }
    let mut ks = Shared::<[f32]>::new_slice(comptime!(TILE * hd));
    let mut vs = Shared::<[f32]>::new_slice(comptime!(TILE * hd));
    let mut acc = zeros(hd);
    for tile in 0..qb.tiles {
        let k0 = tile * TILE;
        load_kv::<F>(k, v, &mut ks, &mut vs, &h, k0, t, hd, block);
        sync_cube();
        if active && p >= k0 {
            for key in k0..usize::min(p + 1, k0 + TILE) {
                let at = (key - k0) * hd;
                let prob = (dot_shared(&qrow, &ks, at, hd) * scale - row_lse).exp();
                let ds = prob * (dot_shared(&dorow, &vs, at, hd) - d);
                for j in 0..hd {
                    acc[j] += ds * ks[at + j];
                }
            }
        }
        sync_cube();
    }
    if active {
        for j in 0..hd {
            dq[u * hd + j] = F::cast_from(acc[j] * scale);
        }
    }
}

/// One unit per key row: `dv_k = sum_r p dO_r` and `dk_k = scale * sum_r p (dO_r . v_k - D_r)
/// q_r` over the query rows of every head in the group that see key `k`, the query rows
/// (with their `dO` rows, log-sum-exp and `D`) walked in shared-memory tiles.
#[cube(launch)]
fn attention_dkv_kernel<F: Float>(
    q: &Tensor<F>,
    k: &Tensor<F>,
    v: &Tensor<F>,
    dout: &Tensor<F>,
    lse: &Tensor<f32>,
    delta: &Tensor<f32>,
    dk: &mut Tensor<F>,
    dv: &mut Tensor<F>,
    kv: u32,
    groups: u32,
    seq: u32,
    scale: f32,
    #[comptime] hd: usize,
    #[comptime] block: usize,
    #[define(F)] _dtype: ElemType,
) {
    let (g, t) = (groups as usize, seq as usize);
    let bk = CUBE_POS_Y as usize;
    let h = head_of(bk, kv, seq, hd);
    let key0 = CUBE_POS_X as usize * block;
    let key = key0 + UNIT_POS as usize;
    let active = key < t;
    let (ka, va) = (h.kb + key * hd, h.vb + key * h.vrow);
    let krow = load_row::<F>(k, ka, active, hd);
    let vrow = load_row::<F>(v, va, active, hd);
    let mut qs = Shared::<[f32]>::new_slice(comptime!(TILE * hd));
    let mut dos = Shared::<[f32]>::new_slice(comptime!(TILE * hd));
    let mut ls = Shared::<[f32]>::new_slice(TILE);
    let mut ds_ = Shared::<[f32]>::new_slice(TILE);
    let mut dk_acc = zeros(hd);
    let mut dv_acc = zeros(hd);
    let n = comptime!(TILE * hd);
    for gi in 0..g {
        // Query rows of this head at positions >= the cube's first key, tile by tile.
        for tile in key0 / TILE..t.div_ceil(TILE) {
            let p0 = tile * TILE;
            for step in 0..comptime!(n.div_ceil(block)) {
                let i = step * block + UNIT_POS as usize;
                let p = p0 + i / hd;
                if i < n && p < t {
                    let j = i % hd;
                    let r = gi * t + p;
                    qs[i] = f32::cast_from(q[(bk * g * t + r) * hd + j]);
                    dos[i] = f32::cast_from(dout[out_row(&h, r, kv, groups, seq, hd) + j]);
                }
            }
            for step in 0..comptime!(TILE.div_ceil(block)) {
                let i = step * block + UNIT_POS as usize;
                if i < TILE && p0 + i < t {
                    let u = bk * g * t + gi * t + p0 + i;
                    ls[i] = lse[u];
                    ds_[i] = delta[u];
                }
            }
            sync_cube();
            if active {
                for p in usize::max(key, p0)..usize::min(t, p0 + TILE) {
                    let (at, c) = ((p - p0) * hd, p - p0);
                    let prob = (dot_shared(&krow, &qs, at, hd) * scale - ls[c]).exp();
                    let ds = prob * (dot_shared(&vrow, &dos, at, hd) - ds_[c]);
                    for j in 0..hd {
                        dv_acc[j] += prob * dos[at + j];
                        dk_acc[j] += ds * qs[at + j];
                    }
                }
            }
            sync_cube();
        }
    }
    if active {
        for j in 0..hd {
            dk[ka + j] = F::cast_from(dk_acc[j] * scale);
            dv[va + j] = F::cast_from(dv_acc[j]);
        }
    }
}

/// `(output, log-sum-exp per query row)`, `block` query rows a cube.
pub(super) fn forward(
    q: CubeTensor,
    k: CubeTensor,
    v: CubeTensor,
    scale: f64,
    block: usize,
) -> (CubeTensor, CubeTensor) {
    let d = dims_of(&q, &k);
    let (q, k, v) = (dense(q), dense(k), dense(v));
    let out = empty_like(&q, [d.b, d.t, d.kv * d.groups * d.hd]);
    let lse = f32_vector(&q, d.rows());
    let (count, dim) = d.launch(d.groups * d.t, block);
    attention_forward_kernel::launch(
        &q.client,
        count,
        dim,
        q.clone().into_tensor_arg(),
        k.into_tensor_arg(),
        v.into_tensor_arg(),
        out.clone().into_tensor_arg(),
        lse.clone().into_tensor_arg(),
        d.kv as u32,
        d.groups as u32,
        d.t as u32,
        scale as f32,
        d.hd,
        block,
        elem(&q),
    );
    (out, lse)
}

/// `(dq, dk, dv)` for the upstream gradient `dout`, from the saved inputs, output and
/// log-sum-exp, `block` rows a cube.
pub(super) fn backward(
    dout: CubeTensor,
    (q, k, v, out, lse): (CubeTensor, CubeTensor, CubeTensor, CubeTensor, CubeTensor),
    scale: f64,
    block: usize,
) -> (CubeTensor, CubeTensor, CubeTensor) {
    let dout = dense(dout);
    let d = dims_of(&q, &k);
    let (dq, dk, dv) = (
        empty_like(&q, dims(&q)),
        empty_like(&k, dims(&k)),
        empty_like(&v, dims(&v)),
    );
    let delta = f32_vector(&q, d.rows());
    let (count, dim) = d.launch(d.groups * d.t, block);
    attention_dq_kernel::launch(
        &q.client,
        count,
        dim,
        q.clone().into_tensor_arg(),
        k.clone().into_tensor_arg(),
        v.clone().into_tensor_arg(),
        out.into_tensor_arg(),
        dout.clone().into_tensor_arg(),
        lse.clone().into_tensor_arg(),
        delta.clone().into_tensor_arg(),
        dq.clone().into_tensor_arg(),
        d.kv as u32,
        d.groups as u32,
        d.t as u32,
        scale as f32,
        d.hd,
        block,
        elem(&q),
    );
    let (count, dim) = d.launch(d.t, block);
    attention_dkv_kernel::launch(
        &q.client,
        count,
        dim,
        q.clone().into_tensor_arg(),
        k.into_tensor_arg(),
        v.into_tensor_arg(),
        dout.into_tensor_arg(),
        lse.into_tensor_arg(),
        delta.into_tensor_arg(),
        dk.clone().into_tensor_arg(),
        dv.clone().into_tensor_arg(),
        d.kv as u32,
        d.groups as u32,
        d.t as u32,
        scale as f32,
        d.hd,
        block,
        elem(&q),
    );
    (dq, dk, dv)
}

/// The kernels in `e` at head dimension `hd`, in cubes of [`GPU_BLOCK`] rows, defined for no
/// device (see [`crate::kernels::device::offline`]).
#[cfg(any(feature = "cuda", feature = "rocm"))]
pub(super) fn offline(
    e: ElemType,
    hd: usize,
) -> Vec<(&'static str, Box<dyn cubecl_runtime::kernel::CubeKernel>)> {
    use crate::kernels::device::offline::{props, settings, tensor};
    let (p, t) = props(None);
    let block = GPU_BLOCK;
    let s = || settings(block);
    vec![
        (
            "forward",
            Box::new(attention_forward_kernel::AttentionForwardKernel::new(
                s(),
                p.clone(),
                t.clone(),
                tensor(),
                tensor(),
                tensor(),
                tensor(),
                tensor(),
                (),
                (),
                (),
                (),
                hd,
                block,
                e,
            )),
        ),
        (
            "dq",
            Box::new(attention_dq_kernel::AttentionDqKernel::new(
                s(),
                p.clone(),
                t.clone(),
                tensor(),
                tensor(),
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
                hd,
                block,
                e,
            )),
        ),
        (
            "dkv",
            Box::new(attention_dkv_kernel::AttentionDkvKernel::new(
                s(),
                p,
                t,
                tensor(),
                tensor(),
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
                hd,
                block,
                e,
            )),
        ),
    ]
}

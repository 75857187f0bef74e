//! The `dk`/`dv` kernel: a cube per block of keys, walking the query rows of every head in its
//! group from the block's first key on: `dv += P^T dO`, `dk += dS^T q`.

use super::staging::{Rows, fetch, fill, kv_rows, put, rows_at, stage, tile_registers, unstage};
use super::tiles::{
    ALIGN, Tiling, UNROLL, accumulate, accumulators, against, back, store_fragments, tile_product,
};
use crate::kernels::attention::cube::layout::{Head, head_of, out_row};
use cubecl::prelude::*;

/// `dv = sum_r P^T dO` and `dk = scale * sum_r (P (dP - D))^T q` for a block of keys, over
/// the query rows of every head in the group at or after the block's first key.
#[cube(launch)]
#[allow(clippy::too_many_arguments)]
pub(super) fn flash_dkv_kernel<F: Float, N: Size>(
    q: &Tensor<Vector<F, N>>,
    k: &Tensor<Vector<F, N>>,
    v: &Tensor<Vector<F, N>>,
    dout: &Tensor<Vector<F, N>>,
    lse: &Tensor<f32>,
    delta: &Tensor<f32>,
    dk: &mut Tensor<Vector<F, N>>,
    dv: &mut Tensor<Vector<F, N>>,
    kv: u32,
    groups: u32,
    seq: u32,
    scale: f32,
    #[comptime] c: Tiling,
    #[define(F)] _dtype: ElemType,
) {
    let (g, t, hd) = (groups as usize, seq as usize, c.hd);
    let (bk, bq) = (c.rows, c.cols);
    // Key blocks longest first over all K/V heads (block 0, the most query rows after it, of
    // every head first), as `query_block` hands out query blocks.
    let kv_heads = CUBE_COUNT / t.div_ceil(bk);
    let (rank, head) = (CUBE_POS / kv_heads, CUBE_POS % kv_heads);
    let h = head_of(head, kv, seq, hd);
    let key0 = rank * bk;
    let keys = usize::min(bk, t - key0);
    let mut ks = Shared::<[F]>::new_aligned_slice(comptime!(bk * c.ldh), ALIGN);
    let mut vs = Shared::<[F]>::new_aligned_slice(comptime!(bk * c.ldh), ALIGN);
    let mut qs = Shared::<[F]>::new_aligned_slice(comptime!(bq * c.ldh), ALIGN);
    let mut dos = Shared::<[F]>::new_aligned_slice(comptime!(bq * c.ldh), ALIGN);
    let mut sts = Shared::<[f32]>::new_aligned_slice(comptime!(bk * c.lds), ALIGN);
    let mut dpts = Shared::<[f32]>::new_aligned_slice(comptime!(bk * c.lds), ALIGN);
    let mut pts = Shared::<[F]>::new_aligned_slice(comptime!(bk * c.ldp), ALIGN);
    let mut dsts = Shared::<[F]>::new_aligned_slice(comptime!(bk * c.ldp), ALIGN);
    let mut dks = Shared::<[f32]>::new_aligned_slice(comptime!(bk * c.ldo), ALIGN);
    let mut dvs = Shared::<[f32]>::new_aligned_slice(comptime!(bk * c.ldo), ALIGN);
    let mut ls = Shared::<[f32]>::new_slice(bq);
    let mut ds = Shared::<[f32]>::new_slice(bq);
    stage::<F, N>(k, &mut ks, &kv_rows(&h, key0, t, true, bk, c), bk, c);
    stage::<F, N>(v, &mut vs, &kv_rows(&h, key0, t, false, bk, c), bk, c);
    if comptime!(!c.mma) {
        fill(&mut dks, 0.0f32, comptime!(bk * c.ldo), c);
        fill(&mut dvs, 0.0f32, comptime!(bk * c.ldo), c);
    }
    let grad = comptime!(back(c, bk, bq));
    let (mut dkacc, mut dvacc) = (accumulators(grad, c), accumulators(grad, c));
    // One step a tile of query rows of a head of the group, the next step's rows, their
    // log-sum-exp and `D` in flight while the cube works on this one's.
    let first = key0 / bq;
    let per_head = t.div_ceil(bq) - first;
    let steps = g * per_head;
    let (mut qr, mut dor) = (
        tile_registers::<F, N>(q, bq, c),
        tile_registers::<F, N>(dout, bq, c),
    );
    let mut tile = first;
    let first_at = query_tile(&h, head, tile, kv, groups, seq, bq, c);
    fetch::<F, N>(q, &mut qr, &first_at.q, bq, c);
    fetch::<F, N>(dout, &mut dor, &first_at.dout, bq, c);
    let (mut l, mut d) = row_stat(lse, delta, &first_at);
    for step in 0..steps {
        let at = query_tile(&h, head, tile, kv, groups, seq, bq, c);
        let (p0, valid) = (at.p0, at.q.valid);
        put::<F, N>(&qr, &mut qs, bq, c);
        put::<F, N>(&dor, &mut dos, bq, c);
        put_row_stats(lse, delta, &mut ls, &mut ds, l, d, &at, c);
        sync_cube();
        if step + 1 < steps {
            let next = step + 1;
            tile = (next / per_head) * t.div_ceil(bq) + first + next % per_head;
            let ahead = query_tile(&h, head, tile, kv, groups, seq, bq, c);
            fetch::<F, N>(q, &mut qr, &ahead.q, bq, c);
            fetch::<F, N>(dout, &mut dor, &ahead.dout, bq, c);
            let (nl, nd) = row_stat(lse, delta, &ahead);
            l = nl;
            d = nd;
        }
        tile_product::<F>(&ks, &qs, &mut sts, comptime!(against(c, bk, bq)), c);
        tile_product::<F>(&vs, &dos, &mut dpts, comptime!(against(c, bk, bq)), c);
        sync_cube();
        key_grads::<F>(
            &sts, &dpts, &ls, &ds, &mut pts, &mut dsts, key0, keys, p0, valid, scale, c,
        );
        sync_cube();
        accumulate::<F>(&pts, &dos, &mut dvacc, &mut dvs, grad, c);
        accumulate::<F>(&dsts, &qs, &mut dkacc, &mut dks, grad, c);
        sync_cube();
    }
    if comptime!(c.mma) {
        store_fragments(&mut dkacc, &mut dks, grad, c);
        store_fragments(&mut dvacc, &mut dvs, grad, c);
        sync_cube();
    }
    unstage::<F, N>(&dks, dk, h.kb + key0 * hd, hd, keys, c);
    unstage::<F, N>(&dvs, dv, h.vb + key0 * h.vrow, h.vrow, keys, c);
}

/// `P^T` and `dS^T` of the `dk`/`dv` kernel's tile (its `keys` keys from `key0` against the
/// `valid` query rows from position `p0`), from the transposed scores `sts` and `dP^T`
/// `dpts`; zero where a key is past the query's position or either is past the real ones.
#[cube]
#[allow(clippy::too_many_arguments)]
pub(super) fn key_grads<F: Float>(
    sts: &Shared<[f32]>,
    dpts: &Shared<[f32]>,
    ls: &Shared<[f32]>,
    ds: &Shared<[f32]>,
    pts: &mut Shared<[F]>,
    dsts: &mut Shared<[F]>,
    key0: usize,
    keys: usize,
    p0: usize,
    valid: usize,
    scale: f32,
    #[comptime] c: Tiling,
) {
    let (bk, bq) = (c.rows, c.cols);
    let count = comptime!((bk * bq).div_ceil(c.units));
    #[unroll(count <= UNROLL)]
    for i in 0..count {
        let idx = UNIT_POS as usize + i * c.units;
        if idx < comptime!(bk * bq) {
            let (kr, col) = (idx / bq, idx % bq);
            let mut p = 0.0f32;
            let mut gr = 0.0f32;
            if kr < keys && col < valid && key0 + kr <= p0 + col {
                p = (sts[kr * c.lds + col] * scale - ls[col]).exp();
                gr = p * (dpts[kr * c.lds + col] - ds[col]) * scale;
            }
            pts[kr * c.ldp + col] = F::cast_from(p);
            dsts[kr * c.ldp + col] = F::cast_from(gr);
        }
    }
}

/// The query tile `at`'s log-sum-exp and `D` into `ls` and `ds` (`c.cols` rows): from this
/// unit's prefetched `l` and `d` (unit `i` row `i`) where the units cover the rows, else read
/// here (CubeCL's CPU runtime in tests: fewer units than rows).
#[cube]
#[allow(clippy::too_many_arguments)]
pub(super) fn put_row_stats(
    lse: &Tensor<f32>,
    delta: &Tensor<f32>,
    ls: &mut Shared<[f32]>,
    ds: &mut Shared<[f32]>,
    l: f32,
    d: f32,
    at: &QueryTile,
    #[comptime] c: Tiling,
) {
    let bq = c.cols;
    if comptime!(c.units >= bq) {
        if UNIT_POS < bq as u32 {
            ls[UNIT_POS as usize] = l;
            ds[UNIT_POS as usize] = d;
        }
    } else {
        let mut i = UNIT_POS as usize;
        while i < bq {
            let mut li = 0.0f32;
            let mut di = 0.0f32;
            if i < at.q.valid {
                li = lse[at.u0 + i];
                di = delta[at.u0 + i];
            }
            ls[i] = li;
            ds[i] = di;
            i += c.units;
        }
    }
}

/// A tile of `rows` query rows for the `dk`/`dv` kernel: where its rows of `q` and of `dO`
/// lie, its first position, and its first row among all query rows.
#[derive(CubeType, Clone, Copy)]
pub(super) struct QueryTile {
    pub(super) q: Rows,
    pub(super) dout: Rows,
    pub(super) p0: usize,
    pub(super) u0: usize,
}

/// Query tile `tile` (counted over the group's heads, `t.div_ceil(rows)` a head) of K/V head
/// `head` (`h`).
#[cube]
#[allow(clippy::too_many_arguments)]
pub(super) fn query_tile(
    h: &Head,
    head: usize,
    tile: usize,
    kv: u32,
    groups: u32,
    seq: u32,
    #[comptime] rows: usize,
    #[comptime] c: Tiling,
) -> QueryTile {
    let (g, t, hd) = (groups as usize, seq as usize, c.hd);
    let per_head = t.div_ceil(rows);
    let (gi, p0) = (tile / per_head, (tile % per_head) * rows);
    let valid = usize::min(rows, t - p0);
    let u0 = head * g * t + gi * t + p0;
    let orow = out_row(h, gi * t + p0, kv, groups, seq, hd);
    QueryTile {
        q: rows_at(u0 * hd, hd, valid),
        dout: rows_at(orow, (kv * groups) as usize * hd, valid),
        p0,
        u0,
    }
}

/// This unit's row's log-sum-exp and `D` of the query tile `at` (unit `i` row `i`; zero past
/// its real rows).
#[cube]
pub(super) fn row_stat(lse: &Tensor<f32>, delta: &Tensor<f32>, at: &QueryTile) -> (f32, f32) {
    let i = UNIT_POS as usize;
    let mut l = 0.0f32;
    let mut d = 0.0f32;
    if i < at.q.valid {
        l = lse[at.u0 + i];
        d = delta[at.u0 + i];
    }
    (l, d)
}

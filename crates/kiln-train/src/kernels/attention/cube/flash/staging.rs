//! What a cube loads and from where: its block of query rows ([`QueryBlock`]), the rows of a
//! tile in global memory ([`Rows`]), staged into shared memory as 16-byte vectors, a fixed
//! number per unit, unrolled and without branches, all in flight at once ([`fetch`], then
//! [`put`]), so that the next tile's loads overlap this tile's products; and the output rows
//! written back ([`unstage`]).

use super::tiles::{Tiling, UNROLL};
use crate::kernels::attention::cube::layout::Head;
use cubecl::prelude::*;

/// Where a tile's rows come from: `valid` real rows from element `base` of a tensor, `stride`
/// elements between rows.
#[derive(CubeType, Clone, Copy)]
pub(super) struct Rows {
    pub(super) base: usize,
    pub(super) stride: usize,
    pub(super) valid: usize,
}

#[cube]
pub(super) fn rows_at(base: usize, stride: usize, valid: usize) -> Rows {
    Rows {
        base,
        stride,
        valid,
    }
}

/// The vectors of one tile this unit stages: `rows` rows of `hd` elements as vectors of `n`,
/// handed out to the cube's units in turn.
pub(super) fn vectors_per_unit(c: Tiling, rows: usize, n: usize) -> usize {
    (rows * c.hd / n).div_ceil(c.units)
}

/// The `i`-th vector this unit stages of a `rows`-row tile: `(row, vector in the row, live)`,
/// not live past the tile's last vector (where the units do not divide them: then it names the
/// tile's first vector).
#[cube]
pub(super) fn vector_at(
    i: usize,
    #[comptime] rows: usize,
    #[comptime] n: usize,
    #[comptime] c: Tiling,
) -> (usize, usize, bool) {
    let per_row = comptime!(c.hd / n);
    let total = comptime!(rows * per_row);
    let idx = UNIT_POS as usize + i * c.units;
    let mut live = true;
    if comptime!(total % c.units != 0) {
        live = idx < total;
    }
    let at = select(live, idx, 0);
    (at / per_row, at % per_row, live)
}

/// Loads this unit's vectors of a `rows`-row tile from `src` into `regs`, all of them issued
/// before any is used (unrolled, without branches: rows past the real ones read the last real
/// row and hold zero), so that a tile costs one memory latency and the loads of the next tile
/// can be in flight while the cube computes on this one.
#[cube]
pub(super) fn fetch<F: Float, N: Size>(
    src: &Tensor<Vector<F, N>>,
    regs: &mut Array<Vector<F, N>>,
    at: &Rows,
    #[comptime] rows: usize,
    #[comptime] c: Tiling,
) {
    let n = src.vector_size();
    let last = at.valid - 1;
    let zero = Vector::<F, N>::new(F::from_int(0));
    let count = comptime!(vectors_per_unit(c, rows, n));
    #[unroll(count <= UNROLL)]
    for i in 0..count {
        let (r, j, _live) = vector_at(i, rows, n, c);
        let x = src[(at.base + usize::min(r, last) * at.stride) / n + j];
        regs[i] = select(r < at.valid, x, zero);
    }
}

/// Stores what [`fetch`] loaded into the tile `dst` `[rows, hdp]` (rows `ldh` apart), and
/// zeros in the columns past `hd`.
#[cube]
pub(super) fn put<F: Float, N: Size>(
    regs: &Array<Vector<F, N>>,
    dst: &mut Shared<[F]>,
    #[comptime] rows: usize,
    #[comptime] c: Tiling,
) {
    let n = regs.vector_size();
    let count = comptime!(vectors_per_unit(c, rows, n));
    #[unroll(count <= UNROLL)]
    for i in 0..count {
        let (r, j, live) = vector_at(i, rows, n, c);
        if live {
            let x = regs[i];
            #[unroll]
            for e in 0..n {
                dst[r * c.ldh + j * n + e] = x.extract(e);
            }
        }
    }
    if comptime!(c.hdp > c.hd) {
        let pad = comptime!(c.hdp - c.hd);
        let mut idx = UNIT_POS as usize;
        while idx < comptime!(rows * pad) {
            dst[(idx / pad) * c.ldh + c.hd + idx % pad] = F::from_int(0);
            idx += c.units;
        }
    }
}

/// Registers for one tile's vectors of a unit (see [`fetch`]).
#[cube]
pub(super) fn tile_registers<F: Float, N: Size>(
    like: &Tensor<Vector<F, N>>,
    #[comptime] rows: usize,
    #[comptime] c: Tiling,
) -> Array<Vector<F, N>> {
    let n = like.vector_size();
    Array::<Vector<F, N>>::new(comptime!(vectors_per_unit(c, rows, n)))
}

/// Stages `rows` rows of a head from `src` (as `at` says) into `dst`: [`fetch`], then [`put`].
#[cube]
pub(super) fn stage<F: Float, N: Size>(
    src: &Tensor<Vector<F, N>>,
    dst: &mut Shared<[F]>,
    at: &Rows,
    #[comptime] rows: usize,
    #[comptime] c: Tiling,
) {
    let mut regs = tile_registers::<F, N>(src, rows, c);
    fetch::<F, N>(src, &mut regs, at, rows, c);
    put::<F, N>(&regs, dst, rows, c);
}

/// Where keys (`true`) or values of K/V head `h` from key `k0` lie, `rows` of them (those
/// before `t` real).
#[cube]
pub(super) fn kv_rows(
    h: &Head,
    k0: usize,
    t: usize,
    #[comptime] keys: bool,
    #[comptime] rows: usize,
    #[comptime] c: Tiling,
) -> Rows {
    let valid = usize::min(rows, t - k0);
    if comptime!(keys) {
        rows_at(h.kb + k0 * c.hd, c.hd, valid)
    } else {
        rows_at(h.vb + k0 * h.vrow, h.vrow, valid)
    }
}

/// Sets `n` values of `dst` to `value`, the cube's units together.
#[cube]
pub(super) fn fill(
    dst: &mut Shared<[f32]>,
    value: f32,
    #[comptime] n: usize,
    #[comptime] c: Tiling,
) {
    let mut idx = UNIT_POS as usize;
    while idx < n {
        dst[idx] = value;
        idx += c.units;
    }
}

/// This cube's block of query rows: K/V head `bk` (of `[b, kv]`), a head of its group,
/// positions `[p0, p0 + valid)`, the block's first row among the K/V head's slice (`r0`) and
/// among all query rows (`u0`).
#[derive(CubeType)]
pub(super) struct QueryBlock {
    pub(super) bk: usize,
    pub(super) p0: usize,
    pub(super) valid: usize,
    pub(super) r0: usize,
    pub(super) u0: usize,
}

/// The block of query rows of this cube. Cubes are handed out longest first over all heads
/// (a block's work grows with its position): every head's last block, then every head's one
/// before, so that the long cubes start in the first wave and the short ones fill in behind
/// them, rather than the last head's long cubes starting at the end of the launch.
#[cube]
pub(super) fn query_block(groups: u32, seq: u32, #[comptime] rows: usize) -> QueryBlock {
    let (g, t) = (groups as usize, seq as usize);
    let blocks = t.div_ceil(rows);
    let heads = CUBE_COUNT / blocks;
    let id = CUBE_POS;
    let (rank, qh) = (id / heads, id % heads);
    let (bk, gi) = (qh / g, qh % g);
    let p0 = (blocks - 1 - rank) * rows;
    let r0 = gi * t + p0;
    QueryBlock {
        bk,
        p0,
        valid: usize::min(rows, t - p0),
        r0,
        u0: bk * g * t + r0,
    }
}

/// Writes `valid` rows of the f32 tile `src` (rows `ldo` apart, `hd` wide) into `dst` from
/// element `base`, `stride` elements between rows, a vector at a time.
#[cube]
#[allow(clippy::too_many_arguments)]
pub(super) fn unstage<F: Float, N: Size>(
    src: &Shared<[f32]>,
    dst: &mut Tensor<Vector<F, N>>,
    base: usize,
    stride: usize,
    valid: usize,
    #[comptime] c: Tiling,
) {
    let n = dst.vector_size();
    let per_row = comptime!(c.hd / n);
    let mut idx = UNIT_POS as usize;
    while idx < valid * per_row {
        let (r, j) = (idx / per_row, idx % per_row);
        let mut x = Vector::<F, N>::new(F::from_int(0));
        #[unroll]
        for e in 0..n {
            x.insert(e, F::cast_from(src[r * c.ldo + j * n + e]));
        }
        dst[(base + r * stride) / n + j] = x;
        idx += c.units;
    }
}

//! The `dq` kernel: a cube per block of query rows recomputes each probability from the
//! log-sum-exp, `dS = P (dP - D) scale`, `dq += dS k`; it also writes `D = dO . O` per row for
//! the `dk`/`dv` kernel.

use super::staging::{
    QueryBlock, fetch, fill, kv_rows, put, query_block, rows_at, tile_registers, unstage,
};
use super::tiles::{
    ALIGN, Tiling, UNROLL, accumulate, accumulators, against, back, store_fragments, tile_product,
};
use crate::kernels::attention::cube::layout::{head_of, out_row};
use cubecl::prelude::*;

/// `dq = scale * sum_k P (dP - D) k` for a block of query rows, and `D = dO . O` per row
/// (saved for the `dk`/`dv` kernel).
#[cube(launch)]
#[allow(clippy::too_many_arguments)]
pub(super) fn flash_dq_kernel<F: Float, N: Size>(
    q: &Tensor<Vector<F, N>>,
    k: &Tensor<Vector<F, N>>,
    v: &Tensor<Vector<F, N>>,
    out: &Tensor<Vector<F, N>>,
    dout: &Tensor<Vector<F, N>>,
    lse: &Tensor<f32>,
    delta: &mut Tensor<f32>,
    dq: &mut Tensor<Vector<F, N>>,
    kv: u32,
    groups: u32,
    seq: u32,
    scale: f32,
    #[comptime] c: Tiling,
    #[define(F)] _dtype: ElemType,
) {
    let (t, hd) = (seq as usize, c.hd);
    let (br, bc) = (c.rows, c.cols);
    let qb = query_block(groups, seq, br);
    let h = head_of(qb.bk, kv, seq, hd);
    let orow = out_row(&h, qb.r0, kv, groups, seq, hd);
    let ostride = (kv * groups) as usize * hd;
    let mut qs = Shared::<[F]>::new_aligned_slice(comptime!(br * c.ldh), ALIGN);
    let mut dos = Shared::<[F]>::new_aligned_slice(comptime!(br * c.ldh), ALIGN);
    let mut ks = Shared::<[F]>::new_aligned_slice(comptime!(bc * c.ldh), ALIGN);
    let mut vs = Shared::<[F]>::new_aligned_slice(comptime!(bc * c.ldh), ALIGN);
    let mut ss = Shared::<[f32]>::new_aligned_slice(comptime!(br * c.lds), ALIGN);
    let mut dps = Shared::<[f32]>::new_aligned_slice(comptime!(br * c.lds), ALIGN);
    let mut dss = Shared::<[F]>::new_aligned_slice(comptime!(br * c.ldp), ALIGN);
    let mut dqs = Shared::<[f32]>::new_aligned_slice(comptime!(br * c.ldo), ALIGN);
    let mut ls = Shared::<[f32]>::new_slice(br);
    let mut ds = Shared::<[f32]>::new_slice(br);
    let (mut kr, mut vr) = (
        tile_registers::<F, N>(k, bc, c),
        tile_registers::<F, N>(v, bc, c),
    );
    fetch::<F, N>(k, &mut kr, &kv_rows(&h, 0, t, true, bc, c), bc, c);
    fetch::<F, N>(v, &mut vr, &kv_rows(&h, 0, t, false, bc, c), bc, c);
    let (mut qr, mut dor) = (
        tile_registers::<F, N>(q, br, c),
        tile_registers::<F, N>(dout, br, c),
    );
    fetch::<F, N>(q, &mut qr, &rows_at(qb.u0 * hd, hd, qb.valid), br, c);
    fetch::<F, N>(dout, &mut dor, &rows_at(orow, ostride, qb.valid), br, c);
    put::<F, N>(&qr, &mut qs, br, c);
    put::<F, N>(&dor, &mut dos, br, c);
    if comptime!(!c.mma) {
        fill(&mut dqs, 0.0f32, comptime!(br * c.ldo), c);
    }
    let dsk = comptime!(back(c, br, bc));
    let mut dqacc = accumulators(dsk, c);
    row_deltas::<F, N>(
        dout, out, lse, delta, &mut ls, &mut ds, &qb, orow, ostride, c,
    );
    let tiles = (qb.p0 + qb.valid - 1) / bc + 1;
    for tile in 0..tiles {
        let k0 = tile * bc;
        put::<F, N>(&kr, &mut ks, bc, c);
        put::<F, N>(&vr, &mut vs, bc, c);
        sync_cube();
        if tile + 1 < tiles {
            fetch::<F, N>(k, &mut kr, &kv_rows(&h, k0 + bc, t, true, bc, c), bc, c);
            fetch::<F, N>(v, &mut vr, &kv_rows(&h, k0 + bc, t, false, bc, c), bc, c);
        }
        tile_product::<F>(&qs, &ks, &mut ss, comptime!(against(c, br, bc)), c);
        tile_product::<F>(&dos, &vs, &mut dps, comptime!(against(c, br, bc)), c);
        sync_cube();
        query_grads::<F>(&ss, &dps, &ls, &ds, &mut dss, &qb, k0, scale, c);
        sync_cube();
        accumulate::<F>(&dss, &ks, &mut dqacc, &mut dqs, dsk, c);
        sync_cube();
    }
    if comptime!(c.mma) {
        store_fragments(&mut dqacc, &mut dqs, dsk, c);
        sync_cube();
    }
    unstage::<F, N>(&dqs, dq, qb.u0 * hd, hd, qb.valid, c);
}

/// `a . b` over the `hd` elements of the row at element `at` of both, in f32, its vector
/// loads unrolled.
#[cube]
pub(super) fn dot_row<F: Float, N: Size>(
    a: &Tensor<Vector<F, N>>,
    b: &Tensor<Vector<F, N>>,
    at: usize,
    #[comptime] c: Tiling,
) -> f32 {
    let n = a.vector_size();
    let mut d = 0.0f32;
    let count = comptime!(c.hd / n);
    #[unroll(count <= UNROLL)]
    for j in 0..count {
        let (x, y) = (a[at / n + j], b[at / n + j]);
        #[unroll]
        for e in 0..n {
            d += f32::cast_from(x.extract(e)) * f32::cast_from(y.extract(e));
        }
    }
    d
}

/// `D = dO . O` of each real row of the query block `qb` (its `dO` and `O` rows from element
/// `orow`, `ostride` apart), written to `delta` and kept in `ds` with each row's log-sum-exp in
/// `ls` (zero past the real rows).
#[cube]
#[allow(clippy::too_many_arguments)]
pub(super) fn row_deltas<F: Float, N: Size>(
    dout: &Tensor<Vector<F, N>>,
    out: &Tensor<Vector<F, N>>,
    lse: &Tensor<f32>,
    delta: &mut Tensor<f32>,
    ls: &mut Shared<[f32]>,
    ds: &mut Shared<[f32]>,
    qb: &QueryBlock,
    orow: usize,
    ostride: usize,
    #[comptime] c: Tiling,
) {
    let mut row = UNIT_POS as usize;
    while row < c.rows {
        let mut d = 0.0f32;
        let mut l = 0.0f32;
        if row < qb.valid {
            d = dot_row::<F, N>(dout, out, orow + row * ostride, c);
            delta[qb.u0 + row] = d;
            l = lse[qb.u0 + row];
        }
        ds[row] = d;
        ls[row] = l;
        row += c.units;
    }
}

/// `dS = P (dP - D) scale` of the `dq` kernel's tile (query rows of `qb` against keys from
/// `k0`), `P` recomputed from the scores `ss` and the rows' log-sum-exp `ls`; zero where a key
/// is past the row's position.
#[cube]
#[allow(clippy::too_many_arguments)]
pub(super) fn query_grads<F: Float>(
    ss: &Shared<[f32]>,
    dps: &Shared<[f32]>,
    ls: &Shared<[f32]>,
    ds: &Shared<[f32]>,
    dss: &mut Shared<[F]>,
    qb: &QueryBlock,
    k0: usize,
    scale: f32,
    #[comptime] c: Tiling,
) {
    let (br, bc) = (c.rows, c.cols);
    let count = comptime!((br * bc).div_ceil(c.units));
    #[unroll(count <= UNROLL)]
    for i in 0..count {
        let idx = UNIT_POS as usize + i * c.units;
        if idx < comptime!(br * bc) {
            let (row, col) = (idx / bc, idx % bc);
            let mut g = 0.0f32;
            if row < qb.valid && k0 + col <= qb.p0 + row {
                let p = (ss[row * c.lds + col] * scale - ls[row]).exp();
                g = p * (dps[row * c.lds + col] - ds[row]) * scale;
            }
            dss[row * c.ldp + col] = F::cast_from(g);
        }
    }
}

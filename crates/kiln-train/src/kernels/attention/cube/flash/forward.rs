//! The forward kernel: a cube per block of query rows of one head, walking the key tiles up to
//! the block's last position with an online softmax; saves each row's log-sum-exp.

use super::softmax::{online_softmax, rescale, row_stats, scale_rows};
use super::staging::{
    fetch, fill, kv_rows, put, query_block, rows_at, stage, tile_registers, unstage,
};
use super::tiles::{
    ALIGN, Tiling, accumulate, accumulators, against, back, store_fragments, tile_product,
};
use crate::kernels::attention::cube::layout::{head_of, out_row};
use cubecl::prelude::*;

#[cube(launch)]
#[allow(clippy::too_many_arguments)]
pub(super) fn flash_forward_kernel<F: Float, N: Size>(
    q: &Tensor<Vector<F, N>>,
    k: &Tensor<Vector<F, N>>,
    v: &Tensor<Vector<F, N>>,
    out: &mut Tensor<Vector<F, N>>,
    lse: &mut Tensor<f32>,
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
    let mut qs = Shared::<[F]>::new_aligned_slice(comptime!(br * c.ldh), ALIGN);
    let mut ks = Shared::<[F]>::new_aligned_slice(comptime!(bc * c.ldh), ALIGN);
    let mut vs = Shared::<[F]>::new_aligned_slice(comptime!(bc * c.ldh), ALIGN);
    let mut ss = Shared::<[f32]>::new_aligned_slice(comptime!(br * c.lds), ALIGN);
    let mut ps = Shared::<[F]>::new_aligned_slice(comptime!(br * c.ldp), ALIGN);
    let mut os = Shared::<[f32]>::new_aligned_slice(comptime!(br * c.ldo), ALIGN);
    let mut st = row_stats(c);
    let (mut kr, mut vr) = (
        tile_registers::<F, N>(k, bc, c),
        tile_registers::<F, N>(v, bc, c),
    );
    fetch::<F, N>(k, &mut kr, &kv_rows(&h, 0, t, true, bc, c), bc, c);
    fetch::<F, N>(v, &mut vr, &kv_rows(&h, 0, t, false, bc, c), bc, c);
    stage::<F, N>(q, &mut qs, &rows_at(qb.u0 * hd, hd, qb.valid), br, c);
    // Unit by unit the output accumulates in `os`; on the tensor cores `os` is written from
    // the fragments before it is read.
    if comptime!(!c.mma) {
        fill(&mut os, 0.0f32, comptime!(br * c.ldo), c);
    }
    let pv = comptime!(back(c, br, bc));
    let mut oacc = accumulators(pv, c);
    let tiles = (qb.p0 + qb.valid - 1) / bc + 1;
    for tile in 0..tiles {
        let k0 = tile * bc;
        put::<F, N>(&kr, &mut ks, bc, c);
        put::<F, N>(&vr, &mut vs, bc, c);
        sync_cube();
        // The next tile's keys and values in flight while the cube works on this one.
        if tile + 1 < tiles {
            fetch::<F, N>(k, &mut kr, &kv_rows(&h, k0 + bc, t, true, bc, c), bc, c);
            fetch::<F, N>(v, &mut vr, &kv_rows(&h, k0 + bc, t, false, bc, c), bc, c);
        }
        tile_product::<F>(&qs, &ks, &mut ss, comptime!(against(c, br, bc)), c);
        sync_cube();
        online_softmax::<F>(&ss, &mut ps, &mut st, &qb, k0, scale, c);
        sync_cube();
        rescale(&mut oacc, &mut os, &st, pv, c);
        accumulate::<F>(&ps, &vs, &mut oacc, &mut os, pv, c);
        sync_cube();
    }
    // Each row's sum over its parts; the output rows divided by it, then written.
    if comptime!(c.mma) {
        store_fragments(&mut oacc, &mut os, pv, c);
    }
    let parts = comptime!(c.parts());
    let mut row = UNIT_POS as usize;
    while row < br {
        let mut l = 0.0f32;
        for p in 0..parts {
            l += st.ls[row * parts + p];
        }
        st.keeps[row] = 1.0f32 / l;
        if row < qb.valid {
            lse[qb.u0 + row] = st.ms[row * parts] + l.ln();
        }
        row += c.units;
    }
    sync_cube();
    scale_rows(&mut os, &st.keeps, c);
    sync_cube();
    let orow = out_row(&h, qb.r0, kv, groups, seq, hd);
    let ostride = (kv * groups) as usize * hd;
    unstage::<F, N>(&os, out, orow, ostride, qb.valid, c);
}

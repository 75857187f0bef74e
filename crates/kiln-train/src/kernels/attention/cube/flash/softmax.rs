//! The forward kernel's online softmax over a tile of scores: every unit of the cube takes part
//! (a row cut in parts), and a row's output is rescaled only when its max rises by more than
//! [`RESCALE_GAP`] (FlashAttention-4's conditional rescale), so most tiles skip the pass over
//! the accumulator.

use super::staging::{QueryBlock, fill};
use super::tiles::{Product, Tiling, UNROLL, load_fragments, store_fragments};
use cubecl::prelude::*;

/// How far (in the scaled scores' natural-log units) a row's running max may rise before
/// the row's output accumulator is rescaled. Below it the row keeps its old max, so a tile's
/// probabilities stay below e^8 (finite in bf16 and in the f32 sums, and the same function:
/// the sum is taken against the same max), and the usual tile, no row rescaled, skips the
/// pass over the accumulator (as FlashAttention-4 does).
pub(super) const RESCALE_GAP: f32 = 8.0;

/// The block's running max and sum over the tile's scores `ss` from key `k0` (keys past a
/// row's position masked), `P` into `ps`, and the output accumulator's rows rescaled where
/// their max rose by more than [`RESCALE_GAP`]. Each row is cut in `parts` (a unit each, all
/// the cube's units busy): a pass for the parts' maxes (`red`), then each part exponentiates
/// its columns against the row's max and keeps its own running max and sum (`ms`, `ls`,
/// `[rows, parts]`, every part of a row the same max); `keeps` and `flag` carry the rescale to
/// the accumulator pass. Each unit walks its columns from its own offset on (rotated by the
/// row), so that the units of a plane read different banks.
#[cube]
#[allow(clippy::too_many_arguments)]
pub(super) fn online_softmax<F: Float>(
    ss: &Shared<[f32]>,
    ps: &mut Shared<[F]>,
    st: &mut RowStats,
    qb: &QueryBlock,
    k0: usize,
    scale: f32,
    #[comptime] c: Tiling,
) {
    let parts = comptime!(c.parts());
    let span = comptime!(c.cols / parts);
    if UNIT_POS == 0 {
        st.flag[0] = 0.0f32;
    }
    let mut idx = UNIT_POS as usize;
    while idx < comptime!(c.rows * parts) {
        let (row, part) = (idx / parts, idx % parts);
        let live = row < qb.valid;
        let mut mx = f32::new(-3.0e38);
        #[unroll(span <= UNROLL)]
        for i in 0..span {
            let col = part * span + (i + row) % span;
            if live && k0 + col <= qb.p0 + row {
                mx = f32::max(mx, ss[row * c.lds + col] * scale);
            }
        }
        st.red[idx] = mx;
        idx += c.units;
    }
    sync_cube();
    let mut idx = UNIT_POS as usize;
    while idx < comptime!(c.rows * parts) {
        let (row, part) = (idx / parts, idx % parts);
        let live = row < qb.valid;
        let mut top = f32::new(-3.0e38);
        for p in 0..parts {
            top = f32::max(top, st.red[row * parts + p]);
        }
        let old = st.ms[idx];
        let mut mx = old;
        let mut keep = 1.0f32;
        if top > old + RESCALE_GAP {
            mx = top;
            keep = (old - top).exp();
        }
        let mut l = st.ls[idx] * keep;
        // Four columns a round, unrolled: their loads and exponentials overlap.
        let step = comptime!(if span.is_multiple_of(4) { 4 } else { 1 });
        for i0 in 0..comptime!(span / step) {
            #[unroll]
            for u in 0..step {
                let col = part * span + (i0 * step + u + row) % span;
                let mut e = 0.0f32;
                if live && k0 + col <= qb.p0 + row {
                    e = (ss[row * c.lds + col] * scale - mx).exp();
                }
                l += e;
                ps[row * c.ldp + col] = F::cast_from(e);
            }
        }
        st.ms[idx] = mx;
        st.ls[idx] = l;
        if part == 0 {
            st.keeps[row] = keep;
            // A row with no key yet has a zero accumulator: nothing to rescale.
            if keep < 1.0f32 && old > -1.0e38f32 {
                st.flag[0] = 1.0f32;
            }
        }
        idx += c.units;
    }
}

/// Rescales the rows of the output accumulator by `st.keeps` where [`online_softmax`] said
/// some row's max rose (`st.flag`, read by every unit after a sync: the branch is the
/// cube's). On the tensor cores the accumulator is the planes' fragments: through `os` and
/// back.
#[cube]
pub(super) fn rescale(
    frags: &mut Sequence<cmma::Matrix<f32>>,
    os: &mut Shared<[f32]>,
    st: &RowStats,
    #[comptime] p: Product,
    #[comptime] c: Tiling,
) {
    if st.flag[0] > 0.0f32 {
        if comptime!(c.mma) {
            store_fragments(frags, os, p, c);
            sync_cube();
        }
        scale_rows(os, &st.keeps, c);
        sync_cube();
        if comptime!(c.mma) {
            load_fragments(frags, os, p, c);
        }
    }
}

/// Multiplies row `r` of the `[rows, hdp]` f32 tile `os` by `by[r]`, the cube's units
/// together.
#[cube]
pub(super) fn scale_rows(os: &mut Shared<[f32]>, by: &Shared<[f32]>, #[comptime] c: Tiling) {
    let mut idx = UNIT_POS as usize;
    while idx < comptime!(c.rows * c.hdp) {
        let row = idx / c.hdp;
        os[row * c.ldo + idx % c.hdp] *= by[row];
        idx += c.units;
    }
}

/// The forward kernel's per-row state in shared memory: running max and sum per part of a
/// row (`[rows, parts]`), the parts' maxes of the current tile, each row's rescale factor,
/// and whether any row is rescaled this tile.
#[derive(CubeType)]
pub(super) struct RowStats {
    pub(super) ms: Shared<[f32]>,
    pub(super) ls: Shared<[f32]>,
    pub(super) red: Shared<[f32]>,
    pub(super) keeps: Shared<[f32]>,
    pub(super) flag: Shared<[f32]>,
}

#[cube]
pub(super) fn row_stats(#[comptime] c: Tiling) -> RowStats {
    let n = comptime!(c.rows * c.parts());
    let mut st = RowStats {
        ms: Shared::<[f32]>::new_slice(n),
        ls: Shared::<[f32]>::new_slice(n),
        red: Shared::<[f32]>::new_slice(n),
        keeps: Shared::<[f32]>::new_slice(c.rows),
        flag: Shared::<[f32]>::new_slice(1usize),
    };
    fill(&mut st.ms, -3.0e38f32, n, c);
    fill(&mut st.ls, 0.0f32, n, c);
    st
}

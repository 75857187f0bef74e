//! Where one K/V head's rows lie in attention's layouts (`q` `[b, kv, groups * t, hd]`, `k`
//! `[b, kv, t, hd]`, `v` `[b, t, kv * hd]`, output `[b, t, heads * hd]`), for the row kernels
//! (`attention`) and the flash kernels (`flash`).

use cubecl::prelude::*;

/// Where one K/V head's data lie: the start of its keys in `k`, of its values in `v` and the
/// stride between value rows, its batch row and its index among the K/V heads.
#[derive(CubeType)]
pub(super) struct Head {
    pub(super) kb: usize,
    pub(super) vb: usize,
    pub(super) vrow: usize,
    b: usize,
    kvi: usize,
}

/// K/V head `bk` (of `[b, kv]`).
#[cube]
pub(super) fn head_of(bk: usize, kv: u32, seq: u32, #[comptime] hd: usize) -> Head {
    let (nkv, t) = (kv as usize, seq as usize);
    let (kvi, b) = (bk % nkv, bk / nkv);
    let vrow = nkv * hd;
    Head {
        kb: bk * t * hd,
        vb: b * t * vrow + kvi * hd,
        vrow,
        b,
        kvi,
    }
}

/// The start of the output row (and `dO` row) of query row `r` of head `h`'s slice.
#[cube]
pub(super) fn out_row(
    h: &Head,
    r: usize,
    kv: u32,
    groups: u32,
    seq: u32,
    #[comptime] hd: usize,
) -> usize {
    let (g, t) = (groups as usize, seq as usize);
    let head = h.kvi * g + r / t;
    (h.b * t + r % t) * (kv as usize) * g * hd + head * hd
}

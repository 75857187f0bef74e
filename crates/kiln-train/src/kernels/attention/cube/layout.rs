//! Attention's layouts on a device: the sizes of device tensors, and where one K/V head's rows
//! lie (`q` `[b, kv, groups * t, hd]`, `k` `[b, kv, t, hd]`, `v` `[b, t, kv * hd]`, output
//! `[b, t, heads * hd]`) for the row kernels and the flash kernels.

use crate::kernels::attention::dims::Dims;
use crate::kernels::device::tensors::dims;
use burn_cubecl::tensor::CubeTensor;
use cubecl::prelude::*;

/// The sizes of causal attention of device tensors `q` and `k`.
pub(in crate::kernels) fn dims_of(q: &CubeTensor, k: &CubeTensor) -> Dims {
    Dims::from_shapes(&dims(q), &dims(k))
}

/// Where one K/V head's data lie: the start of its keys in `k`, of its values in `v` and the
/// stride between value rows, its batch row and its index among the K/V heads.
#[derive(CubeType)]
pub(in crate::kernels) struct Head {
    pub(in crate::kernels) kb: usize,
    pub(in crate::kernels) vb: usize,
    pub(in crate::kernels) vrow: usize,
    b: usize,
    kvi: usize,
}

/// K/V head `bk` (of `[b, kv]`).
#[cube]
pub(in crate::kernels) fn head_of(bk: usize, kv: u32, seq: u32, #[comptime] hd: usize) -> Head {
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
pub(in crate::kernels) fn out_row(
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

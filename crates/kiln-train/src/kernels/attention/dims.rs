//! The sizes of causal grouped-query attention and its layouts, one home for every path: the
//! CPU kernel, and on CubeCL devices the row kernels, the products and the flash kernels.
//!
//! `q` `[b, kv, groups * t, hd]` (the query heads that share a K/V head stacked along the
//! sequence, so row `r` of a K/V head's slice is head `kv * groups + r / t` at position
//! `r % t`), `k` `[b, kv, t, hd]`, `v` `[b, t, kv * hd]` (the projection's layout), output
//! `[b, t, heads * hd]`, one log-sum-exp per query row.

/// The sizes of causal attention, from `q` `[b, kv, groups * t, hd]` and `k` `[b, kv, t, hd]`.
#[derive(Debug, Clone, Copy)]
pub(in crate::kernels) struct Dims {
    pub(in crate::kernels) b: usize,
    pub(in crate::kernels) kv: usize,
    pub(in crate::kernels) groups: usize,
    pub(in crate::kernels) t: usize,
    pub(in crate::kernels) hd: usize,
}

impl Dims {
    /// From the shapes of `q` and `k` (a sequence of at least one).
    pub(in crate::kernels) fn from_shapes(q: &[usize], k: &[usize]) -> Self {
        let t = k.get(2).copied().unwrap_or(0).max(1);
        Self {
            b: q[0],
            kv: q[1],
            groups: q[2] / t,
            t,
            hd: q[3],
        }
    }

    /// Query heads.
    pub(in crate::kernels) fn heads(&self) -> usize {
        self.kv * self.groups
    }

    /// Query rows of every head: `b * kv * groups * t` (one log-sum-exp each).
    #[cfg_attr(not(feature = "cube"), allow(dead_code))]
    pub(in crate::kernels) fn rows(&self) -> usize {
        self.b * self.heads() * self.t
    }
}

//! Causal grouped-query attention as tiled flash kernels whose products run on the tensor
//! cores: the same function, saved state (output and log-sum-exp) and layouts as the row
//! kernels of `attention` and the chunked products of `attention_mm`, never holding more of
//! the scores than one tile per cube.
//!
//! Why: by products (`attention_mm`) attention wrote and read each chunk's f32 scores at
//! memory bandwidth, about 50 ms of a 151 ms step on an H200 against 8.6 ms for PyTorch's
//! flash attention; the row kernels computed every product a scalar at a time (2 TFLOP/s).
//! Here a cube stages a block of query rows and a tile of keys and values in shared memory,
//! multiplies them by 16 x 16 x 16 `cmma` fragments (bf16 or f16 in, f32 out), and keeps the
//! scores, probabilities and running sums of the tile in shared memory:
//!
//! - forward: a cube per block of query rows of one head, walking the key tiles up to the
//!   block's last position with an online softmax (running max and sum per row, the output
//!   accumulator rescaled by each new max); saves the row's log-sum-exp;
//! - `dq`: a cube per block of query rows: recomputes each probability from the log-sum-exp,
//!   `dS = P (dP - D) scale`, `dq += dS k`; it also writes `D = dO . O` per row;
//! - `dk`, `dv`: a cube per block of keys, walking the query rows of every head in its group
//!   from the block's first key on: `dv += P^T dO`, `dk += dS^T q`.
//!
//! No atomics: each output is summed by one cube in a fixed order. `P` and `dS` enter their
//! second products in the element type, as flash attention's do.
//!
//! The tile products ([`tile_product`]) run either on the tensor cores (`mma`, a plane per
//! 16 x 16 output fragment, the planes of a cube taking turns) or unit by unit, the same
//! product over the same shared-memory operands: CubeCL's CPU runtime has no matrix
//! instructions, so there (and in f32) the kernels run unit by unit, and the kernel tests
//! check everything but the fragment instructions against the composed attention; a test
//! compiles the `mma` path to PTX for sm_90 with CubeCL's own backend and assembles it with
//! ptxas, no GPU needed (tensor-core products, no spills); `kiln doctor` checks its values on a
//! GPU. Head dimensions that are not a multiple of 16 are padded with zeros in shared memory.
//!
//! Layouts (as `attention`'s): `q` `[b, kv, groups * t, hd]`, `k` `[b, kv, t, hd]`, `v`
//! `[b, t, kv * hd]`, output `[b, t, heads * hd]`, log-sum-exp and `D` per query row.

use super::heads::{Head, head_of, out_row};
use super::{Dims, attention_dims, dense, dims, elem, empty_like};
use burn_cubecl::tensor::CubeTensor;
use cubecl::features::MmaConfig;
use cubecl::ir::{ElemType, FloatKind};
use cubecl::prelude::*;
use std::sync::atomic::{AtomicUsize, Ordering};

/// The side of a tensor-core fragment (16 x 16 x 16).
const FRAG: usize = 16;
/// Bytes the tiles in shared memory are aligned to: fragment loads and stores take 32-byte
/// aligned addresses (fragment offsets in a tile are multiples of 16 elements).
const ALIGN: usize = 128;

/// How a kernel's cube cuts its work: `rows` rows of its own side (query rows, or keys for
/// `dk`/`dv`) against tiles of `cols` rows of the other side, `units` units (`plane` a
/// plane), the head dimension `hd` padded to `hdp`, tile products on the tensor cores when
/// `mma`. Rows of the tiles in shared memory lie `ldh` elements apart (`[rows, hd]` tiles of
/// the element type), `ldo` (their f32 accumulators), `lds` (f32 scores `[rows, cols]`) and
/// `ldp` (probabilities and score gradients in the element type): each padded past its width
/// by 16 bytes or more, so that the rows of a fragment do not all start in one bank of shared
/// memory.
#[derive(Copy, Clone, Debug, Hash, PartialEq, Eq)]
pub(super) struct Tiling {
    rows: usize,
    cols: usize,
    units: usize,
    plane: usize,
    hd: usize,
    hdp: usize,
    ldh: usize,
    ldo: usize,
    lds: usize,
    ldp: usize,
    mma: bool,
}

impl Tiling {
    fn new(rows: usize, cols: usize, units: usize, plane: usize, hd: usize, mma: bool) -> Self {
        let hdp = hd.next_multiple_of(FRAG);
        Tiling {
            rows,
            cols,
            units,
            plane,
            hd,
            hdp,
            ldh: hdp + 8,
            ldo: hdp + 4,
            lds: cols + 4,
            ldp: cols + 8,
            mma,
        }
    }

    /// Bytes of shared memory the kernel `kind` takes with elements of `size` bytes.
    fn shared_bytes(&self, kind: Kernel, size: usize) -> usize {
        let (r, c) = (self.rows, self.cols);
        let (f32s, elems) = match kind {
            Kernel::Forward => (
                r * (self.lds + self.ldo),
                (r + 2 * c) * self.ldh + r * self.ldp,
            ),
            Kernel::Dq => (
                r * (2 * self.lds + self.ldo),
                (2 * r + 2 * c) * self.ldh + r * self.ldp,
            ),
            Kernel::Dkv => (
                2 * r * (self.lds + self.ldo),
                (2 * r + 2 * c) * self.ldh + 2 * r * self.ldp,
            ),
        };
        f32s * 4 + elems * size + 8 * (r + c) + 16 * ALIGN
    }
}

/// The three kernels, for [`Tiling::shared_bytes`].
#[derive(Copy, Clone, Debug)]
enum Kernel {
    Forward,
    Dq,
    Dkv,
}

/// One product of a tile: `acc [m x n] (+)= a [m x k] . b [k x n]`, each operand a whole
/// shared-memory buffer: `a` row-major with leading dimension `lda` (column-major, i.e. the
/// transpose of a row-major buffer, when `a_cols`), `b` likewise, `acc` f32 row-major with
/// leading dimension `ldc`, zeroed first when `fresh`.
#[derive(Copy, Clone, Debug, Hash, PartialEq, Eq)]
struct Product {
    m: usize,
    n: usize,
    k: usize,
    lda: usize,
    a_cols: bool,
    ldb: usize,
    b_cols: bool,
    ldc: usize,
    fresh: bool,
}

/// `acc (+)= a . b` as `p` says, by the cube's units together (see the module's note).
#[cube]
fn tile_product<F: Float>(
    a: &Shared<[F]>,
    b: &Shared<[F]>,
    acc: &mut Shared<[f32]>,
    #[comptime] p: Product,
    #[comptime] c: Tiling,
) {
    if comptime!(c.mma) {
        fragment_product::<F>(a, b, acc, p, c);
    } else {
        let mut idx = UNIT_POS as usize;
        while idx < comptime!(p.m * p.n) {
            let (r, col) = (idx / p.n, idx % p.n);
            let mut s = 0.0f32;
            for kk in 0..p.k {
                let mut x = a[r * p.lda + kk];
                if comptime!(p.a_cols) {
                    x = a[kk * p.lda + r];
                }
                let mut y = b[kk * p.ldb + col];
                if comptime!(p.b_cols) {
                    y = b[col * p.ldb + kk];
                }
                s += f32::cast_from(x) * f32::cast_from(y);
            }
            if comptime!(!p.fresh) {
                s += acc[r * p.ldc + col];
            }
            acc[r * p.ldc + col] = s;
            idx += c.units;
        }
    }
}

/// [`tile_product`] on the tensor cores: plane `i` of the cube computes output fragments
/// `i`, `i + planes`, ..., each over `k / 16` fragment products.
#[cube]
fn fragment_product<F: Float>(
    a: &Shared<[F]>,
    b: &Shared<[F]>,
    acc: &mut Shared<[f32]>,
    #[comptime] p: Product,
    #[comptime] c: Tiling,
) {
    let planes = comptime!(c.units / c.plane);
    let (fm, fn_, fk) = comptime!((p.m / FRAG, p.n / FRAG, p.k / FRAG));
    let layout_a = comptime!(match p.a_cols {
        true => cmma::MatrixLayout::ColMajor,
        false => cmma::MatrixLayout::RowMajor,
    });
    let layout_b = comptime!(match p.b_cols {
        true => cmma::MatrixLayout::ColMajor,
        false => cmma::MatrixLayout::RowMajor,
    });
    // The extent one fragment spans in a buffer of leading dimension `ld`.
    let (span_a, span_b, span_c) = comptime!((
        (FRAG - 1) * p.lda + FRAG,
        (FRAG - 1) * p.ldb + FRAG,
        (FRAG - 1) * p.ldc + FRAG
    ));
    let mut f = UNIT_POS as usize / c.plane;
    while f < comptime!(fm * fn_) {
        let (i, j) = (f / fn_, f % fn_);
        let at_c = i * FRAG * p.ldc + j * FRAG;
        let mut out = cmma::Matrix::<f32>::from_value(
            cmma::MatrixIdent::Accumulator,
            FRAG,
            FRAG,
            FRAG,
            cmma::MatrixLayout::Undefined,
            0.0f32,
        );
        if comptime!(!p.fresh) {
            cmma::load_with_layout(
                &mut out,
                &acc[at_c..at_c + span_c],
                p.ldc as u32,
                cmma::MatrixLayout::RowMajor,
            );
        }
        for kk in 0..fk {
            let mut at_a = i * FRAG * p.lda + kk * FRAG;
            if comptime!(p.a_cols) {
                at_a = kk * FRAG * p.lda + i * FRAG;
            }
            let mut at_b = kk * FRAG * p.ldb + j * FRAG;
            if comptime!(p.b_cols) {
                at_b = j * FRAG * p.ldb + kk * FRAG;
            }
            let fa = cmma::Matrix::<F>::from_slice(
                cmma::MatrixIdent::A,
                FRAG,
                FRAG,
                FRAG,
                layout_a,
                &a[at_a..at_a + span_a],
                p.lda as u32,
            );
            let fb = cmma::Matrix::<F>::from_slice(
                cmma::MatrixIdent::B,
                FRAG,
                FRAG,
                FRAG,
                layout_b,
                &b[at_b..at_b + span_b],
                p.ldb as u32,
            );
            cmma::execute(&fa, &fb, &out, &out);
        }
        cmma::store(
            &mut acc[at_c..at_c + span_c],
            &out,
            p.ldc as u32,
            cmma::MatrixLayout::RowMajor,
        );
        f += planes;
    }
}

/// `a [rows x hd] . b^T` into `acc [rows x cols]` (f32, fresh): scores, or `dP`, of a tile.
fn against(c: Tiling, rows: usize, cols: usize) -> Product {
    Product {
        m: rows,
        n: cols,
        k: c.hdp,
        lda: c.ldh,
        a_cols: false,
        ldb: c.ldh,
        b_cols: true,
        ldc: c.lds,
        fresh: true,
    }
}

/// `acc [rows x hd] += a [rows x cols] . b [cols x hd]`: `a` probabilities or score
/// gradients (leading dimension `ldp`), `b` a staged tile.
fn back(c: Tiling, rows: usize, cols: usize) -> Product {
    Product {
        m: rows,
        n: c.hdp,
        k: cols,
        lda: c.ldp,
        a_cols: false,
        ldb: c.ldh,
        b_cols: false,
        ldc: c.ldo,
        fresh: false,
    }
}

/// Stages `rows` rows of a head (`valid` of them real, from `base` with `stride` between
/// rows, `hd` wide) into `dst` `[rows, hdp]` (rows `ldh` apart), zero past the real rows and
/// columns.
#[cube]
fn stage<F: Float>(
    src: &Tensor<F>,
    dst: &mut Shared<[F]>,
    base: usize,
    stride: usize,
    valid: usize,
    #[comptime] rows: usize,
    #[comptime] c: Tiling,
) {
    let mut idx = UNIT_POS as usize;
    while idx < comptime!(rows * c.hdp) {
        let (r, j) = (idx / c.hdp, idx % c.hdp);
        let mut x = F::from_int(0);
        if r < valid && j < c.hd {
            x = src[base + r * stride + j];
        }
        dst[r * c.ldh + j] = x;
        idx += c.units;
    }
}

/// Stages keys and values `[k0, k0 + rows)` of K/V head `h` (those before `t` real) into `ks`
/// and `vs`.
#[cube]
#[allow(clippy::too_many_arguments)]
fn stage_kv<F: Float>(
    k: &Tensor<F>,
    v: &Tensor<F>,
    ks: &mut Shared<[F]>,
    vs: &mut Shared<[F]>,
    h: &Head,
    k0: usize,
    t: usize,
    #[comptime] rows: usize,
    #[comptime] c: Tiling,
) {
    let keys = usize::min(rows, t - k0);
    stage::<F>(k, ks, h.kb + k0 * c.hd, c.hd, keys, rows, c);
    stage::<F>(v, vs, h.vb + k0 * h.vrow, h.vrow, keys, rows, c);
}

/// Sets `n` values of `dst` to `value`, the cube's units together.
#[cube]
fn fill(dst: &mut Shared<[f32]>, value: f32, #[comptime] n: usize, #[comptime] c: Tiling) {
    let mut idx = UNIT_POS as usize;
    while idx < n {
        dst[idx] = value;
        idx += c.units;
    }
}

/// This cube's block of query rows: a head of the group, positions `[p0, p0 + valid)`,
/// the block's first row among the K/V head's slice (`r0`) and among all query rows (`u0`).
#[derive(CubeType)]
struct QueryBlock {
    p0: usize,
    valid: usize,
    r0: usize,
    u0: usize,
}

#[cube]
fn query_block(groups: u32, seq: u32, #[comptime] rows: usize) -> QueryBlock {
    let t = seq as usize;
    let blocks = t.div_ceil(rows);
    // The last blocks of a head (the most keys to walk) first, so the longest cubes start
    // early and the short ones fill in behind them.
    let gi = CUBE_POS_X as usize / blocks;
    let p0 = (blocks - 1 - CUBE_POS_X as usize % blocks) * rows;
    let r0 = gi * t + p0;
    QueryBlock {
        p0,
        valid: usize::min(rows, t - p0),
        r0,
        u0: CUBE_POS_Y as usize * (groups as usize) * t + r0,
    }
}

/// One unit a row of the block: the new running max and sum over the tile's scores `ss` from
/// key `k0` (keys past the row's position masked), `P` into `ps`, and the output accumulator's
/// row rescaled by the change of max. Each unit walks its row from its own column on (the
/// columns rotated by the row), so that the units of a plane read different banks.
#[cube]
#[allow(clippy::too_many_arguments)]
fn online_softmax<F: Float>(
    ss: &Shared<[f32]>,
    ps: &mut Shared<[F]>,
    os: &mut Shared<[f32]>,
    ms: &mut Shared<[f32]>,
    ls: &mut Shared<[f32]>,
    qb: &QueryBlock,
    k0: usize,
    scale: f32,
    #[comptime] c: Tiling,
) {
    let (bc, hdp) = (c.cols, c.hdp);
    let mut row = UNIT_POS as usize;
    while row < c.rows {
        let pos = qb.p0 + row;
        let live = row < qb.valid;
        let mut mx = ms[row];
        for i in 0..bc {
            let col = (i + row) % bc;
            if live && k0 + col <= pos {
                mx = f32::max(mx, ss[row * c.lds + col] * scale);
            }
        }
        let keep = (ms[row] - mx).exp();
        let mut l = ls[row] * keep;
        for i in 0..bc {
            let col = (i + row) % bc;
            let mut e = 0.0f32;
            if live && k0 + col <= pos {
                e = (ss[row * c.lds + col] * scale - mx).exp();
            }
            l += e;
            ps[row * c.ldp + col] = F::cast_from(e);
        }
        if live {
            ms[row] = mx;
            ls[row] = l;
            for i in 0..hdp {
                let j = (i + row) % hdp;
                os[row * c.ldo + j] *= keep;
            }
        }
        row += c.units;
    }
}

#[cube(launch)]
#[allow(clippy::too_many_arguments)]
fn flash_forward_kernel<F: Float>(
    q: &Tensor<F>,
    k: &Tensor<F>,
    v: &Tensor<F>,
    out: &mut Tensor<F>,
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
    let h = head_of(CUBE_POS_Y as usize, kv, seq, hd);
    let qb = query_block(groups, seq, br);
    let mut qs = Shared::<[F]>::new_aligned_slice(comptime!(br * c.ldh), ALIGN);
    let mut ks = Shared::<[F]>::new_aligned_slice(comptime!(bc * c.ldh), ALIGN);
    let mut vs = Shared::<[F]>::new_aligned_slice(comptime!(bc * c.ldh), ALIGN);
    let mut ss = Shared::<[f32]>::new_aligned_slice(comptime!(br * c.lds), ALIGN);
    let mut ps = Shared::<[F]>::new_aligned_slice(comptime!(br * c.ldp), ALIGN);
    let mut os = Shared::<[f32]>::new_aligned_slice(comptime!(br * c.ldo), ALIGN);
    let mut ms = Shared::<[f32]>::new_slice(br);
    let mut ls = Shared::<[f32]>::new_slice(br);
    stage::<F>(q, &mut qs, qb.u0 * hd, hd, qb.valid, br, c);
    fill(&mut os, 0.0f32, comptime!(br * c.ldo), c);
    fill(&mut ms, -3.0e38f32, br, c);
    fill(&mut ls, 0.0f32, br, c);
    let tiles = (qb.p0 + qb.valid - 1) / bc + 1;
    for tile in 0..tiles {
        let k0 = tile * bc;
        stage_kv::<F>(k, v, &mut ks, &mut vs, &h, k0, t, bc, c);
        sync_cube();
        tile_product::<F>(&qs, &ks, &mut ss, comptime!(against(c, br, bc)), c);
        sync_cube();
        online_softmax::<F>(&ss, &mut ps, &mut os, &mut ms, &mut ls, &qb, k0, scale, c);
        sync_cube();
        tile_product::<F>(&ps, &vs, &mut os, comptime!(back(c, br, bc)), c);
        sync_cube();
    }
    let mut idx = UNIT_POS as usize;
    while idx < qb.valid * hd {
        let (row, j) = (idx / hd, idx % hd);
        let at = out_row(&h, qb.r0 + row, kv, groups, seq, hd);
        out[at + j] = F::cast_from(os[row * c.ldo + j] / ls[row]);
        idx += c.units;
    }
    let mut row = UNIT_POS as usize;
    while row < qb.valid {
        lse[qb.u0 + row] = ms[row] + ls[row].ln();
        row += c.units;
    }
}

/// `dq = scale * sum_k P (dP - D) k` for a block of query rows, and `D = dO . O` per row
/// (saved for the `dk`/`dv` kernel).
#[cube(launch)]
#[allow(clippy::too_many_arguments)]
fn flash_dq_kernel<F: Float>(
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
    #[comptime] c: Tiling,
    #[define(F)] _dtype: ElemType,
) {
    let (t, hd) = (seq as usize, c.hd);
    let (br, bc) = (c.rows, c.cols);
    let h = head_of(CUBE_POS_Y as usize, kv, seq, hd);
    let qb = query_block(groups, seq, br);
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
    stage::<F>(q, &mut qs, qb.u0 * hd, hd, qb.valid, br, c);
    stage::<F>(dout, &mut dos, orow, ostride, qb.valid, br, c);
    fill(&mut dqs, 0.0f32, comptime!(br * c.ldo), c);
    let mut row = UNIT_POS as usize;
    while row < br {
        let mut d = 0.0f32;
        let mut l = 0.0f32;
        if row < qb.valid {
            let at = orow + row * ostride;
            for j in 0..hd {
                d += f32::cast_from(dout[at + j]) * f32::cast_from(out[at + j]);
            }
            delta[qb.u0 + row] = d;
            l = lse[qb.u0 + row];
        }
        ds[row] = d;
        ls[row] = l;
        row += c.units;
    }
    let tiles = (qb.p0 + qb.valid - 1) / bc + 1;
    for tile in 0..tiles {
        let k0 = tile * bc;
        stage_kv::<F>(k, v, &mut ks, &mut vs, &h, k0, t, bc, c);
        sync_cube();
        tile_product::<F>(&qs, &ks, &mut ss, comptime!(against(c, br, bc)), c);
        tile_product::<F>(&dos, &vs, &mut dps, comptime!(against(c, br, bc)), c);
        sync_cube();
        let mut idx = UNIT_POS as usize;
        while idx < comptime!(br * bc) {
            let (row, col) = (idx / bc, idx % bc);
            let mut g = 0.0f32;
            if row < qb.valid && k0 + col <= qb.p0 + row {
                let p = (ss[row * c.lds + col] * scale - ls[row]).exp();
                g = p * (dps[row * c.lds + col] - ds[row]) * scale;
            }
            dss[row * c.ldp + col] = F::cast_from(g);
            idx += c.units;
        }
        sync_cube();
        tile_product::<F>(&dss, &ks, &mut dqs, comptime!(back(c, br, bc)), c);
        sync_cube();
    }
    let mut idx = UNIT_POS as usize;
    while idx < qb.valid * hd {
        let (row, j) = (idx / hd, idx % hd);
        dq[(qb.u0 + row) * hd + j] = F::cast_from(dqs[row * c.ldo + j]);
        idx += c.units;
    }
}

/// `dv = sum_r P^T dO` and `dk = scale * sum_r (P (dP - D))^T q` for a block of keys, over
/// the query rows of every head in the group at or after the block's first key.
#[cube(launch)]
#[allow(clippy::too_many_arguments)]
fn flash_dkv_kernel<F: Float>(
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
    #[comptime] c: Tiling,
    #[define(F)] _dtype: ElemType,
) {
    let (g, t, hd) = (groups as usize, seq as usize, c.hd);
    let (bk, bq) = (c.rows, c.cols);
    let head = CUBE_POS_Y as usize;
    let h = head_of(head, kv, seq, hd);
    let key0 = CUBE_POS_X as usize * bk;
    let keys = usize::min(bk, t - key0);
    let ostride = (kv * groups) as usize * hd;
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
    stage_kv::<F>(k, v, &mut ks, &mut vs, &h, key0, t, bk, c);
    fill(&mut dks, 0.0f32, comptime!(bk * c.ldo), c);
    fill(&mut dvs, 0.0f32, comptime!(bk * c.ldo), c);
    for gi in 0..g {
        for tile in key0 / bq..t.div_ceil(bq) {
            let p0 = tile * bq;
            let valid = usize::min(bq, t - p0);
            let u0 = head * g * t + gi * t + p0;
            stage::<F>(q, &mut qs, u0 * hd, hd, valid, bq, c);
            let orow = out_row(&h, gi * t + p0, kv, groups, seq, hd);
            stage::<F>(dout, &mut dos, orow, ostride, valid, bq, c);
            let mut i = UNIT_POS as usize;
            while i < bq {
                let mut l = 0.0f32;
                let mut d = 0.0f32;
                if i < valid {
                    l = lse[u0 + i];
                    d = delta[u0 + i];
                }
                ls[i] = l;
                ds[i] = d;
                i += c.units;
            }
            sync_cube();
            tile_product::<F>(&ks, &qs, &mut sts, comptime!(against(c, bk, bq)), c);
            tile_product::<F>(&vs, &dos, &mut dpts, comptime!(against(c, bk, bq)), c);
            sync_cube();
            let mut idx = UNIT_POS as usize;
            while idx < comptime!(bk * bq) {
                let (kr, col) = (idx / bq, idx % bq);
                let mut p = 0.0f32;
                let mut gr = 0.0f32;
                if kr < keys && col < valid && key0 + kr <= p0 + col {
                    p = (sts[kr * c.lds + col] * scale - ls[col]).exp();
                    gr = p * (dpts[kr * c.lds + col] - ds[col]) * scale;
                }
                pts[kr * c.ldp + col] = F::cast_from(p);
                dsts[kr * c.ldp + col] = F::cast_from(gr);
                idx += c.units;
            }
            sync_cube();
            tile_product::<F>(&pts, &dos, &mut dvs, comptime!(back(c, bk, bq)), c);
            tile_product::<F>(&dsts, &qs, &mut dks, comptime!(back(c, bk, bq)), c);
            sync_cube();
        }
    }
    let mut idx = UNIT_POS as usize;
    while idx < keys * hd {
        let (kr, j) = (idx / hd, idx % hd);
        dk[h.kb + (key0 + kr) * hd + j] = F::cast_from(dks[kr * c.ldo + j]);
        dv[h.vb + (key0 + kr) * h.vrow + j] = F::cast_from(dvs[kr * c.ldo + j]);
        idx += c.units;
    }
}

/// The tiling set by [`set_cpu`] for CubeCL's CPU runtime: rows 0 is off (the row kernels
/// there).
static CPU_ROWS: AtomicUsize = AtomicUsize::new(0);
static CPU_COLS: AtomicUsize = AtomicUsize::new(0);
static CPU_UNITS: AtomicUsize = AtomicUsize::new(1);

/// Takes the flash kernels on CubeCL's CPU runtime too (0 `rows`: off, the default): cubes of
/// `rows` query rows against tiles of `cols` keys (forward and `dq`), of `cols` keys against
/// tiles of `rows` query rows (`dk`/`dv`), `units` units a cube; sizes rounded up to 16. For
/// tests of these kernels' unit-by-unit path.
pub(in crate::kernels) fn set_cpu(rows: usize, cols: usize, units: usize) {
    CPU_ROWS.store(rows.next_multiple_of(FRAG), Ordering::Relaxed);
    CPU_COLS.store(cols.max(1).next_multiple_of(FRAG), Ordering::Relaxed);
    CPU_UNITS.store(units.max(1), Ordering::Relaxed);
}

/// Set by [`set_gpu`]: these kernels on GPUs whatever `KILN_ATTENTION` says.
static ON_GPU: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// Takes these kernels on GPUs (where they can run) whatever `KILN_ATTENTION` says, or not:
/// for `kiln doctor`'s check of their tensor-core path.
pub(in crate::kernels) fn set_gpu(on: bool) {
    ON_GPU.store(on, Ordering::Relaxed);
}

/// Whether these kernels are asked for on GPUs: by [`set_gpu`], or by `KILN_ATTENTION=flash`
/// (read once; the default is attention by products until the kernels' speed is measured).
fn asked_on_gpu() -> bool {
    static ASKED: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    ON_GPU.load(Ordering::Relaxed)
        || *ASKED.get_or_init(|| std::env::var("KILN_ATTENTION").is_ok_and(|v| v == "flash"))
}

/// The fragment product the kernels use: 16 x 16 x 16, `e` operands, f32 accumulator.
fn fragment_config(e: ElemType) -> MmaConfig {
    MmaConfig {
        a_type: e,
        b_type: e,
        cd_type: ElemType::Float(FloatKind::F32),
        m: FRAG as u32,
        n: FRAG as u32,
        k: FRAG as u32,
    }
}

/// Whether the device of `q` multiplies 16 x 16 x 16 fragments of its element type into f32.
fn has_fragments(q: &CubeTensor) -> bool {
    let e = elem(q);
    let half = matches!(e, ElemType::Float(FloatKind::BF16 | FloatKind::F16));
    half && q
        .client
        .properties()
        .features
        .matmul
        .cmma
        .contains(&fragment_config(e))
}

/// The tilings of the forward, `dq` and `dk`/`dv` kernels for `q` and `d`, or `None` where
/// these kernels do not run: on CubeCL's CPU runtime unless [`set_cpu`] says so; on GPUs
/// only when asked, with fragments of the element type, one plane of 32 units, and the
/// shared memory each kernel needs.
pub(super) fn tilings(q: &CubeTensor, d: &Dims) -> Option<[Tiling; 3]> {
    if matches!(q.device, cubecl::Device::Cpu(_)) {
        let (rows, cols) = (
            CPU_ROWS.load(Ordering::Relaxed),
            CPU_COLS.load(Ordering::Relaxed),
        );
        let units = CPU_UNITS.load(Ordering::Relaxed);
        let c = Tiling::new(rows, cols, units, 1, d.hd, false);
        let dkv = Tiling::new(cols, rows, units, 1, d.hd, false);
        return (rows > 0).then_some([c, c, dkv]);
    }
    let hw = &q.client.properties().hardware;
    if !asked_on_gpu() || !has_fragments(q) || hw.plane_size_max != 32 || hw.plane_size_min != 32 {
        return None;
    }
    let tiles = gpu_tilings(d.hd);
    let size = q.dtype.size();
    let kinds = [Kernel::Forward, Kernel::Dq, Kernel::Dkv];
    let fits = tiles
        .iter()
        .zip(kinds)
        .all(|(t, kind)| t.shared_bytes(kind, size) <= hw.max_shared_memory_size);
    fits.then_some(tiles)
}

/// The GPU tilings of the three kernels at head dimension `hd` ([`gpu_shapes`], planes of 32).
fn gpu_tilings(hd: usize) -> [Tiling; 3] {
    gpu_shapes().map(|(rows, cols, planes)| Tiling::new(rows, cols, planes * 32, 32, hd, true))
}

/// The GPU tilings, `(rows, cols, planes)` for the forward, `dq` and `dk`/`dv` kernels: by
/// default four planes a cube, 64 query rows against 64 keys forward, 64 rows against 32 keys
/// for `dq` and 32 keys against 32 rows for `dk`/`dv` (their shared memory holds more tiles).
/// `KILN_FLASH_TILING=RxCxP,RxCxP,RxCxP` sets them (read once), for tuning on a GPU without a
/// rebuild; a value that does not parse, or sizes that are not multiples of 16 up to 256 with 1
/// to 16 planes, is said once and the default kept.
fn gpu_shapes() -> [(usize, usize, usize); 3] {
    const DEFAULT: [(usize, usize, usize); 3] = [(64, 64, 4), (64, 32, 4), (32, 32, 4)];
    static SHAPES: std::sync::OnceLock<[(usize, usize, usize); 3]> = std::sync::OnceLock::new();
    *SHAPES.get_or_init(|| {
        let Ok(text) = std::env::var("KILN_FLASH_TILING") else {
            return DEFAULT;
        };
        match crate::kernels::parse_flash_tiling(&text) {
            Ok(shapes) => shapes,
            Err(why) => {
                tracing::warn!("KILN_FLASH_TILING={text:?}: {why}; keeping {DEFAULT:?}");
                DEFAULT
            }
        }
    })
}

/// `(cube count, cube dim)` for `per_head_blocks` cubes for every K/V head.
fn launch(d: &Dims, per_head_blocks: usize, c: &Tiling) -> (CubeCount, CubeDim) {
    (
        CubeCount::Static(per_head_blocks.max(1) as u32, (d.b * d.kv) as u32, 1),
        CubeDim::new_1d(c.units as u32),
    )
}

/// `(output, log-sum-exp per query row)`, as `attention::forward`.
pub(super) fn forward(
    q: CubeTensor,
    k: CubeTensor,
    v: CubeTensor,
    scale: f64,
    c: Tiling,
) -> (CubeTensor, CubeTensor) {
    let (q, k, v) = (dense(q), dense(k), dense(v));
    let d = attention_dims(&q, &k);
    let out = empty_like(&q, [d.b, d.t, d.kv * d.groups * d.hd]);
    let lse = super::f32_vector(&q, d.rows());
    let (count, dim) = launch(&d, d.groups * d.t.div_ceil(c.rows), &c);
    flash_forward_kernel::launch(
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
        c,
        elem(&q),
    );
    (out, lse)
}

/// `(dq, dk, dv)` for the upstream gradient `dout`, as `attention`'s backward, with the
/// `dq` kernel's and the `dk`/`dv` kernel's tilings.
pub(super) fn backward(
    dout: CubeTensor,
    (q, k, v, out, lse): (CubeTensor, CubeTensor, CubeTensor, CubeTensor, CubeTensor),
    scale: f64,
    cq: Tiling,
    ckv: Tiling,
) -> (CubeTensor, CubeTensor, CubeTensor) {
    let (dout, out) = (dense(dout), dense(out));
    let d = attention_dims(&q, &k);
    let (dq, dk, dv) = (
        empty_like(&q, dims(&q)),
        empty_like(&k, dims(&k)),
        empty_like(&v, dims(&v)),
    );
    let delta = super::f32_vector(&q, d.rows());
    let (count, dim) = launch(&d, d.groups * d.t.div_ceil(cq.rows), &cq);
    flash_dq_kernel::launch(
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
        cq,
        elem(&q),
    );
    let (count, dim) = launch(&d, d.t.div_ceil(ckv.rows), &ckv);
    flash_dkv_kernel::launch(
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
        ckv,
        elem(&q),
    );
    (dq, dk, dv)
}

/// The PTX of the forward, `dq` and `dk`/`dv` kernels for `sm_{arch}` at head dimension `hd`
/// in `dtype` (bf16 or f16), compiled here without a device by the backend CubeCL's CUDA
/// runtime compiles them with (LLVM's NVPTX), in the tilings a GPU gets: for a test that the
/// tile products lower to tensor-core instructions and the kernels compile at all, on a
/// machine with no GPU, and for reading.
#[cfg(feature = "cuda")]
pub(in crate::kernels) fn ptx(
    hd: usize,
    dtype: ElemType,
    arch: u32,
) -> Result<[String; 3], String> {
    use cubecl::Compiler;
    use cubecl::ir::{
        AddressType, DeviceIdentity, DeviceProperties, HardwareProperties, MemoryDeviceProperties,
        features::Features, nvidia::SmArch,
    };
    use cubecl::prelude::{CubeDim, ExecutionMode, KernelSettings, TargetProperties};
    use cubecl_llvm::nvptx::ptx_version::PtxVersion;
    use cubecl_llvm::{LlvmTarget, PlironArtifact, PlironCompiler, PlironOptions};
    use cubecl_runtime::kernel::CubeKernel;
    use std::sync::Arc;

    let hardware = HardwareProperties {
        load_width: 128,
        vector_register_count: None,
        plane_size_min: 32,
        plane_size_max: 32,
        max_bindings: 32,
        max_shared_memory_size: 232_448,
        max_cube_count: (u32::MAX, u16::MAX as u32, u16::MAX as u32),
        max_units_per_cube: 1024,
        max_cube_dim: (1024, 1024, 64),
        num_streaming_multiprocessors: None,
        num_tensor_cores: None,
        min_tensor_cores_dim: None,
        num_cpu_cores: None,
        last_level_cache_size: None,
        max_vector_size: cubecl::ir::VectorSize::MAX,
        cube_mma_reserved_shared_memory: 0,
    };
    let mut props = DeviceProperties::new(
        Features::default(),
        MemoryDeviceProperties::new(u64::MAX, 256),
        hardware,
        cubecl::profile::TimingMethod::Device,
        DeviceIdentity {
            name: "offline".to_string(),
            fingerprint: "offline".to_string(),
            physical: None,
        },
    );
    props.features.matmul.cmma.insert(fragment_config(dtype));
    let (props, target) = (Arc::new(props), Arc::new(TargetProperties::default()));
    let tiles = gpu_tilings(hd);
    let settings = |c: &Tiling| {
        KernelSettings::new(
            *CubeDim::new_1d(c.units as u32),
            ExecutionMode::Checked,
            AddressType::U32,
        )
    };
    let tensor = || cubecl::prelude::TensorCompilationArg {
        meta: cubecl::prelude::TensorMetaCompilationArg { len: (), rank: () },
        buffer: cubecl::prelude::BufferCompilationArg { inplace: None },
    };
    let compile = |kernel: &dyn CubeKernel| -> Result<String, String> {
        let mut compiler = PlironCompiler {
            target: LlvmTarget::Nvptx,
        };
        let options = PlironOptions {
            sm_arch: Some(SmArch::new(arch, false)),
            // PTX 8.7 (CUDA 12.8's), which the pinned ptxas (scripts/install-cuda-tools.sh)
            // reads; the runtime emits its driver's version, with the same instructions.
            ptx_version: PtxVersion::for_driver(12080),
            ..Default::default()
        };
        match compiler.compile(kernel.define(), &options) {
            Ok(PlironArtifact::NvptxCode(module)) => {
                // SAFETY: the module's PTX is NUL-terminated.
                let ptx = unsafe { std::ffi::CStr::from_ptr(module.ptx.as_ptr()) };
                Ok(ptx.to_string_lossy().into_owned())
            }
            Ok(_) => Err("the NVPTX target produced no PTX".into()),
            Err(e) => Err(format!("{e:?}")),
        }
    };
    let [cf, cq, ckv] = tiles;
    let forward = flash_forward_kernel::FlashForwardKernel::new(
        settings(&cf),
        props.clone(),
        target.clone(),
        tensor(),
        tensor(),
        tensor(),
        tensor(),
        tensor(),
        (),
        (),
        (),
        (),
        cf,
        dtype,
    );
    let dq = flash_dq_kernel::FlashDqKernel::new(
        settings(&cq),
        props.clone(),
        target.clone(),
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
        cq,
        dtype,
    );
    let dkv = flash_dkv_kernel::FlashDkvKernel::new(
        settings(&ckv),
        props,
        target,
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
        ckv,
        dtype,
    );
    Ok([compile(&forward)?, compile(&dq)?, compile(&dkv)?])
}

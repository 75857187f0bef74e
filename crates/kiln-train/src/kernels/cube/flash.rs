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
//!   block's last position with an online softmax (running max and sum per row); saves the
//!   row's log-sum-exp;
//! - `dq`: a cube per block of query rows: recomputes each probability from the log-sum-exp,
//!   `dS = P (dP - D) scale`, `dq += dS k`; it also writes `D = dO . O` per row;
//! - `dk`, `dv`: a cube per block of keys, walking the query rows of every head in its group
//!   from the block's first key on: `dv += P^T dO`, `dk += dS^T q`.
//!
//! No atomics: each output is summed by one cube in a fixed order. `P` and `dS` enter their
//! second products in the element type, as flash attention's do.
//!
//! Where the time goes, and what is done about it (read off the SASS, `cuobjdump` on the
//! cubin ptxas makes of the PTX test's kernels; no GPU here has timed them):
//!
//! - Staging: each tile is read as 16-byte vectors (`fetch`), a fixed number per unit,
//!   unrolled and without branches, all in flight at once, and the next tile's keys and
//!   values (`dk`/`dv`: query rows, `dO`, log-sum-exp and `D`) are loaded while the cube
//!   computes on this one; `put` stores them into shared memory. The first version loaded and
//!   stored one 2-byte element at a time, about 32 memory latencies a tile.
//! - Products: each plane owns a grid of output fragments ([`Split`]), so a step along `k`
//!   loads each operand fragment once for all the products that take it; the accumulating
//!   products (the forward's output, `dq`, `dk`, `dv`) keep their fragments in registers
//!   across the cube's whole loop, not through shared memory every tile.
//! - Softmax: every unit of the cube takes part (a row cut in parts), and a row's output is
//!   rescaled only when its max rises by more than [`RESCALE_GAP`] (FlashAttention-4's
//!   conditional rescale): most tiles skip the pass over the accumulator.
//!
//! The tile products run either on the tensor cores (`mma`) or unit by unit, the same
//! product over the same shared-memory operands: CubeCL's CPU runtime has no matrix
//! instructions, so there (and in f32) the kernels run unit by unit, and the kernel tests
//! check everything but the fragment instructions against the composed attention (the planes'
//! split of the fragments is checked on the host); a test compiles the `mma` path to PTX for
//! sm_90 with CubeCL's own backend and assembles it with ptxas, no GPU needed (tensor-core
//! products, no spills); `kiln doctor` checks its values on a GPU. Head dimensions that are
//! not a multiple of 16 are padded with zeros in shared memory.
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

/// The most iterations of a per-unit loop that are unrolled (GPUs' tilings: their loads all
/// issued at once, their indices constant); CubeCL's CPU runtime's few units a cube would
/// unroll hundreds.
const UNROLL: usize = 32;
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

    /// Units a row of the forward kernel's softmax takes ([`online_softmax`]): all of the
    /// cube's where they divide the rows and the parts divide the tile's columns.
    fn parts(&self) -> usize {
        let p = (self.units / self.rows).max(1);
        if self.cols.is_multiple_of(p) { p } else { 1 }
    }

    /// Bytes of shared memory the kernel `kind` takes with elements of `size` bytes.
    fn shared_bytes(&self, kind: Kernel, size: usize) -> usize {
        let (r, c) = (self.rows, self.cols);
        let (f32s, elems) = match kind {
            Kernel::Forward => (
                r * (self.lds + self.ldo + 3 * self.parts() + 1) + 1,
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

/// `acc (+)= a . b` as `p` says, by the cube's units together (see the module's note), the
/// accumulator in shared memory.
#[cube]
fn tile_product<F: Float>(
    a: &Shared<[F]>,
    b: &Shared<[F]>,
    acc: &mut Shared<[f32]>,
    #[comptime] p: Product,
    #[comptime] c: Tiling,
) {
    if comptime!(c.mma) {
        let mut frags = accumulators(p, c);
        if comptime!(!p.fresh) {
            load_fragments(&mut frags, acc, p, c);
        }
        fragment_product::<F>(a, b, &mut frags, p, c);
        store_fragments(&mut frags, acc, p, c);
    } else {
        unit_product::<F>(a, b, acc, p, c);
    }
}

/// `acc += a . b` into accumulators that stay with the cube across its loop: on the tensor
/// cores this plane's output fragments `frags` (registers: no trip through shared memory per
/// tile), unit by unit the shared tile `acc`.
#[cube]
fn accumulate<F: Float>(
    a: &Shared<[F]>,
    b: &Shared<[F]>,
    frags: &mut Sequence<cmma::Matrix<f32>>,
    acc: &mut Shared<[f32]>,
    #[comptime] p: Product,
    #[comptime] c: Tiling,
) {
    if comptime!(c.mma) {
        fragment_product::<F>(a, b, frags, p, c);
    } else {
        unit_product::<F>(a, b, acc, p, c);
    }
}

/// [`tile_product`] unit by unit: each unit an output element at a time.
#[cube]
fn unit_product<F: Float>(
    a: &Shared<[F]>,
    b: &Shared<[F]>,
    acc: &mut Shared<[f32]>,
    #[comptime] p: Product,
    #[comptime] c: Tiling,
) {
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

/// How the planes of a cube share the `fm x fn` output fragments of a product. In a grid
/// (`grid`), each plane owns `rows x cols` of them: every fragment row and the columns
/// `plane, plane + planes, ...` (`by_cols`), or the rows `plane, plane + planes, ...` and
/// every column; so that a plane loads `rows + cols` operand fragments a step along `k` for
/// `rows * cols` products, against two a product. Where the planes divide neither side,
/// plane `i` takes fragments `i, i + planes, ...` (`count` slots, the last maybe empty).
#[derive(Copy, Clone, Debug, Hash, PartialEq, Eq)]
struct Split {
    grid: bool,
    by_cols: bool,
    rows: usize,
    cols: usize,
    count: usize,
}

impl Split {
    fn of(p: Product, c: Tiling) -> Self {
        let planes = c.units / c.plane;
        let (fm, fn_) = (p.m / FRAG, p.n / FRAG);
        let (cols_split, rows_split) = (fn_.is_multiple_of(planes), fm.is_multiple_of(planes));
        let by_cols = cols_split && (!rows_split || fm + fn_ / planes <= fm / planes + fn_);
        let (rows, cols) = match (by_cols, rows_split) {
            (true, _) => (fm, fn_ / planes),
            (false, true) => (fm / planes, fn_),
            (false, false) => (0, 0),
        };
        Split {
            grid: by_cols || rows_split,
            by_cols,
            rows,
            cols,
            count: (fm * fn_).div_ceil(planes),
        }
    }
}

/// Fragment slot `q` of this plane in a product split as `s`: `(fragment row, fragment column,
/// whether the slot holds a fragment)`.
#[cube]
fn slot(
    q: usize,
    #[comptime] s: Split,
    #[comptime] p: Product,
    #[comptime] c: Tiling,
) -> (usize, usize, bool) {
    let planes = comptime!(c.units / c.plane);
    let plane = UNIT_POS as usize / c.plane;
    let fn_ = comptime!(p.n / FRAG);
    if comptime!(s.grid) {
        let (qi, qj) = (q / s.cols, q % s.cols);
        if comptime!(s.by_cols) {
            (qi, plane + qj * planes, true)
        } else {
            (plane + qi * planes, qj, true)
        }
    } else {
        let f = plane + q * planes;
        (f / fn_, f % fn_, f < comptime!(p.m / FRAG * fn_))
    }
}

/// Zeroed output fragments for this plane's slots of `p` (none unit by unit).
#[cube]
fn accumulators(#[comptime] p: Product, #[comptime] c: Tiling) -> Sequence<cmma::Matrix<f32>> {
    let mut frags = Sequence::new();
    if comptime!(c.mma) {
        #[unroll]
        for _ in 0..comptime!(Split::of(p, c).count) {
            frags.push(cmma::Matrix::<f32>::from_value(
                cmma::MatrixIdent::Accumulator,
                FRAG,
                FRAG,
                FRAG,
                cmma::MatrixLayout::Undefined,
                0.0f32,
            ));
        }
    }
    frags
}

/// Writes this plane's fragments of `p` into the f32 tile `acc` (rows `ldc` apart).
#[cube]
fn store_fragments(
    frags: &mut Sequence<cmma::Matrix<f32>>,
    acc: &mut Shared<[f32]>,
    #[comptime] p: Product,
    #[comptime] c: Tiling,
) {
    move_fragments(frags, acc, true, p, c);
}

/// Reads this plane's fragments of `p` from the f32 tile `acc` (rows `ldc` apart).
#[cube]
fn load_fragments(
    frags: &mut Sequence<cmma::Matrix<f32>>,
    acc: &mut Shared<[f32]>,
    #[comptime] p: Product,
    #[comptime] c: Tiling,
) {
    move_fragments(frags, acc, false, p, c);
}

/// [`store_fragments`] (`store`) or [`load_fragments`].
#[cube]
fn move_fragments(
    frags: &mut Sequence<cmma::Matrix<f32>>,
    acc: &mut Shared<[f32]>,
    #[comptime] store: bool,
    #[comptime] p: Product,
    #[comptime] c: Tiling,
) {
    let s = comptime!(Split::of(p, c));
    let span = comptime!((FRAG - 1) * p.ldc + FRAG);
    #[unroll]
    for q in 0..s.count {
        let (i, j, live) = slot(q, s, p, c);
        if live {
            let at = i * FRAG * p.ldc + j * FRAG;
            let layout = cmma::MatrixLayout::RowMajor;
            if comptime!(store) {
                cmma::store(
                    &mut acc[at..at + span],
                    frags.index(q),
                    p.ldc as u32,
                    layout,
                );
            } else {
                let tile = &acc[at..at + span];
                cmma::load_with_layout(frags.index_mut(q), tile, p.ldc as u32, layout);
            }
        }
    }
}

/// Operand fragment `(i, kk)` of `a` (`A`) or `(kk, j)` of `b` (`B`) of `p`.
#[cube]
fn operand<F: Float>(
    src: &Shared<[F]>,
    outer: usize,
    kk: usize,
    #[comptime] is_a: bool,
    #[comptime] p: Product,
) -> cmma::Matrix<F> {
    let (ld, cols) = comptime!(match is_a {
        true => (p.lda, p.a_cols),
        false => (p.ldb, p.b_cols),
    });
    let layout = comptime!(match cols {
        true => cmma::MatrixLayout::ColMajor,
        false => cmma::MatrixLayout::RowMajor,
    });
    let ident = comptime!(match is_a {
        true => cmma::MatrixIdent::A,
        false => cmma::MatrixIdent::B,
    });
    // A fragment `(i, kk)` starts at row i, column kk of a row-major `a`; `B` `(kk, j)` at row
    // kk, column j; a transposed (`cols`) operand swaps them.
    let (row, col) = match comptime!(is_a != cols) {
        true => (outer, kk),
        false => (kk, outer),
    };
    let at = row * FRAG * ld + col * FRAG;
    let span = comptime!((FRAG - 1) * ld + FRAG);
    cmma::Matrix::<F>::from_slice(
        ident,
        FRAG,
        FRAG,
        FRAG,
        layout,
        &src[at..at + span],
        ld as u32,
    )
}

/// `frags += a . b` on the tensor cores over this plane's slots of `p` (see [`Split`]).
#[cube]
fn fragment_product<F: Float>(
    a: &Shared<[F]>,
    b: &Shared<[F]>,
    frags: &mut Sequence<cmma::Matrix<f32>>,
    #[comptime] p: Product,
    #[comptime] c: Tiling,
) {
    let s = comptime!(Split::of(p, c));
    for kk in 0..comptime!(p.k / FRAG) {
        if comptime!(s.grid) {
            let mut fa = Sequence::<cmma::Matrix<F>>::new();
            #[unroll]
            for qi in 0..s.rows {
                let (i, _j, _live) = slot(qi * s.cols, s, p, c);
                fa.push(operand::<F>(a, i, kk, true, p));
            }
            let mut fb = Sequence::<cmma::Matrix<F>>::new();
            #[unroll]
            for qj in 0..s.cols {
                let (_i, j, _live) = slot(qj, s, p, c);
                fb.push(operand::<F>(b, j, kk, false, p));
            }
            #[unroll]
            for q in 0..s.count {
                let out = frags.index(q);
                cmma::execute(fa.index(q / s.cols), fb.index(q % s.cols), out, out);
            }
        } else {
            #[unroll]
            for q in 0..s.count {
                let (i, j, live) = slot(q, s, p, c);
                if live {
                    let fa = operand::<F>(a, i, kk, true, p);
                    let fb = operand::<F>(b, j, kk, false, p);
                    let out = frags.index(q);
                    cmma::execute(&fa, &fb, out, out);
                }
            }
        }
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

/// Where a tile's rows come from: `valid` real rows from element `base` of a tensor, `stride`
/// elements between rows.
#[derive(CubeType, Clone, Copy)]
struct Rows {
    base: usize,
    stride: usize,
    valid: usize,
}

#[cube]
fn rows_at(base: usize, stride: usize, valid: usize) -> Rows {
    Rows {
        base,
        stride,
        valid,
    }
}

/// The vectors of one tile this unit stages: `rows` rows of `hd` elements as vectors of `n`,
/// handed out to the cube's units in turn.
fn vectors_per_unit(c: Tiling, rows: usize, n: usize) -> usize {
    (rows * c.hd / n).div_ceil(c.units)
}

/// The `i`-th vector this unit stages of a `rows`-row tile: `(row, vector in the row, live)`,
/// not live past the tile's last vector (where the units do not divide them: then it names the
/// tile's first vector).
#[cube]
fn vector_at(
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
/// can be in flight while the cube computes on this one. (The first version loaded and stored
/// one element at a time: by its SASS, about 32 memory latencies a tile.)
#[cube]
fn fetch<F: Float, N: Size>(
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
fn put<F: Float, N: Size>(
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
fn tile_registers<F: Float, N: Size>(
    like: &Tensor<Vector<F, N>>,
    #[comptime] rows: usize,
    #[comptime] c: Tiling,
) -> Array<Vector<F, N>> {
    let n = like.vector_size();
    Array::<Vector<F, N>>::new(comptime!(vectors_per_unit(c, rows, n)))
}

/// Stages `rows` rows of a head from `src` (as `at` says) into `dst`: [`fetch`], then [`put`].
#[cube]
fn stage<F: Float, N: Size>(
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
fn kv_rows(
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
fn fill(dst: &mut Shared<[f32]>, value: f32, #[comptime] n: usize, #[comptime] c: Tiling) {
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
struct QueryBlock {
    bk: usize,
    p0: usize,
    valid: usize,
    r0: usize,
    u0: usize,
}

/// The block of query rows of this cube. Cubes are handed out longest first over all heads
/// (a block's work grows with its position): every head's last block, then every head's one
/// before, so that the long cubes start in the first wave and the short ones fill in behind
/// them, rather than the last head's long cubes starting at the end of the launch.
#[cube]
fn query_block(groups: u32, seq: u32, #[comptime] rows: usize) -> QueryBlock {
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

/// How far (in the scaled scores' natural-log units) a row's running max may rise before
/// the row's output accumulator is rescaled. Below it the row keeps its old max, so a tile's
/// probabilities stay below e^8 (finite in bf16 and in the f32 sums, and the same function:
/// the sum is taken against the same max), and the usual tile, no row rescaled, skips the
/// pass over the accumulator (as FlashAttention-4 does).
const RESCALE_GAP: f32 = 8.0;

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
fn online_softmax<F: Float>(
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
fn rescale(
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
fn scale_rows(os: &mut Shared<[f32]>, by: &Shared<[f32]>, #[comptime] c: Tiling) {
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
struct RowStats {
    ms: Shared<[f32]>,
    ls: Shared<[f32]>,
    red: Shared<[f32]>,
    keeps: Shared<[f32]>,
    flag: Shared<[f32]>,
}

#[cube]
fn row_stats(#[comptime] c: Tiling) -> RowStats {
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

/// Writes `valid` rows of the f32 tile `src` (rows `ldo` apart, `hd` wide) into `dst` from
/// element `base`, `stride` elements between rows, a vector at a time.
#[cube]
#[allow(clippy::too_many_arguments)]
fn unstage<F: Float, N: Size>(
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

#[cube(launch)]
#[allow(clippy::too_many_arguments)]
fn flash_forward_kernel<F: Float, N: Size>(
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

/// `dq = scale * sum_k P (dP - D) k` for a block of query rows, and `D = dO . O` per row
/// (saved for the `dk`/`dv` kernel).
#[cube(launch)]
#[allow(clippy::too_many_arguments)]
fn flash_dq_kernel<F: Float, N: Size>(
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
fn dot_row<F: Float, N: Size>(
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

/// `dv = sum_r P^T dO` and `dk = scale * sum_r (P (dP - D))^T q` for a block of keys, over
/// the query rows of every head in the group at or after the block's first key.
#[cube(launch)]
#[allow(clippy::too_many_arguments)]
fn flash_dkv_kernel<F: Float, N: Size>(
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

/// `D = dO . O` of each real row of the query block `qb` (its `dO` and `O` rows from element
/// `orow`, `ostride` apart), written to `delta` and kept in `ds` with each row's log-sum-exp in
/// `ls` (zero past the real rows).
#[cube]
#[allow(clippy::too_many_arguments)]
fn row_deltas<F: Float, N: Size>(
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
fn query_grads<F: Float>(
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

/// `P^T` and `dS^T` of the `dk`/`dv` kernel's tile (its `keys` keys from `key0` against the
/// `valid` query rows from position `p0`), from the transposed scores `sts` and `dP^T`
/// `dpts`; zero where a key is past the query's position or either is past the real ones.
#[cube]
#[allow(clippy::too_many_arguments)]
fn key_grads<F: Float>(
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
fn put_row_stats(
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
struct QueryTile {
    q: Rows,
    dout: Rows,
    p0: usize,
    u0: usize,
}

/// Query tile `tile` (counted over the group's heads, `t.div_ceil(rows)` a head) of K/V head
/// `head` (`h`).
#[cube]
#[allow(clippy::too_many_arguments)]
fn query_tile(
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
fn row_stat(lse: &Tensor<f32>, delta: &Tensor<f32>, at: &QueryTile) -> (f32, f32) {
    let i = UNIT_POS as usize;
    let mut l = 0.0f32;
    let mut d = 0.0f32;
    if i < at.q.valid {
        l = lse[at.u0 + i];
        d = delta[at.u0 + i];
    }
    (l, d)
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

/// The vector width (elements) the kernels read and write their `[.., hd]` tensors by: the
/// widest of the device's IO widths that divides the head dimension and every tensor's start.
fn vector_width(hd: usize, tensors: &[&CubeTensor]) -> usize {
    let size = tensors[0].dtype.size();
    tensors[0]
        .client
        .io_optimized_vector_sizes(size)
        .find(|&n| {
            hd.is_multiple_of(n)
                && tensors.iter().all(|t| {
                    t.handle
                        .offset_start
                        .is_none_or(|at| at.is_multiple_of((n * size) as u64))
                })
        })
        .unwrap_or(1)
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
    let width = vector_width(d.hd, &[&q, &k, &v, &out]);
    flash_forward_kernel::launch(
        &q.client,
        count,
        dim,
        width,
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
    let width = vector_width(d.hd, &[&q, &k, &v, &out, &dout, &dq, &dk, &dv]);
    flash_dq_kernel::launch(
        &q.client,
        count,
        dim,
        width,
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
        width,
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
        8,
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
        8,
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
        8,
        ckv,
        dtype,
    );
    Ok([compile(&forward)?, compile(&dq)?, compile(&dkv)?])
}

/// [`slot`] on the host: the same arithmetic, for plane `plane`.
fn slot_on_host(q: usize, plane: usize, s: Split, p: Product, c: Tiling) -> Option<(usize, usize)> {
    let planes = c.units / c.plane;
    let fn_ = p.n / FRAG;
    if s.grid {
        let (qi, qj) = (q / s.cols, q % s.cols);
        Some(match s.by_cols {
            true => (qi, plane + qj * planes),
            false => (plane + qi * planes, qj),
        })
    } else {
        let f = plane + q * planes;
        (f < p.m / FRAG * fn_).then_some((f / fn_, f % fn_))
    }
}

/// Checks that in every product of the tiling `(rows, cols, planes)` at head dimension `hd`
/// each output fragment is some plane's slot exactly once, and that a grid's operand fragments
/// are its slots' (the `A` of slot `qi * cols`, the `B` of slot `qj`): the tensor-core path's
/// bookkeeping, which CubeCL's CPU runtime (no fragments) cannot run.
pub(in crate::kernels) fn check_slots(
    rows: usize,
    cols: usize,
    planes: usize,
    hd: usize,
) -> Result<(), String> {
    let c = Tiling::new(rows, cols, planes * 32, 32, hd, true);
    for p in [against(c, rows, cols), back(c, rows, cols)] {
        let s = Split::of(p, c);
        let (fm, fn_) = (p.m / FRAG, p.n / FRAG);
        let mut seen = vec![0; fm * fn_];
        for plane in 0..planes {
            for q in 0..s.count {
                let Some((i, j)) = slot_on_host(q, plane, s, p, c) else {
                    continue;
                };
                seen[i * fn_ + j] += 1;
                let a = slot_on_host(q / s.cols.max(1) * s.cols, plane, s, p, c);
                let b = slot_on_host(q % s.cols.max(1), plane, s, p, c);
                if s.grid && (a.map(|x| x.0), b.map(|x| x.1)) != (Some(i), Some(j)) {
                    return Err(format!(
                        "{p:?} {s:?}: slot {q} of plane {plane} takes other operands"
                    ));
                }
            }
        }
        if seen.iter().any(|&n| n != 1) {
            return Err(format!("{p:?} {s:?}: fragments computed {seen:?} times"));
        }
    }
    Ok(())
}

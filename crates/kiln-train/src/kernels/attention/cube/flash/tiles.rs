//! A cube's tile products: how a kernel's cube cuts its work ([`Tiling`]), and one product of
//! tiles in shared memory ([`Product`]) run on the tensor cores (16 x 16 x 16 `cmma` fragments,
//! bf16 or f16 in, f32 out) or unit by unit over the same operands. On the tensor cores each
//! plane owns a grid of output fragments ([`Split`]), so a step along `k` loads each operand
//! fragment once for all the products that take it; the accumulating products (the forward's
//! output, `dq`, `dk`, `dv`) keep their fragments in registers across the cube's whole loop.

use cubecl::prelude::*;

/// The most iterations of a per-unit loop that are unrolled (GPUs' tilings: their loads all
/// issued at once, their indices constant); CubeCL's CPU runtime's few units a cube would
/// unroll hundreds.
pub(super) const UNROLL: usize = 32;

/// The side of a tensor-core fragment (16 x 16 x 16).
pub(super) const FRAG: usize = 16;

/// Bytes the tiles in shared memory are aligned to: fragment loads and stores take 32-byte
/// aligned addresses (fragment offsets in a tile are multiples of 16 elements).
pub(super) const ALIGN: usize = 128;

/// How a kernel's cube cuts its work: `rows` rows of its own side (query rows, or keys for
/// `dk`/`dv`) against tiles of `cols` rows of the other side, `units` units (`plane` a
/// plane), the head dimension `hd` padded to `hdp`, tile products on the tensor cores when
/// `mma`. Rows of the tiles in shared memory lie `ldh` elements apart (`[rows, hd]` tiles of
/// the element type), `ldo` (their f32 accumulators), `lds` (f32 scores `[rows, cols]`) and
/// `ldp` (probabilities and score gradients in the element type): each padded past its width
/// by 16 bytes or more, so that the rows of a fragment do not all start in one bank of shared
/// memory.
#[derive(Copy, Clone, Debug, Hash, PartialEq, Eq)]
pub(in crate::kernels) struct Tiling {
    pub(super) rows: usize,
    pub(super) cols: usize,
    pub(super) units: usize,
    pub(super) plane: usize,
    pub(super) hd: usize,
    pub(super) hdp: usize,
    pub(super) ldh: usize,
    pub(super) ldo: usize,
    pub(super) lds: usize,
    pub(super) ldp: usize,
    pub(super) mma: bool,
}

impl Tiling {
    pub(super) fn new(
        rows: usize,
        cols: usize,
        units: usize,
        plane: usize,
        hd: usize,
        mma: bool,
    ) -> Self {
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

    /// Units a row of the forward kernel's softmax takes ([`super::softmax::online_softmax`]): all of the
    /// cube's where they divide the rows and the parts divide the tile's columns.
    pub(super) fn parts(&self) -> usize {
        let p = (self.units / self.rows).max(1);
        if self.cols.is_multiple_of(p) { p } else { 1 }
    }

    /// Bytes of shared memory the kernel `kind` takes with elements of `size` bytes.
    pub(super) fn shared_bytes(&self, kind: Kernel, size: usize) -> usize {
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
pub(super) enum Kernel {
    Forward,
    Dq,
    Dkv,
}

/// One product of a tile: `acc [m x n] (+)= a [m x k] . b [k x n]`, each operand a whole
/// shared-memory buffer: `a` row-major with leading dimension `lda` (column-major, i.e. the
/// transpose of a row-major buffer, when `a_cols`), `b` likewise, `acc` f32 row-major with
/// leading dimension `ldc`, zeroed first when `fresh`.
#[derive(Copy, Clone, Debug, Hash, PartialEq, Eq)]
pub(super) struct Product {
    pub(super) m: usize,
    pub(super) n: usize,
    pub(super) k: usize,
    pub(super) lda: usize,
    pub(super) a_cols: bool,
    pub(super) ldb: usize,
    pub(super) b_cols: bool,
    pub(super) ldc: usize,
    pub(super) fresh: bool,
}

/// `acc (+)= a . b` as `p` says, by the cube's units together (see the module's note), the
/// accumulator in shared memory.
#[cube]
pub(super) fn tile_product<F: Float>(
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
pub(super) fn accumulate<F: Float>(
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
pub(super) fn unit_product<F: Float>(
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
pub(super) struct Split {
    pub(super) grid: bool,
    pub(super) by_cols: bool,
    pub(super) rows: usize,
    pub(super) cols: usize,
    pub(super) count: usize,
}

impl Split {
    pub(super) fn of(p: Product, c: Tiling) -> Self {
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
pub(super) fn slot(
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
pub(super) fn accumulators(
    #[comptime] p: Product,
    #[comptime] c: Tiling,
) -> Sequence<cmma::Matrix<f32>> {
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
pub(super) fn store_fragments(
    frags: &mut Sequence<cmma::Matrix<f32>>,
    acc: &mut Shared<[f32]>,
    #[comptime] p: Product,
    #[comptime] c: Tiling,
) {
    move_fragments(frags, acc, true, p, c);
}

/// Reads this plane's fragments of `p` from the f32 tile `acc` (rows `ldc` apart).
#[cube]
pub(super) fn load_fragments(
    frags: &mut Sequence<cmma::Matrix<f32>>,
    acc: &mut Shared<[f32]>,
    #[comptime] p: Product,
    #[comptime] c: Tiling,
) {
    move_fragments(frags, acc, false, p, c);
}

/// [`store_fragments`] (`store`) or [`load_fragments`].
#[cube]
pub(super) fn move_fragments(
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
pub(super) fn operand<F: Float>(
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
pub(super) fn fragment_product<F: Float>(
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
pub(super) fn against(c: Tiling, rows: usize, cols: usize) -> Product {
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
pub(super) fn back(c: Tiling, rows: usize, cols: usize) -> Product {
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

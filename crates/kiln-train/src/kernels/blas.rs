//! How a row-major batched product `c = a @ b` (`a` `[.., m, k]`, `b` `[.., k, n]`, any strides
//! burn's views give: contiguous, transposed, sliced) is asked of a column-major BLAS
//! (cuBLAS's strided-batched GEMM) without copying either operand: the pure part of
//! `device::cublas`, kept apart so CI checks it on the CPU against a column-major reference.
//!
//! Row-major `c = a b` is column-major `c^T = b^T a^T`: BLAS's `A` is `b`, its `B` is `a`, its
//! `m` is `n` and its `n` is `m`. A row-major matrix read column-major is its transpose, so a
//! row-major operand goes untransposed (`N`) and a transposed view (`b^T` from
//! `float_transpose`: unit stride along its rows) goes as `T`. `c` is written contiguous.

/// One strided-batched GEMM call, in BLAS's (column-major) terms. `A`, `B` and the output
/// each start at their tensor's first element; `stride_*` steps from one product of the batch
/// to the next (0: the same matrix for every product, a broadcast batch).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Gemm {
    /// Products in the batch.
    pub batch: usize,
    /// Rows of BLAS's output (`n` of the row-major product).
    pub m: usize,
    /// Columns of BLAS's output (`m` of the row-major product).
    pub n: usize,
    /// The inner dimension.
    pub k: usize,
    /// `A` (the row-major `b`) is transposed.
    pub trans_a: bool,
    pub lda: usize,
    pub stride_a: usize,
    /// `B` (the row-major `a`) is transposed.
    pub trans_b: bool,
    pub ldb: usize,
    pub stride_b: usize,
    pub ldc: usize,
    pub stride_c: usize,
    /// The row-major output's shape: the broadcast batch, then `[m, n]`.
    pub out_shape: Vec<usize>,
}

/// A matrix's last two dimensions as BLAS reads them: transposed or not, and its leading
/// dimension. `None` when neither dimension has unit stride (a copy would be needed).
fn operand(
    rows: usize,
    cols: usize,
    row_stride: usize,
    col_stride: usize,
) -> Option<(bool, usize)> {
    // Row-major: unit steps along a row, rows at least a row apart (one row: any step).
    if (col_stride == 1 || cols == 1) && (rows == 1 || row_stride >= cols) {
        let ld = if rows == 1 { cols } else { row_stride };
        return Some((false, ld.max(1)));
    }
    // Column-major (a transposed view): unit steps down a column.
    if (row_stride == 1 || rows == 1) && (cols == 1 || col_stride >= rows) {
        let ld = if cols == 1 { rows } else { col_stride };
        return Some((true, ld.max(1)));
    }
    None
}

/// The batch dimensions of one operand as a single stride, when they collapse to one
/// (each dimension steps over the next, size-1 dimensions ignored); 0 for a single matrix.
fn batch_stride(shape: &[usize], strides: &[usize]) -> Option<usize> {
    let dims: Vec<(usize, usize)> = shape
        .iter()
        .zip(strides)
        .filter(|(n, _)| **n != 1)
        .map(|(n, s)| (*n, *s))
        .collect();
    for pair in dims.windows(2) {
        let ((_, outer), (inner_n, inner)) = (pair[0], pair[1]);
        if outer != inner * inner_n {
            return None;
        }
    }
    Some(dims.last().map_or(0, |(_, s)| *s))
}

/// The GEMM for `a @ b` from the operands' shapes and strides (in elements), with the output
/// contiguous `[batch.., m, n]`. `None` when one call cannot do it: ranks under 2 or unequal,
/// batch shapes that differ (other than a single matrix against a batch), batch or matrix
/// strides that no single stride or leading dimension describes, an empty dimension, or a
/// size beyond BLAS's 32-bit integers.
pub(crate) fn plan(
    a_shape: &[usize],
    a_strides: &[usize],
    b_shape: &[usize],
    b_strides: &[usize],
) -> Option<Gemm> {
    let r = a_shape.len();
    if r < 2 || b_shape.len() != r || a_strides.len() != r || b_strides.len() != r {
        return None;
    }
    let (m, k, n) = (a_shape[r - 2], a_shape[r - 1], b_shape[r - 1]);
    if b_shape[r - 2] != k {
        return None;
    }
    let (a_batch, b_batch) = (&a_shape[..r - 2], &b_shape[..r - 2]);
    let (na, nb): (usize, usize) = (a_batch.iter().product(), b_batch.iter().product());
    if a_batch != b_batch && na != 1 && nb != 1 {
        return None;
    }
    let batch: usize = na.max(nb);
    let mut stride_b = batch_stride(a_batch, &a_strides[..r - 2])?;
    let mut stride_a = batch_stride(b_batch, &b_strides[..r - 2])?;
    if na == 1 {
        stride_b = 0;
    }
    if nb == 1 {
        stride_a = 0;
    }
    let (trans_b, ldb) = operand(m, k, a_strides[r - 2], a_strides[r - 1])?;
    let (trans_a, lda) = operand(k, n, b_strides[r - 2], b_strides[r - 1])?;
    let mut out_shape: Vec<usize> = a_batch
        .iter()
        .zip(b_batch)
        .map(|(x, y)| *x.max(y))
        .collect();
    out_shape.extend([m, n]);
    let gemm = Gemm {
        out_shape,
        batch,
        m: n,
        n: m,
        k,
        trans_a,
        lda,
        stride_a,
        trans_b,
        ldb,
        stride_b,
        ldc: n,
        stride_c: m * n,
    };
    let fits = |v: usize| v > 0 && v <= i32::MAX as usize;
    let ints = [
        gemm.m, gemm.n, gemm.k, gemm.lda, gemm.ldb, gemm.ldc, gemm.batch,
    ];
    ints.into_iter().all(fits).then_some(gemm)
}

impl Gemm {
    /// This product written into an existing tensor `c` of the output's shape (strides in
    /// elements), as `c = beta c + a b` (a prefix slice of an accumulator: attention's `dk`
    /// summed over chunks), instead of a new contiguous one. `None` when `c`'s matrices are
    /// not row-major (unit column step, rows at least a row apart), its batch does not collapse
    /// to one stride, or two products of the batch would overlap.
    pub(crate) fn into_view(mut self, c_shape: &[usize], c_strides: &[usize]) -> Option<Gemm> {
        let r = c_shape.len();
        if c_shape != self.out_shape.as_slice() || c_strides.len() != r {
            return None;
        }
        let (m, n) = (c_shape[r - 2], c_shape[r - 1]);
        let (row, col) = (c_strides[r - 2], c_strides[r - 1]);
        if !(col == 1 || n == 1) || !(m == 1 || row >= n) {
            return None;
        }
        self.ldc = if m == 1 { n } else { row };
        self.stride_c = batch_stride(&c_shape[..r - 2], &c_strides[..r - 2])?;
        let span = (m - 1) * self.ldc + n;
        let apart = self.batch == 1 || self.stride_c >= span;
        (apart && self.ldc <= i32::MAX as usize).then_some(self)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// BLAS's strided-batched GEMM as its documentation defines it (column-major,
    /// `C = op(A) op(B)`), on host slices.
    fn reference_gemm(g: &Gemm, a: &[f64], b: &[f64]) -> Vec<f64> {
        let mut c = vec![0.0; g.batch * g.stride_c];
        reference_gemm_into(g, a, b, &mut c, 0.0);
        c
    }

    /// `c = beta c + op(A) op(B)`, batch by batch, over BLAS's view of `c`.
    fn reference_gemm_into(g: &Gemm, a: &[f64], b: &[f64], c: &mut [f64], beta: f64) {
        for p in 0..g.batch {
            for i in 0..g.m {
                for j in 0..g.n {
                    let mut s = 0.0;
                    for l in 0..g.k {
                        let ea = if g.trans_a {
                            l + i * g.lda
                        } else {
                            i + l * g.lda
                        };
                        let eb = if g.trans_b {
                            j + l * g.ldb
                        } else {
                            l + j * g.ldb
                        };
                        s += a[p * g.stride_a + ea] * b[p * g.stride_b + eb];
                    }
                    let at = p * g.stride_c + i + j * g.ldc;
                    c[at] = beta * c[at] + s;
                }
            }
        }
    }

    /// A strided view over a buffer: the element at `index` is `data[sum(index * strides)]`.
    struct View {
        shape: Vec<usize>,
        strides: Vec<usize>,
        data: Vec<f64>,
    }

    impl View {
        /// `shape` laid out with dimensions in `order` (outermost first) and `pad` extra
        /// elements after each of the last two dimensions' rows, filled with distinct values.
        fn new(shape: &[usize], order: &[usize], pad: usize, seed: u64) -> Self {
            let mut strides = vec![0; shape.len()];
            let mut step = 1;
            for &d in order.iter().rev() {
                strides[d] = step;
                step *= shape[d] + if d + 2 >= shape.len() { pad } else { 0 };
            }
            let data = (0..step.max(1))
                .map(|i| ((i as u64 * 2654435761 + seed) % 1000) as f64 / 100.0 - 5.0)
                .collect();
            Self {
                shape: shape.to_vec(),
                strides,
                data,
            }
        }

        fn at(&self, index: &[usize]) -> f64 {
            self.data[index
                .iter()
                .zip(&self.strides)
                .map(|(i, s)| i * s)
                .sum::<usize>()]
        }
    }

    /// `a @ b` by definition, row-major, over the broadcast batch.
    fn product(a: &View, b: &View) -> Vec<f64> {
        let r = a.shape.len();
        let (m, k, n) = (a.shape[r - 2], a.shape[r - 1], b.shape[r - 1]);
        let batch: Vec<usize> = (0..r - 2).map(|d| a.shape[d].max(b.shape[d])).collect();
        let count: usize = batch.iter().product();
        let mut out = Vec::with_capacity(count * m * n);
        for p in 0..count {
            let mut idx = vec![0; r];
            let mut rest = p;
            for d in (0..r - 2).rev() {
                idx[d] = rest % batch[d];
                rest /= batch[d];
            }
            let clamp = |v: &View, idx: &[usize]| -> Vec<usize> {
                idx.iter()
                    .zip(&v.shape)
                    .map(|(i, s)| if *s == 1 { 0 } else { *i })
                    .collect()
            };
            for i in 0..m {
                for j in 0..n {
                    let mut s = 0.0;
                    for l in 0..k {
                        let (mut ia, mut ib) = (idx.clone(), idx.clone());
                        (ia[r - 2], ia[r - 1], ib[r - 2], ib[r - 1]) = (i, l, l, j);
                        s += a.at(&clamp(a, &ia)) * b.at(&clamp(b, &ib));
                    }
                    out.push(s);
                }
            }
        }
        out
    }

    /// Plans `a @ b`, runs the plan on the reference GEMM and compares with the definition.
    fn check(a: &View, b: &View) {
        let g = plan(&a.shape, &a.strides, &b.shape, &b.strides).unwrap_or_else(|| {
            panic!(
                "no plan for {:?} {:?} @ {:?} {:?}",
                a.shape, a.strides, b.shape, b.strides
            )
        });
        assert_eq!(reference_gemm(&g, &b.data, &a.data), product(a, b), "{g:?}");
        let r = a.shape.len();
        let batch = (0..r - 2).map(|d| a.shape[d].max(b.shape[d]));
        let want: Vec<usize> = batch.chain([a.shape[r - 2], b.shape[r - 1]]).collect();
        assert_eq!(g.out_shape, want, "{g:?}");
    }

    #[test]
    fn contiguous_transposed_and_padded_operands() {
        // [m, k] @ [k, n], each row-major or transposed, with and without padded rows.
        for (ta, tb, pad) in [
            (false, false, 0),
            (true, false, 0),
            (false, true, 1),
            (true, true, 3),
        ] {
            let oa = if ta { [1, 0] } else { [0, 1] };
            let ob = if tb { [1, 0] } else { [0, 1] };
            check(
                &View::new(&[5, 3], &oa, pad, 1),
                &View::new(&[3, 4], &ob, pad, 2),
            );
        }
    }

    #[test]
    fn batches_and_broadcast() {
        // Batched [2, 3, m, k] @ [2, 3, k, n]; one matrix against a batch, both ways.
        check(
            &View::new(&[2, 3, 4, 5], &[0, 1, 2, 3], 0, 3),
            &View::new(&[2, 3, 5, 2], &[0, 1, 3, 2], 0, 4),
        );
        check(
            &View::new(&[1, 1, 4, 5], &[0, 1, 2, 3], 2, 5),
            &View::new(&[2, 3, 5, 2], &[0, 1, 2, 3], 0, 6),
        );
        check(
            &View::new(&[2, 3, 4, 5], &[0, 1, 3, 2], 0, 7),
            &View::new(&[1, 1, 5, 2], &[0, 1, 2, 3], 1, 8),
        );
    }

    #[test]
    fn refuses_what_one_call_cannot_do() {
        // Batch dimensions that do not collapse to one stride (the batch axes swapped).
        let a = View::new(&[2, 3, 4, 5], &[1, 0, 2, 3], 0, 1);
        let b = View::new(&[2, 3, 5, 2], &[0, 1, 2, 3], 0, 2);
        assert!(plan(&a.shape, &a.strides, &b.shape, &b.strides).is_none());
        // Neither dimension of unit stride; mismatched inner sizes; partial broadcast; empty.
        assert!(plan(&[4, 5], &[10, 2], &[5, 2], &[2, 1]).is_none());
        assert!(plan(&[4, 5], &[5, 1], &[6, 2], &[2, 1]).is_none());
        assert!(plan(&[2, 4, 5], &[20, 5, 1], &[3, 5, 2], &[10, 2, 1]).is_none());
        assert!(plan(&[0, 5], &[5, 1], &[5, 2], &[2, 1]).is_none());
    }

    #[test]
    fn accumulates_into_a_prefix_of_a_larger_tensor() {
        // dk [2, 3, 10, 4] += ds^T [2, 3, 6, 5] @ q [2, 3, 5, 4] over its first 6 positions:
        // the view's rows are 4 apart, its batch 40 apart, the rest of dk untouched.
        let ds = View::new(&[2, 3, 5, 6], &[0, 1, 2, 3], 0, 1);
        let ds_t = View {
            shape: vec![2, 3, 6, 5],
            strides: vec![ds.strides[0], ds.strides[1], ds.strides[3], ds.strides[2]],
            data: ds.data.clone(),
        };
        let q = View::new(&[2, 3, 5, 4], &[0, 1, 2, 3], 0, 2);
        let g = plan(&ds_t.shape, &ds_t.strides, &q.shape, &q.strides).unwrap();
        let g = g.into_view(&[2, 3, 6, 4], &[120, 40, 4, 1]).unwrap();
        let mut dk: Vec<f64> = (0..240).map(|i| i as f64).collect();
        reference_gemm_into(&g, &q.data, &ds_t.data, &mut dk, 1.0);
        let sum = product(&ds_t, &q);
        for (i, got) in dk.iter().enumerate() {
            let (bk, pos, col) = (i / 40, (i % 40) / 4, i % 4);
            let want = if pos < 6 {
                i as f64 + sum[bk * 24 + pos * 4 + col]
            } else {
                i as f64
            };
            assert_eq!(*got, want, "element {i}");
        }
        // Not a view BLAS can write: transposed, overlapping rows, overlapping batches.
        let g = plan(&ds_t.shape, &ds_t.strides, &q.shape, &q.strides).unwrap();
        assert!(
            g.clone()
                .into_view(&[2, 3, 6, 4], &[120, 40, 1, 6])
                .is_none()
        );
        assert!(
            g.clone()
                .into_view(&[2, 3, 6, 4], &[120, 40, 3, 1])
                .is_none()
        );
        assert!(g.into_view(&[2, 3, 6, 4], &[60, 20, 4, 1]).is_none());
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(64))]
        #[test]
        fn any_layout_burn_gives(
            m in 1usize..6, k in 1usize..6, n in 1usize..6, b0 in 1usize..3, b1 in 1usize..3,
            ta: bool, tb: bool, pad_a in 0usize..2, pad_b in 0usize..2,
            broadcast in 0u8..3,
        ) {
            let shape_a = if broadcast == 1 { vec![1, 1, m, k] } else { vec![b0, b1, m, k] };
            let shape_b = if broadcast == 2 { vec![1, 1, k, n] } else { vec![b0, b1, k, n] };
            let order = |t: bool| if t { [0, 1, 3, 2] } else { [0, 1, 2, 3] };
            check(&View::new(&shape_a, &order(ta), pad_a, 11), &View::new(&shape_b, &order(tb), pad_b, 12));
        }
    }
}

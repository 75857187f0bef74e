//! Matrix products for the kernels, on the `gemm` crate (the one flex uses), with outputs
//! that are never zero-filled or copied.
//!
//! Why not flex's matmul: its output buffer is `vec![0u8; n]` re-allocated to the runtime
//! alignment and copied (`FlexTensor::empty` -> `Bytes::from_bytes_vec`), so every product
//! pays a zero-fill, a full copy and the page faults of two fresh allocations before the
//! multiply writes it. Here the output is an uninitialised `Vec<f32>` that the multiply
//! writes once.
//!
//! Upstream: flex's `FlexTensor::empty` should allocate f32-aligned memory without zeroing
//! (the matmul overwrites all of it), which would make this module unnecessary.

use super::tensors::written;
use burn::backend::flex::FlexTensor;
use std::mem::MaybeUninit;

/// Below this many multiply-adds a product runs on the calling thread (flex's threshold).
const PARALLEL_MIN: usize = 192 * 192 * 192;

/// A read-only matrix in a slice: element `(i, j)` is `data[offset + i * rs + j * cs]`.
#[derive(Clone, Copy, Debug)]
pub(in crate::kernels) struct View<'a> {
    data: &'a [f32],
    offset: usize,
    rows: usize,
    cols: usize,
    rs: isize,
    cs: isize,
}

impl<'a> View<'a> {
    /// A matrix of `rows x cols` at `offset` with strides `rs`, `cs` (non-negative), checked
    /// to lie inside `data`.
    pub fn new(
        data: &'a [f32],
        offset: usize,
        (rows, cols): (usize, usize),
        (rs, cs): (isize, isize),
    ) -> Self {
        assert!(rs >= 0 && cs >= 0, "matmul: negative strides");
        if rows > 0 && cols > 0 {
            let last = offset + (rows - 1) * rs as usize + (cols - 1) * cs as usize;
            assert!(last < data.len(), "matmul: view outside its buffer");
        }
        Self {
            data,
            offset,
            rows,
            cols,
            rs,
            cs,
        }
    }

    /// A row-major `rows x cols` matrix filling `data` from the start.
    pub fn rows(data: &'a [f32], rows: usize, cols: usize) -> Self {
        Self::new(data, 0, (rows, cols), (cols as isize, 1))
    }

    /// The 2-D f32 tensor `t`, whatever its strides.
    pub fn of(t: &'a FlexTensor) -> Self {
        let layout = t.layout();
        let shape = layout.shape();
        assert_eq!(shape.num_dims(), 2, "matmul: 2-D tensor expected");
        let st = layout.strides();
        Self::new(
            t.storage::<f32>(),
            layout.start_offset(),
            (shape[0], shape[1]),
            (st[0], st[1]),
        )
    }

    /// The transpose (a view of the same elements).
    pub fn t(self) -> Self {
        Self {
            rows: self.cols,
            cols: self.rows,
            rs: self.cs,
            cs: self.rs,
            ..self
        }
    }

    /// Rows `start..start + n`.
    pub fn row_range(self, start: usize, n: usize) -> Self {
        assert!(start + n <= self.rows, "matmul: rows out of range");
        Self {
            offset: self.offset + start * self.rs as usize,
            rows: n,
            ..self
        }
    }

    /// Rows.
    pub fn n_rows(&self) -> usize {
        self.rows
    }

    /// Columns.
    pub fn n_cols(&self) -> usize {
        self.cols
    }

    fn ptr(&self) -> *const f32 {
        self.data[self.offset..].as_ptr()
    }
}

fn parallelism(m: usize, n: usize, k: usize, parallel: bool) -> gemm::Parallelism {
    if parallel && m.saturating_mul(n).saturating_mul(k) >= PARALLEL_MIN {
        gemm::Parallelism::Rayon(0)
    } else {
        gemm::Parallelism::None
    }
}

/// `dst = a @ b`, or `dst += a @ b` with `accumulate`; `dst` is row-major with row stride
/// `ld`. `parallel`: split a large product over the rayon pool (false inside parallel tasks).
pub(in crate::kernels) fn gemm_into(
    dst: &mut [f32],
    ld: usize,
    a: View,
    b: View,
    accumulate: bool,
    parallel: bool,
) {
    if !fits(dst.len(), ld, a, b) {
        return;
    }
    // SAFETY: `dst` holds the m x n result at row stride `ld` (checked by `fits`); `a` and
    // `b` were checked to lie inside their slices when they were made (`View::new`).
    unsafe { raw(dst.as_mut_ptr(), ld, a, b, accumulate, parallel) }
}

/// Whether `a @ b` has any element, after checking that its operands agree and that a
/// destination of `len` elements holds it at row stride `ld` (panics otherwise).
fn fits(len: usize, ld: usize, a: View, b: View) -> bool {
    let (m, n) = (a.rows, b.cols);
    assert_eq!(a.cols, b.rows, "matmul: inner dimensions differ");
    if m == 0 || n == 0 {
        return false;
    }
    assert!(
        ld >= n && len >= (m - 1) * ld + n,
        "matmul: destination too small"
    );
    true
}

/// `dst = a @ b` into a buffer that may be uninitialised (row stride `ld`): every element of
/// the `a.rows x b.cols` block is written, none is read.
pub(in crate::kernels) fn gemm_write(
    dst: &mut [MaybeUninit<f32>],
    ld: usize,
    a: View,
    b: View,
    parallel: bool,
) {
    if !fits(dst.len(), ld, a, b) {
        return;
    }
    // SAFETY: `dst` holds the m x n result at row stride `ld` (checked by `fits`); without
    // `accumulate`, `gemm` writes every element of it (zeros when the inner dimension is 0)
    // and reads none.
    unsafe { raw(dst.as_mut_ptr().cast(), ld, a, b, false, parallel) }
}

/// `a @ b` as a new row-major vector, written once (never zero-filled first).
pub(in crate::kernels) fn product(a: View, b: View, parallel: bool) -> Vec<f32> {
    let n = b.cols;
    written(a.rows * n, |out| gemm_write(out, n, a, b, parallel)).0
}

/// # Safety
/// `dst` must be valid for writes (and for reads when `accumulate`) of an
/// `a.rows x b.cols` matrix at row stride `ld`; `a` and `b` must be valid views.
pub(in crate::kernels) unsafe fn raw(
    dst: *mut f32,
    ld: usize,
    a: View,
    b: View,
    accumulate: bool,
    parallel: bool,
) {
    let (m, k, n) = (a.rows, a.cols, b.cols);
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            dst,
            1,
            ld as isize,
            accumulate,
            a.ptr(),
            a.cs,
            a.rs,
            b.ptr(),
            b.cs,
            b.rs,
            1.0f32,
            1.0f32,
            false,
            false,
            false,
            parallelism(m, n, k, parallel),
        );
    }
}

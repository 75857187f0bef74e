//! Flex tensors as f32 slices and back, and the row block that fixes how work is cut.

use burn::backend::flex::{FlexTensor, Layout};
use burn::tensor::{Bytes, DType, Shape};
use std::mem::MaybeUninit;

/// Rows per block of work: small enough to spread over threads, large enough to amortise
/// scheduling. Fixed, so results do not depend on the thread count.
pub(in crate::kernels) const ROW_BLOCK: usize = 16;

/// `t` as a contiguous f32 slice (copies a strided view once).
pub(in crate::kernels) fn contiguous(t: &FlexTensor) -> FlexTensor {
    assert_eq!(t.dtype(), DType::F32, "kiln kernels take f32 tensors");
    t.to_contiguous()
}

/// The f32 elements of a contiguous tensor.
pub(in crate::kernels) fn values(t: &FlexTensor) -> &[f32] {
    t.as_slice::<f32>()
        .expect("kiln kernels: contiguous f32 tensor expected")
}

/// A contiguous f32 tensor owning `v`.
pub(in crate::kernels) fn tensor(v: Vec<f32>, shape: impl Into<Shape>) -> FlexTensor {
    FlexTensor::new(
        Bytes::from_elems(v),
        Layout::contiguous(shape.into()),
        DType::F32,
    )
}

/// The dimensions of a flex tensor.
pub(in crate::kernels) fn dims(t: &FlexTensor) -> Vec<usize> {
    t.layout().shape().iter().copied().collect()
}

/// The value of a one-element tensor (the upstream gradient of a scalar loss).
pub(in crate::kernels) fn scalar(t: &FlexTensor) -> f32 {
    values(&contiguous(t))[0]
}

/// A new buffer of `n` f32 for a kernel output that the kernel writes whole before anything
/// reads it, and what `write` returns. `vec![0.0; n]` would zero-fill it first: calloc takes
/// these sizes from the heap and memsets them, about 3 % of the reference model's CPU step
/// over the kernels. `write` gets the buffer uninitialised and must write every element
/// (each caller says how it does). In test builds the buffer starts as NaN instead, so an
/// element left unwritten fails the kernels' checks against their composed twins.
pub(in crate::kernels) fn written<R>(
    n: usize,
    write: impl FnOnce(&mut [MaybeUninit<f32>]) -> R,
) -> (Vec<f32>, R) {
    let mut v: Vec<f32> = Vec::with_capacity(n);
    let out = &mut v.spare_capacity_mut()[..n];
    if cfg!(test) {
        out.fill(MaybeUninit::new(f32::NAN));
    }
    let r = write(out);
    // SAFETY: `write` wrote all `n` elements (the caller's contract, above).
    unsafe { v.set_len(n) };
    (v, r)
}

//! Flex tensors as f32 slices and back, and the row block that fixes how work is cut.

use burn::backend::flex::{FlexTensor, Layout};
use burn::tensor::{Bytes, DType, Shape};

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

//! New device tensors, their element type and launch shapes.

use burn::backend::cubecl::dtype_to_storage_type;
use burn::tensor::{DType, Shape};
use burn_cubecl::kernel::into_contiguous;
use burn_cubecl::ops::numeric::empty_device_contiguous_dtype;
use burn_cubecl::tensor::CubeTensor;
use cubecl::prelude::*;

/// Units per cube for the one-unit-per-row and one-unit-per-element launches.
pub(in crate::kernels) const UNITS: u32 = 128;

/// The dimensions of a device tensor.
pub(in crate::kernels) fn dims(t: &CubeTensor) -> Vec<usize> {
    t.meta.shape().iter().copied().collect()
}

/// A new contiguous tensor of `shape` on `like`'s device, with `like`'s element type.
///
/// Contiguous, not CubeCL's default layout: on CUDA that default pads each row to an
/// alignment (a pitched layout), and the kernels write row `r` at `r * width`; CubeCL's CPU
/// runtime never pads, so only a GPU shows the difference (`kiln doctor --device cuda`).
pub(in crate::kernels) fn empty_like(like: &CubeTensor, shape: impl Into<Shape>) -> CubeTensor {
    empty_device_contiguous_dtype(
        like.client.clone(),
        like.device.clone(),
        shape.into(),
        like.dtype,
    )
}

/// An f32 vector of `n` on `like`'s device: per-row statistics (1/rms, log-sum-exp) stay f32
/// whatever the element type.
pub(in crate::kernels) fn f32_vector(like: &CubeTensor, n: usize) -> CubeTensor {
    empty_device_contiguous_dtype(
        like.client.clone(),
        like.device.clone(),
        [n].into(),
        DType::F32,
    )
}

/// `(cube count, cube dim)` for `n` units, one-dimensional.
pub(in crate::kernels) fn launch_1d(n: usize) -> (CubeCount, CubeDim) {
    let cubes = n.div_ceil(UNITS as usize).max(1);
    (
        CubeCount::Static(cubes as u32, 1, 1),
        CubeDim::new_1d(UNITS),
    )
}

/// The storage type the kernels are compiled for.
pub(in crate::kernels) fn elem(t: &CubeTensor) -> ElemType {
    dtype_to_storage_type(t.dtype)
}

/// Contiguous (the kernels index rows directly).
pub(in crate::kernels) fn dense(t: CubeTensor) -> CubeTensor {
    into_contiguous(t)
}

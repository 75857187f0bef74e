//! kiln's CubeCL kernels defined for a device that is not there, so that a GPU backend's
//! compiler can compile them on a machine with no GPU (the AMD code objects of [`amdgpu`],
//! for a test; the flash kernels' PTX, `attention::cube::flash::ptx`). Each op's `cube.rs`
//! lists its kernels (`offline`) with the arguments its launches compile them with: every
//! buffer a contiguous tensor, the compile-time values of a typical launch (the helpers for
//! that are below the ops, in `device::offline`).

use burn::tensor::FloatDType;

pub use super::device::offline::Named;
#[cfg(feature = "rocm")]
pub use super::device::offline::{AmdCode, amdgpu};

/// Every kernel of kiln's ops but the flash kernels (which take fragment products: see
/// `attention::cube::flash::ptx`) in `dtype`, with its name.
pub fn kernels(dtype: FloatDType) -> Result<Vec<Named>, String> {
    let e = super::device::offline::elem(dtype)?;
    let mut all = Vec::new();
    for (op, list) in [
        ("rms_norm", super::rms_norm::cube::offline(e)),
        ("swiglu", super::swiglu::cube::offline(e)),
        ("rope", super::rope::cube::offline(e)),
        ("cross_entropy", super::cross_entropy::cube::offline(e)),
        ("adamw", super::adamw::cube::offline(e)),
        ("fixed_order", super::fixed_order::cube::offline(e)),
        ("attention", super::attention::cube::offline(e)),
    ] {
        all.extend(
            list.into_iter()
                .map(|(name, k)| (format!("{op}::{name}"), k)),
        );
    }
    Ok(all)
}

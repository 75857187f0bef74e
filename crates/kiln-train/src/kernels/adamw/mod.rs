//! Gradient clipping and the AdamW update of one parameter as one fused pass: a CPU pass
//! ([`cpu`], bit-identical to the composed update) and a CubeCL kernel ([`cube`]). The composed
//! update they replace is the optimizer's own (`optim::adamw`), which takes the tensors back
//! where neither covers them.

pub mod cpu;
#[cfg(feature = "cube")]
pub(in crate::kernels) mod cube;

use burn::tensor::Tensor;
pub use cpu::{AdamWScalars, Fused};

/// The fused AdamW update of one parameter (with clipping): the CubeCL kernel on CubeCL
/// devices, the CPU pass on flex; `Err` hands the tensors back for the composed update.
pub fn adamw_update(
    p: Tensor<1>,
    g: Tensor<1>,
    m: Tensor<1>,
    v: Tensor<1>,
    s: &AdamWScalars,
) -> Fused {
    #[cfg(feature = "cube")]
    let (p, g, m, v) = match cube::update(p, g, m, v, s) {
        Ok(done) => return Ok(done),
        Err(back) => *back,
    };
    cpu::update(p, g, m, v, s)
}

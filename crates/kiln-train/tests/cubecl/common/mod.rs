//! Helpers shared by the CubeCL CPU-runtime tests (cubecl_cpu.rs, cube_kernels.rs): the
//! kernel self-check's own (`kiln_train::kernels::selfcheck`), so tests and `kiln doctor`
//! draw the same values and measure differences the same way.

pub use kiln_train::kernels::selfcheck::{host, rel_diff};

/// `n` fixed values in [-1, 1) from `seed`.
pub fn random(n: usize, seed: u64) -> Vec<f32> {
    kiln_train::kernels::selfcheck::random(n, seed, burn::tensor::FloatDType::F32)
}

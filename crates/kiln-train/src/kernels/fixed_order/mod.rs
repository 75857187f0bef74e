//! Arithmetic on replicated state, where every data-parallel rank must get the same bits
//! from the same inputs: the gradients' sum of squares (clipping), Muon's Frobenius norm, and
//! the matrix products of Muon's Newton-Schulz. On CubeCL devices burn's generic sum and matmul
//! are autotuned per process (and the sum may use atomics), so two ranks could differ by an ulp
//! and drift apart; here their order and kernel are fixed ([`cube`],
//! `device::matmul::matmul_fixed`). Elsewhere burn's own ops, which are deterministic already.

#[cfg(feature = "cube")]
pub(in crate::kernels) mod cube;

use burn::tensor::Tensor;

/// The sum of squares of every element of `tensors` in an order fixed by their sizes alone,
/// when they are on a CubeCL device; `None` elsewhere, where the caller's own sum is already
/// deterministic. Not switched off by `training.fused_kernels`: it is for exactness, not speed.
pub fn device_square_sum(tensors: &[Tensor<1>]) -> Option<f64> {
    #[cfg(feature = "cube")]
    return cube::square_sum(tensors);
    #[cfg(not(feature = "cube"))]
    {
        let _ = tensors;
        None
    }
}

/// `a @ b` for arithmetic on replicated state (Muon's Newton-Schulz): on CubeCL devices by a
/// kernel chosen from the device's properties, not by timing; burn's matmul elsewhere.
pub fn replicated_matmul(a: Tensor<2>, b: Tensor<2>) -> Tensor<2> {
    #[cfg(feature = "cube")]
    if let Some(out) = super::device::matmul::matmul_fixed(&a, &b) {
        return out;
    }
    a.matmul(b)
}

/// The Frobenius norm of `x` as a one-element tensor on its device, with no read-back: on
/// CubeCL devices the fixed-order sum of [`device_square_sum`], else burn's sum.
pub fn frobenius_norm(x: &Tensor<2>) -> Tensor<1> {
    #[cfg(feature = "cube")]
    if let Some(s) = cube::on_device(&x.clone().reshape([x.dims().iter().product::<usize>()])) {
        return s.sqrt();
    }
    x.clone().powi_scalar(2).sum().sqrt()
}

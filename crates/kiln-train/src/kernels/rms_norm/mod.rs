//! RMSNorm over the last dimension, `x / sqrt(mean(x^2) + eps) * w`: the model's norm before
//! attention, before the MLP and before the head. A CPU kernel ([`cpu`]) and a CubeCL kernel
//! ([`cube`]), each forward and backward, the composed twin they are checked against
//! ([`composed`]), and the self-check case ([`check`]).

pub(super) mod composed;
mod cpu;
#[cfg(feature = "cube")]
pub(in crate::kernels) mod cube;

use super::check::{Check, compare, grad_of, values_and_grads};
use super::coverage::{self, Route};
use burn::tensor::{Device, FloatDType, Tensor};

/// RMSNorm over the last dimension: the CubeCL kernel on CubeCL devices, the CPU kernel on
/// flex, the composed ops where neither covers `x` (dtypes, or kernels off).
pub fn rms_norm<const D: usize>(x: Tensor<D>, w: Tensor<1>, eps: f64) -> Tensor<D> {
    match coverage::route(&x, &[w.dtype()]) {
        #[cfg(feature = "cube")]
        Route::Device(_) => cube::rms_norm(x, w, eps),
        Route::Host => cpu::rms_norm(x, w, eps),
        Route::Composed => composed::rms_norm(x, w, eps),
    }
}

/// The kernel against [`composed`] on `device`: 3 x 5 rows of 24, and 130 rows of 7 (one
/// cube and a bit for per-row units).
pub fn check(device: &Device, dtype: FloatDType) -> Vec<Check> {
    [([3, 5, 24], 1), ([2, 65, 7], 2)]
        .into_iter()
        .flat_map(|(shape, seed)| {
            compare(
                device,
                dtype,
                format!("rms_norm {shape:?}"),
                &["y", "dx", "dw"],
                |r| {
                    let (x, w) = (r.leaf(shape, seed), r.leaf([shape[2]], seed + 10));
                    let y = match r.fused {
                        true => rms_norm(x.clone(), w.clone(), 1e-5),
                        false => composed::rms_norm(x.clone(), w.clone(), 1e-5),
                    };
                    values_and_grads(r, y, &[grad_of(&x), grad_of(&w)])
                },
            )
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use crate::kernels::tests::{against_composed, random};

    #[test]
    fn rms_norm_matches_composed() {
        // 37 rows (not a multiple of the row block), 40 columns (not a multiple of the lanes)
        let x = random(37 * 40, 1, 2.0);
        let w = random(40, 2, 1.5);
        against_composed::<2, 2>(
            [(&x, vec![37, 40]), (&w, vec![1, 40])],
            |t| super::rms_norm(t[0].clone(), t[1].clone().reshape([40]), 1e-5),
            |t| super::composed::rms_norm(t[0].clone(), t[1].clone().reshape([40]), 1e-5),
            2e-6,
        );
    }
}

//! SwiGLU's gate, `silu(gate) * up`: the MLP's product of its two projections. A CPU kernel
//! ([`cpu`]) and a CubeCL kernel ([`cube`]), each forward and backward, the composed twin they
//! are checked against ([`composed`]), and the self-check case ([`check`]).

pub(super) mod composed;
mod cpu;
#[cfg(feature = "cube")]
pub(in crate::kernels) mod cube;

use super::check::{Check, compare, grad_of, values_and_grads};
use super::coverage::{self, Route};
use burn::tensor::{Device, FloatDType, Tensor};

/// `silu(gate) * up`: the CubeCL kernel on CubeCL devices, the CPU kernel on flex, the
/// composed ops where neither covers the tensors.
pub fn swiglu<const D: usize>(gate: Tensor<D>, up: Tensor<D>) -> Tensor<D> {
    match coverage::route(&gate, &[up.dtype()]) {
        #[cfg(feature = "cube")]
        Route::Device(_) => cube::swiglu(gate, up),
        Route::Host => cpu::swiglu(gate, up),
        Route::Composed => composed::swiglu(gate, up),
    }
}

/// The kernel against [`composed`] on `device`, over 231 elements: one full cube and a
/// partial one.
pub fn check(device: &Device, dtype: FloatDType) -> Vec<Check> {
    compare(
        device,
        dtype,
        "swiglu".into(),
        &["y", "dgate", "dup"],
        |r| {
            let (g, u) = (r.leaf([3, 7, 11], 3), r.leaf([3, 7, 11], 4));
            let y = match r.fused {
                true => swiglu(g.clone(), u.clone()),
                false => composed::swiglu(g.clone(), u.clone()),
            };
            values_and_grads(r, y, &[grad_of(&g), grad_of(&u)])
        },
    )
}

#[cfg(test)]
mod tests {
    use crate::kernels::tests::{against_composed, random};

    #[test]
    fn swiglu_matches_composed() {
        let g = random(3 * 5000, 3, 6.0);
        let u = random(3 * 5000, 4, 2.0);
        against_composed::<2, 2>(
            [(&g, vec![3, 5000]), (&u, vec![3, 5000])],
            |t| super::swiglu(t[0].clone(), t[1].clone()),
            |t| super::composed::swiglu(t[0].clone(), t[1].clone()),
            2e-6,
        );
    }
}

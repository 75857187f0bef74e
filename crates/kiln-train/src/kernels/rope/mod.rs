//! Rotate-half RoPE fused with the head transpose: `[b, t, heads * hd]` (a projection's
//! output) in, `[b, heads, t, hd]` (what attention multiplies) out. A CPU kernel ([`cpu`]) and
//! a CubeCL kernel ([`cube`]), each forward and backward, the composed twin they are checked
//! against ([`composed`]), and the self-check case ([`check`]).

pub(super) mod composed;
mod cpu;
#[cfg(feature = "cube")]
pub(in crate::kernels) mod cube;

use super::check::{Check, compare, grad_of, values_and_grads};
use super::coverage::{self, Route};
use burn::tensor::{Device, FloatDType, Tensor, TensorData};

/// Rotate-half RoPE of the heads in `x` `[b, t, heads * hd]` with tables `cos`, `sin`
/// `[t, hd]`, returned head-major: `[b, heads, t, hd]`. The CubeCL kernel on CubeCL devices,
/// the CPU kernel on flex, the composed ops where neither covers the tensors.
pub fn rope(x: Tensor<3>, cos: Tensor<2>, sin: Tensor<2>, heads: usize) -> Tensor<4> {
    match coverage::route(&x, &[cos.dtype(), sin.dtype()]) {
        #[cfg(feature = "cube")]
        Route::Device(_) => cube::rope(x, cos, sin, heads),
        Route::Host => cpu::rope(x, cos, sin, heads),
        Route::Composed => composed::rope(x, cos, sin, heads),
    }
}

/// The kernel against [`composed`] on `device`: batch 2, 5 positions, 3 heads of 8.
pub fn check(device: &Device, dtype: FloatDType) -> Vec<Check> {
    let (b, t, heads, hd) = (2, 5, 3, 8);
    compare(device, dtype, "rope".into(), &["y", "dx"], |r| {
        let x = r.leaf([b, t, heads * hd], 5);
        let angles = |f: fn(f32) -> f32| {
            let v: Vec<f32> = (0..t * hd)
                .map(|i| f((i / hd) as f32 * 0.3 / (1 + i % (hd / 2)) as f32))
                .collect();
            let data = TensorData::new(v, [t, hd]);
            Tensor::<2>::from_data(data, &x.device()).cast(r.compute_dtype())
        };
        let (cos, sin) = (angles(f32::cos), angles(f32::sin));
        let y = match r.fused {
            true => rope(x.clone(), cos, sin, heads),
            false => composed::rope(x.clone(), cos, sin, heads),
        };
        values_and_grads(r, y, &[grad_of(&x)])
    })
}

#[cfg(test)]
mod tests {
    use crate::kernels::tests::{against_composed, random};
    use burn::tensor::{Device, Tensor, TensorData};

    #[test]
    fn rope_matches_composed() {
        let (b, t, heads, hd) = (2, 7, 3, 8);
        let x = random(b * t * heads * hd, 5, 1.0);
        let cos = random(t * hd, 6, 1.0);
        let sin = random(t * hd, 7, 1.0);
        let tables = |d: &Device| {
            (
                Tensor::<2>::from_data(TensorData::new(cos.clone(), [t, hd]), d),
                Tensor::<2>::from_data(TensorData::new(sin.clone(), [t, hd]), d),
            )
        };
        against_composed::<1, 3>(
            [(&x, vec![b, t, heads * hd])],
            |v| {
                let (c, s) = tables(&v[0].device());
                super::rope(v[0].clone(), c, s, heads).reshape([b, heads, t * hd])
            },
            |v| {
                let (c, s) = tables(&v[0].device());
                super::composed::rope(v[0].clone(), c, s, heads).reshape([b, heads, t * hd])
            },
            0.0,
        );
    }
}

//! The projection without bias, `x @ w`, and mixed precision's projection (`x @ w` in the
//! compute dtype, written in another): the model's every matrix product with a weight but the
//! output head's. A CPU kernel ([`cpu`]) and a CubeCL op ([`cube`]), each forward and
//! backward, checked against burn's `linear` ([`check`]).

mod cpu;
#[cfg(feature = "cube")]
mod cube;

use super::check::{Check, compare, grad_of, values_and_grads};
use super::coverage;
use burn::tensor::{DType, Device, FloatDType, Tensor};

/// `x @ w (+ bias)`, as burn's `linear` (`w` is `[in, out]`): the bias-free case on CubeCL
/// devices by the CubeCL op (whatever `training.fused_kernels` says: it is there for exact
/// bits, not speed), on flex by the CPU kernel; burn's `linear` otherwise.
pub fn linear<const D: usize>(x: Tensor<D>, w: Tensor<2>, bias: Option<Tensor<1>>) -> Tensor<D> {
    #[cfg(feature = "cube")]
    if bias.is_none() && coverage::on_cube_device(&x.device()) && x.dtype() == w.dtype() {
        return cube::linear(x, w);
    }
    if bias.is_some() || !coverage::fusable(&x) || !coverage::fusable(&w) {
        return burn::tensor::module::linear(x, w, bias);
    }
    cpu::linear(x, w)
}

/// Mixed precision's projection: `x @ w` with both in the compute dtype `compute`, the result
/// in `out`. On CubeCL devices one op (the casts inside it, the product written in `out` by
/// the device's BLAS where it can); elsewhere the casts around [`linear`]. With `compute` f32
/// and `out` f32 it is [`linear`].
pub fn mixed_linear<const D: usize>(
    x: Tensor<D>,
    w: Tensor<2>,
    compute: DType,
    out: DType,
) -> Tensor<D> {
    #[cfg(feature = "cube")]
    if coverage::on_cube_device(&x.device()) {
        return cube::mixed_linear(x, w, compute, out);
    }
    let compute_float = FloatDType::from(compute);
    linear(x.cast(compute_float), w.cast(compute_float), None).cast(FloatDType::from(out))
}

/// [`linear`] against burn's `linear` on `device`: 74 rows of 70 into 45 (partial tiles every
/// way), and 3 rows of 9 into 130 (a sequence of one; more outputs than a cube's 128 units).
pub fn check(device: &Device, dtype: FloatDType) -> Vec<Check> {
    [([2, 37, 70], 45, 31), ([3, 1, 9], 130, 32)]
        .into_iter()
        .flat_map(|(shape, out, seed)| {
            let name = format!("linear {shape:?} x {out}");
            compare(device, dtype, name, &["y", "dx", "dw"], |r| {
                let (x, w) = (r.leaf(shape, seed), r.leaf([shape[2], out], seed + 10));
                let y = match r.fused {
                    true => linear(x.clone(), w.clone(), None),
                    false => burn::tensor::module::linear(x.clone(), w.clone(), None),
                };
                values_and_grads(r, y, &[grad_of(&x), grad_of(&w)])
            })
        })
        .collect()
}

/// [`mixed_linear`] against burn's `linear` at [`check`]'s shapes: `x` and `w` in f32 (master
/// weights, the residual stream) holding values of the check's type, the product in that type
/// written in f32, the gradients in f32.
pub fn check_mixed(device: &Device, dtype: FloatDType) -> Vec<Check> {
    [([2, 37, 70], 45, 33), ([3, 1, 9], 130, 34)]
        .into_iter()
        .flat_map(|(shape, out, seed)| {
            let name = format!("mixed_linear {shape:?} x {out}");
            compare(device, dtype, name, &["y", "dx", "dw"], |r| {
                let x = r.input(shape, seed).cast(FloatDType::F32);
                let w = r.input([shape[2], out], seed + 10).cast(FloatDType::F32);
                let (x, w) = (x.detach().require_grad(), w.detach().require_grad());
                let y = match r.fused {
                    true => mixed_linear(x.clone(), w.clone(), r.dtype.into(), DType::F32),
                    false => burn::tensor::module::linear(x.clone(), w.clone(), None),
                };
                values_and_grads(r, y, &[grad_of(&x), grad_of(&w)])
            })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use crate::kernels::tests::{against_composed, random};
    use burn::tensor::Tensor;

    #[test]
    fn linear_matches_burn() {
        // a 3-D input (rows are flattened), the weight also as a transposed view
        let x = random(3 * 41 * 24, 16, 1.0);
        let w = random(24 * 37, 17, 1.0);
        for transposed in [false, true] {
            let weight = move |t: &Tensor<3>| {
                if transposed {
                    t.clone().reshape([37, 24]).transpose()
                } else {
                    t.clone().reshape([24, 37])
                }
            };
            against_composed::<2, 3>(
                [(&x, vec![3, 41, 24]), (&w, vec![1, 1, 24 * 37])],
                |t| super::linear(t[0].clone(), weight(&t[1]), None),
                |t| burn::tensor::module::linear(t[0].clone(), weight(&t[1]), None),
                2e-6,
            );
        }
    }
}

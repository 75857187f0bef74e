//! The causal softmax from burn's ops: the reference the kernel is checked against, and the
//! path where it does not cover the tensors.

use burn::tensor::activation::softmax;
use burn::tensor::{Tensor, TensorData};

/// The causal softmax from burn's ops: the scaled scores plus a mask of `-inf` past each
/// row's position.
pub fn causal_softmax(scores: Tensor<4>, scale: f64) -> Tensor<4> {
    let [_, _, rows, t] = scores.dims();
    let mut mask = Vec::with_capacity(rows * t);
    for r in 0..rows {
        let qpos = r % t;
        mask.extend((0..t).map(|k| if k <= qpos { 0.0f32 } else { f32::NEG_INFINITY }));
    }
    let mask = Tensor::from_data(TensorData::new(mask, [1, 1, rows, t]), &scores.device());
    softmax(scores.mul_scalar(scale) + mask, 3)
}

//! Causal attention from burn's ops: the reference the kernels are checked against, and the
//! path where no kernel covers the tensors.

use crate::kernels::softmax::composed::causal_softmax;
use burn::tensor::Tensor;

/// Causal attention from burn's ops: the scores, [`causal_softmax`], the product with `v`.
pub fn causal_attention(q: Tensor<4>, k: Tensor<4>, v: Tensor<3>, scale: f64) -> Tensor<3> {
    let [b, nkv, gt, hd] = q.dims();
    let t = k.dims()[2];
    let heads = nkv * (gt / t);
    let v = v.reshape([b, t, nkv, hd]).swap_dims(1, 2);
    let probs = causal_softmax(q.matmul(k.transpose()), scale);
    probs
        .matmul(v)
        .reshape([b, heads, t, hd])
        .swap_dims(1, 2)
        .reshape([b, t, heads * hd])
}

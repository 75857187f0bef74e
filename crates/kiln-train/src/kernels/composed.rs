//! The fused kernels' functions composed from burn tensor ops: the reference the kernels are
//! tested against (values and gradients), and the path on devices and dtypes the kernels do
//! not cover.

use burn::tensor::activation::{log_softmax, silu, softmax};
use burn::tensor::module::linear;
use burn::tensor::{Int, Tensor, TensorData};

/// RMSNorm over the last dimension, in f32: x / sqrt(mean(x^2) + eps) * w.
pub fn rms_norm<const D: usize>(x: Tensor<D>, w: Tensor<1>, eps: f64) -> Tensor<D> {
    let inv_rms = x
        .clone()
        .powi_scalar(2)
        .mean_dim(D - 1)
        .add_scalar(eps)
        .sqrt()
        .recip();
    x * inv_rms * w.unsqueeze()
}

/// `silu(gate) * up`.
pub fn swiglu<const D: usize>(gate: Tensor<D>, up: Tensor<D>) -> Tensor<D> {
    silu(gate) * up
}

/// Rotate-half RoPE of `x` `[b, t, heads * hd]` (tables `[t, hd]`), as `[b, heads, t, hd]`:
/// x * cos + rotate_half(x) * sin, with rotate_half(x) = cat(-x2, x1).
pub fn rope(x: Tensor<3>, cos: Tensor<2>, sin: Tensor<2>, heads: usize) -> Tensor<4> {
    let [b, t, cols] = x.dims();
    let hd = cols / heads;
    let half = hd / 2;
    let x = x.reshape([b, t, heads, hd]).swap_dims(1, 2);
    let x1 = x.clone().narrow(3, 0, half);
    let x2 = x.clone().narrow(3, half, half);
    let rotated = Tensor::cat(vec![x2.neg(), x1], 3);
    x * cos.reshape([1, 1, t, hd]) + rotated * sin.reshape([1, 1, t, hd])
}

/// Softmax of `scores * scale` over the last dimension `t`, with row `r` masked to columns
/// `0..=r % t`.
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

/// Causal grouped-query attention: `q` `[b, kv, groups * t, hd]`, `k` `[b, kv, t, hd]`,
/// `v` `[b, t, kv * hd]`, returned as `[b, t, heads * hd]`.
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

/// Mean cross-entropy of the logits `h @ w` against `targets`, as a one-element tensor.
pub fn linear_cross_entropy(h: Tensor<2>, w: Tensor<2>, targets: Tensor<1, Int>) -> Tensor<1> {
    let [n, _] = h.dims();
    let logp = log_softmax(linear(h, w, None), 1);
    logp.gather(1, targets.reshape([n, 1])).mean().neg()
}

//! RoPE from burn's ops: the reference the kernels are checked against, and the path where no
//! kernel covers the tensors.

use burn::tensor::Tensor;

/// RoPE from burn's ops: `x * cos + rotate_half(x) * sin`, with `rotate_half(x) = cat(-x2,
/// x1)`.
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

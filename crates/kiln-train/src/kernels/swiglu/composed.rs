//! SwiGLU's gate from burn's ops: the reference the kernels are checked against, and the path
//! where no kernel covers the tensors.

use burn::tensor::Tensor;
use burn::tensor::activation::silu;

/// `silu(gate) * up` from burn's ops.
pub fn swiglu<const D: usize>(gate: Tensor<D>, up: Tensor<D>) -> Tensor<D> {
    silu(gate) * up
}

//! SwiGLU's gate `silu(gate) * up` on flex, forward and backward, one pass each.
//!
//! Composed, it is a sigmoid, two multiplies and their backward ops: five full passes
//! over `[tokens, ffn_hidden]` forward, about eight backward, each allocating.
//!
//! Upstream: burn's autodiff would need `silu` as one op with its own backward (it is
//! composed as `x * sigmoid(x)` in burn-tensor) and a fused gated-linear-unit op, plus
//! multithreaded flex element-wise kernels.

use crate::kernels::host::math::sigmoid;
use crate::kernels::host::tensors::{contiguous, dims, tensor, values, written};
use burn::backend::autodiff::checkpoint::{base::Checkpointer, strategy::CheckpointStrategy};
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn::backend::flex::FlexTensor;
use burn::backend::tensor::FloatTensor;
use burn::backend::{Autodiff, Backend, Dispatch, Flex, backend_extension};
use burn::tensor::Tensor;
use multiversion::multiversion;
use rayon::prelude::*;
use std::mem::MaybeUninit;

/// Elements per block of work.
const BLOCK: usize = 1 << 14;

fn forward(gate: &FlexTensor, up: &FlexTensor) -> FlexTensor {
    let (g, u) = (contiguous(gate), contiguous(up));
    let (gs, us) = (values(&g), values(&u));
    assert_eq!(gs.len(), us.len(), "swiglu: gate and up differ in size");
    // Written whole: the blocks tile `y` and each writes every element of its block.
    let (y, ()) = written(gs.len(), |y| {
        y.par_chunks_mut(BLOCK).enumerate().for_each(|(b, yb)| {
            let at = b * BLOCK;
            forward_block(&gs[at..][..yb.len()], &us[at..][..yb.len()], yb);
        })
    });
    tensor(y, dims(&g))
}

#[multiversion(targets("x86_64+avx512f+avx512vl+avx512dq+avx512bw", "x86_64+avx2+fma"))]
fn forward_block(g: &[f32], u: &[f32], y: &mut [MaybeUninit<f32>]) {
    for ((y, &g), &u) in y.iter_mut().zip(g).zip(u) {
        y.write(g * sigmoid(g) * u);
    }
}

/// `(d gate, d up)`.
fn backward(dy: &FlexTensor, gate: &FlexTensor, up: &FlexTensor) -> (FlexTensor, FlexTensor) {
    let dy = contiguous(dy);
    let (dys, gs, us) = (values(&dy), values(gate), values(up));
    // Written whole: the blocks tile both outputs and each writes every element of its block.
    let (dg, (du, ())) = written(gs.len(), |dg| {
        written(gs.len(), |du| {
            dg.par_chunks_mut(BLOCK)
                .zip(du.par_chunks_mut(BLOCK))
                .enumerate()
                .for_each(|(b, (dgb, dub))| {
                    let at = b * BLOCK;
                    let n = dgb.len();
                    backward_block(&dys[at..][..n], &gs[at..][..n], &us[at..][..n], dgb, dub);
                })
        })
    });
    let shape = dims(gate);
    (tensor(dg, shape.clone()), tensor(du, shape))
}

#[multiversion(targets("x86_64+avx512f+avx512vl+avx512dq+avx512bw", "x86_64+avx2+fma"))]
fn backward_block(
    dy: &[f32],
    g: &[f32],
    u: &[f32],
    dg: &mut [MaybeUninit<f32>],
    du: &mut [MaybeUninit<f32>],
) {
    for i in 0..dy.len() {
        let s = sigmoid(g[i]);
        let silu = g[i] * s;
        du[i].write(dy[i] * silu);
        dg[i].write(dy[i] * u[i] * (s * (1.0 + g[i] * (1.0 - s))));
    }
}

/// SwiGLU's gate recorded as one autodiff op.
fn autodiff<C: CheckpointStrategy>(
    gate: FloatTensor<Autodiff<Flex, C>>,
    up: FloatTensor<Autodiff<Flex, C>>,
) -> FloatTensor<Autodiff<Flex, C>> {
    #[derive(Debug)]
    struct SwigluBackward;

    impl Backward<Flex, 2> for SwigluBackward {
        /// `gate`, `up` (contiguous).
        type State = (FlexTensor, FlexTensor);

        fn backward(
            self,
            ops: Ops<Self::State, 2>,
            grads: &mut Gradients,
            _checkpointer: &mut Checkpointer,
        ) {
            let [node_g, node_u] = ops.parents;
            let dy = grads.consume::<Flex>(&ops.node);
            let (g, u) = ops.state;
            let (dg, du) = backward(&dy, &g, &u);
            if let Some(node) = node_g {
                grads.register::<Flex>(node.id, dg);
            }
            if let Some(node) = node_u {
                grads.register::<Flex>(node.id, du);
            }
        }
    }

    match SwigluBackward
        .prepare::<C>([gate.node(), up.node()])
        .compute_bound()
        .stateful()
    {
        OpsKind::Tracked(prep) => {
            let (g, u) = (contiguous(gate.primitive()), contiguous(up.primitive()));
            let y = forward(&g, &u);
            prep.finish((g, u), y)
        }
        OpsKind::UnTracked(prep) => prep.finish(forward(gate.primitive(), up.primitive())),
    }
}

/// SwiGLU's gate as one op on flex (forward) and on autodiff over flex (forward and one
/// backward step), registered through a backend extension so a model mixes it freely with burn's ops.
#[backend_extension(Flex, Autodiff)]
pub trait FlexSwiglu: Backend {
    /// `silu(gate) * up`.
    fn kiln_swiglu(gate: FloatTensor<Self>, up: FloatTensor<Self>) -> FloatTensor<Self>;
}

impl FlexSwiglu for Flex {
    fn kiln_swiglu(gate: FlexTensor, up: FlexTensor) -> FlexTensor {
        forward(&gate, &up)
    }
}

impl<C: CheckpointStrategy> FlexSwiglu for Autodiff<Flex, C> {
    fn kiln_swiglu(gate: FloatTensor<Self>, up: FloatTensor<Self>) -> FloatTensor<Self> {
        autodiff::<C>(gate, up)
    }
}

/// `silu(gate) * up` on flex ([`FlexSwiglu`]).
pub(super) fn swiglu<const D: usize>(gate: Tensor<D>, up: Tensor<D>) -> Tensor<D> {
    Tensor::from_dispatch(Dispatch::kiln_swiglu(
        gate.into_dispatch(),
        up.into_dispatch(),
    ))
}

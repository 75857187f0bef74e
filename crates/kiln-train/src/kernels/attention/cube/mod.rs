//! Causal attention on CubeCL devices, one autodiff op whose forward and backward take the
//! path the chooser picked ([`Path`]; the backward never chooses again): the row kernels
//! ([`rows`]), chunks of query positions by the device's matrix products ([`products`]), or
//! the tiled flash kernels ([`flash`]). All three compute the same function, save the same
//! state (the output and each query row's log-sum-exp) and recompute the probabilities in the
//! backward, so attention's memory grows linearly with the sequence.

pub(in crate::kernels) mod flash;
mod layout;
mod products;
mod rows;

use crate::config::FlashTiling;
use crate::kernels::device::tensors::dense;
use burn::backend::autodiff::checkpoint::{base::Checkpointer, strategy::CheckpointStrategy};
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn::backend::tensor::FloatTensor;
use burn::backend::{Autodiff, Backend, Dispatch, backend_extension};
use burn::tensor::{DType, Tensor};
use burn_cubecl::CubeBackend;
use burn_cubecl::tensor::CubeTensor;
use flash::tiles::Tiling;

/// How attention runs on a CubeCL device.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(in crate::kernels) enum Path {
    /// The row kernels, `block` query rows a cube.
    Rows { block: usize },
    /// By products, `chunk` query positions a chunk (0: as many as memory allows).
    Products { chunk: usize },
    /// The flash kernels in these tilings (forward, `dq`, `dk`/`dv`).
    Flash(Box<[Tiling; 3]>),
}

impl Path {
    /// The row kernels on `device`, `rows` query rows a cube (0: the device's: 64 on GPUs, one
    /// on CubeCL's CPU runtime, which runs a cube barrier as a spinning thread per unit).
    pub(in crate::kernels) fn rows(device: &cubecl::Device, rows: usize) -> Self {
        let block = match (rows, device) {
            (0, cubecl::Device::Cpu(_)) => 1,
            (0, _) => rows::GPU_BLOCK,
            (n, _) => n,
        };
        Path::Rows { block }
    }

    /// By products, `chunk` query positions a chunk (0: as many as memory allows).
    pub(in crate::kernels) fn products(chunk: usize) -> Self {
        Path::Products { chunk }
    }

    /// The flash kernels in the tilings `shapes` asks for (`None`: the default), where they
    /// can run: on `device` at head dimension `hd` in `dtype`.
    pub(in crate::kernels) fn flash(
        device: &cubecl::Device,
        dtype: DType,
        hd: usize,
        shapes: Option<FlashTiling>,
    ) -> Option<Self> {
        flash::launch::tilings(device, dtype, hd, shapes).map(|t| Path::Flash(Box::new(t)))
    }
}

/// `(output, log-sum-exp per query row)` by `path`.
fn forward(
    q: CubeTensor,
    k: CubeTensor,
    v: CubeTensor,
    scale: f64,
    path: &Path,
) -> (CubeTensor, CubeTensor) {
    match *path {
        Path::Rows { block } => rows::forward(q, k, v, scale, block),
        Path::Products { chunk } => products::forward(q, k, v, scale, chunk),
        Path::Flash(ref t) => flash::launch::forward(q, k, v, scale, t[0]),
    }
}

/// What the backward keeps: `q`, `k`, `v`, the output and its log-sum-exp (contiguous).
type Saved = (CubeTensor, CubeTensor, CubeTensor, CubeTensor, CubeTensor);

/// `(dq, dk, dv)` for the upstream gradient `dout` by `path`.
fn backward(
    dout: CubeTensor,
    saved: Saved,
    scale: f64,
    path: &Path,
) -> (CubeTensor, CubeTensor, CubeTensor) {
    match *path {
        Path::Rows { block } => rows::backward(dout, saved, scale, block),
        Path::Products { chunk } => products::backward(dout, saved, scale, chunk),
        Path::Flash(ref t) => flash::launch::backward(dout, saved, scale, t[1], t[2]),
    }
}

/// Attention recorded as one autodiff op.
fn autodiff<C: CheckpointStrategy>(
    q: FloatTensor<Autodiff<CubeBackend, C>>,
    k: FloatTensor<Autodiff<CubeBackend, C>>,
    v: FloatTensor<Autodiff<CubeBackend, C>>,
    scale: f64,
    path: Path,
) -> FloatTensor<Autodiff<CubeBackend, C>> {
    #[derive(Debug)]
    struct AttentionBackward;

    impl Backward<CubeBackend, 3> for AttentionBackward {
        type State = (Saved, f64, Path);

        fn backward(self, ops: Ops<Self::State, 3>, grads: &mut Gradients, _: &mut Checkpointer) {
            let [nq, nk, nv] = ops.parents;
            let dout = grads.consume::<CubeBackend>(&ops.node);
            let (saved, scale, path) = ops.state;
            let (dq, dk, dv) = backward(dout, saved, scale, &path);
            for (node, g) in [(nq, dq), (nk, dk), (nv, dv)] {
                if let Some(node) = node {
                    grads.register::<CubeBackend>(node.id, g);
                }
            }
        }
    }

    match AttentionBackward
        .prepare::<C>([q.node(), k.node(), v.node()])
        .compute_bound()
        .stateful()
    {
        OpsKind::Tracked(prep) => {
            let (q, k, v) = (
                dense(q.primitive().clone()),
                dense(k.primitive().clone()),
                dense(v.primitive().clone()),
            );
            let (out, lse) = forward(q.clone(), k.clone(), v.clone(), scale, &path);
            prep.finish(((q, k, v, out.clone(), lse), scale, path), out)
        }
        OpsKind::UnTracked(prep) => prep.finish(
            forward(
                q.primitive().clone(),
                k.primitive().clone(),
                v.primitive().clone(),
                scale,
                &path,
            )
            .0,
        ),
    }
}

/// Causal attention as one op on burn's `Cube` backend (forward) and on autodiff over it
/// (forward and one backward step, by the forward's path), registered through a backend
/// extension.
#[backend_extension(Cube, Autodiff)]
pub trait CubeCausalAttention: Backend {
    /// Causal grouped-query attention by `path`; returns `[b, t, heads * hd]`.
    fn device_causal_attention(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        scale: f64,
        path: Path,
    ) -> FloatTensor<Self>;
}

impl CubeCausalAttention for CubeBackend {
    fn device_causal_attention(
        q: CubeTensor,
        k: CubeTensor,
        v: CubeTensor,
        scale: f64,
        path: Path,
    ) -> CubeTensor {
        forward(q, k, v, scale, &path).0
    }
}

impl<C: CheckpointStrategy> CubeCausalAttention for Autodiff<CubeBackend, C> {
    fn device_causal_attention(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        scale: f64,
        path: Path,
    ) -> FloatTensor<Self> {
        autodiff::<C>(q, k, v, scale, path)
    }
}

/// Causal attention on a CubeCL device by `path` ([`CubeCausalAttention`]).
pub(in crate::kernels) fn causal_attention(
    q: Tensor<4>,
    k: Tensor<4>,
    v: Tensor<3>,
    scale: f64,
    path: Path,
) -> Tensor<3> {
    Tensor::from_dispatch(Dispatch::device_causal_attention(
        q.into_dispatch(),
        k.into_dispatch(),
        v.into_dispatch(),
        scale,
        path,
    ))
}

/// The row kernels (head dimensions 64 and 128) and the products path's kernels in `e`,
/// defined for no device (see [`crate::kernels::device::offline`]); the flash kernels are
/// [`flash::ptx`]'s.
#[cfg(any(feature = "cuda", feature = "rocm"))]
pub(in crate::kernels) fn offline(
    e: cubecl::ir::ElemType,
) -> Vec<(&'static str, Box<dyn cubecl_runtime::kernel::CubeKernel>)> {
    let mut all = Vec::new();
    for (hd, names) in [
        (64, ["rows_forward_hd64", "rows_dq_hd64", "rows_dkv_hd64"]),
        (
            128,
            ["rows_forward_hd128", "rows_dq_hd128", "rows_dkv_hd128"],
        ),
    ] {
        all.extend(
            names
                .into_iter()
                .zip(rows::offline(e, hd))
                .map(|(n, (_, k))| (n, k)),
        );
    }
    all.extend(products::offline(e));
    all
}

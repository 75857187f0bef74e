//! The output head with cross-entropy on CubeCL devices, chunked over the vocabulary: the
//! `[n, vocab]` logits are never whole. Forward: for each chunk of columns, burn's matmul
//! (tensor cores where the device has them) gives that chunk's logits, and a kernel (one cube
//! per row) folds them into the row's running max and sum of exponentials and picks the
//! target's logit; the loss is the mean of `log-sum-exp - target logit`, and the log-sum-exp
//! per row is saved. Backward recomputes each chunk's logits, a kernel (one unit per element)
//! turns them into `(softmax - onehot) * dloss / n`, and two matmuls add that chunk's share
//! of `dh` and give its columns of `dw`.

use crate::kernels::device::matmul::product;
use crate::kernels::device::reduce::{cube_max, cube_sum, launch_rows, row_units};
use crate::kernels::device::tensors::{dense, dims, elem, f32_vector, launch_1d};
use burn::backend::autodiff::checkpoint::{base::Checkpointer, strategy::CheckpointStrategy};
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn::backend::ops::FloatTensorOps;
use burn::backend::tensor::{FloatTensor, IntTensor};
use burn::backend::{Autodiff, Backend, Dispatch, backend_extension};
use burn::backend::{FloatDType, Slice};
use burn_cubecl::CubeBackend;
use burn_cubecl::tensor::CubeTensor;
use cubecl::prelude::*;

/// Logits held at once: at most this many elements a chunk (64 MiB in f32), and never fewer
/// than 128 columns.
const CHUNK_ELEMENTS: usize = 16 << 20;

/// Columns of logits a chunk holds for `n` rows and `vocab` columns.
fn chunk_columns(n: usize, vocab: usize) -> usize {
    (CHUNK_ELEMENTS / n.max(1)).max(128).min(vocab.max(1))
}

/// Folds one chunk of logits `[n, cols]` (columns `first_col..`) into each row's running
/// max `m` and sum `l` (`l = sum exp(logit - m)`), and records the target's logit. One cube a
/// row, its units striding over the columns (coalesced reads), their partial max and sum
/// combined in a fixed tree; with one unit (CubeCL's CPU runtime) the row's columns in order.
#[cube(launch)]
fn fold_kernel<F: Float, I: Numeric>(
    logits: &Tensor<F>,
    targets: &Tensor<I>,
    m: &mut Tensor<f32>,
    l: &mut Tensor<f32>,
    target_logit: &mut Tensor<f32>,
    rows: u32,
    cols: u32,
    first_col: u32,
    #[comptime] units: usize,
    #[define(F, I)] _dtypes: [ElemType; 2],
) {
    let r = CUBE_POS;
    if r >= rows as usize {
        terminate!();
    }
    let (c, u) = (cols as usize, UNIT_POS as usize);
    let base = r * c;
    let mut partial = Shared::<[f32]>::new_slice(units);
    let mut mx = f32::new(-3.0e38);
    let mut j = u;
    while j < c {
        mx = f32::max(mx, f32::cast_from(logits[base + j]));
        j += units;
    }
    let mx = cube_max(&mut partial, mx);
    let mut sum = 0.0f32;
    let mut j = u;
    while j < c {
        sum += (f32::cast_from(logits[base + j]) - mx).exp();
        j += units;
    }
    let sum = cube_sum(&mut partial, sum);
    if u == 0 {
        if first_col == 0 {
            m[r] = mx;
            l[r] = sum;
        } else {
            let m_new = f32::max(m[r], mx);
            l[r] = l[r] * (m[r] - m_new).exp() + sum * (mx - m_new).exp();
            m[r] = m_new;
        }
        let t = u32::cast_from(targets[r]) as usize;
        let start = first_col as usize;
        if t >= start && t < start + c {
            target_logit[r] = f32::cast_from(logits[base + t - start]);
        }
    }
}

/// `lse = m + ln l` (kept for backward) and the row's loss `lse - target logit`.
#[cube(launch)]
fn finish_kernel(
    m: &Tensor<f32>,
    l: &Tensor<f32>,
    target_logit: &Tensor<f32>,
    lse: &mut Tensor<f32>,
    loss: &mut Tensor<f32>,
    rows: u32,
) {
    let r = ABSOLUTE_POS;
    if r >= rows as usize {
        terminate!();
    }
    let v = m[r] + l[r].ln();
    lse[r] = v;
    loss[r] = v - target_logit[r];
}

/// `(softmax - onehot(target)) * dloss / n` for one chunk of logits, in place.
#[cube(launch)]
fn grad_kernel<F: Float, I: Numeric>(
    logits: &mut Tensor<F>,
    targets: &Tensor<I>,
    lse: &Tensor<f32>,
    dloss: &Tensor<F>,
    total: u32,
    cols: u32,
    first_col: u32,
    inv_rows: f32,
    #[define(F, I)] _dtypes: [ElemType; 2],
) {
    let i = ABSOLUTE_POS;
    if i >= total as usize {
        terminate!();
    }
    let c = cols as usize;
    let r = i / c;
    let col = first_col as usize + i % c;
    let mut p = (f32::cast_from(logits[i]) - lse[r]).exp();
    if u32::cast_from(targets[r]) as usize == col {
        p -= 1.0f32;
    }
    logits[i] = F::cast_from(p * f32::cast_from(dloss[0]) * inv_rows);
}

/// Columns `range` of `w` `[d, vocab]`, contiguous.
fn columns(w: &CubeTensor, d: usize, range: std::ops::Range<usize>) -> CubeTensor {
    dense(CubeBackend::float_slice(
        w.clone(),
        &[Slice::from(0..d), Slice::from(range)],
    ))
}

/// The chunks' column ranges.
fn chunks(vocab: usize, cols: usize) -> impl Iterator<Item = std::ops::Range<usize>> {
    (0..vocab)
        .step_by(cols.max(1))
        .map(move |c| c..(c + cols).min(vocab))
}

/// `(mean loss [1] in f32, log-sum-exp per row)` for `h` `[n, d]`, `w` `[d, vocab]`,
/// `targets` `[n]`.
fn forward(
    h: CubeTensor,
    w: CubeTensor,
    targets: CubeTensor,
    cols: usize,
) -> (CubeTensor, CubeTensor) {
    let (h, w, targets) = (dense(h), dense(w), dense(targets));
    let ([n, d], vocab) = ([dims(&h)[0], dims(&h)[1]], dims(&w)[1]);
    let (m, l, picked) = (f32_vector(&h, n), f32_vector(&h, n), f32_vector(&h, n));
    for range in chunks(vocab, cols) {
        let logits = dense(product(h.clone(), columns(&w, d, range.clone())));
        let units = row_units(&logits);
        let (count, dim) = launch_rows(n, units);
        fold_kernel::launch(
            &h.client,
            count,
            dim,
            logits.clone().into_tensor_arg(),
            targets.clone().into_tensor_arg(),
            m.clone().into_tensor_arg(),
            l.clone().into_tensor_arg(),
            picked.clone().into_tensor_arg(),
            n as u32,
            range.len() as u32,
            range.start as u32,
            units,
            [elem(&logits), elem(&targets)],
        );
    }
    let (lse, per_row) = (f32_vector(&h, n), f32_vector(&h, n));
    let (count, dim) = launch_1d(n);
    finish_kernel::launch(
        &h.client,
        count,
        dim,
        m.into_tensor_arg(),
        l.into_tensor_arg(),
        picked.into_tensor_arg(),
        lse.clone().into_tensor_arg(),
        per_row.clone().into_tensor_arg(),
        n as u32,
    );
    // In f32 whatever the inputs' type: a bf16 loss would keep three significant digits.
    (CubeBackend::float_mean(per_row), lse)
}

/// The saved state: `h`, `w`, `targets` (contiguous), log-sum-exp per row, chunk columns.
type Saved = (CubeTensor, CubeTensor, CubeTensor, CubeTensor, usize);

/// `(dh, dw)` for the upstream gradient `dloss` `[1]`.
fn backward(dloss: CubeTensor, saved: Saved) -> (CubeTensor, CubeTensor) {
    let (h, w, targets, lse, cols) = saved;
    let ([n, d], vocab) = ([dims(&h)[0], dims(&h)[1]], dims(&w)[1]);
    let dloss = dense(CubeBackend::float_cast(dloss, FloatDType::from(h.dtype)));
    let mut dh: Option<CubeTensor> = None;
    let mut dw = Vec::new();
    for range in chunks(vocab, cols) {
        let wc = columns(&w, d, range.clone());
        let g = dense(product(h.clone(), wc.clone()));
        let total = n * range.len();
        let (count, dim) = launch_1d(total);
        grad_kernel::launch(
            &h.client,
            count,
            dim,
            g.clone().into_tensor_arg(),
            targets.clone().into_tensor_arg(),
            lse.clone().into_tensor_arg(),
            dloss.clone().into_tensor_arg(),
            total as u32,
            range.len() as u32,
            range.start as u32,
            1.0 / n.max(1) as f32,
            [elem(&g), elem(&targets)],
        );
        let part = product(g.clone(), CubeBackend::float_transpose(wc));
        dh = Some(match dh {
            Some(acc) => CubeBackend::float_add(acc, part),
            None => part,
        });
        dw.push(product(CubeBackend::float_transpose(h.clone()), g));
    }
    let dh = dh.unwrap_or_else(|| CubeBackend::float_mul_scalar(h.clone(), 0.0.into()));
    (dh, CubeBackend::float_cat(dw, 1))
}

/// The head and loss recorded as one autodiff op (the targets take no gradient).
fn autodiff<C: CheckpointStrategy>(
    h: FloatTensor<Autodiff<CubeBackend, C>>,
    w: FloatTensor<Autodiff<CubeBackend, C>>,
    targets: IntTensor<Autodiff<CubeBackend, C>>,
    cols: usize,
) -> FloatTensor<Autodiff<CubeBackend, C>> {
    #[derive(Debug)]
    struct CrossEntropyBackward;

    impl Backward<CubeBackend, 2> for CrossEntropyBackward {
        type State = Saved;

        fn backward(self, ops: Ops<Self::State, 2>, grads: &mut Gradients, _: &mut Checkpointer) {
            let dloss = grads.consume::<CubeBackend>(&ops.node);
            let (dh, dw) = backward(dloss, ops.state);
            for (node, g) in ops.parents.into_iter().zip([dh, dw]) {
                if let Some(node) = node {
                    grads.register::<CubeBackend>(node.id, g);
                }
            }
        }
    }

    match CrossEntropyBackward
        .prepare::<C>([h.node(), w.node()])
        .compute_bound()
        .stateful()
    {
        OpsKind::Tracked(prep) => {
            let (h, w) = (dense(h.primitive().clone()), dense(w.primitive().clone()));
            let targets = dense(targets);
            let (loss, lse) = forward(h.clone(), w.clone(), targets.clone(), cols);
            prep.finish((h, w, targets, lse, cols), loss)
        }
        OpsKind::UnTracked(prep) => {
            prep.finish(forward(h.primitive().clone(), w.primitive().clone(), targets, cols).0)
        }
    }
}

/// The output head with cross-entropy as one op on burn's `Cube` backend (forward) and on
/// autodiff over it (forward and one backward step), registered through a backend extension.
#[backend_extension(Cube, Autodiff)]
pub trait CubeLinearCrossEntropy: Backend {
    /// Mean cross-entropy of `h @ w` against `targets`, `columns` logits columns at a time.
    fn device_linear_cross_entropy(
        h: FloatTensor<Self>,
        w: FloatTensor<Self>,
        targets: IntTensor<Self>,
        columns: usize,
    ) -> FloatTensor<Self>;
}

impl CubeLinearCrossEntropy for CubeBackend {
    fn device_linear_cross_entropy(
        h: CubeTensor,
        w: CubeTensor,
        targets: CubeTensor,
        columns: usize,
    ) -> CubeTensor {
        forward(h, w, targets, columns).0
    }
}

impl<C: CheckpointStrategy> CubeLinearCrossEntropy for Autodiff<CubeBackend, C> {
    fn device_linear_cross_entropy(
        h: FloatTensor<Self>,
        w: FloatTensor<Self>,
        targets: IntTensor<Self>,
        columns: usize,
    ) -> FloatTensor<Self> {
        autodiff::<C>(h, w, targets, columns)
    }
}

/// Mean cross-entropy of `h @ w` against `targets` on a CubeCL device
/// ([`CubeLinearCrossEntropy`]), at most `columns` logits columns live at once (`None`: as
/// many as [`chunk_columns`] allows).
pub(super) fn linear_cross_entropy(
    h: burn::tensor::Tensor<2>,
    w: burn::tensor::Tensor<2>,
    targets: burn::tensor::Tensor<1, burn::tensor::Int>,
    columns: Option<usize>,
) -> burn::tensor::Tensor<1> {
    let (n, vocab) = (h.dims()[0], w.dims()[1]);
    let columns = columns.unwrap_or_else(|| chunk_columns(n, vocab));
    burn::tensor::Tensor::from_dispatch(Dispatch::device_linear_cross_entropy(
        h.into_dispatch(),
        w.into_dispatch(),
        targets.into_dispatch(),
        columns.max(1),
    ))
}

/// The kernels in `e` (targets in i32), defined for no device (see
/// [`crate::kernels::device::offline`]): a row's cube of 256 units.
#[cfg(any(feature = "cuda", feature = "rocm"))]
pub(in crate::kernels) fn offline(
    e: ElemType,
) -> Vec<(&'static str, Box<dyn cubecl_runtime::kernel::CubeKernel>)> {
    use crate::kernels::device::offline::{props, settings, tensor};
    let (p, t) = props(None);
    let units = 256;
    let i = ElemType::Int(cubecl::ir::IntKind::I32);
    vec![
        (
            "fold",
            Box::new(fold_kernel::FoldKernel::new(
                settings(units),
                p.clone(),
                t.clone(),
                tensor(),
                tensor(),
                tensor(),
                tensor(),
                tensor(),
                (),
                (),
                (),
                units,
                [e, i],
            )),
        ),
        (
            "finish",
            Box::new(finish_kernel::FinishKernel::new(
                settings(units),
                p.clone(),
                t.clone(),
                tensor(),
                tensor(),
                tensor(),
                tensor(),
                tensor(),
                (),
            )),
        ),
        (
            "grad",
            Box::new(grad_kernel::GradKernel::new(
                settings(units),
                p,
                t,
                tensor(),
                tensor(),
                tensor(),
                tensor(),
                (),
                (),
                (),
                (),
                [e, i],
            )),
        ),
    ]
}

//! Gradient clipping and the AdamW update on flex as one multithreaded pass over each
//! parameter, in place where the parameter and moment buffers are not shared.
//!
//! Composed from burn ops (see `optim::AdamW::update_composed`) the update is eleven
//! element-wise ops per parameter plus one for clipping, each a single-threaded pass on flex
//! that allocates its output: 12 passes over every parameter. Here it is one pass reading
//! `p`, `g`, `m`, `v` and writing `p`, `m`, `v`.
//!
//! Bits: flex's scalar ops round their f64 scalar to f32 and then do one f32 operation, and
//! this pass does the same operations on the same f32 scalars in the same order (no fused
//! multiply-add), so it is bit-identical to the composed update (the tests check it) and the
//! smoke baseline does not move.
//!
//! Upstream: burn would need a fused optimizer step (PyTorch's `foreach`/`fused` AdamW) or
//! multithreaded, in-place flex element-wise ops for this to go away.

use crate::kernels::coverage::fusable;
use crate::kernels::host::tensors::{contiguous, tensor, values};
use burn::backend::Flex;
use burn::backend::flex::FlexTensor;
use burn::tensor::Tensor;
use rayon::prelude::*;

/// Elements per block of work (a multiple of every SIMD width).
const BLOCK: usize = 1 << 14;

/// The f32 scalars of one update, each rounded from f64 exactly as flex rounds a scalar
/// operand.
#[derive(Debug, Clone, Copy)]
pub struct AdamWScalars {
    /// Clipping coefficient applied to the gradient first (None: no clipping this step).
    pub grad_scale: Option<f32>,
    /// beta1 and 1 - beta1.
    pub b1: (f32, f32),
    /// beta2 and 1 - beta2.
    pub b2: (f32, f32),
    /// Decoupled weight decay factor `1 - lr * wd` (None: no decay for this parameter).
    pub decay: Option<f32>,
    /// sqrt(1 - beta2^step).
    pub bc2_sqrt: f32,
    /// Adam's eps.
    pub eps: f32,
    /// lr / (1 - beta1^step).
    pub step_size: f32,
}

/// One update of `p` with gradient `g` and moments `m`, `v`, element by element.
fn update_block(p: &mut [f32], g: &[f32], m: &mut [f32], v: &mut [f32], s: &AdamWScalars) {
    let (b1, omb1) = s.b1;
    let (b2, omb2) = s.b2;
    for i in 0..p.len() {
        let g = match s.grad_scale {
            Some(c) => g[i] * c,
            None => g[i],
        };
        let mi = m[i] * b1 + g * omb1;
        let vi = v[i] * b2 + (g * g) * omb2;
        let pi = match s.decay {
            Some(d) => p[i] * d,
            None => p[i],
        };
        let denom = vi.sqrt() / s.bc2_sqrt + s.eps;
        p[i] = pi - (mi / denom) * s.step_size;
        m[i] = mi;
        v[i] = vi;
    }
}

/// The update over whole slices, in blocks on the rayon pool (element-wise, so the bits do
/// not depend on the split).
fn update_slices(p: &mut [f32], g: &[f32], m: &mut [f32], v: &mut [f32], s: &AdamWScalars) {
    assert!(
        g.len() == p.len() && m.len() == p.len() && v.len() == p.len(),
        "adamw: parameter, gradient and moments differ in size"
    );
    p.par_chunks_mut(BLOCK)
        .zip(m.par_chunks_mut(BLOCK))
        .zip(v.par_chunks_mut(BLOCK))
        .zip(g.par_chunks(BLOCK))
        .for_each(|(((p, m), v), g)| update_block(p, g, m, v, s));
}

/// `t` as a flex tensor whose storage this function may write: the same buffer when it is
/// contiguous from offset 0 and not shared (a clone held elsewhere, e.g. a guard snapshot,
/// must keep its values), a fresh copy otherwise.
fn owned(t: FlexTensor) -> FlexTensor {
    let whole = t.layout().num_elements();
    let mut t = match t.layout().contiguous_offsets() {
        Some((0, end)) if end == whole && t.is_unique() => t,
        _ => tensor(values(&contiguous(&t)).to_vec(), t.layout().shape().clone()),
    };
    if t.try_storage_mut::<f32>().is_none() {
        t = tensor(
            t.storage::<f32>()[..whole].to_vec(),
            t.layout().shape().clone(),
        );
    }
    t
}

/// A fused update's outcome: `(p, m, v)` after the step, or `(p, g, m, v)` handed back
/// untouched for the composed path.
pub type Fused =
    Result<(Tensor<1>, Tensor<1>, Tensor<1>), Box<(Tensor<1>, Tensor<1>, Tensor<1>, Tensor<1>)>>;

/// The fused update of one parameter on flex, when the kernels cover its tensors (f32, not
/// tracked by autodiff); `Err` hands the tensors back. [`super::adamw_update`] chooses it.
pub fn update(p: Tensor<1>, g: Tensor<1>, m: Tensor<1>, v: Tensor<1>, s: &AdamWScalars) -> Fused {
    // A tensor tracked by autodiff (or on another backend) does not convert to a flex
    // primitive; the probe converts a clone, dropped at once, so uniqueness is unaffected.
    let covered = [&p, &g, &m, &v].into_iter().all(|t| {
        fusable(t) && t.dims() == p.dims() && (*t).clone().try_into_primitive::<Flex>().is_ok()
    });
    if !covered {
        return Err(Box::new((p, g, m, v)));
    }
    let prim = |t: Tensor<1>| {
        t.try_into_primitive::<Flex>()
            .expect("adamw: flex tensor checked by fusable")
    };
    let (mut p, g, mut m, mut v) = (owned(prim(p)), prim(g), owned(prim(m)), owned(prim(v)));
    let g = contiguous(&g);
    let gs = values(&g);
    let n = gs.len();
    // `owned` made each buffer unique, contiguous from offset 0 and writable.
    let ps = &mut p.storage_mut::<f32>()[..n];
    let ms = &mut m.storage_mut::<f32>()[..n];
    let vs = &mut v.storage_mut::<f32>()[..n];
    update_slices(ps, gs, ms, vs, s);
    Ok((
        Tensor::from_primitive::<Flex>(p),
        Tensor::from_primitive::<Flex>(m),
        Tensor::from_primitive::<Flex>(v),
    ))
}

//! Mano (Gu & Xie 2026, "Mano: Restriking Manifold Optimization for LLM Training"), with the
//! arithmetic of the authors' `mano.py` (the paper's version): heavy-ball momentum on each
//! 2-D hidden matrix, projected onto the tangent space of the rows' or columns' unit sphere at
//! the weights and normalised along the same axis (a rotating Oblique manifold: columns at
//! even updates, rows at odd ones, in PyTorch's `[out, in]` orientation), then
//!
//! ```text
//! b <- mu b + g;  m = g + mu b (nesterov) or b;  k = t mod 2
//! P = W / max(|W|_k, eps);  T = m - <m, P>_k P;  U = T / max(|T|_k, eps)
//! W <- W (1 - lr wd) - lr 0.2 sqrt(n_k) U        n_k: the size of axis k
//! ```
//!
//! with no Newton-Schulz (`O(mn)` work a matrix). Embeddings, norm weights and the head get
//! AdamW, as under Muon ([`super::role`]). The projection and the norms need each matrix
//! whole: in a sharded run its owner rank computes them ([`Wholes`]).

use super::adamw::AdamW;
use super::{HiddenSplit, StateSlot, StateSlotMut, Wholes};
use crate::config::{ManoConfig, OptimizerConfig};
use crate::model::ParamSpec;
use burn::tensor::{Device, Tensor};
use std::ops::Range;

/// State suffix of the momentum buffer (the authors' name).
pub const MOMENTUM_BUFFER: &str = "momentum_buffer";

/// Mano state: a momentum buffer per hidden matrix, and AdamW for the other parameters.
#[derive(Debug, Clone)]
pub struct Mano {
    cfg: ManoConfig,
    eps: f64,
    weight_decay: f64,
    decay: Vec<bool>,
    /// `[in, out]` of each hidden matrix, `None` for the AdamW parameters.
    shapes: Vec<Option<[usize; 2]>>,
    /// Momentum buffers of the hidden matrices.
    pub momentum: Vec<Option<Tensor<1>>>,
    /// The AdamW of the embeddings, norms and output head (it also counts the steps).
    pub adam: AdamW,
}

/// The update direction `U` of a hidden matrix from its momentum step `m` and weights `w`
/// (flat, kiln's `[inp, out]` layout), along axis `k` of PyTorch's `[out, in]` orientation.
fn direction(m: Tensor<1>, w: Tensor<1>, [inp, out]: [usize; 2], k: usize, eps: f64) -> Tensor<1> {
    let torch = |t: Tensor<1>| t.reshape([inp, out]).transpose();
    let (m, w) = (torch(m), torch(w));
    let norm = |t: &Tensor<2>| t.clone().powi_scalar(2).sum_dim(k).sqrt().clamp_min(eps);
    let unit = w.clone() / norm(&w);
    let tangent = m.clone() - (m * unit.clone()).sum_dim(k) * unit;
    let u = tangent.clone() / norm(&tangent);
    u.transpose().reshape([inp * out])
}

impl Mano {
    /// Zero state as long as each of `ranges` (`None`: none for that parameter).
    pub(crate) fn zeroed(
        cfg: &OptimizerConfig,
        specs: &[ParamSpec],
        device: &Device,
        ranges: &[Option<Range<usize>>],
    ) -> Self {
        let split = HiddenSplit::new(cfg, specs, device, ranges);
        Self {
            cfg: cfg.mano.clone(),
            eps: cfg.eps,
            weight_decay: cfg.weight_decay,
            decay: specs.iter().map(|s| super::adamw::decays(cfg, s)).collect(),
            shapes: split.shapes,
            momentum: split.momentum,
            adam: split.adam,
        }
    }

    /// One update: Mano for the hidden matrices, AdamW (one step count) for the rest.
    pub fn update(
        &mut self,
        params: &mut [Tensor<1>],
        grads: Vec<Tensor<1>>,
        lr: f64,
        frozen: &[bool],
        wholes: &dyn Wholes,
    ) {
        let (mu, k) = (self.cfg.momentum, (self.adam.step % 2) as usize);
        let mut bufs = vec![None; grads.len()];
        let mut inputs = vec![None; grads.len()];
        for (i, g) in grads.iter().enumerate() {
            if self.shapes[i].is_none() || frozen.get(i).copied().unwrap_or(false) {
                continue;
            }
            // A rank holding none of this matrix still takes part in its update's direction.
            let Some(buf) = &self.momentum[i] else {
                let empty = Tensor::empty([0], &g.device());
                inputs[i] = Some(vec![empty.clone(), empty]);
                continue;
            };
            let buf = buf.clone().mul_scalar(mu) + g.clone();
            let m = match self.cfg.nesterov {
                true => g.clone() + buf.clone().mul_scalar(mu),
                false => buf.clone(),
            };
            inputs[i] = Some(vec![m, params[i].clone()]);
            bufs[i] = Some(buf);
        }
        let (shapes, eps) = (&self.shapes, self.eps);
        let directions = wholes.map_whole(inputs, &|i, mut mw| {
            let w = mw.pop().expect("weights");
            let m = mw.pop().expect("momentum");
            let shape = shapes[i].unwrap_or([m.dims()[0], 1]);
            direction(m, w, shape, k, eps)
        });
        for (i, (u, buf)) in directions.into_iter().zip(bufs).enumerate() {
            let (Some(u), Some(buf), Some([inp, out])) = (u, buf, self.shapes[i]) else {
                continue;
            };
            let mut p = params[i].clone();
            if self.decay[i] && self.weight_decay != 0.0 {
                p = p.mul_scalar(1.0 - lr * self.weight_decay);
            }
            // n_k of PyTorch's [out, in]: out along axis 0, in along axis 1.
            let n = [out, inp][k] as f64;
            params[i] = p - u.mul_scalar(lr * 0.2 * n.sqrt());
            self.momentum[i] = Some(buf);
        }
        self.adam.update(params, grads, lr, frozen);
    }

    pub(crate) fn slots(&self) -> Vec<StateSlot<'_>> {
        let mut s = vec![(MOMENTUM_BUFFER, &self.momentum)];
        s.extend(self.adam.slots());
        s
    }

    pub(crate) fn slots_mut(&mut self) -> Vec<StateSlotMut<'_>> {
        let mut s = vec![(MOMENTUM_BUFFER, &mut self.momentum)];
        s.extend(self.adam.slots_mut());
        s
    }
}

//! SophiaG (Liu et al. 2023, "Sophia: A Scalable Stochastic Second-order Optimizer for
//! Language Model Pre-training"), with the arithmetic of the authors' `sophia.py`:
//!
//! ```text
//! p <- p (1 - lr wd)                                  (decayed parameters)
//! m <- beta1 m + (1 - beta1) g
//! p <- p - lr sign(m) min(|m| / (rho * B * h + 1e-15), 1)      B = tokens per step
//! ```
//!
//! and every k steps (`sophia.hessian_interval`), after the update, the Gauss-Newton-Bartlett
//! estimate: `h <- beta2 h + (1 - beta2) g_hat^2`, with `g_hat` the gradient of the mean
//! loss against labels sampled from the model's own predictions (the trainer computes it,
//! [`crate::step::Step`] with sampled labels). `B * g_hat^2` estimates the diagonal
//! of the Gauss-Newton matrix; the authors fold the `B` into the update, as here.

use super::{StateSlot, StateSlotMut, zeros};
use crate::config::{OptimizerConfig, SophiaConfig};
use crate::model::ParamSpec;
use burn::tensor::{Device, Tensor};
use std::ops::Range;

/// State suffix of the momentum (the authors' name).
pub const EXP_AVG: &str = "exp_avg";
/// State suffix of the diagonal Hessian EMA (the authors' name).
pub const HESSIAN: &str = "hessian";
/// The authors' floor of the denominator.
const DENOM_EPS: f64 = 1e-15;

/// SophiaG state: momentum and Hessian EMA per parameter, and the step count.
#[derive(Debug, Clone)]
pub struct SophiaG {
    cfg: SophiaConfig,
    beta1: f64,
    beta2: f64,
    weight_decay: f64,
    decay: Vec<bool>,
    tokens_per_step: f64,
    /// Momentum (exp_avg), in parameter order.
    pub exp_avg: Vec<Option<Tensor<1>>>,
    /// Diagonal Hessian EMA, in parameter order.
    pub hessian: Vec<Option<Tensor<1>>>,
    /// Updates applied.
    pub step: u64,
}

impl SophiaG {
    /// Zero state as long as each of `ranges` (`None`: none for that parameter; a rank's
    /// shard of a sharded run keeps a range of each). Every operation is element-wise, so a
    /// range updates exactly as the same elements of a whole parameter would.
    pub(crate) fn zeroed(
        cfg: &OptimizerConfig,
        specs: &[ParamSpec],
        device: &Device,
        tokens_per_step: u64,
        ranges: &[Option<Range<usize>>],
    ) -> Self {
        Self {
            cfg: cfg.sophia.clone(),
            beta1: cfg.beta1,
            beta2: cfg.beta2,
            weight_decay: cfg.weight_decay,
            decay: specs.iter().map(|s| super::adamw::decays(cfg, s)).collect(),
            tokens_per_step: tokens_per_step.max(1) as f64,
            exp_avg: zeros(ranges, device),
            hessian: zeros(ranges, device),
            step: 0,
        }
    }

    /// One clipped, Hessian-preconditioned update of every parameter not `frozen`.
    pub fn update(
        &mut self,
        params: &mut [Tensor<1>],
        grads: Vec<Tensor<1>>,
        lr: f64,
        frozen: &[bool],
    ) {
        self.step += 1;
        let scale = self.cfg.rho * self.tokens_per_step;
        for (i, g) in grads.into_iter().enumerate() {
            if frozen.get(i).copied().unwrap_or(false) {
                continue;
            }
            let (Some(m), Some(h)) = (&self.exp_avg[i], &self.hessian[i]) else {
                continue;
            };
            let mut p = params[i].clone();
            if self.decay[i] && self.weight_decay != 0.0 {
                p = p.mul_scalar(1.0 - lr * self.weight_decay);
            }
            let m = m.clone().mul_scalar(self.beta1) + g.mul_scalar(1.0 - self.beta1);
            let ratio = (m.clone().abs() / h.clone().mul_scalar(scale).add_scalar(DENOM_EPS))
                .clamp_max(1.0);
            params[i] = p - (m.clone().sign() * ratio).mul_scalar(lr);
            self.exp_avg[i] = Some(m);
        }
    }

    /// Whether a Hessian estimate is due after the update just applied (after every k-th).
    pub fn hessian_due(&self) -> bool {
        self.step > 0 && self.step.is_multiple_of(self.cfg.hessian_interval.max(1))
    }

    /// `h <- beta2 h + (1 - beta2) g_hat^2` for every parameter.
    pub fn update_hessian(&mut self, grads: Vec<Tensor<1>>) {
        for (h, g) in self.hessian.iter_mut().zip(grads) {
            if let Some(old) = h.take() {
                *h =
                    Some(old.mul_scalar(self.beta2) + (g.clone() * g).mul_scalar(1.0 - self.beta2));
            }
        }
    }

    pub(crate) fn slots(&self) -> Vec<StateSlot<'_>> {
        vec![(EXP_AVG, &self.exp_avg), (HESSIAN, &self.hessian)]
    }

    pub(crate) fn slots_mut(&mut self) -> Vec<StateSlotMut<'_>> {
        vec![(EXP_AVG, &mut self.exp_avg), (HESSIAN, &mut self.hessian)]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn update_is_clipped_sign_momentum_scaled_by_the_hessian() {
        let device = Device::flex();
        let cfg = OptimizerConfig {
            weight_decay: 0.0,
            beta1: 0.5,
            beta2: 0.5,
            ..OptimizerConfig::default()
        };
        let spec = ParamSpec {
            name: "w".into(),
            shape: vec![3],
            init: crate::model::Init::Ones,
            is_norm_or_embedding: false,
            placement: crate::mesh::placement::Placement::whole(&[3]),
        };
        // rho * tokens = 0.01 * 100 = 1.
        let mut opt = SophiaG::zeroed(
            &cfg,
            std::slice::from_ref(&spec),
            &device,
            100,
            &[Some(0..3)],
        );
        let mut p = vec![Tensor::<1>::zeros([3], &device)];
        // Without a Hessian estimate yet, every coordinate moves by lr * sign(m).
        let g = || vec![Tensor::<1>::from_floats([2.0, -0.5, 0.0], &device)];
        opt.update(&mut p, g(), 0.1, &[false]);
        let got = crate::tensor::to_vec(&p[0]);
        assert_eq!(got, [-0.1, 0.1, 0.0]);
        // h = 0.5 * g^2 = [2, 0.125, 0]; m = [1.5, -0.375, 0] after the next update
        // ratio = min(|m| / h, 1) = [0.75, 1, 0].
        opt.update_hessian(g());
        opt.update(&mut p, g(), 0.1, &[false]);
        let got = crate::tensor::to_vec(&p[0]);
        let expect = [-0.1 - 0.075, 0.1 + 0.1, 0.0];
        for (a, b) in got.iter().zip(expect) {
            assert!((a - b).abs() < 1e-6, "{got:?} vs {expect:?}");
        }
        assert!(!opt.hessian_due());
    }
}

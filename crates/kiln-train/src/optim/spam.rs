//! SPAM (Huang et al. 2025, "SPAM: Spike-Aware Adam with Momentum Reset for Stable LLM
//! Training"), with the arithmetic of the authors' `SPAM.py` (dense: every element kept).
//! At update `k` (0-based):
//!
//! ```text
//! reset    if (k + 1) % T == 0:  m <- 0, v <- 0                 T = spam.reset_interval
//! clip     if k + 1 >= A and (k + 1) % T >= A:                   A = spam.clip_after
//!            where g^2 > theta v:  g <- sign(g) sqrt(theta v)    theta = spam.threshold
//! moments  m <- b1 m + (1 - b1) g;  v <- b2 v + (1 - b2) g^2
//! update   p <- p - lr sqrt(1 - b2^(k+1)) / (1 - b1^(k+1)) * s(k) * m / (sqrt(v) + eps)
//! decay    p <- p - lr wd p                                      (after the update)
//! ```
//!
//! `s(k)`, the warmup after a reset at update `r`: `1 - 0.99 (1 + cos(pi (k - r) / (N + 1))) / 2`
//! for `k - r < N` (`N` = `spam.warmup_steps`), else 1; 1 before the first reset. The bias
//! correction counts every update (the reset does not restart it), as the reference's does.
//! Everything is element-wise: a rank's range of a parameter updates as those elements of
//! the whole would.

use super::{StateSlot, StateSlotMut, zeros};
use crate::config::{OptimizerConfig, SpamConfig};
use crate::model::ParamSpec;
use burn::tensor::{Device, Tensor};
use std::ops::Range;

/// State suffix of the first moment (the reference's name).
pub const EXP_AVG: &str = "exp_avg";
/// State suffix of the second moment.
pub const EXP_AVG_SQ: &str = "exp_avg_sq";

/// SPAM state: both moments per parameter, and the step count.
#[derive(Debug, Clone)]
pub struct Spam {
    cfg: SpamConfig,
    opt: OptimizerConfig,
    decay: Vec<bool>,
    /// First moments, in parameter order.
    pub exp_avg: Vec<Option<Tensor<1>>>,
    /// Second moments.
    pub exp_avg_sq: Vec<Option<Tensor<1>>>,
    /// Updates applied.
    pub step: u64,
}

impl Spam {
    /// Zero moments as long as each of `ranges` (`None`: none for that parameter).
    pub(crate) fn zeroed(
        cfg: &OptimizerConfig,
        specs: &[ParamSpec],
        device: &Device,
        ranges: &[Option<Range<usize>>],
    ) -> Self {
        Self {
            cfg: cfg.spam.clone(),
            opt: cfg.clone(),
            decay: specs.iter().map(|s| super::adamw::decays(cfg, s)).collect(),
            exp_avg: zeros(ranges, device),
            exp_avg_sq: zeros(ranges, device),
            step: 0,
        }
    }

    /// The warmup factor `s(k)` of update `k` (see the module documentation).
    pub fn warmup_factor(&self, k: u64) -> f64 {
        let (t, n) = (self.cfg.reset_interval.max(1), self.cfg.warmup_steps);
        if k + 1 < t {
            return 1.0;
        }
        // The last reset: the last update r <= k with (r + 1) % t == 0.
        let since = (k + 1) % t;
        if since >= n {
            return 1.0;
        }
        let cos = (std::f64::consts::PI * since as f64 / (n + 1) as f64).cos();
        1.0 - 0.99 * (1.0 + cos) / 2.0
    }

    /// Whether update `k` clips spikes.
    fn clips(&self, k: u64) -> bool {
        let (t, a) = (self.cfg.reset_interval.max(1), self.cfg.clip_after);
        k + 1 >= a && (k + 1) % t >= a
    }

    /// One update of every parameter not `frozen` (see the module documentation).
    pub fn update(
        &mut self,
        params: &mut [Tensor<1>],
        grads: Vec<Tensor<1>>,
        lr: f64,
        frozen: &[bool],
    ) {
        let k = self.step;
        self.step += 1;
        let (b1, b2) = (self.opt.beta1, self.opt.beta2);
        let reset = (k + 1).is_multiple_of(self.cfg.reset_interval.max(1));
        let clips = self.clips(k);
        let theta = self.cfg.threshold;
        let n = (k + 1) as i32;
        let step_size = lr * (1.0 - b2.powi(n)).sqrt() / (1.0 - b1.powi(n));
        let scale = self.warmup_factor(k);
        let wd = self.opt.weight_decay;
        for (i, g) in grads.into_iter().enumerate() {
            if frozen.get(i).copied().unwrap_or(false) {
                continue;
            }
            let (Some(m), Some(v)) = (self.exp_avg[i].take(), self.exp_avg_sq[i].take()) else {
                continue;
            };
            let (m, v) = match reset {
                true => (m.zeros_like(), v.zeros_like()),
                false => (m, v),
            };
            let g = match clips {
                true => {
                    let bound = v.clone().mul_scalar(theta);
                    let spike = g.clone().powi_scalar(2).greater(bound.clone());
                    let clipped = g.clone().sign() * bound.sqrt();
                    g.mask_where(spike, clipped)
                }
                false => g,
            };
            let m = m.mul_scalar(b1) + g.clone().mul_scalar(1.0 - b1);
            let v = v.mul_scalar(b2) + (g.clone() * g).mul_scalar(1.0 - b2);
            let denom = v.clone().sqrt().add_scalar(self.opt.eps);
            let mut p = params[i].clone() - (m.clone() / denom).mul_scalar(step_size * scale);
            if self.decay[i] && wd != 0.0 {
                p = p.clone() - p.mul_scalar(lr * wd);
            }
            params[i] = p;
            self.exp_avg[i] = Some(m);
            self.exp_avg_sq[i] = Some(v);
        }
    }

    pub(crate) fn slots(&self) -> Vec<StateSlot<'_>> {
        vec![(EXP_AVG, &self.exp_avg), (EXP_AVG_SQ, &self.exp_avg_sq)]
    }

    pub(crate) fn slots_mut(&mut self) -> Vec<StateSlotMut<'_>> {
        vec![
            (EXP_AVG, &mut self.exp_avg),
            (EXP_AVG_SQ, &mut self.exp_avg_sq),
        ]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spam(reset_interval: u64, warmup_steps: u64, clip_after: u64) -> Spam {
        let cfg = OptimizerConfig {
            weight_decay: 0.0,
            spam: SpamConfig {
                reset_interval,
                warmup_steps,
                threshold: 4.0,
                clip_after,
            },
            ..OptimizerConfig::default()
        };
        let spec = ParamSpec {
            name: "w".into(),
            shape: vec![2],
            init: crate::model::Init::Ones,
            is_norm_or_embedding: false,
            placement: crate::mesh::placement::Placement::whole(&[2]),
        };
        Spam::zeroed(&cfg, &[spec], &Device::flex(), &[Some(0..2)])
    }

    /// The reference's CosineDecay(0.99, N): 0.01 right at a reset, back to 1 after N updates.
    #[test]
    fn the_update_warms_up_after_each_reset() {
        let s = spam(10, 4, 2);
        assert_eq!(s.warmup_factor(0), 1.0, "no warmup before the first reset");
        assert_eq!(s.warmup_factor(8), 1.0);
        assert!((s.warmup_factor(9) - 0.01).abs() < 1e-12, "at the reset");
        let mid = 1.0 - 0.99 * (1.0 + (std::f64::consts::PI * 2.0 / 5.0).cos()) / 2.0;
        assert!((s.warmup_factor(11) - mid).abs() < 1e-12);
        assert_eq!(s.warmup_factor(13), 1.0, "N updates after the reset");
        assert!((s.warmup_factor(19) - 0.01).abs() < 1e-12, "the next reset");
    }

    /// A spike is clipped to sqrt(theta v) with its sign once the moments have filled, and
    /// the moments restart at the reset.
    #[test]
    fn spikes_are_clipped_against_the_second_moment_and_moments_reset() {
        let mut s = spam(6, 1, 2);
        let device = Device::flex();
        let mut p = vec![Tensor::<1>::zeros([2], &device)];
        let g = |a: f32, b: f32| vec![Tensor::<1>::from_floats([a, b], &device)];
        s.update(&mut p, g(1.0, 1.0), 0.0, &[false]);
        let v1 = crate::tensor::to_vec(s.exp_avg_sq[0].as_ref().unwrap());
        assert!(
            v1.iter().all(|v| (v - 0.05).abs() < 1e-7),
            "v = (1 - b2) g^2: {v1:?}"
        );
        // Update 1 clips (k + 1 = 2 >= 2): g^2 = 100 > 4 v = 0.2 -> g = -sqrt(0.2).
        s.update(&mut p, g(-10.0, 0.1), 0.0, &[false]);
        let v2 = crate::tensor::to_vec(s.exp_avg_sq[0].as_ref().unwrap());
        let clipped = 0.95 * 0.05 + 0.05 * (4.0 * 0.05);
        assert!((v2[0] - clipped).abs() < 1e-7, "{v2:?}");
        assert!(
            (v2[1] - (0.95 * 0.05 + 0.05 * 0.01)).abs() < 1e-7,
            "not a spike: {v2:?}"
        );
        for _ in 2..5 {
            s.update(&mut p, g(1.0, 1.0), 0.0, &[false]);
        }
        // Update 5 resets ((5 + 1) % 6 == 0): the moments hold that update's gradient only.
        s.update(&mut p, g(2.0, 2.0), 0.0, &[false]);
        let m = crate::tensor::to_vec(s.exp_avg[0].as_ref().unwrap());
        assert!((m[0] - 0.1 * 2.0).abs() < 1e-7, "{m:?}");
    }
}

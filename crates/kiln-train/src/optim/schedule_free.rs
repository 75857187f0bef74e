//! Schedule-Free AdamW (Defazio et al. 2024, "The Road Less Scheduled"), with the arithmetic
//! of the authors' `schedulefree.AdamWScheduleFree` (PyPI `schedulefree`). The parameters a
//! step computes gradients at are `y`; the iterate `z` takes the plain Adam-normalised steps;
//! `x`, the weights to evaluate and to publish, is their weighted average, kept implicitly:
//!
//! ```text
//! lr_max <- max(lr_max, lr);  w = (k + 1)^r lr_max^p;  W <- W + w;  c = w / W
//! v <- b2 v + (1 - b2) g^2;   u = g / (sqrt(v / (1 - b2^(k+1))) + eps) + wd y
//! y <- lerp(y, z, c) + lr (b1 (1 - c) - 1) u
//! z <- z - lr u
//! x  = lerp(y, z, 1 - 1 / b1)                       (the reference's `eval()` weights)
//! ```
//!
//! `lr` is the step's learning rate (kiln's schedule: a constant after its warmup, which is
//! the reference's `warmup_steps`); `r` and `p` are `schedule_free.r` and
//! `weight_lr_power`. kiln trains on `y` and publishes `x`: checkpoints, memory snapshots,
//! the final weights and every eval hold `x`, so export, merge and `kiln eval` see the weights
//! the method means; `y` is kept in the optimizer's state (slot `y`) and put back on resume,
//! so training never depends on when `x` was computed (the reference's `train()`/`eval()`
//! swap rounds `y` through `x`). `lr_max` and the weight sum are saved in `state.json`.
//! Element-wise: a rank's range of a parameter updates as those elements of the whole.

use super::{StateSlot, StateSlotMut, lerp, zeros};
use crate::config::{OptimizerConfig, ScheduleFreeConfig};
use crate::model::ParamSpec;
use burn::tensor::{Device, Tensor};
use std::ops::Range;

/// State suffix of the iterate z (the reference's name).
pub const Z: &str = "z";
/// State suffix of the second moment.
pub const EXP_AVG_SQ: &str = "exp_avg_sq";
/// State suffix of the point gradients are computed at (the parameters while training).
pub const Y: &str = "y";
/// `state.json` scalars: the largest LR so far and the sum of the averaging weights.
pub const SCALARS: [&str; 2] = ["lr_max", "weight_sum"];

/// Schedule-Free AdamW state.
#[derive(Debug, Clone)]
pub struct ScheduleFree {
    opt: OptimizerConfig,
    cfg: ScheduleFreeConfig,
    decay: Vec<bool>,
    /// The iterate z, in parameter order.
    pub z: Vec<Option<Tensor<1>>>,
    /// Second moments.
    pub exp_avg_sq: Vec<Option<Tensor<1>>>,
    /// The training point y as of the last update (the parameters then).
    pub y: Vec<Option<Tensor<1>>>,
    /// Updates applied.
    pub step: u64,
    /// The largest learning rate so far.
    pub lr_max: f64,
    /// The sum of the averaging weights so far.
    pub weight_sum: f64,
}

impl ScheduleFree {
    /// Zero state as long as each of `ranges` (`None`: none for that parameter); z starts
    /// as the parameters at the first update, as the reference's does.
    pub(crate) fn zeroed(
        cfg: &OptimizerConfig,
        specs: &[ParamSpec],
        device: &Device,
        ranges: &[Option<Range<usize>>],
    ) -> Self {
        Self {
            opt: cfg.clone(),
            cfg: cfg.schedule_free.clone(),
            decay: specs.iter().map(|s| super::adamw::decays(cfg, s)).collect(),
            z: zeros(ranges, device),
            exp_avg_sq: zeros(ranges, device),
            y: zeros(ranges, device),
            step: 0,
            lr_max: -1.0,
            weight_sum: 0.0,
        }
    }

    /// One update of every parameter (y) not `frozen`.
    pub fn update(
        &mut self,
        params: &mut [Tensor<1>],
        grads: Vec<Tensor<1>>,
        lr: f64,
        frozen: &[bool],
    ) {
        let (b1, b2, eps) = (self.opt.beta1, self.opt.beta2, self.opt.eps);
        let k = self.step;
        self.step += 1;
        let bias_correction2 = 1.0 - b2.powi((k + 1) as i32);
        self.lr_max = self.lr_max.max(lr);
        let weight = ((k + 1) as f64).powf(self.cfg.r) * self.lr_max.powf(self.cfg.weight_lr_power);
        self.weight_sum += weight;
        let ckp1 = if self.weight_sum == 0.0 {
            0.0
        } else {
            weight / self.weight_sum
        };
        let adaptive_y_lr = lr * (b1 * (1.0 - ckp1) - 1.0);
        let wd = self.opt.weight_decay;
        for (i, g) in grads.into_iter().enumerate() {
            if frozen.get(i).copied().unwrap_or(false) {
                continue;
            }
            let (Some(z), Some(v)) = (self.z[i].take(), self.exp_avg_sq[i].take()) else {
                continue;
            };
            let y = params[i].clone();
            let z = if k == 0 { y.clone() } else { z };
            let v = v.mul_scalar(b2) + (g.clone() * g.clone()).mul_scalar(1.0 - b2);
            let denom = v
                .clone()
                .div_scalar(bias_correction2)
                .sqrt()
                .add_scalar(eps);
            let mut u = g / denom;
            if self.decay[i] && wd != 0.0 {
                u = u + y.clone().mul_scalar(wd);
            }
            let y = lerp(y, z.clone(), ckp1) + u.clone().mul_scalar(adaptive_y_lr);
            self.z[i] = Some(z - u.mul_scalar(lr));
            self.exp_avg_sq[i] = Some(v);
            params[i] = y;
        }
        // Every parameter's training point, a frozen one's too (it is put back on resume).
        for (kept, p) in self.y.iter_mut().zip(params.iter()) {
            if kept.is_some() {
                *kept = Some(p.clone());
            }
        }
    }

    /// The weights to evaluate and publish, `x`, of the parameters `y` (before any update:
    /// `y` itself).
    pub fn published(&self, params: &[Tensor<1>]) -> Vec<Tensor<1>> {
        let w = 1.0 - 1.0 / self.opt.beta1;
        (params.iter().zip(&self.z))
            .map(|(y, z)| match (z, self.step) {
                (Some(z), 1..) => lerp(y.clone(), z.clone(), w),
                _ => y.clone(),
            })
            .collect()
    }

    /// The training point `y` of each parameter, as the last update left it (a resume puts it
    /// back in place of the published `x`); `None` before any update.
    pub fn training_point(&self) -> Option<&[Option<Tensor<1>>]> {
        (self.step > 0).then_some(self.y.as_slice())
    }

    pub(crate) fn slots(&self) -> Vec<StateSlot<'_>> {
        vec![(Z, &self.z), (EXP_AVG_SQ, &self.exp_avg_sq), (Y, &self.y)]
    }

    pub(crate) fn slots_mut(&mut self) -> Vec<StateSlotMut<'_>> {
        vec![
            (Z, &mut self.z),
            (EXP_AVG_SQ, &mut self.exp_avg_sq),
            (Y, &mut self.y),
        ]
    }

    /// `lr_max` and the weight sum, as [`SCALARS`] names them.
    pub fn scalars(&self) -> Vec<(String, f64)> {
        let values = [self.lr_max, self.weight_sum];
        (SCALARS.iter().zip(values))
            .map(|(k, v)| (k.to_string(), v))
            .collect()
    }

    /// Restores [`ScheduleFree::scalars`]; an error names a missing one.
    pub fn set_scalars(&mut self, saved: &[(String, f64)]) -> Result<(), String> {
        let get = |k: &str| {
            (saved.iter().find(|(n, _)| n == k).map(|(_, v)| *v))
                .ok_or_else(|| format!("state.json has no optimizer scalar {k:?}"))
        };
        self.lr_max = get(SCALARS[0])?;
        self.weight_sum = get(SCALARS[1])?;
        Ok(())
    }
}

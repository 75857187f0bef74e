//! AdamW with PyTorch's arithmetic (decoupled decay first, then the bias-corrected Adam
//! step), over all parameters or, inside Muon, over the parameters Muon leaves to it.

use super::{StateSlot, StateSlotMut};
use crate::config::OptimizerConfig;
use crate::model::ParamSpec;
use burn::tensor::{Device, Tensor};

/// State suffix of the first moment (`<param>.exp_avg`, PyTorch's name).
pub const EXP_AVG: &str = "exp_avg";
/// State suffix of the second moment (`<param>.exp_avg_sq`).
pub const EXP_AVG_SQ: &str = "exp_avg_sq";

/// AdamW state: first and second moments of the parameters it owns, and the step count.
#[derive(Debug, Clone)]
pub struct AdamW {
    cfg: OptimizerConfig,
    decay: Vec<bool>,
    /// First moments (exp_avg), in parameter order; `None` for parameters it does not own.
    pub exp_avg: Vec<Option<Tensor<1>>>,
    /// Second moments (exp_avg_sq), in parameter order.
    pub exp_avg_sq: Vec<Option<Tensor<1>>>,
    /// Number of updates applied (PyTorch's `step`), for bias correction.
    pub step: u64,
}

/// Whether `spec` is decayed under `cfg` (norm weights and embeddings only on request).
pub(crate) fn decays(cfg: &OptimizerConfig, spec: &ParamSpec) -> bool {
    cfg.decay_norms_and_embeddings || !spec.is_norm_or_embedding
}

impl AdamW {
    /// Zero state for all these parameters.
    pub fn new(cfg: &OptimizerConfig, specs: &[ParamSpec], device: &Device) -> Self {
        Self::owning(cfg, specs, device, &vec![true; specs.len()])
    }

    /// Zero state for the parameters whose `owned` flag is set; the others are never touched.
    pub fn owning(
        cfg: &OptimizerConfig,
        specs: &[ParamSpec],
        device: &Device,
        owned: &[bool],
    ) -> Self {
        let zeros = || {
            specs
                .iter()
                .zip(owned)
                .map(|(s, &own)| own.then(|| Tensor::zeros([s.numel()], device)))
                .collect::<Vec<_>>()
        };
        Self {
            cfg: cfg.clone(),
            decay: specs.iter().map(|s| decays(cfg, s)).collect(),
            exp_avg: zeros(),
            exp_avg_sq: zeros(),
            step: 0,
        }
    }

    /// Replaces the hyper-parameters (a resumed run may change lr or decay).
    pub fn set_config(&mut self, cfg: &OptimizerConfig, specs: &[ParamSpec]) {
        self.cfg = cfg.clone();
        self.decay = specs.iter().map(|s| decays(cfg, s)).collect();
    }

    /// One update of every owned parameter whose `frozen` flag is false, with PyTorch's
    /// AdamW arithmetic (decay first, then the bias-corrected Adam step).
    pub fn update(
        &mut self,
        params: &mut [Tensor<1>],
        grads: Vec<Tensor<1>>,
        lr: f64,
        frozen: &[bool],
    ) {
        self.step += 1;
        let (b1, b2, eps, wd) = (
            self.cfg.beta1,
            self.cfg.beta2,
            self.cfg.eps,
            self.cfg.weight_decay,
        );
        let bc1 = 1.0 - b1.powi(self.step as i32);
        let bc2_sqrt = (1.0 - b2.powi(self.step as i32)).sqrt();
        let step_size = lr / bc1;
        for (i, g) in grads.into_iter().enumerate() {
            if frozen.get(i).copied().unwrap_or(false) {
                continue;
            }
            let (Some(m), Some(v)) = (&self.exp_avg[i], &self.exp_avg_sq[i]) else {
                continue;
            };
            let m = m.clone().mul_scalar(b1) + g.clone().mul_scalar(1.0 - b1);
            let v = v.clone().mul_scalar(b2) + (g.clone() * g).mul_scalar(1.0 - b2);
            let mut p = params[i].clone();
            if self.decay[i] && wd != 0.0 {
                p = p.mul_scalar(1.0 - lr * wd);
            }
            let denom = v.clone().sqrt().div_scalar(bc2_sqrt).add_scalar(eps);
            params[i] = p - (m.clone() / denom).mul_scalar(step_size);
            self.exp_avg[i] = Some(m);
            self.exp_avg_sq[i] = Some(v);
        }
    }

    /// The moments, as named slots of state.
    pub(crate) fn slots(&self) -> Vec<StateSlot<'_>> {
        vec![(EXP_AVG, &self.exp_avg), (EXP_AVG_SQ, &self.exp_avg_sq)]
    }

    /// The moments, to be restored.
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

    #[test]
    fn adamw_matches_hand_computed_pytorch_step() {
        let device = Device::flex();
        let cfg = OptimizerConfig {
            lr: 0.1,
            weight_decay: 0.5,
            ..OptimizerConfig::default()
        };
        let spec = ParamSpec {
            name: "w".into(),
            shape: vec![2],
            init: crate::model::Init::Ones,
            is_norm_or_embedding: false,
        };
        let mut opt = AdamW::new(&cfg, std::slice::from_ref(&spec), &device);
        let mut p = vec![Tensor::<1>::from_floats([1.0, -2.0], &device)];
        let g = vec![Tensor::<1>::from_floats([0.5, 0.25], &device)];
        opt.update(&mut p, g, 0.1, &[false]);
        let got = p[0].clone().into_data().try_to_vec::<f32>().unwrap();
        // step 1: m_hat = g, v_hat = g^2, so the Adam step is lr * g/(|g| + eps) ~ lr * sign(g)
        let expect = [1.0 * (1.0 - 0.05) - 0.1, -2.0 * (1.0 - 0.05) - 0.1];
        for (a, b) in got.iter().zip(expect) {
            assert!((a - b).abs() < 1e-6, "{got:?} vs {expect:?}");
        }
    }
}

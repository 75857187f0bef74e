//! AdamW with PyTorch's arithmetic (decoupled decay first, then the bias-corrected Adam
//! step), over all parameters or, inside Muon, over the parameters Muon leaves to it.

use super::{StateSlot, StateSlotMut, zeros};
use crate::config::OptimizerConfig;
use crate::kernels::adamw::{self, AdamWScalars};
use crate::model::ParamSpec;
use burn::tensor::{Device, Tensor};
use std::ops::Range;

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
    /// Zero moments as long as each of `ranges` (`None`: no state for that parameter; a
    /// rank's shard of a sharded run keeps a range of each). The arithmetic is element-wise,
    /// so a range updates exactly as the same elements of a whole parameter would.
    pub(crate) fn zeroed(
        cfg: &OptimizerConfig,
        specs: &[ParamSpec],
        device: &Device,
        ranges: &[Option<Range<usize>>],
    ) -> Self {
        Self {
            cfg: cfg.clone(),
            decay: specs.iter().map(|s| decays(cfg, s)).collect(),
            exp_avg: zeros(ranges, device),
            exp_avg_sq: zeros(ranges, device),
            step: 0,
        }
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
        self.update_clipped(params, grads, None, lr, frozen);
    }

    /// As [`AdamW::update`], with the gradients first scaled by `grad_scale` (the clipping
    /// coefficient), in the same pass: bit-identical to clipping then [`AdamW::update`].
    /// On flex f32 tensors it is one fused multithreaded pass per parameter, in place
    /// (`kernels::adamw`); elsewhere the composed burn ops.
    pub fn update_clipped(
        &mut self,
        params: &mut [Tensor<1>],
        grads: Vec<Tensor<1>>,
        grad_scale: Option<f64>,
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
            // Take the moments out (not clones), so the fused pass finds them unshared and
            // writes them in place; a parameter without moments is not ours.
            let (Some(m), Some(v)) = (self.exp_avg[i].take(), self.exp_avg_sq[i].take()) else {
                continue;
            };
            let decay = (self.decay[i] && wd != 0.0).then_some(1.0 - lr * wd);
            // Scalars rounded to f32 as flex rounds a scalar operand (see kernels::adamw).
            let s = AdamWScalars {
                grad_scale: grad_scale.map(|c| c as f32),
                b1: (b1 as f32, (1.0 - b1) as f32),
                b2: (b2 as f32, (1.0 - b2) as f32),
                decay: decay.map(|d| d as f32),
                bc2_sqrt: bc2_sqrt as f32,
                eps: eps as f32,
                step_size: step_size as f32,
            };
            // Likewise the parameter (a placeholder holds its slot meanwhile).
            let p = std::mem::replace(&mut params[i], Tensor::empty([0], &g.device()));
            let (p, m, v) = match adamw::adamw_update(p, g, m, v, &s) {
                Ok(done) => done,
                Err(back) => {
                    let (p, g, m, v) = *back;
                    let g = match grad_scale {
                        Some(c) => g.mul_scalar(c),
                        None => g,
                    };
                    update_composed(p, g, m, v, (b1, b2, eps), decay, bc2_sqrt, step_size)
                }
            };
            params[i] = p;
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

/// One AdamW update from burn tensor ops: the path for tensors the fused kernel does not
/// cover (other backends and dtypes), and its reference in the tests. Returns `(p, m, v)`.
#[allow(clippy::too_many_arguments)]
fn update_composed(
    p: Tensor<1>,
    g: Tensor<1>,
    m: Tensor<1>,
    v: Tensor<1>,
    (b1, b2, eps): (f64, f64, f64),
    decay: Option<f64>,
    bc2_sqrt: f64,
    step_size: f64,
) -> (Tensor<1>, Tensor<1>, Tensor<1>) {
    let m = m.mul_scalar(b1) + g.clone().mul_scalar(1.0 - b1);
    let v = v.mul_scalar(b2) + (g.clone() * g).mul_scalar(1.0 - b2);
    let p = match decay {
        Some(d) => p.mul_scalar(d),
        None => p,
    };
    let denom = v.clone().sqrt().div_scalar(bc2_sqrt).add_scalar(eps);
    let p = p - (m.clone() / denom).mul_scalar(step_size);
    (p, m, v)
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
            placement: crate::mesh::placement::Placement::whole(&[2]),
        };
        let mut opt = AdamW::zeroed(
            &cfg,
            std::slice::from_ref(&spec),
            &device,
            &[Some(0..spec.numel())],
        );
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

    /// The fused update (kernels::adamw) against the composed one: the same bits, with and
    /// without clipping and decay, and a clone of a parameter taken before the update (a
    /// guard snapshot) keeps its old values.
    #[test]
    fn fused_update_is_bit_identical_to_the_composed_one() {
        let device = Device::flex();
        let n = 40_000; // more than one block of work
        let vals = |seed: u32, scale: f32| -> Vec<f32> {
            (0..n)
                .map(|i| ((i as u32).wrapping_mul(2_654_435_761) ^ seed) as f32 / u32::MAX as f32)
                .map(|x| (x - 0.5) * scale)
                .collect()
        };
        let t =
            |v: Vec<f32>| Tensor::<1>::from_data(burn::tensor::TensorData::new(v, [n]), &device);
        let cfg = OptimizerConfig {
            lr: 0.01,
            weight_decay: 0.1,
            beta2: 0.999,
            ..OptimizerConfig::default()
        };
        for (decay, clip) in [(true, Some(0.37)), (false, None), (true, None)] {
            let (b1, b2, eps) = (cfg.beta1, cfg.beta2, cfg.eps);
            let mut p = t(vals(1, 2.0));
            let mut m = t(vals(2, 0.1));
            let mut v = t(vals(3, 0.01).iter().map(|x| x.abs()).collect());
            for step in 1..=3u64 {
                let g = t(vals(3 + step as u32, 1.0));
                let bc1 = 1.0 - b1.powi(step as i32);
                let bc2_sqrt = (1.0 - b2.powi(step as i32)).sqrt();
                let d = decay.then_some(1.0 - cfg.lr * cfg.weight_decay);
                let gc = match clip {
                    Some(c) => g.clone().mul_scalar(c),
                    None => g.clone(),
                };
                let want = update_composed(
                    p.clone(),
                    gc,
                    m.clone(),
                    v.clone(),
                    (b1, b2, eps),
                    d,
                    bc2_sqrt,
                    cfg.lr / bc1,
                );
                let s = AdamWScalars {
                    grad_scale: clip.map(|c| c as f32),
                    b1: (b1 as f32, (1.0 - b1) as f32),
                    b2: (b2 as f32, (1.0 - b2) as f32),
                    decay: d.map(|d| d as f32),
                    bc2_sqrt: bc2_sqrt as f32,
                    eps: eps as f32,
                    step_size: (cfg.lr / bc1) as f32,
                };
                let snapshot = p.clone();
                let before = snapshot.clone().into_data();
                let (p2, m2, v2) = adamw::cpu::update(p, g, m, v, &s)
                    .unwrap_or_else(|_| panic!("flex f32 tensors must take the fused path"));
                assert_eq!(snapshot.into_data(), before, "a shared buffer was written");
                for (got, want) in [(&p2, &want.0), (&m2, &want.1), (&v2, &want.2)] {
                    let (a, b) = (got.clone().into_data(), want.clone().into_data());
                    let (a, b) = (a.as_slice::<f32>().unwrap(), b.as_slice::<f32>().unwrap());
                    assert!(
                        a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits()),
                        "decay {decay} clip {clip:?} step {step}: fused != composed"
                    );
                }
                (p, m, v) = (p2, m2, v2);
            }
        }
    }
}

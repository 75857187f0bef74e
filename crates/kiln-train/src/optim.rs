//! AdamW with PyTorch's semantics, global gradient-norm clipping and the LR schedules.
//!
//! Written here rather than taken from burn because burn's optimizer (a) keys its state by a
//! per-process parameter id, which does not survive reloading weights (the restored state
//! silently fails to apply and resume diverges), (b) clips gradients per tensor rather than by
//! the global norm, and (c) defaults eps to 1e-5 where PyTorch uses 1e-8. State here is keyed
//! by parameter name and saved in safetensors beside the weights.

use crate::config::{LrSchedulerConfig, OptimizerConfig, ScheduleKind};
use crate::kernels::{self, adamw::AdamWScalars};
use crate::model::ParamSpec;
use burn::tensor::{Device, Tensor};
use rayon::prelude::*;

/// Learning rate at optimizer step `step` (0-based) of `total`.
pub fn lr_at(sched: &LrSchedulerConfig, peak: f64, step: u64, total: u64) -> f64 {
    let min = peak * sched.min_lr_ratio;
    let warm = sched.warmup_steps.min(total);
    if step < warm {
        return peak * (step + 1) as f64 / warm as f64;
    }
    match sched.kind {
        ScheduleKind::Constant => peak,
        ScheduleKind::Cosine => {
            let span = total.saturating_sub(warm).max(1) as f64;
            let progress = ((step - warm) as f64 / span).min(1.0);
            min + (peak - min) * 0.5 * (1.0 + (std::f64::consts::PI * progress).cos())
        }
        ScheduleKind::Wsd => {
            let decay_steps = ((total as f64) * sched.decay_ratio).round() as u64;
            let decay_start = total.saturating_sub(decay_steps).max(warm);
            if step < decay_start {
                peak
            } else {
                let span = total.saturating_sub(decay_start).max(1) as f64;
                let progress = ((step - decay_start + 1) as f64 / span).min(1.0);
                peak + (min - peak) * progress
            }
        }
    }
}

/// Global L2 norm of all gradients (one host read-back).
pub fn global_norm(grads: &[Tensor<1>]) -> f32 {
    if grads.is_empty() {
        return 0.0;
    }
    // One tensor per rayon task: flex runs each element-wise op on one thread, and the
    // per-tensor results are the same whichever thread computes them (concatenated and
    // summed in parameter order below), so the norm keeps its bits.
    let sq: Vec<Tensor<1>> = grads
        .par_iter()
        .map(|g| g.clone().powi_scalar(2).sum())
        .collect();
    Tensor::cat(sq, 0).sum().sqrt().into_scalar::<f32>()
}

/// Scales gradients so their global norm is at most `max_norm` (as
/// `torch.nn.utils.clip_grad_norm_`: coefficient max_norm / (norm + 1e-6), clamped to 1).
pub fn clip_by_global_norm(grads: Vec<Tensor<1>>, norm: f32, max_norm: f64) -> Vec<Tensor<1>> {
    match clip_coefficient(norm, max_norm) {
        Some(coef) => grads.into_iter().map(|g| g.mul_scalar(coef)).collect(),
        None => grads,
    }
}

/// AdamW state: first and second moments per parameter, and the step count.
#[derive(Debug, Clone)]
pub struct AdamW {
    cfg: OptimizerConfig,
    decay: Vec<bool>,
    /// First moments (exp_avg), in parameter order.
    pub exp_avg: Vec<Tensor<1>>,
    /// Second moments (exp_avg_sq), in parameter order.
    pub exp_avg_sq: Vec<Tensor<1>>,
    /// Number of updates applied (PyTorch's `step`), for bias correction.
    pub step: u64,
}

impl AdamW {
    /// Zero state for these parameters.
    pub fn new(cfg: &OptimizerConfig, specs: &[ParamSpec], device: &Device) -> Self {
        let zeros = || {
            specs
                .iter()
                .map(|s| Tensor::zeros([s.numel()], device))
                .collect::<Vec<_>>()
        };
        let decay = specs
            .iter()
            .map(|s| cfg.decay_norms_and_embeddings || !s.is_norm_or_embedding)
            .collect();
        Self {
            cfg: cfg.clone(),
            decay,
            exp_avg: zeros(),
            exp_avg_sq: zeros(),
            step: 0,
        }
    }

    /// Replaces the hyper-parameters (a resumed run may change lr or decay).
    pub fn set_config(&mut self, cfg: &OptimizerConfig, specs: &[ParamSpec]) {
        self.cfg = cfg.clone();
        self.decay = specs
            .iter()
            .map(|s| cfg.decay_norms_and_embeddings || !s.is_norm_or_embedding)
            .collect();
    }

    /// One update of every parameter whose `frozen` flag is false, with PyTorch's AdamW
    /// arithmetic (decay first, then the bias-corrected Adam step).
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
    /// coefficient from [`clip_coefficient`]), in the same pass: bit-identical to
    /// [`clip_by_global_norm`] followed by [`AdamW::update`].
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
            let p = params[i].clone();
            let (m, v) = (self.exp_avg[i].clone(), self.exp_avg_sq[i].clone());
            // Drop our handles so the fused pass finds the buffers unshared and writes in place.
            let placeholder = || Tensor::<1>::empty([0], &g.device());
            params[i] = placeholder();
            self.exp_avg[i] = placeholder();
            self.exp_avg_sq[i] = placeholder();
            let (p, m, v) = match kernels::adamw::update(p, g, m, v, &s) {
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
            self.exp_avg[i] = m;
            self.exp_avg_sq[i] = v;
        }
    }
}

/// The clipping coefficient for gradients of global norm `norm` (as
/// `torch.nn.utils.clip_grad_norm_`: max_norm / (norm + 1e-6)), or None when no clipping
/// applies (disabled, or the norm is within bounds).
pub fn clip_coefficient(norm: f32, max_norm: f64) -> Option<f64> {
    if max_norm <= 0.0 {
        return None;
    }
    let coef = (max_norm / (f64::from(norm) + 1e-6)).min(1.0);
    (coef < 1.0).then_some(coef)
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

    fn sched(kind: ScheduleKind) -> LrSchedulerConfig {
        LrSchedulerConfig {
            kind,
            warmup_steps: 10,
            min_lr_ratio: 0.1,
            decay_ratio: 0.2,
        }
    }

    #[test]
    fn cosine_warms_up_peaks_and_ends_at_min() {
        let s = sched(ScheduleKind::Cosine);
        assert!((lr_at(&s, 1.0, 0, 100) - 0.1).abs() < 1e-12);
        assert!((lr_at(&s, 1.0, 9, 100) - 1.0).abs() < 1e-12);
        assert!((lr_at(&s, 1.0, 10, 100) - 1.0).abs() < 1e-12);
        assert!((lr_at(&s, 1.0, 100, 100) - 0.1).abs() < 1e-9);
        let mid = lr_at(&s, 1.0, 55, 100);
        assert!((mid - 0.55).abs() < 1e-9, "{mid}");
    }

    #[test]
    fn wsd_is_flat_then_decays_linearly() {
        let s = sched(ScheduleKind::Wsd);
        assert_eq!(lr_at(&s, 1.0, 50, 100), 1.0);
        assert_eq!(lr_at(&s, 1.0, 79, 100), 1.0);
        assert!(lr_at(&s, 1.0, 80, 100) < 1.0);
        assert!((lr_at(&s, 1.0, 99, 100) - 0.1).abs() < 1e-9);
    }

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
                let (p2, m2, v2) = kernels::adamw::update(p, g, m, v, &s)
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

    #[test]
    fn clipping_scales_to_max_norm() {
        let device = Device::flex();
        let g = vec![Tensor::<1>::from_floats([3.0, 4.0], &device)];
        let n = global_norm(&g);
        assert!((n - 5.0).abs() < 1e-6);
        let c = clip_by_global_norm(g, n, 1.0);
        assert!((global_norm(&c) - 1.0).abs() < 1e-5);
    }
}

//! The guard rail's checks that need no tensors: loss-spike detection over a running window,
//! and the first-step loss sanity check. The rail itself is a component
//! ([`crate::components::guard_rail`]); these live apart, below the run's state, because the
//! spike window is part of every checkpoint ([`crate::state::TrainState`]), so a resumed run
//! makes exactly the decisions the uninterrupted one would.

use crate::config::GuardsConfig;
use serde::{Deserialize, Serialize};
use std::collections::VecDeque;

/// Running window of recent losses.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
pub struct SpikeDetector {
    window: VecDeque<f32>,
}

/// Verdict on one loss.
#[derive(Debug, Clone, PartialEq)]
pub enum LossVerdict {
    /// Within the window's statistics.
    Normal,
    /// A spike: the loss, the window mean and standard deviation.
    Spike {
        /// The loss.
        loss: f32,
        /// Window mean.
        mean: f64,
        /// Window standard deviation.
        std: f64,
    },
}

impl SpikeDetector {
    /// Judges `loss` against the window (a spike needs a full window), then, if normal,
    /// pushes it into the window. A spike is not pushed: it must not inflate the statistics.
    pub fn observe(&mut self, loss: f32, cfg: &GuardsConfig) -> LossVerdict {
        if cfg.spike_window > 1 && cfg.spike_sigma > 0.0 && self.window.len() >= cfg.spike_window {
            let n = self.window.len() as f64;
            let mean = self.window.iter().map(|&l| f64::from(l)).sum::<f64>() / n;
            let var = self
                .window
                .iter()
                .map(|&l| (f64::from(l) - mean).powi(2))
                .sum::<f64>()
                / n;
            let std = var.sqrt();
            let l = f64::from(loss);
            if l > mean + cfg.spike_sigma * std && l > mean * cfg.spike_min_ratio {
                return LossVerdict::Spike { loss, mean, std };
            }
        }
        self.window.push_back(loss);
        while self.window.len() > cfg.spike_window.max(1) {
            self.window.pop_front();
        }
        LossVerdict::Normal
    }
}

/// Checks the first loss of a freshly initialised model against ln(vocab): a model with a
/// small init predicts nearly uniformly, so its loss is close to ln(vocab). Far below means
/// the targets leak into the inputs (a data or shift bug) or the loss is divided by something
/// (the tensor-parallel "loss / dp_size" bug); far above means a reduction summing instead of
/// averaging or a broken init. Returns the explanation when it is off.
pub fn check_initial_loss(loss: f32, vocab: usize, tolerance: f64) -> Option<String> {
    let expected = (vocab as f64).ln();
    let l = f64::from(loss);
    if (l - expected).abs() <= tolerance {
        return None;
    }
    let cause = if l < expected {
        "far below: the targets may leak into the inputs (inputs and targets not shifted by one), \
         or the loss is divided by an extra factor (such as the data-parallel size)"
    } else {
        "far above: the loss may be summed instead of averaged, or the init std is far too large"
    };
    Some(format!(
        "first-step loss {l:.4} is {:.2} nats from ln(vocab={vocab}) = {expected:.4} (tolerance {tolerance}); {cause}. \
         Set guards.initial_loss_tolerance to loosen this check.",
        (l - expected).abs()
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn spike_needs_full_window_and_both_thresholds() {
        let cfg = GuardsConfig {
            spike_window: 5,
            spike_sigma: 3.0,
            spike_min_ratio: 1.5,
            ..GuardsConfig::default()
        };
        let mut d = SpikeDetector::default();
        assert_eq!(d.observe(100.0, &cfg), LossVerdict::Normal); // window not full yet
        let mut d = SpikeDetector::default();
        for l in [2.0, 2.1, 1.9, 2.0, 2.05] {
            assert_eq!(d.observe(l, &cfg), LossVerdict::Normal);
        }
        assert!(matches!(d.observe(10.0, &cfg), LossVerdict::Spike { .. }));
        assert_eq!(d.observe(2.2, &cfg), LossVerdict::Normal);
    }

    #[test]
    fn initial_loss_check_explains() {
        assert!(check_initial_loss(2.78, 16, 0.5).is_none());
        assert!(check_initial_loss(0.1, 16, 0.5).unwrap().contains("leak"));
        assert!(
            check_initial_loss(20.0, 16, 0.5)
                .unwrap()
                .contains("summed")
        );
    }
}

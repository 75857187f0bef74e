//! The `[metrics]` and `[eval]` sections: what a run reports, and how often it evaluates.

use serde::{Deserialize, Serialize};

/// Metrics logging.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct MetricsConfig {
    /// Write a `metrics.jsonl` line every this many steps.
    pub log_interval: u64,
    /// Also write the logged scalars (loss, grad norm, LR, tokens/s, MFU, eval metrics) and
    /// the guards' events (as text) as TensorBoard event files in `RUN_DIR/tensorboard/`
    /// (`tensorboard --logdir RUN_DIR/tensorboard`); a resumed run appends without
    /// repeating a step.
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub tensorboard: bool,
}

impl Default for MetricsConfig {
    fn default() -> Self {
        Self {
            log_interval: 1,
            tensorboard: false,
        }
    }
}

/// In-training evaluation.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct EvalConfig {
    /// Evaluate every this many steps (and at the end); 0 = only at the end.
    pub interval: u64,
    /// Held-out sequences per evaluation; 0 = no held-out evaluation (no `eval_loss` line).
    pub samples: usize,
    /// Multiple-choice tasks file (JSON lines) scored during training; empty = the built-in
    /// task of the synthetic corpus (when it is used).
    pub tasks: String,
}

impl Default for EvalConfig {
    fn default() -> Self {
        Self {
            interval: 100,
            samples: 64,
            tasks: String::new(),
        }
    }
}

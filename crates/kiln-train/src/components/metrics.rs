//! What a run reports: per-step and per-eval metrics (`metrics.jsonl`), and the [`Observer`]
//! through which a caller (the CLI's progress display, the smoke gate) watches training.

use crate::model::session::Session;
use serde::Serialize;

/// Everything a step decided, for metrics and progress display. With several data-parallel
/// ranks every value is global (all ranks together).
#[derive(Debug, Clone, Serialize)]
pub struct StepMetrics {
    /// Optimizer steps completed.
    pub step: u64,
    /// Total steps of the run.
    pub total_steps: u64,
    /// Mean loss of the step over the global batch.
    pub loss: f32,
    /// Global gradient norm before clipping.
    pub grad_norm: f32,
    /// Learning rate used.
    pub lr: f64,
    /// Training tokens per second of this step, all ranks.
    pub tokens_per_s: f64,
    /// Wall time of the step.
    pub step_time_s: f64,
    /// Model FLOPs utilisation against `peak_flops` (of all ranks).
    pub mfu: f64,
    /// Resident memory of the writer rank, MiB.
    pub rss_mib: f64,
    /// Tokens trained on so far, all ranks.
    pub tokens_seen: u64,
    /// The step trained on global samples `first_sample .. first_sample + global_batch`
    /// (the same ids whatever the number of ranks).
    pub first_sample: u64,
    /// Sequences per step, all ranks.
    pub global_batch: u64,
    /// Seconds of this step spent averaging gradients over the ranks (host copies and the
    /// bucketed all-reduce); 0 with one rank.
    pub allreduce_s: f64,
    /// Seconds of this step spent in the optimizer's update: with a sharded state also the
    /// gather of the updated parameters and Muon's whole matrices, and SophiaG's Hessian pass
    /// on the steps that estimate it.
    pub update_s: f64,
}

/// Evaluation on held-out data.
#[derive(Debug, Clone, Serialize)]
pub struct EvalMetrics {
    /// Step evaluated after.
    pub step: u64,
    /// Held-out loss (nats per token).
    pub eval_loss: f64,
    /// Fraction of complete held-out answers predicted exactly (synthetic corpus).
    pub eval_accuracy: Option<f64>,
    /// Unigram baseline loss of the corpus, for comparison.
    pub unigram_loss: Option<f64>,
    /// Results of [`Observer::extra_eval`] (multiple-choice accuracy, ...).
    #[serde(flatten)]
    pub extra: serde_json::Map<String, serde_json::Value>,
}

/// Things the caller can observe while training runs (on the writer rank).
pub trait Observer {
    /// Called after every completed step.
    fn on_step(&mut self, _m: &StepMetrics) {}
    /// Called after every evaluation.
    fn on_eval(&mut self, _e: &EvalMetrics) {}
    /// Called for notable events (resume, checkpoint, guard), with a one-line message.
    fn on_note(&mut self, _msg: &str) {}
    /// Extra evaluations run at every eval point (e.g. multiple-choice tasks scored by
    /// `kiln-gates`, which depends on this crate and so cannot be called from here); the
    /// returned fields are added to the eval line of `metrics.jsonl`.
    fn extra_eval(&mut self, _session: &Session) -> serde_json::Map<String, serde_json::Value> {
        serde_json::Map::new()
    }
}

/// An observer that ignores everything.
pub struct Silent;
impl Observer for Silent {}

/// Resident memory of this process, MiB.
pub fn rss_mib() -> f64 {
    // /proc/self/statm: size resident ... in pages.
    std::fs::read_to_string("/proc/self/statm")
        .ok()
        .and_then(|s| s.split_whitespace().nth(1)?.parse::<f64>().ok())
        .map_or(0.0, |pages| pages * 4096.0 / (1024.0 * 1024.0))
}

/// Peak resident memory of this process (VmHWM), MiB.
pub fn peak_rss_mib() -> f64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            let line = s.lines().find(|l| l.starts_with("VmHWM:"))?;
            line.split_whitespace().nth(1)?.parse::<f64>().ok()
        })
        .map_or(0.0, |kib| kib / 1024.0)
}

//! The training config: TOML with torchtitan-like sections. Every field has a default and a
//! doc line; unknown keys are errors that name the key; `--set section.key=value` overrides.

use serde::{Deserialize, Serialize};
use std::path::Path;

/// Errors loading or overriding a config.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// The file could not be read.
    #[error("config {path}: {source}")]
    Read {
        /// The file.
        path: String,
        /// The cause.
        source: std::io::Error,
    },
    /// The TOML is malformed, has an unknown key or a value of the wrong type.
    #[error("config {origin}: {message}")]
    Invalid {
        /// The file, or `--set` for overrides.
        origin: String,
        /// What is wrong (toml's message names the key and line).
        message: String,
    },
    /// A `--set` override is not `section.key=value`.
    #[error("--set {0:?}: expected section.key=value (for example training.steps=100)")]
    BadOverride(String),
    /// A value is out of range or inconsistent with another.
    #[error("config: {0}")]
    Inconsistent(String),
}

/// The whole config. Sections mirror torchtitan's: model, optimizer, lr_scheduler, training,
/// checkpoint, data, metrics, plus kiln's eval, guards and debug.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, Default)]
#[serde(deny_unknown_fields, default)]
pub struct Config {
    /// Model shape.
    pub model: ModelConfig,
    /// AdamW hyper-parameters.
    pub optimizer: OptimizerConfig,
    /// Learning-rate schedule.
    pub lr_scheduler: LrSchedulerConfig,
    /// Steps, batch, seed, device.
    pub training: TrainingConfig,
    /// Checkpoint cadence and retention.
    pub checkpoint: CheckpointConfig,
    /// Where tokens come from.
    pub data: DataConfig,
    /// Metrics logging.
    pub metrics: MetricsConfig,
    /// In-training evaluation.
    pub eval: EvalConfig,
    /// In-run guards (NaN, loss spikes, frozen parameters, replica consistency).
    pub guards: GuardsConfig,
    /// Data parallelism over several ranks (gradient all-reduce).
    pub parallelism: ParallelismConfig,
    /// Fault injection for testing the guards. Never set these in a real run.
    pub debug: DebugConfig,
}

/// Model shape (Llama-style decoder).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ModelConfig {
    /// Vocabulary size; 0 = take it from the data (the synthetic corpus has 16 symbols).
    pub vocab_size: usize,
    /// Hidden width.
    pub d_model: usize,
    /// Number of transformer blocks.
    pub n_layers: usize,
    /// Query heads.
    pub n_heads: usize,
    /// Key/value heads (grouped-query attention); must divide n_heads.
    pub n_kv_heads: usize,
    /// SwiGLU hidden width.
    pub ffn_hidden: usize,
    /// RoPE base frequency.
    pub rope_theta: f64,
    /// RMSNorm epsilon.
    pub norm_eps: f64,
    /// RMSNorm on queries and keys per head (QK-norm).
    pub qk_norm: bool,
    /// Share the embedding matrix with the output head.
    pub tie_embeddings: bool,
    /// Standard deviation of the normal init of every matrix.
    pub init_std: f64,
    /// Scale the init of residual output projections (wo, w_down) by 1/sqrt(2 * n_layers).
    pub scale_residual_init: bool,
}

impl Default for ModelConfig {
    fn default() -> Self {
        Self {
            vocab_size: 0,
            d_model: 128,
            n_layers: 4,
            n_heads: 4,
            n_kv_heads: 2,
            ffn_hidden: 384,
            rope_theta: 10000.0,
            norm_eps: 1e-5,
            qk_norm: false,
            tie_embeddings: false,
            init_std: 0.02,
            scale_residual_init: true,
        }
    }
}

/// AdamW with decoupled weight decay (PyTorch semantics and defaults).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct OptimizerConfig {
    /// Peak learning rate.
    pub lr: f64,
    /// Adam beta1.
    pub beta1: f64,
    /// Adam beta2.
    pub beta2: f64,
    /// Adam epsilon (PyTorch's 1e-8, not burn's 1e-5).
    pub eps: f64,
    /// Decoupled weight decay.
    pub weight_decay: f64,
    /// Also decay norm weights and embeddings (off: as in most LLM recipes).
    pub decay_norms_and_embeddings: bool,
    /// Clip the global gradient norm to this value; 0 disables clipping.
    pub max_grad_norm: f64,
}

impl Default for OptimizerConfig {
    fn default() -> Self {
        Self {
            lr: 3e-3,
            beta1: 0.9,
            beta2: 0.95,
            eps: 1e-8,
            weight_decay: 0.1,
            decay_norms_and_embeddings: false,
            max_grad_norm: 1.0,
        }
    }
}

/// Shape of the learning-rate schedule.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ScheduleKind {
    /// Linear warmup, then cosine decay to `min_lr_ratio * lr` at the last step.
    Cosine,
    /// Warmup-stable-decay: linear warmup, constant, then linear decay over the last
    /// `decay_ratio` of the steps.
    Wsd,
    /// Linear warmup, then constant.
    Constant,
}

/// Learning-rate schedule.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct LrSchedulerConfig {
    /// `cosine`, `wsd` or `constant`.
    pub kind: ScheduleKind,
    /// Linear warmup steps.
    pub warmup_steps: u64,
    /// Final LR as a fraction of the peak.
    pub min_lr_ratio: f64,
    /// WSD only: fraction of all steps spent in the final decay.
    pub decay_ratio: f64,
}

impl Default for LrSchedulerConfig {
    fn default() -> Self {
        Self {
            kind: ScheduleKind::Cosine,
            warmup_steps: 30,
            min_lr_ratio: 0.1,
            decay_ratio: 0.2,
        }
    }
}

/// Steps, batch, seed, device.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct TrainingConfig {
    /// Optimizer steps to run.
    pub steps: u64,
    /// Sequences per micro-batch (per data-parallel rank).
    pub batch_size: usize,
    /// Sequences per optimizer step, all data-parallel ranks together; 0 = batch_size x
    /// grad_accum_steps x ranks. When set, grad_accum_steps is derived from it (it must be a
    /// multiple of batch_size x ranks), so a run resumed on another number of ranks keeps
    /// its global batch. A run resumed on another number of ranks with 0 here keeps the
    /// global batch of its checkpoint the same way.
    pub global_batch_size: u64,
    /// Tokens per sequence.
    pub seq_len: usize,
    /// Micro-batches accumulated into one optimizer step.
    pub grad_accum_steps: usize,
    /// Seed of the init, the data order and every other random choice.
    pub seed: u64,
    /// Device: `flex` (CPU), or with the matching cargo feature `cuda:N`, `rocm:N`, `vulkan`,
    /// `wgpu`, `metal`.
    pub device: String,
    /// CPU threads for the flex backend; 0 = all cores.
    pub threads: usize,
    /// Split each micro-batch into this many shards computed on parallel threads (gradient
    /// accumulation inside the step). Helps on CPU, where burn's element-wise kernels are
    /// single-threaded (2 shards: 1.25x faster steps on 2 cores). The default is fixed, not
    /// the core count, so numerics are the same on every machine; changing it changes the
    /// last bits (f32 summation order).
    pub compute_shards: usize,
    /// Peak FLOP/s of the device, for the MFU estimate; 0 = a rough guess for the device.
    pub peak_flops: f64,
}

impl Default for TrainingConfig {
    fn default() -> Self {
        Self {
            steps: 500,
            batch_size: 16,
            global_batch_size: 0,
            seq_len: 64,
            grad_accum_steps: 1,
            seed: 1234,
            device: "flex".into(),
            threads: 0,
            compute_shards: 2,
            peak_flops: 0.0,
        }
    }
}

/// Checkpoint cadence and retention.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct CheckpointConfig {
    /// Save every this many steps (and at the end); 0 = only at the end and on signals.
    pub interval: u64,
    /// Keep the newest k checkpoints; older ones are deleted after a new one is published.
    pub keep_latest_k: usize,
    /// Resume from the newest valid checkpoint in the run directory, if there is one.
    pub resume: bool,
}

impl Default for CheckpointConfig {
    fn default() -> Self {
        Self {
            interval: 100,
            keep_latest_k: 3,
            resume: true,
        }
    }
}

/// Where tokens come from.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, Default)]
#[serde(deny_unknown_fields, default)]
pub struct DataConfig {
    /// Corpus list file (lines `weight prefix [corpus]`) of Megatron indexed datasets; empty =
    /// the built-in synthetic copy corpus.
    pub corpus_list: String,
    /// Directory for cached blend indices; empty = `.kiln-cache` beside the corpus list
    /// (shared by all ranks and runs that read it).
    pub cache_dir: String,
    /// Verify every shard's full SHA-256 against the manifest at start (slow; the default
    /// checks sizes and a sampled hash).
    pub full_verify: bool,
}

/// Metrics logging.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct MetricsConfig {
    /// Write a `metrics.jsonl` line every this many steps.
    pub log_interval: u64,
}

impl Default for MetricsConfig {
    fn default() -> Self {
        Self { log_interval: 1 }
    }
}

/// In-training evaluation.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct EvalConfig {
    /// Evaluate every this many steps (and at the end); 0 = only at the end.
    pub interval: u64,
    /// Held-out sequences per evaluation.
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

/// In-run guards.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct GuardsConfig {
    /// First-step loss of a fresh model must be within this many nats of ln(vocab).
    pub initial_loss_tolerance: f64,
    /// Skip a step whose loss or gradients are not finite; after `max_nonfinite_in_row` in a
    /// row, roll back to the last snapshot.
    pub max_nonfinite_in_row: u32,
    /// A loss above mean + spike_sigma * std of the recent window is a spike.
    pub spike_sigma: f64,
    /// ... and also above `spike_min_ratio` times the recent mean.
    pub spike_min_ratio: f64,
    /// Steps in the running window of loss statistics.
    pub spike_window: usize,
    /// Batches skipped after rolling back from a spike.
    pub spike_skip_batches: u64,
    /// Take an in-memory snapshot for rollbacks every this many steps; 0 disables rollbacks.
    pub snapshot_interval: u64,
    /// Check every this many steps that every parameter tensor changed; 0 disables it.
    pub frozen_check_interval: u64,
    /// Stop the run (exit 65) after this many rollbacks in a row that did not get training
    /// past the step where the previous rollback happened: a config or data problem that
    /// rolling back cannot fix. 0 = no limit.
    pub max_rollbacks: u32,
    /// With several data-parallel ranks, compare a checksum of every rank's parameters every
    /// this many steps (and before every checkpoint); a rank that differs (silent data
    /// corruption, a desynced rank) is named and the run stops (exit 76) before its weights
    /// are saved. 0 = only before checkpoints.
    pub replica_check_interval: u64,
}

impl Default for GuardsConfig {
    fn default() -> Self {
        Self {
            initial_loss_tolerance: 1.5,
            max_nonfinite_in_row: 3,
            spike_sigma: 6.0,
            spike_min_ratio: 1.5,
            spike_window: 50,
            spike_skip_batches: 20,
            snapshot_interval: 50,
            frozen_check_interval: 50,
            max_rollbacks: 3,
            replica_check_interval: 100,
        }
    }
}

/// Fault injection, so the guards are tested against real faults.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, Default)]
#[serde(deny_unknown_fields, default)]
pub struct DebugConfig {
    /// Make the loss of this step NaN (0 = never).
    pub nan_at_step: u64,
    /// Multiply the gradients of this step by `spike_scale` (0 = never).
    pub spike_at_step: u64,
    /// Gradient multiplier of the injected spike.
    pub spike_scale: f64,
    /// Parameters whose name contains this string never get updated ("" = none).
    pub freeze_params: String,
    /// Perturb the parameters of data-parallel rank `corrupt_replica_rank` after this step,
    /// as silent data corruption would (0 = never).
    pub corrupt_replica_at_step: u64,
    /// The rank whose parameters `corrupt_replica_at_step` perturbs.
    pub corrupt_replica_rank: usize,
}

/// Data parallelism: every rank holds the whole model and trains on its slice of the global
/// batch; gradients are averaged over the ranks (MPI all-reduce) before clipping.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ParallelismConfig {
    /// Gradients are all-reduced in buckets of this many MiB (PyTorch DDP uses 25); the
    /// bucket size is part of what makes the reduction repeatable, so keep it fixed in a run.
    pub bucket_mb: usize,
}

impl Default for ParallelismConfig {
    fn default() -> Self {
        Self { bucket_mb: 25 }
    }
}

impl Config {
    /// Parses TOML text; `origin` names it in errors.
    pub fn from_toml(text: &str, origin: &str) -> Result<Self, ConfigError> {
        toml::from_str(text).map_err(|e| ConfigError::Invalid {
            origin: origin.to_string(),
            message: e.to_string(),
        })
    }

    /// Loads a file (or the defaults when `path` is None), applies `--set` overrides and
    /// validates the result.
    pub fn load(path: Option<&Path>, overrides: &[String]) -> Result<Self, ConfigError> {
        let (mut table, origin) = match path {
            Some(p) => {
                let text = std::fs::read_to_string(p).map_err(|source| ConfigError::Read {
                    path: p.display().to_string(),
                    source,
                })?;
                let table: toml::Table =
                    toml::from_str(&text).map_err(|e| ConfigError::Invalid {
                        origin: p.display().to_string(),
                        message: e.to_string(),
                    })?;
                (table, p.display().to_string())
            }
            None => (toml::Table::new(), "<defaults>".to_string()),
        };
        for o in overrides {
            apply_override(&mut table, o)?;
        }
        let origin = if overrides.is_empty() {
            origin
        } else {
            format!("{origin} with --set overrides")
        };
        let config: Config =
            toml::Value::Table(table)
                .try_into()
                .map_err(|e: toml::de::Error| ConfigError::Invalid {
                    origin,
                    message: e.to_string(),
                })?;
        config.validate()?;
        Ok(config)
    }

    /// The effective config as TOML.
    pub fn to_toml(&self) -> String {
        toml::to_string_pretty(self).unwrap_or_default()
    }

    /// Checks ranges and consistency.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let m = &self.model;
        let bad = |msg: String| Err(ConfigError::Inconsistent(msg));
        if m.d_model == 0
            || m.n_layers == 0
            || m.n_heads == 0
            || m.n_kv_heads == 0
            || m.ffn_hidden == 0
        {
            return bad(
                "model.d_model, n_layers, n_heads, n_kv_heads and ffn_hidden must be > 0".into(),
            );
        }
        if !m.d_model.is_multiple_of(m.n_heads) {
            return bad(format!(
                "model.d_model ({}) must be divisible by model.n_heads ({})",
                m.d_model, m.n_heads
            ));
        }
        if !(m.d_model / m.n_heads).is_multiple_of(2) {
            return bad(format!(
                "head dim d_model/n_heads = {} must be even for RoPE",
                m.d_model / m.n_heads
            ));
        }
        if !m.n_heads.is_multiple_of(m.n_kv_heads) {
            return bad(format!(
                "model.n_kv_heads ({}) must divide model.n_heads ({})",
                m.n_kv_heads, m.n_heads
            ));
        }
        let t = &self.training;
        if t.steps == 0 || t.batch_size == 0 || t.seq_len == 0 || t.grad_accum_steps == 0 {
            return bad(
                "training.steps, batch_size, seq_len and grad_accum_steps must be > 0".into(),
            );
        }
        let o = &self.optimizer;
        if !(o.lr > 0.0 && o.lr.is_finite()) {
            return bad(format!(
                "optimizer.lr must be a positive number, got {}",
                o.lr
            ));
        }
        if !(0.0..1.0).contains(&o.beta1) || !(0.0..1.0).contains(&o.beta2) {
            return bad("optimizer.beta1 and beta2 must be in [0, 1)".into());
        }
        if self.checkpoint.keep_latest_k == 0 {
            return bad("checkpoint.keep_latest_k must be at least 1".into());
        }
        if !(0.0..=1.0).contains(&self.lr_scheduler.decay_ratio) {
            return bad("lr_scheduler.decay_ratio must be in [0, 1]".into());
        }
        Ok(())
    }
}

/// Applies `section.key=value` to a TOML table. The value is parsed as a TOML value
/// (`100`, `true`, `1e-3`, `"text"`, `[1, 2]`); anything that does not parse is a string.
fn apply_override(table: &mut toml::Table, spec: &str) -> Result<(), ConfigError> {
    let (key, raw) = spec
        .split_once('=')
        .ok_or_else(|| ConfigError::BadOverride(spec.to_string()))?;
    let parts: Vec<&str> = key.trim().split('.').collect();
    if parts.len() < 2 || parts.iter().any(|p| p.is_empty()) {
        return Err(ConfigError::BadOverride(spec.to_string()));
    }
    let raw = raw.trim();
    let value = toml::from_str::<toml::Table>(&format!("v = {raw}"))
        .ok()
        .and_then(|mut t| t.remove("v"))
        .unwrap_or_else(|| toml::Value::String(raw.to_string()));
    let mut cur = table;
    for section in &parts[..parts.len() - 1] {
        let entry = cur
            .entry(section.to_string())
            .or_insert_with(|| toml::Value::Table(toml::Table::new()));
        cur = entry
            .as_table_mut()
            .ok_or_else(|| ConfigError::BadOverride(spec.to_string()))?;
    }
    cur.insert(parts[parts.len() - 1].to_string(), value);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_are_valid_and_round_trip() {
        let c = Config::load(None, &[]).unwrap();
        let back = Config::from_toml(&c.to_toml(), "x").unwrap();
        assert_eq!(c, back);
    }

    #[test]
    fn unknown_key_is_named() {
        let err = Config::from_toml("[training]\nstepz = 3\n", "f.toml")
            .unwrap_err()
            .to_string();
        assert!(err.contains("stepz") && err.contains("f.toml"), "{err}");
    }

    #[test]
    fn overrides_apply_and_are_checked() {
        let c = Config::load(
            None,
            &["training.steps=7".into(), "optimizer.lr=1e-4".into()],
        )
        .unwrap();
        assert_eq!(c.training.steps, 7);
        assert_eq!(c.optimizer.lr, 1e-4);
        assert!(matches!(
            Config::load(None, &["steps=7".into()]),
            Err(ConfigError::BadOverride(_))
        ));
        let err = Config::load(None, &["training.nope=1".into()])
            .unwrap_err()
            .to_string();
        assert!(err.contains("nope"), "{err}");
        let err = Config::load(None, &["model.n_kv_heads=3".into()])
            .unwrap_err()
            .to_string();
        assert!(err.contains("n_kv_heads"), "{err}");
    }
}

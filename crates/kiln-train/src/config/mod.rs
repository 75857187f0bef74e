//! The training config: TOML with torchtitan-like sections. Every field has a default and a
//! doc line; unknown keys are errors that name the key; `--set section.key=value` overrides.
//!
//! One file a section, with its keys' domains ([`domains`]: finite, sign, range, every key
//! out of its domain named in one error): [`model`], [`optimizer`] (and the learning-rate
//! schedule), [`training`], [`kernels`], [`checkpoint`], [`data`], [`metrics`] (and eval),
//! [`guards`] (and debug); the parallelism section lives with the mesh
//! ([`crate::mesh::settings`]). [`rules`] checks the keys that tie sections together;
//! [`init_from`] resolves `model.init_from` before the config is read. This file loads,
//! overrides and writes the whole.

pub use crate::mesh::settings::{Collectives, ParallelismConfig, Shard};
use serde::{Deserialize, Serialize};
use std::path::Path;

mod checkpoint;
mod data;
mod domains;
mod error;
mod guards;
pub mod hf_config;
mod init_from;
mod kernels;
mod metrics;
mod model;
mod optimizer;
mod rules;
mod training;

pub use checkpoint::CheckpointConfig;
pub use data::DataConfig;
pub use domains::MAX_BUCKET_MB;
pub use error::{ConfigError, OutOfDomain};
pub use guards::MAX_SPIKE_WINDOW;
pub use guards::{DebugConfig, GuardsConfig};
use init_from::resolve_init_from;
pub use kernels::{AttentionPath, CudaCompiler, CudaGemm, FlashTiling, KernelsConfig};
pub use metrics::{EvalConfig, MetricsConfig};
pub use model::{MAX_VOCAB, ModelConfig};
pub use optimizer::{
    LrSchedulerConfig, ManoConfig, MuonConfig, MuonLrAdjust, OptimizerConfig, OptimizerKind,
    ScheduleFreeConfig, ScheduleKind, SophiaConfig, SpamConfig,
};
pub use training::{
    ActivationCheckpointing, MAX_COMPUTE_SHARDS, MAX_SAMPLES, MAX_STEPS, Precision, TrainingConfig,
    piece_sizes,
};

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
    /// How kiln's fused kernels run on CubeCL devices (GPUs): attention's path, the flash
    /// kernels' tiling, CUDA's matrix products and compiler.
    pub kernels: KernelsConfig,
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
        Self::load_for(path, overrides, None)
    }

    /// [`Config::load`] for a run in `run_dir`: when `model.init_from`'s directory is gone,
    /// the model keys the run recorded from it when it started (`RUN_DIR/config.toml`) stand
    /// in for it, so that the same command resumes the run.
    pub fn load_for_run(
        path: Option<&Path>,
        overrides: &[String],
        run_dir: &Path,
    ) -> Result<Self, ConfigError> {
        Self::load_for(path, overrides, Some(run_dir))
    }

    fn load_for(
        path: Option<&Path>,
        overrides: &[String],
        run_dir: Option<&Path>,
    ) -> Result<Self, ConfigError> {
        let (mut table, origin) = match path {
            Some(p) => {
                let text = kiln_run::files::read_to_string_limited(p, MAX_CONFIG_BYTES, "a config")
                    .map_err(|source| ConfigError::Read {
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
        resolve_init_from(&mut table, &origin, overrides, run_dir)?;
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

    /// Loads the config a run recorded (`RUN_DIR/config.toml`), as it is: its model keys were
    /// resolved when the run started, so `model.init_from` is not read again (the Hugging
    /// Face directory may be gone since).
    pub fn load_recorded(path: &Path) -> Result<Self, ConfigError> {
        let text = kiln_run::files::read_to_string_limited(path, MAX_CONFIG_BYTES, "a config")
            .map_err(|source| ConfigError::Read {
                path: path.display().to_string(),
                source,
            })?;
        let config = Self::from_toml(&text, &path.display().to_string())?;
        config.validate()?;
        Ok(config)
    }

    /// The effective config as TOML.
    pub fn to_toml(&self) -> String {
        toml::to_string_pretty(self).unwrap_or_default()
    }

    /// The effective config as TOML with every key, those [`Config::to_toml`] leaves out at
    /// their defaults too (`kiln train --print-config`). The recorded config leaves them out
    /// so that its hash, and the model hash a checkpoint carries, stay what kiln wrote before
    /// the keys existed.
    pub fn to_toml_every_key(&self) -> String {
        let Ok(mut table) = toml::Table::try_from(self) else {
            return self.to_toml();
        };
        let mut set = |section: &str, key: &str, value: toml::Value| {
            if let Some(t) = table.get_mut(section).and_then(toml::Value::as_table_mut) {
                t.entry(key.to_string()).or_insert(value);
            }
        };
        let t = &self.training;
        set("model", "init_from", self.model.init_from.clone().into());
        let ac = toml::Value::try_from(t.activation_checkpointing);
        set(
            "training",
            "activation_checkpointing",
            ac.unwrap_or("none".into()),
        );
        set("training", "device_memory_gb", t.device_memory_gb.into());
        set("metrics", "tensorboard", self.metrics.tensorboard.into());
        toml::to_string_pretty(&table).unwrap_or_default()
    }
}

/// Largest config file read (a real one is a few KiB).
pub const MAX_CONFIG_BYTES: u64 = 16 * kiln_run::files::MIB;

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

impl Config {
    /// The checkpoint settings as the run uses them: the memory tier is off in a sharded or
    /// tensor-parallel run (`parallelism.shard`, `parallelism.tp`), whose ranks each hold a
    /// different piece of the state, so a snapshot one rank lost could not be healed from a
    /// peer.
    pub fn effective_checkpoint(&self) -> CheckpointConfig {
        let mut c = self.checkpoint.clone();
        if self.parallelism.shard != Shard::None || self.parallelism.tp > 1 {
            c.snapshot_interval = 0;
        }
        c
    }
}

#[cfg(test)]
mod tests;

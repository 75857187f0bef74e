//! The device's estimate of one rank on an accelerator, the device's memory, and the verdict
//! on it (see [`super`]).

use super::advice::*;
use super::host::*;
use crate::config::{ActivationCheckpointing, Config, ConfigError, Shard};
use kiln_run::host::human_bytes;

/// Device memory that is not tensors: the CUDA context, cuBLAS's workspaces, NCCL's
/// buffers, bytes.
pub const DEVICE_CONTEXT: f64 = 1024.0 * 1024.0 * 1024.0;

/// f32 scores of one chunk of attention by products on a GPU (kernels/cube/attention_mm.rs).
pub(super) const ATTENTION_CHUNK: f64 = 256.0 * 1024.0 * 1024.0;

/// Logits of one chunk of the output head + cross-entropy (kernels/cube/heads.rs), f32.
pub(super) const HEAD_CHUNK: f64 = 4.0 * 16.0 * 1024.0 * 1024.0;

/// What a rank of a run on an accelerator needs of the device's memory, by part (bytes,
/// before [`SAFETY`] and [`DEVICE_CONTEXT`]; see the module documentation).
#[derive(Debug, Clone, PartialEq)]
pub struct DeviceEstimate {
    /// Parameters of the model.
    pub params: f64,
    /// Weights, AdamW moments (this rank's share), snapshot and frozen-check copies.
    pub state: f64,
    /// The largest of the backward pass and the exchange and update that follow it.
    pub step: f64,
    /// Of the backward pass, the saved activations.
    pub activations: f64,
}

impl DeviceEstimate {
    /// Device bytes needed, safety factor and context included.
    pub fn need(&self) -> f64 {
        (self.state + self.step) * SAFETY + DEVICE_CONTEXT
    }
}

/// The device estimate of `config` with a vocabulary of `vocab` for one of `ranks`
/// data-parallel ranks (see the module documentation); `None` when the device is not an
/// accelerator.
pub fn device_estimate_on(config: &Config, vocab: usize, ranks: usize) -> Option<DeviceEstimate> {
    let t = &config.training;
    if !on_accelerator(&t.device) {
        return None;
    }
    let m = &config.model;
    let share = TensorShare::of(config, ranks);
    let ranks = share.dp_ranks;
    let p = param_count(m, vocab) / share.tp;
    let (d, f) = (m.d_model as f64, m.ffn_hidden as f64);
    let layers = m.n_layers as f64;
    let kv = m.n_kv_heads as f64 * d / (m.n_heads.max(1) as f64);
    let tokens = t.batch_size as f64 * t.seq_len as f64;
    let bf16 = t.dtype == crate::config::Precision::Bf16;
    let (b, cast) = if bf16 { (2.0, 2.0) } else { (4.0, 0.0) };
    let block = b * tokens * share.layer(24.0 * d + 5.0 * f + 6.0 * kv, d);
    // One attention chunk's scores, probabilities and their gradients; one head chunk's
    // logits, with their softmax and gradient.
    let transient = (4.0 * ATTENTION_CHUNK)
        .min(16.0 * tokens * t.seq_len as f64 * m.n_heads as f64)
        + 3.0 * HEAD_CHUNK;
    let staged = 4.0 * tokens * layers * d + block + transient;
    let r = (ranks / config.parallelism.dp_replicate.max(1)).max(1) as f64;
    let g = &config.guards;
    let (snapshot, frozen) = (g.snapshot_interval > 0, g.frozen_check_interval > 0);
    // Weights and moments `base` bytes a parameter, the rollback snapshot a copy of them and
    // the frozen check one of the weights (`weights` bytes a parameter).
    let with_copies = |base: f64, weights: f64| {
        base + if snapshot { base } else { 0.0 } + if frozen { weights } else { 0.0 }
    };
    let (state, step, activations) = match config.parallelism.shard {
        Shard::Parameters => {
            let s = largest_stage(m, vocab) / share.tp;
            let backward = 4.0 * p / r + (16.0 + cast) * s + staged;
            (with_copies(12.0 / r, 4.0 / r) * p, backward, staged)
        }
        mode => {
            let activations = match t.activation_checkpointing {
                ActivationCheckpointing::Blocks => staged,
                ActivationCheckpointing::None => layers * block + transient,
            };
            let backward = (4.0 + cast) * p + activations;
            let (state, exchange) = match mode {
                Shard::None => (12.0, 8.0),
                // Packed gradients, then (the gradients freed) the gathered weights.
                Shard::Optimizer => (4.0 + 8.0 / r, 8.0),
                _ => (4.0 + 8.0 / r, 8.0 + 4.0 / r),
            };
            (
                with_copies(state, 4.0) * p,
                backward.max(exchange * p),
                activations,
            )
        }
    };
    Some(DeviceEstimate {
        params: p,
        state,
        step,
        activations,
    })
}

/// The memory one rank may use of its accelerator, and what says so: `training.device_memory_gb`,
/// else the device's own report (CUDA), divided among the ranks of this node that share the
/// device; `None` when nothing says (the device check is skipped).
pub fn device_limit(config: &Config) -> Option<(f64, String)> {
    let gib = 1024.0 * 1024.0 * 1024.0;
    let (bytes, source) = match config.training.device_memory_gb {
        g if g > 0.0 => (g * gib, "training.device_memory_gb".to_string()),
        _ => device_memory(&config.training.device)?,
    };
    let sharing = ranks_per_device();
    if sharing > 1 {
        return Some((
            bytes / sharing as f64,
            format!("{source}, shared by {sharing} ranks of this node"),
        ));
    }
    Some((bytes, source))
}

/// How many ranks of this node share one accelerator: the node's ranks over the
/// accelerators `kiln launch` found (`KILN_ACCELERATORS`), rounded up; 1 when unknown.
pub(super) fn ranks_per_device() -> usize {
    let Ok(env) = kiln_topology::RankEnv::from_process_env() else {
        return 1;
    };
    let gpus = std::env::var(kiln_run::host::ACCELERATORS_ENV)
        .ok()
        .and_then(|v| kiln_topology::accelerators_from_env(&v))
        .map_or(0, |a| a.count);
    match gpus {
        0 => 1,
        n => env.local_world_size.max(1).div_ceil(n),
    }
}

/// The total memory of the CUDA device `device` names (`cuda` or `cuda:N`, the N-th this
/// process sees), as the driver reports it; `None` elsewhere or without the `cuda` feature.
pub(super) fn device_memory(device: &str) -> Option<(f64, String)> {
    let (kind, index) = device.split_once(':').unwrap_or((device, "0"));
    if kind != "cuda" {
        return None;
    }
    let index: i32 = index.parse().ok()?;
    #[cfg(feature = "cuda")]
    {
        use cudarc::driver::result as driver;
        driver::init().ok()?;
        let dev = driver::device::get(index).ok()?;
        // SAFETY: `dev` is a device the driver just returned.
        let total = unsafe { driver::device::total_mem(dev) }.ok()?;
        Some((total as f64, format!("CUDA's report for device {index}")))
    }
    #[cfg(not(feature = "cuda"))]
    {
        let _ = index;
        None
    }
}

/// Refuses `config` when one rank's device estimate does not fit the device's memory
/// ([`device_limit`]); `None` off accelerators or where nothing says how much memory there is.
pub fn check_device(
    config: &Config,
    vocab: usize,
    ranks: usize,
) -> Result<Option<DeviceEstimate>, ConfigError> {
    let Some(est) = device_estimate_on(config, vocab, ranks) else {
        return Ok(None);
    };
    let Some((limit, source)) = device_limit(config) else {
        return Ok(Some(est));
    };
    device_verdict(config, vocab, ranks, est, limit, &source).map(Some)
}

/// `est` (one of `ranks` ranks) against `limit` bytes of device memory, which `source` reports.
pub(super) fn device_verdict(
    config: &Config,
    vocab: usize,
    ranks: usize,
    est: DeviceEstimate,
    limit: f64,
    source: &str,
) -> Result<DeviceEstimate, ConfigError> {
    tracing::info!(
        need = %human_bytes(est.need()),
        available = %human_bytes(limit),
        source,
        "device memory estimate of a rank"
    );
    if est.need() <= limit {
        return Ok(est);
    }
    let need = |c: &Config, r: usize| device_estimate_on(c, vocab, r).map_or(0.0, |e| e.need());
    let shard = sharding_advice_by(config, ranks, limit, &need).unwrap_or_default();
    let gib = |b: f64| human_bytes(b);
    Err(ConfigError::TooBig(format!(
        "this run needs about {} of device memory per rank but {} is available ({source}): \
         weights and optimizer state {} ({:.3e} parameters, parallelism.shard = \"{}\" over \
         {ranks} rank(s)), the step {} of which activations {} ({} x {} tokens, \
         training.dtype = \"{}\"); estimate x {SAFETY} + {} for the CUDA context. Lower \
         training.batch_size (raise training.grad_accum_steps to keep the tokens per step), \
         set training.activation_checkpointing = \"blocks\"{shard}",
        gib(est.need()),
        gib(limit),
        gib(est.state),
        est.params,
        config.parallelism.shard.name(),
        gib(est.step),
        gib(est.activations),
        config.training.batch_size,
        config.training.seq_len,
        match config.training.dtype {
            crate::config::Precision::Bf16 => "bf16",
            crate::config::Precision::F32 => "f32",
        },
        gib(DEVICE_CONTEXT),
    )))
}

//! The `[training]` section: steps, batch, seed, device, precision, compute shards, and its
//! keys' domains.

use super::domains::{Bound::*, Domains};
use serde::{Deserialize, Serialize};

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
    /// `wgpu`, `metal`, `cubecl-cpu` (CubeCL's CPU runtime: the GPU code path on the host).
    pub device: String,
    /// CPU threads for the flex backend; 0 = all cores. At most 4 x the cores this process
    /// may use ([`kiln_run::host::THREADS_PER_CORE`]): more only adds contention.
    pub threads: usize,
    /// Split each micro-batch into this many shards computed on parallel threads (gradient
    /// accumulation inside the step). Helps on CPU, where burn's element-wise kernels are
    /// single-threaded (2 shards: 1.25x faster steps on 2 cores). The default is fixed, not
    /// the core count, so numerics are the same on every machine; changing it changes the
    /// last bits (f32 summation order).
    pub compute_shards: usize,
    /// Peak FLOP/s of the device (one rank's), for the MFU estimate; 0 = a guess: the host's
    /// threads at 80 GFLOP/s, a CUDA GPU's bf16 peak by its name (half in f32); the MFU reads
    /// 0 on other accelerators until this is set.
    pub peak_flops: f64,
    /// Use kiln's fused kernels (RMSNorm, SwiGLU, RoPE, causal attention and softmax, output
    /// head + cross-entropy, the AdamW update) on flex and on CubeCL devices (`[kernels]`);
    /// false computes the same functions from burn's ops (slower, more memory; for A/B checks
    /// and profiling). Equal up to f32 rounding.
    pub fused_kernels: bool,
    /// Compute precision of the matmuls (forward and backward): `f32` or `bf16`. With
    /// `bf16`, weights and activations enter every matmul as bf16 while norms, softmax, the
    /// loss and the residual stream stay f32 (as PyTorch's autocast).
    pub dtype: Precision,
    /// Precision of the stored (master) weights: `f32` (default; optimizer state is always
    /// f32) or `bf16`, which saves memory but loses every update smaller than half a bf16
    /// step: norm weights near 1.0 then never move (the seeds' frozen-RMSNorm bug).
    pub master_dtype: Precision,
    /// Activation checkpointing: `none` keeps every block's activations for the backward
    /// pass; `blocks` keeps only each block's input and recomputes the block in the backward
    /// pass (one more forward pass of the blocks for activation memory of one block). The
    /// gradients are the same bits. A parameter-sharded run recomputes its blocks already.
    #[serde(skip_serializing_if = "ActivationCheckpointing::is_none")]
    pub activation_checkpointing: ActivationCheckpointing,
    /// Memory of one accelerator (GiB), for the device memory estimate; 0 = ask the device
    /// (CUDA reports it; other accelerators are then not checked). Ranks sharing one device
    /// (more ranks on a node than `kiln launch` found GPUs) divide it.
    #[serde(skip_serializing_if = "is_zero")]
    pub device_memory_gb: f64,
}

/// Whether a value is 0 (left out of a written config when it is the default).
fn is_zero(v: &f64) -> bool {
    *v == 0.0
}

/// What `training.activation_checkpointing` keeps for the backward pass.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum ActivationCheckpointing {
    /// Every activation the backward pass reads.
    #[default]
    None,
    /// Each block's input only; the block is recomputed in the backward pass.
    Blocks,
}

impl ActivationCheckpointing {
    /// Whether nothing is recomputed (the default, left out of a written config so that the
    /// configs of earlier runs read the same).
    pub fn is_none(&self) -> bool {
        *self == Self::None
    }
}

/// A floating-point precision of `training.dtype` / `training.master_dtype`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum Precision {
    /// 32-bit IEEE float.
    #[default]
    F32,
    /// bfloat16: f32's exponent range, 8 bits of mantissa.
    Bf16,
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
            fused_kernels: true,
            dtype: Precision::F32,
            master_dtype: Precision::F32,
            activation_checkpointing: ActivationCheckpointing::None,
            device_memory_gb: 0.0,
        }
    }
}

/// The sequences of each compute shard of a micro-batch of `rows` sequences split over
/// `shards` threads (`training.compute_shards`): equal shards of `rows / shards` rounded up,
/// the last one what is left.
pub fn piece_sizes(rows: usize, shards: usize) -> Vec<usize> {
    let shards = shards.clamp(1, rows.max(1));
    let per = rows.div_ceil(shards).max(1);
    (0..rows)
        .step_by(per)
        .map(|at| per.min(rows - at))
        .collect()
}

impl TrainingConfig {
    /// The training keys' domains.
    pub(super) fn domains(&self, d: &mut Domains) {
        let t = self;
        d.check(
            "training.steps",
            t.steps,
            (1..=MAX_STEPS).contains(&t.steps),
            format!("an integer in [1, {MAX_STEPS}]"),
        );
        d.at_least("training.batch_size", t.batch_size, 1);
        d.at_least("training.seq_len", t.seq_len, 1);
        d.at_least("training.grad_accum_steps", t.grad_accum_steps, 1);
        let max_threads = kiln_run::host::max_threads();
        d.check(
            "training.threads",
            t.threads,
            t.threads <= max_threads,
            format!(
                "0 (all cores) or an integer in [1, {max_threads}] ({} x the {} cores this process may use)",
                kiln_run::host::THREADS_PER_CORE,
                kiln_run::host::cores()
            ),
        );
        d.check(
            "training.compute_shards",
            t.compute_shards,
            (1..=MAX_COMPUTE_SHARDS).contains(&t.compute_shards),
            format!("an integer in [1, {MAX_COMPUTE_SHARDS}]"),
        );
        d.real("training.peak_flops", t.peak_flops, Closed(0.0), Inf);
        d.real(
            "training.device_memory_gb",
            t.device_memory_gb,
            Closed(0.0),
            Inf,
        );

        d.check(
            "training.global_batch_size",
            t.global_batch_size,
            t.global_batch_size <= MAX_SAMPLES,
            format!(
                "0 (batch_size x grad_accum_steps x ranks) or an integer in [1, {MAX_SAMPLES}]"
            ),
        );
    }
}

/// Most optimizer steps a run may ask for (far beyond any real run; keeps every
/// step-derived count well inside 64 bits).
pub const MAX_STEPS: u64 = 1_000_000_000_000;
/// Most sequences a run may draw (`steps x batch_size x grad_accum_steps`).
pub const MAX_SAMPLES: u64 = 1 << 56;
/// Most compute shards per micro-batch (each is a thread).
pub const MAX_COMPUTE_SHARDS: usize = 256;

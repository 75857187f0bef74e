//! The training config: TOML with torchtitan-like sections. Every field has a default and a
//! doc line; unknown keys are errors that name the key; `--set section.key=value` overrides.

pub use crate::mesh::settings::{Collectives, ParallelismConfig, Shard};
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
    /// Values out of their domain (range, sign, finiteness), or keys that contradict each
    /// other; every offending key is listed with its value and what is allowed.
    #[error("config: {}", join_domains(.0))]
    OutOfDomain(Vec<OutOfDomain>),
    /// The run cannot fit in this machine's memory (see [`crate::model::budget`]).
    #[error("config: {0}")]
    TooBig(String),
}

impl kiln_run::exit::ExitCoded for ConfigError {
    /// A config that cannot be read or is wrong is invalid input: 78, never retried.
    fn exit_code(&self) -> i32 {
        kiln_run::exit::CONFIG
    }
}

fn join_domains(v: &[OutOfDomain]) -> String {
    v.iter()
        .map(|d| d.to_string())
        .collect::<Vec<_>>()
        .join("; ")
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

/// Model shape (Llama-style decoder).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ModelConfig {
    /// Vocabulary size; 0 = take it from the data (the synthetic corpus has 16 symbols; a
    /// tokenized corpus records it in its `PREFIX.kiln.json`). A corpus without that record
    /// (e.g. written by Megatron-LM) needs it set, at least its largest token id + 1.
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
    /// A Hugging Face Llama directory (`config.json`, `model.safetensors` or its shards,
    /// `tokenizer.json`) whose weights start a fresh run (continued pre-training). The model
    /// keys are taken from its `config.json` (a config or `--set` that sets one differently
    /// is an error naming both), and `data.tokenizer` from its `tokenizer.json` unless set.
    /// A run that resumes from a checkpoint ignores it: the checkpoint wins. Empty = none.
    #[serde(skip_serializing_if = "String::is_empty")]
    pub init_from: String,
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
            init_from: String::new(),
        }
    }
}

/// Which optimizer updates the parameters.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum OptimizerKind {
    /// AdamW with decoupled weight decay (PyTorch's arithmetic).
    #[default]
    Adamw,
    /// Muon (momentum orthogonalised by Newton-Schulz) for the 2-D hidden matrices, AdamW
    /// for embeddings, norms and the output head.
    Muon,
    /// SophiaG: clipped, Hessian-preconditioned momentum with the Gauss-Newton-Bartlett
    /// estimate of the diagonal Hessian every `sophia.hessian_interval` steps.
    Sophiag,
    /// SPAM: Adam with spike-aware clipping of each gradient element against its second
    /// moment, and the moments reset every `spam.reset_interval` steps (each reset followed by
    /// a cosine warmup of the update).
    Spam,
    /// Schedule-Free AdamW: no decay schedule (a constant LR after the warmup); trains at a
    /// point y between its iterate z and their average x, which it evaluates and publishes.
    ScheduleFreeAdamw,
    /// Mano: momentum projected onto the tangent space of each hidden matrix's rows or
    /// columns (alternating) and normalised along them, no Newton-Schulz; AdamW for
    /// embeddings, norms and the output head.
    Mano,
}

impl OptimizerKind {
    /// The name used in configs and checkpoints.
    pub fn name(self) -> &'static str {
        match self {
            Self::Adamw => "adamw",
            Self::Muon => "muon",
            Self::Sophiag => "sophiag",
            Self::Spam => "spam",
            Self::ScheduleFreeAdamw => "schedule_free_adamw",
            Self::Mano => "mano",
        }
    }
}

/// The optimizer: AdamW (default), Muon, SophiaG or SPAM, with their reference
/// implementations' semantics and defaults. `lr`, the schedule, weight decay and clipping
/// apply to all of them.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct OptimizerConfig {
    /// `adamw`, `muon`, `sophiag`, `spam`, `schedule_free_adamw` or `mano`.
    pub kind: OptimizerKind,
    /// Peak learning rate (Muon: of both its Muon and its AdamW parameters).
    pub lr: f64,
    /// Adam beta1; SophiaG's momentum beta1.
    pub beta1: f64,
    /// Adam beta2; SophiaG's beta2 of the Hessian EMA.
    pub beta2: f64,
    /// Adam epsilon (PyTorch's 1e-8, not burn's 1e-5).
    pub eps: f64,
    /// Decoupled weight decay.
    pub weight_decay: f64,
    /// Also decay norm weights and embeddings (off: as in most LLM recipes).
    pub decay_norms_and_embeddings: bool,
    /// Clip the global gradient norm to this value; 0 disables clipping.
    pub max_grad_norm: f64,
    /// Muon's settings (`kind = "muon"`).
    pub muon: MuonConfig,
    /// SophiaG's settings (`kind = "sophiag"`).
    pub sophia: SophiaConfig,
    /// SPAM's settings (`kind = "spam"`; beta1, beta2, eps and weight decay are the keys
    /// above).
    pub spam: SpamConfig,
    /// Schedule-Free AdamW's settings (`kind = "schedule_free_adamw"`; beta1, beta2, eps and
    /// weight decay are the keys above, the warmup is `lr_scheduler.warmup_steps`).
    pub schedule_free: ScheduleFreeConfig,
    /// Mano's settings (`kind = "mano"`; eps and weight decay are the keys above, and the
    /// AdamW of its other parameters takes beta1 and beta2).
    pub mano: ManoConfig,
}

impl Default for OptimizerConfig {
    fn default() -> Self {
        Self {
            kind: OptimizerKind::Adamw,
            // 1e-3, not 3e-3: the default run learns its copy task in a sudden transition, and
            // at 3e-3 that came late or not at all for some seeds (flex, 21 seeds: one ended at
            // accuracy 0.175, two at 0.991; on devices, whose sums round differently, seed
            // 1234 twice ended near 0.1). At 1e-3 every seed measured made it (bench/train/results.md).
            lr: 1e-3,
            beta1: 0.9,
            beta2: 0.95,
            eps: 1e-8,
            weight_decay: 0.1,
            decay_norms_and_embeddings: false,
            max_grad_norm: 1.0,
            muon: MuonConfig::default(),
            sophia: SophiaConfig::default(),
            spam: SpamConfig::default(),
            schedule_free: ScheduleFreeConfig::default(),
            mano: ManoConfig::default(),
        }
    }
}

/// How Muon scales its learning rate per matrix (PyTorch's `adjust_lr_fn`), for a matrix of
/// `out x in` (Hugging Face layout).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum MuonLrAdjust {
    /// Keller Jordan's: lr * sqrt(max(1, out/in)); Muon then wants its own, larger LR.
    Original,
    /// Moonshot's: lr * 0.2 * sqrt(max(out, in)), which matches the update RMS of AdamW, so
    /// one LR (and one LR sweep) serves both the Muon and the AdamW parameters.
    MatchRmsAdamw,
}

/// Muon (Jordan et al. 2024; PyTorch's `torch.optim.Muon`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct MuonConfig {
    /// Momentum coefficient.
    pub momentum: f64,
    /// Nesterov momentum.
    pub nesterov: bool,
    /// Newton-Schulz iterations of the quintic (3.4445, -4.7750, 2.0315).
    pub ns_steps: usize,
    /// Per-matrix LR scaling: `match_rms_adamw` or `original`.
    pub adjust_lr: MuonLrAdjust,
}

impl Default for MuonConfig {
    fn default() -> Self {
        Self {
            momentum: 0.95,
            nesterov: true,
            ns_steps: 5,
            adjust_lr: MuonLrAdjust::MatchRmsAdamw,
        }
    }
}

/// SophiaG (Liu et al. 2023). beta1, beta2 and weight decay are `optimizer.beta1/beta2/
/// weight_decay`; the defaults are the seeds' settings (0.9/0.95, rho 0.01, wd 0.1).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct SophiaConfig {
    /// Clipping threshold: the update is lr * sign(m) * min(|m| / (rho * tokens * h), 1),
    /// tokens = tokens per optimizer step.
    pub rho: f64,
    /// Estimate the diagonal Hessian (Gauss-Newton-Bartlett) every this many steps (k).
    pub hessian_interval: u64,
}

impl Default for SophiaConfig {
    fn default() -> Self {
        Self {
            rho: 0.01,
            hessian_interval: 10,
        }
    }
}

/// SPAM (Huang et al. 2025, "SPAM: Spike-Aware Adam with Momentum Reset for Stable LLM
/// Training"; the defaults are the paper's).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct SpamConfig {
    /// Reset both moments every this many steps (the paper's Delta T).
    pub reset_interval: u64,
    /// Steps of the cosine warmup of the update after each reset (the paper's N).
    pub warmup_steps: u64,
    /// A gradient element is a spike when its square exceeds this many times its second
    /// moment (theta); it is clipped to that bound, keeping its sign.
    pub threshold: f64,
    /// Steps after the start and after each reset before spikes are clipped (the second
    /// moment is still filling; the reference's `grad_accu_steps`).
    pub clip_after: u64,
}

impl Default for SpamConfig {
    fn default() -> Self {
        Self {
            reset_interval: 500,
            warmup_steps: 150,
            threshold: 5000.0,
            clip_after: 20,
        }
    }
}

/// Schedule-Free AdamW (Defazio et al. 2024; the defaults are the authors' package's).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ScheduleFreeConfig {
    /// The averaging weight of update k grows as (k + 1)^r.
    pub r: f64,
    /// ... and as the largest LR so far to this power (warmup steps weigh less).
    pub weight_lr_power: f64,
}

impl Default for ScheduleFreeConfig {
    fn default() -> Self {
        Self {
            r: 0.0,
            weight_lr_power: 2.0,
        }
    }
}

/// Mano (Gu & Xie 2026; the defaults are the authors' `mano.py`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ManoConfig {
    /// Heavy-ball momentum coefficient.
    pub momentum: f64,
    /// Nesterov momentum (off in the paper's version, on in the authors' later `mano_v2`).
    pub nesterov: bool,
}

impl Default for ManoConfig {
    fn default() -> Self {
        Self {
            momentum: 0.95,
            nesterov: false,
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

/// How kiln's fused kernels run on CubeCL devices (GPUs); `training.fused_kernels` turns them
/// all off. None of these keys changes what is computed, only how: each path is checked
/// against the same composed twin (`kiln doctor --device`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, Default)]
#[serde(deny_unknown_fields, default)]
pub struct KernelsConfig {
    /// Causal attention's path on CubeCL devices: `auto` (by matrix products on GPUs, the row
    /// kernels on CubeCL's CPU runtime), `products` (chunks of query positions by the device's
    /// matrix products: tensor cores), `flash` (tiled flash kernels on tensor-core fragments;
    /// where they cannot run, bf16 or f16 on a GPU with 32-unit planes, `auto`'s path), or
    /// `rows` (one unit per query row, a scalar at a time). Flex takes its CPU kernel always.
    pub attention: AttentionPath,
    /// The flash kernels' tilings, `RxCxP,RxCxP,RxCxP` for the forward, `dq` and `dk`/`dv`
    /// kernels: R rows of a cube's own side against tiles of C rows of the other, P planes a
    /// cube; sides multiples of 16 up to 256, 1 to 16 planes. "" = 64x64x4,64x32x4,32x32x4.
    pub flash_tiling: String,
    /// Matrix products on CUDA devices: `cublas` (NVIDIA's GEMMs, as PyTorch takes them) or
    /// `cubecl` (burn's autotuned CubeCL matmul, for comparison). Without libcublas, `cubecl`.
    pub cuda_gemm: CudaGemm,
    /// How CubeCL compiles kernels for CUDA devices: `llvm` (LLVM's NVPTX backend) or `nvrtc`
    /// (CUDA C++ through NVRTC, which needs libnvrtc.so; the backend that advertises TMA to
    /// burn's matmul). One per process: the first run's choice stands.
    pub cuda_compiler: CudaCompiler,
    /// A file each cuBLAS product's time is appended to (`| 12.3us | name`, the format of
    /// CubeCL's profiling logger), each product waited on: for profiling; "" = off.
    pub cublas_profile: String,
}

/// Causal attention's path on CubeCL devices (`kernels.attention`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum AttentionPath {
    /// By products on GPUs, the row kernels on CubeCL's CPU runtime.
    #[default]
    Auto,
    /// Chunks of query positions by the device's matrix products.
    Products,
    /// The tiled flash kernels, where they can run (else `Auto`'s path).
    Flash,
    /// The row kernels: one unit per query row.
    Rows,
}

/// Who multiplies matrices on CUDA devices (`kernels.cuda_gemm`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum CudaGemm {
    /// cuBLAS, where its library loads.
    #[default]
    Cublas,
    /// burn's autotuned CubeCL matmul.
    Cubecl,
}

/// The compiler CubeCL's CUDA runtime builds kernels with (`kernels.cuda_compiler`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum CudaCompiler {
    /// LLVM's NVPTX backend.
    #[default]
    Llvm,
    /// CUDA C++ through NVRTC.
    Nvrtc,
}

/// A tiling of the flash kernels: `(rows, cols, planes)` for the forward, `dq` and `dk`/`dv`
/// kernels (see `kernels.flash_tiling`).
pub type FlashTiling = [(usize, usize, usize); 3];

impl KernelsConfig {
    /// `kernels.flash_tiling` parsed; `None` for "" (the default tiling).
    pub fn flash_tiling(&self) -> Result<Option<FlashTiling>, String> {
        if self.flash_tiling.trim().is_empty() {
            return Ok(None);
        }
        parse_flash_tiling(&self.flash_tiling).map(Some)
    }

    /// The kernels keys' domains.
    fn domains(&self, d: &mut Domains) {
        if let Err(why) = self.flash_tiling() {
            d.check(
                "kernels.flash_tiling",
                format!("{:?}", self.flash_tiling),
                false,
                format!("\"\" or RxCxP,RxCxP,RxCxP ({why})"),
            );
        }
    }
}

/// `RxCxP,RxCxP,RxCxP` as three `(rows, cols, planes)`.
fn parse_flash_tiling(text: &str) -> Result<FlashTiling, String> {
    let shapes = text
        .split(',')
        .map(|part| {
            let n: Vec<usize> = part
                .trim()
                .split('x')
                .map(|v| {
                    v.trim()
                        .parse::<usize>()
                        .map_err(|e| format!("{part:?}: {e}"))
                })
                .collect::<Result<_, _>>()?;
            let [rows, cols, planes] = n[..] else {
                return Err(format!("{part:?} is not ROWSxCOLSxPLANES"));
            };
            let size = |v: usize| v > 0 && v <= 256 && v.is_multiple_of(16);
            if !size(rows) || !size(cols) || !(1..=16).contains(&planes) {
                return Err(format!(
                    "{part:?}: sizes are multiples of 16 up to 256, planes 1 to 16"
                ));
            }
            Ok((rows, cols, planes))
        })
        .collect::<Result<Vec<_>, _>>()?;
    shapes
        .try_into()
        .map_err(|v: Vec<_>| format!("three tilings (forward, dq, dk/dv), not {}", v.len()))
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
    /// Write checkpoints on a background thread: the step waits only for a host copy of
    /// the state; at most one save is in flight and every exit waits for it. `false` =
    /// the step waits for the files, fsync and rename.
    #[serde(rename = "async")]
    pub asynchronous: bool,
    /// Every rank snapshots its state every this many steps into node-local memory (the
    /// memory tier: a restarted rank resumes from it, or from a peer's, before it reads the
    /// run directory); written in the background, verified like a checkpoint; 0 = off.
    pub snapshot_interval: u64,
    /// Keep the newest this many memory snapshots per rank.
    pub snapshot_keep: usize,
    /// Node-local directory of the memory snapshots; empty = `/dev/shm` (else the system's
    /// temporary directory). Each run directory gets its own `kiln-<hash>` folder in it.
    pub snapshot_dir: String,
}

impl Default for CheckpointConfig {
    fn default() -> Self {
        Self {
            interval: 100,
            keep_latest_k: 3,
            resume: true,
            asynchronous: true,
            snapshot_interval: 5,
            snapshot_keep: 2,
            snapshot_dir: String::new(),
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
    /// Directory for cached blend indices; empty = `$KILN_DATA_CACHE` if set, else
    /// `.kiln-cache` beside the corpus list (shared by all ranks and runs that read it, and
    /// by `kiln data blend`).
    pub cache_dir: String,
    /// Verify every shard's full SHA-256 against the manifest at start (slow; the default
    /// checks sizes and a sampled hash).
    pub full_verify: bool,
    /// The `tokenizer.json` the corpus was tokenized with (a relative path is resolved from
    /// the working directory, else beside the config); `kiln export` ships it with the
    /// model. Empty = none recorded (the synthetic corpus has its own).
    pub tokenizer: String,
}

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
    /// Report each step's loss divided once more by the data-parallel rank count: the wrong
    /// reduction of a tensor-parallel run whose reported loss was the true loss over the
    /// data-parallel world size, injected so that the smoke gate is seen to catch it.
    pub wrong_loss_reduction: bool,
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

    /// Checks every numeric key's domain (finite, sign, range) and the rules that tie keys
    /// together; an error lists every key that is out of its domain with its value and the
    /// allowed range.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let mut d = Domains::default();
        self.model.domains(&mut d);
        self.optimizer.domains(&mut d);
        self.lr_scheduler.domains(&mut d);
        self.training.domains(&mut d);
        self.kernels.domains(&mut d);
        self.guards.domains(&mut d);
        self.other_domains(&mut d);
        // Rules between keys, checked once each key is in its own domain.
        if d.0.is_empty() {
            self.rules(&mut d);
        }
        d.into_result()
    }

    /// The domains of the parallelism, checkpoint, metrics and debug keys.
    fn other_domains(&self, d: &mut Domains) {
        d.at_least("parallelism.dp_replicate", self.parallelism.dp_replicate, 1);
        d.at_least("parallelism.tp", self.parallelism.tp, 1);
        d.at_least("checkpoint.keep_latest_k", self.checkpoint.keep_latest_k, 1);
        d.at_least("checkpoint.snapshot_keep", self.checkpoint.snapshot_keep, 1);
        d.at_least("metrics.log_interval", self.metrics.log_interval, 1);

        d.real(
            "debug.spike_scale",
            self.debug.spike_scale,
            Closed(f64::MIN),
            Closed(f64::MAX),
        );
        d.check(
            "parallelism.bucket_mb",
            self.parallelism.bucket_mb,
            (1..=MAX_BUCKET_MB).contains(&self.parallelism.bucket_mb),
            format!("an integer in [1, {MAX_BUCKET_MB}] (MiB; PyTorch DDP uses 25)"),
        );
    }

    /// The rules between keys, each key already in its domain.
    fn rules(&self, d: &mut Domains) {
        let (m, o, t) = (&self.model, &self.optimizer, &self.training);
        if !m.d_model.is_multiple_of(m.n_heads) {
            d.rule(format!(
                "model.d_model ({}) must be divisible by model.n_heads ({})",
                m.d_model, m.n_heads
            ));
        } else if !(m.d_model / m.n_heads).is_multiple_of(2) {
            d.rule(format!(
                "head dim model.d_model / model.n_heads = {} must be even for RoPE",
                m.d_model / m.n_heads
            ));
        }
        if !m.n_heads.is_multiple_of(m.n_kv_heads) {
            d.rule(format!(
                "model.n_kv_heads ({}) must divide model.n_heads ({})",
                m.n_kv_heads, m.n_heads
            ));
        }
        if o.lr * o.weight_decay >= 1.0 {
            d.rule(format!(
                "optimizer.lr x optimizer.weight_decay = {} must be < 1: decoupled decay multiplies each weight by 1 - lr x weight_decay per step",
                o.lr * o.weight_decay
            ));
        }
        for rule in self.parallelism.rules() {
            d.rule(rule);
        }
        let why = match o.kind {
            OptimizerKind::Adamw => None,
            OptimizerKind::Muon | OptimizerKind::Mano => Some("needs each matrix whole"),
            OptimizerKind::Sophiag => Some("estimates its Hessian from the whole logits"),
            OptimizerKind::Spam | OptimizerKind::ScheduleFreeAdamw => {
                Some("has not been validated on matrices cut over ranks yet")
            }
        };
        let model = (m.n_heads, m.n_kv_heads, m.ffn_hidden);
        let pieces = piece_sizes(t.batch_size, t.compute_shards);
        let optimizer = why.map(|why| (o.kind.name(), why));
        for rule in (self.parallelism).tensor_rules(model, &pieces, optimizer) {
            d.rule(rule);
        }
        if o.kind == OptimizerKind::ScheduleFreeAdamw {
            if self.lr_scheduler.kind != ScheduleKind::Constant {
                d.rule(format!(
                    "optimizer.kind = \"schedule_free_adamw\" replaces the decay schedule: set lr_scheduler.kind = \"constant\" (its warmup, lr_scheduler.warmup_steps, is the method's), not {:?}",
                    format!("{:?}", self.lr_scheduler.kind).to_lowercase()
                ));
            }
            if matches!(self.parallelism.shard, Shard::Optimizer | Shard::Gradients) {
                d.rule(format!(
                    "optimizer.kind = \"schedule_free_adamw\" publishes its average of the weights and its iterate, which parallelism.shard = {:?} keeps on different ranks (whole weights, sharded iterate): use parallelism.shard = \"parameters\" or \"none\"",
                    self.parallelism.shard.name()
                ));
            }
        }
        if self.parallelism.shard != Shard::None {
            let shard = self.parallelism.shard.name();
            if t.master_dtype != Precision::F32 {
                d.rule(format!(
                    "parallelism.shard = {shard:?} needs training.master_dtype = \"f32\" (its sharded update is f32 only)"
                ));
            }
        }
        let per_step = (t.batch_size as u128 * t.grad_accum_steps as u128)
            .max(u128::from(t.global_batch_size));
        let samples = u128::from(t.steps) * per_step;
        if samples > u128::from(MAX_SAMPLES) {
            d.rule(format!(
                "training.steps x sequences per step = {samples} sequences is more than the {MAX_SAMPLES} a run can address"
            ));
        }
    }
}

impl ModelConfig {
    /// The model keys' domains.
    fn domains(&self, d: &mut Domains) {
        let m = self;
        d.check(
            "model.vocab_size",
            m.vocab_size,
            m.vocab_size == 0 || (2..=MAX_VOCAB).contains(&m.vocab_size),
            format!("0 (take it from the data) or an integer in [2, {MAX_VOCAB}]"),
        );
        d.at_least("model.d_model", m.d_model, 1);
        d.at_least("model.n_layers", m.n_layers, 1);
        d.at_least("model.n_heads", m.n_heads, 1);
        d.at_least("model.n_kv_heads", m.n_kv_heads, 1);
        d.at_least("model.ffn_hidden", m.ffn_hidden, 1);
        d.real("model.rope_theta", m.rope_theta, Open(1.0), Inf);
        d.real("model.norm_eps", m.norm_eps, Open(0.0), Closed(1.0));
        d.real("model.init_std", m.init_std, Open(0.0), Closed(100.0));
    }
}

impl OptimizerConfig {
    /// The optimizer keys' domains.
    fn domains(&self, d: &mut Domains) {
        let o = self;
        d.real("optimizer.lr", o.lr, Open(0.0), Inf);
        d.real("optimizer.beta1", o.beta1, Closed(0.0), Open(1.0));
        d.real("optimizer.beta2", o.beta2, Closed(0.0), Open(1.0));
        d.real("optimizer.eps", o.eps, Open(0.0), Closed(1.0));
        d.real("optimizer.weight_decay", o.weight_decay, Closed(0.0), Inf);
        d.real("optimizer.max_grad_norm", o.max_grad_norm, Closed(0.0), Inf);
        d.real(
            "optimizer.muon.momentum",
            o.muon.momentum,
            Closed(0.0),
            Open(1.0),
        );
        d.check(
            "optimizer.muon.ns_steps",
            o.muon.ns_steps,
            (1..100).contains(&o.muon.ns_steps),
            "an integer in [1, 99] (5 is the usual)".into(),
        );
        d.real("optimizer.sophia.rho", o.sophia.rho, Open(0.0), Inf);
        d.at_least("optimizer.spam.reset_interval", o.spam.reset_interval, 1);
        d.real(
            "optimizer.mano.momentum",
            o.mano.momentum,
            Closed(0.0),
            Open(1.0),
        );
        d.real("optimizer.spam.threshold", o.spam.threshold, Open(0.0), Inf);
        d.at_least(
            "optimizer.sophia.hessian_interval",
            o.sophia.hessian_interval,
            1,
        );
    }
}

impl LrSchedulerConfig {
    /// The learning-rate schedule keys' domains.
    fn domains(&self, d: &mut Domains) {
        let l = self;
        d.real(
            "lr_scheduler.min_lr_ratio",
            l.min_lr_ratio,
            Closed(0.0),
            Closed(1.0),
        );
        d.real(
            "lr_scheduler.decay_ratio",
            l.decay_ratio,
            Closed(0.0),
            Closed(1.0),
        );
    }
}

impl TrainingConfig {
    /// The training keys' domains.
    fn domains(&self, d: &mut Domains) {
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

impl GuardsConfig {
    /// The guard keys' domains.
    fn domains(&self, d: &mut Domains) {
        let g = self;
        d.real(
            "guards.initial_loss_tolerance",
            g.initial_loss_tolerance,
            Open(0.0),
            Inf,
        );
        d.at_least("guards.max_nonfinite_in_row", g.max_nonfinite_in_row, 1);
        d.real("guards.spike_sigma", g.spike_sigma, Closed(0.0), Inf);
        d.real(
            "guards.spike_min_ratio",
            g.spike_min_ratio,
            Closed(0.0),
            Inf,
        );
        d.check(
            "guards.spike_window",
            g.spike_window,
            g.spike_window <= MAX_SPIKE_WINDOW,
            format!("an integer in [0, {MAX_SPIKE_WINDOW}] (0 or 1 disables the spike guard)"),
        );
    }
}

/// Largest config file read (a real one is a few KiB).
pub const MAX_CONFIG_BYTES: u64 = 16 * kiln_run::files::MIB;

/// Largest vocabulary: token ids must fit Megatron's int32 dtype.
pub const MAX_VOCAB: usize = i32::MAX as usize;
/// Most optimizer steps a run may ask for (far beyond any real run; keeps every
/// step-derived count well inside 64 bits).
pub const MAX_STEPS: u64 = 1_000_000_000_000;
/// Most sequences a run may draw (`steps x batch_size x grad_accum_steps`).
pub const MAX_SAMPLES: u64 = 1 << 56;
/// Largest gradient all-reduce bucket, MiB.
pub const MAX_BUCKET_MB: usize = 1 << 16;
/// Most compute shards per micro-batch (each is a thread).
pub const MAX_COMPUTE_SHARDS: usize = 256;
/// Longest spike-guard window.
pub const MAX_SPIKE_WINDOW: usize = 1_000_000;

/// One end of an allowed range of a real-valued key.
#[derive(Clone, Copy)]
enum Bound {
    /// The end itself is allowed.
    Closed(f64),
    /// Only values strictly inside.
    Open(f64),
    /// No bound (but the value must be finite).
    Inf,
}
use Bound::{Closed, Inf, Open};

/// One key whose value is outside its domain.
#[derive(Debug, Clone, PartialEq)]
pub struct OutOfDomain {
    /// `section.key`, or empty for a rule between keys.
    pub key: String,
    /// The value as given.
    pub value: String,
    /// What is allowed (or, for a rule, what is wrong).
    pub allowed: String,
}

impl std::fmt::Display for OutOfDomain {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.key.is_empty() {
            write!(f, "{}", self.allowed)
        } else {
            write!(f, "{} = {}: must be {}", self.key, self.value, self.allowed)
        }
    }
}

/// Collects the keys out of their domains, so one error names them all.
#[derive(Default)]
struct Domains(Vec<OutOfDomain>);

impl Domains {
    fn check(&mut self, key: &str, value: impl std::fmt::Display, ok: bool, allowed: String) {
        if !ok {
            self.0.push(OutOfDomain {
                key: key.into(),
                value: value.to_string(),
                allowed,
            });
        }
    }

    fn at_least<T: PartialOrd + std::fmt::Display + Copy>(&mut self, key: &str, v: T, min: T) {
        self.check(key, v, v >= min, format!("an integer >= {min}"));
    }

    /// A finite real in the range `lo .. hi`.
    fn real(&mut self, key: &str, v: f64, lo: Bound, hi: Bound) {
        let above = match lo {
            Closed(x) => v >= x,
            Open(x) => v > x,
            Inf => true,
        };
        let below = match hi {
            Closed(x) => v <= x,
            Open(x) => v < x,
            Inf => true,
        };
        let allowed = match (lo, hi) {
            (Closed(f64::MIN), Closed(f64::MAX)) => "a finite number".to_string(),
            (Closed(a), Inf) => format!("a finite number >= {a}"),
            (Open(a), Inf) => format!("a finite number > {a}"),
            (lo, hi) => {
                let l = match lo {
                    Closed(a) => format!("[{a}"),
                    Open(a) => format!("({a}"),
                    Inf => "(-inf".into(),
                };
                let h = match hi {
                    Closed(b) => format!("{b}]"),
                    Open(b) => format!("{b})"),
                    Inf => "inf)".into(),
                };
                format!("a finite number in {l}, {h}")
            }
        };
        self.check(key, v, v.is_finite() && above && below, allowed);
    }

    /// A rule between keys that does not hold.
    fn rule(&mut self, what: String) {
        self.0.push(OutOfDomain {
            key: String::new(),
            value: String::new(),
            allowed: what,
        });
    }

    fn into_result(self) -> Result<(), ConfigError> {
        if self.0.is_empty() {
            Ok(())
        } else {
            Err(ConfigError::OutOfDomain(self.0))
        }
    }
}

/// With `model.init_from` set, takes the model keys from the Hugging Face directory's
/// `config.json` ([`crate::hf_dir::HfShape`]) into `table`: a key the file (`origin`) or
/// an override already sets to another value is an error naming both; `data.tokenizer`
/// defaults to the directory's `tokenizer.json`.
fn resolve_init_from(
    table: &mut toml::Table,
    origin: &str,
    overrides: &[String],
    run_dir: Option<&Path>,
) -> Result<(), ConfigError> {
    use crate::hf_dir as hf;
    let Some(dir) = table
        .get("model")
        .and_then(|m| m.get("init_from"))
        .and_then(toml::Value::as_str)
        .filter(|d| !d.is_empty())
        .map(str::to_string)
    else {
        return Ok(());
    };
    let invalid = |message: String| ConfigError::Invalid {
        origin: format!("model.init_from = {dir:?}"),
        message,
    };
    if !Path::new(&dir).is_dir() {
        return shape_without_init_from(table, &dir, run_dir).map_err(invalid);
    }
    let shape = hf::HfShape::read(Path::new(&dir)).map_err(|e| invalid(e.to_string()))?;
    let json = Path::new(&dir).join(hf::CONFIG_JSON);
    let model = table
        .entry("model")
        .or_insert_with(|| toml::Value::Table(toml::Table::new()))
        .as_table_mut()
        .ok_or_else(|| invalid("[model] is not a table".into()))?;
    let mut conflicts = Vec::new();
    for (key, value, hf_key) in shape.keys() {
        match model.get(key) {
            Some(given) if !hf::same_value(given, &value) => {
                // The last override of the key is what set it; else the file did.
                let set = overrides.iter().rev().find(|o| {
                    o.split_once('=')
                        .is_some_and(|(k, _)| k.trim() == format!("model.{key}"))
                });
                let by = match set {
                    Some(o) => format!("--set {o}"),
                    None => format!("model.{key} = {given} in {origin}"),
                };
                conflicts.push(format!(
                    "{by} conflicts with {hf_key} = {value} in {} (the model's shape comes from model.init_from; drop the setting or make it match)",
                    json.display()
                ));
            }
            _ => {
                model.insert(key.to_string(), value);
            }
        }
    }
    if !conflicts.is_empty() {
        return Err(invalid(conflicts.join("; ")));
    }
    let tokenizer = Path::new(&dir).join(hf::TOKENIZER_JSON);
    let data = table
        .entry("data")
        .or_insert_with(|| toml::Value::Table(toml::Table::new()))
        .as_table_mut();
    if let Some(data) = data
        && !data.contains_key("tokenizer")
        && tokenizer.is_file()
    {
        data.insert(
            "tokenizer".into(),
            toml::Value::String(tokenizer.display().to_string()),
        );
    }
    Ok(())
}

/// The model's shape when `model.init_from`'s directory `dir` is gone (only a fresh start
/// reads its weights; a run resuming from its checkpoint needs only the shape): the keys of
/// a config that recorded them (`table` itself: a run's `config.toml`), else those the run in
/// `run_dir` recorded when it started from `dir`. An error saying so when neither has them.
fn shape_without_init_from(
    table: &mut toml::Table,
    dir: &str,
    run_dir: Option<&Path>,
) -> Result<(), String> {
    use crate::hf_dir::HfShape;
    let model = |t: &toml::Table| t.get("model").and_then(toml::Value::as_table).cloned();
    let has_shape = |m: &toml::Table| HfShape::KEYS.iter().all(|k| m.contains_key(*k));
    if model(table).is_some_and(|m| has_shape(&m)) {
        return Ok(());
    }
    let recorded_path = run_dir.map(|d| d.join(kiln_run::layout::CONFIG));
    let recorded = (recorded_path.as_ref())
        .and_then(|p| std::fs::read_to_string(p).ok())
        .and_then(|text| toml::from_str::<toml::Table>(&text).ok())
        .and_then(|t| model(&t))
        .filter(|m| m.get("init_from").and_then(toml::Value::as_str) == Some(dir))
        .filter(has_shape);
    let Some(recorded) = recorded else {
        return Err(format!(
            "{dir} is not a directory: a fresh start reads its weights and config.json; a run that started from it resumes without it (its run directory's config.toml recorded the model's shape: the same command with that --run-dir, or `kiln train RUN_DIR/config.toml`)"
        ));
    };
    let given = model(table).unwrap_or_default();
    let mut merged = given.clone();
    for key in HfShape::KEYS {
        match (given.get(key), recorded.get(key)) {
            (Some(g), Some(r)) if g != r => {
                return Err(format!(
                    "model.{key} = {g} differs from {r}, which the run recorded from {dir} in {} (the folder is gone; drop the setting or make it match)",
                    recorded_path.map_or_else(String::new, |p| p.display().to_string())
                ));
            }
            (None, Some(r)) => {
                merged.insert(key.to_string(), r.clone());
            }
            _ => {}
        }
    }
    table.insert("model".into(), toml::Value::Table(merged));
    Ok(())
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
    /// Issue 60: `--print-config` left out the keys the recorded config skips at their
    /// defaults; it names every key a config sets when none is at its default.
    #[test]
    fn every_key_is_printed() {
        let keys = |text: &str| -> Vec<String> {
            let t: toml::Table = toml::from_str(text).unwrap();
            let mut out: Vec<String> = t
                .iter()
                .flat_map(|(s, v)| {
                    let inner = v.as_table().cloned().unwrap_or_default();
                    inner.keys().map(|k| format!("{s}.{k}")).collect::<Vec<_>>()
                })
                .collect();
            out.sort();
            out
        };
        let mut set = Config::default();
        set.model.init_from = "hf".into();
        set.training.activation_checkpointing = ActivationCheckpointing::Blocks;
        set.training.device_memory_gb = 80.0;
        set.metrics.tensorboard = true;
        let printed = Config::default().to_toml_every_key();
        assert_eq!(keys(&printed), keys(&set.to_toml()));
        assert!(printed.contains("tensorboard = false"), "{printed}");
        assert_eq!(
            Config::from_toml(&printed, "printed").unwrap(),
            Config::default()
        );
    }

    #[test]
    fn flash_tilings_parse_and_bad_ones_are_refused() {
        assert_eq!(
            parse_flash_tiling("64x64x4, 64x32x4,32x32x2"),
            Ok([(64, 64, 4), (64, 32, 4), (32, 32, 2)])
        );
        for bad in [
            "64x64x4",
            "64x64x4,64x32x4",
            "64x64x4,64x32x4,32x32x4,16x16x1",
            "64x64,64x32x4,32x32x4",
            "60x64x4,64x32x4,32x32x4",
            "64x64x0,64x32x4,32x32x4",
            "512x64x4,64x32x4,32x32x4",
            "64x64xa,64x32x4,32x32x4",
        ] {
            assert!(parse_flash_tiling(bad).is_err(), "{bad:?}");
            let mut c = Config::default();
            c.kernels.flash_tiling = bad.into();
            let e = c.validate().unwrap_err().to_string();
            assert!(e.contains("kernels.flash_tiling"), "{e}");
        }
        let mut c = Config::default();
        c.kernels.flash_tiling = " ".into();
        assert_eq!(c.kernels.flash_tiling(), Ok(None));
    }

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
    fn collectives_are_chosen_by_name() {
        let c = Config::load(None, &["parallelism.collectives=device".into()]).unwrap();
        assert_eq!(c.parallelism.collectives, Collectives::Device);
        let err = Config::load(None, &["parallelism.collectives=nccl".into()])
            .unwrap_err()
            .to_string();
        assert!(err.contains("collectives") && err.contains("nccl"), "{err}");
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

    #[test]
    fn sharding_refuses_what_it_cannot_shard_naming_the_keys() {
        let refused = |extra: &str| {
            let sets = ["parallelism.shard=gradients".to_string(), extra.to_string()];
            Config::load(None, &sets).unwrap_err().to_string()
        };
        for kind in ["muon", "sophiag"] {
            let sets = [
                "parallelism.shard=parameters".into(),
                format!("optimizer.kind={kind}"),
            ];
            assert!(Config::load(None, &sets).is_ok(), "{kind} shards");
        }
        let err = refused("training.master_dtype=bf16");
        assert!(err.contains("training.master_dtype"), "{err}");
        let err = Config::load(None, &["parallelism.shard=params".into()])
            .unwrap_err()
            .to_string();
        assert!(err.contains("params"), "{err}");
        let err = Config::load(None, &["parallelism.dp_replicate=2".into()])
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("parallelism.dp_replicate") && err.contains("parallelism.shard"),
            "{err}"
        );
        let err = refused("parallelism.dp_replicate=0");
        assert!(err.contains("parallelism.dp_replicate"), "{err}");
        let sharded = Config::load(None, &["parallelism.shard=optimizer".into()]).unwrap();
        assert_eq!(sharded.effective_checkpoint().snapshot_interval, 0);
        assert_eq!(
            Config::default().effective_checkpoint(),
            Config::default().checkpoint
        );
    }

    fn domain_error(set: &str) -> String {
        match Config::load(None, &[set.to_string()]) {
            Err(ConfigError::OutOfDomain(v)) => v
                .iter()
                .map(|d| d.to_string())
                .collect::<Vec<_>>()
                .join("; "),
            other => panic!("{set}: {other:?}"),
        }
    }

    #[test]
    fn every_numeric_key_is_checked_against_its_domain() {
        for (set, want) in [
            (
                "model.vocab_size=1",
                "model.vocab_size = 1: must be 0 (take it from the data)",
            ),
            (
                "model.d_model=0",
                "model.d_model = 0: must be an integer >= 1",
            ),
            (
                "model.rope_theta=nan",
                "model.rope_theta = NaN: must be a finite number > 1",
            ),
            ("model.rope_theta=1", "model.rope_theta = 1"),
            (
                "model.norm_eps=0",
                "model.norm_eps = 0: must be a finite number in (0, 1]",
            ),
            (
                "model.init_std=-0.1",
                "model.init_std = -0.1: must be a finite number in (0, 100]",
            ),
            (
                "optimizer.lr=-1",
                "optimizer.lr = -1: must be a finite number > 0",
            ),
            (
                "optimizer.beta1=nan",
                "optimizer.beta1 = NaN: must be a finite number in [0, 1)",
            ),
            ("optimizer.eps=0", "optimizer.eps = 0"),
            (
                "optimizer.weight_decay=-0.1",
                "optimizer.weight_decay = -0.1: must be a finite number >= 0",
            ),
            (
                "optimizer.max_grad_norm=inf",
                "optimizer.max_grad_norm = inf",
            ),
            (
                "lr_scheduler.min_lr_ratio=1.5",
                "lr_scheduler.min_lr_ratio = 1.5",
            ),
            (
                "lr_scheduler.decay_ratio=nan",
                "lr_scheduler.decay_ratio = NaN",
            ),
            (
                "training.steps=0",
                "training.steps = 0: must be an integer in [1, 1000000000000]",
            ),
            ("training.batch_size=0", "training.batch_size = 0"),
            ("training.seq_len=0", "training.seq_len = 0"),
            (
                "training.grad_accum_steps=0",
                "training.grad_accum_steps = 0",
            ),
            (
                "training.threads=100000",
                "training.threads = 100000: must be 0 (all cores)",
            ),
            (
                "training.compute_shards=0",
                "training.compute_shards = 0: must be an integer in [1, 256]",
            ),
            ("training.peak_flops=-1", "training.peak_flops = -1"),
            ("checkpoint.keep_latest_k=0", "checkpoint.keep_latest_k = 0"),
            ("metrics.log_interval=0", "metrics.log_interval = 0"),
            (
                "guards.initial_loss_tolerance=0",
                "guards.initial_loss_tolerance = 0",
            ),
            (
                "guards.max_nonfinite_in_row=0",
                "guards.max_nonfinite_in_row = 0",
            ),
            ("guards.spike_sigma=-1", "guards.spike_sigma = -1"),
            ("guards.spike_min_ratio=nan", "guards.spike_min_ratio = NaN"),
            (
                "guards.spike_window=10000000",
                "guards.spike_window = 10000000",
            ),
            (
                "debug.spike_scale=nan",
                "debug.spike_scale = NaN: must be a finite number",
            ),
            (
                "optimizer.weight_decay=1200",
                "optimizer.lr x optimizer.weight_decay = 1.2",
            ),
            (
                "training.batch_size=1000000000000000",
                "sequences is more than the",
            ),
        ] {
            let err = domain_error(set);
            assert!(err.contains(want), "{set}: {err}");
        }
        // Every offender is listed, in one error.
        let err = Config::load(
            None,
            &["optimizer.eps=nan".into(), "model.norm_eps=-1".into()],
        )
        .unwrap_err()
        .to_string();
        assert!(
            err.starts_with("config: model.norm_eps = -1") && err.contains("; optimizer.eps = NaN"),
            "{err}"
        );
        // Edges that are allowed.
        for ok in [
            "model.vocab_size=2",
            "optimizer.beta1=0",
            "optimizer.weight_decay=0",
            "lr_scheduler.min_lr_ratio=0",
            "lr_scheduler.min_lr_ratio=1",
            "training.threads=0",
            "eval.samples=0",
            "guards.spike_sigma=0",
        ] {
            assert!(Config::load(None, &[ok.into()]).is_ok(), "{ok}");
        }
    }
}

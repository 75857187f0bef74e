//! What a run asks of the machine, checked before anything is allocated: the memory of the
//! model, its optimizer and one step, estimated from the config alone and compared with the
//! memory this process may use ([`kiln_run::host::available_memory`]); and the worker
//! threads. A config that cannot fit is refused with the estimate, the limit and the key to
//! change, instead of an allocation abort (`memory allocation of N bytes failed`, exit 134)
//! after minutes of work.
//!
//! # The estimate
//!
//! All tensors are f32. With `P` parameters, `s` compute shards, `N = batch_size x seq_len`
//! tokens per micro-batch, `L` layers, width `d`, SwiGLU width `f`, key/value width `kv`,
//! `H` heads, sequence `T`, vocabulary `V`:
//!
//! | part | bytes | why |
//! | --- | --- | --- |
//! | weights + AdamW moments | `12 P` | always live |
//! | rollback snapshot | `12 P` | weights and moments, when `guards.snapshot_interval > 0` |
//! | frozen-parameter check | `4 P` | the previous weights, when `guards.frozen_check_interval > 0` |
//! | step: weights and gradients | `4 P (2 s + 1)` | per shard an autodiff copy and its gradients, plus their sum |
//! | step: activations | `4 N (L (24 d + 5 f + 6 kv + 3 H T) + 2 H T + 3.5 V + 2 d)` | saved for backward per token and layer (norms, projections, RoPE temporaries, SwiGLU, attention scores and softmax), one layer's score gradients, and the logits with their log-softmax and gradient |
//! | checkpoint | `32 P` | weights and moments copied to the host, serialised, the final weights |
//! | eval | `4 N (24 d + 5 f + 3 H T + 3 V)` | forward only, one layer live at a time |
//! | memory snapshots | `12 P (K + 2)` less what the store holds | a training rank's memory tier when it is on a memory file system (tmpfs, `/dev/shm`): `checkpoint.snapshot_keep` = K copies of weights and moments, one more while the next is written, one at the guards' rollback point (none with `guards.snapshot_interval = 0`); snapshots already there are out of the available memory already |
//!
//! Sharded (`parallelism.shard`, over `R` ranks: the job's, or with `parallelism.dp_replicate`
//! = D replicas the job's ranks / D of one replica): each rank keeps the whole weights but only
//! `1/R` of AdamW's moments, so the weights + moments part is `4 P + 8 P / R`, the rollback
//! snapshot likewise, and a checkpoint copies `4 P` of weights three times (host copy,
//! serialised, final) on rank 0 and `8 P / R` twice (its shard, serialised) on every rank.
//! Parameters sharded too (`parallelism.shard = "parameters"`): weights, moments, the
//! rollback snapshot and the frozen check's copy are all `1/R`; the step holds one stage's
//! whole weights (the largest of the embedding, a block, the head: `S` parameters) with their
//! autodiff copy and two copies of their gradients (`16 S`; `20 S` with
//! `parallelism.prefetch`, which holds the next stage's weights too), this rank's accumulated
//! gradients (`4 P / R`) and, as activations, every block's input (`4 N L d`) plus one
//! block's and the head's; a checkpoint copies `24 P / R` (its shards, serialised), and the
//! final weights, gathered to the writer rank, `8 P` (host copy, serialised).
//! Tensor parallelism (`parallelism.tp`): a rank holds `1/tp` of every part above that scales
//! with `P` (the matrices are cut; the norms, a negligible share, are counted cut too), and of
//! a layer's activations but the two block inputs it gathers whole (`2 d` a token); the
//! logits and eval are `1/tp`; the data-parallel ranks that shard the state are the job's
//! over `tp`. When a run does not fit, the least `tp` that would is named beside the
//! sharding advice.
//! With `training.activation_checkpointing = "blocks"` the activations are those of the
//! parameter-sharded step: every block's input plus one block's and the head's.
//! When a run does not fit, the error names the least sharding (`"gradients"`, then
//! `"parameters"`) that would make it fit on these ranks, or the fewest ranks one would, or
//! with hybrid sharding the most replicas (`parallelism.dp_replicate`) that would.
//!
//! The need is the always-live parts plus the largest of (step, checkpoint, eval), times
//! [`SAFETY`], plus the memory snapshots (files of a known size), plus [`OVERHEAD`] for the
//! program itself. On an accelerator (`training.device` a GPU) the weights, moments, step and
//! eval are in the device's memory, so the host's need is the checkpoint's host copies,
//! the snapshots and the overhead (counting the rest on the host would refuse a 1B-class run
//! on an H200 for 177 GiB of host memory it never uses), and the device's memory has an
//! estimate of its own ([`device_estimate_on`], below). When the snapshots are what does not
//! fit, the error names `checkpoint.snapshot_keep`, `checkpoint.snapshot_dir` and
//! `checkpoint.snapshot_interval`.
//!
//! # The device estimate (accelerators)
//!
//! Per rank, in the device's memory, with `b` bytes per saved activation (2 with
//! `training.dtype = "bf16"`, else 4) and `c` bytes per weight cast for the products (2 with
//! bf16, else 0). On GPUs attention saves each row's log-sum-exp, not its scores, and the
//! head's logits are never whole (kiln's chunked kernels), so the activations are
//! `b N L (24 d + 5 f + 6 kv)` (with activation checkpointing, or parameters sharded: every
//! block's input in f32, `4 N L d`, plus one block's) plus one attention chunk's scores
//! (at most 256 MiB, four of them live) and one head chunk's logits (16 Mi, three live):
//!
//! | mode | always live | during the backward pass | exchange and update (activations freed) |
//! | --- | --- | --- | --- |
//! | `none` | `12 P` (+ snapshot `12 P`, frozen check `4 P`) | gradients `4 P`, casts `c P`, activations | gradients packed into buckets: `4 P` more |
//! | `optimizer` | `4 P + 8 P / R` | the same | the packed gradients; then the gathered weights, `4 P` |
//! | `gradients` | `4 P + 8 P / R` | the same | the packed gradients and this rank's shard `4 P / R`; then the gathered weights |
//! | `parameters` | `12 P / R` | this rank's gradient shard `4 P / R`, a stage's weights gathered (two: the next one is gathered ahead), cast, their gradients and two packed reduce-scatters in flight: `(16 + c) S`, staged activations | — |
//!
//! plus [`DEVICE_CONTEXT`] (the CUDA context, cuBLAS's and NCCL's buffers), the sum times
//! [`SAFETY`]. Calibrated on the one measurement there is: the 1B-class model (0.85B, batch 4
//! x 2048, bf16 on f32 masters, replicated) on an H200 peaked at 34,966 MiB (nvidia-smi); the
//! table gives 36.1 GiB before the safety factor (6 % above). The limit is `training.device_memory_gb`,
//! else the device's total memory as CUDA reports it (other accelerators: unchecked), divided
//! among the ranks of a node that share one device. A run that does not fit is refused
//! naming the least sharding mode, or the fewest ranks, that would fit, as on the host.
//!
//! Calibrated against the peak resident memory (VmHWM) of 2-step runs with a checkpoint and
//! an eval, on the flex backend (2 cores, AVX-512). The need is above every measured peak,
//! at most about 2x above it (the 256 MiB overhead dominates tiny runs):
//!
//! | run (defaults unless named) | need | measured peak |
//! | --- | --- | --- |
//! | default (0.8M params, 16 x 64) | 425 MiB | 120 MiB |
//! | seq_len 1024, batch 4 | 1.8 GiB | 1074 MiB |
//! | d 64, 4 heads, 2 layers, seq_len 2048, batch 1 | 948 MiB | 477 MiB |
//! | vocab 65536, d 64, 1 layer | 1.8 GiB | 1061 MiB |
//! | d 1024, 8/8 heads, 2 layers, ffn 256, batch 8 | 1000 MiB | 620 MiB |
//! | ffn 16384 | 3.3 GiB | 2061 MiB |
//! | d 1024, 2 layers, ffn 4096 (34M params), batch 1 x 8 | 2.6 GiB | 1842 MiB |
//! | the same without snapshot and frozen check | 2.0 GiB | 1447 MiB |
//! | bench model (16M params), batch 4 / 8 / 12 x 256 | 1.8 / 2.6 / 3.3 GiB | 1227 / 1223 / 1840 MiB |

use crate::config::{ActivationCheckpointing, Config, ConfigError, ModelConfig, Shard};
use kiln_run::host::{MemoryLimit, human_bytes};
use std::path::Path;

/// Factor on the estimate: allocator fragmentation, temporaries the table does not list.
pub const SAFETY: f64 = 1.25;
/// Memory of the program itself (code, thread stacks, the data loader's maps), bytes.
pub const OVERHEAD: f64 = 256.0 * 1024.0 * 1024.0;
/// Device memory that is not tensors: the CUDA context, cuBLAS's workspaces, NCCL's
/// buffers, bytes.
pub const DEVICE_CONTEXT: f64 = 1024.0 * 1024.0 * 1024.0;
/// f32 scores of one chunk of attention by products on a GPU (kernels/cube/attention_mm.rs).
const ATTENTION_CHUNK: f64 = 256.0 * 1024.0 * 1024.0;
/// Logits of one chunk of the output head + cross-entropy (kernels/cube/heads.rs), f32.
const HEAD_CHUNK: f64 = 4.0 * 16.0 * 1024.0 * 1024.0;

/// The memory a run needs, by part (bytes, before [`SAFETY`] and [`OVERHEAD`]).
#[derive(Debug, Clone, PartialEq)]
pub struct Estimate {
    /// Parameters of the model.
    pub params: f64,
    /// Weights, AdamW moments, snapshot and frozen-check copies: live all the time.
    pub resident: f64,
    /// Gradients and saved activations of one micro-batch: live during a step.
    pub step: f64,
    /// Of which activations.
    pub activations: f64,
    /// Host copies written at a checkpoint.
    pub checkpoint: f64,
    /// One eval forward pass.
    pub eval: f64,
    /// Memory snapshots still to be written to a memory file system (see [`snapshot_bytes`];
    /// 0 outside a training rank's check).
    pub snapshots: f64,
    /// Whether the weights, moments, step and eval live in an accelerator's memory (a GPU
    /// device): then only the checkpoint's host copies and the snapshots are host memory.
    pub on_accelerator: bool,
}

impl Estimate {
    /// Host bytes needed, safety factor and overhead included.
    pub fn need(&self) -> f64 {
        let live = if self.on_accelerator {
            self.checkpoint
        } else {
            self.resident + self.step.max(self.checkpoint).max(self.eval)
        };
        live * SAFETY + self.snapshots + OVERHEAD
    }
}

/// Whether `device` (a `training.device` name) keeps its tensors in an accelerator's own
/// memory rather than this process's: every device but flex and CubeCL's CPU runtime.
pub fn on_accelerator(device: &str) -> bool {
    !matches!(
        device.split(':').next().unwrap_or(device),
        "flex" | "cpu" | "cubecl-cpu"
    )
}

/// The RAM the memory tier of a training rank whose snapshots go to `store` adds:
/// `checkpoint.snapshot_keep + 1` copies of the weights and AdamW moments (`12 P` bytes each;
/// the newest is written before the oldest is pruned), one more for the guards' rollback
/// point when rollbacks are on (`guards.snapshot_interval`), less the bytes the store holds now
/// (already out of the available memory). 0 when snapshots are off or `store` is not on a
/// memory file system (then they cost disk, not RAM), and in a sharded run (no memory tier:
/// [`Config::effective_checkpoint`]).
pub fn snapshot_bytes(config: &Config, params: f64, store: &Path) -> f64 {
    let c = config.effective_checkpoint();
    if c.snapshot_interval == 0 || !kiln_run::host::in_memory_fs(store) {
        return 0.0;
    }
    let rollback_point = usize::from(config.guards.snapshot_interval > 0);
    let copies = (c.snapshot_keep.max(1) + 1 + rollback_point) as f64;
    (copies * 12.0 * params - held_bytes(store, 2)).max(0.0)
}

/// Bytes of the files under `dir`, `depth` levels down (a store: `step-N/<files>`).
fn held_bytes(dir: &Path, depth: u32) -> f64 {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return 0.0;
    };
    let mut total = 0.0;
    for e in entries.flatten() {
        match e.file_type() {
            Ok(t) if t.is_file() => total += e.metadata().map_or(0, |m| m.len()) as f64,
            Ok(t) if t.is_dir() && depth > 0 => total += held_bytes(&e.path(), depth - 1),
            _ => {}
        }
    }
    total
}

/// Parameters of the Llama of `model` with `vocab` tokens (what `Llama::new` would lay out,
/// computed without building it, so that absurd sizes cost nothing).
pub fn param_count(model: &ModelConfig, vocab: usize) -> f64 {
    let d = model.d_model as f64;
    let hd = d / model.n_heads.max(1) as f64;
    let kv = model.n_kv_heads as f64 * hd;
    let f = model.ffn_hidden as f64;
    let per_layer = 2.0 * d // the two norms
        + d * d + 2.0 * d * kv + d * d // q, k, v, o
        + if model.qk_norm { 2.0 * hd } else { 0.0 }
        + 3.0 * d * f; // gate, up, down
    let head = if model.tie_embeddings {
        0.0
    } else {
        d * vocab as f64
    };
    vocab as f64 * d + model.n_layers as f64 * per_layer + d + head
}

/// The memory estimate of `config` with a vocabulary of `vocab` (see the module docs), for
/// one rank of a job of `ranks` ranks (the mesh's; 1 outside a job).
pub fn estimate(config: &Config, vocab: usize, ranks: usize) -> Estimate {
    estimate_on(config, vocab, ranks)
}

/// Tensor parallelism's share of one rank: its `1/tp` of the parameters (the matrices are
/// cut; the norms, under 0.1 % of a model, are counted cut too), the data-parallel ranks
/// (`ranks / tp`), and a factor on what the step keeps per token of a layer.
struct TensorShare {
    tp: f64,
    dp_ranks: usize,
}

impl TensorShare {
    fn of(config: &Config, ranks: usize) -> Self {
        let tp = config.parallelism.tp.max(1);
        Self {
            tp: tp as f64,
            dp_ranks: (ranks / tp).max(1),
        }
    }

    /// A layer's activations per token on one rank: its heads' and hidden units' share, plus
    /// the two block inputs gathered whole (sequence parallelism keeps `1/tp` of the rest).
    fn layer(&self, per_token_layer: f64, d: f64) -> f64 {
        match self.tp {
            1.0 => per_token_layer,
            tp => per_token_layer / tp + 2.0 * d,
        }
    }
}

/// [`estimate`] for one of `ranks` ranks (what sharding and tensor parallelism leave to each).
pub fn estimate_on(config: &Config, vocab: usize, ranks: usize) -> Estimate {
    let m = &config.model;
    let t = &config.training;
    let g = &config.guards;
    let share = TensorShare::of(config, ranks);
    let ranks = share.dp_ranks;
    let p = param_count(m, vocab) / share.tp;
    let (d, f, v) = (m.d_model as f64, m.ffn_hidden as f64, vocab as f64);
    let (heads, layers) = (m.n_heads as f64, m.n_layers as f64);
    let kv = m.n_kv_heads as f64 * d / heads.max(1.0);
    let seq = t.seq_len as f64;
    let tokens = t.batch_size as f64 * seq;
    let snapshot = if g.snapshot_interval > 0 { 12.0 } else { 0.0 };
    let frozen = if g.frozen_check_interval > 0 {
        4.0
    } else {
        0.0
    };
    let shards = t.compute_shards.clamp(1, t.batch_size.max(1)) as f64;
    let scores = heads * seq; // attention scores per token and layer
    let per_token_layer = share.layer(24.0 * d + 5.0 * f + 6.0 * kv + 3.0 * scores, d);
    // Saved for backward in every layer, plus the gradients of one layer's scores and the
    // logits' softmax and gradient while the backward pass runs.
    let head = (2.0 * scores + 3.5 * v) / share.tp + 2.0 * d;
    // Every block's input kept, one block's activations (recomputed) and the head's: a
    // parameter-sharded step, or activation checkpointing.
    let staged = 4.0 * tokens * (layers * d + per_token_layer + head);
    let activations = match t.activation_checkpointing {
        ActivationCheckpointing::Blocks => staged,
        ActivationCheckpointing::None => 4.0 * tokens * (layers * per_token_layer + head),
    };
    // The held-out eval runs micro-batches of batch_size rows, forward only.
    let eval = 4.0 * tokens * (24.0 * d + 5.0 * f + 3.0 * heads * seq + 3.0 * v) / share.tp;
    // The state is cut over the ranks of one replica (`parallelism.dp_replicate`).
    let r = (ranks / config.parallelism.dp_replicate.max(1)).max(1) as f64;
    // Per shard: the autodiff copy of the weights and their gradients; plus the sum.
    let replicated_step = 4.0 * p * (2.0 * shards + 1.0) + activations;
    // Weights + moments and what a checkpoint copies, per parameter, and the step, on one
    // rank (see the module docs).
    let (state, checkpoint, step, activations) = match config.parallelism.shard {
        Shard::None => (12.0, 32.0, replicated_step, activations),
        Shard::Optimizer | Shard::Gradients => {
            let moments = 8.0 / r;
            (
                4.0 + moments,
                12.0 + 2.0 * moments,
                replicated_step,
                activations,
            )
        }
        Shard::Parameters => {
            // One stage's whole weights, their autodiff copy, gradients and flattened
            // gradients (and the next stage's weights when they are fetched ahead); this
            // rank's accumulated gradient pieces.
            let stages = if config.parallelism.prefetch {
                20.0
            } else {
                16.0
            };
            let step = stages * largest_stage(m, vocab) / share.tp + 4.0 * p / r + staged;
            ((12.0 / r), (24.0 / r).max(8.0), step, staged)
        }
    };
    let snapshot = snapshot / 12.0 * state;
    let frozen = match config.parallelism.shard {
        Shard::Parameters => frozen / r,
        _ => frozen,
    };
    Estimate {
        params: p,
        resident: p * (state + snapshot + frozen),
        step,
        activations,
        checkpoint: checkpoint * p,
        eval,
        snapshots: 0.0,
        on_accelerator: on_accelerator(&t.device),
    }
}

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
fn ranks_per_device() -> usize {
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
fn device_memory(device: &str) -> Option<(f64, String)> {
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
fn device_verdict(
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

/// Parameters of the largest stage (the embedding, a block, the head) of the Llama of
/// `model`: what a parameter-sharded rank gathers at once.
fn largest_stage(model: &ModelConfig, vocab: usize) -> f64 {
    let one_layer = ModelConfig {
        n_layers: 1,
        tie_embeddings: true,
        ..model.clone()
    };
    let d = model.d_model as f64;
    let embed = vocab as f64 * d;
    let block = param_count(&one_layer, vocab) - embed - d;
    // The final norm and the head's own matrix, or with tied embeddings the embedding it
    // reads: as large, and larger than the embedding stage.
    let head = d + embed;
    block.max(head)
}

/// What sharding would do for a run that does not fit in `limit` bytes of host memory: more
/// of it ([`mode_advice`]), else fewer replicas ([`replica_advice`]); `None` when neither fits.
fn sharding_advice(config: &Config, vocab: usize, ranks: usize, limit: f64) -> Option<String> {
    let need = |c: &Config, r: usize| estimate_on(c, vocab, r).need();
    sharding_advice_by(config, ranks, limit, &need)
}

/// [`sharding_advice`] for the memory `need` says a config takes on a rank of so many.
fn sharding_advice_by(
    config: &Config,
    ranks: usize,
    limit: f64,
    need: &dyn Fn(&Config, usize) -> f64,
) -> Option<String> {
    let tp = tensor_advice(config, ranks, limit, need);
    let more = mode_advice(config, ranks, limit, need)
        .or_else(|| replica_advice(config, ranks, limit, need));
    match (tp, more) {
        (None, None) => None,
        (a, b) => Some(a.unwrap_or_default() + &b.unwrap_or_default()),
    }
}

/// The least tensor parallelism beyond the config's (`parallelism.tp`, dividing these
/// ranks and what the model's rules ask it to divide) that fits on these ranks.
fn tensor_advice(
    config: &Config,
    ranks: usize,
    limit: f64,
    need_of: &dyn Fn(&Config, usize) -> f64,
) -> Option<String> {
    let tp = (config.parallelism.tp + 1..=ranks).find(|&tp| {
        let mut cut = config.clone();
        cut.parallelism.tp = tp;
        let laid_out = crate::mesh::shape(&cut.parallelism, ranks).is_ok();
        laid_out && cut.validate().is_ok() && need_of(&cut, ranks) <= limit
    })?;
    let mut cut = config.clone();
    cut.parallelism.tp = tp;
    Some(format!(
        "; or set parallelism.tp = {tp} (the matrices cut over {tp} ranks: about {} a rank)",
        human_bytes(need_of(&cut, ranks))
    ))
}

/// With hybrid sharding (`parallelism.dp_replicate` = D > 1), the most replicas below D that
/// divide the ranks and fit: fewer replicas cut the state over more ranks.
fn replica_advice(
    config: &Config,
    ranks: usize,
    limit: f64,
    need_of: &dyn Fn(&Config, usize) -> f64,
) -> Option<String> {
    let need = |d: usize| {
        let mut fewer = config.clone();
        fewer.parallelism.dp_replicate = d;
        need_of(&fewer, ranks)
    };
    let replicas = config.parallelism.dp_replicate;
    let d = (1..replicas)
        .rev()
        .find(|&d| ranks.is_multiple_of(d) && need(d) <= limit)?;
    Some(format!(
        "; or set parallelism.dp_replicate = {d} (the state cut over {} ranks: about {} a rank)",
        ranks / d,
        human_bytes(need(d))
    ))
}

/// The least sharding mode beyond the config's that fits on these ranks, or the fewest ranks
/// one would fit on: `None` when the config shards everything already or none fits on a
/// reasonable number of ranks.
fn mode_advice(
    config: &Config,
    ranks: usize,
    limit: f64,
    need_of: &dyn Fn(&Config, usize) -> f64,
) -> Option<String> {
    // The modes that shard more than the config does.
    let rest: &[Shard] = match config.parallelism.shard {
        Shard::None | Shard::Optimizer => &[Shard::Gradients, Shard::Parameters],
        Shard::Gradients => &[Shard::Parameters],
        Shard::Parameters => return None,
    };
    let need = |mode: Shard, r: usize| {
        let mut sharded = config.clone();
        sharded.parallelism.shard = mode;
        need_of(&sharded, r)
    };
    // The least sharding that fits on these ranks; else the fewest ranks any mode fits on.
    if let Some(&mode) = rest.iter().find(|&&m| ranks > 1 && need(m, ranks) <= limit) {
        return Some(format!(
            "; or set parallelism.shard = \"{}\" (about {} a rank on these {ranks} ranks)",
            mode.name(),
            human_bytes(need(mode, ranks))
        ));
    }
    let (fits, mode) = (ranks.max(1) + 1..=MAX_ADVISED_RANKS)
        .find_map(|r| rest.iter().find(|&&m| need(m, r) <= limit).map(|&m| (r, m)))?;
    Some(format!(
        "; or train it on {fits} ranks with parallelism.shard = \"{}\" (about {} a rank)",
        mode.name(),
        human_bytes(need(mode, fits))
    ))
}

/// The most ranks [`sharding_advice`] looks at.
const MAX_ADVISED_RANKS: usize = 4096;

/// The vocabulary known before the data is opened: `model.vocab_size`, or the synthetic
/// corpus's; 0 when a corpus list will tell (the embedding is then checked once it has).
pub fn known_vocab(config: &Config) -> usize {
    if config.model.vocab_size > 0 {
        config.model.vocab_size
    } else if config.data.corpus_list.is_empty() {
        crate::data::synthetic::VOCAB
    } else {
        0
    }
}

/// Refuses `config` (with a vocabulary of `vocab`) if its estimate does not fit the memory
/// this process may use. Where nothing says how much that is, the check is skipped.
pub fn check(config: &Config, vocab: usize, ranks: usize) -> Result<Estimate, ConfigError> {
    let est = estimate(config, vocab, ranks);
    let limit = kiln_run::host::available_memory();
    verdict(config, (vocab, ranks), est, limit, None)
}

/// [`check`] for a training rank whose memory snapshots go to `store`: they count too (see
/// [`snapshot_bytes`]).
pub fn check_run(
    config: &Config,
    vocab: usize,
    ranks: usize,
    store: &Path,
) -> Result<Estimate, ConfigError> {
    let mut est = estimate(config, vocab, ranks);
    est.snapshots = snapshot_bytes(config, est.params, store);
    verdict(
        config,
        (vocab, ranks),
        est,
        kiln_run::host::available_memory(),
        Some(store),
    )
}

/// `est` against `limit` (`None`: nothing says; the check is skipped). `store`: where the
/// snapshots counted in `est` go.
fn verdict(
    config: &Config,
    (vocab, ranks): (usize, usize),
    est: Estimate,
    limit: Option<MemoryLimit>,
    store: Option<&Path>,
) -> Result<Estimate, ConfigError> {
    let Some(limit) = limit else {
        return Ok(est);
    };
    tracing::info!(
        need = %human_bytes(est.need()),
        snapshots = %human_bytes(est.snapshots),
        available = %human_bytes(limit.bytes as f64),
        source = %limit.source,
        "memory estimate of the run"
    );
    if est.need() <= limit.bytes as f64 {
        return Ok(est);
    }
    if let Some(store) = store
        && est.snapshots > 0.0
        && est.need() - est.snapshots <= limit.bytes as f64
    {
        return Err(snapshots_too_big(config, &est, &limit, store));
    }
    let gib = |b: f64| human_bytes(b);
    let (key, value, default, saved) = culprit(config, vocab, ranks);
    let shard = sharding_advice(config, vocab, ranks, limit.bytes as f64).unwrap_or_default();
    Err(ConfigError::TooBig(format!(
        "this run needs about {} of memory but {} is available ({}): parameters {} ({:.3e} of them, x{} bytes with AdamW state{}), one step's activations {} ({} x {} tokens), checkpoint buffers {}, eval {}; estimate x {SAFETY}{} + {}. Lower {key} (now {value}; {default}) to save the most ({} less){shard}",
        gib(est.need()),
        gib(limit.bytes as f64),
        limit.source,
        gib(est.resident),
        est.params,
        est.resident / est.params.max(1.0),
        if config.guards.snapshot_interval > 0 {
            " and the rollback snapshot"
        } else {
            ""
        },
        gib(est.activations),
        config.training.batch_size,
        config.training.seq_len,
        gib(est.checkpoint),
        gib(est.eval),
        if est.snapshots > 0.0 {
            format!(" + memory snapshots {}", gib(est.snapshots))
        } else {
            String::new()
        },
        gib(OVERHEAD),
        gib(saved),
    )))
}

/// The run fits without its memory snapshots but not with them.
fn snapshots_too_big(
    config: &Config,
    est: &Estimate,
    limit: &MemoryLimit,
    store: &Path,
) -> ConfigError {
    let keep = config.checkpoint.snapshot_keep;
    let each = 12.0 * est.params;
    let lower = if keep > 1 {
        format!(
            "lower checkpoint.snapshot_keep (now {keep}; 1 saves {}), ",
            human_bytes(each * (keep - 1) as f64)
        )
    } else {
        String::new()
    };
    ConfigError::TooBig(format!(
        "the memory snapshots do not fit: checkpoint.snapshot_keep = {keep} keeps {keep} cop{} of the training state ({} each: weights and AdamW moments), plus one while the next is written and one at the guards' rollback point, in {} (a memory file system: they use RAM), {} more than it holds now; with them this run needs about {} but {} is available ({}). To fit, {lower}point checkpoint.snapshot_dir at a node-local disk, or set checkpoint.snapshot_interval = 0 to turn the memory tier off",
        if keep == 1 { "y" } else { "ies" },
        human_bytes(each),
        store.display(),
        human_bytes(est.snapshots),
        human_bytes(est.need()),
        human_bytes(limit.bytes as f64),
        limit.source,
    ))
}

/// The key whose return to its default saves the most memory: `(key, value, "the default is
/// X", bytes saved)`.
fn culprit(config: &Config, vocab: usize, ranks: usize) -> (&'static str, String, String, f64) {
    let need = estimate(config, vocab, ranks).need();
    let defaults = Config::default();
    type Reset = fn(&mut Config, &Config);
    let keys: [(&str, Reset); 8] = [
        ("model.vocab_size", |c, d| {
            c.model.vocab_size = d.model.vocab_size
        }),
        ("model.d_model", |c, d| c.model.d_model = d.model.d_model),
        ("model.n_layers", |c, d| c.model.n_layers = d.model.n_layers),
        ("model.n_heads", |c, d| c.model.n_heads = d.model.n_heads),
        ("model.ffn_hidden", |c, d| {
            c.model.ffn_hidden = d.model.ffn_hidden
        }),
        ("training.seq_len", |c, d| {
            c.training.seq_len = d.training.seq_len
        }),
        ("training.batch_size", |c, d| {
            c.training.batch_size = d.training.batch_size
        }),
        ("training.compute_shards", |c, d| {
            c.training.compute_shards = d.training.compute_shards
        }),
    ];
    let mut best = ("training.batch_size", 0.0f64);
    for (key, reset) in keys {
        let mut c = config.clone();
        reset(&mut c, &defaults);
        // A vocabulary taken from the data stays the data's; reset it to the synthetic one.
        let v = if key == "model.vocab_size" {
            crate::data::synthetic::VOCAB
        } else {
            vocab
        };
        let saved = need - estimate(&c, v, ranks).need();
        if saved > best.1 {
            best = (key, saved);
        }
    }
    let (value, default) = match best.0 {
        "model.vocab_size" => (vocab.to_string(), "the data decides when 0".to_string()),
        "model.d_model" => (
            config.model.d_model.to_string(),
            format!("the default is {}", defaults.model.d_model),
        ),
        "model.n_layers" => (
            config.model.n_layers.to_string(),
            format!("the default is {}", defaults.model.n_layers),
        ),
        "model.n_heads" => (
            config.model.n_heads.to_string(),
            format!("the default is {}", defaults.model.n_heads),
        ),
        "model.ffn_hidden" => (
            config.model.ffn_hidden.to_string(),
            format!("the default is {}", defaults.model.ffn_hidden),
        ),
        "training.seq_len" => (
            config.training.seq_len.to_string(),
            format!("the default is {}", defaults.training.seq_len),
        ),
        "training.compute_shards" => (
            config.training.compute_shards.to_string(),
            format!("the default is {}", defaults.training.compute_shards),
        ),
        _ => (
            config.training.batch_size.to_string(),
            "raise training.grad_accum_steps to keep the tokens per step".to_string(),
        ),
    };
    (best.0, value, default, best.1)
}

/// Starts the flex backend's worker threads (rayon's global pool) with `threads` workers;
/// 0 keeps rayon's default (one per core). Only the first call in a process has an effect;
/// later ones (another session in the same process) are no-ops. Never panics: a count over
/// [`kiln_run::host::max_threads`] is refused, and a pool that cannot start is an error
/// (rayon's global pool is then unusable, so the process must stop rather than go on).
pub fn start_threads(threads: usize) -> Result<(), ConfigError> {
    if threads == 0 {
        return Ok(());
    }
    kiln_run::host::check_threads("training.threads", threads).map_err(ConfigError::TooBig)?;
    match rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .build_global()
    {
        Ok(()) => Ok(()),
        // rayon exposes no error kind; its Debug output names it.
        Err(e) if format!("{e:?}").contains("GlobalPoolAlreadyInitialized") => Ok(()),
        Err(e) => Err(ConfigError::TooBig(format!(
            "training.threads = {threads}: cannot start the worker threads: {e}"
        ))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::Llama;

    fn config(sets: &[&str]) -> Config {
        let sets: Vec<String> = sets.iter().map(|s| s.to_string()).collect();
        Config::load(None, &sets).unwrap()
    }

    #[test]
    fn param_count_matches_the_model() {
        for sets in [
            &[][..],
            &["model.tie_embeddings=true", "model.qk_norm=true"][..],
            &[
                "model.d_model=96",
                "model.n_heads=6",
                "model.n_kv_heads=3",
                "model.ffn_hidden=200",
            ][..],
        ] {
            let c = config(sets);
            for vocab in [16, 1000] {
                let exact = Llama::new(&c.model, vocab).num_params() as f64;
                assert_eq!(
                    param_count(&c.model, vocab),
                    exact,
                    "{sets:?} vocab {vocab}"
                );
            }
        }
    }

    #[test]
    fn each_part_grows_with_its_keys() {
        let base = estimate(&config(&[]), 16, 1);
        let longer = estimate(&config(&["training.seq_len=128"]), 16, 1);
        // Attention scores are quadratic in the sequence: more than twice the activations.
        assert!(longer.activations > 2.0 * base.activations);
        assert_eq!(longer.resident, base.resident);
        let wider = estimate(&config(&["model.d_model=256"]), 16, 1);
        assert!(wider.params > 2.0 * base.params);
        let no_guards = estimate(
            &config(&[
                "guards.snapshot_interval=0",
                "guards.frozen_check_interval=0",
            ]),
            16,
            1,
        );
        assert_eq!(no_guards.resident, 12.0 * base.params);
        assert!(base.need() > OVERHEAD);
        // Activation checkpointing keeps one block's activations and every block's input.
        let deep = &["model.n_layers=8", "training.seq_len=256"];
        let kept = estimate(&config(deep), 16, 1);
        let mut sets = deep.to_vec();
        sets.push("training.activation_checkpointing=blocks");
        let recomputed = estimate(&config(&sets), 16, 1);
        assert!(
            recomputed.activations < kept.activations / 4.0,
            "{recomputed:?} {kept:?}"
        );
        assert_eq!(recomputed.resident, kept.resident);
    }

    /// With replicas the state is cut over one replica's ranks: 4 ranks as 2 replicas need
    /// what 2 ranks of one replica do, more than 4 ranks of one; a hybrid run that does not
    /// fit is told the most replicas that would.
    #[test]
    fn on_an_accelerator_only_the_host_copies_count() {
        let long = &["training.seq_len=2048", "training.batch_size=4"][..];
        let host = estimate(&config(long), 32000, 1);
        let mut gpu = config(long);
        for device in ["cuda", "cuda:1", "rocm:0", "vulkan"] {
            gpu.training.device = device.into();
            let on_gpu = estimate(&gpu, 32000, 1);
            assert!(on_gpu.on_accelerator, "{device}");
            // The same parts; the activations, weights and moments are device memory.
            assert_eq!(on_gpu.activations, host.activations);
            let want = on_gpu.checkpoint * SAFETY + OVERHEAD;
            assert!((on_gpu.need() - want).abs() < 1.0, "{device}");
            assert!(on_gpu.need() < host.need() / 2.0);
        }
        for device in ["flex", "cpu", "cubecl-cpu"] {
            gpu.training.device = device.into();
            assert_eq!(estimate(&gpu, 32000, 1).need(), host.need(), "{device}");
        }
    }

    /// The 1B-class model of the GPU benchmark (bench/gpu/models.py) as it ran on an H200:
    /// batch 4 x 2048, bf16 on f32 masters, no guard copies, on `cuda`.
    fn one_b(extra: &[&str]) -> Config {
        let mut sets = vec![
            "model.vocab_size=32000",
            "model.d_model=2048",
            "model.n_layers=16",
            "model.n_heads=16",
            "model.n_kv_heads=4",
            "model.ffn_hidden=5632",
            "training.batch_size=4",
            "training.seq_len=2048",
            "training.dtype=bf16",
            "training.device=cuda",
            "guards.snapshot_interval=0",
            "guards.frozen_check_interval=0",
        ];
        sets.extend_from_slice(extra);
        config(&sets)
    }

    const GIB: f64 = 1024.0 * 1024.0 * 1024.0;

    /// The device estimate against the one measurement: the 1B-class model replicated on an
    /// H200 peaked at 34,966 MiB (nvidia-smi, bench/gpu/results/h200.md run 7); the table,
    /// before the safety factor and with the context, within 10 % of it, and the need above it.
    #[test]
    fn the_device_estimate_matches_the_h200_measurement() {
        let e = device_estimate_on(&one_b(&[]), 32000, 1).unwrap();
        let table = e.state + e.step + DEVICE_CONTEXT;
        let measured = 34_966.0 * 1024.0 * 1024.0;
        assert!(
            (table / measured - 1.0).abs() < 0.10,
            "table {:.1} GiB vs measured {:.1} GiB",
            table / GIB,
            measured / GIB
        );
        assert!(e.need() > measured && e.need() < 1.4 * measured);
        // Not an accelerator: no device estimate.
        let mut cpu = one_b(&[]);
        cpu.training.device = "cubecl-cpu".into();
        assert!(device_estimate_on(&cpu, 32000, 1).is_none());
    }

    /// Full sharding holds `1/N` of the replicated state per rank (weights, moments), and
    /// each mode's state lies between (the goal: at most 1/N + 10 %).
    #[test]
    fn the_device_state_per_rank_shrinks_with_the_mode() {
        let state = |mode: &str, r: usize| {
            let set = format!("parallelism.shard={mode}");
            device_estimate_on(&one_b(&[&set]), 32000, r).unwrap().state
        };
        let whole = state("none", 4);
        for r in [2usize, 4, 8] {
            let full = state("parameters", r);
            assert!((full / (whole / r as f64) - 1.0).abs() < 1e-9, "{r} ranks");
            assert!(state("optimizer", r) < whole && state("optimizer", r) > full);
            assert_eq!(state("gradients", r), state("optimizer", r));
        }
        // The step of full sharding holds a stage or two, not the model: far below.
        let step = |mode: &str| {
            let set = format!("parallelism.shard={mode}");
            device_estimate_on(&one_b(&[&set]), 32000, 4).unwrap().step
        };
        assert!(step("parameters") < step("none") / 2.0);
    }

    /// A 7B-class Llama (d 4096, 32 layers, 32/8 heads, SwiGLU 11008, seq 2048) does not fit
    /// one 80 GB GPU replicated; the refusal names the fewest ranks full sharding fits on,
    /// and on 4 ranks with activation checkpointing it fits.
    #[test]
    fn a_7b_model_is_refused_on_one_gpu_naming_what_fits() {
        let seven = |extra: &[&str]| {
            let mut sets = vec![
                "model.d_model=4096",
                "model.n_layers=32",
                "model.n_heads=32",
                "model.n_kv_heads=8",
                "model.ffn_hidden=11008",
                "training.batch_size=1",
            ];
            sets.extend_from_slice(extra);
            let mut c = one_b(&sets);
            c.training.batch_size = 1;
            c
        };
        let limit = 80.0 * GIB;
        let replicated = seven(&[]);
        let est = device_estimate_on(&replicated, 32000, 1).unwrap();
        let err = device_verdict(&replicated, 32000, 1, est, limit, "test")
            .unwrap_err()
            .to_string();
        assert!(err.contains("of device memory per rank"), "{err}");
        assert!(err.contains("parallelism.shard = \"parameters\""), "{err}");
        assert!(err.contains("train it on"), "{err}");
        // On 2 ranks the least sharding that fits is named (no rank count).
        let est = device_estimate_on(&replicated, 32000, 2).unwrap();
        let err = device_verdict(&replicated, 32000, 2, est, limit, "test")
            .unwrap_err()
            .to_string();
        assert!(err.contains("on these 2 ranks"), "{err}");
        let full = seven(&[
            "parallelism.shard=parameters",
            "training.activation_checkpointing=blocks",
        ]);
        let est = device_estimate_on(&full, 32000, 4).unwrap();
        assert!(est.need() < limit, "{:.1} GiB", est.need() / GIB);
        assert!(device_verdict(&full, 32000, 4, est, limit, "test").is_ok());
    }

    #[test]
    fn the_device_limit_comes_from_the_key() {
        let mut c = one_b(&[]);
        c.training.device_memory_gb = 80.0;
        let (bytes, source) = device_limit(&c).unwrap();
        assert!(source.starts_with("training.device_memory_gb"), "{source}");
        assert!(bytes <= 80.0 * GIB && bytes > 0.0);
        // Without the key and off CUDA nothing says (the check is skipped).
        c.training.device_memory_gb = 0.0;
        c.training.device = "rocm".into();
        assert!(device_limit(&c).is_none());
    }

    #[test]
    fn hybrid_sharding_cuts_the_state_over_one_replica() {
        let sharded = config(&["parallelism.shard=parameters"]);
        let hybrid = config(&["parallelism.shard=parameters", "parallelism.dp_replicate=2"]);
        let need = |c: &Config, r: usize| estimate_on(c, 16, r).need();
        assert_eq!(need(&hybrid, 4), need(&sharded, 2));
        assert!(need(&hybrid, 4) > need(&sharded, 4));
        let four = config(&["parallelism.shard=parameters", "parallelism.dp_replicate=4"]);
        let limit = need(&hybrid, 4);
        assert!(need(&four, 4) > limit);
        let advice = sharding_advice(&four, 16, 4, limit).unwrap();
        assert!(
            advice.contains("parallelism.dp_replicate = 2 (the state cut over 2 ranks"),
            "{advice}"
        );
        assert_eq!(sharding_advice(&four, 16, 4, need(&sharded, 4) - 1.0), None);
    }

    /// Tensor parallelism cuts the state and most activations by tp; a run that does not
    /// fit on its ranks is told the tp that would.
    #[test]
    fn tensor_parallelism_cuts_a_ranks_share_and_is_advised() {
        let one = config(&[]);
        let tp2 = config(&["parallelism.tp=2"]);
        let (a, b) = (estimate_on(&one, 16, 2), estimate_on(&tp2, 16, 2));
        assert!((b.resident - a.resident / 2.0).abs() < 1e-6 * a.resident);
        assert!(b.activations < a.activations && b.step < a.step);
        let need = |c: &Config, r: usize| estimate_on(c, 16, r).need();
        let limit = need(&tp2, 2);
        assert!(need(&one, 2) > limit);
        let advice = sharding_advice(&one, 16, 2, limit).unwrap();
        assert!(
            advice.contains("parallelism.tp = 2 (the matrices cut over 2 ranks"),
            "{advice}"
        );
    }

    #[test]
    fn absurd_sizes_are_refused_naming_the_key() {
        for (set, key) in [
            ("model.d_model=1000000", "model.d_model"),
            ("model.n_layers=1000000000", "model.n_layers"),
            ("model.ffn_hidden=1000000000", "model.ffn_hidden"),
            ("model.vocab_size=1000000000", "model.vocab_size"),
            ("training.seq_len=1000000", "training.seq_len"),
            ("training.batch_size=1000000000", "training.batch_size"),
        ] {
            let c = config(&[set]);
            let err = check(&c, known_vocab(&c), 1).unwrap_err().to_string();
            assert!(err.contains(&format!("Lower {key}")), "{set}: {err}");
            assert!(err.contains("is available"), "{err}");
        }
        // The default run fits anywhere kiln's tests run.
        let c = config(&[]);
        assert!(check(&c, 16, 1).is_ok());
    }

    #[test]
    fn memory_snapshots_count_when_they_use_ram_and_are_named_when_they_do_not_fit() {
        let c = config(&["checkpoint.snapshot_keep=2"]);
        let est = estimate(&c, 16, 1);
        let each = 12.0 * est.params;
        // On a disk they cost no RAM.
        let disk = Path::new(env!("CARGO_MANIFEST_DIR"));
        if !kiln_run::host::in_memory_fs(disk) {
            assert_eq!(snapshot_bytes(&c, est.params, disk), 0.0);
        }
        let shm = Path::new("/dev/shm");
        if !kiln_run::host::in_memory_fs(shm) {
            return; // no memory file system on this machine
        }
        let dir = tempfile::tempdir_in(shm).unwrap();
        let store = dir.path().join("rank-0");
        // Two kept, one being written, one at the guards' rollback point.
        assert_eq!(snapshot_bytes(&c, est.params, &store), 4.0 * each);
        let no_rollbacks = config(&["checkpoint.snapshot_keep=2", "guards.snapshot_interval=0"]);
        assert_eq!(
            snapshot_bytes(&no_rollbacks, est.params, &store),
            3.0 * each
        );
        // Snapshots already in the store are out of the available memory already.
        std::fs::create_dir_all(store.join("step-5")).unwrap();
        std::fs::write(store.join("step-5/model.safetensors"), vec![0u8; 1000]).unwrap();
        assert_eq!(snapshot_bytes(&c, est.params, &store), 4.0 * each - 1000.0);
        let off = config(&["checkpoint.snapshot_interval=0"]);
        assert_eq!(snapshot_bytes(&off, est.params, &store), 0.0);
        // The run fits without them but not with them: the error names the keys.
        let mut with = est.clone();
        with.snapshots = snapshot_bytes(&c, est.params, &store);
        assert_eq!(with.need(), est.need() + with.snapshots);
        let limit = |bytes: f64| {
            Some(MemoryLimit {
                bytes: bytes as u64,
                source: "a test".into(),
            })
        };
        let short = limit(with.need() - with.snapshots / 2.0);
        let err = verdict(&c, (16, 1), with.clone(), short, Some(&store))
            .unwrap_err()
            .to_string();
        for want in [
            "the memory snapshots do not fit: checkpoint.snapshot_keep = 2 keeps 2 copies",
            "lower checkpoint.snapshot_keep (now 2; 1 saves",
            "checkpoint.snapshot_dir",
            "checkpoint.snapshot_interval = 0",
            "(a test)",
        ] {
            assert!(err.contains(want), "{want:?} not in {err}");
        }
        assert!(
            verdict(
                &c,
                (16, 1),
                with.clone(),
                limit(with.need() + 1.0),
                Some(&store)
            )
            .is_ok()
        );
    }

    #[test]
    fn thread_counts_are_bounded_and_never_panic() {
        let err = start_threads(100_000).unwrap_err().to_string();
        assert!(
            err.contains("training.threads = 100000: must be 0"),
            "{err}"
        );
        // 0 leaves the pool alone (a count > 0 would set this test binary's global pool).
        assert!(start_threads(0).is_ok());
    }
}

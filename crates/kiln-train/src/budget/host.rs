//! The host's estimate of one rank: weights, optimizer state, gradients, a step's
//! activations, checkpoint buffers, eval and the memory snapshots (see [`super`]).

use crate::config::{ActivationCheckpointing, Config, ModelConfig, Shard};
use std::path::Path;

/// Factor on the estimate: allocator fragmentation, temporaries the table does not list.
pub const SAFETY: f64 = 1.25;

/// Memory of the program itself (code, thread stacks, the data loader's maps), bytes.
pub const OVERHEAD: f64 = 256.0 * 1024.0 * 1024.0;

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
pub(super) fn held_bytes(dir: &Path, depth: u32) -> f64 {
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
pub(super) struct TensorShare {
    pub(super) tp: f64,
    pub(super) dp_ranks: usize,
}

impl TensorShare {
    pub(super) fn of(config: &Config, ranks: usize) -> Self {
        let tp = config.parallelism.tp.max(1);
        Self {
            tp: tp as f64,
            dp_ranks: (ranks / tp).max(1),
        }
    }

    /// A layer's activations per token on one rank: its heads' and hidden units' share, plus
    /// the two block inputs gathered whole (sequence parallelism keeps `1/tp` of the rest).
    pub(super) fn layer(&self, per_token_layer: f64, d: f64) -> f64 {
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

/// Parameters of the largest stage (the embedding, a block, the head) of the Llama of
/// `model`: what a parameter-sharded rank gathers at once.
pub(super) fn largest_stage(model: &ModelConfig, vocab: usize) -> f64 {
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

//! The `parallelism` section of the config: how the ranks of a job are laid out as a mesh
//! and what the data-parallel ranks shard, with the rules that tie its keys together (those
//! that need the job's rank count are checked when the mesh is built, [`super::shape`]).

use serde::{Deserialize, Serialize};

/// Data parallelism: every rank trains on its slice of the global batch; gradients are
/// averaged over the ranks (MPI all-reduce, or reduce-scatter when sharded) before clipping.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ParallelismConfig {
    /// Gradients are all-reduced in buckets of this many MiB (PyTorch DDP uses 25); the
    /// bucket size is part of what makes the reduction repeatable, so keep it fixed in a run.
    pub bucket_mb: usize,
    /// What the ranks shard instead of replicating (see [`Shard`]).
    pub shard: Shard,
    /// Hybrid sharding (torchtitan's `dp_replicate`, HSDP): the ranks form this many equal
    /// groups of consecutive ranks (replicas); the sharded state is cut over the ranks of
    /// one group and replicated over the groups, so all-gathers stay inside a group (a node,
    /// when a group fits one) and only the gradient average crosses groups. 1: one group of
    /// every rank. Must divide the rank count; needs `shard` other than `"none"`.
    pub dp_replicate: usize,
    /// With `shard = "parameters"`: gather the next stage's weights on a second thread while
    /// the current stage computes (FSDP's prefetch), holding two stages' whole weights at a
    /// time instead of one. It pays where each rank has a core to spare for that thread
    /// (compute on an accelerator, or fewer `training.threads` than cores); where compute
    /// fills every core the thread only competes with it, hence off by default. Needs an
    /// MPI library with MPI_THREAD_MULTIPLE (else the weights are gathered when needed);
    /// `start` records whether it is on. On CUDA with NCCL the next stage is always gathered
    /// ahead, on NCCL's stream (no thread), whatever this says.
    pub prefetch: bool,
    /// How the ranks' tensors meet (see [`Collectives`]): `auto` (NCCL on CUDA devices with
    /// several ranks, host-staged MPI elsewhere), `host` (host-staged MPI everywhere: what
    /// NCCL's results are compared with) or `device` (NCCL's device-buffer layout over MPI
    /// staged through host memory: tests of that layout without a GPU).
    pub collectives: Collectives,
    /// Tensor parallelism: each matrix cut over this many consecutive ranks (Megatron's and
    /// torchtitan's layout: attention by heads, the MLP by its hidden units, the embedding and
    /// the output head by the vocabulary), with sequence parallelism on the norms and the
    /// loss computed on the cut logits. The data-parallel ranks are the job's ranks over
    /// `tp`; each of them is `tp` ranks training on the same samples. Cuts the memory of the
    /// weights, gradients and optimizer state by `tp`, at the price of two all-gathers and
    /// two reduce-scatters of a block's activations per block and pass: for a node's fast
    /// links. Must divide the ranks, `model.n_heads`, `model.ffn_hidden`, the vocabulary
    /// and each compute shard's sequences; needs `optimizer.kind = "adamw"`.
    pub tp: usize,
}

/// How the ranks' tensors meet (`parallelism.collectives`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum Collectives {
    /// NCCL on CUDA devices with several ranks, host-staged MPI elsewhere.
    #[default]
    Auto,
    /// Host-staged MPI on every device.
    Host,
    /// The device-buffer layout over MPI staged through host memory.
    Device,
}

impl ParallelismConfig {
    /// What is wrong with the section's keys together, one message each (naming the keys).
    pub fn rules(&self) -> Vec<String> {
        let mut out = Vec::new();
        if self.shard == Shard::None && self.dp_replicate > 1 {
            out.push(format!(
                "parallelism.dp_replicate = {} replicates a sharded state over groups of ranks; set parallelism.shard too (without sharding every rank is a replica already)",
                self.dp_replicate
            ));
        }
        out
    }

    /// What tensor parallelism cannot cut of a model of `heads` query heads sharing `kv`
    /// K/V heads and `ffn` hidden units, trained on compute shards of `pieces` sequences
    /// each, one message per key. `optimizer`: the optimizer's kind and why tensor
    /// parallelism does not take it (Muon's orthogonalisation needs whole matrices, ...), for
    /// every kind but AdamW.
    pub fn tensor_rules(
        &self,
        (heads, kv, ffn): (usize, usize, usize),
        pieces: &[usize],
        optimizer: Option<(&str, &str)>,
    ) -> Vec<String> {
        let tp = self.tp;
        if tp <= 1 {
            return Vec::new();
        }
        let mut out = Vec::new();
        let divisors = |n: usize| {
            let d: Vec<String> = (1..=n)
                .filter(|d| n.is_multiple_of(*d))
                .map(|d| d.to_string())
                .collect();
            d.join(", ")
        };
        if !heads.is_multiple_of(tp) {
            out.push(format!(
                "parallelism.tp = {tp} must divide model.n_heads = {heads} (each rank computes its block of the heads); use one of {}",
                divisors(heads)
            ));
        } else if heads.is_multiple_of(kv) {
            let (per, groups) = (heads / tp, heads / kv);
            if !per.is_multiple_of(groups) && !groups.is_multiple_of(per) {
                out.push(format!(
                    "parallelism.tp = {tp} gives each rank {per} query heads, which neither fill whole groups of model.n_heads / model.n_kv_heads = {groups} nor fit in one: use a tp that divides model.n_kv_heads = {kv}, or a multiple of it dividing {heads}"
                ));
            }
        }
        if !ffn.is_multiple_of(tp) {
            out.push(format!(
                "parallelism.tp = {tp} must divide model.ffn_hidden = {ffn} (each rank computes its block of the MLP)"
            ));
        }
        if let Some(&bad) = pieces.iter().find(|p| !p.is_multiple_of(tp)) {
            out.push(format!(
                "parallelism.tp = {tp} must divide the sequences of each compute shard ({bad} of training.batch_size split over training.compute_shards): sequence parallelism keeps each rank's share of them; use a batch size that {tp} x compute_shards divides"
            ));
        }
        if let Some((kind, why)) = optimizer {
            out.push(format!(
                "parallelism.tp = {tp} cuts every matrix over ranks, and optimizer.kind = {kind:?} {why}; use optimizer.kind = \"adamw\" with tensor parallelism"
            ));
        }
        out
    }

    /// Bytes per all-reduce bucket (`bucket_mb`, at least 1 MiB).
    pub fn bucket_bytes(&self) -> usize {
        self.bucket_mb.max(1) << 20
    }

    /// Whether a run gathers each stage's weights ahead (`prefetch` with `shard =
    /// "parameters"`; the other modes gather nothing stage by stage).
    pub fn prefetches(&self) -> bool {
        self.prefetch && self.shard == Shard::Parameters
    }
}

impl Default for ParallelismConfig {
    fn default() -> Self {
        Self {
            bucket_mb: 25,
            shard: Shard::None,
            dp_replicate: 1,
            prefetch: false,
            collectives: Collectives::Auto,
            tp: 1,
        }
    }
}

/// What data-parallel ranks shard (`parallelism.shard`), named by what is sharded rather than
/// by ZeRO stage number. The parameters, flattened in model order, are cut into one
/// contiguous range per rank (the last one shorter when the count does not divide: any
/// number of ranks can split them); each rank keeps the optimizer state of its range only,
/// updates that range and all-gathers the updated parameters from the others.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum Shard {
    /// Everything replicated (plain data parallelism, the all-reduce).
    #[default]
    None,
    /// Optimizer state sharded (ZeRO-1): gradients still all-reduced whole.
    Optimizer,
    /// Optimizer state and reduced gradients sharded (ZeRO-2): a reduce-scatter leaves each
    /// rank only its range of the averaged gradients, half the all-reduce's traffic.
    Gradients,
    /// Parameters too (ZeRO-3, FSDP's full sharding): each rank keeps only its range of every
    /// stage's weights (the embedding, each block, the head, cut separately); a stage's
    /// weights are all-gathered when it runs and dropped after, in the forward pass and again
    /// in the backward pass, whose gradients are reduce-scattered stage by stage.
    Parameters,
}

impl Shard {
    /// The name used in configs.
    pub fn name(self) -> &'static str {
        match self {
            Self::None => "none",
            Self::Optimizer => "optimizer",
            Self::Gradients => "gradients",
            Self::Parameters => "parameters",
        }
    }
}

//! A config's validation: every section's domains, then the rules that tie keys of several
//! sections together.

use super::domains::{Bound::*, Domains, MAX_BUCKET_MB};
use super::*;

impl Config {
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
        self.model_rules(d);
        self.optimizer_rules(d);
        self.parallel_rules(d);
        let t = &self.training;
        let per_step = (t.batch_size as u128 * t.grad_accum_steps as u128)
            .max(u128::from(t.global_batch_size));
        let samples = u128::from(t.steps) * per_step;
        if samples > u128::from(MAX_SAMPLES) {
            d.rule(format!(
                "training.steps x sequences per step = {samples} sequences is more than the {MAX_SAMPLES} a run can address"
            ));
        }
    }

    /// The model's shape: heads that divide the width into an even head dim, K/V heads that
    /// divide the heads.
    fn model_rules(&self, d: &mut Domains) {
        let m = &self.model;
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
    }

    /// The optimizer against its schedule and the layout: decoupled decay below 1 a step, and
    /// Schedule-Free's own schedule and its two published tensors.
    fn optimizer_rules(&self, d: &mut Domains) {
        let o = &self.optimizer;
        if o.lr * o.weight_decay >= 1.0 {
            d.rule(format!(
                "optimizer.lr x optimizer.weight_decay = {} must be < 1: decoupled decay multiplies each weight by 1 - lr x weight_decay per step",
                o.lr * o.weight_decay
            ));
        }
        if o.kind != OptimizerKind::ScheduleFreeAdamw {
            return;
        }
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

    /// The layout: the mesh's own rules, tensor parallelism against the model, the batch and
    /// the optimizer, and sharding's f32 master weights.
    fn parallel_rules(&self, d: &mut Domains) {
        let (m, o, t) = (&self.model, &self.optimizer, &self.training);
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
        if self.parallelism.shard != Shard::None && t.master_dtype != Precision::F32 {
            let shard = self.parallelism.shard.name();
            d.rule(format!(
                "parallelism.shard = {shard:?} needs training.master_dtype = \"f32\" (its sharded update is f32 only)"
            ));
        }
    }
}

//! What a run that does not fit is told: the key whose default saves the most, and the least
//! sharding or tensor parallelism that would fit.

use super::host::*;
use crate::config::{Config, Shard};
use kiln_run::host::human_bytes;

/// What sharding would do for a run that does not fit in `limit` bytes of host memory: more
/// of it ([`mode_advice`]), else fewer replicas ([`replica_advice`]); `None` when neither fits.
pub(super) fn sharding_advice(
    config: &Config,
    vocab: usize,
    ranks: usize,
    limit: f64,
) -> Option<String> {
    let need = |c: &Config, r: usize| estimate_on(c, vocab, r).need();
    sharding_advice_by(config, ranks, limit, &need)
}

/// [`sharding_advice`] for the memory `need` says a config takes on a rank of so many.
pub(super) fn sharding_advice_by(
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
pub(super) fn tensor_advice(
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
pub(super) fn replica_advice(
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
pub(super) fn mode_advice(
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
pub(super) const MAX_ADVISED_RANKS: usize = 4096;

/// The key whose return to its default saves the most memory: `(key, value, "the default is
/// X", bytes saved)`.
pub(super) fn culprit(
    config: &Config,
    vocab: usize,
    ranks: usize,
) -> (&'static str, String, String, f64) {
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

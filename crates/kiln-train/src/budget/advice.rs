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
    let mut best = (&KNOBS[6], 0.0f64);
    for knob in &KNOBS {
        let mut c = config.clone();
        (knob.set)(&mut c, (knob.get)(&defaults));
        // A vocabulary taken from the data stays the data's; reset it to the synthetic one.
        let v = match knob.key {
            "model.vocab_size" => crate::data::synthetic::VOCAB,
            _ => vocab,
        };
        let saved = need - estimate(&c, v, ranks).need();
        if saved > best.1 {
            best = (knob, saved);
        }
    }
    let (knob, saved) = best;
    let default = match knob.key {
        "model.vocab_size" => "the data decides when 0".to_string(),
        "training.batch_size" => {
            "raise training.grad_accum_steps to keep the tokens per step".into()
        }
        _ => format!("the default is {}", (knob.get)(&defaults)),
    };
    let value = match knob.key {
        "model.vocab_size" => vocab,
        _ => (knob.get)(config),
    };
    (knob.key, value.to_string(), default, saved)
}

/// A key whose return to its default may save memory.
struct Knob {
    key: &'static str,
    get: fn(&Config) -> usize,
    set: fn(&mut Config, usize),
}

/// The keys [`culprit`] tries (`training.batch_size`, the sixth, is the answer when none
/// saves anything).
const KNOBS: [Knob; 8] = [
    Knob {
        key: "model.vocab_size",
        get: |c| c.model.vocab_size,
        set: |c, v| c.model.vocab_size = v,
    },
    Knob {
        key: "model.d_model",
        get: |c| c.model.d_model,
        set: |c, v| c.model.d_model = v,
    },
    Knob {
        key: "model.n_layers",
        get: |c| c.model.n_layers,
        set: |c, v| c.model.n_layers = v,
    },
    Knob {
        key: "model.n_heads",
        get: |c| c.model.n_heads,
        set: |c, v| c.model.n_heads = v,
    },
    Knob {
        key: "model.ffn_hidden",
        get: |c| c.model.ffn_hidden,
        set: |c, v| c.model.ffn_hidden = v,
    },
    Knob {
        key: "training.seq_len",
        get: |c| c.training.seq_len,
        set: |c, v| c.training.seq_len = v,
    },
    Knob {
        key: "training.batch_size",
        get: |c| c.training.batch_size,
        set: |c, v| c.training.batch_size = v,
    },
    Knob {
        key: "training.compute_shards",
        get: |c| c.training.compute_shards,
        set: |c, v| c.training.compute_shards = v,
    },
];

//! The checks before anything is allocated: the host's estimate against the memory this
//! process may use, with what to change when it does not fit.

use super::advice::*;
use super::host::*;
use crate::config::{Config, ConfigError};
use kiln_run::host::{MemoryLimit, human_bytes};
use std::path::Path;

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
pub(super) fn verdict(
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
pub(super) fn snapshots_too_big(
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

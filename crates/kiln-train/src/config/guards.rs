//! The `[guards]` section (what stops or rolls back a run that stopped learning) and `[debug]`
//! (the faults that test them), and their keys' domains.

use super::domains::{Bound::*, Domains};
use serde::{Deserialize, Serialize};

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

impl GuardsConfig {
    /// The guard keys' domains.
    pub(super) fn domains(&self, d: &mut Domains) {
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

/// Longest spike-guard window.
pub const MAX_SPIKE_WINDOW: usize = 1_000_000;

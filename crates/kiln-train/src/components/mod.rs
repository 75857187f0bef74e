//! The run's components, each deciding its own cadence and restoring its own state, called in
//! order by the [`crate::trainer`]: [`journal`] (events, metrics and the caller's observer)
//! with [`metrics`], [`tensorboard`] and [`startup`]; [`checkpoints`] (the whole checkpoint
//! lifecycle: the persistent tier written by its [`checkpoints::saver`], the memory tier of
//! [`checkpoints::snapshot`], resume, the guards' rollback point, lineage, resize); [`guard_rail`] (skips, rollbacks, frozen
//! parameters); [`eval`] (held-out evaluation); [`replicas`] (the replica checksum check).

pub mod checkpoints;
pub mod eval;
pub mod guard_rail;
pub mod journal;
pub mod metrics;
pub mod replicas;
pub mod startup;
pub mod tensorboard;

//! The `[checkpoint]` section, and the checkpoint settings a run uses.

use serde::{Deserialize, Serialize};

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

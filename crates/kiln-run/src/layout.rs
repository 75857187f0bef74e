//! Names of the files and directories of a run directory: the one place they are spelled.
//! Every component (trainer, launcher, status, plots) joins these to the run directory.

/// The effective config of the training run (TOML).
pub const CONFIG: &str = "config.toml";
/// Per-step and per-eval metrics, JSON lines.
pub const METRICS: &str = "metrics.jsonl";
/// The event log, JSON lines (see [`crate::Event`]).
pub const EVENTS: &str = "events.jsonl";
/// Directory of `step-<N>` checkpoint directories.
pub const CHECKPOINTS: &str = "checkpoints";
/// The weights file of a checkpoint (`checkpoints/step-<N>/`).
pub const CHECKPOINT_MODEL: &str = "model.safetensors";
/// The optimizer state file of a checkpoint.
pub const CHECKPOINT_OPTIMIZER: &str = "optimizer.safetensors";
/// The training state file of a checkpoint (the trainer's `TrainState` as JSON).
pub const CHECKPOINT_STATE: &str = "state.json";
/// The manifest of a checkpoint (checksums and sizes of the other files); a checkpoint
/// directory without one is not published.
pub const CHECKPOINT_MANIFEST: &str = "manifest.json";
/// Where checkpoints that were rejected (corrupt, torn, foreign) are moved aside under
/// [`CHECKPOINTS`]; never deleted by kiln.
pub const REJECTED: &str = "rejected";
/// The lineage (`run_id`) of the run in this directory, written at every start, so that a
/// restart before the first persistent checkpoint keeps the lineage of its memory snapshots.
pub const RUN_ID: &str = "run_id";
/// File-name prefix of a run's memory-snapshot folder in the node-local snapshot directory
/// (`kiln-<hash of the run directory>`).
pub const SNAPSHOT_ROOT_PREFIX: &str = "kiln-";
/// File-name prefix of one rank's memory snapshots in that folder (`rank-<R>`), holding
/// `step-<N>` directories in the checkpoint format.
pub const SNAPSHOT_RANK_PREFIX: &str = "rank-";

/// A run's memory-snapshot folder, keyed by a hash of its run directory.
pub fn snapshot_root(run_key: &str) -> String {
    format!("{SNAPSHOT_ROOT_PREFIX}{run_key}")
}

/// One rank's memory-snapshot directory inside [`snapshot_root`].
pub fn snapshot_rank(rank: usize) -> String {
    format!("{SNAPSHOT_RANK_PREFIX}{rank}")
}

/// The final weights (safetensors) at the top of the run directory.
pub const FINAL_MODEL: &str = "model.safetensors";
/// The run-directory lock (flock) held by the one writer of a training run; it holds the
/// holder's `pid host` for the error message of a second trainer.
pub const LOCK: &str = "train.lock";
/// Per-rank progress beacons (the default `$KILN_PROGRESS_DIR` of `kiln launch`).
pub const PROGRESS: &str = "progress";
/// The hosts of the current attempt (`kiln launch`).
pub const HOSTFILE: &str = "hostfile";
/// Hosts taken out of service by node scope, JSON lines `{"time", "host", "cause",
/// "evidence", "job_id"}`; `kiln launch` skips the hosts listed and `kiln submit` excludes
/// them from later jobs. The same format serves a shared file (`--quarantine-file`).
pub const QUARANTINE: &str = "quarantine.jsonl";
/// Plots (`kiln plot`, `kiln lr-find`).
pub const PLOTS: &str = "plots";

/// A rank's progress beacon in the progress directory (see [`crate::write_beacon`]).
pub fn beacon(rank: usize) -> String {
    format!("{BEACON_PREFIX}{rank}")
}

/// File-name prefix of beacons (`rank-<R>`).
pub const BEACON_PREFIX: &str = "rank-";
/// File-name prefix of exit records (`exit-<R>`).
pub const EXIT_RECORD_PREFIX: &str = "exit-";
/// File-name prefix of liveness records (`live-<R>`).
pub const LIVENESS_PREFIX: &str = "live-";

/// kiln's stop request in the progress directory (see [`crate::write_stop_request`]): how a
/// stop reaches the ranks under a launcher without signalling the launcher itself.
pub const STOP_REQUEST: &str = "stop";

/// File-name prefix of lost-heartbeat records (`lost-<R>`).
pub const LOST_PREFIX: &str = "lost-";

/// A rank's lost-heartbeat record (see [`crate::write_lost_record`]).
pub fn lost_record(rank: usize) -> String {
    format!("{LOST_PREFIX}{rank}")
}

/// A rank's liveness record in the progress directory (see [`crate::write_liveness`]).
pub fn liveness(rank: usize) -> String {
    format!("{LIVENESS_PREFIX}{rank}")
}

/// A rank's exit record in the progress directory (see [`crate::write_exit_record`]).
pub fn exit_record(rank: usize) -> String {
    format!("{EXIT_RECORD_PREFIX}{rank}")
}

/// The batch script `kiln submit` writes for `scheduler` (`slurm` or `pbs`), kept in the
/// run directory so every job of a chain runs (and an operator can read) the same script.
pub fn batch_script(scheduler: &str) -> String {
    match scheduler {
        "pbs" => "job.pbs".into(),
        _ => "job.sbatch".into(),
    }
}

/// Where the scheduler writes a batch job's own output (`%j`: Slurm's job id pattern;
/// PBS gets the same name with the id filled in by the script).
pub const JOB_OUTPUT_PATTERN: &str = "job-%j.out";

/// Output of launch attempt `i` (raw bytes).
pub fn attempt_log(i: u32) -> String {
    format!("attempt-{i}.log")
}

/// Name of the checkpoint directory of step `step`.
pub fn checkpoint_dir(step: u64) -> String {
    format!("step-{step}")
}

/// The step of a checkpoint directory name (`step-<N>`), if it is one.
pub fn parse_checkpoint_dir(name: &str) -> Option<u64> {
    let digits = name.strip_prefix("step-")?;
    // Only canonical decimal names: `step-010` or `step-+1` are not ours.
    if digits.is_empty() || (digits.len() > 1 && digits.starts_with('0')) {
        return None;
    }
    if !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    digits.parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn checkpoint_dir_names_round_trip_and_only_canonical_ones_parse() {
        assert_eq!(parse_checkpoint_dir(&checkpoint_dir(120)), Some(120));
        assert_eq!(parse_checkpoint_dir("step-0"), Some(0));
        for bad in [
            "step-", "step-010", "step-+1", "step-1a", "rejected", "step--1",
        ] {
            assert_eq!(parse_checkpoint_dir(bad), None, "{bad}");
        }
    }
}

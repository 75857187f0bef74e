//! Names of the files and directories of a run directory: the one place they are spelled.
//! Every component (trainer, launcher, status, plots) joins these to the run directory, and
//! [`entries`] lists them with what each holds (for `--help`, the README and the crate doc).

use std::fmt::Display;

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
/// In a sharded run (`parallelism.shard`), the optimizer state written by rank `rank` of
/// `ranks` in place of [`CHECKPOINT_OPTIMIZER`]: `optimizer-00001-of-00004.safetensors`.
pub fn checkpoint_optimizer_shard(rank: usize, ranks: usize) -> String {
    shard_file(CHECKPOINT_OPTIMIZER_SHARD, rank, ranks)
}

/// The `(rank, ranks)` of an optimizer shard file name, if it is one (canonical names only).
pub fn parse_optimizer_shard(name: &str) -> Option<(usize, usize)> {
    parse_shard_file(CHECKPOINT_OPTIMIZER_SHARD, name)
}

/// In a parameter-sharded run (`parallelism.shard = "parameters"`), the weights written by
/// rank `rank` of `ranks` in place of [`CHECKPOINT_MODEL`]: `model-00001-of-00004.safetensors`.
pub fn checkpoint_model_shard(rank: usize, ranks: usize) -> String {
    shard_file(CHECKPOINT_MODEL_SHARD, rank, ranks)
}

/// The `(rank, ranks)` of a weights shard file name, if it is one (canonical names only).
pub fn parse_model_shard(name: &str) -> Option<(usize, usize)> {
    parse_shard_file(CHECKPOINT_MODEL_SHARD, name)
}

fn shard_file(prefix: &str, rank: usize, ranks: usize) -> String {
    format!("{prefix}{rank:05}-of-{ranks:05}.safetensors")
}

fn parse_shard_file(prefix: &str, name: &str) -> Option<(usize, usize)> {
    let rest = name.strip_prefix(prefix)?.strip_suffix(".safetensors")?;
    let (rank, ranks) = rest.split_once("-of-")?;
    let (rank, ranks): (usize, usize) = (rank.parse().ok()?, ranks.parse().ok()?);
    (shard_file(prefix, rank, ranks) == name && rank < ranks).then_some((rank, ranks))
}

/// File-name prefix of [`checkpoint_optimizer_shard`].
const CHECKPOINT_OPTIMIZER_SHARD: &str = "optimizer-";
/// File-name prefix of [`checkpoint_model_shard`].
const CHECKPOINT_MODEL_SHARD: &str = "model-";

/// Where the ranks of a sharded run write their optimizer shards for step `step` (under
/// [`CHECKPOINTS`]) before rank 0 moves them into the checkpoint it publishes.
pub fn checkpoint_shard_staging(step: impl Display) -> String {
    format!("{SHARD_STAGING_PREFIX}{}", checkpoint_dir(step))
}

/// The step of a [`checkpoint_shard_staging`] directory name, if it is one.
pub fn parse_shard_staging(name: &str) -> Option<u64> {
    parse_checkpoint_dir(name.strip_prefix(SHARD_STAGING_PREFIX)?)
}

/// File-name prefix of [`checkpoint_shard_staging`].
const SHARD_STAGING_PREFIX: &str = ".shards-";

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

/// The owner record in a run's memory-snapshot folder (JSON: the absolute run directory and
/// the guards' rollback interval), which lets a later kiln start on the node tell whether
/// the folder can still be used and reclaim it when it cannot.
pub const SNAPSHOT_OWNER: &str = "owner.json";

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

/// A rank's CubeCL cache on GPU devices (`device-cache-<R>.db`): its autotune decisions and
/// compiled kernels, kept with the run so a resumed process runs the same kernels.
pub fn device_cache(rank: impl Display) -> String {
    format!("device-cache-{rank}.db")
}

/// A rank's progress beacon in the progress directory (see [`crate::write_beacon`]).
pub fn beacon(rank: impl Display) -> String {
    format!("{BEACON_PREFIX}{rank}")
}

/// File-name prefix of beacons (`rank-<R>`).
pub const BEACON_PREFIX: &str = "rank-";
/// File-name prefix of exit records (`exit-<R>`).
pub const EXIT_RECORD_PREFIX: &str = "exit-";
/// File-name prefix of liveness records (`live-<R>`).
pub const LIVENESS_PREFIX: &str = "live-";

/// File-name prefix of a rank's record of the state it keeps on its node
/// (`node-<R>-<host>`, see [`crate::node_state`]), in the progress directory; kept across
/// attempts, removed when the launch releases the node.
pub const NODE_RECORD_PREFIX: &str = "node-";

/// The hostfile of the step that releases the nodes at the end of a launch (mpirun and
/// mpiexec, when not every host of the allocation ran an attempt).
pub const RELEASE_HOSTFILE: &str = "hostfile.release";

/// kiln's stop request in the progress directory (see [`crate::write_stop_request`]): how a
/// stop reaches the ranks under a launcher without signalling the launcher itself.
pub const STOP_REQUEST: &str = "stop";

/// File-name prefix of lost-heartbeat records (`lost-<R>`).
pub const LOST_PREFIX: &str = "lost-";

/// A rank's lost-heartbeat record (see [`crate::write_lost_record`]).
pub fn lost_record(rank: impl Display) -> String {
    format!("{LOST_PREFIX}{rank}")
}

/// A rank's liveness record in the progress directory (see [`crate::write_liveness`]).
pub fn liveness(rank: impl Display) -> String {
    format!("{LIVENESS_PREFIX}{rank}")
}

/// A rank's exit record in the progress directory (see [`crate::write_exit_record`]).
pub fn exit_record(rank: impl Display) -> String {
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
pub fn attempt_log(i: impl Display) -> String {
    format!("attempt-{i}.log")
}

/// Name of the checkpoint directory of step `step`.
pub fn checkpoint_dir(step: impl Display) -> String {
    format!("{CHECKPOINT_PREFIX}{step}")
}

/// File-name prefix of checkpoint directories (`step-<N>`).
pub const CHECKPOINT_PREFIX: &str = "step-";

/// The step of a checkpoint directory name (`step-<N>`), if it is one.
pub fn parse_checkpoint_dir(name: &str) -> Option<u64> {
    let digits = name.strip_prefix(CHECKPOINT_PREFIX)?;
    // Only canonical decimal names: `step-010` or `step-+1` are not ours.
    if digits.is_empty() || (digits.len() > 1 && digits.starts_with('0')) {
        return None;
    }
    if !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    digits.parse().ok()
}

/// One file or directory of a run directory: a row of [`entries`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Entry {
    /// Its name, or its pattern (`<N>`: a step, `<i>`: an attempt, `<R>`: a rank); a
    /// directory ends with `/`.
    pub name: String,
    /// Who writes it.
    pub by: &'static str,
    /// What it holds, in one line.
    pub what: &'static str,
}

/// Everything a run directory holds, in the order an operator meets it: the one listing
/// that `kiln train --help`, `kiln launch --help`, the README and the crate doc show.
pub fn entries() -> Vec<Entry> {
    let train = |name: &str, what| entry(name.into(), "kiln train", what);
    let launch = |name: String, what| entry(name, "kiln launch", what);
    vec![
        train(
            CONFIG,
            "the effective config (defaults, file and --set merged)",
        ),
        train(
            METRICS,
            "one JSON line per step (loss, grad_norm, lr, tokens_per_s, step_time_s, mfu, \
             rss_mib) and per eval (eval_loss, eval_accuracy, unigram_loss)",
        ),
        entry(
            EVENTS.into(),
            "every component",
            "one JSON event per line: start, resume, checkpoints (saved with stall_s and \
             write_s, loaded, rejected), guards, signals, attempts, node swaps, jobs, exit",
        ),
        train(
            &format!("{CHECKPOINTS}/{}/", checkpoint_dir("<N>")),
            "model.safetensors, optimizer.safetensors (sharded runs: one \
             optimizer-<r>-of-<n>.safetensors per rank, and with parameters sharded one \
             model-<r>-of-<n>.safetensors per rank in place of model.safetensors), \
             state.json and manifest.json (checksums), published atomically",
        ),
        train(
            &format!("{CHECKPOINTS}/{REJECTED}/"),
            "checkpoints that failed verification or belong to another run, moved aside \
             with a note; never deleted",
        ),
        train(FINAL_MODEL, "the final weights"),
        train(
            &device_cache("<R>"),
            "GPU devices only: rank R's kernel choices (autotune) and compiled kernels, so a \
             resumed process runs the same kernels (exact resume) without tuning again",
        ),
        train(
            LOCK,
            "held (flock) by the one trainer writing the directory: its pid and host",
        ),
        train(
            RUN_ID,
            "the run's lineage, kept by a restart before the first checkpoint",
        ),
        launch(
            attempt_log("<i>"),
            "raw bytes of attempt i's output (stdout and stderr)",
        ),
        launch(
            format!("{PROGRESS}/"),
            "$KILN_PROGRESS_DIR: the ranks' beacons, exit, liveness and lost records and \
             kiln's stop request, cleared before each attempt unless the caller set it; and \
             node-<R>-<host>, what rank R keeps on its node until the launch ends",
        ),
        launch(
            HOSTFILE.into(),
            "the hosts used, when fewer than the allocation's",
        ),
        launch(
            RELEASE_HOSTFILE.into(),
            "the hosts whose memory snapshots the end of the launch removed, when fewer than the allocation's",
        ),
        launch(
            QUARANTINE.into(),
            "hosts node scope took out of service, with the evidence",
        ),
        entry(
            format!("{} | {}", batch_script("slurm"), batch_script("pbs")),
            "kiln submit",
            "the batch script every job of the chain runs",
        ),
        entry(
            JOB_OUTPUT_PATTERN.replace("%j", "<id>"),
            "the scheduler",
            "a batch job's own output",
        ),
        entry(
            format!("{PLOTS}/"),
            "kiln plot",
            "curves and the goodput timeline, SVG and PNG",
        ),
    ]
}

fn entry(name: String, by: &'static str, what: &'static str) -> Entry {
    Entry { name, by, what }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn checkpoint_dir_names_round_trip_and_only_canonical_ones_parse() {
        assert_eq!(parse_checkpoint_dir(&checkpoint_dir(120)), Some(120));
        assert_eq!(parse_checkpoint_dir("step-0"), Some(0));
        assert_eq!(checkpoint_dir(7), "step-7");
        for bad in [
            "step-", "step-010", "step-+1", "step-1a", "rejected", "step--1",
        ] {
            assert_eq!(parse_checkpoint_dir(bad), None, "{bad}");
        }
    }

    #[test]
    fn optimizer_shard_and_staging_names_round_trip_and_only_canonical_ones_parse() {
        for (r, n) in [(0, 1), (1, 2), (99_998, 99_999), (3, 100_000)] {
            assert_eq!(
                parse_optimizer_shard(&checkpoint_optimizer_shard(r, n)),
                Some((r, n))
            );
        }
        assert_eq!(
            checkpoint_optimizer_shard(1, 4),
            "optimizer-00001-of-00004.safetensors"
        );
        for bad in [
            "optimizer.safetensors",
            "optimizer-1-of-4.safetensors",
            "optimizer-00004-of-00004.safetensors",
            "optimizer-00001-of-00004.safetensors.tmp",
            "optimizer-+0001-of-00004.safetensors",
            "optimizer-00001-of-00004",
            "../optimizer-00001-of-00004.safetensors",
        ] {
            assert_eq!(parse_optimizer_shard(bad), None, "{bad}");
        }
        assert_eq!(
            checkpoint_model_shard(2, 3),
            "model-00002-of-00003.safetensors"
        );
        assert_eq!(
            parse_model_shard(&checkpoint_model_shard(2, 3)),
            Some((2, 3))
        );
        assert_eq!(parse_model_shard("model.safetensors"), None);
        assert_eq!(parse_model_shard(&checkpoint_optimizer_shard(0, 1)), None);
        assert_eq!(parse_optimizer_shard(&checkpoint_model_shard(0, 1)), None);
        assert_eq!(parse_shard_staging(&checkpoint_shard_staging(40)), Some(40));
        assert_eq!(parse_shard_staging("step-40"), None);
        assert_eq!(parse_shard_staging(".shards-step-040"), None);
    }

    /// The names of [`entries`] as a listing holds them: in backquotes.
    fn missing_from(listing: &str) -> Vec<String> {
        entries()
            .into_iter()
            .flat_map(|e| {
                let names: Vec<String> = e.name.split(" | ").map(str::to_string).collect();
                names
            })
            .filter(|name| !listing.contains(&format!("`{name}`")))
            .collect()
    }

    #[test]
    fn the_readme_lists_every_entry_of_the_run_directory() {
        let readme = include_str!("../../../README.md");
        let start = readme
            .find("### The run directory")
            .expect("README has a run-directory section");
        let section = &readme[start..];
        let end = section[4..].find("\n#").map_or(section.len(), |i| i + 4);
        let missing = missing_from(&section[..end]);
        assert!(
            missing.is_empty(),
            "README's run directory lacks {missing:?}"
        );
    }

    #[test]
    fn the_crate_doc_lists_every_entry_of_the_run_directory() {
        let doc: String = include_str!("lib.rs")
            .lines()
            .filter_map(|l| l.strip_prefix("//!"))
            .collect::<Vec<_>>()
            .join("\n");
        let missing = missing_from(&doc);
        assert!(missing.is_empty(), "kiln-run's crate doc lacks {missing:?}");
    }

    #[test]
    fn every_entry_has_a_name_and_one_line() {
        for e in entries() {
            assert!(!e.name.is_empty() && !e.by.is_empty(), "{e:?}");
            assert!(!e.what.contains('\n') && !e.what.contains("  "), "{e:?}");
        }
    }
}

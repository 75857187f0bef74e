//! Names of the events in `events.jsonl`: the one place they are spelled, so writers and
//! readers (`kiln status`, plots, tests) cannot drift apart.

// Trainer.

/// Who writes an event: the `source` of each line of `events.jsonl`.
pub mod source {
    /// `kiln train` (the writer rank).
    pub const TRAIN: &str = "train";
    /// `kiln launch`.
    pub const LAUNCH: &str = "launch";
    /// `kiln submit`.
    pub const SUBMIT: &str = "submit";
}

/// Phases of a rank's progress beacon: written by the trainer, read by the supervisor.
pub mod beacon_phase {
    /// Training steps.
    pub const TRAIN: &str = "train";
    /// Held-out evaluation (the writer rank; the others wait in the next collective).
    pub const EVAL: &str = "eval";
    /// Saving a checkpoint.
    pub const CHECKPOINT: &str = "checkpoint";
    /// All steps done.
    pub const DONE: &str = "done";
    /// Phases that mean the rank finished, so it is not stalled (kiln's, and the spellings
    /// other programs' beacons use).
    pub const FINISHED: &[&str] = &[DONE, "finished", "exit"];
    /// Phases between steps, in which no step advances: the stall watchdog's default times
    /// them by their own longest duration seen, not by the step time.
    pub const OUTSIDE_STEPS: &[&str] = &[EVAL, CHECKPOINT];
    /// Phases that mean waiting for the other ranks (in a collective).
    pub const WAITING: &[&str] = &["allreduce", "all_reduce", "collective", "barrier", "wait"];
}

/// The trainer started (fields: step, total_steps, params, device, data, ...).
pub const START: &str = "start";
/// The run completed: each rank's peak resident memory (fields: step, rank_mib: VmHWM in
/// MiB, in rank order).
pub const PEAK_MEMORY: &str = "peak_memory";
/// A checkpoint was loaded to resume from.
pub const CHECKPOINT_LOADED: &str = "checkpoint_loaded";
/// A checkpoint failed verification and was moved aside (fields: path, reason, moved_to).
pub const CHECKPOINT_REJECTED: &str = "checkpoint_rejected";
/// A checkpoint's temporary directory left by a writer killed mid-save, deleted at the next
/// start (`path`, `bytes`).
pub const CHECKPOINT_LEFTOVER_REMOVED: &str = "checkpoint_leftover_removed";
/// A checkpoint was published (fields: step, path, seconds, pruned).
pub const CHECKPOINT_SAVED: &str = "checkpoint_saved";
/// The run resumed (fields: step, data_cursor, path, tier: one of [`tier`], source_rank and
/// peer_ranks for a snapshot sent by a peer, persistent_step: the newest checkpoint on the
/// run directory then).
pub const RESUME: &str = "resume";
/// Where a resume came from (the `tier` field of [`RESUME`]).
pub mod tier {
    /// Every rank's own memory snapshot (node-local, e.g. `/dev/shm`).
    pub const MEMORY: &str = "memory";
    /// A memory snapshot that some ranks received from a peer that held it.
    pub const PEER: &str = "peer";
    /// A persistent checkpoint in the run directory.
    pub const PERSISTENT: &str = "persistent";
}
/// A memory snapshot was published (fields: step, path, stall_s, write_s).
pub const SNAPSHOT_SAVED: &str = "snapshot_saved";
/// A memory snapshot failed verification or belongs to another run and was deleted, never
/// used (fields: path, reason, rank).
pub const SNAPSHOT_REJECTED: &str = "snapshot_rejected";
/// Writing a memory snapshot failed; training goes on (fields: step, error).
pub const SNAPSHOT_FAILED: &str = "snapshot_failed";
/// A run resumed between two of the guards' snapshots found the state of the last one in no
/// tier: a rollback before the next one goes to another step than an uninterrupted run's
/// would (fields: step, resumed_step).
pub const ROLLBACK_POINT_LOST: &str = "rollback_point_lost";
/// Ranks without the agreed memory snapshot received it from a peer (fields: step,
/// source_rank, ranks, bytes, seconds).
pub const SNAPSHOT_FROM_PEER: &str = "snapshot_from_peer";
/// A kiln start reclaimed another run's memory tier on its node that no resume could use
/// (fields: folder, run_dir, removed (the whole folder, else older snapshots), why, bytes).
pub const MEMORY_TIER_RECLAIMED: &str = "memory_tier_reclaimed";
/// How long each phase from the process's start to its first step took, on the writer rank
/// (fields: process_start (unix time), mpi_init_s, run_dir_s, data_open_s, model_init_s,
/// checkpoint_load_s, first_step_s).
pub const STARTUP_PHASES: &str = "startup_phases";
/// The phases of [`STARTUP_PHASES`], in order (its fields are `<phase>_s`).
pub mod phase {
    /// The collective's initialisation (MPI_Init, or nothing for one rank).
    pub const MPI_INIT: &str = "mpi_init";
    /// Locking the run directory, opening its logs and scanning its checkpoints.
    pub const RUN_DIR: &str = "run_dir";
    /// Opening the data (shards, blend indices).
    pub const DATA_OPEN: &str = "data_open";
    /// Building the model and the optimizer.
    pub const MODEL_INIT: &str = "model_init";
    /// Agreeing on and loading the resume point (memory, peer or persistent tier).
    pub const CHECKPOINT_LOAD: &str = "checkpoint_load";
    /// The first training step.
    pub const FIRST_STEP: &str = "first_step";
    /// Every phase, in order.
    pub const ALL: [&str; 6] = [
        MPI_INIT,
        RUN_DIR,
        DATA_OPEN,
        MODEL_INIT,
        CHECKPOINT_LOAD,
        FIRST_STEP,
    ];
}
/// The effective config differs from the one of the resumed checkpoint.
pub const CONFIG_CHANGED: &str = "config_changed";
/// `kiln launch` named a rank slower than its peers (`kiln_launch::straggler`): rank, host,
/// its median work time per step against its peers', over a window of steps.
pub const STRAGGLER: &str = "straggler";
/// A fresh run loaded its starting weights from a Hugging Face directory (`model.init_from`).
pub const INIT_FROM: &str = "init_from";
/// A step was skipped for a non-finite loss or gradient (`params`: those whose gradient holds
/// a NaN or an infinity).
pub const NONFINITE_SKIP: &str = "nonfinite_skip";
/// The trainer rolled back to an in-memory snapshot.
pub const ROLLBACK: &str = "rollback";
/// A loss spike was detected.
pub const LOSS_SPIKE: &str = "loss_spike";
/// A spike without a snapshot: the batch was skipped.
pub const SPIKE_SKIP: &str = "spike_skip";
/// Parameter tensors did not change over the check interval.
pub const FROZEN_PARAMS: &str = "frozen_params";
/// Rollbacks stopped making progress; the run stops (exit 65).
pub const ROLLBACK_LIMIT: &str = "rollback_limit";
/// Data-parallel replicas disagree on their parameters (fields: step, ranks, checksums, and
/// optionally hosts); the trainer then exits with [`crate::exit::REPLICA_MISMATCH`] and node
/// scope swaps the hosts of the named ranks.
pub const REPLICA_MISMATCH: &str = "replica_mismatch";
/// The run resumed on another number of ranks or another global batch (fields: from_ranks,
/// to_ranks, global_batch, grad_accum_steps, step).
pub const RESIZED: &str = "resized";
/// The first-step loss matches ln(vocab).
pub const INITIAL_LOSS_OK: &str = "initial_loss_ok";
/// The first-step loss is far from ln(vocab).
pub const INITIAL_LOSS_ERROR: &str = "initial_loss_error";
/// A stop signal was handled.
pub const SIGNAL: &str = "signal";
/// A torn last line of a JSON-lines file was cut off on open (fields: path, bytes_removed).
pub const LOG_REPAIRED: &str = "log_repaired";
/// The process is leaving (fields: reason, code, step, error).
pub const EXIT: &str = "exit";

// Launcher.
/// `kiln launch` started.
pub const LAUNCH_START: &str = "launch_start";
/// One attempt started.
pub const ATTEMPT_START: &str = "attempt_start";
/// One attempt ended, with its classification.
pub const ATTEMPT_END: &str = "attempt_end";
/// Waiting before the next attempt (fields: attempt, seconds, after).
pub const BACKOFF: &str = "backoff";
/// The retry loop stopped before its budget was spent (fields: attempt, reason, ...).
pub const STOPPED: &str = "stopped";
/// `kiln launch` ended.
pub const LAUNCH_END: &str = "launch_end";
/// The launch ended for good and removed what its ranks kept on their nodes (the memory
/// tier; see [`crate::node_state`]) (fields: kept, host, hosts, removed, failed,
/// skipped_quarantined).
pub const NODES_RELEASED: &str = "nodes_released";

// Node scope.
/// The allocation was split into active and spare hosts (fields: active, spares,
/// quarantined, min_nodes).
pub const HOST_POOL: &str = "host_pool";
/// A host was replaced after a failed attempt (fields: attempt, host, replacement, cause,
/// evidence, blind).
pub const NODE_SWAP: &str = "node_swap";
/// A host was taken out of service for this run (fields: host, cause, evidence, attempt;
/// also appended to the quarantine file).
pub const QUARANTINE: &str = "quarantine";
/// No spare was left: the job continues on fewer hosts (fields: attempt, from, to, dropped).
pub const SHRINK: &str = "shrink";

// Job scope.
/// `kiln submit` (or a job of its chain) submitted a batch job (fields: job_id, scheduler,
/// chain_index, chain_limit, script).
pub const JOB_SUBMITTED: &str = "job_submitted";
/// A batch job of the run started (fields: job_id, scheduler, chain_index, submit_time,
/// start_time, queue_s).
pub const JOB_START: &str = "job_start";
/// The chain ended or continues (fields: job_id, chain_index, decision, reason).
pub const CHAIN: &str = "chain";

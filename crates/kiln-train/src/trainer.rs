//! The step loop: [`Trainer`] owns the model, optimizer, data, the exact-resume
//! [`TrainState`], the guards' in-memory state, the run directory (on the writer rank) and
//! the collective that joins data-parallel ranks. One method each: [`Trainer::train_step`]
//! (forward, backward, all-reduce, guards, update), [`Trainer::after_step`] (metrics, eval,
//! snapshots and checks), [`Trainer::checkpoint`] and [`Trainer::agreed_stop`].
//!
//! Everything that decides what the next step computes is state saved in each checkpoint:
//! weights, the optimizer's state (keyed by parameter name) and step count, and the [`TrainState`] (step, data cursor, the
//! guards' loss window, the blend's history). Data and init are pure functions of the seed
//! and counters, so a run killed anywhere and restarted from its newest checkpoint ends
//! bit-identical to one never interrupted.
//!
//! Data parallelism: every rank holds the whole model and computes gradients on its slice of
//! the global batch; gradients and the loss are averaged over ranks before clipping, so every
//! decision (skip, rollback, stop, checkpoint) is taken from identical values on every rank
//! at the same step. Rank 0 is the one writer of the run directory; it writes checkpoints
//! on a background thread ([`crate::saver`]), so the other ranks never wait for its disk
//! except when the run ends.

use crate::checkpoint::{self, Checkpoint, CheckpointManager};
use crate::config::Config;
use crate::data::TrainData;
use crate::guards::{self, LossVerdict};
use crate::metrics::{self, EvalMetrics, Observer, StepMetrics};
use crate::optim::{self, Optimizer};
use crate::run_dir::{RunDir, RunDirError};
use crate::saver::{Saved, Saver, Staged};
use crate::session::{Session, sha256_hex};
use crate::state::{TrainState, new_run_id};
use crate::step::{self, BatchLayout, Labels};
use burn::tensor::{Device, Tensor};
use kiln_dist::{BucketedAllReduce, Collective};
use kiln_run::{EventLog, event, exit};
use serde_json::json;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Instant;

/// Errors that stop training.
#[derive(Debug, thiserror::Error)]
pub enum TrainError {
    /// Bad config.
    #[error(transparent)]
    Config(#[from] crate::config::ConfigError),
    /// Checkpoint write/read failure.
    #[error(transparent)]
    Checkpoint(#[from] checkpoint::CheckpointError),
    /// The run directory is locked or unwritable.
    #[error(transparent)]
    RunDir(#[from] RunDirError),
    /// Run-directory I/O.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The cause.
        source: std::io::Error,
    },
    /// Event log failure.
    #[error(transparent)]
    Events(#[from] kiln_run::EventLogError),
    /// The data could not be opened or does not fit the model (at start: deterministic).
    #[error("data: {0}")]
    Data(String),
    /// Reading a sample failed during training (perhaps transient: worth a retry; the
    /// launcher stops retrying when the same error repeats).
    #[error("data: {0}")]
    DataRead(String),
    /// The device named in the config is unknown or not compiled in.
    #[error("device {0:?}: {1}")]
    Device(String, String),
    /// The collectives between ranks could not be set up.
    #[error(transparent)]
    Dist(#[from] kiln_dist::DistError),
    /// The rank environment or the ranks' configs disagree.
    #[error("data-parallel setup: {0}")]
    Parallel(String),
    /// The newest checkpoint cannot be resumed with this config.
    #[error("cannot resume from {path}: {reason}")]
    ResumeMismatch {
        /// The checkpoint.
        path: PathBuf,
        /// What differs.
        reason: String,
    },
    /// A guard stopped the run.
    #[error("guard: {0}")]
    Guard(String),
    /// Data-parallel replicas disagree on their parameters.
    #[error(
        "replica mismatch after step {step}: the parameters of rank(s) {ranks:?} differ from the other ranks' (silent data corruption or a desynced rank); stopped before saving them"
    )]
    ReplicaMismatch {
        /// The step checked.
        step: u64,
        /// The ranks that differ from the majority.
        ranks: Vec<usize>,
    },
}

impl TrainError {
    /// The process exit code for this error ([`kiln_run::exit`]): deterministic input
    /// errors are told apart from ones worth a retry.
    pub fn exit_code(&self) -> i32 {
        match self {
            Self::Config(_)
            | Self::Device(..)
            | Self::ResumeMismatch { .. }
            | Self::Data(_)
            | Self::Parallel(_) => exit::CONFIG,
            Self::Dist(kiln_dist::DistError::Init(_)) => exit::FAILURE,
            Self::Dist(_) => exit::CONFIG,
            Self::Guard(_) => exit::GUARD_STOP,
            Self::RunDir(RunDirError::Locked { .. }) => exit::RUN_DIR_LOCKED,
            Self::ReplicaMismatch { .. } => exit::REPLICA_MISMATCH,
            Self::RunDir(_)
            | Self::Io { .. }
            | Self::Events(_)
            | Self::Checkpoint(_)
            | Self::DataRead(_) => exit::FAILURE,
        }
    }

    /// Whether every rank reaches this error at the same point (decided from all-reduced
    /// values), so that no rank is left waiting in a collective.
    fn is_collective(&self) -> bool {
        matches!(
            self,
            Self::Guard(_) | Self::ReplicaMismatch { .. } | Self::Parallel(_)
        )
    }
}

fn io(path: &Path) -> impl FnOnce(std::io::Error) -> TrainError + '_ {
    move |source| TrainError::Io {
        path: path.to_path_buf(),
        source,
    }
}

/// A path for an event: lossy text, since JSON strings are UTF-8 and a run directory need
/// not be.
fn path_text(p: &Path) -> String {
    p.to_string_lossy().into_owned()
}

/// How a training run ended.
#[derive(Debug, Clone, PartialEq)]
pub enum Outcome {
    /// All steps done.
    Completed,
    /// Stopped by a signal after saving a checkpoint; running the same command resumes.
    Preempted {
        /// The signal number.
        signal: i32,
    },
}

/// Result of [`train`].
#[derive(Debug, Clone)]
pub struct TrainReport {
    /// How it ended.
    pub outcome: Outcome,
    /// Steps completed.
    pub step: u64,
    /// Last training loss.
    pub last_loss: Option<f32>,
    /// Last evaluation.
    pub last_eval: Option<EvalMetrics>,
    /// Wall time of this process's training, seconds.
    pub seconds: f64,
}

/// Options of one training run.
pub struct TrainOptions {
    /// The effective config.
    pub config: Config,
    /// Run directory (created if missing).
    pub run_dir: PathBuf,
}

/// Signals that ask the trainer to checkpoint and stop.
pub const STOP_SIGNALS: [i32; 3] = [
    signal_hook::consts::SIGTERM,
    signal_hook::consts::SIGUSR1,
    signal_hook::consts::SIGINT,
];

/// The writer rank's files: the locked run directory, the event log, the metrics log and
/// the checkpoints (written by the saver).
struct Writer {
    run: RunDir,
    events: EventLog,
    metrics: std::fs::File,
    saver: Saver,
    /// The run's lineage (the checkpoint manager's, which lives in the saver).
    run_id: String,
}

/// What a rollback restores. The data cursor is not restored: the batches after it are
/// skipped.
#[derive(Clone)]
struct Snapshot {
    state: TrainState,
    params: Vec<Tensor<1>>,
    optimizer: Optimizer,
}

/// The guards' in-memory state (not checkpointed: a resumed run starts these afresh).
#[derive(Default)]
struct GuardRail {
    snapshot: Option<Snapshot>,
    nonfinite_in_row: u32,
    /// Rollbacks since training last got past `high_water`.
    rollbacks_in_row: u32,
    /// The furthest step reached; getting past it again ends a streak of rollbacks.
    high_water: u64,
    last_frozen_check: Option<Vec<Tensor<1>>>,
}

/// What the guards decided about one step's loss and gradients.
enum Verdict {
    /// Apply the update.
    Update,
    /// The step was skipped or rolled back: nothing to apply.
    Discard,
}

/// Quantities fixed for the whole run.
struct RunFacts {
    total: u64,
    fresh: bool,
    frozen: Vec<bool>,
    unigram: Option<f64>,
    flops_per_token: f64,
    peak_flops: f64,
    model_hash: String,
    config_hash: String,
    grads: BucketedAllReduce,
    progress_dir: Option<PathBuf>,
    started: Instant,
}

impl RunFacts {
    fn new(cfg: &Config, session: &Session, data: &TrainData) -> Self {
        let frozen = session
            .model
            .specs()
            .iter()
            .map(|p| {
                !cfg.debug.freeze_params.is_empty() && p.name.contains(&cfg.debug.freeze_params)
            })
            .collect();
        let peak_flops = if cfg.training.peak_flops > 0.0 {
            cfg.training.peak_flops
        } else {
            // A rough CPU peak: 32 f32 FLOP/cycle (two AVX2 FMA units) at 2.5 GHz per thread.
            let threads = if cfg.training.threads > 0 {
                cfg.training.threads
            } else {
                rayon::current_num_threads()
            };
            threads as f64 * 80e9
        };
        Self {
            total: cfg.training.steps,
            fresh: false,
            frozen,
            unigram: data
                .synthetic
                .as_ref()
                .map(|syn| syn.unigram_entropy(64, cfg.training.seq_len + 1)),
            flops_per_token: session.model.flops_per_token(cfg.training.seq_len),
            peak_flops,
            model_hash: session.model_hash(),
            config_hash: sha256_hex(&cfg.to_toml()),
            grads: BucketedAllReduce::new(cfg.parallelism.bucket_mb.max(1) << 20),
            progress_dir: std::env::var_os(kiln_run::PROGRESS_DIR_ENV).map(PathBuf::from),
            started: Instant::now(),
        }
    }
}

/// One training run. See the module documentation.
pub struct Trainer<'o> {
    cfg: Config,
    run_dir: PathBuf,
    session: Session,
    optimizer: Optimizer,
    data: TrainData,
    /// The exact-resume state.
    pub state: TrainState,
    layout: BatchLayout,
    guards: GuardRail,
    writer: Option<Writer>,
    comm: Box<dyn Collective>,
    stop: Arc<AtomicUsize>,
    observer: &'o mut dyn Observer,
    facts: RunFacts,
    ad_device: Device,
    last_loss: Option<f32>,
    last_eval: Option<EvalMetrics>,
    /// The step of the newest checkpoint on disk (this process's save or its resume point).
    saved_at: Option<u64>,
}

/// Trains according to `opts`, resuming from the newest valid checkpoint in the run
/// directory. Returns when all steps are done or a stop signal was handled. Every way out
/// writes an `exit` event; with several ranks, an error on one rank that the others cannot
/// know about ends all of them (MPI_Abort) so that none waits forever in a collective.
pub fn train(opts: &TrainOptions, observer: &mut dyn Observer) -> Result<TrainReport, TrainError> {
    let rank_env = kiln_topology::RankEnv::from_process_env()
        .map_err(|e| TrainError::Parallel(format!("rank environment: {e}")))?;
    let comm = kiln_dist::init(&rank_env)?;
    let mut trainer = match Trainer::new(opts, comm, observer) {
        Ok(t) => t,
        Err((e, comm)) => {
            if let Some(comm) = comm.filter(|c| c.size() > 1 && !e.is_collective()) {
                tracing::error!("rank {}: {e}", comm.rank());
                comm.abort(e.exit_code());
            }
            return Err(e);
        }
    };
    match trainer.run() {
        Ok(report) => Ok(report),
        Err(e) => {
            trainer.emit_exit("error", e.exit_code(), Some(&e.to_string()));
            if trainer.comm.size() > 1 {
                if e.is_collective() {
                    trainer.comm.barrier();
                } else {
                    tracing::error!("rank {}: {e}", trainer.comm.rank());
                    trainer.comm.abort(e.exit_code());
                }
            }
            Err(e)
        }
    }
}

/// What the writer rank found when it opened the run directory.
struct Opened {
    writer: Writer,
    resume: Option<(PathBuf, Checkpoint)>,
    rejected: Vec<checkpoint::Rejection>,
}

impl<'o> Trainer<'o> {
    /// Sets up a run: the run directory (writer rank), data, model and optimizer, and the
    /// newest valid checkpoint when resuming. On error, hands the collective back so the
    /// caller can end the other ranks.
    #[allow(clippy::type_complexity)]
    pub fn new(
        opts: &TrainOptions,
        comm: Box<dyn Collective>,
        observer: &'o mut dyn Observer,
    ) -> Result<Self, (TrainError, Option<Box<dyn Collective>>)> {
        let cfg = opts.config.clone();
        let opened = match Self::prepare(opts, comm.as_ref()) {
            Ok(o) => o,
            Err(e) => return Err((e, Some(comm))),
        };
        let (writer, resume, rejected) = match opened {
            Some(o) => (Some(o.writer), o.resume, o.rejected),
            None => (None, None, Vec::new()),
        };
        let build = || -> Result<_, TrainError> {
            let layout = BatchLayout::new(&cfg.training, comm.rank(), comm.size())
                .map_err(TrainError::Parallel)?;
            // Sizes that cannot fit are refused before the data is indexed for them.
            crate::budget::check(&cfg, crate::budget::known_vocab(&cfg))?;
            let data = TrainData::open(&cfg, layout.samples_for(cfg.training.steps), None)
                .map_err(TrainError::Data)?;
            let vocab = data.vocab(&cfg).map_err(TrainError::Data)?;
            let session = Session::new(&cfg, vocab)?;
            Ok((layout, data, session))
        };
        let (layout, data, session) = match build() {
            Ok(v) => v,
            Err(e) => {
                if let Some(mut w) = writer {
                    let _ = w.events.emit(
                        event::EXIT,
                        json!({"reason": "error", "code": e.exit_code(), "step": 0, "error": e.to_string()}),
                    );
                }
                return Err((e, Some(comm)));
            }
        };
        let optimizer = Optimizer::new(
            &cfg.optimizer,
            session.model.specs(),
            &session.device,
            layout.global_batch() * layout.seq as u64,
        );
        let facts = RunFacts::new(&cfg, &session, &data);
        let state = TrainState::fresh(
            cfg.training.seed,
            String::new(),
            layout.global_batch(),
            layout.world as u64,
        );
        let ad_device = session.device.clone().autodiff();
        let stop = Arc::new(AtomicUsize::new(0));
        let mut t = Self {
            cfg,
            run_dir: opts.run_dir.clone(),
            session,
            optimizer,
            data,
            state,
            layout,
            guards: GuardRail::default(),
            writer,
            comm,
            stop,
            observer,
            facts,
            ad_device,
            last_loss: None,
            last_eval: None,
            saved_at: None,
        };
        let setup = (|| {
            for sig in STOP_SIGNALS {
                signal_hook::flag::register_usize(sig, Arc::clone(&t.stop), sig as usize)
                    .map_err(io(&t.run_dir))?;
            }
            t.check_ranks_agree()?;
            t.resume(resume, rejected)
        })();
        match setup {
            Ok(()) => Ok(t),
            Err(e) => {
                t.emit_exit("error", e.exit_code(), Some(&e.to_string()));
                Err((e, Some(t.comm)))
            }
        }
    }

    /// Validates the config and, on the writer rank, locks the run directory, writes the
    /// config, opens the logs and scans the checkpoints.
    fn prepare(opts: &TrainOptions, comm: &dyn Collective) -> Result<Option<Opened>, TrainError> {
        let cfg = &opts.config;
        cfg.validate()?;
        if comm.rank() != 0 {
            return Ok(None);
        }
        let run = RunDir::lock(&opts.run_dir)?;
        run.write_file(kiln_run::layout::CONFIG, cfg.to_toml().as_bytes())?;
        let mut events = EventLog::open(run.path(), "train")?;
        let (metrics, cut) = run.open_log(kiln_run::layout::METRICS)?;
        if cut > 0 {
            events.emit(
                event::LOG_REPAIRED,
                json!({"path": path_text(&run.path().join(kiln_run::layout::METRICS)), "bytes_removed": cut}),
            )?;
        }
        let opened = CheckpointManager::open(
            &run.path().join(kiln_run::layout::CHECKPOINTS),
            cfg.checkpoint.keep_latest_k,
            cfg.checkpoint.resume,
            &new_run_id(),
        )?;
        let run_id = opened.manager.run_id().to_string();
        Ok(Some(Opened {
            writer: Writer {
                run,
                events,
                metrics,
                saver: Saver::new(opened.manager, cfg.checkpoint.asynchronous),
                run_id,
            },
            resume: opened.resume,
            rejected: opened.rejected,
        }))
    }

    /// Every rank must run the same config: compared by hash at start.
    fn check_ranks_agree(&self) -> Result<(), TrainError> {
        if self.comm.size() == 1 {
            return Ok(());
        }
        let mine = u64::from_str_radix(&self.facts.config_hash[..16], 16).unwrap_or(0);
        let all = self.comm.all_gather_u64(mine);
        let odd: Vec<usize> = (0..all.len()).filter(|&r| all[r] != all[0]).collect();
        if odd.is_empty() {
            Ok(())
        } else {
            Err(TrainError::Parallel(format!(
                "ranks {odd:?} run a different config than rank 0 (every rank must get the same config file and --set flags)"
            )))
        }
    }

    fn emit(&mut self, name: &str, fields: serde_json::Value) -> Result<(), TrainError> {
        if let Some(w) = &mut self.writer {
            w.events.emit(name, fields)?;
        }
        Ok(())
    }

    fn note(&mut self, msg: &str) {
        if self.writer.is_some() {
            self.observer.on_note(msg);
        }
    }

    /// Writes the `exit` event (writer rank), ignoring a failure to write it: it is the last
    /// thing a failing run does. A checkpoint still being written is waited for first, so no
    /// way out leaves one half done.
    fn emit_exit(&mut self, reason: &str, code: i32, error: Option<&str>) {
        if let Err(e) = self.wait_saves() {
            tracing::error!("{e}");
        }
        let step = self.state.step;
        let _ = self.emit(
            event::EXIT,
            json!({"reason": reason, "code": code, "step": step, "error": error, "ranks": self.comm.size()}),
        );
    }

    fn beacon(&self, phase: &str) {
        if let Some(dir) = &self.facts.progress_dir {
            let _ = kiln_run::write_beacon(
                dir,
                self.comm.rank(),
                self.state.step,
                phase,
                kiln_run::unix_time(),
            );
        }
    }

    /// Resumes from the checkpoint rank 0 chose (the other ranks load the same step), or
    /// starts afresh in a new lineage.
    fn resume(
        &mut self,
        chosen: Option<(PathBuf, Checkpoint)>,
        rejected: Vec<checkpoint::Rejection>,
    ) -> Result<(), TrainError> {
        for r in &rejected {
            self.emit(
                event::CHECKPOINT_REJECTED,
                json!({"path": path_text(&r.path), "reason": r.reason, "moved_to": path_text(&r.moved_to)}),
            )?;
            self.note(&format!(
                "rejected checkpoint {}: {} (moved to {})",
                r.path.display(),
                r.reason,
                r.moved_to.display()
            ));
        }
        let mut step = chosen.as_ref().map_or(u64::MAX, |(_, c)| c.step);
        let mut loaded = chosen;
        if self.comm.size() > 1 {
            let mut bytes = step.to_le_bytes();
            self.comm.broadcast_bytes(0, &mut bytes);
            step = u64::from_le_bytes(bytes);
            if loaded.is_none() && step != u64::MAX {
                let dir = self
                    .run_dir
                    .join(kiln_run::layout::CHECKPOINTS)
                    .join(checkpoint::dir_name(step));
                loaded = Some((dir.clone(), checkpoint::load(&dir)?));
            }
        }
        self.state.run_id = self
            .writer
            .as_ref()
            .map(|w| w.run_id.clone())
            .unwrap_or_default();
        match loaded {
            Some((dir, ck)) => self.restore(&dir, &ck),
            None => {
                self.facts.fresh = true;
                self.emit_start(None)
            }
        }
    }

    /// Restores weights, optimizer and state from `ck`, adapting the batch layout when the
    /// run resumes on another number of ranks.
    fn restore(&mut self, dir: &Path, ck: &Checkpoint) -> Result<(), TrainError> {
        let mismatch = |reason: String| TrainError::ResumeMismatch {
            path: dir.to_path_buf(),
            reason,
        };
        let mut st: TrainState = serde_json::from_value(ck.state.clone())
            .map_err(|e| mismatch(format!("unreadable state: {e}")))?;
        if st.model_hash != self.facts.model_hash {
            return Err(mismatch(
                "the model shape (model section or vocab) differs from the config that wrote it; \
                 use a new --run-dir, or restore the original [model] settings"
                    .into(),
            ));
        }
        // Checkpoints of kiln before data parallelism: one rank, global batch from config.
        if st.global_batch == 0 {
            st.global_batch =
                (self.cfg.training.batch_size * self.cfg.training.grad_accum_steps) as u64;
            st.world_size = 1;
        }
        st.sample_cursor = Some(st.next_sample());
        let from_world = st.world_size;
        if self.cfg.training.global_batch_size == 0 && st.global_batch != self.layout.global_batch()
        {
            // Keep the checkpoint's global batch: the accumulation adapts to the ranks.
            self.layout = self
                .layout
                .with_global_batch(st.global_batch)
                .map_err(mismatch)?;
        }
        if from_world != self.layout.world as u64 || st.global_batch != self.layout.global_batch() {
            self.emit(
                event::RESIZED,
                json!({"from_ranks": from_world, "to_ranks": self.layout.world, "global_batch": self.layout.global_batch(),
                       "previous_global_batch": st.global_batch, "grad_accum_steps": self.layout.accum, "step": st.step}),
            )?;
            self.note(&format!(
                "resized: checkpoint of {from_world} rank(s), now {} rank(s) x batch {} x accumulation {} = global batch {}",
                self.layout.world,
                self.layout.micro,
                self.layout.accum,
                self.layout.global_batch()
            ));
        }
        if let Some(schedule) = st.data_schedule.clone().filter(|v| !v.is_null()) {
            self.data = TrainData::open(
                &self.cfg,
                self.layout.samples_for(self.cfg.training.steps),
                Some((schedule, st.next_sample())),
            )
            .map_err(TrainError::Data)?;
        }
        st.global_batch = self.layout.global_batch();
        st.world_size = self.layout.world as u64;
        let kind = self.cfg.optimizer.kind.name();
        if st.optimizer != kind {
            return Err(mismatch(format!(
                "its optimizer state is {}'s and this config says optimizer.kind = {kind:?}; resume with optimizer.kind = {:?}, or start afresh (a new --run-dir, or checkpoint.resume = false)",
                st.optimizer, st.optimizer
            )));
        }
        self.session.load_params(&ck.model, dir)?;
        self.optimizer = Optimizer::new(
            &self.cfg.optimizer,
            self.session.model.specs(),
            &self.session.device,
            self.layout.global_batch() * self.layout.seq as u64,
        );
        self.optimizer
            .load_host_state(
                self.session.model.specs(),
                &ck.optimizer,
                &self.session.device,
            )
            .map_err(mismatch)?;
        self.optimizer.set_step(st.optimizer_step);
        if st.run_id.is_empty() {
            st.run_id = self.state.run_id.clone();
        }
        if st.config_hash != self.facts.config_hash {
            self.emit(
                event::CONFIG_CHANGED,
                json!({"path": path_text(dir), "note": "hyper-parameters differ from the checkpoint's run"}),
            )?;
        }
        self.state = st;
        self.saved_at = Some(self.state.step);
        self.guards.high_water = self.state.step;
        let step = self.state.step;
        self.emit(
            event::CHECKPOINT_LOADED,
            json!({"path": path_text(dir), "step": step}),
        )?;
        self.emit(
            event::RESUME,
            json!({"step": step, "data_cursor": self.state.data_cursor, "sample_cursor": self.state.next_sample(), "path": path_text(dir)}),
        )?;
        self.note(&format!("resumed from {} (step {step})", dir.display()));
        self.emit_start(Some(dir))
    }

    fn emit_start(&mut self, resumed_from: Option<&Path>) -> Result<(), TrainError> {
        let fields = json!({
            "step": self.state.step, "total_steps": self.facts.total, "params": self.session.model.num_params(),
            "device": self.cfg.training.device, "data": self.data.source.describe(),
            "resumed_from": resumed_from.map(path_text), "config_hash": self.facts.config_hash,
            "pid": std::process::id(), "host": kiln_run::host_name(), "ranks": self.layout.world,
            "global_batch": self.layout.global_batch(), "grad_accum_steps": self.layout.accum,
            "engine": self.comm.describe(), "run_id": self.state.run_id,
        });
        self.emit(event::START, fields)?;
        if self.guards.snapshot.is_none() && self.snapshot_due() {
            self.take_snapshot();
        }
        Ok(())
    }

    /// Trains until all steps are done or the ranks agree to stop.
    pub fn run(&mut self) -> Result<TrainReport, TrainError> {
        while self.state.step < self.facts.total {
            let applied = match self.train_step()? {
                Some(m) => {
                    self.after_step(&m)?;
                    true
                }
                None => false,
            };
            self.poll_saves()?;
            let signal = self.agreed_stop();
            let unsaved = self.saved_at != Some(self.state.step);
            if (applied && self.checkpoint_due()) || (signal.is_some() && unsaved) {
                self.checkpoint()?;
            }
            if let Some(signal) = signal {
                return self.preempted(signal);
            }
        }
        self.finish()
    }

    /// One optimizer step: forward and backward over this rank's micro-batches, the
    /// gradient all-reduce, the guards, and the update. `None` when the guards discarded it.
    pub fn train_step(&mut self) -> Result<Option<StepMetrics>, TrainError> {
        let t0 = Instant::now();
        self.beacon("train");
        let lr = optim::lr_at(
            &self.cfg.lr_scheduler,
            self.cfg.optimizer.lr,
            self.state.step,
            self.facts.total,
        );
        let first_sample = self.state.next_sample();
        let (loss, grads, allreduce_s) = self.compute_gradients(first_sample, None)?;
        let grad_norm = optim::global_norm(&grads);
        if let Verdict::Discard = self.check_guards(loss, grad_norm)? {
            return Ok(None);
        }
        // Clipping is folded into the optimizer's pass over each parameter (same bits).
        let clip = optim::clip_coefficient(grad_norm, self.cfg.optimizer.max_grad_norm);
        self.optimizer.update_clipped(
            &mut self.session.params,
            grads,
            clip,
            lr,
            &self.facts.frozen,
        );
        if self.optimizer.hessian_due() {
            self.update_hessian(first_sample)?;
        }
        self.state.step += 1;
        self.state.advance_data(1);
        let tokens = self.layout.global_batch() * self.layout.seq as u64;
        self.state.tokens_seen += tokens;
        self.state.lr = lr;
        self.last_loss = Some(loss);
        self.maybe_corrupt_replica();
        let dt = t0.elapsed().as_secs_f64();
        let tps = tokens as f64 / dt.max(1e-9);
        Ok(Some(StepMetrics {
            step: self.state.step,
            total_steps: self.facts.total,
            loss,
            grad_norm,
            lr,
            tokens_per_s: tps,
            step_time_s: dt,
            mfu: tps * self.facts.flops_per_token
                / (self.facts.peak_flops * self.layout.world as f64),
            rss_mib: metrics::rss_mib(),
            tokens_seen: self.state.tokens_seen,
            first_sample,
            global_batch: self.layout.global_batch(),
            allreduce_s,
        }))
    }

    /// SophiaG's Gauss-Newton-Bartlett estimate after the update: gradients against labels
    /// sampled from the updated model on the step's own batch (the authors draw a fresh
    /// batch; any inputs give an unbiased estimate, and these need no extra data), averaged
    /// over ranks and clipped like the step's gradients, as the authors do. The draws are
    /// seeded by (seed, step, rank), so a resumed run draws the same labels.
    fn update_hessian(&mut self, base: u64) -> Result<(), TrainError> {
        let seed = self.cfg.training.seed
            ^ self.optimizer.step().wrapping_mul(0xD1B5_4A32_D192_ED03)
            ^ (self.comm.rank() as u64).wrapping_mul(0x8CB9_2BA7_2F3D_8DD7);
        let (_, grads, _) = self.compute_gradients(base, Some(seed))?;
        let norm = optim::global_norm(&grads);
        let grads = optim::clip_by_global_norm(grads, norm, self.cfg.optimizer.max_grad_norm);
        self.optimizer.update_hessian(grads);
        Ok(())
    }

    /// This rank's loss and gradients over its micro-batches of the step starting at global
    /// sample `base`, averaged over all ranks, and the seconds the averaging took; against
    /// the data's labels, or with `sampled = Some(seed)` against labels drawn from the model
    /// (SophiaG's estimator).
    fn compute_gradients(
        &mut self,
        base: u64,
        sampled: Option<u64>,
    ) -> Result<(f32, Vec<Tensor<1>>, f64), TrainError> {
        let cfg = &self.cfg;
        let mut grads: Option<Vec<Tensor<1>>> = None;
        let mut loss_sum = 0.0f32;
        for micro in 0..self.layout.accum {
            let rows: Vec<Vec<u32>> = self
                .layout
                .rows(base, micro)
                .map(|i| self.data.source.sample(i, self.layout.seq + 1))
                .collect::<Result<_, _>>()
                .map_err(TrainError::DataRead)?;
            let batch_no = self.state.data_cursor + 1;
            let rows = if cfg.debug.spike_at_step > 0 && batch_no == cfg.debug.spike_at_step {
                step::corrupt_batch(&rows, self.session.model.vocab(), cfg.training.seed)
            } else {
                rows
            };
            let labels = match sampled {
                Some(seed) => Labels::Sampled {
                    seed: seed ^ (micro as u64).wrapping_mul(0xA24B_AED4_963E_E407),
                },
                None => Labels::Data {
                    poison: cfg.debug.nan_at_step > 0 && batch_no == cfg.debug.nan_at_step,
                },
            };
            let (loss, micro_grads) = step::loss_and_grads(
                &self.session.model,
                &self.session.params,
                &rows,
                self.layout.seq,
                &self.ad_device,
                1.0 / self.layout.accum as f64,
                cfg.training.compute_shards.max(1),
                labels,
            );
            loss_sum += loss;
            grads = Some(match grads {
                None => micro_grads,
                Some(acc) => acc
                    .into_iter()
                    .zip(micro_grads)
                    .map(|(a, b)| a + b)
                    .collect(),
            });
        }
        let grads = grads.unwrap_or_default();
        if self.comm.size() == 1 {
            return Ok((loss_sum, grads, 0.0));
        }
        // One flat host buffer: every gradient, then the loss, averaged over the ranks.
        let t0 = Instant::now();
        let mut flat = step::flatten(&grads);
        flat.push(loss_sum);
        self.facts.grads.mean(self.comm.as_ref(), &mut flat);
        let loss = flat.pop().unwrap_or(f32::NAN);
        let grads = step::unflatten(&flat, &grads, &self.session.device);
        Ok((loss, grads, t0.elapsed().as_secs_f64()))
    }

    /// The guards on one step's (global) loss and gradient norm: skip non-finite steps, roll
    /// back after too many of them or on a loss spike, check the first loss. Every rank sees
    /// the same values, so every rank decides the same.
    fn check_guards(&mut self, loss: f32, grad_norm: f32) -> Result<Verdict, TrainError> {
        let g = self.cfg.guards.clone();
        if !loss.is_finite() || !grad_norm.is_finite() {
            self.state.nonfinite_skipped += 1;
            self.guards.nonfinite_in_row += 1;
            self.state.advance_data(1);
            let (step, in_row) = (self.state.step, self.guards.nonfinite_in_row);
            self.emit(event::NONFINITE_SKIP, json!({"step": step, "loss": loss.to_string(), "grad_norm": grad_norm.to_string(), "in_row": in_row}))?;
            self.note(&format!(
                "step {}: non-finite loss/gradients, step skipped",
                step + 1
            ));
            if in_row >= g.max_nonfinite_in_row {
                self.rollback("nonfinite", 0)?;
            }
            return Ok(Verdict::Discard);
        }
        self.guards.nonfinite_in_row = 0;
        if self.facts.fresh && self.state.step == 0 {
            let vocab = self.session.model.vocab();
            if let Some(msg) = guards::check_initial_loss(loss, vocab, g.initial_loss_tolerance) {
                self.emit(
                    event::INITIAL_LOSS_ERROR,
                    json!({"loss": loss, "vocab": vocab, "message": msg}),
                )?;
                return Err(TrainError::Guard(msg));
            }
            self.emit(
                event::INITIAL_LOSS_OK,
                json!({"loss": loss, "expected": (vocab as f64).ln()}),
            )?;
        }
        if let LossVerdict::Spike { loss, mean, std } = self.state.spike_window.observe(loss, &g) {
            let step = self.state.step + 1;
            self.emit(
                event::LOSS_SPIKE,
                json!({"step": step, "loss": loss, "window_mean": mean, "window_std": std}),
            )?;
            self.note(&format!(
                "step {step}: loss spike {loss:.3} (window mean {mean:.3})"
            ));
            self.state.advance_data(1);
            if self.guards.snapshot.is_some() {
                self.rollback("loss_spike", g.spike_skip_batches)?;
            } else {
                // Without a snapshot, at least do not learn from the spiking batch.
                self.emit(
                    event::SPIKE_SKIP,
                    json!({"step": step, "note": "no snapshot; batch skipped"}),
                )?;
            }
            return Ok(Verdict::Discard);
        }
        Ok(Verdict::Update)
    }

    /// Restores the last snapshot and skips `skip` more batches. Past
    /// `guards.max_rollbacks` rollbacks that made no progress the run stops, naming the
    /// likely cause; the checkpoints on disk (the last good state) are kept.
    fn rollback(&mut self, reason: &str, skip: u64) -> Result<(), TrainError> {
        let Some(snap) = self.guards.snapshot.clone() else {
            return Err(TrainError::Guard(format!(
                "{} non-finite steps in a row at step {} and no snapshot to roll back to (guards.snapshot_interval = 0); {}",
                self.guards.nonfinite_in_row,
                self.state.step + 1,
                self.likely_cause(reason)
            )));
        };
        let limit = self.cfg.guards.max_rollbacks;
        if limit > 0 && self.guards.rollbacks_in_row >= limit {
            let msg = format!(
                "{} rollbacks in a row did not get training past step {} ({reason}); {}; the last good state is the newest checkpoint{}",
                self.guards.rollbacks_in_row,
                self.guards.high_water,
                self.likely_cause(reason),
                self.saved_at
                    .map_or(String::new(), |s| format!(" (step {s})"))
            );
            self.emit(
                event::ROLLBACK_LIMIT,
                json!({"step": self.state.step, "rollbacks_in_row": self.guards.rollbacks_in_row, "reason": reason}),
            )?;
            return Err(TrainError::Guard(msg));
        }
        self.state.advance_data(skip);
        let from = self.state.step;
        let (data_cursor, sample_cursor) = (self.state.data_cursor, self.state.next_sample());
        self.emit(
            event::ROLLBACK,
            json!({"from_step": from, "to_step": snap.state.step, "reason": reason, "skip_batches": skip, "data_cursor": data_cursor}),
        )?;
        self.note(&format!(
            "step {}: rolled back to step {} ({reason}) and skipped {skip} batches",
            from + 1,
            snap.state.step
        ));
        let rollbacks = self.state.rollbacks + 1;
        let nonfinite = self.state.nonfinite_skipped;
        self.state = TrainState {
            data_cursor,
            sample_cursor: Some(sample_cursor),
            rollbacks,
            nonfinite_skipped: nonfinite,
            data_schedule: self.state.data_schedule.take(),
            ..snap.state
        };
        self.session.params = snap.params;
        self.optimizer = snap.optimizer;
        self.guards.nonfinite_in_row = 0;
        self.guards.rollbacks_in_row += 1;
        Ok(())
    }

    /// What most likely makes every step fail, for the guard's stop message.
    fn likely_cause(&self, reason: &str) -> String {
        let early = self.guards.high_water <= self.cfg.guards.snapshot_interval.max(1);
        match (reason, early && self.facts.fresh) {
            ("nonfinite", true) => "every step of a fresh model is non-finite: a config value is likely wrong (check optimizer.lr, eps, weight_decay, model.norm_eps, rope_theta, init_std) or the data holds token ids beyond the vocabulary".into(),
            ("nonfinite", _) => "training diverged: lower optimizer.lr or raise warmup, check the data around this step for garbage".into(),
            _ => "the loss keeps spiking past the skipped batches: lower optimizer.lr, or inspect the data around this step".into(),
        }
    }

    /// After an applied step: metrics, snapshot, frozen and replica checks, eval.
    fn after_step(&mut self, m: &StepMetrics) -> Result<(), TrainError> {
        let step = self.state.step;
        if step > self.guards.high_water {
            self.guards.high_water = step;
            self.guards.rollbacks_in_row = 0;
        }
        if self.writer.is_some() {
            if step.is_multiple_of(self.cfg.metrics.log_interval.max(1)) || step == self.facts.total
            {
                self.write_metrics(m)?;
            }
            self.observer.on_step(m);
        }
        if self.snapshot_due() {
            self.take_snapshot();
        }
        self.check_frozen()?;
        let every = self.cfg.guards.replica_check_interval;
        if every > 0 && step.is_multiple_of(every) {
            self.check_replicas()?;
        }
        let eval_every = self.cfg.eval.interval;
        if (eval_every > 0 && step.is_multiple_of(eval_every)) || step == self.facts.total {
            self.evaluate()?;
        }
        Ok(())
    }

    fn write_metrics<T: serde::Serialize>(&mut self, record: &T) -> Result<(), TrainError> {
        if let Some(w) = &mut self.writer {
            let mut line = serde_json::to_vec(record).unwrap_or_default();
            line.push(b'\n');
            let path = w.run.path().join(kiln_run::layout::METRICS);
            w.metrics.write_all(&line).map_err(io(&path))?;
        }
        Ok(())
    }

    fn snapshot_due(&self) -> bool {
        let every = self.cfg.guards.snapshot_interval;
        every > 0 && self.state.step.is_multiple_of(every)
    }

    fn take_snapshot(&mut self) {
        self.guards.snapshot = Some(Snapshot {
            state: self.state.clone(),
            params: self.session.params.clone(),
            optimizer: self.optimizer.clone(),
        });
    }

    /// Names parameter tensors that did not change over the check interval (an event, not a
    /// stop: the writer rank checks, since every rank holds the same parameters).
    fn check_frozen(&mut self) -> Result<(), TrainError> {
        let every = self.cfg.guards.frozen_check_interval;
        let step = self.state.step;
        if every == 0 || !step.is_multiple_of(every) || self.writer.is_none() {
            return Ok(());
        }
        if let Some(prev) = &self.guards.last_frozen_check {
            let unchanged = step::unchanged_params(&self.session.params, prev);
            if !unchanged.is_empty() {
                let names: Vec<String> = unchanged
                    .iter()
                    .map(|&i| self.session.model.specs()[i].name.clone())
                    .collect();
                self.emit(
                    event::FROZEN_PARAMS,
                    json!({"step": step, "since_step": step.saturating_sub(every), "params": names}),
                )?;
                self.note(&format!(
                    "step {step}: {} parameter tensors did not change in {every} steps: {}",
                    names.len(),
                    names.join(", ")
                ));
            }
        }
        self.guards.last_frozen_check = Some(self.session.params.clone());
        Ok(())
    }

    /// Compares a checksum of every rank's parameters; the ranks that differ from the
    /// majority are named and the run stops before their weights can be saved.
    fn check_replicas(&mut self) -> Result<(), TrainError> {
        if self.comm.size() == 1 {
            return Ok(());
        }
        let sums = self
            .comm
            .all_gather_u64(step::params_checksum(&self.session.params));
        let culprits = step::minority_ranks(&sums);
        if culprits.is_empty() {
            return Ok(());
        }
        let step = self.state.step;
        let hex: Vec<String> = sums.iter().map(|s| format!("{s:016x}")).collect();
        self.emit(
            event::REPLICA_MISMATCH,
            json!({"step": step, "ranks": culprits, "checksums": hex}),
        )?;
        Err(TrainError::ReplicaMismatch {
            step,
            ranks: culprits,
        })
    }

    /// `debug.corrupt_replica_*`: perturbs one rank's parameters as silent data corruption
    /// would.
    fn maybe_corrupt_replica(&mut self) {
        let d = &self.cfg.debug;
        if d.corrupt_replica_at_step > 0
            && self.state.step == d.corrupt_replica_at_step
            && self.comm.rank() == d.corrupt_replica_rank
            && let Some(p) = self.session.params.first_mut()
        {
            *p = p.clone().add_scalar(1e-3);
        }
    }

    /// Held-out eval on the writer rank (the others go on to the next step's all-reduce and
    /// wait there).
    fn evaluate(&mut self) -> Result<(), TrainError> {
        if self.writer.is_none() {
            return Ok(());
        }
        self.beacon("eval");
        // eval.samples = 0: no held-out eval (rather than a loss of 0 over no sequences).
        let Some(syn) = self
            .data
            .synthetic
            .as_ref()
            .filter(|_| self.cfg.eval.samples > 0)
        else {
            return Ok(());
        };
        let mut e = self.session.evaluate_synthetic(
            syn,
            self.state.step,
            self.cfg.eval.samples,
            self.facts.unigram,
        );
        e.extra = self.observer.extra_eval(&self.session);
        self.write_metrics(&e)?;
        self.observer.on_eval(&e);
        self.last_eval = Some(e);
        Ok(())
    }

    fn checkpoint_due(&self) -> bool {
        let every = self.cfg.checkpoint.interval;
        (every > 0 && self.state.step.is_multiple_of(every)) || self.state.step == self.facts.total
    }

    /// The stop signal any rank got, agreed by all ranks at the same step.
    pub fn agreed_stop(&mut self) -> Option<i32> {
        let mine = self.stop.load(Ordering::SeqCst) as u64;
        let mut flag = [mine];
        self.comm.all_reduce_max_u64(&mut flag);
        if flag[0] == 0 {
            return None;
        }
        let who: Vec<usize> = if self.comm.size() > 1 {
            let all = self.comm.all_gather_u64(mine);
            (0..all.len()).filter(|&r| all[r] != 0).collect()
        } else {
            vec![0]
        };
        let step = self.state.step;
        let _ = self.emit(
            event::SIGNAL,
            json!({"signal": flag[0], "step": step, "ranks": who}),
        );
        Some(flag[0] as i32)
    }

    /// Saves a checkpoint of the current state (writer rank), after checking that the ranks
    /// agree on the parameters. Every rank calls it at the same step.
    pub fn checkpoint(&mut self) -> Result<(), TrainError> {
        self.check_replicas()?;
        self.beacon("checkpoint");
        if let Some(schedule) = self.data.source.resume_state() {
            self.state.data_schedule = Some(schedule);
        }
        self.state.optimizer_step = self.optimizer.step();
        self.state.optimizer = self.optimizer.kind().name().to_string();
        self.state.schedule = format!("{:?}", self.cfg.lr_scheduler.kind).to_lowercase();
        self.state.model_hash = self.facts.model_hash.clone();
        self.state.config_hash = self.facts.config_hash.clone();
        self.state.kiln_version = env!("CARGO_PKG_VERSION").to_string();
        if self.writer.is_some() {
            // The step stages references to the state (no copy) and, with a save still in
            // flight, waits for that save; the saver copies and writes (see crate::saver).
            let t0 = Instant::now();
            let staged = Staged {
                step: self.state.step,
                model: self.session.named_params(),
                optimizer: self.optimizer.named_state(self.session.model.specs()),
                state: serde_json::to_value(&self.state).unwrap_or_default(),
            };
            let stage_s = t0.elapsed().as_secs_f64();
            let finished = match &mut self.writer {
                Some(w) => w.saver.submit(staged, stage_s),
                None => Vec::new(),
            };
            for outcome in finished {
                self.report_saved(outcome?)?;
            }
        }
        self.saved_at = Some(self.state.step);
        Ok(())
    }

    /// The `checkpoint_saved` event of a finished save: its step's stall (what the training
    /// step waited for) and the write time.
    fn report_saved(&mut self, saved: Saved) -> Result<(), TrainError> {
        let pruned: Vec<String> = saved.report.pruned.iter().map(|p| path_text(p)).collect();
        let superseded: Vec<String> = saved
            .report
            .superseded
            .iter()
            .map(|r| path_text(&r.moved_to))
            .collect();
        self.emit(
            event::CHECKPOINT_SAVED,
            json!({"step": saved.step, "path": path_text(&saved.report.path),
                   "stall_s": saved.stall_s, "write_s": saved.write_s, "seconds": saved.write_s,
                   "async": saved.asynchronous, "pruned": pruned, "superseded": superseded}),
        )?;
        let msg = format!(
            "saved {} (step stalled {:.3} s, write {:.3} s)",
            saved.report.path.display(),
            saved.stall_s,
            saved.write_s
        );
        self.note(&msg);
        Ok(())
    }

    /// Reports the save in flight if it has finished (never waits).
    fn poll_saves(&mut self) -> Result<(), TrainError> {
        let done = self.writer.as_mut().and_then(|w| w.saver.poll());
        match done {
            Some(outcome) => self.report_saved(outcome?),
            None => Ok(()),
        }
    }

    /// Waits for the save in flight, if any, and reports it.
    fn wait_saves(&mut self) -> Result<(), TrainError> {
        let done = self.writer.as_mut().and_then(|w| w.saver.wait());
        match done {
            Some(outcome) => self.report_saved(outcome?),
            None => Ok(()),
        }
    }

    /// Stopped by an agreed signal: the checkpoint is saved (the writer rank waits for it);
    /// every rank waits for the writer, then all leave with the same outcome.
    fn preempted(&mut self, signal: i32) -> Result<TrainReport, TrainError> {
        self.wait_saves()?;
        self.comm.barrier();
        self.emit_exit("preempted", exit::PREEMPTED, None);
        Ok(self.report(Outcome::Preempted { signal }))
    }

    /// All steps done: the final checkpoint and `model.safetensors`.
    fn finish(&mut self) -> Result<TrainReport, TrainError> {
        if self.saved_at != Some(self.state.step) {
            self.checkpoint()?;
        }
        self.wait_saves()?;
        if let Some(w) = &self.writer {
            let bytes = checkpoint::to_safetensors(&self.session.host_params()).map_err(|e| {
                TrainError::Io {
                    path: w.run.path().join(kiln_run::layout::FINAL_MODEL),
                    source: std::io::Error::other(e.to_string()),
                }
            })?;
            w.run.write_file(kiln_run::layout::FINAL_MODEL, &bytes)?;
        }
        self.beacon("done");
        self.comm.barrier();
        self.emit_exit("completed", exit::SUCCESS, None);
        Ok(self.report(Outcome::Completed))
    }

    fn report(&self, outcome: Outcome) -> TrainReport {
        TrainReport {
            outcome,
            step: self.state.step,
            last_loss: self.last_loss,
            last_eval: self.last_eval.clone(),
            seconds: self.facts.started.elapsed().as_secs_f64(),
        }
    }

    /// The model and its parameters (for callers that inspect a finished run).
    pub fn session(&self) -> &Session {
        &self.session
    }
}

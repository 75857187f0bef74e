//! The step loop: [`Trainer`] owns a run's parts and calls them in order. The parts decide
//! for themselves: the [`Step`] computes and applies each step; the [`GuardRail`] judges it
//! and rolls back; the [`Checkpointer`], the [`Evaluator`] and the [`ReplicaCheck`] each
//! know when they are due; the [`Journal`] reports (the writer rank's run directory and the
//! caller's observer). [`train`] owns the collective that joins data-parallel ranks, since
//! it is the one that must end them all when one fails.
//!
//! Everything that decides what the next step computes is state saved in each checkpoint:
//! weights, the optimizer's state (keyed by parameter name) and step count, and the
//! [`TrainState`] (step, data cursor, the guards' loss window, the blend's history). Data
//! and init are pure functions of the seed and counters, so a run killed anywhere and
//! restarted from its newest checkpoint ends bit-identical to one never interrupted.
//!
//! Data parallelism: every rank holds the whole model and computes gradients on its slice of
//! the global batch; gradients and the loss are averaged over ranks before clipping, so every
//! decision (skip, rollback, stop, checkpoint) is taken from identical values on every rank
//! at the same step. Rank 0 is the one writer of the run directory; it writes checkpoints
//! on a background thread ([`crate::saver`]), so the other ranks never wait for its disk
//! except when the run ends.

use crate::checkpoint::ShardFile;
use crate::checkpoint::{self, Checkpoint, CheckpointManager};
use crate::config::{Config, Shard};
use crate::data::TrainData;
use crate::error::{TrainError, io};
use crate::eval::Evaluator;
use crate::guard_rail::{GuardRail, Judged, Live, Verdict};
use crate::journal::{Journal, Writer, path_text};
use crate::metrics::{self, EvalMetrics, Observer, StepMetrics};
use crate::model::ParamSpec;
use crate::optim::{self, Optimizer};
use crate::replicas::ReplicaCheck;
use crate::run_dir::RunDir;
use crate::saver::{Checkpointer, Saver, Staged};
use crate::session::{Session, sha256_hex};
use crate::shard::ShardPlan;
use crate::snapshot::{Recovered, Snapshotter, broadcast_vec};
use crate::stagewise;
use crate::startup::{Startup, phase};
use crate::state::{TrainState, new_run_id};
use crate::step::{At, BatchLayout, Step};
use kiln_dist::Collective;
use kiln_run::{EventLog, event, exit};
use serde_json::json;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Instant;

/// Where a resume came from (the `resume` event's fields).
struct Resumed {
    tier: &'static str,
    persistent_step: Option<u64>,
    source_rank: Option<usize>,
    peer_ranks: Vec<usize>,
}

impl Resumed {
    fn memory(r: &Recovered, persistent_step: Option<u64>) -> Self {
        Self {
            tier: r.tier,
            persistent_step,
            source_rank: r.source_rank,
            peer_ranks: r.peer_ranks.clone(),
        }
    }

    fn persistent(persistent_step: Option<u64>) -> Self {
        Self {
            tier: event::tier::PERSISTENT,
            persistent_step,
            source_rank: None,
            peer_ranks: Vec::new(),
        }
    }
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

/// Quantities fixed for the whole run.
struct RunFacts {
    total: u64,
    flops_per_token: f64,
    peak_flops: f64,
    model_hash: String,
    config_hash: String,
    log_every: crate::cadence::Every,
    progress_dir: Option<PathBuf>,
    started: Instant,
}

impl RunFacts {
    fn new(cfg: &Config, session: &Session) -> Self {
        let threads = if cfg.training.threads > 0 {
            cfg.training.threads
        } else {
            rayon::current_num_threads()
        };
        // 0 when nothing says: the MFU then reads 0 (see `guess_peak_flops`).
        let peak_flops = if cfg.training.peak_flops > 0.0 {
            cfg.training.peak_flops
        } else {
            crate::session::guess_peak_flops(&cfg.training.device, cfg.training.dtype, threads)
                .unwrap_or(0.0)
        };
        Self {
            total: cfg.training.steps,
            flops_per_token: session.model.flops_per_token(cfg.training.seq_len),
            peak_flops,
            model_hash: session.model_hash(),
            config_hash: sha256_hex(&cfg.to_toml()),
            log_every: crate::cadence::Every(cfg.metrics.log_interval.max(1)),
            progress_dir: std::env::var_os(kiln_run::PROGRESS_DIR_ENV).map(PathBuf::from),
            started: Instant::now(),
        }
    }
}

/// One training run. See the module documentation.
pub struct Trainer<'a> {
    cfg: Config,
    run_dir: PathBuf,
    session: Session,
    optimizer: Optimizer,
    data: TrainData,
    /// The exact-resume state.
    pub state: TrainState,
    step: Step<'a>,
    guards: GuardRail,
    checkpoints: Checkpointer,
    snapshots: Snapshotter,
    startup: Startup,
    eval: Evaluator,
    replicas: ReplicaCheck,
    journal: Journal<'a>,
    comm: &'a dyn Collective,
    stop: Arc<AtomicUsize>,
    facts: RunFacts,
    last_loss: Option<f32>,
    last_eval: Option<EvalMetrics>,
}

/// Trains according to `opts`, resuming from the newest valid checkpoint in the run
/// directory. Returns when all steps are done or a stop signal was handled. Every way out
/// writes an `exit` event; with several ranks, an error on one rank that the others cannot
/// know about ends all of them (MPI_Abort) so that none waits forever in a collective.
pub fn train(opts: &TrainOptions, observer: &mut dyn Observer) -> Result<TrainReport, TrainError> {
    let mut startup = Startup::begin();
    let rank_env = kiln_topology::RankEnv::from_process_env()
        .map_err(|e| TrainError::Parallel(format!("rank environment: {e}")))?;
    let comm = kiln_dist::init(&rank_env, opts.config.parallelism.prefetches())?;
    let comm = comm.as_ref();
    startup.mark(phase::MPI_INIT);
    let mut trainer = Trainer::starting(opts, comm, observer, startup).inspect_err(|e| {
        if !e.is_collective() {
            abort_all(comm, e);
        }
    })?;
    trainer.run().inspect_err(|e| {
        trainer.emit_exit("error", e.exit_code(), Some(&e.to_string()));
        if e.is_collective() {
            comm.barrier();
        } else {
            abort_all(comm, e);
        }
    })
}

/// Ends every rank with `e`'s exit code (MPI_Abort), so no rank waits in a collective.
fn abort_all(comm: &dyn Collective, e: &TrainError) {
    if comm.size() > 1 {
        tracing::error!("rank {}: {e}", comm.rank());
        comm.abort(e.exit_code());
    }
}

/// What the writer rank found when it opened the run directory.
struct Opened {
    writer: Writer,
    saver: Saver,
    run_id: String,
    resume: Option<(PathBuf, Checkpoint)>,
    rejected: Vec<checkpoint::Rejection>,
}

impl<'a> Trainer<'a> {
    /// Sets up a run: the run directory (writer rank), data, model and optimizer, and the
    /// newest valid checkpoint when resuming. Past the run directory's opening, an error is
    /// written as the `exit` event before it is returned.
    pub fn new(
        opts: &TrainOptions,
        comm: &'a dyn Collective,
        observer: &'a mut dyn Observer,
    ) -> Result<Self, TrainError> {
        Self::starting(opts, comm, observer, Startup::begin())
    }

    /// [`Trainer::new`] with the phase clock `train` started before the collective.
    fn starting(
        opts: &TrainOptions,
        comm: &'a dyn Collective,
        observer: &'a mut dyn Observer,
        mut startup: Startup,
    ) -> Result<Self, TrainError> {
        let cfg = opts.config.clone();
        cfg.validate()?;
        let opened = (comm.rank() == 0).then(|| open_run_dir(opts)).transpose()?;
        startup.mark(phase::RUN_DIR);
        let (writer, saver, run_id, resume, rejected) = match opened {
            Some(o) => (
                Some(o.writer),
                Some(o.saver),
                o.run_id,
                o.resume,
                o.rejected,
            ),
            None => (None, None, String::new(), None, Vec::new()),
        };
        let mut journal = Journal::new(writer, observer);
        let (layout, data, session) = match build(&cfg, comm, &opts.run_dir, &mut startup) {
            Ok(parts) => parts,
            Err(e) => {
                let fields = json!({"reason": "error", "code": e.exit_code(), "step": 0, "error": e.to_string()});
                let _ = journal.emit(event::EXIT, fields);
                return Err(e);
            }
        };
        let tokens = layout.global_batch() * layout.seq as u64;
        let step = Step::new(&cfg, &session, layout, comm)?;
        let mut session = session;
        keep_pieces(&step, &mut session);
        let specs = session.model.specs();
        let optimizer = match step.shard() {
            Some(plan) => Optimizer::sharded(&cfg.optimizer, specs, &session.device, plan.ranges()),
            None => Optimizer::new(&cfg.optimizer, specs, &session.device, tokens),
        };
        let facts = RunFacts::new(&cfg, &session);
        let state = TrainState::fresh(
            cfg.training.seed,
            run_id,
            layout.global_batch(),
            layout.world as u64,
        );
        let mut t = Self {
            snapshots: Snapshotter::new(
                &cfg.effective_checkpoint(),
                &opts.run_dir,
                comm.rank(),
                cfg.guards.snapshot_interval,
            ),
            step,
            guards: GuardRail::new(&cfg.guards),
            checkpoints: Checkpointer::new(cfg.checkpoint.interval, cfg.training.steps, saver),
            startup,
            eval: Evaluator::new(&cfg, cfg.training.steps, data.synthetic.as_ref()),
            replicas: ReplicaCheck::new(cfg.guards.replica_check_interval),
            run_dir: opts.run_dir.clone(),
            cfg,
            session,
            optimizer,
            data,
            state,
            journal,
            comm,
            stop: Arc::new(AtomicUsize::new(0)),
            facts,
            last_loss: None,
            last_eval: None,
        };
        t.setup(resume, rejected)
            .inspect_err(|e| t.emit_exit("error", e.exit_code(), Some(&e.to_string())))?;
        Ok(t)
    }

    /// The stop signals, the ranks' agreement on the config, and the resume.
    fn setup(
        &mut self,
        resume: Option<(PathBuf, Checkpoint)>,
        rejected: Vec<checkpoint::Rejection>,
    ) -> Result<(), TrainError> {
        for sig in STOP_SIGNALS {
            signal_hook::flag::register_usize(sig, Arc::clone(&self.stop), sig as usize)
                .map_err(io(&self.run_dir))?;
        }
        self.startup.mark(phase::MODEL_INIT);
        self.check_ranks_agree()?;
        self.resume(resume, rejected)?;
        self.startup.mark(phase::CHECKPOINT_LOAD);
        Ok(())
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

    /// Writes the `exit` event (writer rank), ignoring a failure to write it: it is the last
    /// thing a failing run does. A checkpoint still being written is waited for first, so no
    /// way out leaves one half done.
    fn emit_exit(&mut self, reason: &str, code: i32, error: Option<&str>) {
        if let Err(e) = self.checkpoints.wait(&mut self.journal) {
            tracing::error!("{e}");
        }
        if let Err(e) = self.snapshots.wait(&mut self.journal) {
            tracing::error!("{e}");
        }
        let step = self.state.step;
        let _ = self.journal.emit(
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

    /// Resumes from the newest state a tier holds: the ranks' memory snapshots (a rank
    /// without the agreed one receives it from a peer) when one is at least as new as the
    /// persistent checkpoint rank 0 chose; else that checkpoint (the other ranks load the
    /// same step); else a fresh start in a new lineage.
    fn resume(
        &mut self,
        chosen: Option<(PathBuf, Checkpoint)>,
        rejected: Vec<checkpoint::Rejection>,
    ) -> Result<(), TrainError> {
        self.report_rejected(&rejected)?;
        let persistent = self.agree_on_lineage(chosen.as_ref().map(|(_, c)| c.step));
        if !self.cfg.checkpoint.resume {
            self.snapshots.clear(&mut self.journal);
        } else if let Some(r) = self.snapshots.recover(
            self.comm,
            &self.state.run_id.clone(),
            persistent,
            &mut self.journal,
        )? {
            let from = Resumed::memory(&r, persistent);
            self.restore_rollback_point(&r.ck)?;
            return self.restore(&r.dir, &r.ck, &from);
        }
        let specs = self.session.model.specs();
        let loaded = match (chosen, persistent) {
            (Some(c), _) if self.step.shard().is_none() => Some(c),
            // Rank 0 verified it without reading its tensors: this rank's pieces now.
            (Some((dir, _)), _) => Some((dir.clone(), read_checkpoint(&self.step, specs, &dir)?)),
            (None, Some(step)) => {
                let dir = self
                    .run_dir
                    .join(kiln_run::layout::CHECKPOINTS)
                    .join(checkpoint::dir_name(step));
                Some((dir.clone(), read_checkpoint(&self.step, specs, &dir)?))
            }
            (None, None) => None,
        };
        match loaded {
            Some((dir, ck)) => {
                self.restore_rollback_point(&ck)?;
                self.restore(&dir, &ck, &Resumed::persistent(persistent))
            }
            None => self.emit_start(None),
        }
    }

    /// Gives the guards the rollback snapshot an uninterrupted run would hold when it reached
    /// `ck`: the state at the newest multiple of `guards.snapshot_interval` before it (the
    /// fresh state for step 0), from this rank's memory tier or the persistent one, or from a
    /// peer that holds it. When no tier kept it the guards start afresh and say so: a
    /// rollback before their next snapshot would then differ from an uninterrupted run's.
    fn restore_rollback_point(&mut self, ck: &Checkpoint) -> Result<(), TrainError> {
        let Some(at) = self.guards.snapshot_before(ck.step) else {
            return Ok(());
        };
        if at > 0 {
            let run_id = checkpoint::lineage_of(&ck.state)
                .unwrap_or(&self.state.run_id)
                .to_string();
            let persistent =
                (self.run_dir.join(kiln_run::layout::CHECKPOINTS)).join(checkpoint::dir_name(at));
            let (step, specs) = (&self.step, self.session.model.specs());
            let read = |dir: &Path| read_checkpoint(step, specs, dir);
            let found = self.snapshots.at_step(
                self.comm,
                (&run_id, at),
                (&persistent, &read),
                &mut self.journal,
            )?;
            let Some((dir, anchor)) = found else {
                return self.journal.emit(
                    event::ROLLBACK_POINT_LOST,
                    json!({"step": at, "resumed_step": ck.step}),
                );
            };
            self.state = self.load(&dir, &anchor, false)?;
        }
        let live = Live {
            state: &mut self.state,
            session: &mut self.session,
            optimizer: &mut self.optimizer,
        };
        self.guards.adopt_snapshot(&live);
        Ok(())
    }

    /// Rank 0's persistent resume step and lineage, on every rank (the lineage goes into
    /// every rank's state, so every rank's snapshots are the same run's).
    fn agree_on_lineage(&mut self, persistent: Option<u64>) -> Option<u64> {
        if self.comm.size() == 1 {
            return persistent;
        }
        let mut bytes = persistent.map_or(u64::MAX, |s| s).to_le_bytes();
        self.comm.broadcast_bytes(0, &mut bytes);
        let mut run_id = self.state.run_id.clone().into_bytes();
        broadcast_vec(self.comm, 0, &mut run_id);
        self.state.run_id = String::from_utf8_lossy(&run_id).into_owned();
        let step = u64::from_le_bytes(bytes);
        (step != u64::MAX).then_some(step)
    }

    fn report_rejected(&mut self, rejected: &[checkpoint::Rejection]) -> Result<(), TrainError> {
        for r in rejected {
            self.journal.emit(
                event::CHECKPOINT_REJECTED,
                json!({"path": path_text(&r.path), "reason": r.reason, "moved_to": path_text(&r.moved_to)}),
            )?;
            self.journal.note(&format!(
                "rejected checkpoint {}: {} (moved to {})",
                r.path.display(),
                r.reason,
                r.moved_to.display()
            ));
        }
        Ok(())
    }

    /// Restores every part from `ck`; each part restores its own state. The batch layout
    /// keeps the checkpoint's global batch when the run resumes on another number of ranks.
    fn restore(&mut self, dir: &Path, ck: &Checkpoint, from: &Resumed) -> Result<(), TrainError> {
        self.state = self.load(dir, ck, true)?;
        let step = self.state.step;
        // What is on disk is the persistent checkpoint: a memory snapshot does not survive
        // the node, so a stop signal after this resume still saves.
        if let Some(p) = from.persistent_step {
            self.checkpoints.restored(p);
        }
        self.guards.restored(step);
        self.journal.emit(
            event::CHECKPOINT_LOADED,
            json!({"path": path_text(dir), "step": step, "tier": from.tier}),
        )?;
        self.journal.emit(
            event::RESUME,
            json!({"step": step, "data_cursor": self.state.data_cursor, "sample_cursor": self.state.next_sample(),
                   "path": path_text(dir), "tier": from.tier, "persistent_step": from.persistent_step,
                   "source_rank": from.source_rank, "peer_ranks": from.peer_ranks}),
        )?;
        self.journal.note(&format!(
            "resumed from {} (step {step}, {} tier)",
            dir.display(),
            from.tier
        ));
        self.emit_start(Some(dir))
    }

    /// The model and optimizer of `ck` loaded, and its state to adopt. `resume`: training
    /// goes on from it (the batch layout and the data follow it; a changed rank count or
    /// hyper-parameters are reported); else it is only the guards' rollback point.
    fn load(
        &mut self,
        dir: &Path,
        ck: &Checkpoint,
        resume: bool,
    ) -> Result<TrainState, TrainError> {
        let mismatch = |reason: String| TrainError::ResumeMismatch {
            path: dir.to_path_buf(),
            reason,
        };
        let mut st = TrainState::from_checkpoint(&ck.state, &self.cfg, &self.facts.model_hash)
            .map_err(mismatch)?;
        let layout = self
            .step
            .layout()
            .resumed(&self.cfg.training, st.global_batch)
            .map_err(mismatch)?;
        if resume {
            self.report_resize(&st, &layout)?;
            self.step.set_layout(layout);
        }
        let schedule = st.data_schedule.clone().filter(|v| resume && !v.is_null());
        if let Some(schedule) = schedule {
            let samples = layout.samples_for(self.cfg.training.steps);
            self.data = TrainData::open(&self.cfg, samples, Some((schedule, st.next_sample())))
                .map_err(TrainError::Data)?;
        }
        st.global_batch = layout.global_batch();
        st.world_size = layout.world as u64;
        match self.step.parameter_shards() {
            Some(plan) => self.session.load_pieces(&ck.model, plan.ranges(), dir)?,
            None => self.session.load_params(&ck.model, dir)?,
        }
        let specs = self.session.model.specs();
        let tokens = layout.global_batch() * layout.seq as u64;
        let saved = (ck.optimizer.as_slice(), st.optimizer_step);
        let shard = self.step.shard().map(ShardPlan::ranges);
        self.optimizer = Optimizer::restore(
            &self.cfg.optimizer,
            specs,
            &self.session.device,
            (tokens, shard),
            saved,
        )
        .map_err(mismatch)?;
        if st.run_id.is_empty() {
            st.run_id = self.state.run_id.clone();
        }
        if resume && st.config_hash != self.facts.config_hash {
            self.journal.emit(
                event::CONFIG_CHANGED,
                json!({"path": path_text(dir), "note": "hyper-parameters differ from the checkpoint's run"}),
            )?;
        }
        Ok(st)
    }

    /// The `resized` event when the checkpoint was written by another number of ranks or
    /// with another global batch.
    fn report_resize(&mut self, st: &TrainState, layout: &BatchLayout) -> Result<(), TrainError> {
        let from_world = st.world_size;
        if from_world == layout.world as u64 && st.global_batch == layout.global_batch() {
            return Ok(());
        }
        self.journal.emit(
            event::RESIZED,
            json!({"from_ranks": from_world, "to_ranks": layout.world, "global_batch": layout.global_batch(),
                   "previous_global_batch": st.global_batch, "grad_accum_steps": layout.accum, "step": st.step}),
        )?;
        self.journal.note(&format!(
            "resized: checkpoint of {from_world} rank(s), now {} rank(s) x batch {} x accumulation {} = global batch {}",
            layout.world,
            layout.micro,
            layout.accum,
            layout.global_batch()
        ));
        Ok(())
    }

    fn emit_start(&mut self, resumed_from: Option<&Path>) -> Result<(), TrainError> {
        let layout = *self.step.layout();
        let fields = json!({
            "step": self.state.step, "total_steps": self.facts.total, "params": self.session.model.num_params(),
            "device": self.cfg.training.device, "data": self.data.source.describe(),
            "resumed_from": resumed_from.map(path_text), "config_hash": self.facts.config_hash,
            "pid": std::process::id(), "host": kiln_run::host_name(), "ranks": layout.world,
            "global_batch": layout.global_batch(), "grad_accum_steps": layout.accum,
            "engine": self.comm.describe(), "run_id": self.state.run_id,
            "shard": self.cfg.parallelism.shard.name(),
            "shard_ranks": self.step.shard().map_or(1, ShardPlan::shards),
            "prefetch": self.step.shard().is_some_and(ShardPlan::prefetches),
        });
        self.journal.emit(event::START, fields)?;
        let live = Live {
            state: &mut self.state,
            session: &mut self.session,
            optimizer: &mut self.optimizer,
        };
        self.guards.start(&live);
        Ok(())
    }

    /// Trains until all steps are done or the ranks agree to stop.
    pub fn run(&mut self) -> Result<TrainReport, TrainError> {
        while self.state.step < self.facts.total {
            let applied = match self.train_step()? {
                Some(m) => {
                    self.startup.first_step(&mut self.journal)?;
                    self.after_step(&m)?;
                    true
                }
                None => false,
            };
            self.checkpoints.poll(&mut self.journal)?;
            self.snapshots.poll(&mut self.journal)?;
            let signal = self.agreed_stop();
            let step = self.state.step;
            if self.checkpoints.due(step, applied, signal.is_some()) {
                self.checkpoint()?;
            } else if applied && self.snapshots.due(step) {
                self.snapshot()?;
            }
            if let Some(signal) = signal {
                return self.preempted(signal);
            }
        }
        self.finish()
    }

    /// One optimizer step through the [`Step`]: its gradients, the guards' verdict, and the
    /// update. `None` when the guards discarded it.
    pub fn train_step(&mut self) -> Result<Option<StepMetrics>, TrainError> {
        let t0 = Instant::now();
        self.beacon(event::beacon_phase::TRAIN);
        let lr = optim::lr_at(
            &self.cfg.lr_scheduler,
            self.cfg.optimizer.lr,
            self.state.step,
            self.facts.total,
        );
        let at = At {
            base: self.state.next_sample(),
            batch_no: self.state.data_cursor + 1,
        };
        let g = self
            .step
            .gradients(&self.session, self.data.source.as_ref(), at)?;
        let (loss, grad_norm, allreduce_s) = (g.loss, g.norm, g.allreduce_s);
        let saved_at = self.checkpoints.saved_at();
        let mut live = Live {
            state: &mut self.state,
            session: &mut self.session,
            optimizer: &mut self.optimizer,
        };
        let judged = Judged {
            loss,
            norm: grad_norm,
            grads: &g.grads,
            pieces_over: self.step.shard().map(ShardPlan::shard_group),
        };
        if let Verdict::Discard =
            self.guards
                .judge(&judged, &mut live, &mut self.journal, saved_at)?
        {
            return Ok(None);
        }
        self.step.apply(
            &mut self.session,
            &mut self.optimizer,
            self.data.source.as_ref(),
            g,
            lr,
        )?;
        self.state.step += 1;
        self.state.advance_data(1);
        let layout = *self.step.layout();
        self.state.tokens_seen += layout.global_batch() * layout.seq as u64;
        self.state.lr = lr;
        self.last_loss = Some(loss);
        self.step.faults().after_update(
            self.state.step,
            self.comm.rank(),
            &mut self.session.params,
        );
        let dt = t0.elapsed().as_secs_f64();
        Ok(Some(self.metrics(
            loss,
            grad_norm,
            lr,
            dt,
            at.base,
            allreduce_s,
        )))
    }

    /// The metrics of the step just applied, which took `dt` seconds from sample `first_sample`.
    fn metrics(
        &self,
        loss: f32,
        grad_norm: f32,
        lr: f64,
        dt: f64,
        first_sample: u64,
        allreduce_s: f64,
    ) -> StepMetrics {
        let layout = *self.step.layout();
        let tokens = layout.global_batch() * layout.seq as u64;
        let tps = tokens as f64 / dt.max(1e-9);
        let peak = self.facts.peak_flops * layout.world as f64;
        StepMetrics {
            step: self.state.step,
            total_steps: self.facts.total,
            loss,
            grad_norm,
            lr,
            tokens_per_s: tps,
            step_time_s: dt,
            mfu: match peak > 0.0 {
                true => tps * self.facts.flops_per_token / peak,
                false => 0.0,
            },
            rss_mib: metrics::rss_mib(),
            tokens_seen: self.state.tokens_seen,
            first_sample,
            global_batch: layout.global_batch(),
            allreduce_s,
        }
    }

    /// After an applied step: metrics, then each component that is due (the guards'
    /// snapshot and frozen check, the replica check, eval).
    fn after_step(&mut self, m: &StepMetrics) -> Result<(), TrainError> {
        let step = self.state.step;
        let logged = self.facts.log_every.due_or_last(step, self.facts.total);
        self.journal.step(m, logged)?;
        let pieces_over = self.step.parameter_shards().map(ShardPlan::shard_group);
        let live = Live {
            state: &mut self.state,
            session: &mut self.session,
            optimizer: &mut self.optimizer,
        };
        self.guards
            .after_step(&live, pieces_over, &mut self.journal)?;
        if self.replicas.due(step) {
            self.check_replicas()?;
        }
        if self.eval.due(step) {
            self.evaluate()?;
        }
        Ok(())
    }

    /// Compares a checksum of the parameters of the ranks that hold the same ones (every
    /// rank; with parameters sharded, the ranks of each shard in the replicas); the ranks
    /// that differ from the majority are named and the run stops before their weights can
    /// be saved.
    fn check_replicas(&mut self) -> Result<(), TrainError> {
        let shards = self.step.parameter_shards().map_or(1, ShardPlan::shards);
        let Some(m) = ReplicaCheck::compare(self.comm, &self.session.params, shards) else {
            return Ok(());
        };
        let step = self.state.step;
        self.journal.emit(
            event::REPLICA_MISMATCH,
            json!({"step": step, "ranks": m.ranks, "checksums": m.checksums}),
        )?;
        Err(TrainError::ReplicaMismatch {
            step,
            ranks: m.ranks,
        })
    }

    /// Held-out eval on the writer rank (the others go on to the next step's all-reduce and
    /// wait there); with parameters sharded, on every rank, which gather each stage's
    /// weights together (the observer's extra scores, which need the whole model, are left
    /// out).
    fn evaluate(&mut self) -> Result<(), TrainError> {
        let staged = self.step.stage_shards(&self.session);
        if !self.journal.is_writer() && staged.is_none() {
            return Ok(());
        }
        let Some(syn) = self.data.synthetic.as_ref() else {
            return Ok(());
        };
        self.beacon(event::beacon_phase::EVAL);
        let (session, step) = (&self.session, self.state.step);
        let e = match staged {
            Some(mut s) => {
                let logits = &mut |x| stagewise::logits(&session.model, &mut s, x);
                self.eval.run_with(session, syn, step, logits)
            }
            None => {
                let mut e = self.eval.run(session, syn, step);
                e.extra = self.journal.observer().extra_eval(session);
                e
            }
        };
        if !self.journal.is_writer() {
            return Ok(());
        }
        self.journal.eval(&e)?;
        self.last_eval = Some(e);
        Ok(())
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
        let _ = self.journal.emit(
            event::SIGNAL,
            json!({"signal": flag[0], "step": step, "ranks": who}),
        );
        Some(flag[0] as i32)
    }

    /// Saves a checkpoint of the current state (writer rank), after checking that the ranks
    /// agree on the parameters. Every rank calls it at the same step. What the step waits
    /// for (the replica check, staging, a previous save still in flight) is its stall.
    pub fn checkpoint(&mut self) -> Result<(), TrainError> {
        let t0 = Instant::now();
        self.check_replicas()?;
        self.beacon(event::beacon_phase::CHECKPOINT);
        self.complete_state();
        let shards = self.write_shards()?;
        let before_s = t0.elapsed().as_secs_f64();
        let (session, optimizer, state) = (&self.session, &self.optimizer, &self.state);
        let pieces = self.shards_parameters();
        let staged = || {
            let mut s = stage(session, optimizer, state);
            if pieces {
                s.model = Vec::new(); // in the shards
            }
            Staged { shards, ..s }
        };
        self.checkpoints
            .save(state.step, before_s, staged, &mut self.journal)
    }

    /// In a sharded run, every rank writes its shards now (in parallel, on this thread: the
    /// ranks then exchange what they wrote); rank 0 publishes them with its checkpoint.
    /// Empty otherwise.
    fn write_shards(&self) -> Result<Vec<ShardFile>, TrainError> {
        let Some(plan) = self.step.shard() else {
            return Ok(Vec::new());
        };
        let root = self.run_dir.join(kiln_run::layout::CHECKPOINTS);
        let specs = self.session.model.specs();
        let state = self.optimizer.named_state(specs);
        let weights = (specs, self.session.params.as_slice());
        plan.write_shards(self.comm, &root, self.state.step, &state, weights)
    }

    /// Whether each rank holds only its pieces of the parameters
    /// (`parallelism.shard = "parameters"`).
    fn shards_parameters(&self) -> bool {
        self.step.parameter_shards().is_some()
    }

    /// Snapshots the current state into this rank's memory tier (every rank, its own).
    fn snapshot(&mut self) -> Result<(), TrainError> {
        self.complete_state();
        let (snapshots, journal) = (&mut self.snapshots, &mut self.journal);
        let (session, optimizer, state) = (&self.session, &self.optimizer, &self.state);
        snapshots.take(state.step, || stage(session, optimizer, state), journal)
    }

    /// Fills in the parts of the state a checkpoint records but the step does not keep.
    fn complete_state(&mut self) {
        if let Some(schedule) = self.data.source.resume_state() {
            self.state.data_schedule = Some(schedule);
        }
        self.state.optimizer_step = self.optimizer.step();
        self.state.optimizer = self.optimizer.kind().name().to_string();
        self.state.schedule = format!("{:?}", self.cfg.lr_scheduler.kind).to_lowercase();
        self.state.model_hash = self.facts.model_hash.clone();
        self.state.config_hash = self.facts.config_hash.clone();
        self.state.kiln_version = env!("CARGO_PKG_VERSION").to_string();
    }

    /// Stopped by an agreed signal: the checkpoint is saved (the writer rank waits for it);
    /// every rank waits for the writer, then all leave with the same outcome.
    fn preempted(&mut self, signal: i32) -> Result<TrainReport, TrainError> {
        self.checkpoints.wait(&mut self.journal)?;
        self.comm.barrier();
        self.emit_exit("preempted", exit::PREEMPTED, None);
        Ok(self.report(Outcome::Preempted { signal }))
    }

    /// All steps done: the final checkpoint and `model.safetensors`.
    fn finish(&mut self) -> Result<TrainReport, TrainError> {
        if !self.checkpoints.saved(self.state.step) {
            self.checkpoint()?;
        }
        self.checkpoints.wait(&mut self.journal)?;
        // With parameters sharded, every rank takes part in gathering the whole weights.
        let (specs, params) = (self.session.model.specs(), &self.session.params);
        let whole = (self.step.parameter_shards()).map(|plan| plan.whole_host(specs, params));
        if let Some(run) = self.journal.run_dir() {
            let host = whole.unwrap_or_else(|| self.session.host_params());
            let bytes = checkpoint::to_safetensors(&host).map_err(|e| TrainError::Io {
                path: run.path().join(kiln_run::layout::FINAL_MODEL),
                source: std::io::Error::other(e.to_string()),
            })?;
            run.write_file(kiln_run::layout::FINAL_MODEL, &bytes)?;
        }
        self.beacon(event::beacon_phase::DONE);
        let kib = (metrics::peak_rss_mib() * 1024.0) as u64;
        let mib: Vec<f64> = self
            .comm
            .all_gather_u64(kib)
            .iter()
            .map(|&k| k as f64 / 1024.0)
            .collect();
        let step = self.state.step;
        self.journal
            .emit(event::PEAK_MEMORY, json!({"step": step, "rank_mib": mib}))?;
        // The run is complete and its final checkpoint published: the memory tier goes.
        self.snapshots.clear(&mut self.journal);
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

/// With parameters sharded, `session` keeps only this rank's pieces of its parameters,
/// copied out (a slice may be a view that keeps the whole tensor alive).
fn keep_pieces(step: &Step, session: &mut Session) {
    if let Some(plan) = step.parameter_shards() {
        let pieces = plan.pieces(&session.params);
        let lengths: Vec<usize> = pieces.iter().map(|t| t.dims()[0]).collect();
        let flat = crate::tensor::flatten(pieces, &[]);
        session.params = crate::tensor::split(&flat, lengths, &session.device);
    }
}

/// Reads the checkpoint `dir` as this rank of `step`'s run keeps it: in a sharded run only
/// its own pieces ([`ShardPlan::read_checkpoint`]), else all of it, verified.
fn read_checkpoint(
    step: &Step,
    specs: &[ParamSpec],
    dir: &Path,
) -> Result<Checkpoint, checkpoint::CheckpointError> {
    match step.shard() {
        Some(plan) => plan.read_checkpoint(dir, specs),
        None => checkpoint::load(dir),
    }
}

/// A checkpoint of `state` staged from the live tensors (references, no copy). In a sharded
/// run the optimizer state is in the shards the ranks wrote, not here.
fn stage(session: &Session, optimizer: &Optimizer, state: &TrainState) -> Staged {
    let optimizer = match optimizer.shard_ranges() {
        Some(_) => Vec::new(),
        None => optimizer.named_state(session.model.specs()),
    };
    Staged {
        step: state.step,
        model: session.named_params(),
        optimizer,
        state: serde_json::to_value(state).unwrap_or_default(),
        shards: Vec::new(),
    }
}

/// The batch layout, the data and the model of a run (sizes that cannot fit, this rank's
/// memory snapshots included, are refused before the data is indexed for them).
fn build(
    cfg: &Config,
    comm: &dyn Collective,
    run_dir: &Path,
    startup: &mut Startup,
) -> Result<(BatchLayout, TrainData, Session), TrainError> {
    let layout =
        BatchLayout::new(&cfg.training, comm.rank(), comm.size()).map_err(TrainError::Parallel)?;
    let store = crate::snapshot::rank_dir(&cfg.checkpoint, run_dir, comm.rank());
    let known = crate::budget::known_vocab(cfg);
    crate::budget::check_run(cfg, known, &store)?;
    let data = TrainData::open(cfg, layout.samples_for(cfg.training.steps), None)
        .map_err(TrainError::Data)?;
    let vocab = data.vocab(cfg).map_err(TrainError::Data)?;
    if known == 0 {
        // The corpus told the vocabulary only now: the embedding may change the answer.
        crate::budget::check_run(cfg, vocab, &store)?;
    }
    startup.mark(phase::DATA_OPEN);
    crate::session::keep_device_cache(cfg, run_dir, comm.rank());
    let session = Session::new(cfg, vocab)?;
    Ok((layout, data, session))
}

/// The writer rank's side of the run directory: locks it, writes the config, opens the logs
/// and scans the checkpoints.
fn open_run_dir(opts: &TrainOptions) -> Result<Opened, TrainError> {
    let cfg = &opts.config;
    let run = RunDir::lock(&opts.run_dir)?;
    run.write_file(kiln_run::layout::CONFIG, cfg.to_toml().as_bytes())?;
    let mut events = EventLog::open(run.path(), event::source::TRAIN)?;
    let (metrics, cut) = run.open_log(kiln_run::layout::METRICS)?;
    if cut > 0 {
        events.emit(
            event::LOG_REPAIRED,
            json!({"path": path_text(&run.path().join(kiln_run::layout::METRICS)), "bytes_removed": cut}),
        )?;
    }
    // A sharded run's ranks read their own pieces once the plan exists: here the candidate
    // is only verified, without holding its tensors.
    let load = match cfg.parallelism.shard {
        Shard::None => checkpoint::load,
        _ => checkpoint::verify,
    };
    let mut opened = CheckpointManager::open_with(
        &run.path().join(kiln_run::layout::CHECKPOINTS),
        cfg.checkpoint.keep_latest_k,
        cfg.checkpoint.resume,
        &new_run_id(),
        load,
    )?;
    // A restart before the first persistent checkpoint keeps the lineage its memory
    // snapshots carry; the lineage is recorded at every start.
    if cfg.checkpoint.resume && opened.resume.is_none() {
        let recorded = std::fs::read_to_string(run.path().join(kiln_run::layout::RUN_ID));
        if let Some(id) = recorded.ok().map(|t| t.trim().to_string())
            && !id.is_empty()
            && id.bytes().all(|b| b.is_ascii_hexdigit())
        {
            opened.manager.adopt_lineage(&id);
        }
    }
    run.write_file(kiln_run::layout::RUN_ID, opened.manager.run_id().as_bytes())?;
    Ok(Opened {
        run_id: opened.manager.run_id().to_string(),
        saver: Saver::new(opened.manager, cfg.checkpoint.asynchronous),
        writer: Writer {
            run,
            events,
            metrics,
        },
        resume: opened.resume,
        rejected: opened.rejected,
    })
}

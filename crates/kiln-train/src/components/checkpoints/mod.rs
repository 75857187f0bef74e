//! [`Checkpoints`]: the whole checkpoint lifecycle of a run in one component, as
//! torchtitan's `CheckpointStore` is: it is handed the run's one owned state
//! ([`RunState`]: model, optimizer, train state, data) and saves and restores it.
//!
//! - Persistent tier: checkpoints in the run directory, due at `checkpoint.interval`, the
//!   last step and a stop signal with unsaved work ([`PersistentTier`]), written by the writer
//!   rank's [`crate::components::checkpoints::saver::Saver`] (on a background thread with
//!   `checkpoint.async`); in a sharded run every rank writes its shards first.
//! - Memory tier: node-local snapshots every few steps ([`Snapshotter`]), agreed on by the
//!   ranks and healed from a peer at restart.
//! - Resume ([`Checkpoints::load`]): the newest state any tier holds, rank 0's lineage on
//!   every rank, the guards' rollback point as an uninterrupted run would hold it, and the
//!   batch layout kept across a change of rank count (the `resized` event).

pub mod saver;
pub mod snapshot;

use crate::checkpoint::region::Region;
use crate::checkpoint::{self, Checkpoint, CheckpointStore, HostTensor, Rejection, ShardFile};
use crate::components::checkpoints::saver::{PersistentTier, Saver, Staged};
use crate::components::checkpoints::snapshot::{Recovered, Snapshotter};
use crate::components::guard_rail::GuardRail;
use crate::components::journal::{Journal, path_text};
use crate::config::{Config, Shard};
use crate::data::TrainData;
use crate::error::TrainError;
use crate::mesh::{DeviceMesh, Dim, Dims};
use crate::model::ParamSpec;
use crate::optim::Optimizer;
use crate::run_dir::RunDir;
use crate::state::{RunState, TrainState, new_run_id};
use crate::step::{BatchLayout, Step};
use burn::tensor::Tensor;
use kiln_dist::Collective;
use kiln_run::event;
use serde_json::json;
use std::ops::Range;
use std::path::{Path, PathBuf};
use std::time::Instant;

/// What the writer rank found in the run directory's checkpoints.
pub struct Found {
    /// The saver over the run's checkpoint store.
    pub saver: Saver,
    /// The run's lineage.
    pub run_id: String,
    /// The newest checkpoint that verified, when resuming.
    pub resume: Option<(PathBuf, Checkpoint)>,
    /// Checkpoints moved aside.
    pub rejected: Vec<Rejection>,
    /// Temporary directories of writers killed mid-save, deleted (path, bytes).
    pub reclaimed: Vec<(PathBuf, u64)>,
}

/// Scans the checkpoints of the run directory `run` (the writer rank, which holds its lock)
/// and records the run's lineage in it.
pub fn scan(run: &RunDir, cfg: &Config) -> Result<Found, TrainError> {
    // A sharded or tensor-parallel run's ranks read their own pieces once the plan exists:
    // here the candidate is only verified, without holding its tensors.
    let load = match (cfg.parallelism.shard, cfg.parallelism.tp) {
        (Shard::None, 1) => checkpoint::load,
        _ => checkpoint::verify,
    };
    let mut opened = CheckpointStore::open_with(
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
    Ok(Found {
        run_id: opened.manager.run_id().to_string(),
        saver: Saver::new(opened.manager, cfg.checkpoint.asynchronous),
        resume: opened.resume,
        rejected: opened.rejected,
        reclaimed: opened.reclaimed,
    })
}

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

/// Hashes that tie a checkpoint to the run: the model's shapes and the whole config.
pub struct Identity {
    /// Hash of everything that fixes the parameter shapes.
    pub model_hash: String,
    /// Hash of the effective config.
    pub config_hash: String,
}

/// The checkpoint lifecycle (see the module documentation). Every rank holds one.
pub struct Checkpoints<'c> {
    cfg: Config,
    run_dir: PathBuf,
    id: Identity,
    /// The job's mesh: who writes which pieces.
    mesh: &'c DeviceMesh,
    /// Every rank of the job (`mesh`'s world).
    comm: &'c dyn Collective,
    persistent: PersistentTier,
    memory: Snapshotter,
    /// What the writer rank's scan found, until [`Checkpoints::load`] uses it.
    found: Option<(PathBuf, Checkpoint)>,
    rejected: Vec<Rejection>,
    reclaimed: Vec<(PathBuf, u64)>,
}

impl<'c> Checkpoints<'c> {
    /// The lifecycle of `cfg`'s run in `run_dir`, for this rank of `comm`; `found` is the
    /// writer rank's scan ([`scan`]).
    pub fn new(
        cfg: &Config,
        run_dir: &Path,
        id: Identity,
        mesh: &'c DeviceMesh,
        found: Option<Found>,
    ) -> Self {
        let comm = mesh.world();
        let (saver, resume, rejected, reclaimed) = match found {
            Some(f) => (Some(f.saver), f.resume, f.rejected, f.reclaimed),
            None => (None, None, Vec::new(), Vec::new()),
        };
        let memory = Snapshotter::new(
            &cfg.effective_checkpoint(),
            run_dir,
            comm.rank(),
            cfg.guards.snapshot_interval,
        );
        Self {
            persistent: PersistentTier::new(cfg.checkpoint.interval, cfg.training.steps, saver),
            memory,
            cfg: cfg.clone(),
            run_dir: run_dir.to_path_buf(),
            id,
            mesh,
            comm,
            found: resume,
            rejected,
            reclaimed,
        }
    }

    /// Restores `run` from the newest state a tier holds: the ranks' memory snapshots (a
    /// rank without the agreed one receives it from a peer) when one is at least as new as
    /// the persistent checkpoint rank 0 chose; else that checkpoint (the other ranks load
    /// the same step); else a fresh start in a new lineage. Returns where it resumed from.
    /// A collective: every rank calls it.
    pub fn load(
        &mut self,
        run: &mut RunState,
        step: &mut Step,
        guards: &mut GuardRail,
        journal: &mut Journal,
    ) -> Result<Option<PathBuf>, TrainError> {
        self.report_rejected(journal)?;
        self.memory.report_reclaimed(journal)?;
        let chosen = self.found.take();
        let persistent = self.agree_on_lineage(run, chosen.as_ref().map(|(_, c)| c.step));
        if !self.cfg.checkpoint.resume {
            self.memory.clear(journal);
        } else if let Some(r) =
            (self.memory).recover(self.comm, &run.state.run_id.clone(), persistent, journal)?
        {
            let from = Resumed::memory(&r, persistent);
            self.restore_rollback_point(run, step, guards, &r.ck, journal)?;
            return self.restore(run, step, guards, (&r.dir, &r.ck), &from, journal);
        }
        let specs = run.session.model.specs();
        let loaded = match (chosen, persistent) {
            (Some(c), _) if !writes_pieces(step, self.mesh) => Some(c),
            // Rank 0 verified it without reading its tensors: this rank's pieces now.
            (Some((dir, _)), _) => Some((dir.clone(), read_checkpoint(step, specs, &dir)?)),
            (None, Some(at)) => {
                let dir = self.persistent_dir(at);
                Some((dir.clone(), read_checkpoint(step, specs, &dir)?))
            }
            (None, None) => None,
        };
        match loaded {
            Some((dir, ck)) => {
                self.restore_rollback_point(run, step, guards, &ck, journal)?;
                let from = Resumed::persistent(persistent);
                self.restore(run, step, guards, (&dir, &ck), &from, journal)
            }
            None => {
                self.init_from(run, step, guards, journal)?;
                Ok(None)
            }
        }
    }

    /// A fresh start with `model.init_from`: the Hugging Face weights replace the drawn ones
    /// (every rank reads them; in a parameter-sharded run each keeps its pieces). The
    /// `init_from` event records a checksum of the loaded weights.
    fn init_from(
        &self,
        run: &mut RunState,
        step: &Step,
        guards: &mut GuardRail,
        journal: &mut Journal,
    ) -> Result<(), TrainError> {
        let dir = Path::new(&self.cfg.model.init_from);
        if self.cfg.model.init_from.is_empty() {
            return Ok(());
        }
        let tensors = crate::model::hf::load_weights(dir, run.session.model.specs())?;
        match step.parameter_shards() {
            Some(plan) => run.session.load_pieces(&tensors, plan.ranges(), dir)?,
            None => run.session.load_params(&tensors, dir)?,
        }
        guards.trained_start();
        if journal.is_writer() {
            let checksum = crate::tensor::params_checksum(&run.session.params);
            journal.emit(
                event::INIT_FROM,
                json!({"path": path_text(dir), "tensors": tensors.len(), "checksum": format!("{checksum:016x}")}),
            )?;
            journal.note(&format!(
                "starting from the Hugging Face weights in {} ({} tensors)",
                dir.display(),
                tensors.len()
            ));
        }
        Ok(())
    }

    /// The persistent checkpoint directory of `step`.
    fn persistent_dir(&self, step: u64) -> PathBuf {
        (self.run_dir.join(kiln_run::layout::CHECKPOINTS)).join(checkpoint::dir_name(step))
    }

    /// Gives the guards the rollback snapshot an uninterrupted run would hold when it reached
    /// `ck`: the state at the newest multiple of `guards.snapshot_interval` before it (the
    /// fresh state for step 0), from this rank's memory tier or the persistent one, or from a
    /// peer that holds it. When no tier kept it the guards start afresh and say so: a
    /// rollback before their next snapshot would then differ from an uninterrupted run's.
    fn restore_rollback_point(
        &mut self,
        run: &mut RunState,
        step: &mut Step,
        guards: &mut GuardRail,
        ck: &Checkpoint,
        journal: &mut Journal,
    ) -> Result<(), TrainError> {
        let Some(at) = guards.snapshot_before(ck.step) else {
            return Ok(());
        };
        if at > 0 {
            let run_id = checkpoint::lineage_of(&ck.state)
                .unwrap_or(&run.state.run_id)
                .to_string();
            let persistent = self.persistent_dir(at);
            let specs = run.session.model.specs();
            let read = |dir: &Path| read_checkpoint(step, specs, dir);
            let found =
                (self.memory).at_step(self.comm, (&run_id, at), (&persistent, &read), journal)?;
            let Some((dir, anchor)) = found else {
                return journal.emit(
                    event::ROLLBACK_POINT_LOST,
                    json!({"step": at, "resumed_step": ck.step}),
                );
            };
            run.state = self.read_into(run, step, (&dir, &anchor), false, journal)?;
        }
        guards.adopt_snapshot(run);
        Ok(())
    }

    /// Rank 0's persistent resume step and lineage, on every rank (the lineage goes into
    /// every rank's state, so every rank's snapshots are the same run's).
    fn agree_on_lineage(&self, run: &mut RunState, persistent: Option<u64>) -> Option<u64> {
        if self.comm.size() == 1 {
            return persistent;
        }
        let mut bytes = persistent.map_or(u64::MAX, |s| s).to_le_bytes();
        self.comm.broadcast_bytes(0, &mut bytes);
        let mut run_id = run.state.run_id.clone().into_bytes();
        self.comm.broadcast_vec(0, &mut run_id);
        run.state.run_id = String::from_utf8_lossy(&run_id).into_owned();
        let step = u64::from_le_bytes(bytes);
        (step != u64::MAX).then_some(step)
    }

    fn report_rejected(&mut self, journal: &mut Journal) -> Result<(), TrainError> {
        for (path, bytes) in std::mem::take(&mut self.reclaimed) {
            journal.emit(
                event::CHECKPOINT_LEFTOVER_REMOVED,
                json!({"path": path_text(&path), "bytes": bytes}),
            )?;
            journal.note(&format!(
                "removed {} left by a writer killed mid-save ({})",
                path.display(),
                kiln_run::host::human_bytes(bytes as f64)
            ));
        }
        for r in std::mem::take(&mut self.rejected) {
            journal.emit(
                event::CHECKPOINT_REJECTED,
                json!({"path": path_text(&r.path), "reason": r.reason, "moved_to": path_text(&r.moved_to)}),
            )?;
            journal.note(&format!(
                "rejected checkpoint {}: {} (moved to {})",
                r.path.display(),
                r.reason,
                r.moved_to.display()
            ));
        }
        Ok(())
    }

    /// Restores every part of `run` from `ck` in `dir`; the batch layout keeps the
    /// checkpoint's global batch when the run resumes on another number of ranks.
    fn restore(
        &mut self,
        run: &mut RunState,
        step: &mut Step,
        guards: &mut GuardRail,
        (dir, ck): (&Path, &Checkpoint),
        from: &Resumed,
        journal: &mut Journal,
    ) -> Result<Option<PathBuf>, TrainError> {
        run.state = self.read_into(run, step, (dir, ck), true, journal)?;
        let at = run.state.step;
        // What is on disk is the persistent checkpoint: a memory snapshot does not survive
        // the node, so a stop signal after this resume still saves.
        if let Some(p) = from.persistent_step {
            self.persistent.restored(p);
        }
        guards.restored(at);
        journal.emit(
            event::CHECKPOINT_LOADED,
            json!({"path": path_text(dir), "step": at, "tier": from.tier}),
        )?;
        let st = &run.state;
        journal.emit(
            event::RESUME,
            json!({"step": at, "data_cursor": st.data_cursor, "sample_cursor": st.next_sample(),
                   "path": path_text(dir), "tier": from.tier, "persistent_step": from.persistent_step,
                   "source_rank": from.source_rank, "peer_ranks": from.peer_ranks}),
        )?;
        journal.note(&format!(
            "resumed from {} (step {at}, {} tier)",
            dir.display(),
            from.tier
        ));
        if !self.cfg.model.init_from.is_empty() {
            journal.note(&format!(
                "model.init_from ({}) is not read: the run resumes from its checkpoint",
                self.cfg.model.init_from
            ));
        }
        Ok(Some(dir.to_path_buf()))
    }

    /// Loads the model and optimizer of `ck` into `run`, and returns its train state to
    /// adopt. `resume`: training goes on from it (the batch layout and the data follow it; a
    /// changed rank count or hyper-parameters are reported); else it is only the guards'
    /// rollback point.
    fn read_into(
        &self,
        run: &mut RunState,
        step: &mut Step,
        (dir, ck): (&Path, &Checkpoint),
        resume: bool,
        journal: &mut Journal,
    ) -> Result<TrainState, TrainError> {
        let mismatch = |reason: String| TrainError::ResumeMismatch {
            path: dir.to_path_buf(),
            reason,
        };
        let cfg = &self.cfg;
        let mut st =
            TrainState::from_checkpoint(&ck.state, cfg, &self.id.model_hash).map_err(mismatch)?;
        let layout = (step.layout())
            .resumed(&cfg.training, st.global_batch)
            .map_err(mismatch)?;
        if resume {
            report_resize(&st, &layout, journal)?;
            step.set_layout(layout);
        }
        let schedule = st.data_schedule.clone().filter(|v| resume && !v.is_null());
        if let Some(schedule) = schedule {
            let samples = layout.samples_for(cfg.training.steps);
            run.data = TrainData::open(cfg, samples, Some((schedule, st.next_sample())))
                .map_err(TrainError::Data)?;
        }
        st.global_batch = layout.global_batch();
        st.world_size = layout.world as u64;
        match step.parameter_shards() {
            Some(plan) => run.session.load_pieces(&ck.model, plan.ranges(), dir)?,
            None => run.session.load_params(&ck.model, dir)?,
        }
        let specs = run.session.model.specs();
        let tokens = layout.global_batch() * layout.seq as u64;
        let saved = (ck.optimizer.as_slice(), st.optimizer_step);
        let shard = step.shard().map(|p| p.ranges());
        let device = &run.session.device;
        run.optimizer = Optimizer::restore(&cfg.optimizer, specs, device, (tokens, shard), saved)
            .map_err(mismatch)?;
        run.optimizer
            .set_scalars(&st.optimizer_scalars)
            .map_err(mismatch)?;
        // The checkpoint published the optimizer's weights (Schedule-Free's average): training
        // goes on from the point it trains at.
        let dtype = run.session.params.first().map(Tensor::dtype);
        if let Some(point) = dtype.and_then(|d| run.optimizer.training_point(d)) {
            for (p, y) in run.session.params.iter_mut().zip(point) {
                if let Some(y) = y {
                    *p = y;
                }
            }
        }
        if st.run_id.is_empty() {
            st.run_id = run.state.run_id.clone();
        }
        if resume && st.config_hash != self.id.config_hash {
            journal.emit(
                event::CONFIG_CHANGED,
                json!({"path": path_text(dir), "note": "hyper-parameters differ from the checkpoint's run"}),
            )?;
        }
        Ok(st)
    }

    /// Saves the persistent checkpoint of `run`'s current step: every rank of a sharded run
    /// writes its shards, the writer rank stages the rest (references, no copy) for its
    /// saver. Every rank calls it at the same step; `before_s`: what the step already waited
    /// for this save (the replica check), counted in its stall.
    pub fn save(
        &mut self,
        run: &mut RunState,
        step: &Step,
        before_s: f64,
        journal: &mut Journal,
    ) -> Result<(), TrainError> {
        let t0 = Instant::now();
        self.complete_state(run);
        let shards = self.write_shards(run, step)?;
        let before_s = before_s + t0.elapsed().as_secs_f64();
        // What the ranks wrote in pieces is not staged whole: the weights of a
        // parameter-sharded or tensor-parallel run, the optimizer state of any such run.
        let tensor_parallel = self.mesh.shape().size(Dim::Tp) > 1;
        let pieces = step.parameter_shards().is_some() || tensor_parallel;
        let run = &*run;
        let staged = || {
            let mut s = stage(run);
            if pieces {
                s.model = Vec::new();
            }
            if tensor_parallel {
                s.optimizer = Vec::new();
            }
            Staged { shards, ..s }
        };
        (self.persistent).save(run.state.step, before_s, staged, journal)
    }

    /// In a run whose ranks hold different pieces of the state (sharded, or cut by tensor
    /// parallelism), every rank of the first replica writes its pieces now, in parallel, on
    /// this thread (the ranks then exchange what they wrote; rank 0 publishes them with its
    /// checkpoint). Empty otherwise.
    fn write_shards(&self, run: &RunState, step: &Step) -> Result<Vec<ShardFile>, TrainError> {
        if !writes_pieces(step, self.mesh) {
            return Ok(Vec::new());
        }
        let mesh = self.mesh;
        let (writer, writers) = (
            mesh.index(Dims::PIECES),
            mesh.shape().group_size(Dims::PIECES),
        );
        let specs = run.session.model.specs();
        let ranges = step.shard().map(|p| p.ranges());
        let first_tp = mesh.coord(Dim::Tp) == 0;
        // The elements of parameter `i` this rank holds: its range with sharded state, else
        // its whole tensor (`None`: none).
        let held = |i: usize| match ranges {
            Some(r) => r[i].clone(),
            None => Some(0..specs[i].numel()),
        };
        let state_region = |i: usize| region_of(&specs[i], held(i), first_tp);
        let weights_ranged = step.parameter_shards().is_some();
        // Whole weights (not ranged) are held alike by every rank of a `dp_shard` group:
        // written by its first.
        let first_shard = mesh.coord(Dim::DpShard) == 0;
        let weight_region = |i: usize| match (weights_ranged, first_shard) {
            (true, _) => state_region(i),
            (false, true) => region_of(&specs[i], Some(0..specs[i].numel()), first_tp),
            (false, false) => None,
        };
        let mut files = Vec::new();
        if mesh.coord(Dim::DpReplicate) == 0 {
            let state = run.optimizer.state_pieces(specs, &state_region);
            let host: Vec<HostTensor> = state.iter().map(|t| t.to_host()).collect();
            files.push((
                kiln_run::layout::checkpoint_optimizer_shard(writer, writers),
                host,
            ));
            if weights_ranged || mesh.shape().size(Dim::Tp) > 1 {
                let published = run.optimizer.published(&run.session.params);
                let params = published.as_ref().unwrap_or(&run.session.params);
                let weights = (specs.iter().zip(params).enumerate())
                    .filter_map(|(i, (spec, t))| {
                        let region = weight_region(i)?;
                        Some(HostTensor::f32(
                            region.name(&spec.name),
                            vec![region.len()],
                            crate::tensor::to_vec(t),
                        ))
                    })
                    .collect();
                files.push((
                    kiln_run::layout::checkpoint_model_shard(writer, writers),
                    weights,
                ));
            }
        }
        let root = self.run_dir.join(kiln_run::layout::CHECKPOINTS);
        let at = run.state.step;
        let mine: Result<Vec<ShardFile>, String> = (files.into_iter())
            .map(|(name, t)| checkpoint::write_shard(&root, at, name, &t))
            .collect::<Result<_, _>>()
            .map_err(|e| e.to_string());
        self.gather_reports(at, mine, (writer, writers))
    }

    /// Every writer's files of the checkpoint of `step` (this rank is writer `writer` of
    /// `writers` when it is in the first replica, and wrote `mine`), on every rank: on rank 0 the shards to publish; an error
    /// when any writer failed (every rank gets it, so all stop).
    fn gather_reports(
        &self,
        step: u64,
        mine: Result<Vec<ShardFile>, String>,
        (writer, writers): (usize, usize),
    ) -> Result<Vec<ShardFile>, TrainError> {
        let mesh = self.mesh;
        let tp = mesh.shape().size(Dim::Tp);
        let mut all = Vec::with_capacity(writers * 2);
        for w in 0..writers {
            let me = mesh.coord(Dim::DpReplicate) == 0 && w == writer;
            let mut bytes = match me {
                true => serde_json::to_vec(&mine).unwrap_or_default(),
                false => Vec::new(),
            };
            let at = [
                (Dim::DpReplicate, 0),
                (Dim::DpShard, w / tp),
                (Dim::Tp, w % tp),
            ];
            self.comm.broadcast_vec(mesh.rank_with(&at), &mut bytes);
            let got: Result<Vec<ShardFile>, String> = serde_json::from_slice(&bytes)
                .unwrap_or_else(|e| Err(format!("unreadable shard report of writer {w}: {e}")));
            all.extend(got.map_err(|e| {
                TrainError::Parallel(format!(
                    "writer {w} could not write its shards of step {step}: {e}"
                ))
            })?);
        }
        Ok(all)
    }

    /// Snapshots `run`'s current state into this rank's memory tier (every rank, its own).
    pub fn snapshot(
        &mut self,
        run: &mut RunState,
        journal: &mut Journal,
    ) -> Result<(), TrainError> {
        self.complete_state(run);
        let run = &*run;
        self.memory.take(run.state.step, || stage(run), journal)
    }

    /// After a step (`applied`: the guards kept it; `stopping`: the ranks agreed to stop):
    /// what a tier wants saved now.
    pub fn due(&self, at: u64, applied: bool, stopping: bool) -> Due {
        if self.persistent.due(at, applied, stopping) {
            Due::Persistent
        } else if applied && self.memory.due(at) {
            Due::Memory
        } else {
            Due::Nothing
        }
    }

    /// Whether the checkpoint of `at` is on disk.
    pub fn saved(&self, at: u64) -> bool {
        self.persistent.saved(at)
    }

    /// The step of the newest checkpoint on disk, if any.
    pub fn saved_at(&self) -> Option<u64> {
        self.persistent.saved_at()
    }

    /// Reports the saves that finished since the last call (never waits).
    pub fn poll(&mut self, journal: &mut Journal) -> Result<(), TrainError> {
        self.persistent.poll(journal)?;
        self.memory.poll(journal)
    }

    /// Waits for the persistent save in flight, if any.
    pub fn wait(&mut self, journal: &mut Journal) -> Result<(), TrainError> {
        self.persistent.wait(journal)
    }

    /// Waits for every save in flight, reporting (not returning) a failure: what every way
    /// out of training does, so that none leaves a save half done.
    pub fn settle(&mut self, journal: &mut Journal) {
        if let Err(e) = self.persistent.wait(journal) {
            tracing::error!("{e}");
        }
        if let Err(e) = self.memory.wait(journal) {
            tracing::error!("{e}");
        }
    }

    /// A replica check failed: this rank's memory snapshots may hold weights from after the
    /// corruption (only the checks tell, and the last one failed), so they go and a resume
    /// falls back to the persistent tier, which saves nothing a check has not passed.
    pub fn distrust_memory(&mut self, journal: &mut Journal) {
        self.memory.clear(journal);
    }

    /// The run is complete and its final checkpoint published: the memory tier goes.
    pub fn complete(&mut self, journal: &mut Journal) {
        self.memory.clear(journal);
    }

    /// Fills in the parts of the state a checkpoint records but the step does not keep.
    fn complete_state(&self, run: &mut RunState) {
        if let Some(schedule) = run.data.source.resume_state() {
            run.state.data_schedule = Some(schedule);
        }
        let st = &mut run.state;
        st.optimizer_step = run.optimizer.step();
        st.optimizer = run.optimizer.kind().name().to_string();
        st.optimizer_scalars = run.optimizer.scalars();
        st.schedule = format!("{:?}", self.cfg.lr_scheduler.kind).to_lowercase();
        st.model_hash = self.id.model_hash.clone();
        st.config_hash = self.id.config_hash.clone();
        st.kiln_version = env!("CARGO_PKG_VERSION").to_string();
    }
}

/// What a tier wants saved after a step.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Due {
    /// A persistent checkpoint.
    Persistent,
    /// A memory snapshot.
    Memory,
    /// Nothing.
    Nothing,
}

/// The `resized` event when the checkpoint was written by another number of ranks or with
/// another global batch.
fn report_resize(
    st: &TrainState,
    layout: &BatchLayout,
    journal: &mut Journal,
) -> Result<(), TrainError> {
    let from_world = st.world_size;
    if from_world == layout.world as u64 && st.global_batch == layout.global_batch() {
        return Ok(());
    }
    journal.emit(
        event::RESIZED,
        json!({"from_ranks": from_world, "to_ranks": layout.world, "global_batch": layout.global_batch(),
               "previous_global_batch": st.global_batch, "grad_accum_steps": layout.accum, "step": st.step}),
    )?;
    journal.note(&format!(
        "resized: checkpoint of {from_world} rank(s), now {} rank(s) x batch {} x accumulation {} = global batch {}",
        layout.world,
        layout.micro,
        layout.accum,
        layout.global_batch()
    ));
    Ok(())
}

/// Whether the ranks of `step`'s run on `mesh` write their pieces of the state (sharded, or
/// cut by tensor parallelism) rather than rank 0 the whole.
fn writes_pieces(step: &Step, mesh: &DeviceMesh) -> bool {
    step.shard().is_some() || mesh.shape().size(Dim::Tp) > 1
}

/// The region of the whole tensor of `spec` in a checkpoint piece holding `held` (elements
/// of this rank's tensor; `None`: none): its box's elements, or of a tensor every
/// tensor-parallel rank holds whole, a flat range written by the first of them only.
fn region_of(spec: &ParamSpec, held: Option<Range<usize>>, first_tp: bool) -> Option<Region> {
    let held = held?;
    (first_tp || !spec.placement.is_whole()).then(|| spec.placement.region(held))
}

/// Reads the checkpoint `dir` as this rank of `step`'s run keeps it: in a run whose ranks
/// hold pieces only its own elements of each tensor (its range with sharded state, its box
/// under tensor parallelism: see [`checkpoint::load_kept`], which reads only those bytes and
/// leaves hashing to [`checkpoint::verify`] on rank 0), else all of it, verified.
fn read_checkpoint(
    step: &Step,
    specs: &[ParamSpec],
    dir: &Path,
) -> Result<Checkpoint, checkpoint::CheckpointError> {
    let ranges = step.shard().map(|p| p.ranges());
    let cut = specs.iter().any(|s| !s.placement.is_whole());
    if ranges.is_none() && !cut {
        return checkpoint::load(dir);
    }
    let weights_ranged = step.parameter_shards().is_some();
    let index: std::collections::HashMap<&str, usize> = specs
        .iter()
        .enumerate()
        .map(|(i, s)| (s.name.as_str(), i))
        .collect();
    let keep = |part: checkpoint::Part, name: &str| {
        let (param, ranged) = match part {
            checkpoint::Part::Weights => (name, weights_ranged),
            // `<param>.<slot>`
            checkpoint::Part::Optimizer => (name.rsplit_once('.')?.0, ranges.is_some()),
        };
        let i = *index.get(param)?;
        let spec = &specs[i];
        let held = match (ranged, ranges) {
            (true, Some(r)) => r[i].clone().unwrap_or(0..0),
            _ if spec.placement.is_whole() => return None,
            _ => 0..spec.numel(),
        };
        let region = spec.placement.region(held);
        let shape = spec.placement.global.clone();
        Some(checkpoint::Want { shape, region })
    };
    checkpoint::load_kept(dir, &keep)
}

/// A checkpoint of `run` staged from the live tensors (references, no copy). In a sharded
/// run the optimizer state is in the shards the ranks wrote, not here.
fn stage(run: &RunState) -> Staged {
    let optimizer = match run.optimizer.shard_ranges() {
        Some(_) => Vec::new(),
        None => run.optimizer.named_state(run.session.model.specs()),
    };
    let model = match run.optimizer.published(&run.session.params) {
        Some(x) => run.session.named(&x),
        None => run.session.named_params(),
    };
    Staged {
        step: run.state.step,
        model,
        optimizer,
        state: serde_json::to_value(&run.state).unwrap_or_default(),
        shards: Vec::new(),
    }
}

//! Start-up of a run: the run directory (writer rank), the data, the model and the
//! optimizer, the step and its exchange, the ranks' agreement on the config, and the resume
//! through the checkpoint lifecycle.

use super::{STOP_SIGNALS, TrainOptions, Trainer};
use crate::components::checkpoints::{self, Checkpoints, Identity};
use crate::components::eval::Evaluator;
use crate::components::guard_rail::GuardRail;
use crate::components::journal::{Journal, Writer, path_text};
use crate::components::metrics::Observer;
use crate::components::replicas::ReplicaCheck;
use crate::components::startup::{Startup, phase};
use crate::config::Config;
use crate::data::TrainData;
use crate::error::{TrainError, io};
use crate::mesh::DeviceMesh;
use crate::model::session::{Session, sha256_hex};
use crate::parallel::shard::ShardPlan;
use crate::run_dir::RunDir;
use crate::state::{RunState, TrainState};
use crate::step::{BatchLayout, Step};
use kiln_run::{EventLog, event};
use serde_json::json;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::AtomicUsize;
use std::time::Instant;

/// Quantities fixed for the whole run.
pub(super) struct RunFacts {
    pub(super) total: u64,
    pub(super) flops_per_token: f64,
    pub(super) peak_flops: f64,
    pub(super) model_hash: String,
    pub(super) config_hash: String,
    pub(super) log_every: crate::cadence::Every,
    pub(super) progress_dir: Option<PathBuf>,
    pub(super) started: Instant,
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
            crate::model::session::guess_peak_flops(
                &cfg.training.device,
                cfg.training.dtype,
                threads,
            )
            .unwrap_or(0.0)
        };
        Self {
            total: cfg.training.steps,
            flops_per_token: session.model.flops_per_token(cfg.training.seq_len),
            peak_flops,
            model_hash: session.model_hash(),
            config_hash: sha256_hex(&cfg.to_toml()),
            log_every: crate::cadence::Every(cfg.metrics.log_interval.max(1)),
            progress_dir: kiln_run::progress_dir(),
            started: Instant::now(),
        }
    }
}

impl<'a> Trainer<'a> {
    /// Sets up a run: the run directory (writer rank), data, model and optimizer, and the
    /// newest valid checkpoint when resuming. Past the run directory's opening, an error is
    /// written as the `exit` event before it is returned.
    pub(super) fn new(
        opts: &TrainOptions,
        mesh: &'a DeviceMesh,
        observer: &'a mut dyn Observer,
        mut startup: Startup,
    ) -> Result<Self, TrainError> {
        let comm = mesh.world();
        let cfg = opts.config.clone();
        cfg.validate()?;
        let opened = (comm.rank() == 0).then(|| open_run_dir(opts)).transpose()?;
        startup.mark(phase::RUN_DIR);
        let (writer, found) = opened.unzip();
        let run_id = found
            .as_ref()
            .map_or_else(String::new, |f| f.run_id.clone());
        let mut journal = Journal::new(writer, observer);
        let (layout, data, session) = match build(&cfg, mesh, &opts.run_dir, &mut startup) {
            Ok(parts) => parts,
            Err(e) => {
                let fields = json!({"reason": "error", "code": e.exit_code(), "step": 0, "error": e.to_string()});
                let _ = journal.emit(event::EXIT, fields);
                return Err(e);
            }
        };
        let mut session = session;
        let (step, optimizer) = Step::for_run(&cfg, &mut session, layout, mesh)?;
        let facts = RunFacts::new(&cfg, &session);
        let id = Identity {
            model_hash: facts.model_hash.clone(),
            config_hash: facts.config_hash.clone(),
        };
        let (seed, world) = (cfg.training.seed, layout.world as u64);
        let mut t = Self {
            checkpoints: Checkpoints::new(&cfg, &opts.run_dir, id, mesh, found),
            step,
            guards: GuardRail::new(&cfg.guards),
            startup,
            eval: Evaluator::new(&cfg, cfg.training.steps, data.synthetic.as_ref()),
            replicas: ReplicaCheck::new(cfg.guards.replica_check_interval),
            run: RunState {
                session,
                optimizer,
                state: TrainState::fresh(seed, run_id, layout.global_batch(), world),
                data,
            },
            cfg,
            journal,
            mesh,
            comm,
            stop: Arc::new(AtomicUsize::new(0)),
            facts,
            last_loss: None,
            last_eval: None,
            last_work_s: None,
        };
        t.setup(&opts.run_dir)
            .inspect_err(|e| t.emit_exit("error", e.exit_code(), Some(&e.to_string())))?;
        Ok(t)
    }

    /// The stop signals, the ranks' agreement on the config, and the resume.
    fn setup(&mut self, run_dir: &Path) -> Result<(), TrainError> {
        for sig in STOP_SIGNALS {
            signal_hook::flag::register_usize(sig, Arc::clone(&self.stop), sig as usize)
                .map_err(io(run_dir))?;
        }
        self.startup.mark(phase::MODEL_INIT);
        self.check_ranks_agree()?;
        let resumed_from = self.checkpoints.load(
            &mut self.run,
            &mut self.step,
            &mut self.guards,
            &mut self.journal,
        )?;
        // The run's config, once the start is accepted: a start refused above (a checkpoint
        // of another model) leaves the config the run was trained with, which export reads.
        if let Some(run) = self.journal.run_dir() {
            run.write_file(kiln_run::layout::CONFIG, self.cfg.to_toml().as_bytes())?;
        }
        self.emit_start(resumed_from.as_deref())?;
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

    fn emit_start(&mut self, resumed_from: Option<&Path>) -> Result<(), TrainError> {
        let layout = *self.step.layout();
        let fields = json!({
            "step": self.run.state.step, "total_steps": self.facts.total, "params": self.run.session.model.num_params(),
            "device": self.cfg.training.device, "data": self.run.data.source.describe(),
            "resumed_from": resumed_from.map(path_text), "config_hash": self.facts.config_hash,
            "pid": std::process::id(), "host": kiln_run::host_name(), "ranks": layout.world,
            "global_batch": layout.global_batch(), "grad_accum_steps": layout.accum,
            "engine": self.comm.describe(), "run_id": self.run.state.run_id,
            "shard": self.cfg.parallelism.shard.name(),
            "shard_ranks": self.step.shard().map_or(1, ShardPlan::shards),
            "tp": self.mesh.shape().size(crate::mesh::Dim::Tp),
            "prefetch": self.step.shard().is_some_and(ShardPlan::prefetches),
            "collectives": self.step.collectives(),
        });
        self.journal.emit(event::START, fields)?;
        if self.cfg.metrics.tensorboard {
            self.journal.open_tensorboard(self.run.state.step)?;
        }
        self.guards.start(&self.run);
        Ok(())
    }
}

/// The batch layout, the data and the model of a run (sizes that cannot fit, this rank's
/// memory snapshots included, are refused before the data is indexed for them).
fn build(
    cfg: &Config,
    mesh: &DeviceMesh,
    run_dir: &Path,
    startup: &mut Startup,
) -> Result<(BatchLayout, TrainData, Session), TrainError> {
    let layout = BatchLayout::of(&cfg.training, mesh).map_err(TrainError::Parallel)?;
    let rank = mesh.world().rank();
    let store = crate::components::checkpoints::snapshot::rank_dir(&cfg.checkpoint, run_dir, rank);
    crate::components::checkpoints::snapshot::check_store(&cfg.effective_checkpoint(), &store)?;
    let known = crate::budget::known_vocab(cfg);
    let ranks = mesh.world().size();
    crate::budget::check_run(cfg, known, ranks, &store)?;
    let data = TrainData::open(cfg, layout.samples_for(cfg.training.steps), None)
        .map_err(TrainError::Data)?;
    let vocab = data.vocab(cfg).map_err(TrainError::Data)?;
    if known == 0 {
        // The corpus told the vocabulary only now: the embedding may change the answer.
        crate::budget::check_run(cfg, vocab, ranks, &store)?;
    }
    startup.mark(phase::DATA_OPEN);
    crate::model::session::keep_device_cache(cfg, run_dir, rank);
    let session = Session::for_rank_of(cfg, vocab, ranks)?;
    Ok((layout, data, session))
}

/// The writer rank's side of the run directory: locks it, opens the logs and scans the
/// checkpoints (the config is written once the start is accepted, [`Trainer::setup`]).
fn open_run_dir(opts: &TrainOptions) -> Result<(Writer, checkpoints::Found), TrainError> {
    let cfg = &opts.config;
    let run = RunDir::lock(&opts.run_dir)?;
    let mut events = EventLog::open(run.path(), event::source::TRAIN)?;
    let (metrics, cut) = run.open_log(kiln_run::layout::METRICS)?;
    if cut > 0 {
        events.emit(
            event::LOG_REPAIRED,
            json!({"path": path_text(&run.path().join(kiln_run::layout::METRICS)), "bytes_removed": cut}),
        )?;
    }
    let found = checkpoints::scan(&run, cfg)?;
    Ok((
        Writer {
            run,
            events,
            metrics,
        },
        found,
    ))
}

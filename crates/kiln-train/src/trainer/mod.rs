//! The step loop: [`Trainer`] owns a run's parts and calls them in order. The parts decide
//! for themselves: the [`Step`] computes and applies each step; the [`GuardRail`] judges it
//! and rolls back; the [`Checkpoints`] (the whole checkpoint lifecycle), the [`Evaluator`] and the [`ReplicaCheck`] each
//! know when they are due; the [`Journal`] reports (the writer rank's run directory and the
//! caller's observer). [`train`] owns the job's device mesh ([`crate::mesh`]), since it is
//! the one that must end every rank when one fails.
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
//! on a background thread ([`crate::components::checkpoints::saver`]), so the other ranks never wait for its disk
//! except when the run ends.

use crate::components::checkpoints::{Checkpoints, Due};
use crate::components::eval::Evaluator;
use crate::components::guard_rail::{GuardRail, Judged, Verdict};
use crate::components::journal::Journal;
use crate::components::metrics::{self, EvalMetrics, Observer, StepMetrics};
use crate::components::replicas::ReplicaCheck;
use crate::components::startup::{Startup, phase};
use crate::config::Config;
use crate::error::TrainError;
use crate::mesh::{DeviceMesh, Dim, Dims};
use crate::model::stagewise;
use crate::optim;
use crate::state::RunState;
use crate::step::{At, Step};
use burn::tensor::{Int, Tensor};
use kiln_dist::Collective;
use kiln_run::{event, exit};
use serde_json::json;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Instant;

mod setup;

use setup::RunFacts;

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

/// One training run. See the module documentation.
struct Trainer<'a> {
    cfg: Config,
    /// The one owned state the step trains and the checkpoints save and restore.
    run: RunState,
    step: Step<'a>,
    guards: GuardRail,
    checkpoints: Checkpoints<'a>,
    startup: Startup,
    eval: Evaluator,
    replicas: ReplicaCheck,
    journal: Journal<'a>,
    /// The job's ranks as a mesh, and their groups.
    mesh: &'a DeviceMesh,
    /// Every rank of the job (`mesh`'s world): what every rank agrees on goes over it.
    comm: &'a dyn Collective,
    stop: Arc<AtomicUsize>,
    facts: RunFacts,
    last_loss: Option<f32>,
    last_eval: Option<EvalMetrics>,
    /// Seconds this rank worked on its last step, not counting the wait for its peers in
    /// the gradient exchange (its beacons carry it: `kiln_launch::straggler`).
    last_work_s: Option<f64>,
}

/// Trains according to `opts`, resuming from the newest valid checkpoint in the run
/// directory. Returns when all steps are done or a stop signal was handled. Every way out
/// writes an `exit` event; with several ranks, an error on one rank that the others cannot
/// know about ends all of them (MPI_Abort) so that none waits forever in a collective.
pub fn train(opts: &TrainOptions, observer: &mut dyn Observer) -> Result<TrainReport, TrainError> {
    let mut startup = Startup::begin();
    let mesh = crate::mesh::start(&opts.config.parallelism)?;
    let comm = mesh.world();
    startup.mark(phase::MPI_INIT);
    let mut trainer = Trainer::new(opts, &mesh, observer, startup).inspect_err(|e| {
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

/// `logits` of the rows of `x` `[batch, seq]` with the last row repeated until `tp` divides
/// them (a tensor-parallel model keeps each rank's share of the rows), and only the given
/// rows' logits kept.
fn padded(
    tp: usize,
    x: Tensor<2, Int>,
    logits: impl FnOnce(Tensor<2, Int>) -> Tensor<3>,
) -> Tensor<3> {
    let [b, t] = x.dims();
    let pad = (tp - b % tp) % tp;
    if pad == 0 || b == 0 {
        return logits(x);
    }
    let last = x.clone().slice([b - 1..b, 0..t]).repeat_dim(0, pad);
    let y = logits(Tensor::cat(vec![x, last], 0));
    let [_, _, v] = y.dims();
    y.slice([0..b, 0..t, 0..v])
}

/// Ends every rank with `e`'s exit code (MPI_Abort), so no rank waits in a collective.
fn abort_all(comm: &dyn Collective, e: &TrainError) {
    if comm.size() > 1 {
        tracing::error!("rank {}: {e}", comm.rank());
        comm.abort(e.exit_code());
    }
}

impl<'a> Trainer<'a> {
    /// Writes the `exit` event (writer rank), ignoring a failure to write it: it is the last
    /// thing a failing run does. A save still being written is waited for first, so no way
    /// out leaves one half done.
    fn emit_exit(&mut self, reason: &str, code: i32, error: Option<&str>) {
        self.checkpoints.settle(&mut self.journal);
        let step = self.run.state.step;
        let _ = self.journal.emit(
            event::EXIT,
            json!({"reason": reason, "code": code, "step": step, "error": error, "ranks": self.comm.size()}),
        );
    }

    fn beacon(&self, phase: &str) {
        if let Some(dir) = &self.facts.progress_dir {
            let _ = kiln_run::write_beacon_with_work(
                dir,
                self.comm.rank(),
                self.run.state.step,
                phase,
                kiln_run::unix_time(),
                self.last_work_s,
            );
        }
    }

    /// Trains until all steps are done or the ranks agree to stop.
    fn run(&mut self) -> Result<TrainReport, TrainError> {
        while self.run.state.step < self.facts.total {
            let applied = match self.train_step()? {
                Some(m) => {
                    self.startup.first_step(&mut self.journal)?;
                    self.after_step(&m)?;
                    true
                }
                None => false,
            };
            self.checkpoints.poll(&mut self.journal)?;
            let signal = self.agreed_stop();
            match self
                .checkpoints
                .due(self.run.state.step, applied, signal.is_some())
            {
                Due::Persistent => self.save()?,
                Due::Memory => self
                    .checkpoints
                    .snapshot(&mut self.run, &mut self.journal)?,
                Due::Nothing => {}
            }
            if let Some(signal) = signal {
                return self.preempted(signal);
            }
        }
        self.finish()
    }

    /// One optimizer step through the [`Step`]: its gradients, the guards' verdict, and the
    /// update. `None` when the guards discarded it. Never inlined: profilers and the
    /// performance guard (bench/guard, `STEP_FUNCTION`) count the step by this symbol.
    #[inline(never)]
    fn train_step(&mut self) -> Result<Option<StepMetrics>, TrainError> {
        let t0 = Instant::now();
        self.beacon(event::beacon_phase::TRAIN);
        let pieces_over = self.pieces_over(false);
        let (cfg, run) = (&self.cfg, &mut self.run);
        let lr = optim::lr_at(
            &cfg.lr_scheduler,
            cfg.optimizer.lr,
            run.state.step,
            self.facts.total,
        );
        let at = At {
            base: run.state.next_sample(),
            batch_no: run.state.data_cursor + 1,
        };
        let g = self
            .step
            .gradients(&run.session, run.data.source.as_ref(), at)?;
        let (loss, grad_norm, allreduce_s) = (g.loss, g.norm, g.allreduce_s);
        let judged = Judged {
            loss,
            norm: grad_norm,
            grads: &g.grads,
            pieces_over,
        };
        let saved_at = self.checkpoints.saved_at();
        if let Verdict::Discard = self
            .guards
            .judge(&judged, run, &mut self.journal, saved_at)?
        {
            return Ok(None);
        }
        let data = run.data.source.as_ref();
        let t_update = Instant::now();
        (self.step).apply(&mut run.session, &mut run.optimizer, data, g, lr)?;
        let update_s = t_update.elapsed().as_secs_f64();
        let layout = *self.step.layout();
        let st = &mut run.state;
        st.step += 1;
        st.advance_data(1);
        st.tokens_seen += layout.global_batch() * layout.seq as u64;
        st.lr = lr;
        self.last_loss = Some(loss);
        let params = &mut run.session.params;
        (self.step.faults()).after_update(st.step, self.comm.rank(), params);
        let dt = t0.elapsed().as_secs_f64();
        // This rank's own work on the step, without the wait for its peers in the exchange:
        // the next beacon carries it (stragglers, `kiln_launch::straggler`).
        self.last_work_s = Some((dt - allreduce_s).max(0.0));
        Ok(Some(self.metrics(
            loss,
            grad_norm,
            lr,
            dt,
            at.base,
            (allreduce_s, update_s),
        )))
    }

    /// The metrics of the step just applied, which took `dt` seconds from sample
    /// `first_sample`, of which `allreduce_s` averaging the gradients and `update_s` in the
    /// optimizer's update.
    fn metrics(
        &self,
        loss: f32,
        grad_norm: f32,
        lr: f64,
        dt: f64,
        first_sample: u64,
        (allreduce_s, update_s): (f64, f64),
    ) -> StepMetrics {
        let layout = *self.step.layout();
        let tokens = layout.global_batch() * layout.seq as u64;
        let tps = tokens as f64 / dt.max(1e-9);
        // Every rank's device, the tensor-parallel ones too.
        let peak = self.facts.peak_flops * self.comm.size() as f64;
        StepMetrics {
            step: self.run.state.step,
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
            tokens_seen: self.run.state.tokens_seen,
            first_sample,
            global_batch: layout.global_batch(),
            allreduce_s,
            update_s,
        }
    }

    /// After an applied step: metrics, then each component that is due (the guards'
    /// snapshot and frozen check, the replica check, eval).
    fn after_step(&mut self, m: &StepMetrics) -> Result<(), TrainError> {
        let step = self.run.state.step;
        let logged = self.facts.log_every.due_or_last(step, self.facts.total);
        self.journal.step(m, logged)?;
        let pieces_over = self.pieces_over(true);
        self.guards
            .after_step(&self.run, pieces_over, &mut self.journal)?;
        if self.replicas.due(step) {
            self.check_replicas()?;
        }
        if self.eval.due(step) {
            self.evaluate()?;
        }
        Ok(())
    }

    /// The ranks whose pieces of the gradients (`parameters`: of the parameters) make them
    /// whole, whose verdicts the guards combine: those a sharded state is cut over, by those
    /// tensor parallelism cuts the matrices over (`None`: this rank holds them whole).
    fn pieces_over(&self, parameters: bool) -> Option<&'a dyn Collective> {
        let sharded = match parameters {
            true => self.step.parameter_shards().is_some(),
            false => self.step.shard().is_some(),
        };
        let dims = match sharded {
            true => Dims::PIECES,
            false => Dims::one(Dim::Tp),
        };
        let mesh: &'a DeviceMesh = self.mesh;
        (mesh.shape().group_size(dims) > 1).then(|| mesh.group(dims))
    }

    /// Compares a checksum of the parameters of the ranks that hold the same ones (every
    /// rank; with parameters sharded, the ranks of each shard in the replicas); the ranks
    /// that differ from the majority are named and the run stops before their weights can
    /// be saved.
    fn check_replicas(&mut self) -> Result<(), TrainError> {
        // The ranks that hold the same parameters: every data-parallel rank, or with the
        // parameters sharded, those of the same shard in each replica.
        let same = match self.step.parameter_shards() {
            Some(_) => Dims::one(Dim::DpReplicate),
            None => Dims::DP,
        };
        let params = &self.run.session.params;
        let Some(m) = ReplicaCheck::compare(self.mesh, same, params) else {
            return Ok(());
        };
        let step = self.run.state.step;
        self.journal.emit(
            event::REPLICA_MISMATCH,
            json!({"step": step, "ranks": m.ranks, "checksums": m.checksums}),
        )?;
        self.checkpoints.distrust_memory(&mut self.journal);
        Err(TrainError::ReplicaMismatch {
            step,
            ranks: m.ranks,
        })
    }

    /// Held-out eval on the writer rank (the others go on to the next step's all-reduce and
    /// wait there); with parameters sharded or matrices cut (tensor parallelism), on every
    /// rank, which compute each batch together (the observer's extra scores, which need the
    /// whole model on one rank, are left out).
    fn evaluate(&mut self) -> Result<(), TrainError> {
        // The optimizer's published weights where they are not the ones it trains at.
        let shown = (self.run.optimizer.published(&self.run.session.params))
            .map(|x| self.run.session.with_params(x));
        let session = shown.as_ref().unwrap_or(&self.run.session);
        let staged = self.step.stage_shards(session);
        let tp = self.mesh.shape().size(Dim::Tp);
        if !self.journal.is_writer() && staged.is_none() && tp == 1 {
            return Ok(());
        }
        let Some(syn) = self.run.data.synthetic.as_ref() else {
            return Ok(());
        };
        self.beacon(event::beacon_phase::EVAL);
        let step = self.run.state.step;
        let e = match staged {
            Some(mut s) => {
                let logits =
                    &mut |x| padded(tp, x, |x| stagewise::logits(&session.model, &mut s, x));
                let e = self.eval.run_with(session, syn, step, logits);
                // A collective that failed during the eval is the step's error.
                s.check()?;
                e
            }
            None if tp > 1 => {
                let logits = &mut |x| padded(tp, x, |x| session.model.forward(&session.params, x));
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
    fn agreed_stop(&mut self) -> Option<i32> {
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
        let step = self.run.state.step;
        let _ = self.journal.emit(
            event::SIGNAL,
            json!({"signal": flag[0], "step": step, "ranks": who}),
        );
        Some(flag[0] as i32)
    }

    /// Saves a persistent checkpoint, after checking that the ranks agree on the parameters.
    /// Every rank calls it at the same step. What the step waits for (the replica check,
    /// staging, a previous save still in flight) is its stall.
    fn save(&mut self) -> Result<(), TrainError> {
        let t0 = Instant::now();
        self.check_replicas()?;
        self.beacon(event::beacon_phase::CHECKPOINT);
        let before_s = t0.elapsed().as_secs_f64();
        (self.checkpoints).save(&mut self.run, &self.step, before_s, &mut self.journal)
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
        if !self.checkpoints.saved(self.run.state.step) {
            self.save()?;
        }
        self.checkpoints.wait(&mut self.journal)?;
        self.write_final_model()?;
        self.beacon(event::beacon_phase::DONE);
        let kib = (metrics::peak_rss_mib() * 1024.0) as u64;
        let mib: Vec<f64> = self
            .comm
            .all_gather_u64(kib)
            .iter()
            .map(|&k| k as f64 / 1024.0)
            .collect();
        let step = self.run.state.step;
        self.journal
            .emit(event::PEAK_MEMORY, json!({"step": step, "rank_mib": mib}))?;
        self.checkpoints.complete(&mut self.journal);
        self.emit_exit("completed", exit::SUCCESS, None);
        Ok(self.report(Outcome::Completed))
    }

    /// `model.safetensors` in the run directory (writer rank); with parameters sharded or
    /// matrices cut (tensor parallelism), every rank takes part in gathering the whole
    /// weights.
    fn write_final_model(&mut self) -> Result<(), TrainError> {
        let shown = (self.run.optimizer.published(&self.run.session.params))
            .map(|x| self.run.session.with_params(x));
        let session = shown.as_ref().unwrap_or(&self.run.session);
        let (specs, params) = (session.model.specs(), &session.params);
        let gathered = (self.step.parameter_shards())
            .map(|plan| plan.whole_host(specs, params))
            .transpose()?;
        let tp = self.mesh.shape().size(Dim::Tp);
        if gathered.is_none() && tp == 1 && !self.journal.is_writer() {
            return Ok(());
        }
        let host = match (gathered, tp) {
            (Some(h), 1) => h,
            (None, 1) => session.host_params(),
            (h, _) => {
                let local = match h {
                    Some(h) => h.into_iter().map(|t| t.values).collect(),
                    None => params.iter().map(crate::tensor::to_vec).collect(),
                };
                crate::parallel::tensor::whole(&session.model, local)
            }
        };
        let Some(run) = self.journal.run_dir() else {
            return Ok(());
        };
        let bytes = crate::checkpoint::to_safetensors(&host).map_err(|e| TrainError::Io {
            path: run.path().join(kiln_run::layout::FINAL_MODEL),
            source: std::io::Error::other(e.to_string()),
        })?;
        run.write_file(kiln_run::layout::FINAL_MODEL, &bytes)?;
        Ok(())
    }

    fn report(&self, outcome: Outcome) -> TrainReport {
        TrainReport {
            outcome,
            step: self.run.state.step,
            last_loss: self.last_loss,
            last_eval: self.last_eval.clone(),
            seconds: self.facts.started.elapsed().as_secs_f64(),
        }
    }
}

//! [`GuardRail`]: the in-run guards of a run as one component. It judges each step's global
//! loss and gradient norm (skip non-finite steps, roll back after too many of them or on a
//! loss spike, check the first loss), keeps the in-memory snapshot it rolls back to, and
//! names parameters that stopped changing. Every rank sees the same values, so every rank
//! decides the same. Its cadence is its own (`guards.snapshot_interval`,
//! `guards.frozen_check_interval`). Its snapshot is not checkpointed with the run's state;
//! instead the memory tier keeps the state at the newest multiple of the snapshot interval,
//! and a run resumed between two snapshots gets it back from there (or from a persistent
//! checkpoint at that step, or a peer: [`GuardRail::adopt_snapshot`]), so that it rolls back
//! exactly where an uninterrupted run would. The rest of its in-memory state (the streak
//! counters, the frozen check's reference) starts afresh at the resumed step
//! ([`GuardRail::restored`]).

use crate::cadence::Every;
use crate::components::journal::Journal;
use crate::config::GuardsConfig;
use crate::error::TrainError;
use crate::loss_checks::{self, LossVerdict};
use crate::model::ParamSpec;
use crate::optim::Optimizer;
use crate::state::{RunState, TrainState};
use crate::tensor::{changed_params, nonfinite_tensors};
use burn::tensor::Tensor;
use kiln_dist::Collective;
use kiln_run::event;
use serde_json::json;

/// What a rollback restores. The data cursor is not restored: the batches after it are
/// skipped.
#[derive(Clone)]
struct Snapshot {
    state: TrainState,
    params: Vec<Tensor<1>>,
    optimizer: Optimizer,
}

/// One step's global loss and gradient norm, and the averaged gradients they come from.
pub struct Judged<'a> {
    /// The loss, averaged over the ranks.
    pub loss: f32,
    /// The global norm of the averaged gradients.
    pub norm: f32,
    /// The averaged gradients (in a sharded run, this rank's pieces of them).
    pub grads: &'a [Tensor<1>],
    /// In a sharded run, the ranks whose pieces make the gradients whole.
    pub pieces_over: Option<&'a dyn Collective>,
}

/// What the guards decided about one step.
pub enum Verdict {
    /// Apply the update.
    Update,
    /// The step was skipped or rolled back: nothing to apply.
    Discard,
}

/// The guards' component (see the module documentation).
pub struct GuardRail {
    cfg: GuardsConfig,
    /// The run started from a fresh model (not a checkpoint).
    fresh: bool,
    snapshot: Option<Snapshot>,
    nonfinite_in_row: u32,
    /// Rollbacks since training last got past `high_water`.
    rollbacks_in_row: u32,
    /// The furthest step reached; getting past it again ends a streak of rollbacks.
    high_water: u64,
    last_frozen_check: Option<Vec<Tensor<1>>>,
}

impl GuardRail {
    /// The guards of `cfg` for a fresh run.
    pub fn new(cfg: &GuardsConfig) -> Self {
        Self {
            cfg: cfg.clone(),
            fresh: true,
            snapshot: None,
            nonfinite_in_row: 0,
            rollbacks_in_row: 0,
            high_water: 0,
            last_frozen_check: None,
        }
    }

    /// The run starts from trained weights (`model.init_from`): its first loss is not a
    /// fresh model's.
    pub fn trained_start(&mut self) {
        self.fresh = false;
    }

    /// The run resumed at `step` from a checkpoint.
    pub fn restored(&mut self, step: u64) {
        self.fresh = false;
        self.high_water = step;
    }

    /// The step of the snapshot an uninterrupted run would hold on reaching `step`, when
    /// that is not `step` itself (rollbacks off: none).
    pub fn snapshot_before(&self, step: u64) -> Option<u64> {
        let every = self.cfg.snapshot_interval;
        (every > 0 && !step.is_multiple_of(every)).then(|| step - step % every)
    }

    /// Takes `live` (the state at [`GuardRail::snapshot_before`] the resumed step, restored)
    /// as the snapshot to roll back to.
    pub fn adopt_snapshot(&mut self, live: &RunState) {
        self.take_snapshot(live);
    }

    /// At the start of training: the first snapshot, when one is due at the start step.
    pub fn start(&mut self, live: &RunState) {
        if self.snapshot.is_none() && Every(self.cfg.snapshot_interval).due(live.state.step) {
            self.take_snapshot(live);
        }
    }

    /// Judges one step's global loss and gradient norm (`step`); may roll `live` back.
    /// `saved_at` (the newest checkpoint) is named when the guards give up.
    pub fn judge(
        &mut self,
        step: &Judged,
        live: &mut RunState,
        journal: &mut Journal,
        saved_at: Option<u64>,
    ) -> Result<Verdict, TrainError> {
        let (loss, norm) = (step.loss, step.norm);
        if !loss.is_finite() || !norm.is_finite() {
            return self.nonfinite(step, live, journal, saved_at);
        }
        self.nonfinite_in_row = 0;
        if self.fresh && live.state.step == 0 {
            self.check_initial_loss(loss, live.session.model.vocab(), journal)?;
        }
        let verdict = live.state.spike_window.observe(loss, &self.cfg);
        if let LossVerdict::Spike { loss, mean, std } = verdict {
            let step = live.state.step + 1;
            journal.emit(
                event::LOSS_SPIKE,
                json!({"step": step, "loss": loss, "window_mean": mean, "window_std": std}),
            )?;
            journal.note(&format!(
                "step {step}: loss spike {loss:.3} (window mean {mean:.3})"
            ));
            live.state.advance_data(1);
            if self.snapshot.is_some() {
                self.rollback(
                    "loss_spike",
                    self.cfg.spike_skip_batches,
                    live,
                    journal,
                    saved_at,
                )?;
            } else {
                // Without a snapshot, at least do not learn from the spiking batch.
                journal.emit(
                    event::SPIKE_SKIP,
                    json!({"step": step, "note": "no snapshot; batch skipped"}),
                )?;
            }
            return Ok(Verdict::Discard);
        }
        Ok(Verdict::Update)
    }

    /// After an applied step: the high-water mark, the snapshot and the frozen check when due
    /// (`pieces_over`: the ranks whose pieces of the parameters make them whole, in a
    /// parameter-sharded run; every rank calls this at the same steps).
    pub fn after_step(
        &mut self,
        live: &RunState,
        pieces_over: Option<&dyn Collective>,
        journal: &mut Journal,
    ) -> Result<(), TrainError> {
        let step = live.state.step;
        if step > self.high_water {
            self.high_water = step;
            self.rollbacks_in_row = 0;
        }
        if Every(self.cfg.snapshot_interval).due(step) {
            self.take_snapshot(live);
        }
        let checks = journal.is_writer() || pieces_over.is_some();
        if Every(self.cfg.frozen_check_interval).due(step) && checks {
            self.check_frozen(live, pieces_over, journal)?;
        }
        Ok(())
    }

    /// A step with a non-finite loss or gradient norm: skipped, with the parameters whose
    /// gradients hold a NaN or an infinity named; rolled back after too many in a row.
    fn nonfinite(
        &mut self,
        judged: &Judged,
        live: &mut RunState,
        journal: &mut Journal,
        saved_at: Option<u64>,
    ) -> Result<Verdict, TrainError> {
        live.state.nonfinite_skipped += 1;
        self.nonfinite_in_row += 1;
        live.state.advance_data(1);
        let (step, in_row) = (live.state.step, self.nonfinite_in_row);
        let (loss, norm) = (judged.loss.to_string(), judged.norm.to_string());
        let names = nonfinite_names(live.session.model.specs(), judged);
        journal.emit(
            event::NONFINITE_SKIP,
            json!({"step": step, "loss": loss, "grad_norm": norm, "in_row": in_row, "params": names}),
        )?;
        journal.note(&format!(
            "step {}: non-finite loss/gradients ({}), step skipped",
            step + 1,
            name_list(&names)
        ));
        if in_row >= self.cfg.max_nonfinite_in_row {
            self.rollback("nonfinite", 0, live, journal, saved_at)?;
        }
        Ok(Verdict::Discard)
    }

    fn check_initial_loss(
        &self,
        loss: f32,
        vocab: usize,
        journal: &mut Journal,
    ) -> Result<(), TrainError> {
        let tolerance = self.cfg.initial_loss_tolerance;
        if let Some(msg) = loss_checks::check_initial_loss(loss, vocab, tolerance) {
            journal.emit(
                event::INITIAL_LOSS_ERROR,
                json!({"loss": loss, "vocab": vocab, "message": msg}),
            )?;
            return Err(TrainError::Guard(msg));
        }
        journal.emit(
            event::INITIAL_LOSS_OK,
            json!({"loss": loss, "expected": (vocab as f64).ln()}),
        )
    }

    /// Restores the last snapshot and skips `skip` more batches. Past
    /// `guards.max_rollbacks` rollbacks that made no progress the run stops, naming the
    /// likely cause; the checkpoints on disk (the last good state) are kept.
    fn rollback(
        &mut self,
        reason: &str,
        skip: u64,
        live: &mut RunState,
        journal: &mut Journal,
        saved_at: Option<u64>,
    ) -> Result<(), TrainError> {
        let Some(snap) = self.snapshot.clone() else {
            return Err(TrainError::Guard(format!(
                "{} non-finite steps in a row at step {} and no snapshot to roll back to (guards.snapshot_interval = 0); {}",
                self.nonfinite_in_row,
                live.state.step + 1,
                self.likely_cause(reason)
            )));
        };
        let limit = self.cfg.max_rollbacks;
        if limit > 0 && self.rollbacks_in_row >= limit {
            journal.emit(
                event::ROLLBACK_LIMIT,
                json!({"step": live.state.step, "rollbacks_in_row": self.rollbacks_in_row, "reason": reason}),
            )?;
            return Err(TrainError::Guard(format!(
                "{} rollbacks in a row did not get training past step {} ({reason}); {}; the last good state is the newest checkpoint{}",
                self.rollbacks_in_row,
                self.high_water,
                self.likely_cause(reason),
                saved_at.map_or(String::new(), |s| format!(" (step {s})"))
            )));
        }
        live.state.advance_data(skip);
        let from = live.state.step;
        journal.emit(
            event::ROLLBACK,
            json!({"from_step": from, "to_step": snap.state.step, "reason": reason, "skip_batches": skip, "data_cursor": live.state.data_cursor}),
        )?;
        journal.note(&format!(
            "step {}: rolled back to step {} ({reason}) and skipped {skip} batches",
            from + 1,
            snap.state.step
        ));
        live.state = TrainState {
            data_cursor: live.state.data_cursor,
            sample_cursor: Some(live.state.next_sample()),
            rollbacks: live.state.rollbacks + 1,
            nonfinite_skipped: live.state.nonfinite_skipped,
            data_schedule: live.state.data_schedule.take(),
            ..snap.state
        };
        live.session.params = snap.params;
        live.optimizer = snap.optimizer;
        self.nonfinite_in_row = 0;
        self.rollbacks_in_row += 1;
        Ok(())
    }

    /// What most likely makes every step fail, for the guard's stop message.
    fn likely_cause(&self, reason: &str) -> String {
        let early = self.high_water <= self.cfg.snapshot_interval.max(1);
        match (reason, early && self.fresh) {
            ("nonfinite", true) => "every step of a fresh model is non-finite: a config value is likely wrong (check optimizer.lr, eps, weight_decay, model.norm_eps, rope_theta, init_std) or the data holds token ids beyond the vocabulary".into(),
            ("nonfinite", _) => "training diverged: lower optimizer.lr or raise warmup, check the data around this step for garbage".into(),
            _ => "the loss keeps spiking past the skipped batches: lower optimizer.lr, or inspect the data around this step".into(),
        }
    }

    fn take_snapshot(&mut self, live: &RunState) {
        self.snapshot = Some(Snapshot {
            state: live.state.clone(),
            params: live.session.params.clone(),
            optimizer: live.optimizer.clone(),
        });
    }

    /// Names parameter tensors that did not change over the check interval (an event, not a
    /// stop). Every rank holds the same parameters, so the writer rank checks; with
    /// `pieces_over`, every rank holds its pieces only and a parameter is frozen when no
    /// rank's piece of it changed.
    fn check_frozen(
        &mut self,
        live: &RunState,
        pieces_over: Option<&dyn Collective>,
        journal: &mut Journal,
    ) -> Result<(), TrainError> {
        let (step, every) = (live.state.step, self.cfg.frozen_check_interval);
        let params = &live.session.params;
        if let Some(prev) = &self.last_frozen_check {
            let mut changed: Vec<f64> = changed_params(params, prev)
                .into_iter()
                .map(f64::from)
                .collect();
            if let Some(comm) = pieces_over {
                comm.all_reduce_sum_f64(&mut changed);
            }
            let specs = live.session.model.specs();
            let names: Vec<String> = (0..specs.len())
                .filter(|&i| changed[i] == 0.0)
                .map(|i| specs[i].name.clone())
                .collect();
            if !names.is_empty() && journal.is_writer() {
                journal.emit(
                    event::FROZEN_PARAMS,
                    json!({"step": step, "since_step": step.saturating_sub(every), "params": names}),
                )?;
                journal.note(&format!(
                    "step {step}: {} parameter tensors did not change in {every} steps: {}",
                    names.len(),
                    names.join(", ")
                ));
            }
        }
        self.last_frozen_check = Some(params.clone());
        Ok(())
    }
}

/// The parameters whose averaged gradient holds a NaN or an infinity (in a sharded run every
/// rank of `judged.pieces_over` calls it, and their pieces are combined).
fn nonfinite_names(specs: &[ParamSpec], judged: &Judged) -> Vec<String> {
    let mut bad: Vec<f64> = nonfinite_tensors(judged.grads)
        .into_iter()
        .map(f64::from)
        .collect();
    if let Some(comm) = judged.pieces_over {
        comm.all_reduce_sum_f64(&mut bad);
    }
    specs
        .iter()
        .zip(bad)
        .filter(|(_, b)| *b > 0.0)
        .map(|(s, _)| s.name.clone())
        .collect()
}

/// `names` for a log line: the first few, and how many more.
fn name_list(names: &[String]) -> String {
    const SHOWN: usize = 4;
    match names.len() {
        0 => "no gradient holds one: the loss itself".into(),
        n if n <= SHOWN => names.join(", "),
        n => format!("{} and {} more", names[..SHOWN].join(", "), n - SHOWN),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::ModelConfig;
    use crate::model::Llama;
    use burn::tensor::Device;

    /// Three ranks, each with its pieces of two parameters' gradients; rank 0 holds nothing
    /// of the second, and only rank 2's piece of it is NaN: every rank names that one.
    #[test]
    fn non_finite_gradients_are_named_from_every_ranks_pieces() {
        let specs = Llama::new(&ModelConfig::default(), 40).specs()[..2].to_vec();
        let names: Vec<Vec<String>> = std::thread::scope(|scope| {
            let handles: Vec<_> = kiln_dist::Threads::job(3)
                .into_iter()
                .map(|comm| {
                    let specs = &specs;
                    scope.spawn(move || {
                        let d = Device::flex();
                        let second: &[f32] = match comm.rank() {
                            0 => &[],
                            1 => &[1.0, 2.0],
                            _ => &[3.0, f32::NAN],
                        };
                        let grads = [
                            Tensor::<1>::from_floats([1.0, -1.0], &d),
                            Tensor::<1>::from_floats(second, &d),
                        ];
                        let judged = Judged {
                            loss: 1.0,
                            norm: f32::NAN,
                            grads: &grads,
                            pieces_over: Some(&comm),
                        };
                        nonfinite_names(specs, &judged)
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        for n in names {
            assert_eq!(n, [specs[1].name.clone()]);
        }
    }

    #[test]
    fn long_name_lists_are_cut_for_the_log() {
        let names: Vec<String> = (0..6).map(|i| format!("p{i}")).collect();
        assert_eq!(name_list(&names[..2]), "p0, p1");
        assert_eq!(name_list(&names), "p0, p1, p2, p3 and 2 more");
        assert!(name_list(&[]).contains("loss"));
    }
}

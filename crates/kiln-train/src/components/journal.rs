//! [`Journal`]: what a run reports. The writer rank (rank 0) holds the locked run
//! directory, its event log and `metrics.jsonl`; every rank holds one, so components report
//! through it without asking which rank they run on (the others' reports go nowhere). The
//! caller's [`Observer`] sees steps, evals and notes on the writer rank. With
//! `metrics.tensorboard`, the writer rank also writes the logged scalars and the guards'
//! events to the run's TensorBoard event file ([`TensorBoard`]).

use crate::components::metrics::{EvalMetrics, Observer, StepMetrics};
use crate::components::tensorboard::TensorBoard;
use crate::error::{TrainError, io};
use crate::run_dir::RunDir;
use kiln_run::EventLog;
use serde_json::Value;
use std::io::Write;
use std::path::Path;

/// The writer rank's files.
pub struct Writer {
    /// The locked run directory.
    pub run: RunDir,
    /// `events.jsonl`.
    pub events: EventLog,
    /// `metrics.jsonl`, opened for appending.
    pub metrics: std::fs::File,
}

/// A run's reports (see the module documentation).
pub struct Journal<'o> {
    writer: Option<Writer>,
    observer: &'o mut dyn Observer,
    tensorboard: Option<TensorBoard>,
}

/// The events written to TensorBoard as text (under `guards/<event>`): what the guards saw
/// and did.
pub const GUARD_EVENTS: &[&str] = &[
    kiln_run::event::NONFINITE_SKIP,
    kiln_run::event::ROLLBACK,
    kiln_run::event::LOSS_SPIKE,
    kiln_run::event::SPIKE_SKIP,
    kiln_run::event::FROZEN_PARAMS,
    kiln_run::event::ROLLBACK_LIMIT,
    kiln_run::event::REPLICA_MISMATCH,
    kiln_run::event::INITIAL_LOSS_ERROR,
    kiln_run::event::ROLLBACK_POINT_LOST,
];

/// A path for an event: lossy text, since JSON strings are UTF-8 and a run directory need
/// not be.
pub fn path_text(p: &Path) -> String {
    p.to_string_lossy().into_owned()
}

impl<'o> Journal<'o> {
    /// The journal of the writer rank (`Some(writer)`) or of another rank.
    pub fn new(writer: Option<Writer>, observer: &'o mut dyn Observer) -> Self {
        Self {
            writer,
            observer,
            tensorboard: None,
        }
    }

    /// On the writer rank, opens the run's TensorBoard event file for a run that starts
    /// after step `from` (later steps a previous attempt wrote are cut: they come again).
    pub fn open_tensorboard(&mut self, from: u64) -> Result<(), TrainError> {
        if let Some(w) = &self.writer {
            self.tensorboard = Some(TensorBoard::open(w.run.path(), from)?);
        }
        Ok(())
    }

    /// Whether this rank writes the run directory.
    pub fn is_writer(&self) -> bool {
        self.writer.is_some()
    }

    /// An event in the run's event log.
    pub fn emit(&mut self, name: &str, fields: Value) -> Result<(), TrainError> {
        if let Some(tb) = &mut self.tensorboard
            && GUARD_EVENTS.contains(&name)
        {
            // A rollback returns to `to_step`: the steps after it come again.
            let back = fields.get("to_step").and_then(Value::as_u64);
            if let Some(to) = back {
                tb.rollback_to(to)?;
            }
            let step = fields.get("step").and_then(Value::as_u64).or(back);
            tb.text(
                step.unwrap_or(0),
                &format!("guards/{name}"),
                &fields.to_string(),
            )?;
        }
        if let Some(w) = &mut self.writer {
            w.events.emit(name, fields)?;
        }
        Ok(())
    }

    /// A one-line message for the observer.
    pub fn note(&mut self, msg: &str) {
        if self.writer.is_some() {
            self.observer.on_note(msg);
        }
    }

    /// A completed step: its line in `metrics.jsonl` when `logged`, and the observer.
    pub fn step(&mut self, m: &StepMetrics, logged: bool) -> Result<(), TrainError> {
        if self.writer.is_some() {
            if logged {
                self.metrics_line(m)?;
                if let Some(tb) = &mut self.tensorboard {
                    tb.scalars(
                        m.step,
                        &[
                            ("train/loss", f64::from(m.loss)),
                            ("train/grad_norm", f64::from(m.grad_norm)),
                            ("train/lr", m.lr),
                            ("train/tokens_per_s", m.tokens_per_s),
                            ("train/mfu", m.mfu),
                            ("train/step_time_s", m.step_time_s),
                        ],
                    )?;
                }
            }
            self.observer.on_step(m);
        }
        Ok(())
    }

    /// An evaluation: its line in `metrics.jsonl`, and the observer.
    pub fn eval(&mut self, e: &EvalMetrics) -> Result<(), TrainError> {
        if self.writer.is_some() {
            self.metrics_line(e)?;
            if let Some(tb) = &mut self.tensorboard {
                let mut values = vec![("eval/loss".to_string(), e.eval_loss)];
                values.extend(e.eval_accuracy.map(|a| ("eval/accuracy".into(), a)));
                values.extend(e.unigram_loss.map(|u| ("eval/unigram_loss".into(), u)));
                for (k, v) in &e.extra {
                    if let Some(x) = v.as_f64() {
                        values.push((format!("eval/{k}"), x));
                    }
                }
                let named: Vec<(&str, f64)> =
                    values.iter().map(|(k, v)| (k.as_str(), *v)).collect();
                tb.scalars(e.step, &named)?;
            }
            self.observer.on_eval(e);
        }
        Ok(())
    }

    /// The observer (for its extra evaluations).
    pub fn observer(&mut self) -> &mut dyn Observer {
        &mut *self.observer
    }

    /// The locked run directory (writer rank).
    pub fn run_dir(&self) -> Option<&RunDir> {
        self.writer.as_ref().map(|w| &w.run)
    }

    fn metrics_line<T: serde::Serialize>(&mut self, record: &T) -> Result<(), TrainError> {
        if let Some(w) = &mut self.writer {
            let mut line = serde_json::to_vec(record).unwrap_or_default();
            line.push(b'\n');
            let path = w.run.path().join(kiln_run::layout::METRICS);
            w.metrics.write_all(&line).map_err(io(&path))?;
        }
        Ok(())
    }
}

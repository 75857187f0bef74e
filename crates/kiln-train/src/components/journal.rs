//! [`Journal`]: what a run reports. The writer rank (rank 0) holds the locked run
//! directory, its event log and `metrics.jsonl`; every rank holds one, so components report
//! through it without asking which rank they run on (the others' reports go nowhere). The
//! caller's [`Observer`] sees steps, evals and notes on the writer rank.

use crate::components::metrics::{EvalMetrics, Observer, StepMetrics};
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
}

/// A path for an event: lossy text, since JSON strings are UTF-8 and a run directory need
/// not be.
pub fn path_text(p: &Path) -> String {
    p.to_string_lossy().into_owned()
}

impl<'o> Journal<'o> {
    /// The journal of the writer rank (`Some(writer)`) or of another rank.
    pub fn new(writer: Option<Writer>, observer: &'o mut dyn Observer) -> Self {
        Self { writer, observer }
    }

    /// Whether this rank writes the run directory.
    pub fn is_writer(&self) -> bool {
        self.writer.is_some()
    }

    /// An event in the run's event log.
    pub fn emit(&mut self, name: &str, fields: Value) -> Result<(), TrainError> {
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
            }
            self.observer.on_step(m);
        }
        Ok(())
    }

    /// An evaluation: its line in `metrics.jsonl`, and the observer.
    pub fn eval(&mut self, e: &EvalMetrics) -> Result<(), TrainError> {
        if self.writer.is_some() {
            self.metrics_line(e)?;
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

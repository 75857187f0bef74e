//! [`PersistentTier`]: the checkpoint component of a run, on every rank: when a save is due
//! (`checkpoint.interval`, the last step, a stop signal with unsaved work), and, on the
//! writer rank, its [`Saver`], which writes checkpoints through a [`Store`] (the run's
//! [`CheckpointStore`]; the memory tier's store in [`crate::components::checkpoints::snapshot`]), synchronously or
//! on a writer thread (`checkpoint.async`).
//!
//! Asynchronous saving: the training step hands over the state as [`Staged`] tensors and
//! goes on; the writer thread copies them to the host, serialises, writes, fsyncs, writes the
//! manifest, renames and applies retention. Handing over costs no copy: burn tensors are
//! immutable values whose buffers a step only ever replaces (an operation writes in place
//! only into a buffer nobody else holds), so the staged tensors keep the step's values while
//! training goes on; the price is that those buffers stay allocated until the writer has
//! copied them (on a GPU: one more copy of weights and optimizer state in device memory). At most one save is in flight: submitting the
//! next one first waits for it. Every way out of training waits for it too
//! ([`Saver::wait`]); dropping the saver joins the thread, so not even an early return can
//! leave a save half done while the process exits normally. A SIGKILL during a write leaves
//! a temporary directory, never a published checkpoint, exactly as a synchronous save would.
//!
//! The writer thread runs at a lower scheduling priority (nice +10): its host copy,
//! serialisation, SHA-256 and fsync use a core the training step would otherwise get, and on
//! a machine whose cores the step keeps busy it must yield to the step, not slow it.

use crate::cadence::Every;
use crate::checkpoint::{
    Checkpoint, CheckpointError, CheckpointStore, Contents, SaveReport, Source,
};
use crate::components::journal::{Journal, path_text};
use crate::error::TrainError;
use crate::tensor::DeviceTensor;
use kiln_run::event;
use serde_json::json;
use std::sync::mpsc::{Receiver, Sender, TryRecvError, channel};
use std::thread::JoinHandle;
use std::time::Instant;

/// A checkpoint as the step hands it over: references to the tensors, not copies.
#[derive(Debug, Clone)]
pub struct Staged {
    /// Optimizer step the checkpoint is taken after.
    pub step: u64,
    /// Weights.
    pub model: Vec<DeviceTensor>,
    /// Optimizer state.
    pub optimizer: Vec<DeviceTensor>,
    /// `state.json`.
    pub state: serde_json::Value,
    /// A sharded run's optimizer shards, already on disk (see [`Checkpoint::shards`]).
    pub shards: Vec<crate::checkpoint::ShardFile>,
}

impl Staged {
    /// Writes it into `store`. On the host backend the staged tensors are host memory
    /// already, the buffers the step has replaced, so each is read as its bytes are written
    /// and no second copy of the state is ever made. On a device they are first copied to
    /// the host and released, so that device memory holds them only for that copy, however
    /// long the write takes.
    fn save_into(self, store: &mut dyn Store) -> Result<SaveReport, CheckpointError> {
        if self.on_host() {
            return store.save(&self.contents());
        }
        let ckpt = self.to_host();
        drop(self);
        store.save(&ckpt.contents())
    }

    fn on_host(&self) -> bool {
        (self.model.iter().chain(&self.optimizer))
            .all(|t| crate::tensor::on_host_threads(&t.tensor.device()))
    }

    /// The files' contents, read from the staged tensors as they are written.
    pub fn contents(&self) -> Contents<'_> {
        Contents {
            step: self.step,
            model: self.model.iter().map(|t| t as &dyn Source).collect(),
            optimizer: self.optimizer.iter().map(|t| t as &dyn Source).collect(),
            state: &self.state,
            shards: &self.shards,
        }
    }

    /// The host copy the files are written from.
    pub fn to_host(&self) -> Checkpoint {
        Checkpoint {
            step: self.step,
            model: self.model.iter().map(DeviceTensor::to_host).collect(),
            optimizer: self.optimizer.iter().map(DeviceTensor::to_host).collect(),
            state: self.state.clone(),
            shards: self.shards.clone(),
        }
    }
}

/// A save that finished.
#[derive(Debug)]
pub struct Saved {
    /// The step saved.
    pub step: u64,
    /// What the manager did.
    pub report: SaveReport,
    /// Seconds the training step was blocked by this save (waiting for the previous save,
    /// staging the state, and for a synchronous save the host copy and the write).
    pub stall_s: f64,
    /// Seconds the save took (host copy, serialise, write, fsync, manifest, rename,
    /// retention).
    pub write_s: f64,
    /// Whether it was written on the writer thread.
    pub asynchronous: bool,
}

struct Job {
    staged: Staged,
    stall_s: f64,
}

type Outcome = Result<Saved, CheckpointError>;

/// Where a saver publishes checkpoints: atomically, verified by the reader, with its own
/// retention.
pub trait Store: Send {
    /// Publishes `ckpt` and applies retention.
    fn save(&mut self, ckpt: &Contents) -> Result<SaveReport, CheckpointError>;
}

impl Store for CheckpointStore {
    fn save(&mut self, ckpt: &Contents) -> Result<SaveReport, CheckpointError> {
        CheckpointStore::save(self, ckpt)
    }
}

type BoxedStore = Box<dyn Store>;

enum Mode {
    Sync(BoxedStore),
    Async {
        jobs: Option<Sender<Job>>,
        done: Receiver<Outcome>,
        thread: Option<JoinHandle<()>>,
        in_flight: bool,
    },
}

/// Writes checkpoints (see the module documentation).
pub struct Saver {
    mode: Mode,
}

impl Saver {
    /// A saver over `store`; `asynchronous` starts the writer thread, which yields the CPU
    /// to the step (see the module documentation).
    pub fn new(store: impl Store + 'static, asynchronous: bool) -> Self {
        Self::with_priority(store, asynchronous, true)
    }

    /// [`Saver::new`]; `yielding`: whether the writer thread runs at a lower priority (a
    /// tier that must keep up with the step, like the memory snapshots, does not).
    pub fn with_priority(store: impl Store + 'static, asynchronous: bool, yielding: bool) -> Self {
        let manager: BoxedStore = Box::new(store);
        if !asynchronous {
            return Self {
                mode: Mode::Sync(manager),
            };
        }
        let (jobs, inbox) = channel::<Job>();
        let (outbox, done) = channel::<Outcome>();
        // The store goes to the thread once it runs, so a failed spawn keeps it here.
        let (give, take) = channel::<BoxedStore>();
        let spawned = std::thread::Builder::new()
            .name("kiln-checkpoint-writer".into())
            .spawn(move || {
                if let Ok(manager) = take.recv() {
                    if yielding {
                        yield_to_the_step();
                    }
                    writer(manager, inbox, outbox);
                }
            });
        let handed = match spawned {
            Ok(handle) => give.send(manager).map(|()| handle).map_err(|e| e.0),
            Err(e) => {
                tracing::warn!(
                    "cannot start the checkpoint writer thread ({e}); saving synchronously"
                );
                Err(manager)
            }
        };
        match handed {
            Ok(handle) => Self {
                mode: Mode::Async {
                    jobs: Some(jobs),
                    done,
                    thread: Some(handle),
                    in_flight: false,
                },
            },
            Err(manager) => Self {
                mode: Mode::Sync(manager),
            },
        }
    }

    /// Saves `staged`, whose staging took `stage_s` seconds. A synchronous saver copies and
    /// writes it now; an asynchronous one first waits for the save in flight, then hands it
    /// to the writer. Returns the saves that finished meanwhile (the previous one, or this
    /// one when synchronous), for the caller to report.
    pub fn submit(&mut self, staged: Staged, stage_s: f64) -> Vec<Outcome> {
        let t0 = Instant::now();
        let copy_s = stage_s;
        match &mut self.mode {
            Mode::Sync(manager) => {
                let step = staged.step;
                let res = staged.save_into(manager.as_mut()).map(|report| {
                    let write_s = t0.elapsed().as_secs_f64();
                    Saved {
                        step,
                        report,
                        stall_s: copy_s + write_s,
                        write_s,
                        asynchronous: false,
                    }
                });
                vec![res]
            }
            Mode::Async { .. } => {
                let finished: Vec<Outcome> = self.wait().into_iter().collect();
                let Mode::Async {
                    jobs, in_flight, ..
                } = &mut self.mode
                else {
                    return finished;
                };
                let stall_s = copy_s + t0.elapsed().as_secs_f64();
                let sent = jobs
                    .as_ref()
                    .is_some_and(|tx| tx.send(Job { staged, stall_s }).is_ok());
                *in_flight = sent;
                let mut out = finished;
                if !sent {
                    out.push(Err(writer_gone()));
                }
                out
            }
        }
    }

    /// The finished save, if the one in flight is done (never blocks).
    pub fn poll(&mut self) -> Option<Outcome> {
        self.finished(false)
    }

    /// Waits for the save in flight, if any, and returns how it ended.
    pub fn wait(&mut self) -> Option<Outcome> {
        self.finished(true)
    }

    /// How the save in flight ended, waiting for it with `block`; `None` when none is in
    /// flight (or, without `block`, it is still running).
    fn finished(&mut self, block: bool) -> Option<Outcome> {
        let Mode::Async {
            done, in_flight, ..
        } = &mut self.mode
        else {
            return None;
        };
        if !*in_flight {
            return None;
        }
        let res = match (block, done.try_recv()) {
            (_, Ok(res)) => res,
            (false, Err(TryRecvError::Empty)) => return None,
            (true, Err(TryRecvError::Empty)) => done.recv().unwrap_or_else(|_| Err(writer_gone())),
            (_, Err(TryRecvError::Disconnected)) => Err(writer_gone()),
        };
        *in_flight = false;
        Some(res)
    }

    /// Whether a save is being written.
    pub fn in_flight(&self) -> bool {
        matches!(
            self.mode,
            Mode::Async {
                in_flight: true,
                ..
            }
        )
    }
}

impl Drop for Saver {
    fn drop(&mut self) {
        if let Mode::Async { jobs, thread, .. } = &mut self.mode {
            // Closing the queue ends the writer after the job it holds.
            drop(jobs.take());
            if let Some(t) = thread.take() {
                let _ = t.join();
            }
        }
    }
}

fn writer_gone() -> CheckpointError {
    CheckpointError::Io {
        path: std::path::PathBuf::from("<checkpoint writer thread>"),
        source: std::io::Error::other("the checkpoint writer thread ended unexpectedly"),
    }
}

/// Lowers the calling thread's scheduling priority (nice +10; Linux applies it to the
/// thread alone). Best effort: a refusal leaves the priority as it was.
fn yield_to_the_step() {
    // SAFETY: gettid and setpriority have no memory effects; PRIO_PROCESS with a thread id
    // changes only this thread's nice value on Linux.
    unsafe {
        let tid = libc::gettid();
        let _ = libc::setpriority(libc::PRIO_PROCESS, tid as libc::id_t, 10);
    }
}

/// The writer thread: one job at a time, each result sent back.
fn writer(mut manager: BoxedStore, inbox: Receiver<Job>, outbox: Sender<Outcome>) {
    for job in inbox {
        let t0 = Instant::now();
        let step = job.staged.step;
        let stall_s = job.stall_s;
        let res = job.staged.save_into(manager.as_mut()).map(|report| Saved {
            step,
            report,
            stall_s,
            write_s: t0.elapsed().as_secs_f64(),
            asynchronous: true,
        });
        if outbox.send(res).is_err() {
            return;
        }
    }
}

/// The checkpoint component (see the module documentation). Every rank holds one and calls
/// it at the same steps; only the writer rank's has a [`Saver`].
pub struct PersistentTier {
    every: Every,
    total: u64,
    /// The step of the newest checkpoint on disk (this process's save or its resume point).
    saved_at: Option<u64>,
    saver: Option<Saver>,
}

impl PersistentTier {
    /// Saves every `every` steps and at the last of `total`; `saver` on the writer rank.
    pub fn new(every: u64, total: u64, saver: Option<Saver>) -> Self {
        Self {
            every: Every(every),
            total,
            saved_at: None,
            saver,
        }
    }

    /// Whether to save after `step`: at the interval or the last step when a step was
    /// `applied`, and whenever the run is `stopping` with work not yet saved.
    pub fn due(&self, step: u64, applied: bool, stopping: bool) -> bool {
        (applied && self.every.due_or_last(step, self.total)) || (stopping && !self.saved(step))
    }

    /// Whether `step` is already on disk.
    pub fn saved(&self, step: u64) -> bool {
        self.saved_at == Some(step)
    }

    /// The step of the newest checkpoint on disk, if any.
    pub fn saved_at(&self) -> Option<u64> {
        self.saved_at
    }

    /// The run resumed from the checkpoint of `step`.
    pub fn restored(&mut self, step: u64) {
        self.saved_at = Some(step);
    }

    /// Saves the checkpoint of `step`: the writer rank stages `staged()` (references, no
    /// copy) and hands it to the saver, which with a save still in flight first waits for it.
    /// `before_s`: what the step already waited for this save (the replica check), counted
    /// in its stall.
    pub fn save(
        &mut self,
        step: u64,
        before_s: f64,
        staged: impl FnOnce() -> Staged,
        journal: &mut Journal,
    ) -> Result<(), TrainError> {
        if let Some(saver) = &mut self.saver {
            let t0 = Instant::now();
            let staged = staged();
            let finished = saver.submit(staged, before_s + t0.elapsed().as_secs_f64());
            for outcome in finished {
                report(outcome?, journal)?;
            }
        }
        self.saved_at = Some(step);
        Ok(())
    }

    /// Reports the save in flight if it has finished (never waits).
    pub fn poll(&mut self, journal: &mut Journal) -> Result<(), TrainError> {
        match self.saver.as_mut().and_then(Saver::poll) {
            Some(outcome) => report(outcome?, journal),
            None => Ok(()),
        }
    }

    /// Waits for the save in flight, if any, and reports it.
    pub fn wait(&mut self, journal: &mut Journal) -> Result<(), TrainError> {
        match self.saver.as_mut().and_then(Saver::wait) {
            Some(outcome) => report(outcome?, journal),
            None => Ok(()),
        }
    }
}

/// The `checkpoint_saved` event of a finished save: its step's stall (what the training step
/// waited for) and the write time.
fn report(saved: Saved, journal: &mut Journal) -> Result<(), TrainError> {
    let pruned: Vec<String> = saved.report.pruned.iter().map(|p| path_text(p)).collect();
    let superseded: Vec<String> = saved
        .report
        .superseded
        .iter()
        .map(|r| path_text(&r.moved_to))
        .collect();
    journal.emit(
        event::CHECKPOINT_SAVED,
        json!({"step": saved.step, "path": path_text(&saved.report.path),
               "stall_s": saved.stall_s, "write_s": saved.write_s, "seconds": saved.write_s,
               "async": saved.asynchronous, "pruned": pruned, "superseded": superseded}),
    )?;
    journal.note(&format!(
        "saved {} (step stalled {:.3} s, write {:.3} s)",
        saved.report.path.display(),
        saved.stall_s,
        saved.write_s
    ));
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::checkpoint::list_steps;
    use burn::tensor::Tensor;

    fn ckpt(step: u64) -> Staged {
        let d = burn::tensor::Device::flex();
        let t = |name: &str, v: [f32; 3]| DeviceTensor {
            name: name.into(),
            shape: vec![3],
            tensor: Tensor::from_floats(v, &d),
        };
        Staged {
            step,
            model: vec![t("w", [1.0, 2.0, step as f32])],
            optimizer: vec![t("w.exp_avg", [0.0; 3])],
            state: serde_json::json!({"step": step, "run_id": "r"}),
            shards: Vec::new(),
        }
    }

    #[test]
    fn async_saves_publish_in_order_one_at_a_time_and_drop_waits() {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path().join("checkpoints");
        let opened = CheckpointStore::open(&root, 2, true, "r").unwrap();
        let mut saver = Saver::new(opened.manager, true);
        let mut finished = Vec::new();
        for step in [1, 2, 3] {
            finished.extend(saver.submit(ckpt(step), 0.0));
            // The previous save is done before the next is handed over.
            assert!(saver.in_flight());
        }
        finished.extend(saver.wait());
        assert!(!saver.in_flight());
        let steps: Vec<u64> = finished.iter().map(|r| r.as_ref().unwrap().step).collect();
        assert_eq!(steps, [1, 2, 3]);
        for r in &finished {
            let s = r.as_ref().unwrap();
            assert!(s.asynchronous && s.write_s >= 0.0 && s.stall_s >= 0.0);
        }
        // Retention ran on the writer thread.
        assert_eq!(list_steps(&root), [3, 2]);
        // Dropping with a save in flight finishes it.
        saver.submit(ckpt(4), 0.0);
        drop(saver);
        assert_eq!(list_steps(&root), [4, 3]);
    }

    #[test]
    fn a_synchronous_saver_writes_before_returning() {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path().join("checkpoints");
        let opened = CheckpointStore::open(&root, 2, true, "r").unwrap();
        let mut saver = Saver::new(opened.manager, false);
        let done = saver.submit(ckpt(7), 0.25);
        assert_eq!(list_steps(&root), [7]);
        let s = done[0].as_ref().unwrap();
        assert!(!s.asynchronous && s.stall_s >= 0.25 && s.stall_s >= s.write_s);
        assert!(saver.wait().is_none());
    }
}

//! kiln's trainer: a Llama-style decoder trained with AdamW, Muon or SophiaG on burn, in f32
//! or bf16, with exact checkpoint/resume, data parallelism over MPI, metrics, and in-run
//! guards.
//!
//! Layout (torchtitan-like): [`config`] (the TOML sections), [`model`] (parameters and the
//! forward pass), [`optim`] (AdamW, Muon and SophiaG behind one seam, clipping, LR
//! schedules), [`data`] (token sources), [`kernels`] (fused CPU kernels with their backward passes), [`synthetic`] (the
//! built-in corpus), [`budget`]
//! (memory and threads checked before allocating), [`session`] (a model and its
//! parameters), [`state`] (the exact-resume state), [`step`] (the arithmetic of a step and
//! the batch layout over ranks), [`checkpoint`] (atomic, verified checkpoints and
//! retention), [`saver`] (synchronous or background checkpoint writing), [`run_dir`] (the
//! locked run directory), [`guards`] (spike and sanity checks), [`metrics`] (what a run
//! reports) and [`trainer`] (the step loop).

pub mod budget;
pub mod checkpoint;
pub mod config;
pub mod data;
pub mod guards;
pub mod kernels;
pub mod metrics;
pub mod model;
pub mod optim;
pub mod run_dir;
pub mod saver;
pub mod session;
pub mod state;
pub mod step;
pub mod synthetic;
pub mod trainer;

pub use config::Config;
pub use metrics::{EvalMetrics, Observer, Silent, StepMetrics};
pub use session::Session;
pub use state::TrainState;
pub use trainer::{Outcome, TrainError, TrainOptions, TrainReport, Trainer, train};

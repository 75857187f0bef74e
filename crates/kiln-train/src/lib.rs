//! kiln's trainer: a Llama-style decoder trained with AdamW, Muon or SophiaG on burn, in f32
//! or bf16, with exact checkpoint/resume, data parallelism over MPI, metrics, and in-run
//! guards.
//!
//! Layout (torchtitan-like), from the leaves up:
//! - leaves, importing none of the rest: [`error`] (what stops training, and its exit code),
//!   [`tensor`] (host copies, named device tensors, checksums), [`cadence`] ("every N
//!   steps"), [`config`] (the TOML sections), [`checkpoint`] (atomic, verified checkpoints
//!   and retention), [`run_dir`] (the locked run directory), [`guards`] (spike and sanity
//!   checks without tensors), [`synthetic`] (the built-in corpus);
//! - the model: [`model`] (parameters and the forward pass), [`kernels`] (fused CPU kernels
//!   with their backward passes), [`optim`] (AdamW, Muon and SophiaG behind one seam,
//!   clipping, LR schedules), [`budget`] (memory and threads checked before allocating),
//!   [`session`] (a model and its parameters), [`data`] (token sources), [`state`] (the
//!   exact-resume state), [`metrics`] (what a run reports, and the [`Observer`]);
//! - the step: [`step`] (the one training step every driver calls, and the batch layout
//!   over ranks), [`shard`] (sharded data parallelism: a rank's range of the state and its
//!   collectives), [`stagewise`] (the forward and backward pass stage by stage, each stage's
//!   weights gathered when used: the parameter-sharded pass), [`faults`] (the debug fault
//!   hooks, behind one seam the step calls);
//! - the components, each deciding its own cadence and restoring its own state: [`journal`]
//!   (events, metrics and the observer), [`saver`] (checkpoints: when, and synchronous or
//!   background writing), [`snapshot`] (the memory tier: node-local snapshots every few
//!   steps, agreed on and healed from a peer at restart), [`guard_rail`] (skips, rollbacks, snapshots, frozen parameters),
//!   [`eval`] (held-out evaluation), [`replicas`] (the replica checksum check);
//! - [`trainer`] (the step loop that calls them in order).

pub mod budget;
pub mod cadence;
pub mod checkpoint;
pub mod config;
pub mod data;
pub mod error;
pub mod eval;
pub mod faults;
pub mod guard_rail;
pub mod guards;
pub mod journal;
pub mod kernels;
pub mod metrics;
pub mod model;
pub mod nccl;
pub mod optim;
pub mod replicas;
pub mod run_dir;
pub mod saver;
pub mod session;
pub mod shard;
pub mod snapshot;
pub mod stagewise;
pub mod startup;
pub mod state;
pub mod step;
pub mod synthetic;
pub mod tensor;
pub mod trainer;

pub use config::Config;
pub use error::TrainError;
pub use metrics::{EvalMetrics, Observer, Silent, StepMetrics};
pub use session::Session;
pub use state::TrainState;
pub use trainer::{Outcome, TrainOptions, TrainReport, Trainer, train};

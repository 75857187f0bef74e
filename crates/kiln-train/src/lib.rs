//! kiln's trainer: a Llama-style decoder trained with AdamW, Muon or SophiaG on burn, in f32
//! or bf16, with exact checkpoint/resume, data parallelism over MPI, metrics, and in-run
//! guards.
//!
//! Layout (torchtitan-like), from the leaves up; the folders say it:
//! - leaves, importing none of the rest: [`error`] (what stops training, and its exit code),
//!   [`cadence`] ("every N steps"), [`config`] (the TOML sections), [`checkpoint`] (the
//!   on-disk format: atomic, verified checkpoints, shards and retention), [`run_dir`] (the
//!   locked run directory), [`loss_checks`] (the guard rail's spike and first-loss checks,
//!   without tensors), and [`tensor`] (host copies, named device tensors, checksums);
//!   [`mesh`] (the ranks of the job as one device mesh, built once, and the `parallelism`
//!   section it is built from); [`budget`] (admission control: the memory of host and
//!   device and the threads, checked before anything is allocated);
//! - [`kernels`]: the fused kernels, CPU and CubeCL, with their backward passes;
//! - [`model`]: the model (parameters and the forward pass), its [`model::session`] (a model
//!   and its parameters on a device); [`optim`] (AdamW, Muon and SophiaG behind one seam, clipping, LR
//!   schedules); [`data`] (token sources, the built-in corpus);
//! - [`state`]: the run's one owned state ([`state::RunState`]) and the exact-resume
//!   [`TrainState`];
//! - [`parallel`]: what drives the model over the mesh, one module a dimension: tensor
//!   parallelism, sharded data parallelism's machinery (the shard plan and its collectives,
//!   the stage-by-stage pass, NCCL);
//! - [`step`]: the one training step every driver calls: the local pass, the gradient
//!   exchange chosen once per run, the batch layout over ranks, the debug faults;
//! - [`components`]: each deciding its own cadence and restoring its own state: the journal
//!   and metrics, the checkpoint lifecycle (persistent tier, memory tier, resume), the guard
//!   rail, eval, the replica check;
//! - [`trainer`]: the step loop that calls them in order.

pub mod budget;
pub mod cadence;
pub mod checkpoint;
pub mod components;
pub mod config;
pub mod data;
pub mod error;
pub mod kernels;
pub mod loss_checks;
pub mod mesh;
pub mod model;
pub mod optim;
pub mod parallel;
pub mod run_dir;
pub mod state;
pub mod step;
pub mod tensor;
pub mod trainer;

pub use components::metrics::{EvalMetrics, Observer, Silent, StepMetrics};
pub use config::Config;
pub use error::TrainError;
pub use model::session::Session;
pub use state::TrainState;
pub use trainer::{Outcome, TrainOptions, TrainReport, train};

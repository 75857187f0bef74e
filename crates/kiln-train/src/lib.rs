//! kiln's trainer: a Llama-style decoder trained with AdamW on burn, with exact
//! checkpoint/resume, metrics, and in-run guards.
//!
//! Layout (torchtitan-like): [`config`] (the TOML sections), [`model`] (parameters and the
//! forward pass), [`optim`] (AdamW, clipping, LR schedules), [`data`] (token sources),
//! [`synthetic`] (the built-in corpus), [`budget`] (memory and threads checked before
//! allocating), [`checkpoint`] (atomic, verified checkpoints),
//! [`guards`] (spike and sanity checks) and [`trainer`] (the step loop).

pub mod budget;
pub mod checkpoint;
pub mod config;
pub mod data;
pub mod guards;
pub mod model;
pub mod optim;
pub mod synthetic;
pub mod trainer;

pub use config::Config;
pub use trainer::{
    EvalMetrics, Observer, Outcome, Session, StepMetrics, TrainError, TrainOptions, TrainReport,
    train,
};

//! [`TrainError`]: everything that stops training, and the exit code each one means. A leaf:
//! every other module of the trainer may return it, and it imports none of them but the
//! lower-level error types it wraps.

use crate::checkpoint;
use crate::run_dir::RunDirError;
use kiln_run::exit;
use std::path::{Path, PathBuf};

/// Errors that stop training.
#[derive(Debug, thiserror::Error)]
pub enum TrainError {
    /// Bad config.
    #[error(transparent)]
    Config(#[from] crate::config::ConfigError),
    /// Checkpoint write/read failure.
    #[error(transparent)]
    Checkpoint(#[from] checkpoint::CheckpointError),
    /// The run directory is locked or unwritable.
    #[error(transparent)]
    RunDir(#[from] RunDirError),
    /// Run-directory I/O.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The cause.
        source: std::io::Error,
    },
    /// Event log failure.
    #[error(transparent)]
    Events(#[from] kiln_run::EventLogError),
    /// The data could not be opened, does not fit the model, or a sample turned out to be
    /// damaged during training: deterministic, so never worth a retry.
    #[error("data: {0}")]
    Data(String),
    /// Reading a sample failed during training (an I/O error: perhaps transient, worth a retry; the
    /// launcher stops retrying when the same error repeats).
    #[error("data: {0}")]
    DataRead(String),
    /// The device named in the config is unknown or not compiled in.
    #[error("device {0:?}: {1}")]
    Device(String, String),
    /// The collectives between ranks could not be set up.
    #[error(transparent)]
    Dist(#[from] kiln_dist::DistError),
    /// The rank environment or the ranks' configs disagree.
    #[error("data-parallel setup: {0}")]
    Parallel(String),
    /// The newest checkpoint cannot be resumed with this config.
    #[error("cannot resume from {path}: {reason}")]
    ResumeMismatch {
        /// The checkpoint.
        path: PathBuf,
        /// What differs.
        reason: String,
    },
    /// The Hugging Face weights of `model.init_from` cannot be loaded.
    #[error("model.init_from: {0}")]
    Import(#[from] crate::config::hf_config::HfError),
    /// A guard stopped the run.
    #[error("guard: {0}")]
    Guard(String),
    /// A collective between the ranks' devices failed during training (NCCL): perhaps a peer
    /// was lost, worth a retry.
    #[error("device collective: {0}")]
    Collective(String),
    /// Data-parallel replicas disagree on their parameters.
    #[error(
        "replica mismatch after step {step}: the parameters of rank(s) {ranks:?} differ from the other ranks' (silent data corruption or a desynced rank); stopped before saving them"
    )]
    ReplicaMismatch {
        /// The step checked.
        step: u64,
        /// The ranks that differ from the majority.
        ranks: Vec<usize>,
    },
}

impl From<crate::mesh::MeshError> for TrainError {
    /// A layout that does not fit the job is a config error, as the rank environment's;
    /// the collectives' errors keep their own.
    fn from(e: crate::mesh::MeshError) -> Self {
        use crate::mesh::MeshError;
        match e {
            MeshError::Dist(e) => Self::Dist(e),
            MeshError::Layout(_) | MeshError::RankEnv(_) => Self::Parallel(e.to_string()),
        }
    }
}

impl exit::ExitCoded for TrainError {
    fn exit_code(&self) -> i32 {
        TrainError::exit_code(self)
    }
}

impl TrainError {
    /// The process exit code for this error ([`kiln_run::exit`]): deterministic input
    /// errors are told apart from ones worth a retry.
    pub fn exit_code(&self) -> i32 {
        match self {
            Self::Config(_)
            | Self::Device(..)
            | Self::ResumeMismatch { .. }
            | Self::Data(_)
            | Self::Parallel(_) => exit::CONFIG,
            Self::Dist(kiln_dist::DistError::Init(_)) => exit::FAILURE,
            Self::Dist(_) => exit::CONFIG,
            Self::Import(e) => e.exit_code(),
            Self::Guard(_) => exit::GUARD_STOP,
            Self::RunDir(RunDirError::Locked { .. }) => exit::RUN_DIR_LOCKED,
            Self::ReplicaMismatch { .. } => exit::REPLICA_MISMATCH,
            Self::RunDir(_)
            | Self::Io { .. }
            | Self::Events(_)
            | Self::Checkpoint(_)
            | Self::Collective(_)
            | Self::DataRead(_) => exit::FAILURE,
        }
    }

    /// Whether every rank reaches this error at the same point (decided from all-reduced
    /// values), so that no rank is left waiting in a collective.
    pub fn is_collective(&self) -> bool {
        matches!(
            self,
            Self::Guard(_) | Self::ReplicaMismatch { .. } | Self::Parallel(_)
        )
    }
}

pub(crate) fn io(path: &Path) -> impl FnOnce(std::io::Error) -> TrainError + '_ {
    move |source| TrainError::Io {
        path: path.to_path_buf(),
        source,
    }
}

//! Why a checkpoint could not be saved or loaded.

use std::path::{Path, PathBuf};

/// Errors saving or loading checkpoints.
#[derive(Debug, thiserror::Error)]
pub enum CheckpointError {
    /// Filesystem error.
    #[error("checkpoint {path}: {source}")]
    Io {
        /// The file or directory.
        path: PathBuf,
        /// The cause.
        source: std::io::Error,
    },
    /// The checkpoint is incomplete or does not match its manifest.
    #[error("checkpoint {path}: {reason}")]
    Invalid {
        /// The checkpoint directory or file.
        path: PathBuf,
        /// What is wrong.
        reason: String,
    },
}

pub(super) fn invalid(path: &Path, reason: impl Into<String>) -> CheckpointError {
    CheckpointError::Invalid {
        path: path.to_path_buf(),
        reason: reason.into(),
    }
}

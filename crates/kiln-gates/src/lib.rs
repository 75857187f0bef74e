//! Correctness gates: the bit-exact smoke gate ([`smoke`]), the LR finder ([`lrfind`]),
//! multiple-choice and held-out eval ([`mc`]), the Hugging Face export ([`export`]), and run
//! reports ([`report`]: status and plots of a run directory).
//!
//! Everything here is a library so the CLI (`kiln smoke`, `lr-find`, `eval`, `status`,
//! `plot`) stays thin and the trainer can call the same eval ([`mc::score_multiple_choice`]).

pub mod export;
pub mod lrfind;
pub mod mc;
pub mod merge;
pub mod plot;
pub mod recovery;
pub mod report;
pub mod smoke;

use kiln_run::{EventLogError, exit};
use kiln_train::checkpoint::CheckpointError;
use std::path::PathBuf;

/// Errors of the gates.
#[derive(Debug, thiserror::Error)]
pub enum GatesError {
    /// A file could not be read or written.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The cause.
        source: std::io::Error,
    },
    /// A file is malformed; `line` is 1-based, 0 when the whole file is at fault.
    #[error("{}: {message}", location(path, *line))]
    Parse {
        /// The file.
        path: PathBuf,
        /// 1-based line number (0: the whole file).
        line: usize,
        /// What is wrong and how to fix it.
        message: String,
    },
    /// The trainer failed (config, checkpoint, data).
    #[error(transparent)]
    Train(#[from] kiln_train::TrainError),
    /// Reading a checkpoint failed.
    #[error(transparent)]
    Checkpoint(#[from] kiln_train::checkpoint::CheckpointError),
    /// The event log is unreadable.
    #[error(transparent)]
    Events(#[from] kiln_run::EventLogError),
    /// Drawing a plot failed.
    #[error("plot {path}: {message}")]
    Plot {
        /// The output file.
        path: PathBuf,
        /// What failed.
        message: String,
    },
    /// A flag value out of its domain (the message names the flag and what is allowed).
    #[error("{0}")]
    Usage(String),
    /// Anything else in the input that makes the request impossible (the message says why).
    #[error("{0}")]
    Invalid(String),
}

impl exit::ExitCoded for GatesError {
    /// Input that is wrong (a malformed file, a checkpoint that does not verify, a request
    /// that cannot be met) is deterministic and exits [`exit::CONFIG`]; a bad flag value
    /// [`exit::USAGE`]; reading or writing that failed [`exit::FAILURE`], worth a retry; the
    /// trainer's errors keep their own codes.
    fn exit_code(&self) -> i32 {
        match self {
            Self::Io { .. } | Self::Plot { .. } => exit::FAILURE,
            Self::Parse { .. } | Self::Invalid(_) => exit::CONFIG,
            Self::Usage(_) => exit::USAGE,
            Self::Train(e) => e.exit_code(),
            Self::Checkpoint(CheckpointError::Io { .. }) => exit::FAILURE,
            Self::Checkpoint(CheckpointError::Invalid { .. }) => exit::CONFIG,
            Self::Events(EventLogError::Io { .. }) => exit::FAILURE,
            Self::Events(EventLogError::Parse { .. }) => exit::CONFIG,
        }
    }
}

fn location(path: &std::path::Path, line: usize) -> String {
    if line == 0 {
        path.display().to_string()
    } else {
        format!("{} line {line}", path.display())
    }
}

/// Shorthand for an I/O error naming `path`.
pub(crate) fn io_err(path: &std::path::Path) -> impl FnOnce(std::io::Error) -> GatesError + '_ {
    move |source| GatesError::Io {
        path: path.to_path_buf(),
        source,
    }
}

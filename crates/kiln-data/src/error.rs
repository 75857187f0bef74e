//! The data layer's single error type. Every variant names the file (and line, where there is
//! one) so that an operator can fix the input without reading code.

use std::path::{Path, PathBuf};

/// Everything that can go wrong in the data layer.
#[derive(Debug, thiserror::Error)]
pub enum DataError {
    /// An I/O error on a named file.
    // The I/O error is part of the message and deliberately not a `source`: printing the
    // chain (`{:#}`) would repeat it.
    #[error("{}: {error}", path.display())]
    Io {
        path: PathBuf,
        error: std::io::Error,
    },
    /// A `.idx` or `.bin` file that is not a valid Megatron indexed dataset.
    #[error("{}: {reason}", path.display())]
    Format { path: PathBuf, reason: String },
    /// A bad line in a corpus list.
    #[error("{}:{line}: {reason}", path.display())]
    ListLine {
        path: PathBuf,
        line: usize,
        reason: String,
    },
    /// A bad record (line) of an input file being tokenized: its line and the byte offset
    /// in the file where that line starts.
    #[error("{}:{line}: {reason} (line {line} starts at byte {offset})", path.display())]
    Record {
        path: PathBuf,
        line: usize,
        offset: u64,
        reason: String,
    },
    /// A corpus list that is bad as a whole (empty, all weights zero, ...).
    #[error("{}: {reason}", path.display())]
    List { path: PathBuf, reason: String },
    /// A shard whose bytes differ from what the manifest pinned.
    #[error(
        "{}: shard changed since it was pinned in {} ({reason}); if the change is intended, re-pin with `kiln data manifest`",
        path.display(),
        manifest.display()
    )]
    ShardChanged {
        path: PathBuf,
        manifest: PathBuf,
        reason: String,
    },
    /// A tokenizer file that cannot be loaded, or tokenization that failed.
    #[error("{}: {reason}", path.display())]
    Tokenizer { path: PathBuf, reason: String },
    /// A request the loader cannot serve (out of range, bad configuration).
    #[error("{0}")]
    Invalid(String),
}

/// The exit code of each error, from kiln's table ([`kiln_run::exit`]): the input is wrong
/// (a bad record, list, shard, tokenizer, or a file that is missing or unreadable as named):
/// [`exit::CONFIG`], fix it and do not retry; other I/O (a full disk, a network file system
/// that went away): [`exit::FAILURE`], which may be transient.
impl kiln_run::exit::ExitCoded for DataError {
    fn exit_code(&self) -> i32 {
        DataError::exit_code(self)
    }
}

impl DataError {
    /// The process exit code for this error (see the [`kiln_run::exit::ExitCoded`] impl).
    pub fn exit_code(&self) -> i32 {
        use kiln_run::exit;
        use std::io::ErrorKind as K;
        match self {
            DataError::Io { error, .. } => match error.kind() {
                K::NotFound
                | K::PermissionDenied
                | K::InvalidData
                | K::InvalidInput
                | K::IsADirectory
                | K::NotADirectory
                | K::UnexpectedEof => exit::CONFIG,
                _ => exit::FAILURE,
            },
            DataError::Format { .. }
            | DataError::ListLine { .. }
            | DataError::Record { .. }
            | DataError::List { .. }
            | DataError::ShardChanged { .. }
            | DataError::Tokenizer { .. }
            | DataError::Invalid(_) => exit::CONFIG,
        }
    }

    pub(crate) fn io(path: &Path, source: std::io::Error) -> Self {
        DataError::Io {
            path: path.to_path_buf(),
            error: source,
        }
    }

    pub(crate) fn format(path: &Path, reason: impl Into<String>) -> Self {
        DataError::Format {
            path: path.to_path_buf(),
            reason: reason.into(),
        }
    }

    pub(crate) fn record(path: &Path, line: usize, offset: u64, reason: impl Into<String>) -> Self {
        DataError::Record {
            path: path.to_path_buf(),
            line,
            offset,
            reason: reason.into(),
        }
    }

    pub(crate) fn line(path: &Path, line: usize, reason: impl Into<String>) -> Self {
        DataError::ListLine {
            path: path.to_path_buf(),
            line,
            reason: reason.into(),
        }
    }
}

/// Limits on files read whole whose names come from other files (see [`kiln_run::files`]):
/// far above any real one, far below what would exhaust memory.
pub mod limits {
    use kiln_run::files::MIB;
    /// A corpus list.
    pub const CORPUS_LIST: u64 = 64 * MIB;
    /// A shard manifest.
    pub const MANIFEST: u64 = 256 * MIB;
    /// A dataset's `PREFIX.kiln.json` sidecar.
    pub const SIDECAR: u64 = MIB;
    /// A `tokenizer.json` (the largest public ones are tens of MiB).
    pub const TOKENIZER: u64 = 1024 * MIB;
    /// A blend schedule (`--schedule`).
    pub const SCHEDULE: u64 = 64 * MIB;
}

/// Shorthand used throughout the crate.
pub type Result<T, E = DataError> = std::result::Result<T, E>;

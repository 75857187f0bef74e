//! One module per verb family; each owns its clap argument structs and a `run`-like entry.
//! Here: what the verbs share, the refusals of their own checks ([`CliError`]) and the
//! process exit code ([`exit_code`]).

pub mod data;
pub mod export;
pub mod gates;
pub mod help;
pub mod launch;
pub mod merge;
pub mod submit;
pub mod train;
pub mod yeet;

use kiln_run::exit;
use std::process::ExitCode;

/// What a verb's own checks refuse: flags and inputs only the command line sees (a flag
/// value out of its domain, flags that do not go together, a file read here), with the exit
/// code kiln ends with for it. `main` maps it as it maps every library error.
#[derive(Debug, thiserror::Error)]
pub enum CliError {
    /// A bad flag value or combination; nothing ran (exit [`exit::USAGE`]).
    #[error("{0}")]
    Usage(String),
    /// An input file is invalid: fix it, do not retry (exit [`exit::CONFIG`]).
    #[error("{0}")]
    Invalid(String),
}

impl exit::ExitCoded for CliError {
    fn exit_code(&self) -> i32 {
        match self {
            CliError::Usage(_) => exit::USAGE,
            CliError::Invalid(_) => exit::CONFIG,
        }
    }
}

/// A usage error (exit 2) saying `message`.
pub fn usage(message: impl Into<String>) -> anyhow::Error {
    CliError::Usage(message.into()).into()
}

/// An invalid-input error (exit 78) saying `message`.
pub fn invalid(message: impl Into<String>) -> anyhow::Error {
    CliError::Invalid(message.into()).into()
}

/// The process exit status for `code` (one of [`kiln_run::exit`]'s, or a program's own);
/// a code that does not fit in a byte ends kiln with 1.
pub fn exit_code(code: i32) -> ExitCode {
    ExitCode::from(u8::try_from(code).unwrap_or(1))
}

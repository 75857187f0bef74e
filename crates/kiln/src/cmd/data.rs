//! `kiln data ...` (scaffold: filled by the data-layer work).
use std::process::ExitCode;

/// Token data verbs.
#[derive(Debug, clap::Subcommand)]
pub enum DataCommand {
    /// Print a dataset's statistics.
    Inspect {
        /// Dataset prefix (without .bin/.idx).
        prefix: String,
    },
}

pub fn run(_command: DataCommand) -> anyhow::Result<ExitCode> {
    anyhow::bail!("kiln data is not built yet")
}

//! `kiln launch` and `kiln doctor` (scaffold: filled by the process-scope work).
use std::process::ExitCode;

/// Arguments of `kiln launch`.
#[derive(Debug, clap::Args)]
pub struct LaunchArgs {
    /// The program and its arguments.
    #[arg(last = true)]
    pub command: Vec<String>,
}

/// Arguments of `kiln doctor`.
#[derive(Debug, clap::Args)]
pub struct DoctorArgs {}

pub fn run(_args: LaunchArgs) -> anyhow::Result<ExitCode> {
    anyhow::bail!("kiln launch is not built yet")
}

pub fn doctor(_args: DoctorArgs) -> anyhow::Result<ExitCode> {
    anyhow::bail!("kiln doctor is not built yet")
}

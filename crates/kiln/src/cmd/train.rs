//! `kiln train` (scaffold).
use std::process::ExitCode;

#[derive(Debug, clap::Args)]
pub struct TrainArgs {}

pub fn run(_a: TrainArgs) -> anyhow::Result<ExitCode> {
    anyhow::bail!("not built yet")
}

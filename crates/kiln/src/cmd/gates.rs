//! `kiln smoke`, `lr-find`, `eval`, `status`, `plot` (scaffold: filled by the gates work).
use std::process::ExitCode;

#[derive(Debug, clap::Args)]
pub struct SmokeArgs {}
#[derive(Debug, clap::Args)]
pub struct LrFindArgs {}
#[derive(Debug, clap::Args)]
pub struct EvalArgs {}
#[derive(Debug, clap::Args)]
pub struct StatusArgs {}
#[derive(Debug, clap::Args)]
pub struct PlotArgs {}

pub fn smoke(_a: SmokeArgs) -> anyhow::Result<ExitCode> {
    anyhow::bail!("not built yet")
}
pub fn lr_find(_a: LrFindArgs) -> anyhow::Result<ExitCode> {
    anyhow::bail!("not built yet")
}
pub fn eval(_a: EvalArgs) -> anyhow::Result<ExitCode> {
    anyhow::bail!("not built yet")
}
pub fn status(_a: StatusArgs) -> anyhow::Result<ExitCode> {
    anyhow::bail!("not built yet")
}
pub fn plot(_a: PlotArgs) -> anyhow::Result<ExitCode> {
    anyhow::bail!("not built yet")
}

//! `kiln`: the command line. Thin by design: every verb parses its flags here and calls a
//! library crate, so that tests can reach all logic without the binary.

mod cmd;

use clap::{Parser, Subcommand};
use std::process::ExitCode;

/// LLM pre-training that survives failure.
///
/// kiln launches a training job on any cluster (PBS, Slurm or none), watches it, recovers it,
/// feeds it blended data deterministically, trains a Llama-style model, checkpoints it safely
/// and proves with gates that it is still learning.
#[derive(Debug, Parser)]
#[command(name = "kiln", version, about, long_about, propagate_version = true)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Train a model (default: a small Llama on the built-in synthetic copy corpus).
    Train(cmd::train::TrainArgs),
    /// Run any program on every rank of the allocation, watch its progress and recover it.
    Launch(cmd::launch::LaunchArgs),
    /// Print the detected scheduler, hosts, accelerators and rank environment, and why.
    Doctor(cmd::launch::DoctorArgs),
    /// Token data: train a tokenizer, tokenize, blend, inspect, pin shards in a manifest.
    #[command(subcommand)]
    Data(cmd::data::DataCommand),
    /// Bit-exact smoke gate: run N deterministic steps and compare with a stored baseline.
    Smoke(cmd::gates::SmokeArgs),
    /// Learning-rate finder: exponential LR sweep with a suggested LR and a plot.
    LrFind(cmd::gates::LrFindArgs),
    /// Held-out loss and multiple-choice accuracy of a checkpoint.
    Eval(cmd::gates::EvalArgs),
    /// A short text summary of a run: steps, tokens, last loss, checkpoints, events.
    Status(cmd::gates::StatusArgs),
    /// Plot a run's curves (loss, eval, LR, grad-norm, tokens/s) as SVG and PNG.
    Plot(cmd::gates::PlotArgs),
    /// Put a file, directory or tarball on every node's local disk over MPI broadcast.
    Yeet(cmd::yeet::YeetArgs),
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("KILN_LOG")
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
        )
        .with_writer(std::io::stderr)
        .init();
    let result = match cli.command {
        Command::Train(args) => cmd::train::run(args),
        Command::Launch(args) => cmd::launch::run(args),
        Command::Doctor(args) => cmd::launch::doctor(args),
        Command::Data(command) => cmd::data::run(command),
        Command::Smoke(args) => cmd::gates::smoke(args),
        Command::LrFind(args) => cmd::gates::lr_find(args),
        Command::Eval(args) => cmd::gates::eval(args),
        Command::Status(args) => cmd::gates::status(args),
        Command::Plot(args) => cmd::gates::plot(args),
        Command::Yeet(args) => cmd::yeet::run(args),
    };
    match result {
        Ok(code) => code,
        Err(err) => {
            eprintln!("kiln: error: {err:#}");
            ExitCode::FAILURE
        }
    }
}

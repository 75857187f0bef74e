//! `kiln`: the command line. Thin by design: every verb parses its flags here and calls a
//! library crate, so that tests can reach all logic without the binary.

mod cmd;

use clap::{Parser, Subcommand};
use std::io::IsTerminal;
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
    /// Write a PBS/Slurm batch script that runs `kiln launch` with spares, stops before the
    /// walltime and resubmits itself until the run completes; submit it.
    Submit(cmd::submit::SubmitArgs),
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
    /// Write a run's or checkpoint's weights as a Hugging Face Llama directory.
    Export(cmd::export::ExportArgs),
    /// Average the weights of checkpoints of one run (uniform or weighted).
    Merge(cmd::merge::MergeArgs),
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
        .with_ansi(use_color(
            std::io::stderr().is_terminal(),
            std::env::var_os("NO_COLOR").as_deref(),
        ))
        .init();
    let result = match cli.command {
        Command::Train(args) => cmd::train::run(args),
        Command::Launch(args) => cmd::launch::run(args),
        Command::Submit(args) => cmd::submit::run(args),
        Command::Doctor(args) => cmd::launch::doctor(args),
        Command::Data(command) => cmd::data::run(command),
        Command::Smoke(args) => cmd::gates::smoke(args),
        Command::LrFind(args) => cmd::gates::lr_find(args),
        Command::Eval(args) => cmd::gates::eval(args),
        Command::Export(args) => cmd::export::run(args),
        Command::Merge(args) => cmd::merge::run(args),
        Command::Status(args) => cmd::gates::status(args),
        Command::Plot(args) => cmd::gates::plot(args),
        Command::Yeet(args) => cmd::yeet::run(args),
    };
    match result {
        Ok(code) => code,
        Err(err) => {
            eprintln!("kiln: error: {}", render_error(&err));
            cmd::exit_code(exit_code_of(&err))
        }
    }
}

/// The exit code an error ends kiln with: that of the first error in its chain that knows
/// one ([`kiln_run::exit::ExitCoded`]), else 1. The one place errors become exit codes.
fn exit_code_of(err: &anyhow::Error) -> i32 {
    use kiln_run::exit::ExitCoded;
    fn coded<T: ExitCoded + std::error::Error + Send + Sync + 'static>(
        cause: &(dyn std::error::Error + 'static),
    ) -> Option<i32> {
        cause.downcast_ref::<T>().map(ExitCoded::exit_code)
    }
    err.chain()
        .find_map(|cause| {
            coded::<kiln_train::TrainError>(cause)
                .or_else(|| coded::<kiln_train::config::ConfigError>(cause))
                .or_else(|| coded::<kiln_launch::LaunchError>(cause))
                .or_else(|| coded::<kiln_launch::SubmitError>(cause))
                .or_else(|| coded::<kiln_data::yeet::YeetError>(cause))
                .or_else(|| coded::<kiln_gates::GatesError>(cause))
                .or_else(|| coded::<kiln_data::DataError>(cause))
                .or_else(|| coded::<cmd::CliError>(cause))
        })
        .unwrap_or(kiln_run::exit::FAILURE)
}

/// Colour in log lines only on a terminal, and never when `NO_COLOR` is set to anything
/// non-empty (<https://no-color.org>): escape codes in a pipe or a log file are noise.
fn use_color(stderr_is_terminal: bool, no_color: Option<&std::ffi::OsStr>) -> bool {
    stderr_is_terminal && no_color.is_none_or(|v| v.is_empty())
}

/// An error and its causes on one line, `outer: inner: root`, each said once.
///
/// The one rule for error output: messages may include their cause's text (kiln's error
/// types do, so that `to_string()` alone is complete), and this printer, the only place
/// that prints a chain, leaves out a cause whose text the line already holds. Library
/// errors that both print their cause and return it from `source()` (as thiserror does
/// for a field named `source`) are then said once, whichever crate they come from.
fn render_error(err: &anyhow::Error) -> String {
    let mut line = String::new();
    for cause in err.chain() {
        let text = cause.to_string();
        if text.is_empty() || line.contains(&text) {
            continue;
        }
        if !line.is_empty() {
            line.push_str(": ");
        }
        line.push_str(&text);
    }
    line
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What `#[derive(thiserror::Error)]` makes of `#[error("{path}: {source}")]` with a
    /// field named `source`: the cause in the message and in `source()`.
    #[derive(Debug)]
    struct PathError {
        path: String,
        source: std::io::Error,
    }
    impl std::fmt::Display for PathError {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            write!(f, "{}: {}", self.path, self.source)
        }
    }
    impl std::error::Error for PathError {
        fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
            Some(&self.source)
        }
    }

    #[test]
    fn each_cause_is_said_once() {
        let enospc = std::io::Error::from_raw_os_error(28);
        let err = anyhow::Error::new(PathError {
            path: "out.csv".into(),
            source: enospc,
        })
        .context("writing the results");
        let text = render_error(&err);
        assert_eq!(
            text,
            format!(
                "writing the results: out.csv: {}",
                std::io::Error::from_raw_os_error(28)
            )
        );
        assert_eq!(text.matches("os error 28").count(), 1, "{text}");
        // A cause not yet said is kept.
        let err = anyhow::Error::new(std::io::Error::other("disk gone")).context("saving");
        assert_eq!(render_error(&err), "saving: disk gone");
    }

    #[test]
    fn colour_only_on_a_terminal_without_no_color() {
        use std::ffi::OsStr;
        assert!(use_color(true, None));
        assert!(use_color(true, Some(OsStr::new(""))));
        assert!(!use_color(true, Some(OsStr::new("1"))));
        assert!(!use_color(false, None));
    }
}

//! `kiln merge`: flag parsing and printing; the averaging is `kiln_gates::merge`.

use std::path::PathBuf;
use std::process::ExitCode;

/// Arguments of `kiln merge`.
#[derive(Debug, clap::Args)]
#[command(after_long_help = "\
Averages the weights of checkpoints of one run (checkpoint averaging, the seeds' WSM merging),
uniformly or with --weights (normalised to sum 1), element by element in f64, rounded once to
each tensor's dtype. Each checkpoint is verified against its manifest and read as kiln eval
reads it (a sharded run's shards assembled); all must share the run's lineage (state.json
run_id) and model shape, or the merge is refused naming both.

OUT (which must not exist, or be empty; written to a temporary directory and renamed) holds:
  model.safetensors   the averaged weights
  config.toml         the run's config, so kiln eval OUT and kiln export OUT --to hf take it
  merge.json          the checkpoints, their steps and weights

Exit codes:
  0   merged
  1   a file could not be read or written (the message names it)
  2   bad flags (fewer than two checkpoints, a weight count or value that does not fit)
  78  a checkpoint is missing, does not verify, is of another run or shape, or OUT is not empty

Examples:
  kiln merge runs/a/checkpoints/step-800 runs/a/checkpoints/step-900 runs/a/checkpoints/step-1000 --to merged/a
  kiln merge runs/a/checkpoints/step-{900,1000} --to merged/b --weights 1,3
  kiln eval merged/a --tasks tasks/synthetic-copy-mc.jsonl")]
pub struct MergeArgs {
    /// Checkpoint directories of one run (RUN_DIR/checkpoints/step-N), two or more.
    #[arg(required = true, num_args = 2..)]
    pub checkpoints: Vec<PathBuf>,
    /// The output directory.
    #[arg(long = "to", value_name = "OUT")]
    pub out: PathBuf,
    /// One weight per checkpoint, comma-separated (normalised to sum 1) [default: uniform].
    #[arg(long, value_delimiter = ',', value_name = "W1,W2,...")]
    pub weights: Option<Vec<f64>>,
}

/// `kiln merge`.
pub fn run(a: MergeArgs) -> anyhow::Result<ExitCode> {
    let report = kiln_gates::merge::merge(&kiln_gates::merge::MergeOptions {
        checkpoints: a.checkpoints,
        weights: a.weights,
        out: a.out,
    })?;
    let parts: Vec<String> = report
        .steps
        .iter()
        .zip(&report.weights)
        .map(|(s, w)| format!("step {s} x {w:.4}"))
        .collect();
    println!(
        "merged {} tensors of run {} ({}) into {}",
        report.tensors,
        report.run_id,
        parts.join(", "),
        report.out.display()
    );
    Ok(ExitCode::SUCCESS)
}

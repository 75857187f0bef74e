//! `kiln export`: flag parsing and printing; the export is `kiln_gates::export`.

use std::path::PathBuf;
use std::process::ExitCode;

/// The formats `kiln export` writes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Format {
    /// A Hugging Face Llama directory (`LlamaForCausalLM`).
    Hf,
}

/// Arguments of `kiln export`.
#[derive(Debug, clap::Args)]
#[command(after_long_help = "\
Writes a run's weights (RUN_DIR/model.safetensors, else its newest valid checkpoint) or one
checkpoint (RUN_DIR/checkpoints/step-N, verified against its manifest) as a Hugging Face Llama
directory that transformers loads with AutoModelForCausalLM.from_pretrained(OUT_DIR), no
custom code. The model is rebuilt from the run's config.toml (or --config).

Files written into OUT_DIR (which must not exist, or be empty; written to a temporary
directory beside it and renamed, so a half export is never seen):
  config.json             LlamaForCausalLM: sizes, heads and KV heads (GQA), rope_theta,
                          rms_norm_eps, tie_word_embeddings, torch_dtype
  model.safetensors       the weights under Hugging Face's names; linear layers transposed
                          from kiln's [in, out] to nn.Linear's [out, in]; dtypes kept
  generation_config.json  eos_token_id of the tokenizer
  tokenizer.json          the run's data.tokenizer (or --tokenizer); for the built-in
  tokenizer_config.json   synthetic corpus, a one-character-per-token tokenizer of its 16
                          symbols. Not written when a run on real data recorded no tokenizer.

Models Hugging Face's Llama cannot represent are refused: QK-norm (model.qk_norm = true).

Exit codes:
  0   exported
  1   a file could not be read or written (the message names it)
  78  the run, checkpoint or config is missing or invalid, the checkpoint does not verify,
      the model cannot be represented (QK-norm), or OUT_DIR is not empty

Examples:
  kiln export runs/default --to hf exports/default
  kiln export runs/default/checkpoints/step-300 --to hf exports/step-300
  python -c 'import transformers as t; t.AutoModelForCausalLM.from_pretrained(\"exports/default\")'")]
pub struct ExportArgs {
    /// A run directory or a checkpoint directory (RUN_DIR/checkpoints/step-N).
    pub path: PathBuf,
    /// The format to write.
    #[arg(long = "to", value_enum)]
    pub to: Format,
    /// The output directory.
    pub out: PathBuf,
    /// The config to rebuild the model with [default: the run's config.toml].
    #[arg(long, value_name = "FILE")]
    pub config: Option<PathBuf>,
    /// The tokenizer.json to ship [default: the run's data.tokenizer].
    #[arg(long, value_name = "FILE")]
    pub tokenizer: Option<PathBuf>,
}

/// `kiln export`.
pub fn run(a: ExportArgs) -> anyhow::Result<ExitCode> {
    let Format::Hf = a.to;
    let report = kiln_gates::export::export_hf(&kiln_gates::export::ExportOptions {
        source: a.path,
        config: a.config,
        out: a.out,
        tokenizer: a.tokenizer,
    })?;
    println!(
        "exported {}{} to {} ({})",
        report.weights.display(),
        report
            .step
            .map_or(String::new(), |s| format!(" (step {s})")),
        report.out.display(),
        report.files.join(", ")
    );
    match &report.tokenizer {
        Some(t) => println!("tokenizer: {t}"),
        None => println!(
            "tokenizer: none (the run recorded no data.tokenizer; pass --tokenizer FILE to ship one)"
        ),
    }
    Ok(ExitCode::SUCCESS)
}

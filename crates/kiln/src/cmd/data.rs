//! `kiln data ...`: token data verbs. Thin: flags here, logic in `kiln-data`.
use super::{invalid, usage};
use anyhow::Context;
use kiln_data::blend::BlendSchedule;
use kiln_data::corpus::CorpusList;
use kiln_data::indexed::IndexedDataset;
use kiln_data::manifest::{self, Manifest, Verify};
use kiln_data::tokenize::{self, DocSource, TextSplit};
use kiln_data::{BlendedLoader, LoaderConfig, Resume};
use std::path::PathBuf;
use std::process::ExitCode;

/// Token data verbs.
#[derive(Debug, clap::Subcommand)]
pub enum DataCommand {
    /// Train a byte-level BPE tokenizer and write it as a Hugging Face `tokenizer.json`.
    TrainTokenizer(TrainTokenizerArgs),
    /// Tokenize text/JSONL files into a Megatron indexed dataset (PREFIX.bin + PREFIX.idx).
    Tokenize(TokenizeArgs),
    /// Print a dataset's dtype, documents, tokens and length statistics, or dump documents.
    Inspect(InspectArgs),
    /// Build (or load) the blended sample indices of a corpus list and report the blend.
    Blend(BlendArgs),
    /// Pin every shard of a corpus list (size + SHA-256) in a manifest.
    Manifest(ManifestArgs),
    /// Check a corpus list's shards against their manifest.
    Verify(VerifyArgs),
}

/// Input documents.
#[derive(Debug, clap::Args)]
pub struct InputArgs {
    /// Input files: `.jsonl`/`.json` (one JSON object per line), `.parquet`, or plain text.
    #[arg(long = "input", short = 'i', required = true, num_args = 1..)]
    pub input: Vec<PathBuf>,
    /// JSON field that holds the text.
    #[arg(long, default_value = "text")]
    pub json_key: String,
    /// Parquet column that holds the text (a string column; null rows are skipped).
    #[arg(long, default_value = "text")]
    pub text_column: String,
    /// How plain-text files split into documents: paragraph (blank lines), line, or file.
    #[arg(long, default_value = "paragraph")]
    pub split: TextSplit,
}

impl InputArgs {
    fn source(&self) -> DocSource {
        DocSource {
            files: self.input.clone(),
            json_key: self.json_key.clone(),
            text_column: self.text_column.clone(),
            split: self.split,
        }
    }
}

#[derive(Debug, clap::Args)]
pub struct TrainTokenizerArgs {
    #[command(flatten)]
    pub input: InputArgs,
    /// Where to write the tokenizer.
    #[arg(long, short = 'o', default_value = "tokenizer.json")]
    pub output: PathBuf,
    /// Vocabulary size, special tokens and the 256 byte tokens included.
    #[arg(long, default_value_t = 32_000)]
    pub vocab_size: usize,
    /// Minimum pair frequency for a merge.
    #[arg(long, default_value_t = 2)]
    pub min_frequency: u64,
    /// Special tokens (repeatable); the first is the end-of-document token.
    #[arg(long = "special-token", default_value = "<|endoftext|>")]
    pub special_tokens: Vec<String>,
}

#[derive(Debug, clap::Args)]
pub struct TokenizeArgs {
    /// The `tokenizer.json` to use.
    #[arg(long, short = 't')]
    pub tokenizer: PathBuf,
    #[command(flatten)]
    pub input: InputArgs,
    /// Output prefix: writes PREFIX.bin, PREFIX.idx and PREFIX.kiln.json.
    #[arg(long, short = 'o')]
    pub output_prefix: PathBuf,
    /// End-of-document token appended to each document (default: the first of
    /// <|endoftext|>, </s>, <eos>, <|end_of_text|> the tokenizer has).
    #[arg(long, conflicts_with = "no_eos")]
    pub eos: Option<String>,
    /// Do not append an end-of-document token.
    #[arg(long)]
    pub no_eos: bool,
    /// Worker threads (default: all cores).
    #[arg(long)]
    pub workers: Option<usize>,
    /// Print the statistics as JSON.
    #[arg(long)]
    pub json: bool,
}

#[derive(Debug, clap::Args)]
pub struct InspectArgs {
    /// Dataset prefix (without .bin/.idx).
    pub prefix: PathBuf,
    /// Print the statistics as JSON.
    #[arg(long)]
    pub json: bool,
    /// Print document I's token ids as a JSON array; `A..B` prints documents A to B-1, one
    /// array per line.
    #[arg(long, value_name = "I|A..B")]
    pub dump_doc: Option<String>,
    /// Also check every length and pointer of the index (O(sequences)).
    #[arg(long)]
    pub check: bool,
}

#[derive(Debug, clap::Args)]
pub struct LoaderArgs {
    /// Corpus list: lines of `weight prefix [corpus]`, `#` comments; relative prefixes are
    /// relative to the list's directory.
    pub list: PathBuf,
    /// Tokens per training sequence (samples hold seq_len + 1 tokens).
    #[arg(long, default_value_t = 2048)]
    pub seq_len: usize,
    /// Global samples to index (default: steps x global batch).
    #[arg(long, conflicts_with_all = ["steps", "global_batch"])]
    pub samples: Option<u64>,
    /// Training steps (with --global-batch).
    #[arg(long, requires = "global_batch")]
    pub steps: Option<u64>,
    /// Global batch size in samples (with --steps).
    #[arg(long, requires = "steps")]
    pub global_batch: Option<u64>,
    /// Shuffle seed.
    #[arg(long, default_value_t = 1234)]
    pub seed: u64,
    /// Index cache directory (default: $KILN_DATA_CACHE, else .kiln-cache next to the list).
    #[arg(long)]
    pub cache_dir: Option<PathBuf>,
    /// Shard check against the manifest: off, fast (size + sampled hash) or full (SHA-256).
    #[arg(long, default_value = "fast")]
    pub verify: Verify,
    /// Manifest to check against (default: LIST.manifest.json if it exists).
    #[arg(long)]
    pub manifest: Option<PathBuf>,
    /// Fail if there is no manifest.
    #[arg(long)]
    pub require_manifest: bool,
    /// Weight history (JSON, as written by --write-schedule) of the run being resumed.
    #[arg(long, requires = "resume_at_sample")]
    pub schedule: Option<PathBuf>,
    /// Global sample at which the run resumes (step x global batch); the list's weights
    /// apply from here on, earlier samples stay as they were.
    #[arg(long, requires = "schedule")]
    pub resume_at_sample: Option<u64>,
    /// Worker threads (default: all cores).
    #[arg(long)]
    pub threads: Option<usize>,
}

#[derive(Debug, clap::Args)]
pub struct BlendArgs {
    #[command(flatten)]
    pub loader: LoaderArgs,
    /// Print the report as JSON.
    #[arg(long)]
    pub json: bool,
    /// Print the blend of the first N global samples as JSON: `{"dataset_index": [...],
    /// "dataset_sample_index": [...]}` (megatron-core's `build_blending_indices` outputs).
    #[arg(long, value_name = "N")]
    pub dump_order: Option<u64>,
    /// Print the tokens of global samples A..B, one JSON array per line.
    #[arg(long, value_name = "A..B")]
    pub dump_samples: Option<String>,
    /// Write the blend's weight history (JSON) to this file, for a later --schedule.
    #[arg(long)]
    pub write_schedule: Option<PathBuf>,
}

#[derive(Debug, clap::Args)]
pub struct ManifestArgs {
    /// Corpus list whose shards to pin.
    pub list: PathBuf,
    /// Manifest to write (default: LIST.manifest.json).
    #[arg(long, short = 'o')]
    pub output: Option<PathBuf>,
}

#[derive(Debug, clap::Args)]
pub struct VerifyArgs {
    /// Corpus list whose shards to check.
    pub list: PathBuf,
    /// Manifest to check against (default: LIST.manifest.json).
    #[arg(long)]
    pub manifest: Option<PathBuf>,
    /// Hash every byte instead of the fast sampled check.
    #[arg(long)]
    pub full: bool,
}

pub fn run(command: DataCommand) -> anyhow::Result<ExitCode> {
    match command {
        DataCommand::TrainTokenizer(a) => train_tokenizer(a),
        DataCommand::Tokenize(a) => with_threads("--workers", a.workers, || tokenize_cmd(a)),
        DataCommand::Inspect(a) => inspect(a),
        DataCommand::Blend(a) => with_threads("--threads", a.loader.threads, || blend(a)),
        DataCommand::Manifest(a) => manifest_cmd(a),
        DataCommand::Verify(a) => verify(a),
    }
}

fn with_threads(
    flag: &str,
    threads: Option<usize>,
    f: impl FnOnce() -> anyhow::Result<ExitCode> + Send,
) -> anyhow::Result<ExitCode> {
    if let Some(n) = threads {
        kiln_run::host::check_threads(flag, n).map_err(usage)?;
    }
    kiln_data::with_threads(threads, f)?
}

fn train_tokenizer(a: TrainTokenizerArgs) -> anyhow::Result<ExitCode> {
    if a.special_tokens.is_empty() {
        return Err(usage(
            "give at least one --special-token (the first is the end-of-document token)",
        ));
    }
    tokenize::check_vocab_size(a.vocab_size, a.special_tokens.len())
        .map_err(|e| usage(format!("--vocab-size {e}")))?;
    let t0 = std::time::Instant::now();
    let tok = tokenize::train_bpe(
        &a.input.source(),
        &tokenize::TrainOptions {
            vocab_size: a.vocab_size,
            min_frequency: a.min_frequency,
            special_tokens: a.special_tokens.clone(),
        },
        &a.output,
    )?;
    eprintln!(
        "wrote {} (vocab {}, eos {:?}) in {:.1}s",
        a.output.display(),
        tok.get_vocab_size(true),
        a.special_tokens[0],
        t0.elapsed().as_secs_f64()
    );
    Ok(ExitCode::SUCCESS)
}

fn tokenize_cmd(a: TokenizeArgs) -> anyhow::Result<ExitCode> {
    let eos = if a.no_eos {
        None
    } else {
        let tok = tokenize::load(&a.tokenizer)?;
        Some(tokenize::find_eos(&tok, &a.tokenizer, a.eos.as_deref())?.0)
    };
    let stats = tokenize::tokenize(
        &a.tokenizer,
        &a.input.source(),
        &a.output_prefix,
        &tokenize::TokenizeOptions {
            eos,
            batch_docs: 4096,
        },
    )?;
    if a.json {
        println!("{}", serde_json::to_string(&stats)?);
    } else {
        println!(
            "{}: {} documents, {} tokens ({}) in {:.2}s: {:.0} tokens/s, {:.1} MB/s of text",
            a.output_prefix.display(),
            stats.documents,
            stats.tokens,
            stats.dtype.name(),
            stats.seconds,
            stats.tokens_per_second,
            stats.text_bytes as f64 / stats.seconds.max(1e-9) / 1e6
        );
        for (path, bytes) in &stats.abandoned_removed {
            println!(
                "  removed {path} ({}) left by a writer killed before it finished",
                kiln_run::host::human_bytes(*bytes as f64)
            );
        }
        if stats.null_rows > 0 {
            println!(
                "  {} null row(s) of the parquet text column were skipped",
                stats.null_rows
            );
        }
        if stats.split_documents > 0 {
            println!(
                "  {} document(s) longer than {} KiB were encoded in pieces cut before words, to bound memory",
                stats.split_documents,
                tokenize::PIECE_BYTES >> 10
            );
        }
    }
    Ok(ExitCode::SUCCESS)
}

fn parse_range(s: &str, what: &str) -> anyhow::Result<(u64, u64)> {
    let parse = |x: &str| {
        x.trim().parse::<u64>().map_err(|e| {
            usage(format!(
                "{what} {s:?}: expected I or A..B with integers: {e}"
            ))
        })
    };
    match s.split_once("..") {
        Some((a, b)) => {
            let (a, b) = (parse(a)?, parse(b)?);
            if b < a {
                return Err(usage(format!("{what} {s:?}: the end is before the start")));
            }
            Ok((a, b))
        }
        None => {
            let a = parse(s)?;
            let b = a
                .checked_add(1)
                .ok_or_else(|| usage(format!("{what} {s:?}: index out of range")))?;
            Ok((a, b))
        }
    }
}

fn inspect(a: InspectArgs) -> anyhow::Result<ExitCode> {
    let ds = IndexedDataset::open(&a.prefix)?;
    if let Some(r) = &a.dump_doc {
        let (start, end) = parse_range(r, "--dump-doc")?;
        let docs = ds.index().documents() as u64;
        if end > docs {
            return Err(usage(format!(
                "{}: --dump-doc {r}: the dataset has {docs} documents (0..{})",
                a.prefix.display(),
                docs.saturating_sub(1)
            )));
        }
        use std::io::Write;
        let mut out = std::io::BufWriter::new(std::io::stdout().lock());
        for d in start..end {
            writeln!(out, "{}", serde_json::to_string(&ds.document(d as usize)?)?)?;
        }
        return Ok(ExitCode::SUCCESS);
    }
    let s = kiln_data::summary::summary(&ds, a.check)?;
    if a.json {
        println!("{}", serde_json::to_string(&s)?);
        return Ok(ExitCode::SUCCESS);
    }
    let l = &s.length;
    println!("{}", s.prefix);
    println!("  dtype      {}", s.dtype);
    println!("  documents  {}", s.documents);
    println!("  sequences  {}", s.sequences);
    println!("  tokens     {}", s.tokens);
    println!(
        "  length     min {} / mean {:.1} / p50 {} / p90 {} / p99 {} / max {}",
        l.min, l.mean, l.p50, l.p90, l.p99, l.max
    );
    if let Some(vocab) = s.vocab_size {
        let eos = s.eos_id.map_or("none".to_string(), |id| id.to_string());
        println!("  vocab      {vocab} (eos id {eos})");
    }
    if s.checked {
        println!("  check      every length and pointer consistent");
    }
    Ok(ExitCode::SUCCESS)
}

fn open_loader(a: &LoaderArgs) -> anyhow::Result<BlendedLoader> {
    let samples = match (a.samples, a.steps, a.global_batch) {
        (Some(n), _, _) => n,
        (None, Some(s), Some(g)) => s
            .checked_mul(g)
            .ok_or_else(|| usage("--steps x --global-batch overflows"))?,
        _ => {
            return Err(usage(
                "give --samples N, or --steps S with --global-batch G",
            ));
        }
    };
    if samples == 0 {
        return Err(usage(
            "the sample count (--samples, or --steps x --global-batch) must be at least 1",
        ));
    }
    if let Some(at) = a.resume_at_sample
        && at > samples
    {
        return Err(usage(format!(
            "--resume-at-sample {at} is past the end of the blend ({samples} samples)"
        )));
    }
    let mut cfg = LoaderConfig::new(
        a.seq_len,
        a.seed,
        samples,
        kiln_data::cache::cache_dir(a.cache_dir.as_deref(), &a.list),
    );
    cfg.verify = a.verify;
    cfg.manifest = a.manifest.clone();
    cfg.require_manifest = a.require_manifest;
    if let (Some(path), Some(at)) = (&a.schedule, a.resume_at_sample) {
        let text = kiln_run::files::read_to_string_limited(
            path,
            kiln_data::error::limits::SCHEDULE,
            "a blend schedule",
        )
        .with_context(|| format!("cannot read schedule {}", path.display()))?;
        let schedule: BlendSchedule = serde_json::from_str(&text)
            .map_err(|e| invalid(format!("{}: not a blend schedule: {e}", path.display())))?;
        cfg.resume = Some(Resume {
            schedule,
            at_sample: at,
        });
    }
    Ok(BlendedLoader::open(&a.list, &cfg)?)
}

fn blend(a: BlendArgs) -> anyhow::Result<ExitCode> {
    let t0 = std::time::Instant::now();
    let loader = open_loader(&a.loader)?;
    let elapsed = t0.elapsed().as_secs_f64();
    if let Some(path) = &a.write_schedule {
        std::fs::write(
            path,
            serde_json::to_string_pretty(loader.schedule())? + "\n",
        )
        .with_context(|| format!("cannot write {}", path.display()))?;
    }
    if let Some(n) = a.dump_order {
        let n = n.min(loader.total_samples());
        let order: Vec<(usize, u64)> =
            (0..n).map(|i| loader.source(i)).collect::<Result<_, _>>()?;
        let (d, j): (Vec<usize>, Vec<u64>) = order.into_iter().unzip();
        println!(
            "{}",
            serde_json::json!({"dataset_index": d, "dataset_sample_index": j})
        );
        return Ok(ExitCode::SUCCESS);
    }
    if let Some(r) = &a.dump_samples {
        let (start, end) = parse_range(r, "--dump-samples")?;
        use std::io::Write;
        let mut out = std::io::BufWriter::new(std::io::stdout().lock());
        for i in start..end {
            writeln!(out, "{}", serde_json::to_string(&loader.sample(i)?)?)?;
        }
        return Ok(ExitCode::SUCCESS);
    }
    let shares = loader.shares();
    if a.json {
        let report = serde_json::json!({
            "list": a.loader.list.display().to_string(),
            "samples": loader.total_samples(),
            "seq_len": a.loader.seq_len,
            "seed": a.loader.seed,
            "seconds": elapsed,
            "blend_cache": loader.blend_path().display().to_string(),
            "vocab_hint": loader.vocab_hint(),
            "datasets": shares,
        });
        println!("{report}");
        return Ok(ExitCode::SUCCESS);
    }
    println!(
        "{}: {} samples of {} tokens over {} datasets ({:.2}s)",
        a.loader.list.display(),
        loader.total_samples(),
        a.loader.seq_len + 1,
        shares.len(),
        elapsed
    );
    println!(
        "  {:<36} {:<14} {:>8} {:>8} {:>12} {:>8}",
        "dataset", "corpus", "weight", "share", "samples", "epochs"
    );
    for d in &shares {
        println!(
            "  {:<36} {:<14} {:>8.4} {:>8.4} {:>12} {:>8.3}",
            d.key, d.corpus, d.weight, d.share, d.samples, d.epochs
        );
    }
    Ok(ExitCode::SUCCESS)
}

fn manifest_cmd(a: ManifestArgs) -> anyhow::Result<ExitCode> {
    let list = CorpusList::read(&a.list)?;
    let out = a.output.unwrap_or_else(|| manifest::default_path(&a.list));
    let prefixes: Vec<PathBuf> = list.entries.iter().map(|e| e.prefix.clone()).collect();
    let t0 = std::time::Instant::now();
    let m = Manifest::create(&prefixes, &out)?;
    m.write(&out)?;
    let bytes: u64 = m.shards.iter().map(|s| s.size).sum();
    println!(
        "pinned {} files ({:.1} MB) in {} ({:.1}s)",
        m.shards.len(),
        bytes as f64 / 1e6,
        out.display(),
        t0.elapsed().as_secs_f64()
    );
    Ok(ExitCode::SUCCESS)
}

fn verify(a: VerifyArgs) -> anyhow::Result<ExitCode> {
    let list = CorpusList::read(&a.list)?;
    let path = a
        .manifest
        .unwrap_or_else(|| manifest::default_path(&a.list));
    let m = Manifest::read(&path)?;
    let prefixes: Vec<PathBuf> = list.entries.iter().map(|e| e.prefix.clone()).collect();
    let mode = if a.full { Verify::Full } else { Verify::Fast };
    m.verify(&path, &prefixes, mode)?;
    println!(
        "{} shards match {} ({})",
        2 * prefixes.len(),
        path.display(),
        if a.full { "full SHA-256" } else { "fast" }
    );
    Ok(ExitCode::SUCCESS)
}

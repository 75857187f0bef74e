//! `kiln smoke`, `lr-find`, `eval`, `status`, `plot`: flag parsing and printing; the logic is
//! in the `kiln-gates` crate.
use anyhow::Context;
use kiln_gates::smoke;
use kiln_train::Config;
use std::path::PathBuf;
use std::process::ExitCode;

/// Arguments of `kiln smoke`.
#[derive(Debug, clap::Args)]
#[command(after_long_help = "\
The smoke gate runs a short deterministic training (checkpoints and evals only at the end, in
a temporary directory) and records, per step, the loss and the gradient norm as exact f32 bits
and the process's peak memory (VmHWM). It compares them with the baseline: any difference in
any bit fails; memory fails only if it grew by more than --mem-tolerance. On a failure it
prints the first differing step, both values and their distance in ULPs.

The baseline keeps the effective config it was made with; a run with a different config (other
--set values, another --steps) is refused with the differing keys named, unless --ignore-config.

Exit codes:
  0   identical to the baseline (or --bless wrote it)
  1   numerics, step count or memory differ, the config differs, or an error

Examples:
  kiln smoke                                   # default config against gates/smoke-default.json
  kiln smoke --bless                           # (re)write the baseline after an intended change
  kiln smoke configs/tiny.toml --steps 5 --baseline gates/tiny.json --bless")]
pub struct SmokeArgs {
    /// TOML config file; without one, the built-in defaults (as `kiln train`).
    pub config: Option<PathBuf>,
    /// Steps to run [default: the baseline's step count, or 10 with --bless and no baseline].
    #[arg(long)]
    pub steps: Option<u64>,
    /// Baseline file (JSON) to compare with or, with --bless, to write.
    #[arg(long, value_name = "FILE", default_value = "gates/smoke-default.json")]
    pub baseline: PathBuf,
    /// Write this run as the baseline instead of comparing.
    #[arg(long)]
    pub bless: bool,
    /// Override a config key, e.g. `--set training.seed=7` (repeatable).
    #[arg(long = "set", value_name = "SECTION.KEY=VALUE")]
    pub overrides: Vec<String>,
    /// Compare even if the config differs from the baseline's (to check that a change which
    /// should not touch numerics, such as a thread count, really does not).
    #[arg(long)]
    pub ignore_config: bool,
    /// Allowed relative growth of peak memory over the baseline (0.25 = 25 %); negative
    /// disables the memory check.
    #[arg(long, default_value_t = 0.25, allow_negative_numbers = true)]
    pub mem_tolerance: f64,
    /// Print every step's values as they are computed.
    #[arg(long, short)]
    pub verbose: bool,
}
#[derive(Debug, clap::Args)]
pub struct LrFindArgs {}
#[derive(Debug, clap::Args)]
pub struct EvalArgs {}
#[derive(Debug, clap::Args)]
pub struct StatusArgs {}
#[derive(Debug, clap::Args)]
pub struct PlotArgs {}

/// `kiln smoke`.
pub fn smoke(a: SmokeArgs) -> anyhow::Result<ExitCode> {
    let base = Config::load(a.config.as_deref(), &a.overrides)?;
    let baseline = if a.bless && !a.baseline.exists() {
        None
    } else {
        Some(smoke::load(&a.baseline).with_context(|| {
            if a.baseline.exists() {
                "reading the smoke baseline".to_string()
            } else {
                "no baseline: create one with `kiln smoke --bless` (and --baseline FILE)"
                    .to_string()
            }
        })?)
    };
    let steps = a
        .steps
        .or_else(|| baseline.as_ref().map(|b| b.steps))
        .unwrap_or(10);
    if steps == 0 {
        anyhow::bail!("--steps must be at least 1");
    }
    let config = smoke::smoke_config(&base, steps);
    // Refuse before spending minutes on a run that cannot be compared.
    if let Some(b) = baseline.as_ref().filter(|_| !a.bless && !a.ignore_config) {
        let text = config.to_toml();
        if b.config != text {
            let diffs = smoke::config_differences(&b.config, &text);
            let fake = smoke::SmokeRun {
                config: text,
                ..b.clone()
            };
            println!(
                "{}",
                smoke::report(
                    &smoke::Verdict::ConfigMismatch(diffs),
                    b,
                    &fake,
                    &a.baseline
                )
            );
            return Ok(ExitCode::FAILURE);
        }
    }
    let verbose = a.verbose;
    let mut progress = |r: &smoke::StepRecord| {
        if verbose {
            println!(
                "step={} loss={} ({}) grad_norm={} ({})",
                r.step, r.loss, r.loss_bits, r.grad_norm, r.grad_norm_bits
            );
        }
    };
    let run = smoke::run(&config, &mut progress).context("smoke run")?;
    if a.bless {
        smoke::save(&run, &a.baseline)?;
        println!(
            "smoke: blessed {} ({} steps, last loss {}, peak memory {:.1} MiB, {:.1}s)",
            a.baseline.display(),
            run.records.len(),
            run.records.last().map_or(f32::NAN, |r| r.loss),
            run.peak_rss_mib,
            run.seconds
        );
        return Ok(ExitCode::SUCCESS);
    }
    let Some(baseline) = baseline else {
        anyhow::bail!("no baseline to compare with");
    };
    let verdict = smoke::compare(&baseline, &run, !a.ignore_config, a.mem_tolerance);
    println!("{}", smoke::report(&verdict, &baseline, &run, &a.baseline));
    Ok(if verdict == smoke::Verdict::Identical {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    })
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

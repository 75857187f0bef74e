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

A baseline is per kind of CPU (the SIMD level of the matrix products: x86_64 avx512f, avx2,
...): where FILE was blessed on another kind, the gate compares with FILE's sibling for this
kind (gates/smoke-default@x86_64-avx2.json), and where there is none it says so and compares
nothing (exit 0); --bless then writes that sibling, never over another kind's baseline.

Exit codes:
  0   identical to the baseline (or --bless wrote it; or no baseline of this CPU kind: said)
  1   numerics, step count or memory differ, or the config differs; or reading or writing
      failed (the message names the file)
  2   a bad flag value (--steps, --mem-tolerance); nothing ran
  78  the config or the baseline file is invalid: fix it

Examples:
  kiln smoke                                   # default config against gates/smoke-default.json
  kiln smoke --bless                           # (re)write the baseline after an intended change
  kiln smoke configs/tiny.toml --steps 5 --baseline gates/tiny.json --bless")]
pub struct SmokeArgs {
    /// TOML config file; without one, the built-in defaults (as `kiln train`).
    pub config: Option<PathBuf>,
    /// Steps to run, 1 to 100000 [default: the baseline's step count, or 10 with --bless and
    /// no baseline].
    #[arg(long, value_parser = clap::value_parser!(u64).range(1..=MAX_GATE_STEPS))]
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
    #[arg(long, conflicts_with = "layout")]
    pub ignore_config: bool,
    /// Compare the same training on another layout (tensor parallelism, sharding, another
    /// rank count: the `parallelism.*` keys and the ranks may differ from the baseline's,
    /// every other key must match) within the tolerance the baseline was blessed with, e.g.
    /// `kiln launch --mpi --np 4 -- kiln smoke --layout --set parallelism.tp=2` against a
    /// one-rank baseline blessed with `--tolerance 1e-4`. Memory is not compared.
    #[arg(long)]
    pub layout: bool,
    /// Allowed relative growth of peak memory over the baseline (0.25 = 25 %); negative
    /// disables the memory check.
    #[arg(long, default_value_t = 0.25, allow_negative_numbers = true)]
    pub mem_tolerance: f64,
    /// With --bless: the relative difference the baseline allows each value, for a device
    /// whose kernels burn picks per process by timing (CubeCL devices: `cubecl-cpu`, `cuda`,
    /// ...), where runs may differ in the last bits. 0 (the default) compares bits, as on flex.
    #[arg(
        long,
        default_value_t = 0.0,
        requires = "bless",
        allow_negative_numbers = true
    )]
    pub tolerance: f64,
    /// Print every step's values as they are computed.
    #[arg(long, short)]
    pub verbose: bool,
}
/// The most steps of a gate run (smoke, lr-find): a sweep is 50 to 200 steps and a smoke test
/// a handful; more is a typo, and would run for days with the CLI waiting.
const MAX_GATE_STEPS: u64 = 100_000;

/// Arguments of `kiln lr-find`.
#[derive(Debug, clap::Args)]
#[command(after_long_help = "\
Trains a fresh model (the config's model, data, AdamW and clipping) while the learning rate
grows exponentially from --min to --max over --steps, smooths the loss with a debiased EMA,
and stops when the smoothed loss exceeds --blowup times its best (or is not finite).

It suggests the LR where the smoothed loss falls fastest against log(LR) (the steepest
descent), and the more conservative blow-up LR / 10. Writes into --out:
  lr-find.csv                 step, lr, loss, smoothed_loss, grad_norm
  lr-find.json                the suggestions
  lr-find.svg, lr-find.png    loss and smoothed loss against LR (log axis), suggestions marked

Examples:
  kiln lr-find                                  # default config, 1e-6 .. 1, 100 steps
  kiln lr-find configs/tiny.toml --min 1e-5 --max 1e-1 --steps 200 --out runs/lr")]
pub struct LrFindArgs {
    /// TOML config file; without one, the built-in defaults (as `kiln train`).
    pub config: Option<PathBuf>,
    /// Override a config key (repeatable), as `kiln train`.
    #[arg(long = "set", value_name = "SECTION.KEY=VALUE")]
    pub overrides: Vec<String>,
    /// First learning rate of the ramp.
    #[arg(long, default_value_t = 1e-6)]
    pub min: f64,
    /// Last learning rate of the ramp.
    #[arg(long, default_value_t = 1.0)]
    pub max: f64,
    /// Steps of the ramp, 5 to 100000 (the sweep stops early at a blow-up).
    #[arg(long, default_value_t = 100, value_parser = clap::value_parser!(u64).range(5..=MAX_GATE_STEPS))]
    pub steps: u64,
    /// EMA coefficient of the loss smoothing.
    #[arg(long, default_value_t = 0.9)]
    pub beta: f64,
    /// Blow-up: smoothed loss above this many times the best smoothed loss.
    #[arg(long, default_value_t = 4.0)]
    pub blowup: f64,
    /// Output directory for the CSV, JSON and plots.
    #[arg(long, value_name = "DIR", default_value = "runs/lr-find")]
    pub out: PathBuf,
    /// Print every step.
    #[arg(long, short)]
    pub verbose: bool,
}

/// Arguments of `kiln eval`.
#[derive(Debug, clap::Args)]
#[command(after_long_help = "\
Loads the weights of a run directory (its final model.safetensors, else its newest valid
checkpoint) or of one checkpoint directory (RUN_DIR/checkpoints/step-N, verified against its
manifest) with the run's config.toml, and reports:
  held-out loss and answer accuracy   on the synthetic corpus's held-out problems (when the
                                      run used the synthetic corpus)
  acc, acc_norm                       multiple-choice tasks scored as lm-evaluation-harness:
                                      the choice with the highest log-likelihood given the
                                      context (acc), or per byte of the choice (acc_norm)

Task file (--tasks): JSON lines, one task each; blank and # lines are skipped:
  {\"context\": \"04213=04213\\n58213=\", \"choices\": [\"58213\\n\", \"58218\\n\"], \"answer\": 0}
Text is in the synthetic corpus's vocabulary (one character per token: digits, + - * = space
and newline). Without --tasks, the built-in task of the synthetic corpus is used (the same as
tasks/synthetic-copy-mc.jsonl).

Examples:
  kiln eval runs/default --tasks tasks/synthetic-copy-mc.jsonl
  kiln eval runs/default/checkpoints/step-200 --json")]
pub struct EvalArgs {
    /// A run directory or a checkpoint directory.
    pub path: PathBuf,
    /// Multiple-choice task file (JSON lines) [default: the built-in synthetic copy task].
    #[arg(long, value_name = "FILE.jsonl")]
    pub tasks: Option<PathBuf>,
    /// Config to rebuild the model with [default: the run's config.toml].
    #[arg(long, value_name = "FILE")]
    pub config: Option<PathBuf>,
    /// Held-out sequences for the held-out loss [default: the config's eval.samples].
    #[arg(long)]
    pub samples: Option<usize>,
    /// Print one JSON object instead of text.
    #[arg(long)]
    pub json: bool,
}

/// Arguments of `kiln status`.
#[derive(Debug, clap::Args)]
#[command(after_long_help = "\
Reads RUN_DIR/metrics.jsonl, RUN_DIR/events.jsonl and RUN_DIR/checkpoints/ and prints: steps
and tokens done, the last loss, the last eval, the checkpoints present, starts and resumes,
and the guard events (non-finite skips, loss spikes, rollbacks, frozen parameters, rejected
checkpoints) with counts and the latest few in full.

Then the goodput ledger over every batch job and launch attempt of the run: each second of
wall time as productive training, startup (launch to first step), checkpoint stall, lost work
(steps redone after a failure), detection (from a fault to the end of its attempt's kill),
backoff, queue wait (submission to start) or other, and ETTR = productive / total; the attempts
with their classification and culprit hosts; each fault with its detection time (from the
failed rank's last heartbeat, progress or exit to the supervisor's decision), the tier the next
attempt resumed from (memory snapshot, peer, persistent checkpoint) and the work it lost (steps
redone x step time); the node swaps (named and blind), the quarantined hosts, and the chain's
last decision.

Examples:
  kiln status runs/default
  kiln status --json runs/default | jq .ledger.faults")]
pub struct StatusArgs {
    /// The run directory (`kiln train --run-dir`).
    pub run_dir: PathBuf,
    /// Print one JSON object (the step, ETTR and the whole ledger: buckets, attempts, faults,
    /// swaps) instead of text.
    #[arg(long)]
    pub json: bool,
}

/// Arguments of `kiln plot`.
#[derive(Debug, clap::Args)]
#[command(after_long_help = "\
Draws, from RUN_DIR/metrics.jsonl, the training and held-out loss, the eval accuracies, the
learning rate, the gradient norm and tokens/s against the step, as one SVG and one PNG; and,
for a run started by `kiln launch`/`kiln submit`, its timeline from RUN_DIR/events.jsonl
(timeline.svg/.png beside the curves): the step each attempt reached over wall time, failures
and node swaps marked, and the goodput ledger as a colored band.
Text in the PNG needs a TrueType font: $KILN_FONT, or DejaVu Sans (Debian/Ubuntu package
fonts-dejavu-core); without one the PNG has no text.

Example:
  kiln plot runs/default            # runs/default/plots/curves.svg and .png (+ timeline)")]
pub struct PlotArgs {
    /// The run directory (`kiln train --run-dir`).
    pub run_dir: PathBuf,
    /// Output path without extension [default: RUN_DIR/plots/curves].
    #[arg(long, value_name = "STEM")]
    pub out: Option<PathBuf>,
}

/// `kiln smoke`.
pub fn smoke(a: SmokeArgs) -> anyhow::Result<ExitCode> {
    smoke::check_mem_tolerance(a.mem_tolerance)?;
    smoke::check_tolerance(a.tolerance).map_err(|e| anyhow::anyhow!("--{e}"))?;
    let base = Config::load(a.config.as_deref(), &a.overrides)?;
    let (path, baseline) = match smoke_baseline(&a)? {
        Ok(found) => found,
        Err(why) => {
            // Not a failure of this tree: nothing of this CPU kind to compare it with.
            println!("{why}");
            return Ok(ExitCode::SUCCESS);
        }
    };
    // --steps is at least 1 (clap checks it), a baseline's step count too (smoke::load).
    let steps = a
        .steps
        .or_else(|| baseline.as_ref().map(|b| b.steps))
        .unwrap_or(10);
    let config = smoke::smoke_config(&base, steps);
    // Refuse before spending minutes on a run that cannot be compared.
    let ranks = kiln_topology::RankEnv::from_process_env()?.world_size as u64;
    let setup = match (a.ignore_config, a.layout) {
        (true, _) => smoke::Setup::Any,
        (false, true) => smoke::Setup::Layout,
        (false, false) => smoke::Setup::Same,
    };
    if let Some(b) = baseline.as_ref().filter(|_| !a.bless)
        && let Some(refusal) = smoke::refuse_config(b, &config.to_toml(), ranks, &path, setup)
    {
        println!("{refusal}");
        return Ok(ExitCode::FAILURE);
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
    let Some(mut run) = smoke::run(&config, &mut progress).context("smoke run")? else {
        // Another rank trained beside rank 0, which compares and writes.
        return Ok(ExitCode::SUCCESS);
    };
    if a.bless {
        run.tolerance = a.tolerance;
        smoke::save(&run, &path)?;
        println!(
            "smoke: blessed {} ({} steps, last loss {}, peak memory {:.1} MiB, {:.1}s)",
            path.display(),
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
    let verdict = smoke::compare(&baseline, &run, setup, a.mem_tolerance);
    println!("{}", smoke::report(&verdict, &baseline, &run, &path));
    Ok(if verdict == smoke::Verdict::Identical {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    })
}

/// The smoke baseline to compare with and its file (`None` when blessing a new one), or, where
/// the file given was blessed on another kind of CPU and none of this kind is beside it, why
/// nothing can be compared.
type Found = Result<(PathBuf, Option<smoke::SmokeRun>), String>;

fn smoke_baseline(a: &SmokeArgs) -> anyhow::Result<Found> {
    if a.bless && !a.baseline.exists() {
        return Ok(Ok((a.baseline.clone(), None)));
    }
    if !a.baseline.exists() {
        anyhow::bail!(
            "{}: no baseline: create one with `kiln smoke --bless` (and --baseline FILE)",
            a.baseline.display()
        );
    }
    let found = smoke::baseline_for_this_cpu(&a.baseline).context("reading the smoke baseline")?;
    Ok(match found {
        smoke::Baseline::Found(path, run) => Ok((path, Some(run))),
        // Blessed with the other kind's step count, beside it.
        smoke::Baseline::OtherKind { wanted, run, .. } if a.bless => Ok((wanted, Some(*run))),
        smoke::Baseline::OtherKind { given, run, wanted } => Err(format!(
            "smoke: NOT COMPARED: no baseline for this kind of CPU ({}). {} was blessed on {}, whose SIMD matrix products sum in another order, so its bits cannot be compared here. Bless one for this kind (after checking this tree is the one you trust): `kiln smoke --bless --baseline {}` writes {}",
            smoke::cpu_description(),
            given.display(),
            run.cpu,
            given.display(),
            wanted.display()
        )),
    })
}

/// Progress of a long gate (lr-find, eval): a live bar on a terminal, else (a pipe, a batch
/// log) a line each time another tenth of the work is done, so a long run is never silent.
struct GateProgress {
    bar: Option<indicatif::ProgressBar>,
    label: &'static str,
    total: u64,
    /// Tenths of the work already reported (no terminal).
    tenths_shown: u64,
    /// Print progress lines when there is no terminal (off for machine-read output).
    lines: bool,
}

impl GateProgress {
    fn new(label: &'static str, total: u64, lines: bool) -> Self {
        use std::io::IsTerminal;
        let bar = std::io::stderr().is_terminal().then(|| {
            let bar = indicatif::ProgressBar::new(total);
            bar.set_style(
                indicatif::ProgressStyle::with_template(
                    "{prefix} {bar:30} {pos}/{len} {msg} eta {eta}",
                )
                .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
            );
            bar.set_prefix(label);
            bar
        });
        Self {
            bar,
            label,
            total,
            tenths_shown: 0,
            lines,
        }
    }

    fn update(&mut self, done: u64, line: &str) {
        match &self.bar {
            Some(bar) => {
                bar.set_position(done);
                bar.set_message(line.to_string());
            }
            None if self.lines => {
                let tenth = done.saturating_mul(10) / self.total.max(1);
                if tenth > self.tenths_shown {
                    self.tenths_shown = tenth;
                    eprintln!("{}: {done}/{} {line}", self.label, self.total);
                }
            }
            None => {}
        }
    }

    fn finish(&self) {
        if let Some(bar) = &self.bar {
            bar.finish_and_clear();
        }
    }
}

/// `kiln lr-find`.
pub fn lr_find(a: LrFindArgs) -> anyhow::Result<ExitCode> {
    let config = Config::load(a.config.as_deref(), &a.overrides)?;
    let opts = kiln_gates::lrfind::LrFindOptions {
        min_lr: a.min,
        max_lr: a.max,
        steps: a.steps,
        beta: a.beta,
        blowup_factor: a.blowup,
    };
    let verbose = a.verbose;
    let mut shown = GateProgress::new("lr-find", a.steps, true);
    let mut progress = |p: &kiln_gates::lrfind::LrPoint| {
        let line = format!(
            "step={} lr={:.3e} loss={:.4} smoothed={:.4} grad_norm={:.3}",
            p.step, p.lr, p.loss, p.smoothed, p.grad_norm
        );
        if verbose {
            println!("{line}");
        } else {
            shown.update(p.step, &line);
        }
    };
    let result = kiln_gates::lrfind::run(&config, &opts, &mut progress);
    shown.finish();
    let result = result?;
    if !result.writer {
        // One sweep over every rank: rank 0 reports and writes it.
        return Ok(ExitCode::SUCCESS);
    }
    let files = kiln_gates::lrfind::write_outputs(&result, &a.out)?;
    let fmt = |v: Option<f64>| v.map_or("-".to_string(), |v| format!("{v:.2e}"));
    println!(
        "lr-find: {} steps, lr {:.1e} .. {:.1e}; blow-up at {}",
        result.points.len(),
        a.min,
        result.points.last().map_or(a.min, |p| p.lr),
        result
            .blowup_lr
            .map_or("none (raise --max to find it)".to_string(), |v| format!(
                "{v:.2e}"
            ))
    );
    println!(
        "suggested lr: {} (steepest descent of the smoothed loss); conservative: {} ({}); lowest smoothed loss at {}",
        fmt(result.suggested_lr),
        fmt(result.conservative_lr),
        if result.blowup_lr.is_some() {
            "blow-up / 10"
        } else {
            "min-loss lr / 10"
        },
        fmt(result.min_loss_lr)
    );
    for f in files {
        println!("wrote {}", f.display());
    }
    Ok(ExitCode::SUCCESS)
}

/// `kiln eval`.
pub fn eval(a: EvalArgs) -> anyhow::Result<ExitCode> {
    if a.samples == Some(0) {
        return Err(super::usage(
            "--samples 0: must be at least 1 (held-out sequences to score)",
        ));
    }
    let tasks = match &a.tasks {
        Some(path) => kiln_gates::mc::load_tasks(path)?,
        None => kiln_gates::mc::synthetic_copy_tasks(
            kiln_gates::mc::SHIPPED_TASKS,
            kiln_gates::mc::SHIPPED_SEED,
        ),
    };
    let loaded = kiln_gates::mc::load_model(&a.path, a.config.as_deref())?;
    let s = &loaded.session;
    let samples = a.samples.unwrap_or(s.config.eval.samples);
    // The held-out synthetic eval applies to runs trained on the built-in corpus.
    let held_out = (s.config.data.corpus_list.is_empty() && samples > 0).then(|| {
        let syn = kiln_train::data::synthetic::Synthetic::new(s.config.training.seed);
        kiln_train::components::eval::synthetic(s, &syn, loaded.step.unwrap_or(0), samples, None)
    });
    let sequences = tasks.iter().map(|t| t.choices.len() as u64).sum();
    let mut shown = GateProgress::new("eval", sequences, !a.json);
    let mut progress = |done: usize, _: usize| shown.update(done as u64, "sequences scored");
    let score = kiln_gates::mc::score_multiple_choice(s, &tasks, &mut progress);
    shown.finish();
    let task_name = a
        .tasks
        .as_ref()
        .map_or("built-in synthetic copy task".to_string(), |p| {
            p.display().to_string()
        });
    if a.json {
        let v = serde_json::json!({
            "weights": loaded.weights.display().to_string(),
            "config": loaded.config_path.display().to_string(),
            "step": loaded.step,
            "tasks_file": task_name,
            "mc": score,
            "held_out_loss": held_out.as_ref().map(|e| e.eval_loss),
            "answer_accuracy": held_out.as_ref().and_then(|e| e.eval_accuracy),
        });
        println!("{v}");
    } else {
        println!(
            "weights: {}{}",
            loaded.weights.display(),
            loaded
                .step
                .map_or(String::new(), |s| format!(" (step {s})"))
        );
        match &held_out {
            Some(e) => println!(
                "held-out loss: {:.4} nats/token over {samples} sequences; answer accuracy {}",
                e.eval_loss,
                e.eval_accuracy
                    .map_or("-".to_string(), |x| format!("{x:.3}"))
            ),
            None if samples == 0 => println!("held-out loss: - (eval.samples = 0)"),
            None => println!("held-out loss: - (only for the synthetic corpus)"),
        }
        println!(
            "{task_name}: {} tasks, acc {:.3}, acc_norm {:.3} (chance {:.3}), mean log-likelihood of the answer {:.3}",
            score.tasks, score.acc, score.acc_norm, score.chance, score.mean_answer_loglik
        );
    }
    Ok(ExitCode::SUCCESS)
}

/// `kiln status`.
pub fn status(a: StatusArgs) -> anyhow::Result<ExitCode> {
    if a.json {
        let v = kiln_gates::report::status_json(&a.run_dir)?;
        println!("{}", serde_json::to_string_pretty(&v)?);
    } else {
        print!("{}", kiln_gates::report::status(&a.run_dir)?);
    }
    Ok(ExitCode::SUCCESS)
}

/// `kiln plot`.
pub fn plot(a: PlotArgs) -> anyhow::Result<ExitCode> {
    for path in kiln_gates::report::plot_run(&a.run_dir, a.out.as_deref())? {
        println!("wrote {}", path.display());
    }
    Ok(ExitCode::SUCCESS)
}

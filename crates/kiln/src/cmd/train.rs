//! `kiln train`: load the config, run the trainer, show progress.

use kiln_train::{Config, EvalMetrics, Observer, Outcome, StepMetrics, TrainOptions};
use std::io::IsTerminal;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Instant;

/// Arguments of `kiln train`.
#[derive(Debug, clap::Args)]
#[command(after_long_help = train_help())]
pub struct TrainArgs {
    /// TOML config file; without one, the built-in defaults (synthetic copy corpus).
    pub config: Option<PathBuf>,
    /// Override a config key, e.g. `--set training.steps=100` (repeatable).
    #[arg(long = "set", value_name = "SECTION.KEY=VALUE")]
    pub overrides: Vec<String>,
    /// Run directory: config, metrics, events and checkpoints. Resumes if it has checkpoints.
    #[arg(long, value_name = "DIR", default_value = "runs/default")]
    pub run_dir: PathBuf,
    /// Print the effective config (defaults, file and overrides merged) as TOML and exit.
    #[arg(long)]
    pub print_config: bool,
    /// Plain `step=N` lines instead of the live status line, even on a terminal.
    #[arg(long)]
    pub no_progress_bar: bool,
}

/// What `kiln train --help` says after the flags; the exit codes and the run directory come
/// from kiln-run's tables.
fn train_help() -> String {
    use kiln_run::exit::*;
    let codes = [
        SUCCESS,
        FAILURE,
        GUARD_STOP,
        RUN_DIR_LOCKED,
        PREEMPTED,
        REPLICA_MISMATCH,
        CONFIG,
    ];
    format!(
        "Exit codes (kiln launch reads them: {} are never retried):\n{}\n\n{TRAIN_ABOUT}\n\n\
         Run directory:\n{}\n\n{TRAIN_EXAMPLES}",
        super::help::never_retried(&codes),
        super::help::exit_listing(&codes),
        super::help::run_dir_listing(),
    )
}

const TRAIN_ABOUT: &str = "\
Data parallelism: start N ranks with an MPI launcher (kiln launch --mpi --np N, mpirun,
mpiexec or srun) on a kiln built with `--features mpi`. Each rank trains on its slice of the
global batch (training.global_batch_size, or batch_size x grad_accum_steps x ranks);
gradients are averaged over ranks. Rank 0 writes the run directory. A checkpoint resumes
on any number of ranks that divides its global batch.

Optimizers (optimizer.kind): adamw (default), muon (Newton-Schulz orthogonalised momentum
for the hidden matrices, AdamW for embeddings, norms and the head), sophiag (clipped,
Hessian-preconditioned momentum; optimizer.sophia.rho, hessian_interval). Precision:
training.dtype = f32 | bf16 (matmuls), training.master_dtype = f32 | bf16 (stored weights;
bf16 loses small updates: the norms freeze). Checkpoints are written on a background thread
(checkpoint.async = true): a step waits only for a host copy of the state, and every exit
waits for the save in flight.";

const TRAIN_EXAMPLES: &str = "\
Examples:
  kiln train                                   # the built-in default, a few minutes on CPU
  kiln train configs/tiny.toml --set training.steps=2000 --run-dir runs/long
  kiln train --print-config > my.toml          # every key, with its default";

/// Renders progress: a live status line on a terminal, plain `step=N ...` lines otherwise
/// (what `kiln launch` and any other supervisor parse).
struct Progress {
    bar: Option<indicatif::ProgressBar>,
    /// Multiple-choice tasks scored at every eval (as `mc_acc`, `mc_acc_norm`).
    tasks: Vec<kiln_gates::mc::McTask>,
    started: Instant,
    first_step: Option<u64>,
}

impl Progress {
    fn new(live: bool, total: u64) -> Self {
        let bar = live.then(|| {
            let bar = indicatif::ProgressBar::new(total);
            bar.set_style(
                indicatif::ProgressStyle::with_template("{bar:30} {pos}/{len} {msg} eta {eta}")
                    .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
            );
            bar
        });
        Self {
            bar,
            tasks: Vec::new(),
            started: Instant::now(),
            first_step: None,
        }
    }

    fn eta(&mut self, step: u64, total: u64) -> f64 {
        let first = *self.first_step.get_or_insert(step.saturating_sub(1));
        let done = step.saturating_sub(first).max(1) as f64;
        self.started.elapsed().as_secs_f64() / done * total.saturating_sub(step) as f64
    }

    fn println(&self, msg: &str) {
        match &self.bar {
            Some(bar) => bar.println(msg),
            None => say(format_args!("{msg}")),
        }
    }
}

impl Observer for Progress {
    fn on_step(&mut self, m: &StepMetrics) {
        let eta = self.eta(m.step, m.total_steps);
        match &self.bar {
            Some(bar) => {
                bar.set_position(m.step);
                bar.set_message(format!(
                    "loss {:.4} | {:.0} tok/s | lr {:.2e}",
                    m.loss, m.tokens_per_s, m.lr
                ));
            }
            None => say(format_args!(
                "step={} total={} loss={:.4} grad_norm={:.3} lr={:.3e} tok/s={:.0} mfu={:.3} eta={:.0}s",
                m.step, m.total_steps, m.loss, m.grad_norm, m.lr, m.tokens_per_s, m.mfu, eta
            )),
        }
    }

    fn on_eval(&mut self, e: &EvalMetrics) {
        let acc = e
            .eval_accuracy
            .map_or(String::new(), |a| format!(" answer_accuracy={a:.3}"));
        let uni = e
            .unigram_loss
            .map_or(String::new(), |u| format!(" unigram_baseline={u:.4}"));
        let mc = e
            .extra
            .get("mc_acc")
            .and_then(|v| v.as_f64())
            .map_or(String::new(), |a| format!(" mc_acc={a:.3}"));
        self.println(&format!(
            "eval step={} held_out_loss={:.4}{uni}{acc}{mc}",
            e.step, e.eval_loss
        ));
    }

    fn on_note(&mut self, msg: &str) {
        self.println(&format!("note: {msg}"));
    }

    fn extra_eval(
        &mut self,
        session: &kiln_train::Session,
    ) -> serde_json::Map<String, serde_json::Value> {
        let mut out = serde_json::Map::new();
        if !self.tasks.is_empty() {
            let score = kiln_gates::mc::score_multiple_choice(session, &self.tasks, &mut |_, _| {});
            out.insert("mc_acc".into(), score.acc.into());
            out.insert("mc_acc_norm".into(), score.acc_norm.into());
            out.insert("mc_chance".into(), score.chance.into());
        }
        out
    }
}

/// Prints a progress line. A closed stdout (the reader went away: a pipe to `head`, a
/// launcher that died) must not stop training, so write errors are ignored here rather
/// than panicking as `println!` does.
fn say(line: std::fmt::Arguments) {
    use std::io::Write;
    let _ = writeln!(std::io::stdout(), "{line}");
}

/// `kiln train`.
pub fn run(args: TrainArgs) -> anyhow::Result<ExitCode> {
    // Liveness apart from progress: beat to the node's launcher from a thread while this runs.
    let _heartbeat = kiln_run::Heartbeat::start();
    // A bad config is exit 78 like any other invalid input (never retried by kiln launch),
    // whether it is found here or once training starts (ConfigError and TrainError say so).
    let config = Config::load_for_run(args.config.as_deref(), &args.overrides, &args.run_dir)?;
    if args.print_config {
        print!("{}", config.to_toml_every_key());
        return Ok(ExitCode::SUCCESS);
    }
    let live = !args.no_progress_bar && std::io::stderr().is_terminal();
    let mut progress = Progress::new(live, config.training.steps);
    progress.tasks = eval_tasks(&config)?;
    let opts = TrainOptions {
        config,
        run_dir: args.run_dir.clone(),
    };
    let report = match kiln_train::train(&opts, &mut progress) {
        Ok(report) => report,
        Err(e) => {
            if let Some(bar) = &progress.bar {
                bar.finish_and_clear();
            }
            let dir = args.run_dir.display();
            return Err(anyhow::Error::new(e).context(format!("training in run directory {dir}")));
        }
    };
    if let Some(bar) = &progress.bar {
        bar.finish_and_clear();
    }
    match report.outcome {
        Outcome::Completed => {
            say(format_args!("{}", done_line(&report, &args.run_dir)));
            Ok(ExitCode::SUCCESS)
        }
        Outcome::Preempted { signal } => {
            eprintln!(
                "kiln: preempted by signal {signal} after step {}; checkpoint saved; run the same command to resume",
                report.step
            );
            Ok(super::exit_code(kiln_run::exit::PREEMPTED))
        }
    }
}

/// The multiple-choice eval's tasks: `eval.tasks`, or the built-in task of the synthetic
/// corpus (none when the run evaluates nothing or reads a corpus of its own).
fn eval_tasks(config: &Config) -> anyhow::Result<Vec<kiln_gates::mc::McTask>> {
    if !config.eval.tasks.is_empty() {
        let path = std::path::Path::new(&config.eval.tasks);
        return kiln_gates::mc::load_tasks(path).map_err(|e| {
            kiln_train::config::ConfigError::Invalid {
                origin: "eval.tasks".into(),
                message: e.to_string(),
            }
            .into()
        });
    }
    if config.data.corpus_list.is_empty() && config.eval.samples > 0 {
        return Ok(kiln_gates::mc::synthetic_copy_tasks(
            kiln_gates::mc::SHIPPED_TASKS,
            kiln_gates::mc::SHIPPED_SEED,
        ));
    }
    Ok(Vec::new())
}

/// The line a completed run ends with: its steps, last loss, last evaluation and weights.
fn done_line(report: &kiln_train::TrainReport, run_dir: &std::path::Path) -> String {
    let loss = report
        .last_loss
        .map_or("-".to_string(), |l| format!("{l:.4}"));
    let eval = report.last_eval.as_ref().map_or(String::new(), |e| {
        let unigram = e.unigram_loss.map(|u| format!(" unigram_baseline={u:.4}"));
        let accuracy = e.eval_accuracy.map(|a| format!(" answer_accuracy={a:.3}"));
        format!(
            " held_out_loss={:.4}{}{}",
            e.eval_loss,
            unigram.unwrap_or_default(),
            accuracy.unwrap_or_default()
        )
    });
    format!(
        "done: steps={} loss={loss}{eval} time={:.1}s weights={}",
        report.step,
        report.seconds,
        run_dir.join(kiln_run::layout::FINAL_MODEL).display()
    )
}

//! The step loop: forward, backward, global clipping, AdamW, guards, metrics, checkpoints,
//! signals and exact resume.
//!
//! Everything that decides what the next step computes is state saved in each checkpoint:
//! weights, AdamW moments and step count, the step, the data cursor (batches consumed,
//! including skipped ones), and the guards' loss window. Data and init are pure functions of
//! the seed and counters, so a run killed anywhere and restarted from its newest checkpoint
//! ends bit-identical to one never interrupted.

use crate::checkpoint::{self, Checkpoint, HostTensor};
use crate::config::Config;
use crate::data::{BlendedSource, SyntheticSource, TokenSource};
use crate::guards::{self, LossVerdict, SpikeDetector};
use crate::model::Llama;
use crate::optim::{self, AdamW};
use crate::synthetic::Synthetic;
use burn::tensor::{Device, Int, Tensor, TensorData};
use kiln_run::EventLog;
use serde::{Deserialize, Serialize};
use serde_json::json;
use sha2::{Digest, Sha256};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Instant;

/// Errors that stop training.
#[derive(Debug, thiserror::Error)]
pub enum TrainError {
    /// Bad config.
    #[error(transparent)]
    Config(#[from] crate::config::ConfigError),
    /// Checkpoint write/read failure.
    #[error(transparent)]
    Checkpoint(#[from] checkpoint::CheckpointError),
    /// Run-directory I/O.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The cause.
        source: std::io::Error,
    },
    /// Event log failure.
    #[error(transparent)]
    Events(#[from] kiln_run::EventLogError),
    /// The data source failed.
    #[error("data: {0}")]
    Data(String),
    /// The device named in the config is unknown or not compiled in.
    #[error("device {0:?}: {1}")]
    Device(String, String),
    /// The newest checkpoint cannot be resumed with this config.
    #[error("cannot resume from {path}: {reason}")]
    ResumeMismatch {
        /// The checkpoint.
        path: PathBuf,
        /// What differs.
        reason: String,
    },
    /// A guard stopped the run.
    #[error("guard: {0}")]
    Guard(String),
}

/// Everything a step decided, for metrics and progress display.
#[derive(Debug, Clone, Serialize)]
pub struct StepMetrics {
    /// Optimizer steps completed.
    pub step: u64,
    /// Total steps of the run.
    pub total_steps: u64,
    /// Mean loss of the step.
    pub loss: f32,
    /// Global gradient norm before clipping.
    pub grad_norm: f32,
    /// Learning rate used.
    pub lr: f64,
    /// Training tokens per second of this step.
    pub tokens_per_s: f64,
    /// Wall time of the step.
    pub step_time_s: f64,
    /// Model FLOPs utilisation against `peak_flops`.
    pub mfu: f64,
    /// Resident memory, MiB.
    pub rss_mib: f64,
    /// Tokens trained on so far.
    pub tokens_seen: u64,
}

/// Evaluation on held-out data.
#[derive(Debug, Clone, Serialize)]
pub struct EvalMetrics {
    /// Step evaluated after.
    pub step: u64,
    /// Held-out loss (nats per token).
    pub eval_loss: f64,
    /// Fraction of complete held-out answers predicted exactly (synthetic corpus).
    pub eval_accuracy: Option<f64>,
    /// Unigram baseline loss of the corpus, for comparison.
    pub unigram_loss: Option<f64>,
    /// Results of [`Observer::extra_eval`] (multiple-choice accuracy, ...).
    #[serde(flatten)]
    pub extra: serde_json::Map<String, serde_json::Value>,
}

/// How a training run ended.
#[derive(Debug, Clone, PartialEq)]
pub enum Outcome {
    /// All steps done.
    Completed,
    /// Stopped by a signal after saving a checkpoint; running the same command resumes.
    Preempted {
        /// The signal number.
        signal: i32,
    },
}

/// Result of [`train`].
#[derive(Debug, Clone)]
pub struct TrainReport {
    /// How it ended.
    pub outcome: Outcome,
    /// Steps completed.
    pub step: u64,
    /// Last training loss.
    pub last_loss: Option<f32>,
    /// Last evaluation.
    pub last_eval: Option<EvalMetrics>,
    /// Wall time of this process's training, seconds.
    pub seconds: f64,
}

/// Things the caller can observe while training runs.
pub trait Observer {
    /// Called after every completed step.
    fn on_step(&mut self, _m: &StepMetrics) {}
    /// Called after every evaluation.
    fn on_eval(&mut self, _e: &EvalMetrics) {}
    /// Called for notable events (resume, checkpoint, guard), with a one-line message.
    fn on_note(&mut self, _msg: &str) {}
    /// Extra evaluations run at every eval point (e.g. multiple-choice tasks scored by
    /// `kiln-gates`, which depends on this crate and so cannot be called from here); the
    /// returned fields are added to the eval line of `metrics.jsonl`.
    fn extra_eval(&mut self, _session: &Session) -> serde_json::Map<String, serde_json::Value> {
        serde_json::Map::new()
    }
}

/// An observer that ignores everything.
pub struct Silent;
impl Observer for Silent {}

/// The state file of a checkpoint (`state.json`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TrainState {
    /// Optimizer steps completed.
    pub step: u64,
    /// Tokens trained on.
    pub tokens_seen: u64,
    /// Batches consumed from the data (steps plus skipped batches): the data cursor.
    pub data_cursor: u64,
    /// Seed of init and data order (the RNG state: every draw is a function of it and a counter).
    pub seed: u64,
    /// AdamW updates applied.
    pub optimizer_step: u64,
    /// LR schedule kind and the LR of the last step.
    pub schedule: String,
    /// Learning rate of the last step.
    pub lr: f64,
    /// Hash of everything that fixes the parameter shapes; a mismatch refuses resume.
    pub model_hash: String,
    /// Hash of the whole effective config.
    pub config_hash: String,
    /// Loss window of the spike guard.
    pub spike_window: SpikeDetector,
    /// Steps skipped for non-finite loss/gradients.
    pub nonfinite_skipped: u64,
    /// Spike rollbacks performed.
    pub rollbacks: u64,
    /// kiln version that wrote it.
    pub kiln_version: String,
}

fn sha256_hex(text: &str) -> String {
    hex::encode(Sha256::digest(text.as_bytes()))
}

/// Parses a device name (`flex`, `cuda:0`, `rocm:1`, `vulkan`, `wgpu`, `metal`).
pub fn parse_device(name: &str) -> Result<Device, TrainError> {
    let (kind, index) = match name.split_once(':') {
        Some((k, i)) => {
            let idx: usize = i.parse().map_err(|_| {
                TrainError::Device(name.into(), "index after ':' must be a number".into())
            })?;
            (k, idx)
        }
        None => (name, 0),
    };
    let _ = index;
    let not_built = |feature: &str| {
        TrainError::Device(
            name.into(),
            format!(
                "this kiln was built without the `{feature}` feature; rebuild with `cargo build --release --features {feature}`"
            ),
        )
    };
    match kind {
        "flex" | "cpu" => Ok(Device::flex()),
        #[cfg(feature = "cuda")]
        "cuda" => Ok(Device::cuda(index)),
        #[cfg(feature = "rocm")]
        "rocm" => Ok(Device::rocm(index)),
        #[cfg(feature = "vulkan")]
        "vulkan" => Ok(Device::vulkan(Default::default())),
        #[cfg(feature = "wgpu")]
        "wgpu" => Ok(Device::wgpu(Default::default())),
        #[cfg(feature = "metal")]
        "metal" => Ok(Device::metal(Default::default())),
        "cuda" | "rocm" | "vulkan" | "wgpu" | "metal" => Err(not_built(kind)),
        _ => Err(TrainError::Device(
            name.into(),
            "unknown device; use flex, cuda:N, rocm:N, vulkan, wgpu or metal".into(),
        )),
    }
}

/// Sets the CPU thread count of the flex backend (rayon's global pool). Only the first call
/// in a process takes effect; see [`crate::budget::start_threads`].
pub fn set_threads(threads: usize) -> Result<(), TrainError> {
    Ok(crate::budget::start_threads(threads)?)
}

fn rss_mib() -> f64 {
    // /proc/self/statm: size resident ... in pages.
    std::fs::read_to_string("/proc/self/statm")
        .ok()
        .and_then(|s| s.split_whitespace().nth(1)?.parse::<f64>().ok())
        .map_or(0.0, |pages| pages * 4096.0 / (1024.0 * 1024.0))
}

/// Peak resident memory of this process (VmHWM), MiB.
pub fn peak_rss_mib() -> f64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            let line = s.lines().find(|l| l.starts_with("VmHWM:"))?;
            line.split_whitespace().nth(1)?.parse::<f64>().ok()
        })
        .map_or(0.0, |kib| kib / 1024.0)
}

/// The model, its parameters and optimizer, built from a config: what `kiln train`, the
/// gates and eval all start from.
pub struct Session {
    /// The effective config.
    pub config: Config,
    /// Device the tensors live on.
    pub device: Device,
    /// Model structure.
    pub model: Llama,
    /// Parameters (flat, in `model.specs()` order), without autodiff.
    pub params: Vec<Tensor<1>>,
    /// AdamW state.
    pub optimizer: AdamW,
    /// Token source.
    pub data: Box<dyn TokenSource>,
    /// The synthetic corpus, when it is the data (for the built-in eval).
    pub synthetic: Option<Synthetic>,
}

impl Session {
    /// Builds the model, fresh parameters and zero optimizer state from `config`.
    pub fn new(config: &Config) -> Result<Self, TrainError> {
        config.validate()?;
        // Memory is checked before anything is allocated, and again once the data has said
        // its vocabulary.
        let known_vocab = crate::budget::known_vocab(config);
        crate::budget::check(config, known_vocab)?;
        set_threads(config.training.threads)?;
        let device = parse_device(&config.training.device)?;
        let (data, synthetic): (Box<dyn TokenSource>, Option<Synthetic>) =
            if config.data.corpus_list.is_empty() {
                let s = Synthetic::new(config.training.seed);
                (Box::new(SyntheticSource(s.clone())), Some(s))
            } else {
                (Box::new(Self::open_blended(config, None)?), None)
            };
        let vocab = crate::data::model_vocab(config, data.as_ref()).map_err(TrainError::Data)?;
        if vocab != known_vocab {
            crate::budget::check(config, vocab)?;
        }
        let model = Llama::new(&config.model, vocab);
        let params = model.init(config.training.seed, &device);
        let optimizer = AdamW::new(&config.optimizer, model.specs(), &device);
        Ok(Self {
            config: config.clone(),
            device,
            model,
            params,
            optimizer,
            data,
            synthetic,
        })
    }

    /// Opens `data.corpus_list` for this run (with the weight history of a checkpoint when
    /// resuming).
    fn open_blended(
        config: &Config,
        resume: Option<(serde_json::Value, u64)>,
    ) -> Result<BlendedSource, TrainError> {
        let t = &config.training;
        // Room for the batches that spike rollbacks skip beyond the planned steps.
        let batches = t.steps + (t.steps / 4).max(100);
        let total_samples = batches * (t.grad_accum_steps * t.batch_size) as u64;
        let list = Path::new(&config.data.corpus_list);
        let cache_dir = kiln_data::cache::cache_dir(Some(Path::new(&config.data.cache_dir)), list);
        BlendedSource::open(
            list,
            t.seq_len,
            t.seed,
            total_samples,
            cache_dir,
            config.data.full_verify,
            resume,
        )
        .map_err(|e| TrainError::Data(format!("data.corpus_list {}: {e}", list.display())))
    }

    /// Hash of what fixes parameter shapes (model section and vocab).
    pub fn model_hash(&self) -> String {
        let mut m = self.config.model.clone();
        m.vocab_size = self.model.vocab();
        // init values do not change shapes: a resumed run may use another init std
        m.init_std = 0.0;
        m.scale_residual_init = false;
        sha256_hex(&toml::to_string(&m).unwrap_or_default())
    }

    /// Parameters as named host tensors (logical shapes).
    pub fn host_params(&self) -> Vec<HostTensor> {
        self.model
            .specs()
            .iter()
            .zip(&self.params)
            .map(|(s, t)| HostTensor {
                name: s.name.clone(),
                shape: s.shape.clone(),
                values: to_vec(t),
            })
            .collect()
    }

    fn host_optimizer(&self) -> Vec<HostTensor> {
        let mut out = Vec::with_capacity(2 * self.params.len());
        for (i, s) in self.model.specs().iter().enumerate() {
            out.push(HostTensor {
                name: format!("{}.exp_avg", s.name),
                shape: s.shape.clone(),
                values: to_vec(&self.optimizer.exp_avg[i]),
            });
            out.push(HostTensor {
                name: format!("{}.exp_avg_sq", s.name),
                shape: s.shape.clone(),
                values: to_vec(&self.optimizer.exp_avg_sq[i]),
            });
        }
        out
    }

    /// Loads weights (by name) from host tensors; every parameter must be present with its shape.
    pub fn load_params(&mut self, tensors: &[HostTensor], origin: &Path) -> Result<(), TrainError> {
        self.params = self.lookup(tensors, "", origin)?;
        Ok(())
    }

    fn lookup(
        &self,
        tensors: &[HostTensor],
        suffix: &str,
        origin: &Path,
    ) -> Result<Vec<Tensor<1>>, TrainError> {
        let by_name: std::collections::HashMap<&str, &HostTensor> =
            tensors.iter().map(|t| (t.name.as_str(), t)).collect();
        self.model
            .specs()
            .iter()
            .map(|s| {
                let name = format!("{}{suffix}", s.name);
                let t = by_name
                    .get(name.as_str())
                    .ok_or_else(|| TrainError::ResumeMismatch {
                        path: origin.to_path_buf(),
                        reason: format!("tensor {name} is missing"),
                    })?;
                if t.shape != s.shape {
                    return Err(TrainError::ResumeMismatch {
                        path: origin.to_path_buf(),
                        reason: format!(
                            "tensor {name} has shape {:?}, the model needs {:?}",
                            t.shape, s.shape
                        ),
                    });
                }
                Ok(Tensor::from_data(
                    TensorData::new(t.values.clone(), [s.numel()]),
                    &self.device,
                ))
            })
            .collect()
    }

    /// Token ids `[rows, len]` as an Int tensor on `device`.
    pub fn int_tensor(rows: &[Vec<u32>], len: usize, device: &Device) -> Tensor<2, Int> {
        let flat: Vec<i64> = rows
            .iter()
            .flat_map(|r| r.iter().take(len).map(|&t| i64::from(t)))
            .collect();
        Tensor::from_data(TensorData::new(flat, [rows.len(), len]), device)
    }

    /// Loss of one batch of `seq_len + 1`-token rows without gradients (for eval).
    pub fn eval_loss(&self, rows: &[Vec<u32>]) -> f32 {
        let len = rows.first().map_or(0, Vec::len).saturating_sub(1);
        let inputs = Self::int_tensor(rows, len, &self.device);
        let shifted: Vec<Vec<u32>> = rows.iter().map(|r| r[1..].to_vec()).collect();
        let targets = Self::int_tensor(&shifted, len, &self.device);
        self.model
            .loss(&self.params, inputs, targets)
            .into_scalar::<f32>()
    }

    /// Held-out loss and answer accuracy on the synthetic corpus (`samples` sequences).
    pub fn evaluate_synthetic(
        &self,
        step: u64,
        samples: usize,
        unigram: Option<f64>,
    ) -> Option<EvalMetrics> {
        // No sequences, no evaluation (`eval.samples = 0`), rather than a loss of 0.
        if samples == 0 {
            return None;
        }
        let syn = self.synthetic.as_ref()?;
        let len = self.config.training.seq_len + 1;
        let batch = self.config.training.batch_size.max(1);
        let (mut loss_sum, mut n_batches, mut correct, mut total) =
            (0.0f64, 0usize, 0usize, 0usize);
        let mut idx = 0u64;
        while (idx as usize) < samples {
            let rows: Vec<_> = (0..batch.min(samples - idx as usize))
                .map(|r| syn.eval_sample(idx + r as u64, len))
                .collect();
            idx += rows.len() as u64;
            let tokens: Vec<Vec<u32>> = rows.iter().map(|s| s.tokens.clone()).collect();
            let inputs = Self::int_tensor(&tokens, len - 1, &self.device);
            let logits = self.model.forward(&self.params, inputs); // [b, t, v]
            let [b, t, v] = logits.dims();
            let shifted: Vec<Vec<u32>> = tokens.iter().map(|r| r[1..].to_vec()).collect();
            let targets = Self::int_tensor(&shifted, t, &self.device);
            let logp = burn::tensor::activation::log_softmax(logits.clone().reshape([b * t, v]), 1);
            loss_sum += f64::from(
                logp.gather(1, targets.reshape([b * t, 1]))
                    .mean()
                    .neg()
                    .into_scalar::<f32>(),
            );
            n_batches += 1;
            // `iter` converts from whatever int dtype the backend uses (flex: i32).
            let pred: Vec<i64> = logits.argmax(2).into_data().iter::<i64>().collect();
            for (r, sample) in rows.iter().enumerate() {
                for &(start, end) in &sample.answers {
                    // token at position p is predicted from position p-1
                    if start == 0 {
                        continue;
                    }
                    total += 1;
                    let ok = (start..end).all(|p| {
                        pred.get(r * t + p - 1).copied() == Some(i64::from(sample.tokens[p]))
                    });
                    correct += usize::from(ok);
                }
            }
        }
        Some(EvalMetrics {
            step,
            eval_loss: loss_sum / n_batches.max(1) as f64,
            eval_accuracy: (total > 0).then(|| correct as f64 / total as f64),
            unigram_loss: unigram,
            extra: serde_json::Map::new(),
        })
    }
}

/// Host copy of a flat tensor.
pub fn to_vec(t: &Tensor<1>) -> Vec<f32> {
    t.clone()
        .into_data()
        .try_to_vec::<f32>()
        .unwrap_or_default()
}

/// What a rollback restores.
#[derive(Clone)]
struct Snapshot {
    step: u64,
    tokens_seen: u64,
    params: Vec<Tensor<1>>,
    optimizer: AdamW,
    spike: SpikeDetector,
}

/// Options of one training run.
pub struct TrainOptions {
    /// The effective config.
    pub config: Config,
    /// Run directory (created if missing).
    pub run_dir: PathBuf,
}

/// Signals that ask the trainer to checkpoint and stop.
pub const STOP_SIGNALS: [i32; 3] = [
    signal_hook::consts::SIGTERM,
    signal_hook::consts::SIGUSR1,
    signal_hook::consts::SIGINT,
];

/// Trains according to `opts`, resuming from the newest valid checkpoint in the run
/// directory. Returns when all steps are done or a stop signal was handled.
pub fn train(opts: &TrainOptions, observer: &mut dyn Observer) -> Result<TrainReport, TrainError> {
    let started = Instant::now();
    let cfg = &opts.config;
    let run_dir = &opts.run_dir;
    let io = |path: &Path| {
        let path = path.to_path_buf();
        move |source| TrainError::Io { path, source }
    };
    std::fs::create_dir_all(run_dir).map_err(io(run_dir))?;
    let config_path = run_dir.join("config.toml");
    std::fs::write(&config_path, cfg.to_toml()).map_err(io(&config_path))?;
    let mut events = EventLog::open(run_dir, "train")?;
    let metrics_path = run_dir.join("metrics.jsonl");
    let mut metrics = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(&metrics_path)
        .map_err(io(&metrics_path))?;

    // Signals: remember the first stop signal; the loop checks it after every step.
    let stop = Arc::new(AtomicUsize::new(0));
    for sig in STOP_SIGNALS {
        signal_hook::flag::register_usize(sig, Arc::clone(&stop), sig as usize)
            .map_err(io(run_dir))?;
    }

    let mut s = Session::new(cfg)?;
    let model_hash = s.model_hash();
    let config_hash = sha256_hex(&cfg.to_toml());
    let total = cfg.training.steps;
    let ckpt_root = run_dir.join("checkpoints");

    let mut step = 0u64;
    let mut data_cursor = 0u64;
    let mut tokens_seen = 0u64;
    let mut spike = SpikeDetector::default();
    let mut nonfinite_skipped = 0u64;
    let mut rollbacks = 0u64;
    let mut resumed_from: Option<PathBuf> = None;

    if cfg.checkpoint.resume {
        let mut rejected = Vec::new();
        let found = checkpoint::load_latest_valid(&ckpt_root, |p, reason| {
            rejected.push((p.to_path_buf(), reason.to_string()))
        });
        for (p, reason) in &rejected {
            events.emit("checkpoint_rejected", json!({"path": p, "reason": reason}))?;
            observer.on_note(&format!("rejected checkpoint {}: {reason}", p.display()));
        }
        if let Some((dir, ck)) = found {
            let st: TrainState = serde_json::from_value(ck.state.clone()).map_err(|e| {
                TrainError::ResumeMismatch {
                    path: dir.join("state.json"),
                    reason: format!("unreadable state: {e}"),
                }
            })?;
            if st.model_hash != model_hash {
                return Err(TrainError::ResumeMismatch {
                    path: dir,
                    reason: "the model shape (model section or vocab) differs from the config that wrote it; \
                             use a new --run-dir, or restore the original [model] settings"
                        .into(),
                });
            }
            if let Some(schedule) = ck.state.get("data_schedule").filter(|v| !v.is_null()) {
                let per_batch = (cfg.training.grad_accum_steps * cfg.training.batch_size) as u64;
                let resume = Some((schedule.clone(), st.data_cursor * per_batch));
                s.data = Box::new(Session::open_blended(cfg, resume)?);
            }
            s.load_params(&ck.model, &dir)?;
            s.optimizer.exp_avg = s.lookup(&ck.optimizer, ".exp_avg", &dir)?;
            s.optimizer.exp_avg_sq = s.lookup(&ck.optimizer, ".exp_avg_sq", &dir)?;
            s.optimizer.step = st.optimizer_step;
            step = st.step;
            data_cursor = st.data_cursor;
            tokens_seen = st.tokens_seen;
            spike = st.spike_window.clone();
            nonfinite_skipped = st.nonfinite_skipped;
            rollbacks = st.rollbacks;
            if st.config_hash != config_hash {
                events.emit("config_changed", json!({"path": dir, "note": "hyper-parameters differ from the checkpoint's run"}))?;
            }
            events.emit("checkpoint_loaded", json!({"path": dir, "step": step}))?;
            events.emit(
                "resume",
                json!({"step": step, "data_cursor": data_cursor, "path": dir}),
            )?;
            observer.on_note(&format!("resumed from {} (step {step})", dir.display()));
            resumed_from = Some(dir);
        }
    }
    events.emit(
        "start",
        json!({
            "step": step, "total_steps": total, "params": s.model.num_params(), "device": cfg.training.device,
            "data": s.data.describe(), "resumed_from": resumed_from, "config_hash": config_hash, "pid": std::process::id(),
        }),
    )?;

    let frozen: Vec<bool> = s
        .model
        .specs()
        .iter()
        .map(|p| !cfg.debug.freeze_params.is_empty() && p.name.contains(&cfg.debug.freeze_params))
        .collect();
    let unigram = s
        .synthetic
        .as_ref()
        .map(|syn| syn.unigram_entropy(64, cfg.training.seq_len + 1));
    let flops_per_token = s.model.flops_per_token(cfg.training.seq_len);
    let peak_flops = if cfg.training.peak_flops > 0.0 {
        cfg.training.peak_flops
    } else {
        // A rough CPU peak: 32 f32 FLOP/cycle (two AVX2 FMA units) at 2.5 GHz per thread.
        let threads = if cfg.training.threads > 0 {
            cfg.training.threads
        } else {
            rayon::current_num_threads()
        };
        threads as f64 * 80e9
    };
    let progress_dir = std::env::var_os(kiln_run::PROGRESS_DIR_ENV).map(PathBuf::from);
    // The rank names this process's beacon; a malformed rank environment is an error.
    let rank_env = kiln_topology::RankEnv::from_process_env()
        .map_err(|e| TrainError::Data(format!("rank environment: {e}")))?;
    if rank_env.world_size > 1 {
        return Err(TrainError::Data(format!(
            "WORLD_SIZE={} but data-parallel training (gradient all-reduce) is not built yet; run one rank",
            rank_env.world_size
        )));
    }
    let rank = rank_env.rank;
    let beacon = |step: u64, phase: &str| {
        if let Some(dir) = &progress_dir {
            let _ = kiln_run::write_beacon(dir, rank, step, phase, kiln_run::unix_time());
        }
    };

    let ad_device = s.device.clone().autodiff();
    let (batch, seq, accum) = (
        cfg.training.batch_size,
        cfg.training.seq_len,
        cfg.training.grad_accum_steps,
    );
    let fresh = resumed_from.is_none() && step == 0;
    let snapshot_every = cfg.guards.snapshot_interval;
    // The data cursor is not restored by a rollback: the batches after it are skipped.
    let take_snapshot = |s: &Session, step, tokens_seen, spike: &SpikeDetector| Snapshot {
        step,
        tokens_seen,
        params: s.params.clone(),
        optimizer: s.optimizer.clone(),
        spike: spike.clone(),
    };
    let mut snapshot = (snapshot_every > 0 && step.is_multiple_of(snapshot_every))
        .then(|| take_snapshot(&s, step, tokens_seen, &spike));
    let mut nonfinite_in_row = 0u32;
    let mut last_loss = None;
    let mut last_eval = None;
    let mut last_frozen_check: Option<Vec<Tensor<1>>> = None;
    let mut saved_at = resumed_from.as_ref().map(|_| step);

    let save = |s: &Session,
                events: &mut EventLog,
                step,
                data_cursor,
                tokens_seen,
                spike: &SpikeDetector,
                lr,
                nonfinite_skipped,
                rollbacks|
     -> Result<PathBuf, TrainError> {
        let t0 = Instant::now();
        let state = TrainState {
            step,
            tokens_seen,
            data_cursor,
            seed: cfg.training.seed,
            optimizer_step: s.optimizer.step,
            schedule: format!("{:?}", cfg.lr_scheduler.kind).to_lowercase(),
            lr,
            model_hash: model_hash.clone(),
            config_hash: config_hash.clone(),
            spike_window: spike.clone(),
            nonfinite_skipped,
            rollbacks,
            kiln_version: env!("CARGO_PKG_VERSION").to_string(),
        };
        let ck = Checkpoint {
            step,
            model: s.host_params(),
            optimizer: s.host_optimizer(),
            state: {
                let mut v = serde_json::to_value(&state).unwrap_or_default();
                if let (Some(obj), Some(schedule)) = (v.as_object_mut(), s.data.resume_state()) {
                    obj.insert("data_schedule".into(), schedule);
                }
                v
            },
        };
        let dir = checkpoint::save(&ckpt_root, &ck)?;
        let pruned = checkpoint::prune(&ckpt_root, cfg.checkpoint.keep_latest_k)?;
        events.emit("checkpoint_saved", json!({"step": step, "path": dir, "seconds": t0.elapsed().as_secs_f64(), "pruned": pruned}))?;
        Ok(dir)
    };

    let mut lr = optim::lr_at(&cfg.lr_scheduler, cfg.optimizer.lr, step, total);
    while step < total {
        let t0 = Instant::now();
        beacon(step, "train");
        lr = optim::lr_at(&cfg.lr_scheduler, cfg.optimizer.lr, step, total);
        // ---- forward/backward over the micro-batches of this step
        let mut grads: Option<Vec<Tensor<1>>> = None;
        let mut loss_sum = 0.0f32;
        for micro in 0..accum {
            let base = (data_cursor * accum as u64 + micro as u64) * batch as u64;
            let rows: Vec<Vec<u32>> = (0..batch as u64)
                .map(|r| s.data.sample(base + r, seq + 1))
                .collect::<Result<_, _>>()
                .map_err(TrainError::Data)?;
            let rows = if cfg.debug.spike_at_step > 0 && data_cursor + 1 == cfg.debug.spike_at_step
            {
                corrupt_batch(&rows, s.model.vocab(), cfg.training.seed)
            } else {
                rows
            };
            let poison = cfg.debug.nan_at_step > 0 && data_cursor + 1 == cfg.debug.nan_at_step;
            let shards = cfg.training.compute_shards.max(1);
            let (loss_value, micro_grads) = loss_and_grads(
                &s.model,
                &s.params,
                &rows,
                seq,
                &ad_device,
                1.0 / accum as f64,
                shards,
                poison,
            );
            loss_sum += loss_value;
            grads = Some(match grads {
                None => micro_grads,
                Some(acc) => acc
                    .into_iter()
                    .zip(micro_grads)
                    .map(|(a, b)| a + b)
                    .collect(),
            });
        }
        let grads = grads.unwrap_or_default();
        let loss = loss_sum;
        let grad_norm = optim::global_norm(&grads);

        // ---- guards
        if !loss.is_finite() || !grad_norm.is_finite() {
            nonfinite_skipped += 1;
            nonfinite_in_row += 1;
            data_cursor += 1;
            events.emit("nonfinite_skip", json!({"step": step, "loss": loss.to_string(), "grad_norm": grad_norm.to_string(), "in_row": nonfinite_in_row}))?;
            observer.on_note(&format!(
                "step {}: non-finite loss/gradients, step skipped",
                step + 1
            ));
            if nonfinite_in_row >= cfg.guards.max_nonfinite_in_row {
                let Some(snap) = snapshot.clone() else {
                    return Err(TrainError::Guard(format!(
                        "{nonfinite_in_row} non-finite steps in a row and no snapshot to roll back to"
                    )));
                };
                events.emit("rollback", json!({"from_step": step, "to_step": snap.step, "reason": "nonfinite", "data_cursor": data_cursor}))?;
                (step, tokens_seen) = (snap.step, snap.tokens_seen);
                s.params = snap.params;
                s.optimizer = snap.optimizer;
                spike = snap.spike;
                rollbacks += 1;
                nonfinite_in_row = 0;
            }
            continue;
        }
        nonfinite_in_row = 0;
        if fresh && step == 0 {
            if let Some(msg) =
                guards::check_initial_loss(loss, s.model.vocab(), cfg.guards.initial_loss_tolerance)
            {
                events.emit(
                    "initial_loss_error",
                    json!({"loss": loss, "vocab": s.model.vocab(), "message": msg}),
                )?;
                return Err(TrainError::Guard(msg));
            }
            events.emit(
                "initial_loss_ok",
                json!({"loss": loss, "expected": (s.model.vocab() as f64).ln()}),
            )?;
        }
        if let LossVerdict::Spike { loss, mean, std } = spike.observe(loss, &cfg.guards) {
            let skip = cfg.guards.spike_skip_batches;
            events.emit(
                "loss_spike",
                json!({"step": step + 1, "loss": loss, "window_mean": mean, "window_std": std}),
            )?;
            match snapshot.clone() {
                Some(snap) => {
                    let new_cursor = data_cursor + 1 + skip;
                    events.emit(
                        "rollback",
                        json!({"from_step": step, "to_step": snap.step, "reason": "loss_spike", "skip_batches": skip, "data_cursor": new_cursor}),
                    )?;
                    observer.on_note(&format!(
                        "step {}: loss spike {loss:.3} (window mean {mean:.3}); rolled back to step {} and skipped {skip} batches",
                        step + 1,
                        snap.step
                    ));
                    (step, tokens_seen) = (snap.step, snap.tokens_seen);
                    s.params = snap.params;
                    s.optimizer = snap.optimizer;
                    spike = snap.spike;
                    data_cursor = new_cursor;
                    rollbacks += 1;
                    continue;
                }
                None => {
                    // Without a snapshot, at least do not learn from the spiking batch.
                    data_cursor += 1;
                    events.emit(
                        "spike_skip",
                        json!({"step": step + 1, "note": "no snapshot; batch skipped"}),
                    )?;
                    continue;
                }
            }
        }

        // ---- update
        let grads = optim::clip_by_global_norm(grads, grad_norm, cfg.optimizer.max_grad_norm);
        s.optimizer.update(&mut s.params, grads, lr, &frozen);
        step += 1;
        data_cursor += 1;
        tokens_seen += (batch * seq * accum) as u64;
        last_loss = Some(loss);

        let dt = t0.elapsed().as_secs_f64();
        let tps = (batch * seq * accum) as f64 / dt.max(1e-9);
        let m = StepMetrics {
            step,
            total_steps: total,
            loss,
            grad_norm,
            lr,
            tokens_per_s: tps,
            step_time_s: dt,
            mfu: tps * flops_per_token / peak_flops,
            rss_mib: rss_mib(),
            tokens_seen,
        };
        if step.is_multiple_of(cfg.metrics.log_interval.max(1)) || step == total {
            let mut line = serde_json::to_vec(&m).unwrap_or_default();
            line.push(b'\n');
            metrics.write_all(&line).map_err(io(&metrics_path))?;
        }
        observer.on_step(&m);

        if snapshot_every > 0 && step.is_multiple_of(snapshot_every) {
            snapshot = Some(take_snapshot(&s, step, tokens_seen, &spike));
        }
        let frozen_every = cfg.guards.frozen_check_interval;
        if frozen_every > 0 && step.is_multiple_of(frozen_every) {
            if let Some(prev) = &last_frozen_check {
                let unchanged = unchanged_params(&s.params, prev);
                if !unchanged.is_empty() {
                    let names: Vec<&str> = unchanged
                        .iter()
                        .map(|&i| s.model.specs()[i].name.as_str())
                        .collect();
                    events.emit(
                        "frozen_params",
                        json!({"step": step, "since_step": step - frozen_every, "params": names}),
                    )?;
                    observer.on_note(&format!("step {step}: {} parameter tensors did not change in {frozen_every} steps: {}", names.len(), names.join(", ")));
                }
            }
            last_frozen_check = Some(s.params.clone());
        }
        let eval_every = cfg.eval.interval;
        if (eval_every > 0 && step.is_multiple_of(eval_every)) || step == total {
            beacon(step, "eval");
            if let Some(mut e) = s.evaluate_synthetic(step, cfg.eval.samples, unigram) {
                e.extra = observer.extra_eval(&s);
                let mut line = serde_json::to_vec(&e).unwrap_or_default();
                line.push(b'\n');
                metrics.write_all(&line).map_err(io(&metrics_path))?;
                observer.on_eval(&e);
                last_eval = Some(e);
            }
        }
        let signal = stop.load(Ordering::SeqCst);
        let interval_due =
            cfg.checkpoint.interval > 0 && step.is_multiple_of(cfg.checkpoint.interval);
        if interval_due || step == total || signal != 0 {
            beacon(step, "checkpoint");
            let dir = save(
                &s,
                &mut events,
                step,
                data_cursor,
                tokens_seen,
                &spike,
                lr,
                nonfinite_skipped,
                rollbacks,
            )?;
            saved_at = Some(step);
            observer.on_note(&format!("saved {}", dir.display()));
        }
        if signal != 0 {
            events.emit("signal", json!({"signal": signal, "step": step}))?;
            events.emit(
                "exit",
                json!({"reason": "preempted", "code": kiln_run::EXIT_PREEMPTED, "step": step}),
            )?;
            return Ok(TrainReport {
                outcome: Outcome::Preempted {
                    signal: signal as i32,
                },
                step,
                last_loss,
                last_eval,
                seconds: started.elapsed().as_secs_f64(),
            });
        }
    }
    if saved_at != Some(step) {
        save(
            &s,
            &mut events,
            step,
            data_cursor,
            tokens_seen,
            &spike,
            lr,
            nonfinite_skipped,
            rollbacks,
        )?;
    }
    // The final weights also at the top of the run directory, for eval and export.
    let final_path = run_dir.join("model.safetensors");
    let bytes = checkpoint::to_safetensors(&s.host_params()).map_err(|e| TrainError::Io {
        path: final_path.clone(),
        source: std::io::Error::other(e.to_string()),
    })?;
    let tmp = run_dir.join(".model.safetensors.tmp");
    std::fs::write(&tmp, bytes)
        .and_then(|()| std::fs::rename(&tmp, &final_path))
        .map_err(io(&final_path))?;
    beacon(step, "done");
    events.emit(
        "exit",
        json!({"reason": "completed", "code": 0, "step": step}),
    )?;
    Ok(TrainReport {
        outcome: Outcome::Completed,
        step,
        last_loss,
        last_eval,
        seconds: started.elapsed().as_secs_f64(),
    })
}

/// Mean loss of `rows` times `scale`, and its gradients, computed as `shards` pieces on as
/// many threads and summed in a fixed order (deterministic whatever the scheduling).
///
/// Why shards: burn's flex backend runs element-wise kernels on one thread, and they are
/// about 40% of a step; two shards on two threads keep both cores busy through them. The
/// math is gradient accumulation over the shards, exact up to f32 summation order.
/// `poison` (debug.nan_at_step) makes the loss NaN, as a real overflow would.
#[allow(clippy::too_many_arguments)]
fn loss_and_grads(
    model: &Llama,
    params: &[Tensor<1>],
    rows: &[Vec<u32>],
    seq: usize,
    device: &Device,
    scale: f64,
    shards: usize,
    poison: bool,
) -> (f32, Vec<Tensor<1>>) {
    let one = |chunk: &[Vec<u32>], scale: f64, poison: bool| {
        let inputs = Session::int_tensor(chunk, seq, device);
        let shifted: Vec<Vec<u32>> = chunk.iter().map(|r| r[1..].to_vec()).collect();
        let targets = Session::int_tensor(&shifted, seq, device);
        let leaves: Vec<Tensor<1>> = params
            .iter()
            .map(|p| p.clone().autodiff().require_grad())
            .collect();
        let mut loss = model.loss(&leaves, inputs, targets);
        if scale != 1.0 {
            loss = loss.mul_scalar(scale);
        }
        let mut value = loss.clone().into_scalar::<f32>();
        if poison {
            loss = loss.mul_scalar(f64::NAN);
            value = f32::NAN;
        }
        let g = loss.backward();
        let grads: Vec<Tensor<1>> = leaves
            .iter()
            .zip(params)
            .map(|(leaf, p)| leaf.grad(&g).unwrap_or_else(|| p.zeros_like()))
            .collect();
        (value, grads)
    };
    let shards = shards.min(rows.len()).max(1);
    if shards == 1 {
        return one(rows, scale, poison);
    }
    let per = rows.len().div_ceil(shards);
    let n = rows.len() as f64;
    let results: Vec<(f32, Vec<Tensor<1>>)> = std::thread::scope(|scope| {
        let handles: Vec<_> = rows
            .chunks(per)
            .enumerate()
            .map(|(i, chunk)| {
                let shard_scale = scale * chunk.len() as f64 / n;
                scope.spawn(move || one(chunk, shard_scale, poison && i == 0))
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().unwrap_or_else(|e| std::panic::resume_unwind(e)))
            .collect()
    });
    let mut iter = results.into_iter();
    let (mut loss, mut grads) = iter.next().unwrap_or_default();
    for (l, g) in iter {
        loss += l;
        grads = grads.into_iter().zip(g).map(|(a, b)| a + b).collect();
    }
    (loss, grads)
}

/// Indices of parameters identical to `prev` (one host read-back for all of them).
fn unchanged_params(params: &[Tensor<1>], prev: &[Tensor<1>]) -> Vec<usize> {
    let diffs: Vec<Tensor<1>> = params
        .iter()
        .zip(prev)
        .map(|(a, b)| (a.clone() - b.clone()).abs().max())
        .collect();
    if diffs.is_empty() {
        return Vec::new();
    }
    let d = Tensor::cat(diffs, 0)
        .into_data()
        .try_to_vec::<f32>()
        .unwrap_or_default();
    d.iter()
        .enumerate()
        .filter(|(_, v)| **v == 0.0)
        .map(|(i, _)| i)
        .collect()
}

/// The injected spike (`debug.spike_at_step`): the batch replaced by uniformly random tokens
/// (a garbage shard), drawn deterministically from the seed.
fn corrupt_batch(rows: &[Vec<u32>], vocab: usize, seed: u64) -> Vec<Vec<u32>> {
    use rand::{Rng, SeedableRng};
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed ^ 0x5EED_BAD0);
    rows.iter()
        .map(|r| r.iter().map(|_| rng.gen_range(0..vocab as u32)).collect())
        .collect()
}

//! The run's state: [`RunState`], the one owned state a run trains and a checkpoint saves and
//! restores (the model's parameters, the optimizer, the data and the [`TrainState`]), and
//! [`TrainState`]: everything besides weights and optimizer moments that decides what the
//! next step computes, written as `state.json` into every checkpoint, so a run killed
//! anywhere and resumed continues exactly.

use crate::data::TrainData;
use crate::loss_checks::SpikeDetector;
use crate::model::session::Session;
use crate::optim::Optimizer;
use serde::{Deserialize, Serialize};

/// The run's one owned state: what the step trains, the guards roll back and the
/// checkpoint lifecycle ([`crate::components::checkpoints`]) saves and restores.
pub struct RunState {
    /// The model and its parameters (in a parameter-sharded run, this rank's pieces).
    pub session: Session,
    /// The optimizer and its state.
    pub optimizer: Optimizer,
    /// The exact-resume state.
    pub state: TrainState,
    /// Where the tokens come from (its cursor is in `state`).
    pub data: TrainData,
}

/// The exact-resume state of a run (`state.json` of a checkpoint).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TrainState {
    /// Optimizer steps completed.
    pub step: u64,
    /// Tokens trained on (all ranks together).
    pub tokens_seen: u64,
    /// Batches consumed from the data (steps plus skipped batches).
    pub data_cursor: u64,
    /// Global samples consumed (steps and skipped batches, all ranks): the data cursor in
    /// samples, which stays right when the global batch size changes. Absent in checkpoints
    /// of kiln before data-parallel training: derived from `data_cursor` on load.
    #[serde(default)]
    pub sample_cursor: Option<u64>,
    /// Seed of init and data order (the RNG state: every draw is a function of it and a counter).
    pub seed: u64,
    /// Optimizer updates applied.
    pub optimizer_step: u64,
    /// The optimizer whose state the checkpoint holds (`optimizer.kind`; checkpoints from
    /// before there was a choice hold AdamW's).
    #[serde(default = "adamw")]
    pub optimizer: String,
    /// The optimizer's scalars beside its tensors (Schedule-Free's `lr_max`, `weight_sum`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub optimizer_scalars: Vec<(String, f64)>,
    /// LR schedule kind.
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
    /// Rollbacks performed.
    pub rollbacks: u64,
    /// kiln version that wrote it.
    pub kiln_version: String,
    /// The lineage of the run: set when a run starts afresh, kept by every resume. Retention
    /// deletes only checkpoints of the same lineage.
    #[serde(default)]
    pub run_id: String,
    /// Samples per optimizer step, all ranks together (0 in old checkpoints).
    #[serde(default)]
    pub global_batch: u64,
    /// Data-parallel ranks of the run that wrote it (0 in old checkpoints: one).
    #[serde(default)]
    pub world_size: u64,
    /// The blend's weight history (real data only), handed back to the loader on resume.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub data_schedule: Option<serde_json::Value>,
}

impl TrainState {
    /// The state of a run starting at step 0.
    pub fn fresh(seed: u64, run_id: String, global_batch: u64, world_size: u64) -> Self {
        Self {
            step: 0,
            tokens_seen: 0,
            data_cursor: 0,
            sample_cursor: Some(0),
            seed,
            optimizer_step: 0,
            optimizer: adamw(),
            optimizer_scalars: Vec::new(),
            schedule: String::new(),
            lr: 0.0,
            model_hash: String::new(),
            config_hash: String::new(),
            spike_window: SpikeDetector::default(),
            nonfinite_skipped: 0,
            rollbacks: 0,
            kiln_version: env!("CARGO_PKG_VERSION").to_string(),
            run_id,
            global_batch,
            world_size,
            data_schedule: None,
        }
    }

    /// The state a checkpoint's `state.json` resumes: refused (with the reason) when the
    /// model shape differs (`model_hash`); checkpoints of kiln before data parallelism (no
    /// global batch) get the config's one-rank global batch. The sample cursor is fixed to
    /// the next step's first sample, so a later change of layout cannot move it.
    pub fn from_checkpoint(
        value: &serde_json::Value,
        cfg: &crate::config::Config,
        model_hash: &str,
    ) -> Result<Self, String> {
        let mut st: Self =
            serde_json::from_value(value.clone()).map_err(|e| format!("unreadable state: {e}"))?;
        if st.model_hash != model_hash {
            return Err(
                "the model shape (model section or vocab) differs from the config that wrote it; \
                 use a new --run-dir, or restore the original [model] settings"
                    .into(),
            );
        }
        if st.global_batch == 0 {
            st.global_batch = (cfg.training.batch_size * cfg.training.grad_accum_steps) as u64;
            st.world_size = 1;
        }
        st.sample_cursor = Some(st.next_sample());
        let kind = cfg.optimizer.kind.name();
        if st.optimizer != kind {
            return Err(format!(
                "its optimizer state is {}'s and this config says optimizer.kind = {kind:?}; resume with optimizer.kind = {:?}, or start afresh (a new --run-dir, or checkpoint.resume = false)",
                st.optimizer, st.optimizer
            ));
        }
        Ok(st)
    }

    /// The first global sample of the next step.
    pub fn next_sample(&self) -> u64 {
        self.sample_cursor
            .unwrap_or(self.data_cursor * self.global_batch)
    }

    /// Moves the data cursor past `batches` batches of `global_batch` samples.
    pub fn advance_data(&mut self, batches: u64) {
        self.sample_cursor = Some(self.next_sample() + batches * self.global_batch);
        self.data_cursor += batches;
    }
}

fn adamw() -> String {
    crate::config::OptimizerKind::Adamw.name().to_string()
}

/// A new lineage id: time, host and process, unique enough to tell runs in one directory
/// apart (it is compared, never parsed).
pub fn new_run_id() -> String {
    use sha2::{Digest, Sha256};
    let seed = format!(
        "{} {} {}",
        kiln_run::unix_time(),
        kiln_run::host_name(),
        std::process::id()
    );
    hex::encode(&Sha256::digest(seed.as_bytes())[..8])
}

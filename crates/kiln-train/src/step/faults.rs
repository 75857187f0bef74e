//! [`Faults`]: the debug fault hooks (`[debug]`: NaN at a batch, a garbage batch, frozen
//! parameters, a corrupted replica), behind the one seam the step calls, so the real path
//! reads clean and a test can make every guard fire on purpose.

use crate::config::{Config, DebugConfig};
use crate::model::ParamSpec;
use burn::tensor::Tensor;

/// The faults a run injects (none unless `[debug]` asks).
#[derive(Debug, Clone)]
pub struct Faults {
    debug: DebugConfig,
    seed: u64,
}

/// A micro-batch as the step trains on it.
pub struct Injected {
    /// The token rows (the data's, or garbage at `debug.spike_at_step`).
    pub rows: Vec<Vec<u32>>,
    /// Make the loss NaN, as a real overflow would (`debug.nan_at_step`).
    pub poison: bool,
}

impl Faults {
    /// The faults `cfg` asks for.
    pub fn new(cfg: &Config) -> Self {
        Self {
            debug: cfg.debug.clone(),
            seed: cfg.training.seed,
        }
    }

    /// The rows of a micro-batch of data batch `batch_no` (1-based), with the fault due there.
    pub fn micro_batch(&self, batch_no: u64, rows: Vec<Vec<u32>>, vocab: usize) -> Injected {
        let at = |n: u64| n > 0 && batch_no == n;
        let rows = if at(self.debug.spike_at_step) {
            corrupt_batch(&rows, vocab, self.seed)
        } else {
            rows
        };
        Injected {
            rows,
            poison: at(self.debug.nan_at_step),
        }
    }

    /// The loss a step reports, `loss` being the true one over `dp` data-parallel ranks
    /// (`debug.wrong_loss_reduction` divides it by `dp` once more).
    pub fn reported_loss(&self, loss: f32, dp: usize) -> f32 {
        match self.debug.wrong_loss_reduction {
            true => loss / dp as f32,
            false => loss,
        }
    }

    /// Which parameters the update leaves alone (`debug.freeze_params`: a name fragment).
    pub fn frozen(&self, specs: &[ParamSpec]) -> Vec<bool> {
        let pattern = &self.debug.freeze_params;
        specs
            .iter()
            .map(|p| !pattern.is_empty() && p.name.contains(pattern))
            .collect()
    }

    /// After the update that completed `step`: perturbs rank `rank`'s parameters as silent
    /// data corruption would (`debug.corrupt_replica_*`).
    pub fn after_update(&self, step: u64, rank: usize, params: &mut [Tensor<1>]) {
        let d = &self.debug;
        if d.corrupt_replica_at_step > 0
            && step == d.corrupt_replica_at_step
            && rank == d.corrupt_replica_rank
            && let Some(p) = params.first_mut()
        {
            *p = p.clone().add_scalar(1e-3);
        }
    }
}

/// The injected spike: the batch replaced by uniformly random tokens (a garbage shard), drawn
/// deterministically from the seed.
fn corrupt_batch(rows: &[Vec<u32>], vocab: usize, seed: u64) -> Vec<Vec<u32>> {
    use rand::{Rng, SeedableRng};
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed ^ 0x5EED_BAD0);
    rows.iter()
        .map(|r| r.iter().map(|_| rng.gen_range(0..vocab as u32)).collect())
        .collect()
}

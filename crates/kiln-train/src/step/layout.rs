//! [`BatchLayout`]: which global samples each rank trains on at each step.

use crate::config::TrainingConfig;
use crate::mesh::{DeviceMesh, Dims};
use std::ops::Range;

/// How the global batch of a step is cut: `world` ranks, each running `accum` micro-batches
/// of `micro` sequences of `seq` tokens.
///
/// Step samples are the global sample ids `[base, base + global_batch)`; rank `r`'s
/// micro-batch `m` takes the `micro` ids starting at `base + (m * world + r) * micro`. The
/// set of samples of a step does not depend on `world`, so a run resumed on another number
/// of ranks trains on exactly the same samples at every step.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BatchLayout {
    /// Sequences per micro-batch per rank (`training.batch_size`).
    pub micro: usize,
    /// Micro-batches per step.
    pub accum: usize,
    /// Data-parallel ranks.
    pub world: usize,
    /// This rank's index among them.
    pub rank: usize,
    /// Tokens per sequence.
    pub seq: usize,
}

impl BatchLayout {
    /// The layout of `training` on `world` ranks (`training.global_batch_size`, when set,
    /// fixes the accumulation).
    pub fn new(training: &TrainingConfig, rank: usize, world: usize) -> Result<Self, String> {
        let layout = Self {
            micro: training.batch_size,
            accum: training.grad_accum_steps,
            world: world.max(1),
            rank,
            seq: training.seq_len,
        };
        if training.global_batch_size > 0 {
            layout.with_global_batch(training.global_batch_size)
        } else {
            Ok(layout)
        }
    }

    /// The layout of `training` on `mesh`'s data-parallel ranks (the ranks of one
    /// data-parallel index train on the same samples).
    pub fn of(training: &TrainingConfig, mesh: &DeviceMesh) -> Result<Self, String> {
        let ranks = mesh.shape().group_size(Dims::DP);
        Self::new(training, mesh.index(Dims::DP), ranks)
    }

    /// This layout with the accumulation that makes the global batch `global`.
    pub fn with_global_batch(self, global: u64) -> Result<Self, String> {
        let per_micro = (self.micro * self.world) as u64;
        if global == 0 || !global.is_multiple_of(per_micro) {
            return Err(format!(
                "the global batch of {global} sequences cannot be split over {} data-parallel rank(s) x batch_size {}: it must be a multiple of {per_micro}; change training.batch_size or the number of ranks",
                self.world, self.micro
            ));
        }
        Ok(Self {
            accum: (global / per_micro) as usize,
            ..self
        })
    }

    /// The layout a run resumed from a checkpoint of global batch `global` trains with: the
    /// checkpoint's global batch is kept (the accumulation adapts to the ranks) unless
    /// `training.global_batch_size` fixes another.
    pub fn resumed(self, training: &TrainingConfig, global: u64) -> Result<Self, String> {
        if training.global_batch_size == 0 && global != self.global_batch() {
            self.with_global_batch(global)
        } else {
            Ok(self)
        }
    }

    /// Sequences per optimizer step, all ranks together.
    pub fn global_batch(&self) -> u64 {
        (self.micro * self.accum * self.world) as u64
    }

    /// Global samples a run of `steps` steps may read, with room for the batches that spike
    /// rollbacks skip.
    pub fn samples_for(&self, steps: u64) -> u64 {
        (steps + (steps / 4).max(100)) * self.global_batch()
    }

    /// Global sample ids of this rank's micro-batch `m` of the step starting at `base`.
    pub fn rows(&self, base: u64, m: usize) -> Range<u64> {
        let start = base + ((m * self.world + self.rank) * self.micro) as u64;
        start..start + self.micro as u64
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn training(batch: usize, accum: usize) -> TrainingConfig {
        TrainingConfig {
            batch_size: batch,
            grad_accum_steps: accum,
            ..TrainingConfig::default()
        }
    }

    #[test]
    fn every_rank_count_trains_on_the_same_samples_per_step() {
        let one = BatchLayout::new(&training(2, 6), 0, 1).unwrap();
        let mut reference: Vec<u64> = (0..one.accum).flat_map(|m| one.rows(120, m)).collect();
        reference.sort_unstable();
        assert_eq!(reference, (120..132).collect::<Vec<_>>());
        for world in [2, 3, 6] {
            let mut got: Vec<u64> = (0..world)
                .flat_map(|rank| {
                    let l = BatchLayout::new(&training(2, 1), rank, world)
                        .unwrap()
                        .with_global_batch(12)
                        .unwrap();
                    (0..l.accum).flat_map(move |m| l.rows(120, m))
                })
                .collect();
            got.sort_unstable();
            assert_eq!(got, reference, "world {world}");
        }
        let err = BatchLayout::new(&training(2, 1), 0, 5)
            .unwrap()
            .with_global_batch(12)
            .unwrap_err();
        assert!(err.contains("multiple of 10"), "{err}");
    }
}

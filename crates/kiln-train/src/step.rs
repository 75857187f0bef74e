//! The arithmetic of one step, free of run-directory concerns: which global samples each
//! rank trains on ([`BatchLayout`]), the forward/backward pass ([`loss_and_grads`]),
//! gradients to and from the flat host buffer the all-reduce works on, and the checks on
//! parameters (frozen tensors, replica checksums).

use crate::config::TrainingConfig;
use crate::model::Llama;
use crate::session::Session;
use burn::tensor::{Device, FloatDType, Int, Tensor, TensorData};
use sha2::{Digest, Sha256};
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
    /// This rank.
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

    /// This layout with the accumulation that makes the global batch `global`.
    pub fn with_global_batch(self, global: u64) -> Result<Self, String> {
        let per_micro = (self.micro * self.world) as u64;
        if global == 0 || !global.is_multiple_of(per_micro) {
            return Err(format!(
                "the global batch of {global} sequences cannot be split over {} rank(s) x batch_size {}: it must be a multiple of {per_micro}; change training.batch_size or the number of ranks",
                self.world, self.micro
            ));
        }
        Ok(Self {
            accum: (global / per_micro) as usize,
            ..self
        })
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

/// Mean loss of `rows` times `scale`, and its gradients, computed as `shards` pieces on as
/// many threads and summed in a fixed order (deterministic whatever the scheduling).
///
/// Why shards: burn's flex backend runs element-wise kernels on one thread, and they are
/// about 40% of a step; two shards on two threads keep both cores busy through them. The
/// math is gradient accumulation over the shards, exact up to f32 summation order.
/// Gradients are f32 whatever the parameters' dtype.
#[allow(clippy::too_many_arguments)]
pub fn loss_and_grads(
    model: &Llama,
    params: &[Tensor<1>],
    rows: &[Vec<u32>],
    seq: usize,
    device: &Device,
    scale: f64,
    shards: usize,
    labels: Labels,
) -> (f32, Vec<Tensor<1>>) {
    let one = |chunk: &[Vec<u32>], scale: f64, shard: usize| {
        let inputs = Session::int_tensor(chunk, seq, device);
        let leaves: Vec<Tensor<1>> = params
            .iter()
            .map(|p| p.clone().autodiff().require_grad())
            .collect();
        let (mut loss, poison) = match labels {
            Labels::Data { poison } => {
                let shifted: Vec<Vec<u32>> = chunk.iter().map(|r| r[1..].to_vec()).collect();
                let targets = Session::int_tensor(&shifted, seq, device);
                (model.loss(&leaves, inputs, targets), poison && shard == 0)
            }
            Labels::Sampled { seed } => {
                let seed = seed ^ (shard as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15);
                (sampled_label_loss(model, &leaves, inputs, seed), false)
            }
        };
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
            .map(|(leaf, p)| {
                leaf.grad(&g)
                    .unwrap_or_else(|| p.zeros_like())
                    .cast(FloatDType::F32)
            })
            .collect();
        (value, grads)
    };
    let shards = shards.min(rows.len()).max(1);
    if shards == 1 {
        return one(rows, scale, 0);
    }
    let per = rows.len().div_ceil(shards);
    let n = rows.len() as f64;
    let results: Vec<(f32, Vec<Tensor<1>>)> = std::thread::scope(|scope| {
        let handles: Vec<_> = rows
            .chunks(per)
            .enumerate()
            .map(|(i, chunk)| {
                let shard_scale = scale * chunk.len() as f64 / n;
                scope.spawn(move || one(chunk, shard_scale, i))
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

/// What [`loss_and_grads`] computes the loss against.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Labels {
    /// The data's next tokens; `poison` (debug.nan_at_step) makes the loss NaN, as a real
    /// overflow would.
    Data {
        /// Inject a NaN.
        poison: bool,
    },
    /// Labels drawn from the model's own predictions with this seed: the gradient is
    /// SophiaG's Gauss-Newton-Bartlett sample.
    Sampled {
        /// Seed of the draws (a function of the run's seed, step and rank, for exact resume).
        seed: u64,
    },
}

/// Mean cross-entropy of the model's logits against labels sampled from its own softmax
/// (drawn on the host from a seeded ChaCha8 stream, so reproducible on every backend).
fn sampled_label_loss(
    model: &Llama,
    params: &[Tensor<1>],
    inputs: Tensor<2, Int>,
    seed: u64,
) -> Tensor<1> {
    use rand::{Rng, SeedableRng};
    let device = inputs.device();
    let [b, t] = inputs.dims();
    let v = model.vocab();
    let logp =
        burn::tensor::activation::log_softmax(model.forward(params, inputs).reshape([b * t, v]), 1);
    let host = crate::session::to_vec(&logp.clone().detach().reshape([b * t * v]));
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
    let labels: Vec<i64> = host
        .chunks_exact(v.max(1))
        .map(|row| {
            let u: f64 = rng.r#gen();
            let mut acc = 0.0f64;
            let pick = row.iter().position(|&lp| {
                acc += f64::from(lp).exp();
                acc > u
            });
            // Rounding can leave the total just under u: take the last token then.
            pick.unwrap_or(row.len() - 1) as i64
        })
        .collect();
    let labels = Tensor::<2, Int>::from_data(TensorData::new(labels, [b * t, 1]), &device);
    logp.gather(1, labels).mean().neg()
}

/// All tensors' values, concatenated on the host (what the all-reduce works on).
pub fn flatten(tensors: &[Tensor<1>]) -> Vec<f32> {
    if tensors.is_empty() {
        return Vec::new();
    }
    crate::session::to_vec(&Tensor::cat(tensors.to_vec(), 0))
}

/// Cuts `flat` back into tensors shaped like `like`, on `device`.
pub fn unflatten(flat: &[f32], like: &[Tensor<1>], device: &Device) -> Vec<Tensor<1>> {
    let mut at = 0;
    like.iter()
        .map(|t| {
            let n = t.dims()[0];
            let part = flat[at..at + n].to_vec();
            at += n;
            Tensor::from_data(TensorData::new(part, [n]), device)
        })
        .collect()
}

/// A 64-bit checksum of all parameter values (bit-exact: any flipped bit changes it).
pub fn params_checksum(params: &[Tensor<1>]) -> u64 {
    let flat = flatten(params);
    let digest = Sha256::digest(bytemuck::cast_slice::<f32, u8>(&flat));
    u64::from_le_bytes(digest[..8].try_into().unwrap_or([0; 8]))
}

/// Ranks whose value differs from the most common one (ties broken towards the value of
/// the lowest rank); empty when all agree.
pub fn minority_ranks(values: &[u64]) -> Vec<usize> {
    let majority = values
        .iter()
        .max_by_key(|v| {
            let count = values.iter().filter(|w| w == v).count();
            let first = values.iter().position(|w| w == *v).unwrap_or(0);
            (count, std::cmp::Reverse(first))
        })
        .copied();
    (0..values.len())
        .filter(|&r| Some(values[r]) != majority)
        .collect()
}

/// Indices of parameters identical to `prev` (one host read-back for all of them).
pub fn unchanged_params(params: &[Tensor<1>], prev: &[Tensor<1>]) -> Vec<usize> {
    let diffs: Vec<Tensor<1>> = params
        .iter()
        .zip(prev)
        .map(|(a, b)| {
            let (a, b) = (
                a.clone().cast(FloatDType::F32),
                b.clone().cast(FloatDType::F32),
            );
            (a - b).abs().max()
        })
        .collect();
    if diffs.is_empty() {
        return Vec::new();
    }
    let d = crate::session::to_vec(&Tensor::cat(diffs, 0));
    d.iter()
        .enumerate()
        .filter(|(_, v)| **v == 0.0)
        .map(|(i, _)| i)
        .collect()
}

/// The injected spike (`debug.spike_at_step`): the batch replaced by uniformly random tokens
/// (a garbage shard), drawn deterministically from the seed.
pub fn corrupt_batch(rows: &[Vec<u32>], vocab: usize, seed: u64) -> Vec<Vec<u32>> {
    use rand::{Rng, SeedableRng};
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed ^ 0x5EED_BAD0);
    rows.iter()
        .map(|r| r.iter().map(|_| rng.gen_range(0..vocab as u32)).collect())
        .collect()
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

    #[test]
    fn the_minority_is_named() {
        assert!(minority_ranks(&[5, 5, 5]).is_empty());
        assert_eq!(minority_ranks(&[5, 9, 5]), vec![1]);
        assert_eq!(minority_ranks(&[9, 5, 5]), vec![0]);
        // A tie: the value of the lowest rank is taken as the reference.
        assert_eq!(minority_ranks(&[5, 9]), vec![1]);
    }

    #[test]
    fn flatten_round_trips() {
        let d = Device::flex();
        let ts = vec![
            Tensor::<1>::from_floats([1.0, 2.0], &d),
            Tensor::<1>::from_floats([3.0], &d),
        ];
        let flat = flatten(&ts);
        assert_eq!(flat, [1.0, 2.0, 3.0]);
        let back = unflatten(&flat, &ts, &d);
        assert_eq!(flatten(&back), flat);
        assert_ne!(params_checksum(&ts), params_checksum(&back[..1]));
    }
}

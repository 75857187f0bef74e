//! One training step, the only one: [`Step`] computes a step's loss and gradients over this
//! rank's micro-batches ([`Step::gradients`]: forward, backward, the average over ranks,
//! the global norm) and applies them ([`Step::apply`]: clipping folded into the optimizer's
//! pass, then SophiaG's Hessian estimate when it is due). The trainer, lr-find and the
//! profiling example all call it, so a change to the step is made once. [`BatchLayout`]
//! says which global samples each rank trains on.

use crate::config::{Config, TrainingConfig};
use crate::data::{SampleError, TokenSource};
use crate::error::TrainError;
use crate::faults::Faults;
use crate::model::Llama;
use crate::nccl::Nccl;
use crate::optim::{self, Optimizer};
use crate::session::Session;
use crate::shard::{ShardPlan, StageShards};
use crate::stagewise;
use crate::tensor::{int_tensor, target_tensor};
use burn::tensor::{FloatDType, Int, Tensor, TensorData};
use kiln_dist::{BucketedAllReduce, Collective};
use std::ops::Range;
use std::time::Instant;

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

/// Where a step reads: the global sample its batch starts at and the data batch's number
/// (1-based, what the debug faults are keyed on).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct At {
    /// First global sample of the step.
    pub base: u64,
    /// The data batch (`TrainState::data_cursor + 1`).
    pub batch_no: u64,
}

/// One step's loss and gradients, averaged over all ranks.
pub struct Gradients {
    /// The step they were computed at.
    pub at: At,
    /// Mean loss over the global batch.
    pub loss: f32,
    /// Gradients (f32 whatever the parameters' dtype); in a sharded run this rank's range
    /// of each (see [`ShardPlan::pieces`]).
    pub grads: Vec<Tensor<1>>,
    /// Their global norm (over all ranks' ranges in a sharded run), before clipping.
    pub norm: f32,
    /// Seconds spent averaging over the ranks (0 with one rank).
    pub allreduce_s: f64,
}

/// What the loss is computed against.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Labels {
    /// The data's next tokens; `poison` makes the loss NaN (a debug fault).
    Data { poison: bool },
    /// Labels drawn from the model's own predictions with this seed: the gradient is
    /// SophiaG's Gauss-Newton-Bartlett sample.
    Sampled { seed: u64 },
}

/// The step of a run (see the module documentation).
pub struct Step<'c> {
    layout: BatchLayout,
    /// Threads a micro-batch's forward/backward is split over (`training.compute_shards`).
    shards: usize,
    max_grad_norm: f64,
    seed: u64,
    frozen: Vec<bool>,
    faults: Faults,
    allreduce: BucketedAllReduce,
    /// What this rank keeps of a sharded run (`parallelism.shard`).
    shard: Option<ShardPlan>,
    /// The gradient average on the devices (CUDA: NCCL), else staged through host memory.
    nccl: Option<Nccl>,
    comm: &'c dyn Collective,
}

impl Step<'static> {
    /// The step of `cfg` on one rank, outside a data-parallel job (lr-find, profiling).
    pub fn single(cfg: &Config, session: &Session) -> Result<Self, TrainError> {
        let layout = BatchLayout::new(&cfg.training, 0, 1).map_err(TrainError::Parallel)?;
        // One rank keeps everything, whatever the config shards.
        Ok(Self::with_plan(
            cfg,
            session,
            layout,
            &kiln_dist::Solo,
            None,
        ))
    }
}

impl<'c> Step<'c> {
    /// The step of `cfg` for `session`'s model on `layout`, averaging over `comm`'s ranks
    /// (every rank calls it); an error when the ranks cannot form the config's replicas.
    pub fn new(
        cfg: &Config,
        session: &Session,
        layout: BatchLayout,
        comm: &'c dyn Collective,
    ) -> Result<Self, TrainError> {
        let plan = ShardPlan::new(cfg, &session.model, comm)?;
        // The sharded modes' reduce-scatter and all-gather stay host-staged (see `nccl`).
        let nccl = match plan.is_none() && comm.size() > 1 {
            true => Nccl::join(comm, &session.device)?,
            false => None,
        };
        Ok(Self {
            nccl,
            ..Self::with_plan(cfg, session, layout, comm, plan)
        })
    }

    /// The step of `cfg` with the sharding `shard`.
    fn with_plan(
        cfg: &Config,
        session: &Session,
        layout: BatchLayout,
        comm: &'c dyn Collective,
        shard: Option<ShardPlan>,
    ) -> Self {
        let faults = Faults::new(cfg);
        Self {
            layout,
            shards: cfg.training.compute_shards.max(1),
            max_grad_norm: cfg.optimizer.max_grad_norm,
            seed: cfg.training.seed,
            frozen: faults.frozen(session.model.specs()),
            faults,
            allreduce: BucketedAllReduce::new(cfg.parallelism.bucket_mb.max(1) << 20),
            shard,
            nccl: None,
            comm,
        }
    }

    /// What this rank keeps of a sharded run, if it is one.
    pub fn shard(&self) -> Option<&ShardPlan> {
        self.shard.as_ref()
    }

    /// The plan of a parameter-sharded run, whose ranks keep only their pieces of the
    /// parameters (`parallelism.shard = "parameters"`).
    pub fn parameter_shards(&self) -> Option<&ShardPlan> {
        self.shard.as_ref().filter(|p| p.shards_parameters())
    }

    /// How the global batch is cut over the ranks.
    pub fn layout(&self) -> &BatchLayout {
        &self.layout
    }

    /// Another layout (a run resumed on another number of ranks keeps its global batch).
    pub fn set_layout(&mut self, layout: BatchLayout) {
        self.layout = layout;
    }

    /// The debug faults this step injects.
    pub fn faults(&self) -> &Faults {
        &self.faults
    }

    /// Loss and gradients of the step at `at` against the data, averaged over all ranks.
    pub fn gradients(
        &self,
        session: &Session,
        data: &dyn TokenSource,
        at: At,
    ) -> Result<Gradients, TrainError> {
        self.compute(session, data, at, None)
    }

    /// Applies `g` with learning rate `lr`: the clipping folded into the optimizer's pass
    /// (same bits as clipping first), then, when SophiaG wants one, its Hessian estimate
    /// from the updated model on the same batch.
    pub fn apply(
        &self,
        session: &mut Session,
        optimizer: &mut Optimizer,
        data: &dyn TokenSource,
        g: Gradients,
        lr: f64,
    ) -> Result<(), TrainError> {
        let clip = optim::clip_coefficient(g.norm, self.max_grad_norm);
        if self.parameter_shards().is_some() {
            // The session holds this rank's pieces only: they are updated in place.
            optimizer.update_clipped(&mut session.params, g.grads, clip, lr, &self.frozen);
            return Ok(());
        }
        if let Some(plan) = &self.shard {
            // This rank's range of each parameter, updated, then everyone's gathered.
            let mut pieces = plan.pieces(&session.params);
            optimizer.update_clipped(&mut pieces, g.grads, clip, lr, &self.frozen);
            plan.gather(pieces, &mut session.params, &session.device);
            return Ok(());
        }
        optimizer.update_clipped(&mut session.params, g.grads, clip, lr, &self.frozen);
        if optimizer.hessian_due() {
            // Seeded by (seed, optimizer step, rank): a resumed run draws the same labels.
            let seed = self.seed
                ^ optimizer.step().wrapping_mul(0xD1B5_4A32_D192_ED03)
                ^ (self.comm.rank() as u64).wrapping_mul(0x8CB9_2BA7_2F3D_8DD7);
            let h = self.compute(session, data, g.at, Some(seed))?;
            let grads = optim::clip_by_global_norm(h.grads, h.norm, self.max_grad_norm);
            optimizer.update_hessian(grads);
        }
        Ok(())
    }

    /// This rank's loss and gradients over its micro-batches, averaged over the ranks;
    /// against the data's labels, or with `sampled = Some(seed)` against labels drawn from
    /// the model (SophiaG's estimator).
    fn compute(
        &self,
        session: &Session,
        data: &dyn TokenSource,
        at: At,
        sampled: Option<u64>,
    ) -> Result<Gradients, TrainError> {
        let (mut loss, mut grads) = (0.0f32, None::<Vec<Tensor<1>>>);
        let mut staged = self.stage_shards(session);
        let scale = 1.0 / self.layout.accum as f64;
        for micro in 0..self.layout.accum {
            let (rows, labels) = self.micro_rows(session, data, at, micro, sampled)?;
            if let Some(stages) = staged.as_mut() {
                loss += staged_loss(session, stages, &rows, self.layout.seq, scale, labels)?;
                continue;
            }
            let (l, g) = self.micro_batch(session, &rows, scale, labels);
            loss += l;
            grads = Some(match grads {
                None => g,
                Some(acc) => acc.into_iter().zip(g).map(|(a, b)| a + b).collect(),
            });
        }
        let grads = grads.unwrap_or_default();
        let t0 = Instant::now();
        let (loss, grads, norm, allreduce_s) = match (&self.shard, staged) {
            (Some(plan), Some(mut stages)) => {
                let (pieces, sq) = stages.take_grads();
                let (loss, norm) = plan.loss_and_norm(self.comm, loss, sq);
                let comm_s = stages.comm_s() + t0.elapsed().as_secs_f64();
                (loss, pieces, norm, comm_s)
            }
            (Some(plan), None) => {
                let (loss, pieces, norm) = plan.average(self.comm, loss, grads, &session.device);
                (loss, pieces, norm, t0.elapsed().as_secs_f64())
            }
            (None, _) => {
                let (loss, grads, allreduce_s) = self.average(session, loss, grads)?;
                let norm = optim::global_norm(&grads);
                (loss, grads, norm, allreduce_s)
            }
        };
        Ok(Gradients {
            at,
            loss,
            grads,
            norm,
            allreduce_s,
        })
    }

    /// The rows of this rank's micro-batch `micro` of the step at `at` (with the debug
    /// faults applied) and what their loss is computed against.
    fn micro_rows(
        &self,
        session: &Session,
        data: &dyn TokenSource,
        at: At,
        micro: usize,
        sampled: Option<u64>,
    ) -> Result<(Vec<Vec<u32>>, Labels), TrainError> {
        let rows: Vec<Vec<u32>> = self
            .layout
            .rows(at.base, micro)
            .map(|i| data.sample(i, self.layout.seq + 1))
            .collect::<Result<_, _>>()
            .map_err(|e| match e {
                SampleError::Corrupt(m) => TrainError::Data(m),
                SampleError::Read(m) => TrainError::DataRead(m),
            })?;
        let batch = self
            .faults
            .micro_batch(at.batch_no, rows, session.model.vocab());
        let labels = match sampled {
            Some(seed) => Labels::Sampled {
                seed: seed ^ (micro as u64).wrapping_mul(0xA24B_AED4_963E_E407),
            },
            None => Labels::Data {
                poison: batch.poison,
            },
        };
        Ok((batch.rows, labels))
    }

    /// The stage-by-stage pass over this rank's pieces of the parameters, in a
    /// parameter-sharded run (`None` otherwise).
    pub fn stage_shards<'s>(&'s self, session: &'s Session) -> Option<StageShards<'s>> {
        let plan = self.parameter_shards()?;
        Some(StageShards::new(
            plan,
            &session.model,
            &session.params,
            &session.device,
        ))
    }

    /// The loss and gradients averaged over the ranks, in one flat host buffer (every
    /// gradient, then the loss), and the seconds it took.
    fn average(
        &self,
        session: &Session,
        loss: f32,
        grads: Vec<Tensor<1>>,
    ) -> Result<(f32, Vec<Tensor<1>>, f64), TrainError> {
        if self.comm.size() == 1 {
            return Ok((loss, grads, 0.0));
        }
        let t0 = Instant::now();
        if let Some(nccl) = &self.nccl {
            let mut sum = [loss];
            self.comm.all_reduce_sum_f32(&mut sum);
            let loss = sum[0] * (1.0 / self.comm.size() as f32);
            return Ok((loss, nccl.mean(grads)?, t0.elapsed().as_secs_f64()));
        }
        let (loss, grads) = crate::tensor::mean_over_ranks(
            &self.allreduce,
            self.comm,
            loss,
            grads,
            &session.device,
        );
        Ok((loss, grads, t0.elapsed().as_secs_f64()))
    }

    /// Mean loss of `rows` times `scale`, and its gradients, computed as `shards` pieces on
    /// as many threads and summed in a fixed order (deterministic whatever the scheduling).
    ///
    /// Why shards: burn's flex backend runs element-wise kernels on one thread, and they are
    /// about 40% of a step; two shards on two threads keep both cores busy through them.
    /// The math is gradient accumulation over the shards, exact up to f32 summation order.
    fn micro_batch(
        &self,
        session: &Session,
        rows: &[Vec<u32>],
        scale: f64,
        labels: Labels,
    ) -> (f32, Vec<Tensor<1>>) {
        let shards = match crate::tensor::on_host_threads(&session.device) {
            true => self.shards.min(rows.len()).max(1),
            false => 1, // one stream: see `on_host_threads`
        };
        if shards == 1 {
            return shard_loss_and_grads(session, rows, self.layout.seq, scale, labels, 0);
        }
        let per = rows.len().div_ceil(shards);
        let n = rows.len() as f64;
        let results: Vec<(f32, Vec<Tensor<1>>)> = std::thread::scope(|scope| {
            let handles: Vec<_> = rows
                .chunks(per)
                .enumerate()
                .map(|(i, chunk)| {
                    let s = scale * chunk.len() as f64 / n;
                    let seq = self.layout.seq;
                    scope.spawn(move || shard_loss_and_grads(session, chunk, seq, s, labels, i))
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
}

/// Loss of the micro-batch `rows` times `scale` in a parameter-sharded run: stage by stage,
/// each stage's gradients reduce-scattered into `stages` as the backward pass leaves it.
fn staged_loss(
    session: &Session,
    stages: &mut StageShards,
    rows: &[Vec<u32>],
    seq: usize,
    scale: f64,
    labels: Labels,
) -> Result<f32, TrainError> {
    let Labels::Data { poison } = labels else {
        // The config refuses SophiaG with sharding (its Hessian pass would come here).
        return Err(TrainError::Parallel(
            "sampled labels are not supported with parallelism.shard = \"parameters\"".into(),
        ));
    };
    let inputs = int_tensor(rows, seq, &session.device);
    let targets = target_tensor(rows, seq, &session.device);
    // A poisoned batch (a debug fault) makes the loss and every gradient NaN, as it does
    // in the replicated step.
    let scale = if poison { f64::NAN } else { scale };
    Ok(stagewise::loss_and_grads(
        &session.model,
        stages,
        inputs,
        targets,
        scale,
    ))
}

/// Loss of one shard of a micro-batch times `scale`, and its gradients (f32).
fn shard_loss_and_grads(
    session: &Session,
    chunk: &[Vec<u32>],
    seq: usize,
    scale: f64,
    labels: Labels,
    shard: usize,
) -> (f32, Vec<Tensor<1>>) {
    let device = session.device.clone().autodiff();
    let (model, params) = (&session.model, &session.params);
    let inputs = int_tensor(chunk, seq, &device);
    let leaves: Vec<Tensor<1>> = params
        .iter()
        .map(|p| p.clone().autodiff().require_grad())
        .collect();
    let (mut loss, poison) = match labels {
        Labels::Data { poison } => {
            let targets = target_tensor(chunk, seq, &device);
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
    let grads = leaves
        .iter()
        .zip(params)
        .map(|(leaf, p)| {
            leaf.grad(&g)
                .unwrap_or_else(|| p.zeros_like())
                .cast(FloatDType::F32)
        })
        .collect();
    (value, grads)
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
    let host = crate::tensor::to_vec(&logp.clone().detach().reshape([b * t * v]));
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

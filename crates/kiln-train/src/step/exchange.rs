//! How a step's gradients travel between the data-parallel ranks and reach the parameters:
//! the [`Exchange`] seam, with one strategy per `parallelism.shard` mode, chosen once per run
//! by [`choose`]:
//!
//! | mode | strategy | gradients | update |
//! | --- | --- | --- | --- |
//! | `none` | [`Replicated`] | all-reduced whole | every rank, everything (Muon's orthogonalisation shared out) |
//! | `optimizer` | [`ShardedState`] | all-reduced whole, this rank's range kept | this rank's range, then all-gathered |
//! | `gradients` | [`ShardedState`] | reduce-scattered to this rank's range | this rank's range, then all-gathered |
//! | `parameters` | [`StageWise`] | reduce-scattered stage by stage inside the backward pass | this rank's pieces, in place |
//!
//! Every strategy returns the same [`Reduced`]: the loss averaged over all ranks, this rank's
//! gradients (whole, or its range of each) and their global norm over all ranks. Every
//! strategy's collectives go through one [`DeviceCollective`], chosen once per run
//! ([`collective::choose`]): NCCL on the device on CUDA, host-staged MPI elsewhere.

use super::pass::{Labels, LocalPass, MicroBatches};
use crate::config::ParallelismConfig;
use crate::error::TrainError;
use crate::model::Targets;
use crate::model::session::Session;
use crate::model::stagewise;
use crate::optim::Optimizer;
use crate::parallel::collective::{self, DeviceCollective};
use crate::parallel::shard::{ShardPlan, StageShards};
use crate::parallel::wire::Ranks;
use crate::tensor::{int_tensor, target_tensor};
use burn::tensor::Tensor;
use kiln_dist::Collective;
use std::time::Instant;

/// A step's loss and gradients averaged over the ranks.
pub struct Reduced {
    /// Mean loss over the global batch.
    pub loss: f32,
    /// Gradients (f32); in a sharded run this rank's range of each ([`ShardPlan::pieces`]).
    pub grads: Vec<Tensor<1>>,
    /// Their global norm over every rank's range, before clipping.
    pub norm: f32,
    /// Seconds spent in the collectives.
    pub comm_s: f64,
}

/// How an update is applied: the clipping coefficient (`None`: no clipping), the learning
/// rate and the parameters the debug faults freeze.
#[derive(Clone, Copy)]
pub struct Update<'a> {
    /// Multiplies the gradients; `None` leaves them as they are.
    pub clip: Option<f64>,
    /// Learning rate.
    pub lr: f64,
    /// Parameters left unchanged.
    pub frozen: &'a [bool],
}

/// The gradient exchange of a run (see the module documentation).
pub trait Exchange {
    /// This rank's loss and gradients over `batches`, averaged over the ranks.
    fn gradients(
        &self,
        pass: &LocalPass,
        session: &Session,
        batches: MicroBatches,
    ) -> Result<Reduced, TrainError>;

    /// Applies averaged gradients (as [`Exchange::gradients`] returned them) to the
    /// parameters and the optimizer's state.
    fn apply(
        &self,
        session: &mut Session,
        optimizer: &mut Optimizer,
        grads: Vec<Tensor<1>>,
        update: Update,
    ) -> Result<(), TrainError>;

    /// What carries the collectives (host-staged MPI, NCCL), for the `start` event.
    fn collectives(&self) -> String;

    /// What this rank keeps of a sharded run (`None`: everything).
    fn plan(&self) -> Option<&ShardPlan<'_>> {
        None
    }

    /// The stage-by-stage pass over this rank's pieces of the parameters, when the ranks
    /// keep only their pieces (`None` otherwise).
    fn stages<'s>(&'s self, _session: &'s Session) -> Option<StageShards<'s>> {
        None
    }
}

/// The exchange of `plan` (`None`: a replicated run) over the data-parallel ranks `dp`, with
/// the collectives `parallel` asks of [`collective::choose`] (the sharded plan chose its own,
/// over its mesh). A collective: every rank calls it.
pub fn choose<'c>(
    plan: Option<ShardPlan<'c>>,
    dp: &'c dyn Collective,
    session: &Session,
    parallel: &ParallelismConfig,
) -> Result<Box<dyn Exchange + 'c>, TrainError> {
    Ok(match plan {
        Some(plan) if plan.shards_parameters() => Box::new(StageWise { plan }),
        Some(plan) => Box::new(ShardedState { plan }),
        None => Box::new(Replicated {
            comm: dp,
            costs: (session.model.specs().iter())
                .map(|s| crate::parallel::whole::cost(&s.shape))
                .collect(),
            coll: collective::choose(
                parallel.collectives,
                Ranks::replicated(dp),
                &session.device,
                parallel.bucket_bytes(),
                None,
            )?,
        }),
    })
}

/// Every rank holds everything; gradients are all-reduced whole.
pub struct Replicated<'c> {
    /// The data-parallel ranks.
    comm: &'c dyn Collective,
    /// Each parameter's cost as a whole matrix: the ranks share Muon's orthogonalisation by
    /// it ([`crate::parallel::whole::Spread`]).
    costs: Vec<f64>,
    /// NCCL on CUDA devices with several ranks, else host-staged MPI in fixed buckets.
    coll: Box<dyn DeviceCollective>,
}

impl Replicated<'_> {
    /// The loss and gradients averaged over the ranks, and the seconds it took.
    fn average(
        &self,
        loss: f32,
        grads: Vec<Tensor<1>>,
    ) -> Result<(f32, Vec<Tensor<1>>, f64), TrainError> {
        if self.comm.size() == 1 {
            return Ok((loss, grads, 0.0));
        }
        let t0 = Instant::now();
        let (loss, grads) = self.coll.mean(Ranks::replicated(self.comm), loss, grads)?;
        let busy = self.coll.device_busy_s();
        Ok((loss, grads, t0.elapsed().as_secs_f64() + busy))
    }
}

impl Exchange for Replicated<'_> {
    fn gradients(
        &self,
        pass: &LocalPass,
        session: &Session,
        batches: MicroBatches,
    ) -> Result<Reduced, TrainError> {
        let (loss, grads) = pass.accumulate(session, batches)?;
        let (loss, grads, comm_s) = self.average(loss, grads)?;
        let norm = crate::parallel::tensor::global_norm(&session.model, &grads);
        Ok(Reduced {
            loss,
            grads,
            norm,
            comm_s,
        })
    }

    fn apply(
        &self,
        session: &mut Session,
        optimizer: &mut Optimizer,
        grads: Vec<Tensor<1>>,
        u: Update,
    ) -> Result<(), TrainError> {
        let whole = crate::parallel::whole::Spread {
            group: self.comm,
            costs: &self.costs,
        };
        optimizer.update_clipped(&mut session.params, grads, (u.clip, u.lr), u.frozen, &whole);
        Ok(())
    }

    fn collectives(&self) -> String {
        self.coll.describe()
    }
}

/// `optimizer` and `gradients`: every rank holds the whole parameters and its range of the
/// optimizer's state; it updates its range, then the ranks all-gather the whole.
pub struct ShardedState<'c> {
    plan: ShardPlan<'c>,
}

impl Exchange for ShardedState<'_> {
    fn gradients(
        &self,
        pass: &LocalPass,
        session: &Session,
        batches: MicroBatches,
    ) -> Result<Reduced, TrainError> {
        let (loss, grads) = pass.accumulate(session, batches)?;
        let t0 = Instant::now();
        let (loss, grads, norm) = self.plan.average(&session.model, loss, grads)?;
        Ok(Reduced {
            loss,
            grads,
            norm,
            comm_s: t0.elapsed().as_secs_f64() + self.plan.device_busy_s(),
        })
    }

    fn apply(
        &self,
        session: &mut Session,
        optimizer: &mut Optimizer,
        grads: Vec<Tensor<1>>,
        u: Update,
    ) -> Result<(), TrainError> {
        let mut pieces = self.plan.pieces(&session.params);
        optimizer.update_clipped(&mut pieces, grads, (u.clip, u.lr), u.frozen, &self.plan);
        self.plan.gather(pieces, &mut session.params)
    }

    fn plan(&self) -> Option<&ShardPlan<'_>> {
        Some(&self.plan)
    }

    fn collectives(&self) -> String {
        self.plan.describe_collectives()
    }
}

/// `parameters`: every rank holds only its pieces of the parameters; each stage's weights are
/// gathered when it runs and its gradients reduce-scattered as the backward pass leaves it.
pub struct StageWise<'c> {
    plan: ShardPlan<'c>,
}

impl Exchange for StageWise<'_> {
    fn gradients(
        &self,
        _pass: &LocalPass,
        session: &Session,
        batches: MicroBatches,
    ) -> Result<Reduced, TrainError> {
        let mut stages = StageShards::new(&self.plan, &session.model, &session.params);
        let (scale, mut loss) = (batches.scale(), 0.0f32);
        for m in 0..batches.count {
            let b = (batches.read)(m)?;
            loss += staged_loss(session, &mut stages, &b.rows, batches.seq, scale, b.labels)?;
        }
        let t0 = Instant::now();
        let (grads, sq) = stages.take_grads()?;
        let (loss, norm) = self.plan.loss_and_norm(loss, sq);
        Ok(Reduced {
            loss,
            grads,
            norm,
            comm_s: stages.comm_s() + t0.elapsed().as_secs_f64() + self.plan.device_busy_s(),
        })
    }

    fn apply(
        &self,
        session: &mut Session,
        optimizer: &mut Optimizer,
        grads: Vec<Tensor<1>>,
        u: Update,
    ) -> Result<(), TrainError> {
        // The session holds this rank's pieces only: they are updated in place.
        let (params, plan) = (&mut session.params, &self.plan);
        optimizer.update_clipped(params, grads, (u.clip, u.lr), u.frozen, plan);
        Ok(())
    }

    fn plan(&self) -> Option<&ShardPlan<'_>> {
        Some(&self.plan)
    }

    fn collectives(&self) -> String {
        self.plan.describe_collectives()
    }

    fn stages<'s>(&'s self, session: &'s Session) -> Option<StageShards<'s>> {
        Some(StageShards::new(
            &self.plan,
            &session.model,
            &session.params,
        ))
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
    let inputs = int_tensor(rows, seq, &session.device);
    let (targets, poison) = match labels {
        Labels::Data { poison } => (
            Targets::Data(Box::new(target_tensor(rows, seq, &session.device))),
            poison,
        ),
        // SophiaG's Hessian pass: labels drawn from the model's own predictions.
        Labels::Sampled { seed } => (Targets::Sampled(seed), false),
    };
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

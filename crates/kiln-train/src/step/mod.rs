//! One training step, the only one: [`Step`] computes a step's loss and gradients over this
//! rank's micro-batches ([`Step::gradients`]: the local forward and backward pass of
//! [`pass`], the average over the ranks and the global norm by the run's [`exchange`]) and
//! applies them ([`Step::apply`]: clipping folded into the optimizer's pass, then SophiaG's
//! Hessian estimate when it is due). The trainer, lr-find and the profiling example all call
//! it, so a change to the step is made once. [`BatchLayout`] says which global samples each
//! rank trains on.

pub mod exchange;
pub mod faults;
mod layout;
pub mod pass;

pub use layout::BatchLayout;

use crate::config::{ActivationCheckpointing, Config};
use crate::data::{SampleError, TokenSource};
use crate::error::TrainError;
use crate::mesh::{DeviceMesh, Dims};
use crate::model::session::Session;
use crate::optim::{self, Optimizer};
use crate::parallel::shard::{ShardPlan, StageShards};
use burn::tensor::Tensor;
use exchange::{Exchange, Update};
use faults::Faults;
use kiln_dist::Collective;
use pass::{Labels, LocalPass, MicroBatch, MicroBatches};

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

/// The step of a run (see the module documentation).
pub struct Step<'c> {
    layout: BatchLayout,
    pass: LocalPass,
    max_grad_norm: f64,
    seed: u64,
    frozen: Vec<bool>,
    faults: Faults,
    /// How the gradients reach every rank and the parameters (`parallelism.shard`).
    exchange: Box<dyn Exchange + 'c>,
    /// The data-parallel ranks.
    comm: &'c dyn Collective,
}

impl Step<'static> {
    /// The step of `cfg` on one rank, outside a data-parallel job (lr-find, profiling). One
    /// rank keeps everything, whatever the config shards.
    pub fn single(cfg: &Config, session: &Session) -> Result<Self, TrainError> {
        let layout = BatchLayout::new(&cfg.training, 0, 1).map_err(TrainError::Parallel)?;
        let solo = &kiln_dist::Solo;
        let exchange = exchange::choose(None, solo, session, &cfg.parallelism)?;
        Ok(Self::with_exchange(cfg, session, layout, solo, exchange))
    }
}

impl<'c> Step<'c> {
    /// The step of `cfg` for `session`'s model on `layout`, averaging over `mesh`'s
    /// data-parallel ranks (every rank calls it); an error when the device's collectives
    /// cannot be set up.
    pub fn new(
        cfg: &Config,
        session: &Session,
        layout: BatchLayout,
        mesh: &'c DeviceMesh,
    ) -> Result<Self, TrainError> {
        let plan = ShardPlan::new(cfg, &session.model, mesh, &session.device)?;
        let dp = mesh.group(Dims::DP);
        let exchange = exchange::choose(plan, dp, session, &cfg.parallelism)?;
        Ok(Self::with_exchange(cfg, session, layout, dp, exchange))
    }

    /// The step of a run and the optimizer it updates, for this rank of `mesh` (every rank
    /// calls it): with parameters sharded, `session` keeps only this rank's pieces of its
    /// parameters and the optimizer the state of this rank's ranges.
    pub fn for_run(
        cfg: &Config,
        session: &mut Session,
        layout: BatchLayout,
        mesh: &'c DeviceMesh,
    ) -> Result<(Self, Optimizer), TrainError> {
        crate::parallel::tensor::apply(session, mesh)?;
        let step = Self::new(cfg, session, layout, mesh)?;
        if let Some(plan) = step.parameter_shards() {
            // Copied out: a slice may be a view that keeps the whole tensor alive.
            let pieces = plan.pieces(&session.params);
            let lengths: Vec<usize> = pieces.iter().map(|t| t.dims()[0]).collect();
            let flat = crate::tensor::flatten(pieces, &[]);
            session.params = crate::tensor::split(&flat, lengths, &session.device);
        }
        let (specs, device) = (session.model.specs(), &session.device);
        let tokens = step.layout.global_batch() * step.layout.seq as u64;
        let optimizer = match step.shard() {
            Some(plan) => Optimizer::sharded(&cfg.optimizer, specs, device, tokens, plan.ranges()),
            None => Optimizer::new(&cfg.optimizer, specs, device, tokens),
        };
        Ok((step, optimizer))
    }

    fn with_exchange(
        cfg: &Config,
        session: &Session,
        layout: BatchLayout,
        comm: &'c dyn Collective,
        exchange: Box<dyn Exchange + 'c>,
    ) -> Self {
        let faults = Faults::new(cfg);
        Self {
            layout,
            pass: LocalPass {
                compute_threads: cfg.training.compute_shards.max(1),
                checkpoint_blocks: cfg.training.activation_checkpointing
                    == ActivationCheckpointing::Blocks,
            },
            max_grad_norm: cfg.optimizer.max_grad_norm,
            seed: cfg.training.seed,
            frozen: faults.frozen(session.model.specs()),
            faults,
            exchange,
            comm,
        }
    }

    /// What this rank keeps of a sharded run, if it is one.
    pub fn shard(&self) -> Option<&ShardPlan<'_>> {
        self.exchange.plan()
    }

    /// The plan of a parameter-sharded run, whose ranks keep only their pieces of the
    /// parameters (`parallelism.shard = "parameters"`).
    pub fn parameter_shards(&self) -> Option<&ShardPlan<'_>> {
        self.shard().filter(|p| p.shards_parameters())
    }

    /// How the global batch is cut over the ranks.
    pub fn layout(&self) -> &BatchLayout {
        &self.layout
    }

    /// Another layout (a run resumed on another number of ranks keeps its global batch).
    pub fn set_layout(&mut self, layout: BatchLayout) {
        self.layout = layout;
    }

    /// What carries the collectives between the ranks (host-staged MPI, NCCL).
    pub fn collectives(&self) -> String {
        self.exchange.collectives()
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
    /// from the updated model on the same batch (in a sharded run, reduced to this rank's
    /// ranges as the gradients are).
    pub fn apply(
        &self,
        session: &mut Session,
        optimizer: &mut Optimizer,
        data: &dyn TokenSource,
        g: Gradients,
        lr: f64,
    ) -> Result<(), TrainError> {
        let update = Update {
            clip: optim::clip_coefficient(g.norm, self.max_grad_norm),
            lr,
            frozen: &self.frozen,
        };
        self.exchange.apply(session, optimizer, g.grads, update)?;
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
        let mut read = |m| self.micro_batch(session, data, at, m, sampled);
        let batches = MicroBatches {
            count: self.layout.accum,
            seq: self.layout.seq,
            read: &mut read,
        };
        let r = self.exchange.gradients(&self.pass, session, batches)?;
        Ok(Gradients {
            at,
            loss: self.faults.reported_loss(r.loss, self.layout.world),
            grads: r.grads,
            norm: r.norm,
            allreduce_s: r.comm_s,
        })
    }

    /// This rank's micro-batch `micro` of the step at `at` (with the debug faults applied)
    /// and what its loss is computed against.
    fn micro_batch(
        &self,
        session: &Session,
        data: &dyn TokenSource,
        at: At,
        micro: usize,
        sampled: Option<u64>,
    ) -> Result<MicroBatch, TrainError> {
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
        Ok(MicroBatch {
            rows: batch.rows,
            labels,
        })
    }

    /// The stage-by-stage pass over this rank's pieces of the parameters, in a
    /// parameter-sharded run (`None` otherwise).
    pub fn stage_shards<'s>(&'s self, session: &'s Session) -> Option<StageShards<'s>> {
        self.exchange.stages(session)
    }
}

//! Sharded data parallelism (`parallelism.shard`): which piece of the training state this
//! rank keeps, and the collectives of a sharded step.
//!
//! The parameters, flattened in model order, are cut into one contiguous range per rank
//! ([`kiln_dist::Sharded`]). A rank keeps AdamW's moments for its range only; after the
//! backward pass the gradients are averaged over the ranks (all-reduced whole with
//! `optimizer`, reduce-scattered to the range with `gradients`), the rank updates its range
//! of the parameters, and an all-gather gives every rank the whole updated parameters. The
//! update is element-wise, so each element is computed exactly as in a replicated run; what
//! differs is the summation order of the gradient norm (per range, then over the ranks) and,
//! with `gradients`, MPI's reduction order in the reduce-scatter: losses agree with a
//! replicated run to float rounding, not bit for bit.
//!
//! A sharded checkpoint has one optimizer file per rank, written by that rank in parallel
//! ([`write_shard`]); rank 0 publishes them under one manifest (see [`crate::checkpoint`]).

use crate::checkpoint::{self, HostTensor, ShardFile};
use crate::config::{Config, Shard};
use crate::error::TrainError;
use crate::model::ParamSpec;
use crate::tensor::{DeviceTensor, flatten, split, unflatten};
use burn::tensor::{Device, Tensor};
use kiln_dist::{Collective, Sharded};
use std::ops::Range;
use std::path::Path;

/// This rank's part of a sharded run's state (see the module documentation).
#[derive(Debug, Clone)]
pub struct ShardPlan {
    mode: Shard,
    flat: Sharded,
    rank: usize,
    world: usize,
    /// Bytes per all-reduce bucket (`parallelism.bucket_mb`).
    bucket: usize,
    /// The elements of each parameter in this rank's range (`None`: none).
    ranges: Vec<Option<Range<usize>>>,
}

impl ShardPlan {
    /// The plan of `cfg` for rank `rank` of `world`; `None` when nothing is sharded.
    pub fn new(cfg: &Config, specs: &[ParamSpec], rank: usize, world: usize) -> Option<Self> {
        let mode = cfg.parallelism.shard;
        if mode == Shard::None {
            return None;
        }
        let total = specs.iter().map(ParamSpec::numel).sum();
        let bucket = cfg.parallelism.bucket_mb.max(1) << 20;
        let flat = Sharded::new(total, world, bucket);
        let mine = flat.range(rank);
        let mut at = 0;
        let ranges = specs
            .iter()
            .map(|s| {
                let (lo, hi) = (at.max(mine.start), (at + s.numel()).min(mine.end));
                let r = (lo < hi).then(|| lo - at..hi - at);
                at += s.numel();
                r
            })
            .collect();
        Some(Self {
            mode,
            flat,
            rank,
            world,
            bucket,
            ranges,
        })
    }

    /// The elements of each parameter whose optimizer state this rank keeps.
    pub fn ranges(&self) -> &[Option<Range<usize>>] {
        &self.ranges
    }

    /// The mode.
    pub fn mode(&self) -> Shard {
        self.mode
    }

    /// This rank's range of each tensor (an empty tensor where it has none).
    pub fn pieces(&self, tensors: &[Tensor<1>]) -> Vec<Tensor<1>> {
        tensors
            .iter()
            .zip(&self.ranges)
            .map(|(t, r)| match r {
                Some(r) => t.clone().slice([r.clone()]),
                None => Tensor::empty([0], &t.device()),
            })
            .collect()
    }

    /// `flat` (this rank's range of the flattened parameters) cut into pieces, as
    /// [`ShardPlan::pieces`] cuts whole tensors.
    fn cut(&self, flat: &[f32], device: &Device) -> Vec<Tensor<1>> {
        let lengths = self.ranges.iter().map(|r| r.as_ref().map_or(0, Range::len));
        split(flat, lengths, device)
    }

    /// The loss and this rank's range of the gradients, averaged over the ranks (as pieces,
    /// see [`ShardPlan::pieces`]), and the global norm of the averaged gradients.
    pub fn average(
        &self,
        comm: &dyn Collective,
        loss: f32,
        grads: Vec<Tensor<1>>,
        device: &Device,
    ) -> (f32, Vec<Tensor<1>>, f32) {
        let lengths: Vec<usize> = grads.iter().map(|g| g.dims()[0]).collect();
        let mine = self.flat.range(self.rank);
        let (loss, shard) = match self.mode {
            Shard::Gradients => {
                let mut l = [loss];
                comm.all_reduce_sum_f32(&mut l);
                let shard = self.flat.reduce_scatter_mean(comm, &flatten(grads, &[]));
                (l[0] / self.world as f32, shard[..mine.len()].to_vec())
            }
            _ => {
                // The replicated run's all-reduce and norm, bit for bit: every rank has the
                // whole averaged gradients here.
                let reduce = kiln_dist::BucketedAllReduce::new(self.bucket);
                let mut all = reduce.mean(comm, &flatten(grads, &[loss]));
                let loss = all.pop().unwrap_or(f32::NAN);
                let norm = crate::optim::global_norm(&split(&all, lengths, device));
                let pieces = self.cut(&all[mine], device);
                return (loss, pieces, norm);
            }
        };
        let mut sq = [shard
            .iter()
            .map(|&g| f64::from(g) * f64::from(g))
            .sum::<f64>()];
        comm.all_reduce_sum_f64(&mut sq);
        let pieces = self.cut(&shard, device);
        (loss, pieces, sq[0].sqrt() as f32)
    }

    /// Replaces `params` with the whole parameters gathered from every rank's updated
    /// range (`pieces`, this rank's; taken, so that each is copied to the host once).
    pub fn gather(
        &self,
        comm: &dyn Collective,
        pieces: Vec<Tensor<1>>,
        params: &mut Vec<Tensor<1>>,
        device: &Device,
    ) {
        // The padding up to a whole shard goes in with the values: no second allocation.
        let have: usize = pieces.iter().map(|p| p.dims()[0]).sum();
        let mine = flatten(pieces, &vec![0.0; self.flat.shard.saturating_sub(have)]);
        let full = self.flat.all_gather(comm, &mine);
        *params = unflatten(&full, params, device);
    }

    /// Writes this rank's optimizer pieces for the checkpoint of `step` into its staging
    /// directory under `root`, and tells every rank every rank's file: on rank 0 the
    /// shards to publish; an error when any rank failed (every rank gets it, so all stop).
    pub fn write_shard(
        &self,
        comm: &dyn Collective,
        root: &Path,
        step: u64,
        state: &[DeviceTensor],
    ) -> Result<Vec<ShardFile>, TrainError> {
        let host: Vec<HostTensor> = state.iter().map(DeviceTensor::to_host).collect();
        let mine = checkpoint::write_shard(root, step, (self.rank, self.world), &host)
            .map_err(|e| e.to_string());
        let mut all = Vec::with_capacity(self.world);
        for r in 0..self.world {
            let mut bytes = match (r == self.rank, &mine) {
                (true, m) => serde_json::to_vec(m).unwrap_or_default(),
                (false, _) => Vec::new(),
            };
            crate::snapshot::broadcast_vec(comm, r, &mut bytes);
            let got: Result<ShardFile, String> = serde_json::from_slice(&bytes)
                .unwrap_or_else(|e| Err(format!("unreadable shard report of rank {r}: {e}")));
            all.push(got.map_err(|e| {
                TrainError::Parallel(format!(
                    "rank {r} could not write its optimizer shard of step {step}: {e}"
                ))
            })?);
        }
        Ok(all)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_ranges_of_all_ranks_tile_every_parameter_once() {
        let mut cfg = Config::default();
        cfg.parallelism.shard = Shard::Gradients;
        let specs = crate::model::Llama::new(&cfg.model, 300).specs().to_vec();
        for world in 1..=5 {
            for (i, spec) in specs.iter().enumerate() {
                let mut covered: Vec<Range<usize>> = (0..world)
                    .filter_map(|r| {
                        ShardPlan::new(&cfg, &specs, r, world).unwrap().ranges[i].clone()
                    })
                    .collect();
                covered.sort_by_key(|r| r.start);
                let mut next = 0;
                for r in covered {
                    assert_eq!(r.start, next, "{} on {world} ranks", spec.name);
                    next = r.end;
                }
                assert_eq!(next, spec.numel(), "{} on {world} ranks", spec.name);
            }
        }
        cfg.parallelism.shard = Shard::None;
        assert!(ShardPlan::new(&cfg, &specs, 0, 2).is_none());
    }
}

//! Sharded data parallelism (`parallelism.shard`): which piece of the training state this
//! rank keeps, and the collectives of a sharded step.
//!
//! The parameters are flattened in model order and cut into one contiguous range per rank
//! ([`kiln_dist::Sharded`]): all of them together with `optimizer` and `gradients`, each
//! stage's ([`Stage`]: the embedding, a block, the head) separately with `parameters`, so
//! that a stage's weights are gathered by one all-gather. A rank keeps AdamW's moments for
//! its range only; after the backward pass the gradients are averaged over the ranks
//! (all-reduced whole with `optimizer`, reduce-scattered to the range with `gradients`, and
//! with `parameters` reduce-scattered stage by stage inside the backward pass, see
//! [`StageShards`]), the rank updates its range of the parameters, and, unless the
//! parameters are sharded too, an all-gather gives every rank the whole updated parameters.
//! The update is element-wise, so each element is computed exactly as in a replicated run;
//! what differs is the summation order of the gradient norm (per range, then over the ranks)
//! and, with `gradients` and `parameters`, MPI's reduction order in the reduce-scatter:
//! losses agree with a replicated run to float rounding, not bit for bit.
//!
//! A sharded checkpoint has one optimizer file per rank (and with `parameters` one weights
//! file per rank), written by that rank in parallel from its [`ShardPlan::ranges`] (the
//! checkpoint lifecycle, [`crate::components::checkpoints`], decides who writes what); rank 0
//! publishes them under one manifest (see [`crate::checkpoint`]).

use crate::checkpoint::HostTensor;
use crate::config::{Config, Shard};
use crate::error::TrainError;
use crate::mesh::{DeviceMesh, Dim, Dims};
use crate::model::stagewise::StageParams;
use crate::model::{Llama, ParamSpec, Stage};
use crate::parallel::collective::{self, DeviceCollective};
use crate::parallel::whole;
use crate::parallel::wire::{InFlight, Ranks};
use crate::tensor::{into_vec, split};
use burn::tensor::{Device, Tensor};
use kiln_dist::{Background, Sharded};
use std::collections::VecDeque;
use std::ops::Range;
use std::time::Instant;

/// Parameters flattened and cut over the ranks together.
#[derive(Debug, Clone)]
struct Group {
    /// Their indices in the model's parameters.
    params: Range<usize>,
    flat: Sharded,
}

/// This rank's part of a sharded run's state (see the module documentation).
pub struct ShardPlan<'m> {
    mode: Shard,
    /// The whole model, or with `parameters` each stage in [`Llama::stages`] order.
    groups: Vec<Group>,
    /// This rank's shard: its rank among the ranks of its replica.
    rank: usize,
    /// The ranks of a replica, over which the state is cut.
    shards: usize,
    /// The elements of each parameter in this rank's range (`None`: none).
    ranges: Vec<Option<Range<usize>>>,
    /// Every rank's of the replica (empty where it has none), for whole matrices.
    all_ranges: Vec<Vec<Range<usize>>>,
    /// Each parameter's cost as a whole matrix ([`whole::cost`]).
    costs: Vec<f64>,
    /// The job's mesh: this rank shards with the ranks of its `dp_shard` group, and those
    /// of its `dp_replicate` group hold the same shard in the other replicas.
    mesh: &'m DeviceMesh,
    /// How the pieces travel between the ranks: host-staged MPI, or NCCL on CUDA devices
    /// ([`collective::choose`]); with `parameters` and `parallelism.prefetch` on the host
    /// path, it gathers the next stage's weights while the current one computes.
    coll: Box<dyn DeviceCollective>,
    device: Device,
}

impl<'m> ShardPlan<'m> {
    /// The plan of `cfg` for this rank of `mesh`, on `device`; `None` when nothing is
    /// sharded, an error when `parallelism.dp_replicate` does not divide the ranks (or the
    /// device's collectives cannot be set up). Every rank calls it.
    pub fn new(
        cfg: &Config,
        model: &Llama,
        mesh: &'m DeviceMesh,
        device: &Device,
    ) -> Result<Option<Self>, TrainError> {
        let mode = cfg.parallelism.shard;
        if mode == Shard::None {
            return Ok(None);
        }
        let ranks = data_parallel(mesh);
        let (rank, shards) = (ranks.shard.rank(), ranks.shard.size());
        let bucket = cfg.parallelism.bucket_bytes();
        let (groups, ranges) = cut(mode, model, rank, shards, bucket);
        let all_ranges = (0..shards)
            .map(|r| cut(mode, model, r, shards, bucket).1)
            .map(|rs| rs.into_iter().map(|r| r.unwrap_or(0..0)).collect())
            .collect();
        let costs = model
            .specs()
            .iter()
            .map(|s| whole::cost(&s.shape))
            .collect();
        let ahead = cfg.parallelism.prefetches() && shards > 1;
        let background = ahead.then(|| Background::new(ranks.shard)).flatten();
        let choice = cfg.parallelism.collectives;
        let coll = collective::choose(choice, ranks, device, bucket, background)?;
        Ok(Some(Self {
            mode,
            groups,
            rank,
            shards,
            ranges,
            all_ranges,
            costs,
            mesh,
            coll,
            device: device.clone(),
        }))
    }

    /// The communicators of this plan's collectives.
    fn ranks(&self) -> Ranks<'m> {
        data_parallel(self.mesh)
    }

    /// What carries the sharded collectives (host-staged MPI, NCCL), for the `start` event.
    pub fn describe_collectives(&self) -> String {
        self.coll.describe()
    }

    /// Seconds the device spent in this plan's collectives since the last call (NCCL; 0 on
    /// the host path, whose waits the caller's clock counts).
    pub fn device_busy_s(&self) -> f64 {
        self.coll.device_busy_s()
    }

    /// The ranks of a replica, over which the state is cut.
    pub fn shards(&self) -> usize {
        self.shards
    }

    /// The elements of each parameter whose optimizer state this rank keeps.
    pub fn ranges(&self) -> &[Option<Range<usize>>] {
        &self.ranges
    }

    /// The mode.
    pub fn mode(&self) -> Shard {
        self.mode
    }

    /// Whether the next stage's weights are gathered while the current one computes (with
    /// `parameters`: on the host path with `parallelism.prefetch` and an MPI library that
    /// allows it; always on the device path).
    pub fn prefetches(&self) -> bool {
        self.shards_parameters() && self.shards > 1 && self.coll.gathers_ahead()
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

    /// The one group of the `optimizer` and `gradients` modes: the whole model.
    fn whole_model(&self) -> &Sharded {
        &self.groups[0].flat
    }

    /// `flat` (this rank's range of the flattened parameters of `group`) cut into pieces, as
    /// [`ShardPlan::pieces`] cuts whole tensors: on flex copied into tensors of their own
    /// (as before the device path existed), elsewhere views of `flat` on the device.
    fn cut(&self, group: &Group, flat: Tensor<1>) -> Vec<Tensor<1>> {
        let lengths = self.ranges[group.params.clone()]
            .iter()
            .map(|r| r.as_ref().map_or(0, Range::len));
        if crate::tensor::on_host_threads(&self.device) {
            return split(&into_vec(flat), lengths, &self.device);
        }
        let mut at = 0;
        lengths
            .map(|n| {
                at += n;
                flat.clone().slice(at - n..at)
            })
            .collect()
    }

    /// The loss and this rank's range of the gradients, averaged over the ranks (as pieces,
    /// see [`ShardPlan::pieces`]), and the global norm of the averaged gradients. Not for
    /// the `parameters` mode, whose gradients are averaged stage by stage ([`StageShards`]).
    pub fn average(
        &self,
        model: &Llama,
        loss: f32,
        grads: Vec<Tensor<1>>,
    ) -> Result<(f32, Vec<Tensor<1>>, f32), TrainError> {
        let ranks = self.ranks();
        if self.mode != Shard::Gradients {
            // The replicated run's all-reduce and norm, bit for bit: every rank has the
            // whole averaged gradients here.
            let (loss, grads) = self.coll.mean(ranks, loss, grads)?;
            let norm = crate::parallel::tensor::global_norm(model, &grads);
            return Ok((loss, self.pieces(&grads), norm));
        }
        let flat = self.whole_model();
        let mine = flat.range(self.rank).len();
        let shard = self.coll.reduce_scatter_mean(ranks, flat, grads)?.wait()?;
        let shard = shard.slice(0..mine);
        let pieces = self.cut(&self.groups[0], shard.clone());
        let sq = self.square_sum(model, std::slice::from_ref(&shard), &pieces);
        let (loss, norm) = self.loss_and_norm(loss, sq);
        Ok((loss, pieces, norm))
    }

    /// The sum of squares this rank counts in the global norm of gradients of which it holds
    /// `flat` (its ranges, concatenated) cut into `pieces` (one per parameter): over
    /// `flat`, in one running sum in model order, without tensor parallelism (the bits of
    /// every run before it); else each element once over the `tp` ranks
    /// ([`crate::parallel::tensor::counted_square_sum`]).
    fn square_sum(&self, model: &Llama, flat: &[Tensor<1>], pieces: &[Tensor<1>]) -> f64 {
        match self.mesh.shape().size(Dim::Tp) {
            1 => self.coll.square_sum(flat),
            _ => crate::parallel::tensor::counted_square_sum(model, pieces),
        }
    }

    /// The mean of the data-parallel ranks' losses and the global norm of
    /// gradients of which every rank of a replica holds its own range, whose sum of squares
    /// is `sq` (the replicas hold the same ranges).
    pub fn loss_and_norm(&self, loss: f32, sq: f64) -> (f32, f32) {
        let ranks = self.ranks();
        let mut l = [loss];
        ranks.dp.all_reduce_sum_f32(&mut l);
        let mut sq = [sq];
        ranks.shard.all_reduce_sum_f64(&mut sq);
        self.mesh.group(Dim::Tp).all_reduce_sum_f64(&mut sq);
        (l[0] / ranks.dp.size() as f32, sq[0].sqrt() as f32)
    }

    /// Replaces `params` with the whole parameters gathered from every rank's updated
    /// range (`pieces`, this rank's; taken, so that on the host path each is copied to the
    /// host once). Not for the `parameters` mode, which keeps its pieces.
    pub fn gather(
        &self,
        pieces: Vec<Tensor<1>>,
        params: &mut Vec<Tensor<1>>,
    ) -> Result<(), TrainError> {
        let lengths = params.iter().map(|p| p.dims()[0]).collect();
        *params = self
            .all_gather(self.whole_model(), pieces, lengths, false)?
            .wait()?;
        Ok(())
    }

    /// The whole tensors of `flat` (of `lengths` elements) gathered from the ranges of every
    /// rank of this rank's replica, of which `pieces` are this rank's; `ahead`: while the
    /// caller computes, where the collectives can.
    fn all_gather(
        &self,
        flat: &Sharded,
        pieces: Vec<Tensor<1>>,
        lengths: Vec<usize>,
        ahead: bool,
    ) -> Result<InFlight<Vec<Tensor<1>>>, TrainError> {
        self.coll
            .all_gather(self.ranks(), flat, pieces, lengths, ahead)
    }

    /// Whether each rank keeps only its pieces of the parameters (`parameters`).
    pub fn shards_parameters(&self) -> bool {
        self.mode == Shard::Parameters
    }

    /// The whole parameters gathered from every rank's `pieces`, as host tensors (the final
    /// weights of a parameter-sharded run); every rank calls it, and holds one stage's
    /// whole weights at a time besides what it returns.
    pub fn whole_host(
        &self,
        specs: &[ParamSpec],
        pieces: &[Tensor<1>],
    ) -> Result<Vec<HostTensor>, TrainError> {
        let mut out = Vec::with_capacity(specs.len());
        for g in &self.groups {
            let specs = &specs[g.params.clone()];
            let lengths = specs.iter().map(ParamSpec::numel).collect();
            let pieces = pieces[g.params.clone()].to_vec();
            let full = self.all_gather(&g.flat, pieces, lengths, false)?.wait()?;
            for (spec, values) in specs.iter().zip(full) {
                out.push(HostTensor::f32(
                    spec.name.clone(),
                    spec.shape.clone(),
                    into_vec(values),
                ));
            }
        }
        Ok(out)
    }
}

/// Muon's whole matrices: each gathered to one owner rank of the replica and its result's
/// pieces scattered back ([`whole`]), on the host through MPI.
impl crate::optim::Wholes for ShardPlan<'_> {
    fn map_whole(
        &self,
        pieces: Vec<Option<Vec<Tensor<1>>>>,
        f: &dyn Fn(usize, Vec<Tensor<1>>) -> Tensor<1>,
    ) -> Vec<Option<Tensor<1>>> {
        let at = whole::Pieces {
            ranges: &self.all_ranges,
            costs: &self.costs,
        };
        whole::map_whole(self.ranks().shard, &at, pieces, f, &self.device)
    }
}

/// The groups of `mode` over the parameters of `model`, cut into `shards` ranges, and the
/// elements of each parameter in range `rank`.
fn cut(
    mode: Shard,
    model: &Llama,
    rank: usize,
    shards: usize,
    bucket: usize,
) -> (Vec<Group>, Vec<Option<Range<usize>>>) {
    let specs = model.specs();
    let spans: Vec<Range<usize>> = match mode {
        Shard::Parameters => model.stages().into_iter().map(|s| model.owned(s)).collect(),
        _ => std::iter::once(0..specs.len()).collect(),
    };
    let mut ranges = vec![None; specs.len()];
    let groups = spans
        .into_iter()
        .map(|params| {
            let total = specs[params.clone()].iter().map(ParamSpec::numel).sum();
            let flat = Sharded::new(total, shards, bucket);
            let mine = flat.range(rank);
            let mut at = 0;
            for i in params.clone() {
                let n = specs[i].numel();
                let (lo, hi) = (at.max(mine.start), (at + n).min(mine.end));
                ranges[i] = (lo < hi).then(|| lo - at..hi - at);
                at += n;
            }
            Group { params, flat }
        })
        .collect();
    (groups, ranges)
}

/// The data-parallel groups of `mesh`.
fn data_parallel(mesh: &DeviceMesh) -> Ranks<'_> {
    Ranks {
        dp: mesh.group(Dims::DP),
        shard: mesh.group(Dim::DpShard),
        replica: mesh.group(Dim::DpReplicate),
    }
}

/// The [`StageParams`] of a parameter-sharded step: a stage's whole weights all-gathered
/// from every rank's pieces (this rank's are `pieces`, [`ShardPlan::pieces`] of the whole),
/// its gradients reduce-scattered (the mean over the ranks) and this rank's range of them
/// accumulated until [`StageShards::take_grads`].
///
/// Overlap: the next expected stage's all-gather is started when a stage is handed out
/// (on the device path always, on the host path with `parallelism.prefetch`), and a stage's
/// reduce-scatter is waited for only when the next one is handed over, so that on NCCL it
/// runs while the backward pass computes the stage before it.
pub struct StageShards<'a> {
    plan: &'a ShardPlan<'a>,
    model: &'a Llama,
    pieces: &'a [Tensor<1>],
    /// Per stage, this rank's range of the accumulated gradients (padding included).
    grads: Vec<Tensor<1>>,
    /// Seconds spent in the collectives (waiting for them, when they run ahead).
    comm_s: f64,
    /// The stages still expected after the one fetched ahead, next first.
    order: VecDeque<Stage>,
    /// The stage whose weights are being gathered ahead, and the gather.
    ahead: Option<(Stage, InFlight<Vec<Tensor<1>>>)>,
    /// The last reduce-scatter, not yet added to `grads`: its group and result.
    reducing: Option<(usize, InFlight<Tensor<1>>)>,
    /// The first collective that failed (the pass goes on with zeros; the error is
    /// returned by [`StageShards::take_grads`] or [`StageShards::check`]).
    failed: Option<TrainError>,
}

impl<'a> StageShards<'a> {
    /// The stages of `model` cut by `plan` (a `parameters` plan).
    pub fn new(plan: &'a ShardPlan<'a>, model: &'a Llama, pieces: &'a [Tensor<1>]) -> Self {
        Self {
            grads: plan.zeroed_grads(),
            plan,
            model,
            pieces,
            comm_s: 0.0,
            order: VecDeque::new(),
            ahead: None,
            reducing: None,
            failed: None,
        }
    }

    /// Keeps the first error of a collective.
    fn keep<T>(&mut self, r: Result<T, TrainError>) -> Option<T> {
        match r {
            Ok(v) => Some(v),
            Err(e) => {
                self.failed.get_or_insert(e);
                None
            }
        }
    }

    /// The whole weights of stage `s`: the gather started ahead, or one now.
    fn gather_now(&mut self, s: Stage) -> Result<Vec<Tensor<1>>, TrainError> {
        match self.ahead.take() {
            Some((next, pending)) if next == s => pending.wait(),
            other => {
                // Not the stage expected: the gather started ahead still ran on every
                // rank (the calls stay matched); this pass fetches nothing ahead any more.
                if let Some((_, p)) = other {
                    drop(p.wait()?);
                }
                self.order.clear();
                let (flat, pieces, lengths) = self.stage_pieces(s);
                self.plan.all_gather(&flat, pieces, lengths, false)?.wait()
            }
        }
    }

    /// Starts gathering the next expected stage's weights ahead.
    fn fetch_ahead(&mut self) {
        let Some(next) = self.order.pop_front() else {
            return;
        };
        let (flat, pieces, lengths) = self.stage_pieces(next);
        let started = self.plan.all_gather(&flat, pieces, lengths, true);
        self.ahead = self.keep(started).map(|p| (next, p));
    }

    /// What gathering stage `s` takes: its group's cut, this rank's pieces of its
    /// parameters, and their whole lengths.
    fn stage_pieces(&self, s: Stage) -> (Sharded, Vec<Tensor<1>>, Vec<usize>) {
        let g = &self.plan.groups[self.group(s)];
        let specs = &self.model.specs()[g.params.clone()];
        let lengths = specs.iter().map(ParamSpec::numel).collect();
        (g.flat, self.pieces[g.params.clone()].to_vec(), lengths)
    }

    /// Seconds spent in the all-gathers and reduce-scatters so far.
    pub fn comm_s(&self) -> f64 {
        self.comm_s
    }

    /// The error of a collective of this pass, if one failed.
    pub fn check(&mut self) -> Result<(), TrainError> {
        match self.failed.take() {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }

    /// The group of stage `s` (stages are numbered in [`Llama::stages`] order).
    fn group(&self, s: Stage) -> usize {
        match s {
            Stage::Embed => 0,
            Stage::Block(l) => 1 + l,
            Stage::Head => self.plan.groups.len() - 1,
        }
    }

    /// Waits for the last reduce-scatter and adds it to its stage's gradients.
    fn finish_reduce(&mut self) {
        let Some((i, flight)) = self.reducing.take() else {
            return;
        };
        let t0 = Instant::now();
        let got = flight.wait();
        self.comm_s += t0.elapsed().as_secs_f64();
        if let Some(mine) = self.keep(got) {
            self.grads[i] = self.grads[i].clone() + mine;
        }
    }

    /// This rank's pieces of the gradients accumulated so far (as [`ShardPlan::pieces`])
    /// and their sum of squares, and zeros in their place; the error of a collective of the
    /// pass if one failed.
    pub fn take_grads(&mut self) -> Result<(Vec<Tensor<1>>, f64), TrainError> {
        self.finish_reduce();
        self.check()?;
        let (plan, rank) = (self.plan, self.plan.rank);
        let grads = std::mem::replace(&mut self.grads, plan.zeroed_grads());
        let mine: Vec<Tensor<1>> = (plan.groups.iter().zip(grads))
            .map(|(g, t)| t.slice(0..g.flat.range(rank).len()))
            .collect();
        let mut out = Vec::with_capacity(plan.ranges.len());
        for (g, t) in plan.groups.iter().zip(&mine) {
            out.extend(plan.cut(g, t.clone()));
        }
        // One running sum in model order, as over the whole range of the other modes.
        let sq = plan.square_sum(self.model, &mine, &out);
        Ok((out, sq))
    }
}

impl ShardPlan<'_> {
    /// Zeros for this rank's padded shard of every group's gradients.
    fn zeroed_grads(&self) -> Vec<Tensor<1>> {
        (self.groups.iter())
            .map(|g| Tensor::zeros([g.flat.shard], &self.device))
            .collect()
    }
}

impl StageParams for StageShards<'_> {
    fn gather(&mut self, s: Stage) -> Vec<Tensor<1>> {
        let t0 = Instant::now();
        let got = self.gather_now(s);
        self.comm_s += t0.elapsed().as_secs_f64();
        let got = self.keep(got);
        self.fetch_ahead();
        got.unwrap_or_else(|| {
            // A collective failed: zeros of the right sizes let the pass end; the error
            // is what the step returns.
            let (_, _, lengths) = self.stage_pieces(s);
            (lengths.into_iter())
                .map(|n| Tensor::zeros([n], &self.plan.device))
                .collect()
        })
    }

    fn expect(&mut self, order: Vec<Stage>) {
        if self.plan.prefetches() {
            self.order = order.into();
            self.fetch_ahead();
        }
    }

    fn reduce(&mut self, s: Stage, grads: Vec<Tensor<1>>) {
        self.finish_reduce();
        let i = self.group(s);
        let t0 = Instant::now();
        let ranks = self.plan.ranks();
        let started = (self.plan.coll).reduce_scatter_mean(ranks, &self.plan.groups[i].flat, grads);
        self.comm_s += t0.elapsed().as_secs_f64();
        self.reducing = self.keep(started).map(|f| (i, f));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_ranges_of_all_ranks_tile_every_parameter_once() {
        let mut cfg = Config::default();
        cfg.parallelism.shard = Shard::Gradients;
        let model = Llama::new(&cfg.model, 300);
        let specs = model.specs();
        for (mode, world) in [Shard::Gradients, Shard::Parameters]
            .into_iter()
            .flat_map(|m| (1..=5).map(move |w| (m, w)))
        {
            for (i, spec) in specs.iter().enumerate() {
                let mut covered: Vec<Range<usize>> = (0..world)
                    .filter_map(|r| cut(mode, &model, r, world, 1 << 20).1[i].clone())
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
        let mesh = DeviceMesh::along(Box::new(kiln_dist::Solo), Dim::DpReplicate);
        assert!(
            ShardPlan::new(&cfg, &model, &mesh, &Device::flex())
                .unwrap()
                .is_none()
        );
    }
}

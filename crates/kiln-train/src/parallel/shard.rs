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
//! file per rank), written by that rank in parallel ([`ShardPlan::write_shards`]); rank 0
//! publishes them under one manifest (see [`crate::checkpoint`]).

use crate::checkpoint::{self, HostTensor, ShardFile};
use crate::config::{Config, Shard};
use crate::error::TrainError;
use crate::model::{Llama, ParamSpec, Stage};
use crate::parallel::stagewise::StageParams;
use crate::tensor::{DeviceTensor, flatten, from_vec, into_vec, split};
use burn::tensor::{Device, Tensor};
use kiln_dist::{Background, Collective, Mesh, Pending, Sharded};
use kiln_run::layout;
use std::collections::VecDeque;
use std::ops::Range;
use std::path::Path;
use std::time::Instant;

/// Parameters flattened and cut over the ranks together.
#[derive(Debug, Clone)]
struct Group {
    /// Their indices in the model's parameters.
    params: Range<usize>,
    flat: Sharded,
}

/// This rank's part of a sharded run's state (see the module documentation).
pub struct ShardPlan {
    mode: Shard,
    /// The whole model, or with `parameters` each stage in [`Llama::stages`] order.
    groups: Vec<Group>,
    /// This rank's shard: its rank among the ranks of its replica.
    rank: usize,
    /// The ranks of a replica, over which the state is cut.
    shards: usize,
    /// Bytes per all-reduce bucket (`parallelism.bucket_mb`).
    bucket: usize,
    /// The elements of each parameter in this rank's range (`None`: none).
    ranges: Vec<Option<Range<usize>>>,
    /// The ranks this rank shards with, and those holding the same shard in the other
    /// replicas (`parallelism.dp_replicate`).
    mesh: Mesh,
    /// With `parameters` and `parallelism.prefetch`, where the next stage's weights are
    /// gathered while the current one computes (`None`: gathered when needed).
    background: Option<Background>,
}

impl ShardPlan {
    /// The plan of `cfg` for this rank of `comm`; `None` when nothing is sharded, an error
    /// when `parallelism.dp_replicate` does not divide the ranks. Every rank calls it.
    pub fn new(
        cfg: &Config,
        model: &Llama,
        comm: &dyn Collective,
    ) -> Result<Option<Self>, TrainError> {
        let mode = cfg.parallelism.shard;
        if mode == Shard::None {
            return Ok(None);
        }
        let mesh = Mesh::new(comm, cfg.parallelism.dp_replicate)?;
        let (rank, shards) = (mesh.shard().rank(), mesh.shard().size());
        let bucket = cfg.parallelism.bucket_mb.max(1) << 20;
        let (groups, ranges) = cut(mode, model, rank, shards, bucket);
        let ahead = cfg.parallelism.prefetches() && shards > 1;
        let background = ahead.then(|| Background::new(mesh.shard())).flatten();
        Ok(Some(Self {
            mode,
            groups,
            rank,
            shards,
            bucket,
            ranges,
            mesh,
            background,
        }))
    }

    /// The ranks this rank shards the state with (its replica).
    pub fn shard_group(&self) -> &dyn Collective {
        self.mesh.shard()
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

    /// Whether the next stage's weights are gathered while the current one computes.
    pub fn prefetches(&self) -> bool {
        self.background.is_some()
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
    /// [`ShardPlan::pieces`] cuts whole tensors.
    fn cut(&self, group: &Group, flat: &[f32], device: &Device) -> Vec<Tensor<1>> {
        let lengths = self.ranges[group.params.clone()]
            .iter()
            .map(|r| r.as_ref().map_or(0, Range::len));
        split(flat, lengths, device)
    }

    /// The loss and this rank's range of the gradients, averaged over the ranks (as pieces,
    /// see [`ShardPlan::pieces`]), and the global norm of the averaged gradients. Not for
    /// the `parameters` mode, whose gradients are averaged stage by stage ([`StageShards`]).
    pub fn average(
        &self,
        comm: &dyn Collective,
        loss: f32,
        grads: Vec<Tensor<1>>,
        device: &Device,
    ) -> (f32, Vec<Tensor<1>>, f32) {
        if self.mode != Shard::Gradients {
            // The replicated run's all-reduce and norm, bit for bit: every rank has the
            // whole averaged gradients here.
            let reduce = kiln_dist::BucketedAllReduce::new(self.bucket);
            let (loss, grads) = crate::tensor::mean_over_ranks(&reduce, comm, loss, grads, device);
            let norm = crate::optim::global_norm(&grads);
            return (loss, self.pieces(&grads), norm);
        }
        let flat = self.whole_model();
        let mine = flat.range(self.rank).len();
        let mut host: Vec<Vec<f32>> = grads.into_iter().map(into_vec).collect();
        let shard = &self.mesh.reduce_scatter_mean(flat, &mut host)[..mine];
        let (loss, norm) = self.loss_and_norm(comm, loss, sum_of_squares(shard));
        (loss, self.cut(&self.groups[0], shard, device), norm)
    }

    /// The mean of the ranks' losses (every rank of `comm`, the job) and the global norm of
    /// gradients of which every rank of a replica holds its own range, whose sum of squares
    /// is `sq` (the replicas hold the same ranges).
    pub fn loss_and_norm(&self, comm: &dyn Collective, loss: f32, sq: f64) -> (f32, f32) {
        let mut l = [loss];
        comm.all_reduce_sum_f32(&mut l);
        let mut sq = [sq];
        self.mesh.shard().all_reduce_sum_f64(&mut sq);
        (l[0] / comm.size() as f32, sq[0].sqrt() as f32)
    }

    /// Replaces `params` with the whole parameters gathered from every rank's updated
    /// range (`pieces`, this rank's; taken, so that each is copied to the host once). Not
    /// for the `parameters` mode, which keeps its pieces.
    pub fn gather(&self, pieces: Vec<Tensor<1>>, params: &mut Vec<Tensor<1>>, device: &Device) {
        let lengths = params.iter().map(|p| p.dims()[0]);
        *params = self.all_gather(self.whole_model(), pieces, lengths, device);
    }

    /// The whole tensors of `flat` (of `lengths` elements) gathered from the ranges of every
    /// rank of this rank's replica, of which `pieces` are this rank's.
    fn all_gather(
        &self,
        flat: &Sharded,
        pieces: Vec<Tensor<1>>,
        lengths: impl Iterator<Item = usize>,
        device: &Device,
    ) -> Vec<Tensor<1>> {
        self.all_gather_host(flat, pieces, lengths)
            .into_iter()
            .map(|v| from_vec(v, device))
            .collect()
    }

    /// [`ShardPlan::all_gather`] into host vectors.
    fn all_gather_host(
        &self,
        flat: &Sharded,
        pieces: Vec<Tensor<1>>,
        lengths: impl Iterator<Item = usize>,
    ) -> Vec<Vec<f32>> {
        gathered(flat, self.mesh.shard(), &padded(flat, pieces), lengths)
    }

    /// [`ShardPlan::all_gather_host`] started in the background (`None` without one): the
    /// pieces are copied to the host here, the collective runs while the caller computes.
    fn all_gather_later(
        &self,
        flat: &Sharded,
        pieces: Vec<Tensor<1>>,
        lengths: Vec<usize>,
    ) -> Option<Pending<Vec<Vec<f32>>>> {
        let background = self.background.as_ref()?;
        let (flat, mine) = (*flat, padded(flat, pieces));
        Some(background.start(move |comm| gathered(&flat, comm, &mine, lengths.into_iter())))
    }

    /// Reads the checkpoint `dir` as this rank keeps it: its range of each optimizer tensor
    /// and, with `parameters`, of each weight; the other weights whole (see
    /// [`checkpoint::load_kept`]: only those bytes are read, and the tensor files are not
    /// hashed, which [`checkpoint::verify`] did on rank 0).
    pub fn read_checkpoint(
        &self,
        dir: &Path,
        specs: &[ParamSpec],
    ) -> Result<checkpoint::Checkpoint, checkpoint::CheckpointError> {
        let index: std::collections::HashMap<&str, usize> = specs
            .iter()
            .enumerate()
            .map(|(i, s)| (s.name.as_str(), i))
            .collect();
        let keep = |part: checkpoint::Part, name: &str| {
            let param = match part {
                checkpoint::Part::Weights if !self.shards_parameters() => return None,
                checkpoint::Part::Weights => name,
                // `<param>.<slot>`
                checkpoint::Part::Optimizer => name.rsplit_once('.')?.0,
            };
            let i = *index.get(param)?;
            Some(self.ranges[i].clone().unwrap_or(0..0))
        };
        checkpoint::load_kept(dir, &keep)
    }

    /// Whether each rank keeps only its pieces of the parameters (`parameters`).
    pub fn shards_parameters(&self) -> bool {
        self.mode == Shard::Parameters
    }

    /// The whole parameters gathered from every rank's `pieces`, as host tensors (the final
    /// weights of a parameter-sharded run); every rank calls it, and holds one stage's
    /// whole weights at a time besides what it returns.
    pub fn whole_host(&self, specs: &[ParamSpec], pieces: &[Tensor<1>]) -> Vec<HostTensor> {
        let mut out = Vec::with_capacity(specs.len());
        for g in &self.groups {
            let specs = &specs[g.params.clone()];
            let lengths = specs.iter().map(ParamSpec::numel);
            let full = self.all_gather_host(&g.flat, pieces[g.params.clone()].to_vec(), lengths);
            for (spec, values) in specs.iter().zip(full) {
                out.push(HostTensor::f32(
                    spec.name.clone(),
                    spec.shape.clone(),
                    values,
                ));
            }
        }
        out
    }

    /// This rank's pieces of the weights, named `<param>@<first element>` (the empty ones
    /// left out).
    fn named_pieces(&self, specs: &[ParamSpec], pieces: &[Tensor<1>]) -> Vec<HostTensor> {
        specs
            .iter()
            .zip(pieces)
            .zip(&self.ranges)
            .filter_map(|((spec, t), r)| {
                let r = r.as_ref()?;
                let piece = DeviceTensor {
                    name: format!("{}@{}", spec.name, r.start),
                    shape: vec![r.len()],
                    tensor: t.clone(),
                };
                Some(piece.to_host())
            })
            .collect()
    }

    /// Writes this rank's shards for the checkpoint of `step` into its staging directory
    /// under `root` (its optimizer pieces `state`; with `parameters` also its weight
    /// `pieces`), and tells every rank of `comm` (the job) every writer's files: on rank 0
    /// the shards to publish; an error when any writer failed (every rank gets it, so all
    /// stop). The ranks of the first replica write; the other replicas hold the same shards.
    pub fn write_shards(
        &self,
        comm: &dyn Collective,
        root: &Path,
        step: u64,
        state: &[DeviceTensor],
        (specs, pieces): (&[ParamSpec], &[Tensor<1>]),
    ) -> Result<Vec<ShardFile>, TrainError> {
        let (rank, ranks) = (self.rank, self.shards);
        let writes = self.mesh.replica().rank() == 0;
        let mut files = Vec::new();
        if writes {
            let host: Vec<HostTensor> = state.iter().map(DeviceTensor::to_host).collect();
            files.push((layout::checkpoint_optimizer_shard(rank, ranks), host));
        }
        if writes && self.shards_parameters() {
            let weights = self.named_pieces(specs, pieces);
            files.push((layout::checkpoint_model_shard(rank, ranks), weights));
        }
        let mine: Result<Vec<ShardFile>, String> = files
            .into_iter()
            .map(|(name, t)| checkpoint::write_shard(root, step, name, &t))
            .collect::<Result<_, _>>()
            .map_err(|e| e.to_string());
        let mut all = Vec::with_capacity(self.shards * 2);
        for r in 0..self.shards {
            let mut bytes = match (writes && r == self.rank, &mine) {
                (true, m) => serde_json::to_vec(m).unwrap_or_default(),
                (false, _) => Vec::new(),
            };
            comm.broadcast_vec(self.mesh.job_rank(0, r), &mut bytes);
            let got: Result<Vec<ShardFile>, String> = serde_json::from_slice(&bytes)
                .unwrap_or_else(|e| Err(format!("unreadable shard report of rank {r}: {e}")));
            all.extend(got.map_err(|e| {
                TrainError::Parallel(format!(
                    "rank {r} could not write its shards of step {step}: {e}"
                ))
            })?);
        }
        Ok(all)
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

/// The whole tensors of `flat` (of `lengths` elements) all-gathered over `comm` from every
/// rank's padded shard (this rank's is `mine`).
fn gathered(
    flat: &Sharded,
    comm: &dyn Collective,
    mine: &[f32],
    lengths: impl Iterator<Item = usize>,
) -> Vec<Vec<f32>> {
    let mut full: Vec<Vec<f32>> = lengths.map(|n| vec![0.0; n]).collect();
    flat.all_gather_into(comm, mine, &mut full);
    full
}

/// This rank's `pieces` of `flat` on the host, padded to a whole shard (the padding goes in
/// with the values: no second allocation).
fn padded(flat: &Sharded, pieces: Vec<Tensor<1>>) -> Vec<f32> {
    let have: usize = pieces.iter().map(|p| p.dims()[0]).sum();
    flatten(pieces, &vec![0.0; flat.shard.saturating_sub(have)])
}

/// The sum of the squares of `values`, in f64.
fn sum_of_squares(values: &[f32]) -> f64 {
    sum_of_squares_from(0.0, values)
}

/// `acc` plus the squares of `values`, added in order.
fn sum_of_squares_from(acc: f64, values: &[f32]) -> f64 {
    values
        .iter()
        .fold(acc, |s, &g| s + f64::from(g) * f64::from(g))
}

/// The [`StageParams`] of a parameter-sharded step: a stage's whole weights all-gathered
/// from every rank's pieces (this rank's are `pieces`, [`ShardPlan::pieces`] of the whole),
/// its gradients reduce-scattered (the mean over the ranks) and this rank's range of them
/// accumulated until [`StageShards::take_grads`].
pub struct StageShards<'a> {
    plan: &'a ShardPlan,
    model: &'a Llama,
    pieces: &'a [Tensor<1>],
    device: Device,
    /// Per stage, this rank's range of the accumulated gradients (padding included).
    grads: Vec<Vec<f32>>,
    /// Seconds spent in the collectives (waiting for them, when they run ahead).
    comm_s: f64,
    /// The stages still expected after the one fetched ahead, next first.
    order: VecDeque<Stage>,
    /// The stage whose weights are being gathered ahead, and the gather.
    ahead: Option<(Stage, Pending<Vec<Vec<f32>>>)>,
}

impl<'a> StageShards<'a> {
    /// The stages of `model` cut by `plan` (a `parameters` plan).
    pub fn new(
        plan: &'a ShardPlan,
        model: &'a Llama,
        pieces: &'a [Tensor<1>],
        device: &Device,
    ) -> Self {
        Self {
            grads: plan
                .groups
                .iter()
                .map(|g| vec![0.0; g.flat.shard])
                .collect(),
            plan,
            model,
            pieces,
            device: device.clone(),
            comm_s: 0.0,
            order: VecDeque::new(),
            ahead: None,
        }
    }

    /// The whole weights of stage `s`, on the host: the gather started ahead, or one now.
    fn gather_host(&mut self, s: Stage) -> Vec<Vec<f32>> {
        match self.ahead.take() {
            Some((next, pending)) if next == s => pending.wait(),
            other => {
                // Not the stage expected: the gather started ahead still ran on every
                // rank (the calls stay matched); this pass fetches nothing ahead any more.
                drop(other.map(|(_, p)| p.wait()));
                self.order.clear();
                let (flat, pieces, lengths) = self.stage_pieces(s);
                self.plan
                    .all_gather_host(&flat, pieces, lengths.into_iter())
            }
        }
    }

    /// Starts gathering the next expected stage's weights in the background.
    fn fetch_ahead(&mut self) {
        let Some(next) = self.order.pop_front() else {
            return;
        };
        let (flat, pieces, lengths) = self.stage_pieces(next);
        self.ahead = (self.plan)
            .all_gather_later(&flat, pieces, lengths)
            .map(|p| (next, p));
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

    /// The group of stage `s` (stages are numbered in [`Llama::stages`] order).
    fn group(&self, s: Stage) -> usize {
        match s {
            Stage::Embed => 0,
            Stage::Block(l) => 1 + l,
            Stage::Head => self.plan.groups.len() - 1,
        }
    }

    /// This rank's pieces of the gradients accumulated so far (as [`ShardPlan::pieces`])
    /// and their sum of squares, and zeros in their place.
    pub fn take_grads(&mut self) -> (Vec<Tensor<1>>, f64) {
        let (plan, rank) = (self.plan, self.plan.rank);
        let mine = |g: &Group| g.flat.range(rank).len();
        // One running sum in model order, as over the whole range of the other modes.
        let sq = plan
            .groups
            .iter()
            .zip(&self.grads)
            .map(|(g, grads)| &grads[..mine(g)])
            .fold(0.0, sum_of_squares_from);
        let mut out = Vec::with_capacity(plan.ranges.len());
        for (g, grads) in plan.groups.iter().zip(&mut self.grads) {
            out.extend(plan.cut(g, &grads[..mine(g)], &self.device));
            grads.fill(0.0);
        }
        (out, sq)
    }
}

impl StageParams for StageShards<'_> {
    fn gather(&mut self, s: Stage) -> Vec<Tensor<1>> {
        let t0 = Instant::now();
        let host = self.gather_host(s);
        self.comm_s += t0.elapsed().as_secs_f64();
        self.fetch_ahead();
        host.into_iter()
            .map(|v| from_vec(v, &self.device))
            .collect()
    }

    fn expect(&mut self, order: Vec<Stage>) {
        if self.plan.prefetches() {
            self.order = order.into();
            self.fetch_ahead();
        }
    }

    fn reduce(&mut self, s: Stage, grads: Vec<Tensor<1>>) {
        let i = self.group(s);
        let mut host: Vec<Vec<f32>> = grads.into_iter().map(into_vec).collect();
        let t0 = Instant::now();
        let mine = (self.plan.mesh).reduce_scatter_mean(&self.plan.groups[i].flat, &mut host);
        self.comm_s += t0.elapsed().as_secs_f64();
        for (a, g) in self.grads[i].iter_mut().zip(mine) {
            *a += g;
        }
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
        assert!(
            ShardPlan::new(&cfg, &model, &kiln_dist::Solo)
                .unwrap()
                .is_none()
        );
    }
}

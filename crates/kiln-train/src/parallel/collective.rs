//! The collectives of data parallelism on the ranks' tensors: [`DeviceCollective`], the one
//! seam between the gradient exchanges ([`crate::step::exchange`], [`super::shard`]) and how the
//! ranks' tensors meet, chosen once per run by [`choose`]:
//!
//! | implementation | chosen | how |
//! | --- | --- | --- |
//! | [`HostStaged`] | every device but CUDA and ROCm (flex, CubeCL's CPU runtime, Vulkan, Metal), ROCm without RCCL on every rank, and CUDA or ROCm with `parallelism.collectives = "host"` | each tensor copied to host memory, MPI in fixed buckets ([`kiln_dist::BucketedAllReduce`], [`kiln_dist::Sharded`]), copied back, in the same calls on every run and resume, so they give the same bits |
//! | [`OnDevice`] over [`Nccl`] | CUDA with several ranks | one flat device buffer per bucket or stage, NCCL's all-reduce, reduce-scatter and all-gather on a stream of kiln's own, ordered against CubeCL's stream by CUDA events (no host synchronisation, no whole-device wait) |
//! | [`OnDevice`] over [`Rccl`](crate::parallel::rccl::Rccl) | ROCm with several ranks, when every rank opens `librccl.so` | the same device buffers, RCCL (NCCL's API) on a stream of kiln's own, the host waiting for each (no AMD GPU has run it) |
//! | [`OnDevice`] over [`MpiWire`] | `parallelism.collectives = "device"` (tests) | the same device buffers as over NCCL, each flat buffer staged through host memory and MPI: what CI runs to exercise the device-side packing on CubeCL's CPU runtime |
//!
//! Layouts are [`kiln_dist::Sharded`]'s whatever the implementation: a group of tensors
//! flattened in model order and padded to `ranks x shard` elements, rank `r` owning
//! `[r x shard, (r + 1) x shard)`; so checkpoints, resumes and the optimizer's ranges do not
//! depend on which implementation ran.
//!
//! A reduce-scatter or all-gather hands back an [`InFlight`] result: over NCCL the collective
//! is queued and the caller goes on queueing its own work (the next stage's recomputation) until
//! it waits, which only makes CubeCL's stream wait for NCCL's (the overlap FSDP gets from its
//! second stream); elsewhere it is already done.

use super::nccl::Nccl;
use super::wire::{InFlight, MpiWire, Over, Ranks, Wire};
use crate::config::Collectives;
use crate::error::TrainError;
use crate::tensor::{flatten, from_vec, into_vec};
use burn::tensor::{Device, Tensor};
use kiln_dist::{Background, BucketedAllReduce, Collective, Sharded};

/// The collectives a data-parallel run makes on its tensors (see the module documentation).
/// Every rank makes the same calls in the same order with the same sizes.
pub trait DeviceCollective {
    /// What carries them, for the log and the `start` event.
    fn describe(&self) -> String;

    /// The mean over every data-parallel rank of `loss` and of each of `tensors` (whole).
    fn mean(
        &self,
        ranks: Ranks,
        loss: f32,
        tensors: Vec<Tensor<1>>,
    ) -> Result<(f32, Vec<Tensor<1>>), TrainError>;

    /// This rank's shard (`flat.shard` elements, zeros past the buffer's end) of the mean over
    /// every data-parallel rank of the concatenation of `tensors` (`flat.len` elements cut as
    /// `flat`): reduce-scattered over the shard's ranks, then averaged over the replicas.
    fn reduce_scatter_mean(
        &self,
        ranks: Ranks,
        flat: &Sharded,
        tensors: Vec<Tensor<1>>,
    ) -> Result<InFlight<Tensor<1>>, TrainError>;

    /// The whole tensors of `lengths` elements (`flat.len` in all) all-gathered over the
    /// shard's ranks from each rank's range of their concatenation; `pieces` are this rank's
    /// range cut at the tensors' boundaries. `ahead`: the caller computes until it waits (run
    /// on a second stream or thread where the implementation has one).
    fn all_gather(
        &self,
        ranks: Ranks,
        flat: &Sharded,
        pieces: Vec<Tensor<1>>,
        lengths: Vec<usize>,
        ahead: bool,
    ) -> Result<InFlight<Vec<Tensor<1>>>, TrainError>;

    /// The sum of the squares of every element of `tensors`, in an order fixed by their sizes
    /// (the same on every rank and every run).
    fn square_sum(&self, tensors: &[Tensor<1>]) -> f64;

    /// Whether [`DeviceCollective::all_gather`] with `ahead` runs while the caller computes.
    fn gathers_ahead(&self) -> bool;

    /// Seconds the device spent in collectives queued since the last call (NCCL's stream,
    /// timed by CUDA events, overlapped with compute or not; waits for the last one queued).
    /// 0 where the collectives block the caller, whose own clock counts them.
    fn device_busy_s(&self) -> f64 {
        0.0
    }
}

/// The collectives of a run over `ranks` on `device`, as `choice`
/// (`parallelism.collectives`) asks (every rank calls it: joining NCCL is a collective):
/// NCCL on CUDA devices when the job has several ranks, host-staged MPI otherwise.
/// `bucket` is the bytes of an all-reduce bucket (`parallelism.bucket_mb`); `background`, a
/// communicator over the shard's ranks driven by a thread of its own, gathers stages ahead
/// on the host path (`parallelism.prefetch`).
pub fn choose(
    choice: Collectives,
    ranks: Ranks,
    device: &Device,
    bucket: usize,
    background: Option<Background>,
) -> Result<Box<dyn DeviceCollective>, TrainError> {
    if ranks.dp.size() > 1
        && choice == Collectives::Auto
        && let Some(nccl) = Nccl::join_mesh(ranks, device)?
    {
        return Ok(Box::new(OnDevice::new(nccl, bucket, device)));
    }
    if ranks.dp.size() > 1
        && choice == Collectives::Auto
        && let Some(rccl) = crate::parallel::rccl::Rccl::join_mesh(ranks, device)?
    {
        return Ok(Box::new(OnDevice::new(rccl, bucket, device)));
    }
    if choice == Collectives::Device {
        return Ok(Box::new(OnDevice::new(MpiWire { bucket }, bucket, device)));
    }
    Ok(Box::new(HostStaged {
        bucket,
        background,
        device: device.clone(),
    }))
}

/// Host-staged MPI (see the module documentation): every call copies its tensors to host
/// memory and makes the bucketed MPI calls of [`kiln_dist`], the same calls and bits as
/// before the seam existed.
pub struct HostStaged {
    bucket: usize,
    background: Option<Background>,
    device: Device,
}

impl DeviceCollective for HostStaged {
    fn describe(&self) -> String {
        "host-staged MPI".into()
    }

    fn mean(
        &self,
        ranks: Ranks,
        loss: f32,
        tensors: Vec<Tensor<1>>,
    ) -> Result<(f32, Vec<Tensor<1>>), TrainError> {
        let reduce = BucketedAllReduce::new(self.bucket);
        Ok(crate::tensor::mean_over_ranks(
            &reduce,
            ranks.dp,
            loss,
            tensors,
            &self.device,
        ))
    }

    fn reduce_scatter_mean(
        &self,
        ranks: Ranks,
        flat: &Sharded,
        tensors: Vec<Tensor<1>>,
    ) -> Result<InFlight<Tensor<1>>, TrainError> {
        let mut host: Vec<Vec<f32>> = tensors.into_iter().map(into_vec).collect();
        let mine = flat.reduce_scatter_mean_hybrid(ranks.shard, ranks.replica, &mut host);
        Ok(InFlight::ready(from_vec(mine, &self.device)))
    }

    fn all_gather(
        &self,
        ranks: Ranks,
        flat: &Sharded,
        pieces: Vec<Tensor<1>>,
        lengths: Vec<usize>,
        ahead: bool,
    ) -> Result<InFlight<Vec<Tensor<1>>>, TrainError> {
        let device = self.device.clone();
        let to_device = move |host: Vec<Vec<f32>>| -> Vec<Tensor<1>> {
            host.into_iter().map(|v| from_vec(v, &device)).collect()
        };
        // The pieces are copied to the host here, on the caller's thread.
        let mine = padded(flat, pieces);
        let flat = *flat;
        match (&self.background, ahead) {
            (Some(background), true) => {
                let pending = background.start(move |comm| gathered(&flat, comm, &mine, lengths));
                Ok(InFlight::later(move || Ok(to_device(pending.wait()))))
            }
            _ => Ok(InFlight::ready(to_device(gathered(
                &flat,
                ranks.shard,
                &mine,
                lengths,
            )))),
        }
    }

    fn square_sum(&self, tensors: &[Tensor<1>]) -> f64 {
        host_square_sum(tensors)
    }

    fn gathers_ahead(&self) -> bool {
        self.background.is_some()
    }
}

/// One running f64 sum of the squares of `tensors`' host copies, in order.
fn host_square_sum(tensors: &[Tensor<1>]) -> f64 {
    tensors.iter().fold(0.0, |acc, t| {
        crate::tensor::to_vec(t)
            .iter()
            .fold(acc, |s, &g| s + f64::from(g) * f64::from(g))
    })
}

/// The whole tensors of `flat` (of `lengths` elements) all-gathered over `comm` from every
/// rank's padded shard (this rank's is `mine`).
fn gathered(
    flat: &Sharded,
    comm: &dyn Collective,
    mine: &[f32],
    lengths: Vec<usize>,
) -> Vec<Vec<f32>> {
    let mut full: Vec<Vec<f32>> = lengths.into_iter().map(|n| vec![0.0; n]).collect();
    flat.all_gather_into(comm, mine, &mut full);
    full
}

/// This rank's `pieces` of `flat` on the host, padded to a whole shard (the padding goes in
/// with the values: no second allocation).
fn padded(flat: &Sharded, pieces: Vec<Tensor<1>>) -> Vec<f32> {
    let have: usize = pieces.iter().map(|p| p.dims()[0]).sum();
    flatten(pieces, &vec![0.0; flat.shard.saturating_sub(have)])
}

/// Collectives on flat device buffers (see the module documentation): the tensors of a
/// bucket or a stage concatenated (and padded) into one buffer on the device, one collective
/// of the [`Wire`] on it, the results cut back into tensors as views of the result buffer.
pub struct OnDevice<W> {
    wire: W,
    /// Bytes of an all-reduce bucket (whole tensors are packed until one would pass it).
    bucket: usize,
    device: Device,
}

impl<W: Wire> OnDevice<W> {
    /// Collectives over `wire`, all-reducing in buckets of `bucket` bytes.
    pub fn new(wire: W, bucket: usize, device: &Device) -> Self {
        Self {
            wire,
            bucket,
            device: device.clone(),
        }
    }
}

/// `tensors` concatenated and padded with zeros to `total` elements (the empty ones left
/// out), and whether that is a new buffer (else it is the one tensor given, which others may
/// share).
fn pack(tensors: Vec<Tensor<1>>, total: usize, device: &Device) -> (Tensor<1>, bool) {
    let have: usize = tensors.iter().map(|t| t.dims()[0]).sum();
    let mut parts: Vec<Tensor<1>> = tensors.into_iter().filter(|t| t.dims()[0] > 0).collect();
    if total > have {
        parts.push(Tensor::zeros([total - have], device));
    }
    match parts.len() {
        0 => (Tensor::zeros([0], device), true),
        1 => (
            parts.pop().unwrap_or_else(|| Tensor::zeros([0], device)),
            false,
        ),
        _ => (Tensor::cat(parts, 0), true),
    }
}

/// Consecutive views of `flat` of `lengths` elements, from its start.
fn unpack(flat: Tensor<1>, lengths: impl IntoIterator<Item = usize>) -> Vec<Tensor<1>> {
    let mut at = 0;
    lengths
        .into_iter()
        .map(|n| {
            at += n;
            flat.clone().slice(at - n..at)
        })
        .collect()
}

/// Indices of `tensors` cut into buckets of whole consecutive tensors, each closed once it
/// holds `bucket` bytes of f32 (a tensor larger than a bucket is a bucket of its own).
fn buckets(lengths: &[usize], bucket: usize) -> Vec<std::ops::Range<usize>> {
    let cap = (bucket / 4).max(1);
    let mut out = Vec::new();
    let (mut start, mut fill) = (0, 0);
    for (i, &n) in lengths.iter().enumerate() {
        fill += n;
        if fill >= cap {
            out.push(start..i + 1);
            (start, fill) = (i + 1, 0);
        }
    }
    if start < lengths.len() {
        out.push(start..lengths.len());
    }
    out
}

impl<W: Wire> DeviceCollective for OnDevice<W> {
    fn describe(&self) -> String {
        self.wire.describe()
    }

    fn mean(
        &self,
        ranks: Ranks,
        loss: f32,
        tensors: Vec<Tensor<1>>,
    ) -> Result<(f32, Vec<Tensor<1>>), TrainError> {
        let mut sum = [loss];
        ranks.dp.all_reduce_sum_f32(&mut sum);
        let loss = sum[0] * (1.0 / ranks.dp.size() as f32);
        let lengths: Vec<usize> = tensors.iter().map(|t| t.dims()[0]).collect();
        // Every bucket is queued before the first is waited for: NCCL reduces one while
        // CubeCL packs the next.
        let mut tensors = tensors.into_iter();
        let mut queued = Vec::new();
        for b in buckets(&lengths, self.bucket) {
            let n = lengths[b.clone()].iter().sum();
            let part: Vec<Tensor<1>> = tensors.by_ref().take(b.len()).collect();
            let (buf, fresh) = pack(part, n, &self.device);
            queued.push((b, self.wire.all_reduce_mean(ranks, Over::Dp, buf, fresh)?));
        }
        let mut out = Vec::with_capacity(lengths.len());
        for (b, flight) in queued {
            out.extend(unpack(flight.wait()?, lengths[b].iter().copied()));
        }
        Ok((loss, out))
    }

    fn reduce_scatter_mean(
        &self,
        ranks: Ranks,
        flat: &Sharded,
        tensors: Vec<Tensor<1>>,
    ) -> Result<InFlight<Tensor<1>>, TrainError> {
        let (send, _) = pack(tensors, ranks.shard.size() * flat.shard, &self.device);
        self.wire.reduce_scatter_mean(ranks, flat, send)
    }

    fn all_gather(
        &self,
        ranks: Ranks,
        flat: &Sharded,
        pieces: Vec<Tensor<1>>,
        lengths: Vec<usize>,
        _ahead: bool,
    ) -> Result<InFlight<Vec<Tensor<1>>>, TrainError> {
        let (mine, _) = pack(pieces, flat.shard, &self.device);
        Ok(self
            .wire
            .all_gather(ranks, flat, mine)?
            .map(move |whole| unpack(whole, lengths)))
    }

    fn square_sum(&self, tensors: &[Tensor<1>]) -> f64 {
        crate::kernels::fixed_order::device_square_sum(tensors)
            .unwrap_or_else(|| host_square_sum(tensors))
    }

    fn gathers_ahead(&self) -> bool {
        true
    }

    fn device_busy_s(&self) -> f64 {
        self.wire.busy_s()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::mesh::{DeviceMesh, Dim, Dims, MeshShape};
    use crate::tensor::to_vec;
    use kiln_dist::Threads;

    #[test]
    fn buckets_hold_whole_tensors_and_close_at_the_size() {
        // 4-byte elements: a bucket of 40 bytes closes at 10 elements.
        assert_eq!(buckets(&[3, 4, 5, 20, 1, 1], 40), vec![0..3, 3..4, 4..6]);
        assert_eq!(buckets(&[], 40), Vec::<std::ops::Range<usize>>::new());
        // Empty tensors ride along with the bucket they are in.
        assert_eq!(buckets(&[0, 0], 4), vec![0..2]);
        assert_eq!(buckets(&[0, 1, 0], 4), vec![0..2, 2..3]);
    }

    /// Rank `r`'s tensors of `lengths` elements.
    fn tensors(r: usize, lengths: &[usize], d: &Device) -> Vec<Tensor<1>> {
        lengths
            .iter()
            .enumerate()
            .map(|(i, &n)| {
                let v = (0..n)
                    .map(|j| ((r * 31 + i * 7 + j) % 17) as f32 * 0.37 - 2.0)
                    .collect();
                from_vec(v, d)
            })
            .collect()
    }

    fn bits(ts: &[Tensor<1>]) -> Vec<Vec<u32>> {
        ts.iter()
            .map(|t| to_vec(t).iter().map(|v| v.to_bits()).collect())
            .collect()
    }

    /// On `world` thread ranks as `replicas` replicas: the mean, the reduce-scatter (and this
    /// rank's pieces cut from it) and the all-gather of both implementations, as bits.
    fn both(world: usize, replicas: usize, bucket: usize) -> Vec<[Vec<Vec<Vec<u32>>>; 2]> {
        const LENGTHS: [usize; 6] = [5, 0, 13, 7, 2, 1];
        std::thread::scope(|scope| {
            let handles: Vec<_> = Threads::job(world)
                .into_iter()
                .map(|job| {
                    scope.spawn(move || {
                        let d = Device::flex();
                        let shape = MeshShape::default()
                            .with(Dim::DpReplicate, replicas)
                            .with(Dim::DpShard, world / replicas);
                        let r = job.rank();
                        let mesh = DeviceMesh::new(Box::new(job), shape, &[Dims::DP]).unwrap();
                        let ranks = Ranks {
                            dp: mesh.world(),
                            shard: mesh.group(Dim::DpShard),
                            replica: mesh.group(Dim::DpReplicate),
                        };
                        let host = HostStaged {
                            bucket,
                            background: None,
                            device: d.clone(),
                        };
                        let dev = OnDevice::new(MpiWire { bucket }, bucket, &d);
                        let impls: [&dyn DeviceCollective; 2] = [&host, &dev];
                        let total: usize = LENGTHS.iter().sum();
                        let flat = Sharded::new(total, ranks.shard.size(), bucket);
                        impls.map(|c| {
                            let (loss, mean) =
                                c.mean(ranks, r as f32, tensors(r, &LENGTHS, &d)).unwrap();
                            let shard = c
                                .reduce_scatter_mean(ranks, &flat, tensors(r, &LENGTHS, &d))
                                .unwrap()
                                .wait()
                                .unwrap();
                            let mine = flat.range(ranks.shard.rank()).len();
                            let piece = shard.clone().slice(0..mine);
                            let whole = c
                                .all_gather(ranks, &flat, vec![piece], LENGTHS.to_vec(), true)
                                .unwrap()
                                .wait()
                                .unwrap();
                            let sq = c.square_sum(&whole);
                            vec![
                                bits(&mean),
                                bits(&[shard]),
                                bits(&whole),
                                vec![vec![loss.to_bits(), (sq as f32).to_bits()]],
                            ]
                        })
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        })
    }

    /// The device-side packing over MPI makes the host path's reductions: on thread ranks
    /// (sums in rank order whatever the buckets) the same bits, hybrid meshes included.
    #[test]
    fn device_buffers_over_mpi_give_the_host_paths_bits() {
        for (world, replicas, bucket) in
            [(1, 1, 8), (2, 1, 8), (3, 1, 1 << 20), (4, 2, 12), (6, 3, 4)]
        {
            for (r, [host, dev]) in both(world, replicas, bucket).into_iter().enumerate() {
                assert_eq!(host, dev, "{world} ranks, {replicas} replicas, rank {r}");
            }
        }
    }
}

//! How the ranks' flat tensors travel ([`Wire`]) and what a collective over them is given
//! ([`Ranks`], [`Over`]) and hands back ([`InFlight`]): below both wires, NCCL's
//! ([`super::nccl`]) and MPI's staged through host memory ([`MpiWire`]), and below
//! [`super::collective`], which packs tensors into the flat buffers they carry.

use crate::error::TrainError;
use crate::tensor::{from_vec, into_vec};
use burn::tensor::Tensor;
use kiln_dist::{BucketedAllReduce, Collective, Sharded};

/// The MPI communicators a data-parallel run's collectives go over: groups of the job's
/// [`crate::mesh::DeviceMesh`].
#[derive(Clone, Copy)]
pub struct Ranks<'a> {
    /// Every data-parallel rank (the replicated mean, the loss).
    pub dp: &'a dyn Collective,
    /// The ranks a sharded state is cut over (the job, or one replica of a hybrid run).
    pub shard: &'a dyn Collective,
    /// The ranks holding the same shard in the other replicas (one rank without hybrid
    /// sharding).
    pub replica: &'a dyn Collective,
}

impl<'a> Ranks<'a> {
    /// A replicated run over `dp`: the state is "cut" over every rank, one replica.
    pub fn replicated(dp: &'a dyn Collective) -> Self {
        Self {
            dp,
            shard: dp,
            replica: &kiln_dist::Solo,
        }
    }
}

/// A collective's result, ready once [`InFlight::wait`] returns.
#[must_use = "an in-flight collective must be waited for"]
pub struct InFlight<T>(Box<dyn FnOnce() -> Result<T, TrainError>>);

impl<T: 'static> InFlight<T> {
    /// A result that is already there.
    pub fn ready(value: T) -> Self {
        Self(Box::new(move || Ok(value)))
    }

    /// A result `finish` produces when waited for.
    pub fn later(finish: impl FnOnce() -> Result<T, TrainError> + 'static) -> Self {
        Self(Box::new(finish))
    }

    /// Waits for the result (over NCCL: makes CubeCL's stream wait for the collective's).
    pub fn wait(self) -> Result<T, TrainError> {
        (self.0)()
    }

    /// The result passed through `f` once it is there.
    pub fn map<U: 'static>(self, f: impl FnOnce(T) -> U + 'static) -> InFlight<U> {
        InFlight::later(move || self.wait().map(f))
    }
}

/// Which communicator of [`Ranks`] an all-reduce goes over.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Over {
    /// Every data-parallel rank.
    Dp,
    /// The ranks holding the same shard.
    Replica,
}

/// How [`OnDevice`]'s flat device buffers travel between the ranks: one call per flat
/// buffer, each returning a new buffer (the input is never written).
pub trait Wire {
    /// What carries them.
    fn describe(&self) -> String;
    /// The mean over `over`'s ranks of `buf`; `in_place`: `buf` is a buffer no other tensor
    /// shares, which the collective may write (no second buffer as large).
    fn all_reduce_mean(
        &self,
        ranks: Ranks,
        over: Over,
        buf: Tensor<1>,
        in_place: bool,
    ) -> Result<InFlight<Tensor<1>>, TrainError>;
    /// This rank's shard (`flat.shard` elements) of the mean over every rank of the job of
    /// `send` (`ranks.shard.size() x flat.shard` elements, zeros past `flat.len`):
    /// reduce-scattered over the shard's ranks, then averaged over the replicas.
    fn reduce_scatter_mean(
        &self,
        ranks: Ranks,
        flat: &Sharded,
        send: Tensor<1>,
    ) -> Result<InFlight<Tensor<1>>, TrainError>;
    /// Every shard's rank's `mine` (`flat.shard` elements), concatenated in rank order (at
    /// least `flat.len` elements; past them, padding).
    fn all_gather(
        &self,
        ranks: Ranks,
        flat: &Sharded,
        mine: Tensor<1>,
    ) -> Result<InFlight<Tensor<1>>, TrainError>;
    /// See [`DeviceCollective::device_busy_s`].
    fn busy_s(&self) -> f64 {
        0.0
    }
}

/// [`Wire`] over MPI, each flat buffer staged through host memory in kiln's fixed buckets
/// (`parallelism.collectives = "device"`: the device-side packing of [`OnDevice`] without a GPU).
pub struct MpiWire {
    /// Bytes of an all-reduce bucket.
    pub bucket: usize,
}

impl Wire for MpiWire {
    fn describe(&self) -> String {
        "device buffers over host-staged MPI".into()
    }

    fn all_reduce_mean(
        &self,
        ranks: Ranks,
        over: Over,
        buf: Tensor<1>,
        _in_place: bool,
    ) -> Result<InFlight<Tensor<1>>, TrainError> {
        let device = buf.device();
        let comm = match over {
            Over::Dp => ranks.dp,
            Over::Replica => ranks.replica,
        };
        let mut host = into_vec(buf);
        BucketedAllReduce::new(self.bucket).mean_in_place(comm, &mut [&mut host[..]]);
        Ok(InFlight::ready(from_vec(host, &device)))
    }

    fn reduce_scatter_mean(
        &self,
        ranks: Ranks,
        flat: &Sharded,
        send: Tensor<1>,
    ) -> Result<InFlight<Tensor<1>>, TrainError> {
        let device = send.device();
        let mut host = into_vec(send);
        let full = &mut [&mut host[..flat.len]];
        let mine = flat.reduce_scatter_mean_hybrid(ranks.shard, ranks.replica, full);
        Ok(InFlight::ready(from_vec(mine, &device)))
    }

    fn all_gather(
        &self,
        ranks: Ranks,
        flat: &Sharded,
        mine: Tensor<1>,
    ) -> Result<InFlight<Tensor<1>>, TrainError> {
        let device = mine.device();
        let whole = flat.all_gather(ranks.shard, &into_vec(mine));
        Ok(InFlight::ready(from_vec(whole, &device)))
    }
}

//! The device mesh: the ranks of a job as a grid with one axis per kind of parallelism, in
//! torchtitan's names and order, outermost first: `pp` (pipeline stages), `dp_replicate`
//! (replicas of a hybrid-sharded state), `dp_shard` (the ranks a sharded state is cut over),
//! `cp` (context: the sequence cut over ranks) and `tp` (tensor: the matrices cut over ranks).
//! Built once per job ([`DeviceMesh::new`]); each parallelism then takes the group of ranks
//! along its dims ([`DeviceMesh::group`]): one dim (`tp`) or several flattened into one
//! (`dp` = `dp_replicate` x `dp_shard`).
//!
//! Rank `r`'s coordinates are `r` written in the mixed radix of the dims' sizes, the last dim
//! fastest: the ranks of one `tp` group are consecutive (on one node, where its all-gathers are
//! cheapest), then those of one `dp_shard` group, and so on out. With `tp = cp = pp = 1` a
//! rank holds shard `r % dp_shard` of replica `r / dp_shard`, hybrid sharding's layout.
//!
//! Experts (`ep`) borrow ranks of the data-parallel dims rather than adding ranks of their
//! own (as in torchtitan), so they are a group of this grid, not a dim of it.

use crate::collective::{Collective, DistError};
use crate::solo::Solo;

/// One axis of the mesh (see the module documentation).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Dim {
    /// Pipeline stages.
    Pp,
    /// Replicas of a hybrid-sharded state.
    DpReplicate,
    /// The ranks a sharded state is cut over.
    DpShard,
    /// Context parallelism: the sequence cut over ranks.
    Cp,
    /// Tensor parallelism: the matrices cut over ranks.
    Tp,
}

impl Dim {
    /// Every dim, outermost first.
    pub const ALL: [Dim; 5] = [Dim::Pp, Dim::DpReplicate, Dim::DpShard, Dim::Cp, Dim::Tp];

    /// The name the config uses (`parallelism.<name>`).
    pub fn name(self) -> &'static str {
        match self {
            Dim::Pp => "pp",
            Dim::DpReplicate => "dp_replicate",
            Dim::DpShard => "dp_shard",
            Dim::Cp => "cp",
            Dim::Tp => "tp",
        }
    }

    fn index(self) -> usize {
        self as usize
    }
}

/// A set of dims, whose ranks form one group, flattened in mesh order.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Dims(u8);

impl Dims {
    /// No dim: every rank a group of its own.
    pub const NONE: Dims = Dims(0);
    /// The data-parallel ranks: `dp_replicate` x `dp_shard`, which train on different samples.
    pub const DP: Dims = Dims(1 << 1 | 1 << 2);
    /// The ranks whose pieces of a model make it whole when its state is sharded over the
    /// data-parallel ranks and its matrices over the tensor-parallel ones: `dp_shard` x `tp`.
    pub const PIECES: Dims = Dims(1 << 2 | 1 << 4);
    /// Every dim: the whole job.
    pub const ALL: Dims = Dims(0b1_1111);

    /// The set of one dim.
    pub const fn one(dim: Dim) -> Dims {
        Dims(1 << dim as u8)
    }

    /// This set with `dim` too.
    pub const fn and(self, dim: Dim) -> Dims {
        Dims(self.0 | 1 << dim as u8)
    }

    /// Whether `dim` is in the set.
    pub fn contains(self, dim: Dim) -> bool {
        self.0 & (1 << dim as u8) != 0
    }
}

impl From<Dim> for Dims {
    fn from(d: Dim) -> Self {
        Dims::one(d)
    }
}

/// The size of each dim of a mesh.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MeshShape([usize; 5]);

impl Default for MeshShape {
    /// One rank: every dim of size 1.
    fn default() -> Self {
        MeshShape([1; 5])
    }
}

impl MeshShape {
    /// This shape with `dim` of `size` ranks.
    pub fn with(mut self, dim: Dim, size: usize) -> Self {
        self.0[dim.index()] = size;
        self
    }

    /// The size of `dim`.
    pub fn size(&self, dim: Dim) -> usize {
        self.0[dim.index()]
    }

    /// Ranks in a group over `dims`.
    pub fn group_size(&self, dims: Dims) -> usize {
        Dim::ALL
            .iter()
            .filter(|d| dims.contains(**d))
            .map(|d| self.size(*d))
            .product()
    }

    /// Ranks of the whole mesh.
    pub fn ranks(&self) -> usize {
        self.0.iter().product()
    }

    /// The coordinates of job rank `rank` (see the module documentation).
    pub fn coords(&self, rank: usize) -> [usize; 5] {
        let mut c = [0; 5];
        let mut rest = rank;
        for d in Dim::ALL.iter().rev() {
            let n = self.size(*d).max(1);
            c[d.index()] = rest % n;
            rest /= n;
        }
        c
    }

    /// The job rank at `coords`.
    pub fn rank_at(&self, coords: [usize; 5]) -> usize {
        Dim::ALL
            .iter()
            .fold(0, |acc, d| acc * self.size(*d) + coords[d.index()])
    }

    /// `coords` read over `dims` only, as one number in their mixed radix (mesh order): the
    /// rank within the group over `dims`, or with the complement, which group it is.
    fn flat(&self, coords: [usize; 5], dims: Dims) -> usize {
        Dim::ALL
            .iter()
            .filter(|d| dims.contains(**d))
            .fold(0, |acc, d| acc * self.size(*d) + coords[d.index()])
    }

    /// The shape as `pp=1 x dp_replicate=2 x ...`, for messages.
    pub fn describe(&self) -> String {
        Dim::ALL
            .iter()
            .map(|d| format!("{}={}", d.name(), self.size(*d)))
            .collect::<Vec<_>>()
            .join(" x ")
    }
}

/// The ranks of a job as a mesh, with the groups its parallelisms use (see the module
/// documentation). It owns the job's communicator.
pub struct DeviceMesh {
    world: Box<dyn Collective>,
    shape: MeshShape,
    coords: [usize; 5],
    /// The groups built, over their dims; a group of one rank, or of every rank, is not
    /// built (see [`DeviceMesh::group`]).
    groups: Vec<(Dims, Box<dyn Collective>)>,
}

impl DeviceMesh {
    /// The mesh of `shape` over `world`'s ranks, with a group over each dim and over each of
    /// `flattened` (every rank calls it, with the same arguments: splitting is a
    /// collective). An error when the shape's ranks are not the job's.
    pub fn new(
        world: Box<dyn Collective>,
        shape: MeshShape,
        flattened: &[Dims],
    ) -> Result<Self, DistError> {
        let ranks = world.size();
        if shape.ranks() != ranks || shape.0.contains(&0) {
            return Err(DistError::Shape {
                mesh: shape.describe(),
                ranks,
            });
        }
        let coords = shape.coords(world.rank());
        let mut wanted: Vec<Dims> = Dim::ALL.iter().map(|d| Dims::one(*d)).collect();
        wanted.extend(flattened.iter().copied());
        let mut groups: Vec<(Dims, Box<dyn Collective>)> = Vec::new();
        for dims in wanted {
            let size = shape.group_size(dims);
            if size == 1 || size == ranks || groups.iter().any(|(d, _)| *d == dims) {
                continue;
            }
            let others = Dims(Dims::ALL.0 & !dims.0);
            let color = shape.flat(coords, others);
            let key = shape.flat(coords, dims);
            groups.push((dims, world.split(color, key)));
        }
        Ok(Self {
            world,
            shape,
            coords,
            groups,
        })
    }

    /// The mesh of `world` with every rank along `dim` (the others of size 1).
    pub fn along(world: Box<dyn Collective>, dim: Dim) -> Self {
        let shape = MeshShape::default().with(dim, world.size());
        let coords = shape.coords(world.rank());
        Self {
            world,
            shape,
            coords,
            groups: Vec::new(),
        }
    }

    /// Every rank of the job.
    pub fn world(&self) -> &dyn Collective {
        self.world.as_ref()
    }

    /// The sizes of the dims.
    pub fn shape(&self) -> &MeshShape {
        &self.shape
    }

    /// This rank's coordinate along `dim`.
    pub fn coord(&self, dim: Dim) -> usize {
        self.coords[dim.index()]
    }

    /// This rank's index in the group over `dims` (its rank there).
    pub fn index(&self, dims: Dims) -> usize {
        self.shape.flat(self.coords, dims)
    }

    /// The ranks that differ from this one along `dims` only, numbered in mesh order: the
    /// group over one dim or several flattened. A group of one rank is [`Solo`], one of every
    /// rank the job's own communicator ([`DeviceMesh::world`]: along dims whose complement
    /// has one rank, the group's order is the job's); any other must be one
    /// [`DeviceMesh::new`] built (a single dim, or one of its `flattened`).
    ///
    /// # Panics
    /// If the group was not built: every group a run uses is named when its mesh is built.
    pub fn group(&self, dims: impl Into<Dims>) -> &dyn Collective {
        let dims = dims.into();
        match self.shape.group_size(dims) {
            1 => return &Solo,
            n if n == self.world.size() => return self.world(),
            _ => {}
        }
        match self.groups.iter().find(|(d, _)| *d == dims) {
            Some((_, g)) => g.as_ref(),
            None => panic!("the mesh was built without a group over {dims:?}"),
        }
    }

    /// The job rank of the rank at this one's coordinates but those of `at` (dim and
    /// coordinate pairs).
    pub fn rank_with(&self, at: &[(Dim, usize)]) -> usize {
        let mut c = self.coords;
        for &(dim, i) in at {
            c[dim.index()] = i;
        }
        self.shape.rank_at(c)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::flat::Sharded;
    use crate::threads::Threads;

    #[test]
    fn coordinates_are_the_rank_in_mixed_radix_tp_fastest() {
        let shape = MeshShape::default()
            .with(Dim::Pp, 2)
            .with(Dim::DpShard, 3)
            .with(Dim::Tp, 2);
        assert_eq!(shape.ranks(), 12);
        for r in 0..12 {
            let c = shape.coords(r);
            assert_eq!(shape.rank_at(c), r);
            assert_eq!(c[Dim::Tp as usize], r % 2);
            assert_eq!(c[Dim::DpShard as usize], (r / 2) % 3);
            assert_eq!(c[Dim::Pp as usize], r / 6);
        }
        assert_eq!(shape.group_size(Dims::DP), 3);
        assert_eq!(shape.group_size(Dims::one(Dim::Tp).and(Dim::DpShard)), 6);
    }

    #[test]
    fn a_shape_that_is_not_the_job_is_refused() {
        let shape = MeshShape::default().with(Dim::Tp, 2);
        let err = DeviceMesh::new(Box::new(Solo), shape, &[])
            .err()
            .unwrap()
            .to_string();
        assert!(err.contains("tp=2") && err.contains("1 rank"), "{err}");
        let m = DeviceMesh::new(Box::new(Solo), MeshShape::default(), &[Dims::DP]).unwrap();
        assert_eq!(m.group(Dim::Tp).size(), 1);
        assert_eq!(m.group(Dims::DP).size(), 1);
    }

    /// Eight ranks as dp_replicate=2 x dp_shard=2 x tp=2: each group holds the ranks that
    /// differ along its dims only, numbered in mesh order, and its collectives stay inside.
    #[test]
    fn groups_are_the_ranks_along_their_dims() {
        let shape = MeshShape::default()
            .with(Dim::DpReplicate, 2)
            .with(Dim::DpShard, 2)
            .with(Dim::Tp, 2);
        let got = Threads::each(8, |world| {
            let m = DeviceMesh::new(Box::new(world.clone()), shape, &[Dims::DP]).unwrap();
            let members = |dims: Dims| {
                let g = m.group(dims);
                (g.rank(), g.all_gather_u64(world.rank() as u64))
            };
            (
                members(Dims::one(Dim::Tp)),
                members(Dims::one(Dim::DpShard)),
                members(Dims::one(Dim::DpReplicate)),
                members(Dims::DP),
            )
        });
        for (r, (tp, shard, replica, dp)) in got.into_iter().enumerate() {
            let base_tp = r - r % 2;
            assert_eq!(
                tp,
                (r % 2, vec![base_tp as u64, base_tp as u64 + 1]),
                "rank {r}"
            );
            let t = r % 2;
            let rep = r / 4;
            assert_eq!(
                shard,
                (
                    (r / 2) % 2,
                    vec![(rep * 4 + t) as u64, (rep * 4 + 2 + t) as u64]
                )
            );
            let s = (r / 2) % 2;
            assert_eq!(
                replica,
                (rep, vec![(s * 2 + t) as u64, (4 + s * 2 + t) as u64])
            );
            assert_eq!(dp.0, rep * 2 + s);
            assert_eq!(
                dp.1,
                vec![t as u64, 2 + t as u64, 4 + t as u64, 6 + t as u64]
            );
        }
    }

    /// Six ranks as 2 replicas of 3 shards (hybrid sharding): a reduce-scatter over the
    /// shard then an all-reduce over the replica gives each rank its shard of the mean over
    /// all six; the groups are those hybrid sharding always used.
    #[test]
    fn two_replicas_of_three_shards_average_over_all_ranks() {
        let len = 10;
        let shape = MeshShape::default()
            .with(Dim::DpReplicate, 2)
            .with(Dim::DpShard, 3);
        let got = Threads::each(6, |world| {
            let mesh = DeviceMesh::new(Box::new(world.clone()), shape, &[Dims::DP]).unwrap();
            let r = world.rank();
            let (shard, replica) = (mesh.group(Dim::DpShard), mesh.group(Dim::DpReplicate));
            let flat = Sharded::new(len, 3, 8);
            let full: Vec<f32> = (0..len).map(|i| (i * 6 + r) as f32).collect();
            let mine = flat.reduce_scatter_mean_hybrid(shard, replica, &mut [full]);
            let mut whole = vec![0.0; len];
            flat.all_gather_into(shard, &mine, &mut [&mut whole[..]]);
            (shard.rank(), replica.rank(), replica.size(), mine, whole)
        });
        // The mean over ranks 0..6 of i * 6 + r is i * 6 + 2.5.
        let want: Vec<f32> = (0..len).map(|i| (i * 6) as f32 + 2.5).collect();
        for (r, (shard, replica, replicas, mine, whole)) in got.into_iter().enumerate() {
            assert_eq!((shard, replica, replicas), (r % 3, r / 3, 2), "rank {r}");
            let range = Sharded::new(len, 3, 8).range(shard);
            assert_eq!(&mine[..range.len()], &want[range], "rank {r}");
            assert_eq!(whole, want, "rank {r}");
        }
    }
}

//! Hybrid sharded data parallelism (torchtitan's `dp_replicate` x `dp_shard`, HSDP): the
//! ranks of a job as `replicas` groups of `shards` consecutive ranks. A state is sharded over
//! the ranks of one group (consecutive ranks: on one node when a group fits one, where the
//! all-gathers are cheapest) and replicated over the groups, whose ranks of the same shard
//! average their gradients with an all-reduce. Rank `r` holds shard `r % shards` of replica
//! `r / shards`.

use crate::{Collective, DistError, Sharded};

/// The two groups a rank belongs to in a hybrid-sharded job (see the module documentation).
pub struct Mesh {
    /// The ranks of this rank's replica, numbered by shard.
    shard: Box<dyn Collective>,
    /// The ranks holding the same shard as this rank, one per replica, numbered by replica.
    replica: Box<dyn Collective>,
}

impl Mesh {
    /// The mesh of `replicas` replicas over `world`'s ranks (every rank calls it); an error
    /// when `replicas` does not divide the ranks.
    pub fn new(world: &dyn Collective, replicas: usize) -> Result<Self, DistError> {
        let (rank, ranks) = (world.rank(), world.size());
        if replicas == 0 || !ranks.is_multiple_of(replicas) {
            return Err(DistError::Replicas { replicas, ranks });
        }
        let shards = ranks / replicas;
        Ok(Self {
            shard: world.split(rank / shards, rank),
            replica: world.split(rank % shards, rank),
        })
    }

    /// The ranks this rank shards the state with (its replica).
    pub fn shard(&self) -> &dyn Collective {
        self.shard.as_ref()
    }

    /// The ranks that hold the same shard as this rank (one per replica).
    pub fn replica(&self) -> &dyn Collective {
        self.replica.as_ref()
    }

    /// The job rank of shard `shard` of replica `replica`.
    pub fn job_rank(&self, replica: usize, shard: usize) -> usize {
        replica * self.shard.size() + shard
    }

    /// This rank's shard of the mean over every rank of the job of the concatenation of
    /// `full` (only read), over this mesh ([`Sharded::reduce_scatter_mean_hybrid`]).
    pub fn reduce_scatter_mean<P: AsMut<[f32]>>(&self, flat: &Sharded, full: &mut [P]) -> Vec<f32> {
        flat.reduce_scatter_mean_hybrid(self.shard(), self.replica(), full)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{Solo, Threads};

    #[test]
    fn the_replicas_must_divide_the_ranks() {
        let err = Mesh::new(&Solo, 2).err().unwrap().to_string();
        assert!(err.contains("parallelism.dp_replicate = 2"), "{err}");
        assert!(Mesh::new(&Solo, 0).is_err());
        let m = Mesh::new(&Solo, 1).unwrap();
        assert_eq!((m.shard().size(), m.replica().size()), (1, 1));
    }

    /// Six ranks as 2 replicas of 3 shards: the groups are the consecutive ranks and the
    /// ranks of one shard, and a reduce-scatter then all-reduce gives each rank its shard of
    /// the mean over all six.
    #[test]
    fn two_replicas_of_three_shards_average_over_all_ranks() {
        let len = 10;
        let got: Vec<_> = std::thread::scope(|scope| {
            let handles: Vec<_> = Threads::job(6)
                .into_iter()
                .map(|world| {
                    scope.spawn(move || {
                        let mesh = Mesh::new(&world, 2).unwrap();
                        let r = world.rank();
                        assert_eq!(mesh.job_rank(r / 3, r % 3), r);
                        let flat = Sharded::new(len, 3, 8);
                        let full: Vec<f32> = (0..len).map(|i| (i * 6 + r) as f32).collect();
                        let mine = mesh.reduce_scatter_mean(&flat, &mut [full]);
                        let mut whole = vec![0.0; len];
                        flat.all_gather_into(mesh.shard(), &mine, &mut [&mut whole[..]]);
                        let (s, p) = (mesh.shard(), mesh.replica());
                        (s.rank(), p.rank(), p.size(), mine, whole)
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
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

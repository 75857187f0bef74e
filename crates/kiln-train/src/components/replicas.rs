//! The replica check: data-parallel ranks hold the same parameters (with parameters sharded,
//! the ranks holding the same shard in each replica hold the same pieces), so a checksum of
//! each rank's parameters, compared at `guards.replica_check_interval` and before every save,
//! names a silently corrupted or desynced rank before its weights are written.

use crate::cadence::Every;
use crate::mesh::{DeviceMesh, Dim, Dims};
use crate::tensor::params_checksum;
use burn::tensor::Tensor;

/// Ranks whose parameters differ from the majority's.
#[derive(Debug, Clone, PartialEq)]
pub struct Mismatch {
    /// The ranks that differ.
    pub ranks: Vec<usize>,
    /// Every rank's checksum, hex.
    pub checksums: Vec<String>,
}

/// The replica-check component: its cadence and the comparison.
pub struct ReplicaCheck {
    every: Every,
}

impl ReplicaCheck {
    /// Checks every `every` steps (0: only before saves).
    pub fn new(every: u64) -> Self {
        Self {
            every: Every(every),
        }
    }

    /// Whether the periodic check is due after `step`.
    pub fn due(&self, step: u64) -> bool {
        self.every.due(step)
    }

    /// Compares the checksums of the ranks that hold the same values (a collective: every
    /// rank of `mesh` calls it at the same step): those that differ from this one along the
    /// dims `same` only (the data-parallel dims, or with the parameters sharded the replicas
    /// of each shard). Every rank gets every checksum, so all come to the same verdict.
    pub fn compare(mesh: &DeviceMesh, same: Dims, params: &[Tensor<1>]) -> Option<Mismatch> {
        let shape = mesh.shape();
        if shape.group_size(same) == 1 {
            return None; // no two ranks hold the same values
        }
        let sums = mesh.world().all_gather_u64(params_checksum(params));
        // Ranks in one class hold the same values: their coordinates agree off `same`.
        let class = |r: usize| {
            let mut c = shape.coords(r);
            for d in Dim::ALL.into_iter().filter(|d| same.contains(*d)) {
                c[d as usize] = 0;
            }
            c
        };
        let mut classes: Vec<([usize; 5], Vec<usize>)> = Vec::new();
        for r in 0..sums.len() {
            match classes.iter_mut().find(|(c, _)| *c == class(r)) {
                Some((_, holders)) => holders.push(r),
                None => classes.push((class(r), vec![r])),
            }
        }
        let mut ranks: Vec<usize> = classes
            .iter()
            .flat_map(|(_, holders)| {
                let values: Vec<u64> = holders.iter().map(|&r| sums[r]).collect();
                minority_ranks(&values).into_iter().map(|i| holders[i])
            })
            .collect();
        ranks.sort_unstable();
        (!ranks.is_empty()).then(|| Mismatch {
            ranks,
            checksums: sums.iter().map(|s| format!("{s:016x}")).collect(),
        })
    }
}

/// Ranks whose value differs from the most common one (ties broken towards the value of
/// the lowest rank); empty when all agree.
pub fn minority_ranks(values: &[u64]) -> Vec<usize> {
    let majority = values
        .iter()
        .max_by_key(|v| {
            let count = values.iter().filter(|w| w == v).count();
            let first = values.iter().position(|w| w == *v).unwrap_or(0);
            (count, std::cmp::Reverse(first))
        })
        .copied();
    (0..values.len())
        .filter(|&r| Some(values[r]) != majority)
        .collect()
}

#[cfg(test)]
mod tests {
    use super::{ReplicaCheck, minority_ranks};
    use burn::tensor::{Device, Tensor};
    use kiln_dist::Collective;

    /// Four ranks as two replicas of two shards: rank `r` holds piece `r % 2`, and rank 3's
    /// differs from rank 1's. Compared as replicas, rank 3 is named; compared as one
    /// replica of four shards, nothing is compared.
    #[test]
    fn replicas_of_each_shard_are_compared_with_each_other() {
        use crate::mesh::{DeviceMesh, Dim, Dims, MeshShape};
        let verdicts: Vec<_> = std::thread::scope(|scope| {
            let handles: Vec<_> = kiln_dist::Threads::job(4)
                .into_iter()
                .map(|comm| {
                    scope.spawn(move || {
                        let r = comm.rank();
                        let bad = if r == 3 { 0.5 } else { 0.0 };
                        let v = [(r % 2) as f32 + bad, 1.0];
                        let piece = Tensor::<1>::from_floats(v, &Device::flex());
                        let hybrid = MeshShape::default()
                            .with(Dim::DpReplicate, 2)
                            .with(Dim::DpShard, 2);
                        let mesh = DeviceMesh::new(Box::new(comm.clone()), hybrid, &[Dims::DP]);
                        let mesh = mesh.unwrap();
                        let same = Dims::one(Dim::DpReplicate);
                        let hybrid =
                            ReplicaCheck::compare(&mesh, same, std::slice::from_ref(&piece));
                        let sharded = MeshShape::default().with(Dim::DpShard, 4);
                        let mesh = DeviceMesh::new(Box::new(comm), sharded, &[Dims::DP]).unwrap();
                        (hybrid, ReplicaCheck::compare(&mesh, same, &[piece]))
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        for (hybrid, unreplicated) in verdicts {
            assert_eq!(hybrid.map(|m| m.ranks), Some(vec![3]));
            assert!(unreplicated.is_none());
        }
    }

    #[test]
    fn the_minority_is_named() {
        assert!(minority_ranks(&[5, 5, 5]).is_empty());
        assert_eq!(minority_ranks(&[5, 9, 5]), vec![1]);
        assert_eq!(minority_ranks(&[9, 5, 5]), vec![0]);
        // A tie: the value of the lowest rank is taken as the reference.
        assert_eq!(minority_ranks(&[5, 9]), vec![1]);
    }
}

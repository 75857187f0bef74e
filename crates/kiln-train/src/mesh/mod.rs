//! The device mesh of a run ([`kiln_dist::DeviceMesh`]), built once at start from the
//! `parallelism` section ([`settings`]): the ranks of the job laid out along torchtitan's
//! dims, and the groups each parallelism takes of it. The trainer, lr-find, and through the
//! trainer the smoke gate, all start here ([`start`]); nothing else reads `WORLD_SIZE` or
//! cuts the ranks into groups.
//!
//! The data-parallel ranks (`dp_replicate` x `dp_shard`) train on different samples and
//! average their gradients; without sharding every one of them is a replica
//! (`dp_replicate` = all of them, `dp_shard` = 1), with it `parallelism.dp_replicate` of them
//! are (1 unless hybrid), and the state is cut over the `dp_shard` ranks of each.

pub mod autograd;
pub mod placement;
pub mod settings;

pub use kiln_dist::{DeviceMesh, Dim, Dims, MeshShape};

use kiln_dist::{Collective, DistError};
use settings::{ParallelismConfig, Shard};

/// Why a run's mesh could not be built.
#[derive(Debug, thiserror::Error)]
pub enum MeshError {
    /// The config's layout does not fit the job's ranks (names the keys and what would).
    #[error("{0}")]
    Layout(String),
    /// The collectives could not be set up.
    #[error(transparent)]
    Dist(#[from] DistError),
    /// The launcher's rank variables are missing or contradict each other.
    #[error("rank environment: {0}")]
    RankEnv(String),
}

/// The groups a run uses besides each single dim's: the data-parallel ranks together, and
/// the ranks whose pieces of the parameters make them whole (the `dp_shard` ranks of a
/// parameter-sharded run by the `tp` ranks).
const FLATTENED: &[Dims] = &[Dims::DP, Dims::PIECES];

/// The mesh shape of `p` over `ranks` ranks; an error naming the key that does not divide
/// them, and what would.
pub fn shape(p: &ParallelismConfig, ranks: usize) -> Result<MeshShape, String> {
    let tp = p.tp.max(1);
    if !ranks.is_multiple_of(tp) {
        return Err(format!(
            "parallelism.tp = {tp} does not divide the {ranks} ranks of this job; use a divisor of {ranks}, or {} ranks",
            ranks.div_ceil(tp) * tp
        ));
    }
    let dp = ranks / tp;
    let replicas = match p.shard {
        Shard::None => dp,
        _ => p.dp_replicate,
    };
    if replicas == 0 || !dp.is_multiple_of(replicas) {
        return Err(format!(
            "parallelism.dp_replicate = {replicas} does not divide the {dp} ranks of this job into equal replicas; use a divisor of {dp}"
        ));
    }
    Ok(MeshShape::default()
        .with(Dim::DpReplicate, replicas)
        .with(Dim::DpShard, dp / replicas)
        .with(Dim::Tp, tp))
}

/// The mesh of `p` over `world`'s ranks (every rank calls it: its groups are split from
/// `world`).
pub fn build(world: Box<dyn Collective>, p: &ParallelismConfig) -> Result<DeviceMesh, MeshError> {
    let shape = shape(p, world.size()).map_err(MeshError::Layout)?;
    Ok(DeviceMesh::new(world, shape, FLATTENED)?)
}

/// The mesh of this process's job: one rank, or the ranks an MPI launcher started (read from
/// the launcher's variables, checked against MPI's own view). Every rank calls it.
pub fn start(p: &ParallelismConfig) -> Result<DeviceMesh, MeshError> {
    let env = kiln_topology::RankEnv::from_process_env()
        .map_err(|e| MeshError::RankEnv(e.to_string()))?;
    build(kiln_dist::init(&env, p.prefetches())?, p)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn data_parallel_ranks_are_replicas_unless_sharded() {
        let mut p = ParallelismConfig::default();
        let s = shape(&p, 4).unwrap();
        assert_eq!((s.size(Dim::DpReplicate), s.size(Dim::DpShard)), (4, 1));
        p.shard = Shard::Parameters;
        let s = shape(&p, 4).unwrap();
        assert_eq!((s.size(Dim::DpReplicate), s.size(Dim::DpShard)), (1, 4));
        p.dp_replicate = 2;
        let s = shape(&p, 6).unwrap();
        assert_eq!((s.size(Dim::DpReplicate), s.size(Dim::DpShard)), (2, 3));
        let err = shape(&p, 3).unwrap_err();
        assert!(
            err.contains("parallelism.dp_replicate = 2 does not divide the 3 ranks"),
            "{err}"
        );
    }
}

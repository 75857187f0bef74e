//! The machinery of sharded data parallelism that the step's gradient exchanges
//! ([`crate::step::exchange`]) use: which piece of the state each rank keeps and the
//! collectives over those pieces ([`shard`]), the forward and backward pass stage by stage
//! with each stage's weights gathered when used ([`stagewise`]), and the gradient average on
//! CUDA devices over NCCL ([`nccl`]) and on ROCm devices over RCCL ([`rccl`]).

pub mod collective;
pub mod nccl;
pub mod rccl;
pub mod shard;
pub mod stagewise;

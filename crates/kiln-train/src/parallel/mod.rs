//! What drives or wraps the model over the mesh's ranks, one module a dimension: tensor
//! parallelism ([`tensor`]: the model's matrices cut over the `tp` ranks) and the machinery
//! of sharded data parallelism that the step's gradient exchanges ([`crate::step::exchange`])
//! use: which piece of the state each rank keeps and the collectives over those pieces,
//! among them each stage's weights gathered when the model's stage-by-stage pass
//! ([`crate::model::stagewise`]) runs it ([`shard`]), the whole matrices an optimizer needs
//! from them ([`whole`]: Muon's, one owner rank per matrix), the one seam through which
//! the ranks' tensors meet ([`collective`]: host-staged MPI, or flat device buffers), and
//! below it how flat buffers travel ([`wire`]: MPI, or NCCL on CUDA devices, [`nccl`], and
//! RCCL on ROCm devices, [`rccl`]).

pub mod collective;
pub mod nccl;
pub mod rccl;
pub mod shard;
#[cfg(test)]
mod stagewise_tests;
pub mod tensor;
pub mod whole;
pub mod wire;

//! What the CPU kernels (each op's `cpu.rs`, on burn's flex backend) share: flex tensors as
//! f32 slices and back and the row block that fixes how work is cut ([`tensors`]), branch-free
//! scalar math ([`math`]) and matrix products without flex's zero-fill and copy ([`matmul`]).
//!
//! Determinism: work is cut into fixed-size blocks of rows whatever the thread count, and
//! partial sums are combined in block order, so results are bit-identical for any number of
//! threads. Reductions accumulate in 16 explicit lanes and the kernels use no fused
//! multiply-add, so the AVX-512, AVX2 and SSE builds of a kernel (chosen at run time by
//! `multiversion`) give the same bits too.

pub(in crate::kernels) mod math;
pub(in crate::kernels) mod matmul;
pub(in crate::kernels) mod tensors;

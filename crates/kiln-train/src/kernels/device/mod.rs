//! What the CubeCL kernels (each op's `cube.rs`, on burn's `Cube` backend) share: new device
//! tensors and launch shapes ([`tensors`]), a cube's fixed-order sum and max ([`reduce`]), and
//! the device's matrix products ([`matmul`]: fixed where the bits must not depend on timing,
//! cuBLAS's on CUDA).
//!
//! The kernels are written once in CubeCL, so the same source runs on every CubeCL runtime:
//! CUDA, ROCm, Vulkan/wgpu, Metal, and CubeCL's CPU runtime (the CI driver). Numerics: every
//! kernel reads its element type and accumulates in f32, then writes its element type, so
//! bf16 inputs keep f32 sums. Work is one unit per output row or element, or a cube per row,
//! and every sum runs in a fixed order with no atomics, so results are deterministic on a
//! device.

#[cfg(feature = "cuda")]
mod cublas;
pub(in crate::kernels) mod matmul;
#[cfg(any(feature = "cuda", feature = "rocm"))]
pub(in crate::kernels) mod offline;
pub(in crate::kernels) mod reduce;
pub(in crate::kernels) mod tensors;

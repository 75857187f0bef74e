//! kiln's fused kernels: the model's hot spots as single ops with their own backward passes,
//! on the CPU (burn's flex backend) and, written once in CubeCL, on every CubeCL device (CUDA,
//! ROCm, Vulkan/wgpu, Metal, and CubeCL's CPU runtime, CI's driver for the GPU code path).
//!
//! burn's autodiff records every primitive op of a composed function (RMSNorm is seven,
//! log-softmax six, SiLU three), each a pass over memory that allocates its output, and the
//! backward pass doubles that. Each kernel here does one such function in one or two passes
//! and registers one backward step with burn's autodiff through a backend extension, so a
//! model mixes them freely with burn's ops.
//!
//! One folder per op: its chooser (the one function the model calls, as
//! `kernels::rms_norm::rms_norm`, which picks the CubeCL kernel, the CPU kernel or the composed
//! twin), the composed twin (burn's ops: the reference the kernels are checked against, and
//! the path where no kernel covers a tensor), the self-check case, and the kernels side by
//! side (`cpu.rs`, `cube.rs`): `linear/`, `rms_norm/`, `swiglu/`, `rope/`, `attention/`,
//! `softmax/`, `cross_entropy/`, `adamw/`, and `fixed_order/` (fixed-order arithmetic on
//! replicated state). Below them what they share: `settings` (how the kernels run in this
//! process, from the config), `coverage` (which tensors each family takes), `host/` (the CPU
//! kernels' helpers), `device/` (the CubeCL kernels' helpers and matrix products), `blas` (how
//! a product is asked of cuBLAS) and `check` (the self-check harness); above them
//! [`selfcheck`], every case for tests and `kiln doctor`.
//!
//! Upstream: each CPU kernel says what burn would need for it to go away. In short: burn's
//! autodiff should use the backend's fused forward ops (flex already has a fused softmax and
//! layer norm forward) and give them fused backward ops, and flex's element-wise ops should be
//! multithreaded.

pub mod adamw;
pub mod attention;
#[cfg(any(test, feature = "cuda"))]
mod blas;
mod check;
pub mod coverage;
pub mod cross_entropy;
#[cfg(feature = "cube")]
mod device;
pub mod fixed_order;
mod host;
pub mod linear;
#[cfg(any(feature = "cuda", feature = "rocm"))]
pub mod offline;
pub mod rms_norm;
pub mod rope;
pub mod selfcheck;
pub mod settings;
pub mod softmax;
pub mod swiglu;
#[cfg(test)]
mod tests;

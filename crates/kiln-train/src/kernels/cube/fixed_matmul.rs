//! A matrix product whose kernel is chosen without timing, for arithmetic on replicated state.
//!
//! burn's matmul on CubeCL devices is autotuned: each process times the candidate kernels and
//! keeps the fastest, and candidates split the inner sum differently. Two data-parallel ranks
//! orthogonalising the same all-reduced momentum (Muon's Newton-Schulz) could therefore take
//! different kernels and come out an ulp apart, and they did: a two-rank Muon run on
//! `cubecl-cpu` stopped on a replica mismatch after step 1. Here the kernel is CubeCL's
//! default strategy, picked from the device's properties alone, so every rank with the same
//! GPU runs the same one.

use super::dense;
use burn::backend::Cube;
use burn_cubecl::kernel::matmul::{MatmulStrategy, matmul};

/// A burn tensor (cubecl's prelude names its own `Tensor`).
type Host2 = burn::tensor::Tensor<2>;

/// `a @ b` by CubeCL's default strategy when both are on a CubeCL device; `None` otherwise,
/// or when that strategy cannot run the shapes (reported once).
pub(in crate::kernels) fn matmul_fixed(a: &Host2, b: &Host2) -> Option<Host2> {
    let pa = dense(a.clone().try_into_primitive::<Cube>().ok()?);
    let pb = dense(b.clone().try_into_primitive::<Cube>().ok()?);
    let dtype = pa.dtype;
    match matmul(pa, pb, None, MatmulStrategy::Cube, dtype) {
        Ok(out) => Some(Host2::from_primitive::<Cube>(out)),
        Err(e) => {
            static ONCE: std::sync::Once = std::sync::Once::new();
            ONCE.call_once(|| {
                tracing::warn!(
                    error = %e,
                    "CubeCL's default matmul cannot run these shapes; the autotuned one takes over, so data-parallel replicas may drift apart (the replica check names it)"
                )
            });
            None
        }
    }
}

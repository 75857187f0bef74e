//! Helpers shared by the CubeCL CPU-runtime tests (cubecl_cpu.rs, cube_kernels.rs).

use burn::tensor::Tensor;

/// `n` fixed values in [-1, 1) from `seed` (a small LCG: they only need to be fixed and
/// spread out).
pub fn random(n: usize, seed: u64) -> Vec<f32> {
    let mut s = seed.wrapping_mul(6364136223846793005).wrapping_add(1);
    (0..n)
        .map(|_| {
            s = s
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((s >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
        })
        .collect()
}

/// A tensor's values on the host, as f32.
pub fn host<const D: usize>(t: &Tensor<D>) -> Vec<f32> {
    t.clone()
        .into_data()
        .convert::<f32>()
        .try_to_vec::<f32>()
        .unwrap()
}

/// Largest |a - b| relative to the largest |b|.
pub fn rel_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    let scale = b.iter().fold(0.0f32, |m, v| m.max(v.abs())).max(1e-30);
    a.iter()
        .zip(b)
        .fold(0.0f32, |m, (x, y)| m.max((x - y).abs()))
        / scale
}

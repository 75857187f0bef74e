//! The `[kernels]` section: which kernels and paths the device runs.

use super::domains::Domains;
use serde::{Deserialize, Serialize};

/// How kiln's fused kernels run on CubeCL devices (GPUs); `training.fused_kernels` turns them
/// all off. None of these keys changes what is computed, only how: each path is checked
/// against the same composed twin (`kiln doctor --device`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, Default)]
#[serde(deny_unknown_fields, default)]
pub struct KernelsConfig {
    /// Causal attention's path on CubeCL devices: `auto` (by matrix products on GPUs, the row
    /// kernels on CubeCL's CPU runtime), `products` (chunks of query positions by the device's
    /// matrix products: tensor cores), `flash` (tiled flash kernels on tensor-core fragments;
    /// where they cannot run, bf16 or f16 on a GPU with 32-unit planes, `auto`'s path), or
    /// `rows` (one unit per query row, a scalar at a time). Flex takes its CPU kernel always.
    pub attention: AttentionPath,
    /// The flash kernels' tilings, `RxCxP,RxCxP,RxCxP` for the forward, `dq` and `dk`/`dv`
    /// kernels: R rows of a cube's own side against tiles of C rows of the other, P planes a
    /// cube; sides multiples of 16 up to 256, 1 to 16 planes. "" = 64x64x4,64x32x4,32x32x4.
    pub flash_tiling: String,
    /// Matrix products on CUDA devices: `cublas` (NVIDIA's GEMMs, as PyTorch takes them) or
    /// `cubecl` (burn's autotuned CubeCL matmul, for comparison). Without libcublas, `cubecl`.
    pub cuda_gemm: CudaGemm,
    /// How CubeCL compiles kernels for CUDA devices: `llvm` (LLVM's NVPTX backend) or `nvrtc`
    /// (CUDA C++ through NVRTC, which needs libnvrtc.so; the backend that advertises TMA to
    /// burn's matmul). One per process: the first run's choice stands.
    pub cuda_compiler: CudaCompiler,
    /// A file each cuBLAS product's time is appended to (`| 12.3us | name`, the format of
    /// CubeCL's profiling logger), each product waited on: for profiling; "" = off.
    pub cublas_profile: String,
}

/// Causal attention's path on CubeCL devices (`kernels.attention`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum AttentionPath {
    /// By products on GPUs, the row kernels on CubeCL's CPU runtime.
    #[default]
    Auto,
    /// Chunks of query positions by the device's matrix products.
    Products,
    /// The tiled flash kernels, where they can run (else `Auto`'s path).
    Flash,
    /// The row kernels: one unit per query row.
    Rows,
}

/// Who multiplies matrices on CUDA devices (`kernels.cuda_gemm`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum CudaGemm {
    /// cuBLAS, where its library loads.
    #[default]
    Cublas,
    /// burn's autotuned CubeCL matmul.
    Cubecl,
}

/// The compiler CubeCL's CUDA runtime builds kernels with (`kernels.cuda_compiler`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum CudaCompiler {
    /// LLVM's NVPTX backend.
    #[default]
    Llvm,
    /// CUDA C++ through NVRTC.
    Nvrtc,
}

/// A tiling of the flash kernels: `(rows, cols, planes)` for the forward, `dq` and `dk`/`dv`
/// kernels (see `kernels.flash_tiling`).
pub type FlashTiling = [(usize, usize, usize); 3];

impl KernelsConfig {
    /// `kernels.flash_tiling` parsed; `None` for "" (the default tiling).
    pub fn flash_tiling(&self) -> Result<Option<FlashTiling>, String> {
        if self.flash_tiling.trim().is_empty() {
            return Ok(None);
        }
        parse_flash_tiling(&self.flash_tiling).map(Some)
    }

    /// The kernels keys' domains.
    pub(super) fn domains(&self, d: &mut Domains) {
        if let Err(why) = self.flash_tiling() {
            d.check(
                "kernels.flash_tiling",
                format!("{:?}", self.flash_tiling),
                false,
                format!("\"\" or RxCxP,RxCxP,RxCxP ({why})"),
            );
        }
    }
}

/// `RxCxP,RxCxP,RxCxP` as three `(rows, cols, planes)`.
fn parse_flash_tiling(text: &str) -> Result<FlashTiling, String> {
    let shapes = text
        .split(',')
        .map(|part| {
            let n: Vec<usize> = part
                .trim()
                .split('x')
                .map(|v| {
                    v.trim()
                        .parse::<usize>()
                        .map_err(|e| format!("{part:?}: {e}"))
                })
                .collect::<Result<_, _>>()?;
            let [rows, cols, planes] = n[..] else {
                return Err(format!("{part:?} is not ROWSxCOLSxPLANES"));
            };
            let size = |v: usize| v > 0 && v <= 256 && v.is_multiple_of(16);
            if !size(rows) || !size(cols) || !(1..=16).contains(&planes) {
                return Err(format!(
                    "{part:?}: sizes are multiples of 16 up to 256, planes 1 to 16"
                ));
            }
            Ok((rows, cols, planes))
        })
        .collect::<Result<Vec<_>, _>>()?;
    shapes
        .try_into()
        .map_err(|v: Vec<_>| format!("three tilings (forward, dq, dk/dv), not {}", v.len()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Config;

    #[test]
    fn flash_tilings_parse_and_bad_ones_are_refused() {
        assert_eq!(
            parse_flash_tiling("64x64x4, 64x32x4,32x32x2"),
            Ok([(64, 64, 4), (64, 32, 4), (32, 32, 2)])
        );
        for bad in [
            "64x64x4",
            "64x64x4,64x32x4",
            "64x64x4,64x32x4,32x32x4,16x16x1",
            "64x64,64x32x4,32x32x4",
            "60x64x4,64x32x4,32x32x4",
            "64x64x0,64x32x4,32x32x4",
            "512x64x4,64x32x4,32x32x4",
            "64x64xa,64x32x4,32x32x4",
        ] {
            assert!(parse_flash_tiling(bad).is_err(), "{bad:?}");
            let mut c = Config::default();
            c.kernels.flash_tiling = bad.into();
            let e = c.validate().unwrap_err().to_string();
            assert!(e.contains("kernels.flash_tiling"), "{e}");
        }
        let mut c = Config::default();
        c.kernels.flash_tiling = " ".into();
        assert_eq!(c.kernels.flash_tiling(), Ok(None));
    }
}

//! Every fused kernel against its composed twin on a device, values and every gradient: the
//! CI tests run these on CubeCL's CPU runtime in f32 and bf16, and `kiln doctor --device DEV`
//! runs them on a user's GPU (f32, and bf16 where the device has it) before a month-long run
//! trusts the kernels there. Each op's folder holds its cases; [`super::check`] compares.
//!
//! Shapes fill no tile: counts that are not multiples of the 128 units a cube runs, grouped-
//! query ratios 1, 2 and 3, sequences of 1, 7 and 13, the vocabulary in one chunk and in three.

#[cfg(feature = "rocm")]
pub use super::attention::cube::flash::ptx::amdgpu as flash_amdgpu;
#[cfg(feature = "cube")]
pub use super::attention::cube::flash::ptx::check_slots as flash_fragment_slots;
#[cfg(feature = "cuda")]
pub use super::attention::cube::flash::ptx::ptx as flash_ptx;
pub use super::attention::{
    check as causal_attention, check_flash as causal_attention_flash,
    check_in_chunks as causal_attention_in_chunks, check_rising as causal_attention_rising,
    check_wide as causal_attention_wide,
};
pub use super::check::{Check, host, random, rel_diff, tolerance};
pub use super::cross_entropy::check as linear_cross_entropy;
pub use super::linear::{check as linear, check_mixed as mixed_linear};
pub use super::rms_norm::check as rms_norm;
pub use super::rope::check as rope;
pub use super::swiglu::check as swiglu;

use super::coverage::has_bf16_kernels;
use burn::tensor::{Device, FloatDType};

/// Every kernel's checks on `device` in `dtype`.
pub fn run(device: &Device, dtype: FloatDType) -> Vec<Check> {
    [
        linear,
        mixed_linear,
        rms_norm,
        swiglu,
        rope,
        causal_attention,
        causal_attention_rising,
        causal_attention_in_chunks,
        causal_attention_flash,
        linear_cross_entropy,
    ]
    .iter()
    .flat_map(|check| check(device, dtype))
    .collect()
}

/// [`run`] in f32 and in bf16, each named, or why a type is skipped: bf16 only where kiln has
/// bf16 kernels ([`has_bf16_kernels`]: CubeCL devices with the type), since elsewhere bf16
/// takes the composed ops and there would be nothing to compare.
pub fn run_each_type(device: &Device) -> Vec<(&'static str, Result<Vec<Check>, &'static str>)> {
    let bf16 = match has_bf16_kernels(device) {
        true => Ok(run(device, FloatDType::BF16)),
        false => Err(
            "kiln's bf16 kernels run on CubeCL devices with bf16; this one takes the composed ops",
        ),
    };
    vec![("f32", Ok(run(device, FloatDType::F32))), ("bf16", bf16)]
}

//! Which tensors kiln's kernels take, the facts every op's chooser asks: the CPU kernels take
//! f32 on flex, the CubeCL kernels f32 and bf16 on CubeCL devices, and neither when
//! `training.fused_kernels` is off; the rest take the composed twins.

use super::settings;
#[cfg(feature = "cube")]
use burn::backend::DispatchDevice;
use burn::tensor::{DType, Device, Tensor};

/// Which implementation of an op takes its tensors.
pub(super) enum Route {
    /// The CubeCL kernel, on this device.
    #[cfg(feature = "cube")]
    Device(cubecl::Device),
    /// The CPU kernel.
    Host,
    /// The composed twin.
    Composed,
}

/// The implementation of an op on `t` whose other inputs have the element types `others`:
/// the CubeCL kernel where it [`covers`] them, else the CPU kernel where it is [`fusable`],
/// else the composed twin.
pub(super) fn route<const D: usize>(t: &Tensor<D>, others: &[DType]) -> Route {
    #[cfg(feature = "cube")]
    if covers(t, others)
        && let Some(device) = cube_device(&t.device())
    {
        return Route::Device(device);
    }
    let _ = others;
    match fusable(t) {
        true => Route::Host,
        false => Route::Composed,
    }
}

/// Whether the fused CPU kernels cover this tensor: f32 on the flex backend (with or without
/// autodiff), kernels enabled.
pub(super) fn fusable<const D: usize>(t: &Tensor<D>) -> bool {
    settings::current().fused
        && t.dtype() == DType::F32
        && crate::tensor::on_host_threads(&t.device())
}

/// Whether the CubeCL kernels cover an op on `t` whose other inputs have the element types
/// `others`: f32 or bf16 on a CubeCL device, every input the same type (a kernel is compiled
/// for one), kernels enabled. (bf16 reads and writes bf16 and accumulates in f32.)
#[cfg(feature = "cube")]
pub(super) fn covers<const D: usize>(t: &Tensor<D>, others: &[DType]) -> bool {
    settings::current().fused
        && matches!(t.dtype(), DType::F32 | DType::BF16)
        && others.iter().all(|d| *d == t.dtype())
        && on_cube_device(&t.device())
}

/// `device` as CubeCL names it, when it is a CubeCL device (where the CubeCL kernels run).
#[cfg(feature = "cube")]
pub(super) fn cube_device(device: &Device) -> Option<cubecl::Device> {
    match device.as_dispatch().clone().inner() {
        DispatchDevice::Cube(d) => Some(d),
        _ => None,
    }
}

/// Whether `device` is a CubeCL device.
#[cfg(feature = "cube")]
pub(super) fn on_cube_device(device: &Device) -> bool {
    cube_device(device).is_some()
}

/// Whether `device` is a CubeCL GPU (not CubeCL's CPU runtime).
#[cfg(feature = "cube")]
pub(super) fn on_gpu(device: &Device) -> bool {
    cube_device(device).is_some_and(|d| !matches!(d, cubecl::Device::Cpu(_)))
}

/// Whether kiln has bf16 kernels on `device`: its CubeCL kernels, where the device has bf16
/// (flex's kernels cover f32 only; bf16 tensors there take the composed ops).
pub fn has_bf16_kernels(device: &Device) -> bool {
    #[cfg(feature = "cube")]
    return on_cube_device(device) && device.supports_dtype(burn::tensor::FloatDType::BF16);
    #[cfg(not(feature = "cube"))]
    {
        let _ = device;
        false
    }
}

/// Whether the mixed-precision model (bf16 matmuls on f32 activations) takes kiln's kernels
/// for attention and the output head on `device`: kernels on and kiln's CubeCL kernels there
/// (which take bf16). Then attention never holds the `T x T` scores and the head never the
/// whole logits, so activation memory grows linearly with the sequence. Elsewhere (flex, whose
/// kernels are f32 only) the model composes both, their matmuls in the compute dtype.
pub fn fuses_mixed(device: &Device) -> bool {
    settings::current().fused && has_bf16_kernels(device)
}

//! What defining a CubeCL kernel for a device that is not there takes, so that a GPU
//! backend's compiler can compile it on a machine with no GPU: the device's properties, a
//! launch's settings, a contiguous tensor argument, the element type; and the AMDGPU compile
//! ([`amdgpu`]). Each op's `cube.rs` lists its kernels with these (`offline`); the catalogue
//! of every op's is [`crate::kernels::offline`], the flash kernels' PTX
//! `attention::cube::flash::ptx`.

use burn::tensor::FloatDType;
use cubecl::features::MmaConfig;
use cubecl::ir::{
    AddressType, DeviceIdentity, DeviceProperties, ElemType, FloatKind, HardwareProperties,
    MemoryDeviceProperties, features::Features,
};
use cubecl::prelude::{
    BufferCompilationArg, CubeDim, ExecutionMode, KernelSettings, TargetProperties,
    TensorCompilationArg, TensorMetaCompilationArg,
};
use cubecl_runtime::kernel::CubeKernel;
use std::sync::Arc;

/// A kernel and the name it is reported by.
pub type Named = (String, Box<dyn CubeKernel>);

/// The properties of a GPU with planes of 32 units, 227 KiB of shared memory a cube and the
/// fragment products `mma` (none for the kernels that take none).
pub(in crate::kernels) fn props(
    mma: Option<MmaConfig>,
) -> (Arc<DeviceProperties>, Arc<TargetProperties>) {
    let hardware = HardwareProperties {
        load_width: 128,
        vector_register_count: None,
        plane_size_min: 32,
        plane_size_max: 32,
        max_bindings: 32,
        max_shared_memory_size: 232_448,
        max_cube_count: (u32::MAX, u16::MAX as u32, u16::MAX as u32),
        max_units_per_cube: 1024,
        max_cube_dim: (1024, 1024, 64),
        num_streaming_multiprocessors: None,
        num_tensor_cores: None,
        min_tensor_cores_dim: None,
        num_cpu_cores: None,
        last_level_cache_size: None,
        max_vector_size: cubecl::ir::VectorSize::MAX,
        cube_mma_reserved_shared_memory: 0,
    };
    let mut props = DeviceProperties::new(
        Features::default(),
        MemoryDeviceProperties::new(u64::MAX, 256),
        hardware,
        cubecl::profile::TimingMethod::Device,
        DeviceIdentity {
            name: "offline".to_string(),
            fingerprint: "offline".to_string(),
            physical: None,
        },
    );
    if let Some(mma) = mma {
        props.features.matmul.cmma.insert(mma);
    }
    (Arc::new(props), Arc::new(TargetProperties::default()))
}

/// A launch of cubes of `units` units along x, bounds-checked, 32-bit indices.
pub(in crate::kernels) fn settings(units: usize) -> KernelSettings {
    KernelSettings::new(
        *CubeDim::new_1d(units as u32),
        ExecutionMode::Checked,
        AddressType::U32,
    )
}

/// A tensor argument (a contiguous buffer of any rank).
pub(in crate::kernels) fn tensor() -> TensorCompilationArg {
    TensorCompilationArg {
        meta: TensorMetaCompilationArg { len: (), rank: () },
        buffer: BufferCompilationArg { inplace: None },
    }
}

/// The element type of `dtype`'s kernels (f32, bf16 or f16).
pub(in crate::kernels) fn elem(dtype: FloatDType) -> Result<ElemType, String> {
    Ok(ElemType::Float(match dtype {
        FloatDType::F32 => FloatKind::F32,
        FloatDType::BF16 => FloatKind::BF16,
        FloatDType::F16 => FloatKind::F16,
        other => {
            return Err(format!(
                "kiln's kernels take f32, bf16 or f16, not {other:?}"
            ));
        }
    }))
}

/// One kernel compiled for an AMD GPU.
#[cfg(feature = "rocm")]
#[derive(Debug, Clone)]
pub struct AmdCode {
    /// The loadable code object: an ELF shared object for `EM_AMDGPU`.
    pub code_object: Vec<u8>,
    /// The entry point's symbol.
    pub entrypoint: String,
    /// The assembly, when `CUBECL_DEBUG_PLIRON` is set in the process.
    pub asm: Option<String>,
}

/// `kernel` compiled for the AMD GPU `arch` (`gfx942`, `gfx90a`, `gfx1201`, ...) by the backend
/// CubeCL's ROCm runtime compiles with: LLVM's AMDGPU target, ROCm's device bitcode for the
/// math functions (`CUBECL_ROCM_DEVICE_LIB_PATH` or `ROCM_PATH`, read once a process), then an
/// external LLD links the object into a code object (`CUBECL_AMDGPU_LINKER`, ROCm's
/// `ld.lld`, or `ld.lld`/`rust-lld` on `PATH`: the patched `cubecl-llvm`).
#[cfg(feature = "rocm")]
pub fn amdgpu(kernel: &dyn CubeKernel, arch: &str) -> Result<AmdCode, String> {
    use cubecl::Compiler;
    use cubecl::ir::amd::GfxArch;
    use cubecl_llvm::{LlvmTarget, PlironArtifact, PlironCompiler, PlironOptions};

    let mut compiler = PlironCompiler {
        target: LlvmTarget::AmdGpu,
    };
    let options = PlironOptions {
        arch: Some(GfxArch::parse(arch)),
        ..Default::default()
    };
    match compiler.compile(kernel.define(), &options) {
        Ok(PlironArtifact::AmdGpuCode(module)) => Ok(AmdCode {
            code_object: module.code_object.to_vec(),
            entrypoint: module.entrypoint,
            asm: module.asm,
        }),
        Ok(_) => Err("the AMDGPU target produced no code object".into()),
        Err(e) => Err(format!("{e:?}")),
    }
}

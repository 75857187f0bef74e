//! Checks of the tensor-core path that need no GPU: the kernels' PTX for a GPU, compiled here
//! by the backend CubeCL's CUDA runtime uses (for a test that it compiles, with tensor-core
//! instructions and no spills), and the planes' split of each tile product's fragments.

#[cfg(feature = "cuda")]
use super::dkv::flash_dkv_kernel;
#[cfg(feature = "cuda")]
use super::dq::flash_dq_kernel;
#[cfg(feature = "cuda")]
use super::forward::flash_forward_kernel;
#[cfg(feature = "cuda")]
use super::launch::{DEFAULT_SHAPES, fragment_config, gpu_tilings};
use super::tiles::{FRAG, Product, Split, Tiling, against, back};

/// The PTX of the forward, `dq` and `dk`/`dv` kernels for `sm_{arch}` at head dimension `hd`
/// in `dtype` (bf16 or f16), compiled here without a device by the backend CubeCL's CUDA
/// runtime compiles them with (LLVM's NVPTX), in the default tilings: for a test that the
/// tile products lower to tensor-core instructions and the kernels compile at all, on a
/// machine with no GPU, and for reading.
#[cfg(feature = "cuda")]
pub fn ptx(hd: usize, dtype: burn::tensor::FloatDType, arch: u32) -> Result<[String; 3], String> {
    use burn::tensor::FloatDType;
    use cubecl::Compiler;
    use cubecl::ir::{
        AddressType, DeviceIdentity, DeviceProperties, HardwareProperties, MemoryDeviceProperties,
        features::Features, nvidia::SmArch,
    };
    use cubecl::ir::{ElemType, FloatKind};
    use cubecl::prelude::{CubeDim, ExecutionMode, KernelSettings, TargetProperties};
    use cubecl_llvm::nvptx::ptx_version::PtxVersion;
    use cubecl_llvm::{LlvmTarget, PlironArtifact, PlironCompiler, PlironOptions};
    use cubecl_runtime::kernel::CubeKernel;
    use std::sync::Arc;

    let dtype = match dtype {
        FloatDType::BF16 => ElemType::Float(FloatKind::BF16),
        FloatDType::F16 => ElemType::Float(FloatKind::F16),
        other => {
            return Err(format!(
                "the flash kernels' fragments take bf16 or f16, not {other:?}"
            ));
        }
    };

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
    props.features.matmul.cmma.insert(fragment_config(dtype));
    let (props, target) = (Arc::new(props), Arc::new(TargetProperties::default()));
    let tiles = gpu_tilings(hd, DEFAULT_SHAPES);
    let settings = |c: &Tiling| {
        KernelSettings::new(
            *CubeDim::new_1d(c.units as u32),
            ExecutionMode::Checked,
            AddressType::U32,
        )
    };
    let tensor = || cubecl::prelude::TensorCompilationArg {
        meta: cubecl::prelude::TensorMetaCompilationArg { len: (), rank: () },
        buffer: cubecl::prelude::BufferCompilationArg { inplace: None },
    };
    let compile = |kernel: &dyn CubeKernel| -> Result<String, String> {
        let mut compiler = PlironCompiler {
            target: LlvmTarget::Nvptx,
        };
        let options = PlironOptions {
            sm_arch: Some(SmArch::new(arch, false)),
            // PTX 8.7 (CUDA 12.8's), which the pinned ptxas (scripts/install-cuda-tools.sh)
            // reads; the runtime emits its driver's version, with the same instructions.
            ptx_version: PtxVersion::for_driver(12080),
            ..Default::default()
        };
        match compiler.compile(kernel.define(), &options) {
            Ok(PlironArtifact::NvptxCode(module)) => {
                // SAFETY: the module's PTX is NUL-terminated.
                let ptx = unsafe { std::ffi::CStr::from_ptr(module.ptx.as_ptr()) };
                Ok(ptx.to_string_lossy().into_owned())
            }
            Ok(_) => Err("the NVPTX target produced no PTX".into()),
            Err(e) => Err(format!("{e:?}")),
        }
    };
    let [cf, cq, ckv] = tiles;
    let forward = flash_forward_kernel::FlashForwardKernel::new(
        settings(&cf),
        props.clone(),
        target.clone(),
        tensor(),
        tensor(),
        tensor(),
        tensor(),
        tensor(),
        (),
        (),
        (),
        (),
        8,
        cf,
        dtype,
    );
    let dq = flash_dq_kernel::FlashDqKernel::new(
        settings(&cq),
        props.clone(),
        target.clone(),
        tensor(),
        tensor(),
        tensor(),
        tensor(),
        tensor(),
        tensor(),
        tensor(),
        tensor(),
        (),
        (),
        (),
        (),
        8,
        cq,
        dtype,
    );
    let dkv = flash_dkv_kernel::FlashDkvKernel::new(
        settings(&ckv),
        props,
        target,
        tensor(),
        tensor(),
        tensor(),
        tensor(),
        tensor(),
        tensor(),
        tensor(),
        tensor(),
        (),
        (),
        (),
        (),
        8,
        ckv,
        dtype,
    );
    Ok([compile(&forward)?, compile(&dq)?, compile(&dkv)?])
}

/// [`super::tiles::slot`] on the host: the same arithmetic, for plane `plane`.
fn slot_on_host(q: usize, plane: usize, s: Split, p: Product, c: Tiling) -> Option<(usize, usize)> {
    let planes = c.units / c.plane;
    let fn_ = p.n / FRAG;
    if s.grid {
        let (qi, qj) = (q / s.cols, q % s.cols);
        Some(match s.by_cols {
            true => (qi, plane + qj * planes),
            false => (plane + qi * planes, qj),
        })
    } else {
        let f = plane + q * planes;
        (f < p.m / FRAG * fn_).then_some((f / fn_, f % fn_))
    }
}

/// Checks that in every product of the tiling `(rows, cols, planes)` at head dimension `hd`
/// each output fragment is some plane's slot exactly once, and that a grid's operand fragments
/// are its slots' (the `A` of slot `qi * cols`, the `B` of slot `qj`): the tensor-core path's
/// bookkeeping, which CubeCL's CPU runtime (no fragments) cannot run.
pub fn check_slots(rows: usize, cols: usize, planes: usize, hd: usize) -> Result<(), String> {
    let c = Tiling::new(rows, cols, planes * 32, 32, hd, true);
    for p in [against(c, rows, cols), back(c, rows, cols)] {
        let s = Split::of(p, c);
        let (fm, fn_) = (p.m / FRAG, p.n / FRAG);
        let mut seen = vec![0; fm * fn_];
        for plane in 0..planes {
            for q in 0..s.count {
                let Some((i, j)) = slot_on_host(q, plane, s, p, c) else {
                    continue;
                };
                seen[i * fn_ + j] += 1;
                let a = slot_on_host(q / s.cols.max(1) * s.cols, plane, s, p, c);
                let b = slot_on_host(q % s.cols.max(1), plane, s, p, c);
                if s.grid && (a.map(|x| x.0), b.map(|x| x.1)) != (Some(i), Some(j)) {
                    return Err(format!(
                        "{p:?} {s:?}: slot {q} of plane {plane} takes other operands"
                    ));
                }
            }
        }
        if seen.iter().any(|&n| n != 1) {
            return Err(format!("{p:?} {s:?}: fragments computed {seen:?} times"));
        }
    }
    Ok(())
}

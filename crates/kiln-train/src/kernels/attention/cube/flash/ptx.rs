//! Checks of the tensor-core path that need no GPU: the kernels' PTX for an NVIDIA GPU and their
//! code objects for an AMD GPU, compiled here by the backends CubeCL's CUDA and ROCm runtimes
//! use (for tests that they compile, with matrix-core instructions and no spills), and the
//! planes' split of each tile product's fragments.

#[cfg(any(feature = "cuda", feature = "rocm"))]
use super::dkv::flash_dkv_kernel;
#[cfg(any(feature = "cuda", feature = "rocm"))]
use super::dq::flash_dq_kernel;
#[cfg(any(feature = "cuda", feature = "rocm"))]
use super::forward::flash_forward_kernel;
#[cfg(any(feature = "cuda", feature = "rocm"))]
use super::launch::{DEFAULT_SHAPES, fragment_config, gpu_tilings};
use super::tiles::{FRAG, Product, Split, Tiling, against, back};

/// The forward, `dq` and `dk`/`dv` kernels at head dimension `hd` in `dtype` (bf16 or f16), in
/// the default tilings (planes of 32 units), defined for a device with 16 x 16 x 16 fragments
/// and no other: what [`ptx`] and [`amdgpu`] compile without a device.
#[cfg(any(feature = "cuda", feature = "rocm"))]
fn kernels(
    hd: usize,
    dtype: burn::tensor::FloatDType,
) -> Result<[Box<dyn cubecl_runtime::kernel::CubeKernel>; 3], String> {
    use crate::kernels::device::offline::{props, settings, tensor};
    use burn::tensor::FloatDType;

    if !matches!(dtype, FloatDType::BF16 | FloatDType::F16) {
        return Err(format!(
            "the flash kernels' fragments take bf16 or f16, not {dtype:?}"
        ));
    }
    let dtype = crate::kernels::device::offline::elem(dtype)?;
    let (props, target) = props(Some(fragment_config(dtype)));
    let tiles = gpu_tilings(hd, DEFAULT_SHAPES);
    let settings = |c: &Tiling| settings(c.units);
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
    Ok([Box::new(forward), Box::new(dq), Box::new(dkv)])
}

/// The PTX of the forward, `dq` and `dk`/`dv` kernels for `sm_{arch}` at head dimension `hd`
/// in `dtype` (bf16 or f16), compiled here without a device by the backend CubeCL's CUDA
/// runtime compiles them with (LLVM's NVPTX), in the default tilings: for a test that the
/// tile products lower to tensor-core instructions and the kernels compile at all, on a
/// machine with no GPU, and for reading.
#[cfg(feature = "cuda")]
pub fn ptx(hd: usize, dtype: burn::tensor::FloatDType, arch: u32) -> Result<[String; 3], String> {
    use cubecl::Compiler;
    use cubecl::ir::nvidia::SmArch;
    use cubecl_llvm::nvptx::ptx_version::PtxVersion;
    use cubecl_llvm::{LlvmTarget, PlironArtifact, PlironCompiler, PlironOptions};

    let compile = |kernel: &dyn cubecl_runtime::kernel::CubeKernel| -> Result<String, String> {
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
    let [forward, dq, dkv] = kernels(hd, dtype)?;
    Ok([compile(&*forward)?, compile(&*dq)?, compile(&*dkv)?])
}

/// The forward, `dq` and `dk`/`dv` kernels at head dimension `hd` in `dtype` compiled without a
/// device for the AMD GPU `arch` by the backend CubeCL's ROCm runtime compiles them with
/// ([`crate::kernels::device::offline::amdgpu`]), each a loadable code object.
///
/// Only for GPUs with WMMA (RDNA3 and RDNA4: `gfx1100`, `gfx1201`, ...): CubeCL 0.11.3's AMDGPU
/// backend lowers tile products to no other matrix instructions (it panics on CDNA's MFMA:
/// `gfx90a`, `gfx942`). At run time kiln launches these kernels only on 32-unit planes
/// (`launch::tilings`), so CDNA GPUs (wave64) take the row or product kernels anyway.
#[cfg(feature = "rocm")]
pub fn amdgpu(
    hd: usize,
    dtype: burn::tensor::FloatDType,
    arch: &str,
) -> Result<[crate::kernels::device::offline::AmdCode; 3], String> {
    use crate::kernels::device::offline::amdgpu as compile;
    let [forward, dq, dkv] = kernels(hd, dtype)?;
    Ok([
        compile(&*forward, arch)?,
        compile(&*dq, arch)?,
        compile(&*dkv, arch)?,
    ])
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

//! Where the flash kernels run and how they are launched: the tilings a device takes (the
//! tensor cores' fragments of the element type, 32-unit planes, the shared memory each kernel
//! needs; unit by unit on CubeCL's CPU runtime), and the forward and backward launches.

use super::dkv::flash_dkv_kernel;
use super::dq::flash_dq_kernel;
use super::forward::flash_forward_kernel;
use super::tiles::{FRAG, Kernel, Tiling};
use crate::config::FlashTiling;
use crate::kernels::attention::cube::layout::dims_of;
use crate::kernels::attention::dims::Dims;
use crate::kernels::device::tensors::{dense, dims, elem, empty_like, f32_vector};
use burn::backend::cubecl::dtype_to_storage_type;
use burn::tensor::DType;
use burn_cubecl::tensor::CubeTensor;
use cubecl::features::MmaConfig;
use cubecl::ir::{DeviceProperties, ElemType, FloatKind};
use cubecl::prelude::*;

/// The fragment product the kernels use: 16 x 16 x 16, `e` operands, f32 accumulator.
pub(super) fn fragment_config(e: ElemType) -> MmaConfig {
    MmaConfig {
        a_type: e,
        b_type: e,
        cd_type: ElemType::Float(FloatKind::F32),
        m: FRAG as u32,
        n: FRAG as u32,
        k: FRAG as u32,
    }
}

/// Whether `props`' device multiplies 16 x 16 x 16 fragments of `e` into f32.
fn has_fragments(props: &DeviceProperties, e: ElemType) -> bool {
    let half = matches!(e, ElemType::Float(FloatKind::BF16 | FloatKind::F16));
    half && props.features.matmul.cmma.contains(&fragment_config(e))
}

/// The tilings `shapes` asks for (`(rows, cols, planes)` of the forward, `dq` and `dk`/`dv`
/// kernels; `None`: [`DEFAULT_SHAPES`]) on `device` at head dimension `hd` in `dtype`, or
/// `None` where these kernels cannot run there. On CubeCL's CPU runtime they run unit by unit,
/// a plane being one unit; on GPUs on the tensor cores, where the device has fragments of the
/// element type, planes of 32 units, and the shared memory each kernel needs.
pub(in crate::kernels) fn tilings(
    device: &cubecl::Device,
    dtype: DType,
    hd: usize,
    shapes: Option<FlashTiling>,
) -> Option<[Tiling; 3]> {
    let shapes = shapes.unwrap_or(DEFAULT_SHAPES);
    if matches!(device, cubecl::Device::Cpu(_)) {
        return Some(
            shapes.map(|(rows, cols, planes)| Tiling::new(rows, cols, planes, 1, hd, false)),
        );
    }
    let client = device.client();
    let props = client.properties();
    let hw = &props.hardware;
    let e = dtype_to_storage_type(dtype);
    if !has_fragments(props, e) || hw.plane_size_max != 32 || hw.plane_size_min != 32 {
        return None;
    }
    let tiles = gpu_tilings(hd, shapes);
    let kinds = [Kernel::Forward, Kernel::Dq, Kernel::Dkv];
    let fits = tiles
        .iter()
        .zip(kinds)
        .all(|(t, kind)| t.shared_bytes(kind, dtype.size()) <= hw.max_shared_memory_size);
    fits.then_some(tiles)
}

/// The tilings of the three kernels at head dimension `hd` on a GPU: `shapes` with planes of
/// 32 units, products on the tensor cores.
pub(super) fn gpu_tilings(hd: usize, shapes: FlashTiling) -> [Tiling; 3] {
    shapes.map(|(rows, cols, planes)| Tiling::new(rows, cols, planes * 32, 32, hd, true))
}

/// The tilings `(rows, cols, planes)` of the forward, `dq` and `dk`/`dv` kernels unless
/// `kernels.flash_tiling` says otherwise: four planes a cube, 64 query rows against 64 keys
/// forward, 64 rows against 32 keys for `dq` and 32 keys against 32 rows for `dk`/`dv` (their
/// shared memory holds more tiles).
pub(super) const DEFAULT_SHAPES: FlashTiling = [(64, 64, 4), (64, 32, 4), (32, 32, 4)];

/// `(cube count, cube dim)` for `per_head_blocks` cubes for every K/V head.
pub(super) fn launch(d: &Dims, per_head_blocks: usize, c: &Tiling) -> (CubeCount, CubeDim) {
    (
        CubeCount::Static(per_head_blocks.max(1) as u32, (d.b * d.kv) as u32, 1),
        CubeDim::new_1d(c.units as u32),
    )
}

/// The vector width (elements) the kernels read and write their `[.., hd]` tensors by: the
/// widest of the device's IO widths that divides the head dimension and every tensor's start.
pub(super) fn vector_width(hd: usize, tensors: &[&CubeTensor]) -> usize {
    let size = tensors[0].dtype.size();
    tensors[0]
        .client
        .io_optimized_vector_sizes(size)
        .find(|&n| {
            hd.is_multiple_of(n)
                && tensors.iter().all(|t| {
                    t.handle
                        .offset_start
                        .is_none_or(|at| at.is_multiple_of((n * size) as u64))
                })
        })
        .unwrap_or(1)
}

/// `(output, log-sum-exp per query row)`, in the forward kernel's tiling `c`.
pub(in crate::kernels) fn forward(
    q: CubeTensor,
    k: CubeTensor,
    v: CubeTensor,
    scale: f64,
    c: Tiling,
) -> (CubeTensor, CubeTensor) {
    let (q, k, v) = (dense(q), dense(k), dense(v));
    let d = dims_of(&q, &k);
    let out = empty_like(&q, [d.b, d.t, d.kv * d.groups * d.hd]);
    let lse = f32_vector(&q, d.rows());
    let (count, dim) = launch(&d, d.groups * d.t.div_ceil(c.rows), &c);
    let width = vector_width(d.hd, &[&q, &k, &v, &out]);
    flash_forward_kernel::launch(
        &q.client,
        count,
        dim,
        width,
        q.clone().into_tensor_arg(),
        k.into_tensor_arg(),
        v.into_tensor_arg(),
        out.clone().into_tensor_arg(),
        lse.clone().into_tensor_arg(),
        d.kv as u32,
        d.groups as u32,
        d.t as u32,
        scale as f32,
        c,
        elem(&q),
    );
    (out, lse)
}

/// `(dq, dk, dv)` for the upstream gradient `dout`, with the `dq` kernel's and the `dk`/`dv`
/// kernel's tilings.
pub(in crate::kernels) fn backward(
    dout: CubeTensor,
    (q, k, v, out, lse): (CubeTensor, CubeTensor, CubeTensor, CubeTensor, CubeTensor),
    scale: f64,
    cq: Tiling,
    ckv: Tiling,
) -> (CubeTensor, CubeTensor, CubeTensor) {
    let (dout, out) = (dense(dout), dense(out));
    let d = dims_of(&q, &k);
    let (dq, dk, dv) = (
        empty_like(&q, dims(&q)),
        empty_like(&k, dims(&k)),
        empty_like(&v, dims(&v)),
    );
    let delta = f32_vector(&q, d.rows());
    let (count, dim) = launch(&d, d.groups * d.t.div_ceil(cq.rows), &cq);
    let width = vector_width(d.hd, &[&q, &k, &v, &out, &dout, &dq, &dk, &dv]);
    flash_dq_kernel::launch(
        &q.client,
        count,
        dim,
        width,
        q.clone().into_tensor_arg(),
        k.clone().into_tensor_arg(),
        v.clone().into_tensor_arg(),
        out.into_tensor_arg(),
        dout.clone().into_tensor_arg(),
        lse.clone().into_tensor_arg(),
        delta.clone().into_tensor_arg(),
        dq.clone().into_tensor_arg(),
        d.kv as u32,
        d.groups as u32,
        d.t as u32,
        scale as f32,
        cq,
        elem(&q),
    );
    let (count, dim) = launch(&d, d.t.div_ceil(ckv.rows), &ckv);
    flash_dkv_kernel::launch(
        &q.client,
        count,
        dim,
        width,
        q.clone().into_tensor_arg(),
        k.into_tensor_arg(),
        v.into_tensor_arg(),
        dout.into_tensor_arg(),
        lse.into_tensor_arg(),
        delta.into_tensor_arg(),
        dk.clone().into_tensor_arg(),
        dv.clone().into_tensor_arg(),
        d.kv as u32,
        d.groups as u32,
        d.t as u32,
        scale as f32,
        ckv,
        elem(&q),
    );
    (dq, dk, dv)
}

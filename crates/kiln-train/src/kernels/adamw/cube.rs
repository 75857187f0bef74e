//! Gradient clipping and the AdamW update in CubeCL: one kernel over a parameter's device
//! buffers (one unit per element) instead of the composed update's twelve element-wise ops,
//! and no host round trip. The arithmetic is the CPU pass's ([`super::cpu`]), operation for
//! operation; a GPU compiler may contract a multiply and an add, so the bits are not promised
//! equal to the CPU's, only within rounding.

use super::cpu::{AdamWScalars, Fused};
use crate::kernels::coverage::covers;
use crate::kernels::device::tensors::{dense, dims, elem, empty_like, launch_1d};
use burn::backend::Cube;
use burn_cubecl::tensor::CubeTensor;
use cubecl::prelude::*;

#[cube(launch)]
#[allow(clippy::too_many_arguments)]
fn adamw_kernel<F: Float>(
    p: &Tensor<F>,
    g: &Tensor<F>,
    m: &Tensor<F>,
    v: &Tensor<F>,
    p_out: &mut Tensor<F>,
    m_out: &mut Tensor<F>,
    v_out: &mut Tensor<F>,
    n: u32,
    grad_scale: f32,
    b1: f32,
    omb1: f32,
    b2: f32,
    omb2: f32,
    decay: f32,
    bc2_sqrt: f32,
    eps: f32,
    step_size: f32,
    #[define(F)] _dtype: ElemType,
) {
    let i = ABSOLUTE_POS;
    if i >= n as usize {
        terminate!();
    }
    // `grad_scale` and `decay` are 1.0 where there is no clipping or no decay: a multiply by
    // one is exact.
    let gi = f32::cast_from(g[i]) * grad_scale;
    let mi = f32::cast_from(m[i]) * b1 + gi * omb1;
    let vi = f32::cast_from(v[i]) * b2 + (gi * gi) * omb2;
    let pi = f32::cast_from(p[i]) * decay;
    let denom = vi.sqrt() / bc2_sqrt + eps;
    p_out[i] = F::cast_from(pi - (mi / denom) * step_size);
    m_out[i] = F::cast_from(mi);
    v_out[i] = F::cast_from(vi);
}

/// The fused update of one parameter on a CubeCL device: `(p, m, v)` after the step.
pub(super) fn update(
    p: burn::tensor::Tensor<1>,
    g: burn::tensor::Tensor<1>,
    m: burn::tensor::Tensor<1>,
    v: burn::tensor::Tensor<1>,
    s: &AdamWScalars,
) -> Fused {
    // A tensor tracked by autodiff does not convert to a `Cube` primitive; the probe converts a
    // clone, dropped at once.
    let covered = [&p, &g, &m, &v].into_iter().all(|t| {
        covers(t, &[p.dtype()])
            && t.dims() == p.dims()
            && (*t).clone().try_into_primitive::<Cube>().is_ok()
    });
    if !covered {
        return Err(Box::new((p, g, m, v)));
    }
    let prim = |t: burn::tensor::Tensor<1>| {
        dense(
            t.try_into_primitive::<Cube>()
                .expect("adamw: device tensor checked by covers"),
        )
    };
    let (p, g, m, v) = (prim(p), prim(g), prim(m), prim(v));
    let (p2, m2, v2) = launch(&p, &g, &m, &v, s);
    Ok((
        burn::tensor::Tensor::from_primitive::<Cube>(p2),
        burn::tensor::Tensor::from_primitive::<Cube>(m2),
        burn::tensor::Tensor::from_primitive::<Cube>(v2),
    ))
}

fn launch(
    p: &CubeTensor,
    g: &CubeTensor,
    m: &CubeTensor,
    v: &CubeTensor,
    s: &AdamWScalars,
) -> (CubeTensor, CubeTensor, CubeTensor) {
    let n = dims(p).iter().product::<usize>();
    let out = || empty_like(p, dims(p));
    let (p2, m2, v2) = (out(), out(), out());
    let (count, dim) = launch_1d(n);
    adamw_kernel::launch(
        &p.client,
        count,
        dim,
        p.clone().into_tensor_arg(),
        g.clone().into_tensor_arg(),
        m.clone().into_tensor_arg(),
        v.clone().into_tensor_arg(),
        p2.clone().into_tensor_arg(),
        m2.clone().into_tensor_arg(),
        v2.clone().into_tensor_arg(),
        n as u32,
        s.grad_scale.unwrap_or(1.0),
        s.b1.0,
        s.b1.1,
        s.b2.0,
        s.b2.1,
        s.decay.unwrap_or(1.0),
        s.bc2_sqrt,
        s.eps,
        s.step_size,
        elem(p),
    );
    (p2, m2, v2)
}

/// The kernel in `e`, defined for no device (see [`crate::kernels::device::offline`]).
#[cfg(any(feature = "cuda", feature = "rocm"))]
pub(in crate::kernels) fn offline(
    e: ElemType,
) -> Vec<(&'static str, Box<dyn cubecl_runtime::kernel::CubeKernel>)> {
    use crate::kernels::device::offline::{props, settings, tensor};
    let (p, t) = props(None);
    vec![(
        "update",
        Box::new(adamw_kernel::AdamwKernel::new(
            settings(256),
            p,
            t,
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
            (),
            (),
            (),
            (),
            (),
            (),
            e,
        )),
    )]
}

//! Sums and maxima over a cube's units in a fixed order, and the launch shape of the kernels
//! that take a cube per row.

use burn_cubecl::tensor::CubeTensor;
use cubecl::prelude::*;

/// Units a cube of the row kernels takes: a power of two. On CubeCL's CPU runtime one (a
/// cube barrier there costs a spinning thread a unit; with one unit a row is summed in column
/// order, the order that runtime's smoke baseline was blessed with).
pub(in crate::kernels) fn row_units(t: &CubeTensor) -> usize {
    match t.device {
        cubecl::Device::Cpu(_) => 1,
        _ => 256,
    }
}

/// `(cube count, cube dim)` for one cube of `units` a row (rows past 65,535 go to the second
/// grid dimension, which every runtime allows).
pub(in crate::kernels) fn launch_rows(rows: usize, units: usize) -> (CubeCount, CubeDim) {
    let x = rows.clamp(1, 65_535);
    let y = rows.div_ceil(x).max(1);
    (
        CubeCount::Static(x as u32, y as u32, 1),
        CubeDim::new_1d(units as u32),
    )
}

/// The sum of every unit's `value` over the cube, added in a fixed tree (unit `u` takes
/// `u + s` for halving `s`), so a row's sum has the same bits on every run; every unit gets it.
/// `partial` holds one f32 a unit (free again on return); the cube's units are a power of two.
#[cube]
pub(in crate::kernels) fn cube_sum(partial: &mut Shared<[f32]>, value: f32) -> f32 {
    cube_tree(partial, value, false)
}

/// The largest of every unit's `value` over the cube, as [`cube_sum`].
#[cube]
pub(in crate::kernels) fn cube_max(partial: &mut Shared<[f32]>, value: f32) -> f32 {
    cube_tree(partial, value, true)
}

/// [`cube_sum`] (`max` false) or [`cube_max`] (`max` true).
#[cube]
fn cube_tree(partial: &mut Shared<[f32]>, value: f32, #[comptime] max: bool) -> f32 {
    let u = UNIT_POS as usize;
    partial[u] = value;
    sync_cube();
    let mut s = CUBE_DIM as usize / 2;
    while s > 0 {
        if u < s {
            if max {
                partial[u] = f32::max(partial[u], partial[u + s]);
            } else {
                partial[u] += partial[u + s];
            }
        }
        sync_cube();
        s /= 2;
    }
    let out = partial[0];
    sync_cube();
    out
}

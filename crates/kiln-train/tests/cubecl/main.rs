//! The GPU code path's kernels and ops on CubeCL's CPU runtime (`--features cubecl-cpu`, with
//! `cuda` for the PTX checks), one binary: [`cubecl_cpu`] (burn's ops and a model step
//! against flex) and [`cube_kernels`] (kiln's CubeCL kernels against their composed twins).
//! Run one test at a time (`-- --test-threads=1`): see `.ci/run`.

mod common;
mod cube_kernels;
mod cubecl_cpu;

//! kiln's end-to-end tests, one binary: each module runs the real `kiln` binary (and real
//! MPI, Slurm, signals and files) for one area. One binary instead of one per file: each
//! test binary links burn, and CI's cold build paid for every one.
//!
//! Run one area with `cargo test --release -p kiln --features kiln/mpi --test suite AREA::`
//! (for example `launch_mpi::`).

mod common;
mod control_plane;
mod data_cli;
mod data_megatron;
mod data_parallel;
mod data_parquet;
mod export;
mod gates;
mod guards;
mod hardening;
mod init_from;
mod launch;
mod launch_faults;
mod launch_mpi;
mod liveness;
mod merge;
mod optimizers;
mod recover;
mod run_dir;
mod slurm;
mod soak;
mod stragglers;
mod submit;
mod tensor_parallel;
mod tensorboard;
mod train;
mod yeet;

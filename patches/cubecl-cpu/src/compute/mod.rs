pub mod affinity;
pub mod server;
pub mod threadpool;

pub(crate) mod alloc_controller;
pub(crate) mod cpu_kernel;
pub(crate) mod schedule;
pub(crate) mod stream;

pub use cubecl_server::device::CpuDevice;

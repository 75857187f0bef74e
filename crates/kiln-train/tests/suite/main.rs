//! kiln-train's integration tests, one binary (each test binary links burn): training on
//! blended Megatron data ([`blended_data`]) and the optimizers against PyTorch's
//! ([`torch_parity`], gated on a Python with torch).

mod blended_data;
mod torch_parity;

//! kiln-train's integration tests, one binary (each test binary links burn): training on
//! blended Megatron data ([`blended_data`]), Hugging Face weights as a run's start against
//! transformers' logits ([`hf_import`]), and the optimizers against PyTorch's
//! ([`torch_parity`], gated on a Python with torch).

mod blended_data;
mod hf_import;
mod torch_parity;

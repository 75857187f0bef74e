//! Megatron-compatible indexed datasets, tokenization, deterministic weighted blending and the resumable loader.

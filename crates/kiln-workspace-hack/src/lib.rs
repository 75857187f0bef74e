//! Feature unification for CI's two builds; no code. See `Cargo.toml`.

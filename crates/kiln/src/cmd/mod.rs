//! One module per verb family; each owns its clap argument structs and a `run`-like entry.

pub mod data;
pub mod export;
pub mod gates;
pub mod help;
pub mod launch;
pub mod submit;
pub mod train;
pub mod yeet;

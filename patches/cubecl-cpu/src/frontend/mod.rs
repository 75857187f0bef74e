mod unaligned_vector;
pub use unaligned_vector::*;

//! Causal grouped-query attention as tiled flash kernels whose products run on the tensor
//! cores: the same function, saved state (output and log-sum-exp) and layouts as the row
//! kernels and the products, never holding more of the scores than one tile per cube. Why:
//! by products attention writes and reads each chunk's f32 scores at memory bandwidth, and the
//! row kernels compute every product a scalar at a time; here a cube stages a block of query
//! rows and a tile of keys and values in shared memory, multiplies them by 16 x 16 x 16 `cmma`
//! fragments (bf16 or f16 in, f32 out), and keeps the scores, probabilities and running sums
//! of the tile in shared memory.
//!
//! The parts, by what they do:
//! - [`tiles`]: how a cube cuts its work, and the tile products (tensor cores, or unit by unit);
//! - [`staging`]: what a cube loads from global memory into shared memory and writes back;
//! - [`softmax`]: the forward kernel's online softmax with its conditional rescale;
//! - the three kernels: [`forward`], [`dq`] (and `D = dO . O` per row), [`dkv`];
//! - [`launch`]: the tilings a device takes, and the forward and backward launches;
//! - [`ptx`]: the checks of the tensor-core path that need no GPU.
//!
//! No atomics: each output is summed by one cube in a fixed order. `P` and `dS` enter their
//! second products in the element type, as flash attention's do.
//!
//! The tile products run either on the tensor cores (`mma`) or unit by unit, the same product
//! over the same shared-memory operands: CubeCL's CPU runtime has no matrix instructions, so
//! there (and in f32) the kernels run unit by unit, and the kernel tests check everything but
//! the fragment instructions against the composed attention (the planes' split of the
//! fragments is checked on the host); a test compiles the `mma` path to PTX for sm_90 with
//! CubeCL's own backend and assembles it with ptxas, no GPU needed (tensor-core products, no
//! spills); `kiln doctor` checks its values on a GPU. Head dimensions that are not a multiple
//! of 16 are padded with zeros in shared memory. Layouts as [`crate::kernels::attention::dims`]
//! says, with log-sum-exp and `D` per query row.

mod dkv;
mod dq;
mod forward;
pub(in crate::kernels) mod launch;
pub(in crate::kernels) mod ptx;
mod softmax;
mod staging;
pub(in crate::kernels) mod tiles;

//! The tensor files of a checkpoint: safetensors of f32 or bf16 tensors, read back as f32.

use super::error::{CheckpointError, invalid};
use std::path::Path;

/// The element type a tensor is stored with (`training.master_dtype` for weights; optimizer
/// state is always f32).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum StoredDtype {
    /// 32-bit float.
    #[default]
    F32,
    /// bfloat16.
    Bf16,
}

impl StoredDtype {
    /// Bytes per element.
    pub fn width(self) -> usize {
        match self {
            Self::F32 => 4,
            Self::Bf16 => 2,
        }
    }
}

/// A named tensor on the host. Values are held as f32 whatever the stored dtype (every bf16
/// value is exactly an f32), so the rest of kiln handles one element type; the dtype says
/// how the tensor is written and was read.
#[derive(Debug, Clone, PartialEq)]
pub struct HostTensor {
    /// Parameter (or state) name.
    pub name: String,
    /// Shape.
    pub shape: Vec<usize>,
    /// How it is stored in safetensors.
    pub dtype: StoredDtype,
    /// Values, row-major.
    pub values: Vec<f32>,
}

impl HostTensor {
    /// An f32 tensor.
    pub fn f32(name: String, shape: Vec<usize>, values: Vec<f32>) -> Self {
        Self {
            name,
            shape,
            dtype: StoredDtype::F32,
            values,
        }
    }

    /// Elements `range` of this tensor, read as a tensor of shape `shape`: from the whole
    /// tensor (that shape, or flat: the weights assembled from shards have no other), or,
    /// where `pieces` allows it, from a piece of exactly `range.len()` elements (what
    /// [`load_kept`] reads); `None` when it is neither.
    pub fn elements(
        &self,
        shape: &[usize],
        range: std::ops::Range<usize>,
        pieces: bool,
    ) -> Option<Vec<f32>> {
        let numel: usize = shape.iter().product();
        let whole = (self.shape == shape || self.shape == [numel]) && self.values.len() == numel;
        match (whole, pieces && self.shape == [range.len()]) {
            (true, _) => self.values.get(range).map(<[f32]>::to_vec),
            (false, true) => Some(self.values.clone()),
            (false, false) => None,
        }
    }
}

/// bf16 bits of `v`, rounded to nearest even (exact for values that are bf16 already).
pub(super) fn bf16_bits(v: f32) -> u16 {
    burn::tensor::bf16::from_f32(v).to_bits()
}

/// Parses safetensors bytes into host tensors: F32 and BF16 are read (BF16 widened to f32
/// exactly, the dtype kept); any other dtype is an error naming the tensor.
pub fn from_safetensors(bytes: &[u8], path: &Path) -> Result<Vec<HostTensor>, CheckpointError> {
    let st =
        safetensors::SafeTensors::deserialize(bytes).map_err(|e| invalid(path, e.to_string()))?;
    let mut out = Vec::new();
    for (name, view) in st.tensors() {
        let dtype = stored_dtype(view.dtype(), &name, path)?;
        let values = decode(view.data(), dtype);
        out.push(HostTensor {
            name,
            shape: view.shape().to_vec(),
            dtype,
            values,
        });
    }
    out.sort_by(|a, b| a.name.cmp(&b.name));
    Ok(out)
}

/// The [`StoredDtype`] of a safetensors dtype kiln reads (F32, BF16); any other is an error
/// naming the tensor `name` of `path`.
pub(super) fn stored_dtype(
    dtype: safetensors::Dtype,
    name: &str,
    path: &Path,
) -> Result<StoredDtype, CheckpointError> {
    match dtype {
        safetensors::Dtype::F32 => Ok(StoredDtype::F32),
        safetensors::Dtype::BF16 => Ok(StoredDtype::Bf16),
        other => Err(invalid(
            path,
            format!("tensor {name} has dtype {other:?}; kiln reads F32 and BF16"),
        )),
    }
}

/// Little-endian values of `dtype` as f32 (bf16 widened exactly).
pub(super) fn decode(bytes: &[u8], dtype: StoredDtype) -> Vec<f32> {
    match dtype {
        StoredDtype::F32 => bytes
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect(),
        StoredDtype::Bf16 => bytes
            .chunks_exact(2)
            .map(|c| burn::tensor::bf16::from_bits(u16::from_le_bytes([c[0], c[1]])).to_f32())
            .collect(),
    }
}

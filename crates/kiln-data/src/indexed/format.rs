//! What every part of an indexed dataset shares: the dtype codes, the magic, the header's
//! length, the paths of `.bin` and `.idx`, little-endian reads.

use std::path::{Path, PathBuf};
/// The `.idx` magic bytes.
pub const INDEX_MAGIC: &[u8; 9] = b"MMIDIDX\x00\x00";
pub(super) const HEADER_LEN: usize = 9 + 8 + 1 + 8 + 8;
/// Token dtype codes, as Megatron numbers them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DType {
    U8,
    I8,
    I16,
    I32,
    I64,
    F64,
    F32,
    U16,
}
impl DType {
    /// Megatron's numeric code for the dtype.
    pub fn code(self) -> u8 {
        match self {
            DType::U8 => 1,
            DType::I8 => 2,
            DType::I16 => 3,
            DType::I32 => 4,
            DType::I64 => 5,
            DType::F64 => 6,
            DType::F32 => 7,
            DType::U16 => 8,
        }
    }

    /// The dtype for a Megatron code, if it is one.
    pub fn from_code(code: u8) -> Option<DType> {
        Some(match code {
            1 => DType::U8,
            2 => DType::I8,
            3 => DType::I16,
            4 => DType::I32,
            5 => DType::I64,
            6 => DType::F64,
            7 => DType::F32,
            8 => DType::U16,
            _ => return None,
        })
    }

    /// Bytes per token.
    pub fn size(self) -> usize {
        match self {
            DType::U8 | DType::I8 => 1,
            DType::I16 | DType::U16 => 2,
            DType::I32 | DType::F32 => 4,
            DType::I64 | DType::F64 => 8,
        }
    }

    /// The dtype Megatron picks for a vocabulary: `uint16` below 65500 entries, else `int32`
    /// (`DType.optimal_dtype`). Matching it keeps files byte-identical with Megatron's.
    pub fn optimal(vocab_size: usize) -> DType {
        if vocab_size < 65_500 {
            DType::U16
        } else {
            DType::I32
        }
    }

    /// numpy's name for the dtype.
    pub fn name(self) -> &'static str {
        match self {
            DType::U8 => "uint8",
            DType::I8 => "int8",
            DType::I16 => "int16",
            DType::I32 => "int32",
            DType::I64 => "int64",
            DType::F64 => "float64",
            DType::F32 => "float32",
            DType::U16 => "uint16",
        }
    }
}
/// Path of the `.idx` file of a prefix (the prefix plus `.idx`, as Megatron appends it).
pub fn idx_path(prefix: &Path) -> PathBuf {
    let mut s = prefix.as_os_str().to_owned();
    s.push(".idx");
    PathBuf::from(s)
}
/// Path of the `.bin` file of a prefix.
pub fn bin_path(prefix: &Path) -> PathBuf {
    let mut s = prefix.as_os_str().to_owned();
    s.push(".bin");
    PathBuf::from(s)
}
#[inline]
pub(super) fn le_u64(b: &[u8], at: usize) -> u64 {
    let mut a = [0u8; 8];
    a.copy_from_slice(&b[at..at + 8]);
    u64::from_le_bytes(a)
}
#[inline]
pub(super) fn le_i32(b: &[u8], at: usize) -> i32 {
    let mut a = [0u8; 4];
    a.copy_from_slice(&b[at..at + 4]);
    i32::from_le_bytes(a)
}
#[inline]
pub(super) fn le_i64(b: &[u8], at: usize) -> i64 {
    let mut a = [0u8; 8];
    a.copy_from_slice(&b[at..at + 8]);
    i64::from_le_bytes(a)
}
/// A temporary sibling name unique to this process and call, so that concurrent writers never
/// share a temporary file.
pub(crate) fn tmp_name(path: &Path) -> PathBuf {
    use std::sync::atomic::{AtomicU64, Ordering};
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let n = COUNTER.fetch_add(1, Ordering::Relaxed);
    let mut s = path.as_os_str().to_owned();
    s.push(format!(".tmp.{}.{n}", std::process::id()));
    PathBuf::from(s)
}

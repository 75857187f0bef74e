//! Writing safetensors files a tensor at a time: the header from the tensors' names, dtypes
//! and shapes, then each tensor's bytes as it is read ([`Source`]), through a writer that
//! hashes what passes ([`Hashing`]). A checkpoint is written without ever holding a second
//! copy of the whole state, and without reading the file back for its checksum: on the host
//! backend the memory tier writes the step's own (released) buffers straight into
//! `/dev/shm`, where building the file in memory first cost a copy of the state and twice its
//! size in peak memory.
//!
//! The bytes are exactly [`safetensors::serialize`]'s (the same header, the tensors in the
//! format's order: dtype alignment descending, then name), which a test holds.

use super::checksum::{ChecksumKind, Hasher, ManifestEntry};
use super::format::{HostTensor, StoredDtype, bf16_bits};
use std::borrow::Cow;
use std::io::Write;

/// A tensor a safetensors file is written from, read only when its bytes are written.
pub trait Source {
    /// Its name in the file.
    fn name(&self) -> &str;
    /// Its shape.
    fn shape(&self) -> &[usize];
    /// How it is stored.
    fn dtype(&self) -> StoredDtype;
    /// Writes its bytes as stored (little-endian f32, or bf16 bits) into `out`; returns how
    /// many it wrote.
    fn write_to(&self, out: &mut dyn Write) -> std::io::Result<usize>;
}

impl Source for HostTensor {
    fn name(&self) -> &str {
        &self.name
    }
    fn shape(&self) -> &[usize] {
        &self.shape
    }
    fn dtype(&self) -> StoredDtype {
        self.dtype
    }
    fn write_to(&self, out: &mut dyn Write) -> std::io::Result<usize> {
        // Values in memory are the little-endian bytes safetensors stores on every platform
        // kiln builds for (x86-64, aarch64).
        let bytes: Cow<[u8]> = match self.dtype {
            StoredDtype::F32 => Cow::Borrowed(bytemuck::cast_slice(&self.values)),
            StoredDtype::Bf16 => Cow::Owned(
                self.values
                    .iter()
                    .flat_map(|&v| bf16_bits(v).to_le_bytes())
                    .collect(),
            ),
        };
        out.write_all(&bytes)?;
        Ok(bytes.len())
    }
}

fn safetensors_dtype(d: StoredDtype) -> safetensors::Dtype {
    match d {
        StoredDtype::F32 => safetensors::Dtype::F32,
        StoredDtype::Bf16 => safetensors::Dtype::BF16,
    }
}

fn stored_bytes(s: &dyn Source) -> usize {
    let width = match s.dtype() {
        StoredDtype::F32 => 4,
        StoredDtype::Bf16 => 2,
    };
    s.shape().iter().product::<usize>() * width
}

/// A tensor as the header sees it: dtype, shape and length, no data.
struct Meta<'a>(&'a dyn Source);

impl safetensors::View for Meta<'_> {
    fn dtype(&self) -> safetensors::Dtype {
        safetensors_dtype(self.0.dtype())
    }
    fn shape(&self) -> &[usize] {
        self.0.shape()
    }
    fn data(&self) -> Cow<'_, [u8]> {
        Cow::Borrowed(&[])
    }
    fn data_len(&self) -> usize {
        stored_bytes(self.0)
    }
}

/// Why a file could not be written.
#[derive(Debug, thiserror::Error)]
pub enum StreamError {
    /// The header (a name twice, a header too large).
    #[error("{0}")]
    Format(#[from] safetensors::SafeTensorError),
    /// A tensor whose bytes do not match its shape and dtype.
    #[error("tensor {name} has {got} bytes; its shape and dtype make {want}")]
    Length {
        /// The tensor.
        name: String,
        /// Bytes it gave.
        got: usize,
        /// Bytes its shape and dtype make.
        want: usize,
    },
    /// The writer failed.
    #[error("{0}")]
    Io(#[from] std::io::Error),
}

/// Writes `tensors` as a safetensors file (metadata `{"format": "pt"}`) into `out`, each
/// tensor's bytes read as it is written.
pub fn write(out: &mut dyn Write, tensors: &[&dyn Source]) -> Result<(), StreamError> {
    let meta = std::collections::HashMap::from([("format".to_string(), "pt".to_string())]);
    // With no data in the views, serialising gives the length prefix and the header alone.
    let header = safetensors::serialize(tensors.iter().map(|t| (t.name(), Meta(*t))), &Some(meta))?;
    out.write_all(&header)?;
    let mut order: Vec<&dyn Source> = tensors.to_vec();
    // The format's order (safetensors' `prepare`): dtype alignment descending, then name.
    order.sort_by(|a, b| {
        safetensors_dtype(b.dtype())
            .cmp(&safetensors_dtype(a.dtype()))
            .then_with(|| a.name().cmp(b.name()))
    });
    for t in order {
        let got = t.write_to(out)?;
        let want = stored_bytes(t);
        if got != want {
            return Err(StreamError::Length {
                name: t.name().to_string(),
                got,
                want,
            });
        }
    }
    Ok(())
}

/// A writer that hashes and counts the bytes it passes on.
pub struct Hashing<W> {
    inner: W,
    hash: Hasher,
    bytes: u64,
}

impl<W: Write> Hashing<W> {
    /// Hashing what goes into `inner` with `kind`.
    pub fn new(inner: W, kind: ChecksumKind) -> Self {
        Self {
            inner,
            hash: Hasher::new(kind),
            bytes: 0,
        }
    }

    /// The manifest entry of what was written, and the inner writer.
    pub fn finish(self) -> (ManifestEntry, W) {
        let entry = ManifestEntry {
            sum: self.hash.finish(),
            bytes: self.bytes,
        };
        (entry, self.inner)
    }
}

impl<W: Write> Write for Hashing<W> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let n = self.inner.write(buf)?;
        self.hash.update(&buf[..n]);
        self.bytes += n as u64;
        Ok(n)
    }
    fn flush(&mut self) -> std::io::Result<()> {
        self.inner.flush()
    }
}

/// Serialises tensors to safetensors bytes. Deterministic: same tensors, same bytes (the
/// metadata map has a single fixed key, tensors are ordered by the format's rules).
pub fn to_safetensors(tensors: &[HostTensor]) -> Result<Vec<u8>, StreamError> {
    let sources: Vec<&dyn Source> = tensors.iter().map(|t| t as &dyn Source).collect();
    let mut out = Vec::new();
    write(&mut out, &sources)?;
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::checkpoint::checksum::Checksum;

    fn t(name: &str, dtype: StoredDtype, shape: Vec<usize>) -> HostTensor {
        let n: usize = shape.iter().product();
        HostTensor {
            name: name.into(),
            shape,
            dtype,
            values: (0..n).map(|i| i as f32 * 0.37 - 1.5).collect(),
        }
    }

    /// The bytes of the crate's own serialiser on fully materialised views.
    fn reference(tensors: &[HostTensor]) -> Vec<u8> {
        let owned: Vec<(String, safetensors::Dtype, Vec<usize>, Vec<u8>)> = tensors
            .iter()
            .map(|x| {
                (
                    x.name.clone(),
                    safetensors_dtype(x.dtype),
                    x.shape.clone(),
                    {
                        let mut b = Vec::new();
                        x.write_to(&mut b).unwrap();
                        b
                    },
                )
            })
            .collect();
        let views = owned.iter().map(|(n, d, s, b)| {
            (
                n.clone(),
                safetensors::tensor::TensorView::new(*d, s.clone(), b).unwrap(),
            )
        });
        let meta = std::collections::HashMap::from([("format".to_string(), "pt".to_string())]);
        safetensors::serialize(views, &Some(meta)).unwrap()
    }

    #[test]
    fn streamed_bytes_are_the_serialisers_whatever_the_order_and_dtypes() {
        let tensors = vec![
            t("z.weight", StoredDtype::Bf16, vec![3, 5]),
            t("a.weight", StoredDtype::F32, vec![7]),
            t("m.exp_avg", StoredDtype::F32, vec![2, 2, 2]),
            t("b.bias", StoredDtype::Bf16, vec![1]),
            t("empty", StoredDtype::F32, vec![0]),
        ];
        let sources: Vec<&dyn Source> = tensors.iter().map(|t| t as &dyn Source).collect();
        for kind in [ChecksumKind::Sha256, ChecksumKind::Xxh3_128] {
            let mut out = Hashing::new(Vec::new(), kind);
            write(&mut out, &sources).unwrap();
            let (entry, bytes) = out.finish();
            assert_eq!(bytes, reference(&tensors));
            assert_eq!(entry.bytes, bytes.len() as u64);
            assert_eq!(entry.sum, Checksum::of(kind, &bytes));
        }
    }

    #[test]
    fn a_tensor_whose_bytes_miss_its_shape_is_an_error_naming_it() {
        let mut bad = t("short", StoredDtype::F32, vec![4]);
        bad.values.pop();
        let err = write(&mut Vec::new(), &[&bad as &dyn Source]).unwrap_err();
        assert!(err.to_string().contains("short"), "{err}");
    }
}

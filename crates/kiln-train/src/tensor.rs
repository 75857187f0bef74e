//! Tensor helpers every part of the trainer shares: host copies, named device tensors, the
//! flat host buffer the all-reduce works on, and checksums. A leaf: it imports nothing of
//! the trainer but the checkpoint's host-tensor type.

use crate::checkpoint::{HostTensor, Source, StoredDtype};
use burn::backend::Flex;
use burn::tensor::{DType, Device, FloatDType, Int, Tensor, TensorData};
use kiln_dist::{BucketedAllReduce, Collective};
use sha2::{Digest, Sha256};

/// Host copy of a flat tensor, widened to f32 whatever its dtype.
pub fn to_vec(t: &Tensor<1>) -> Vec<f32> {
    into_vec(t.clone())
}

/// The values of `t` as f32, taken (on the host backend without a copy where `t` held the
/// only reference to its buffer).
pub fn into_vec(t: Tensor<1>) -> Vec<f32> {
    let data = t.into_data();
    let data = if data.dtype() == DType::F32 {
        data
    } else {
        data.convert::<f32>()
    };
    data.try_into_vec::<f32>().unwrap_or_default()
}

/// Whether `device` computes on the host's threads (flex), where spreading independent
/// tensor work over threads pays. On a CubeCL device each host thread has its own stream,
/// and a tensor produced on one thread's stream and read on another's is not reliably
/// waited for (measured on CubeCL's CPU runtime: a global norm summed from per-tensor
/// results of rayon threads came out 10 % low, every gradient itself exact), so work on those
/// devices stays on the calling thread.
pub fn on_host_threads(device: &Device) -> bool {
    matches!(
        device.as_dispatch().clone().inner(),
        burn::backend::DispatchDevice::Flex(_)
    )
}

/// Token ids `[rows, len]` as an Int tensor on `device`.
pub fn int_tensor(rows: &[Vec<u32>], len: usize, device: &Device) -> Tensor<2, Int> {
    tokens_from(rows, 0, len, device)
}

/// The next-token targets of `rows` (`[rows, len]`: each row's tokens from the second on,
/// the first `len`), for the inputs [`int_tensor`] makes of the same rows.
pub fn target_tensor(rows: &[Vec<u32>], len: usize, device: &Device) -> Tensor<2, Int> {
    tokens_from(rows, 1, len, device)
}

fn tokens_from(rows: &[Vec<u32>], skip: usize, len: usize, device: &Device) -> Tensor<2, Int> {
    let flat: Vec<i64> = rows
        .iter()
        .flat_map(|r| r.iter().skip(skip).take(len).map(|&t| i64::from(t)))
        .collect();
    Tensor::from_data(TensorData::new(flat, [rows.len(), len]), device)
}

/// A named tensor still on the device.
#[derive(Debug, Clone)]
pub struct DeviceTensor {
    /// Its name in the checkpoint.
    pub name: String,
    /// Its logical shape (the tensor itself is flat).
    pub shape: Vec<usize>,
    /// The tensor.
    pub tensor: Tensor<1>,
}

impl DeviceTensor {
    /// A host copy, widened to f32, remembering whether it was bf16.
    pub fn to_host(&self) -> HostTensor {
        HostTensor {
            name: self.name.clone(),
            shape: self.shape.clone(),
            dtype: if self.tensor.dtype() == DType::BF16 {
                StoredDtype::Bf16
            } else {
                StoredDtype::F32
            },
            values: to_vec(&self.tensor),
        }
    }
}

/// Read as its bytes are written: f32 and bf16 tensors as the device holds them (one host
/// copy, no widening), any other dtype widened to f32.
impl Source for DeviceTensor {
    fn name(&self) -> &str {
        &self.name
    }
    fn shape(&self) -> &[usize] {
        &self.shape
    }
    fn dtype(&self) -> StoredDtype {
        if self.tensor.dtype() == DType::BF16 {
            StoredDtype::Bf16
        } else {
            StoredDtype::F32
        }
    }
    fn write_to(&self, out: &mut dyn std::io::Write) -> std::io::Result<usize> {
        // On flex, the bytes where they lie: `into_data` of a shared buffer copied it (twice
        // when the copy was re-aligned), about 1 % of the reference model's CPU step with the
        // memory tier at its default.
        if let Ok(prim) = self.tensor.clone().try_into_primitive::<Flex>()
            && let Some(values) = prim.as_slice::<f32>()
        {
            let bytes: &[u8] = bytemuck::cast_slice(values);
            out.write_all(bytes)?;
            return Ok(bytes.len());
        }
        let data = self.tensor.clone().into_data();
        let data = match data.dtype() {
            DType::F32 | DType::BF16 => data,
            _ => data.convert::<f32>(),
        };
        out.write_all(data.as_bytes())?;
        Ok(data.as_bytes().len())
    }
}

/// All tensors' values, then `extra`, concatenated on the host (what the all-reduce works
/// on) in one buffer allocated once. Each tensor is read where it lies and dropped once
/// copied: a tensor held nowhere else (a gradient) is copied once, and never twice at the
/// same time.
pub fn flatten(tensors: Vec<Tensor<1>>, extra: &[f32]) -> Vec<f32> {
    let n = tensors.iter().map(|t| t.dims()[0]).sum::<usize>() + extra.len();
    let mut out = Vec::with_capacity(n);
    for t in tensors {
        let data = t.into_data();
        match data.as_slice::<f32>() {
            Ok(values) => out.extend_from_slice(values),
            Err(_) => out.extend(data.convert::<f32>().iter::<f32>()),
        }
    }
    out.extend_from_slice(extra);
    out
}

/// The mean over the ranks of `comm` of `loss` and `grads` (f32), as the bucketed
/// all-reduce of their concatenation, gradients first (the same calls and bits), made on
/// their host copies in place: no buffer as long as the model is built for it.
pub fn mean_over_ranks(
    reduce: &BucketedAllReduce,
    comm: &dyn Collective,
    loss: f32,
    grads: Vec<Tensor<1>>,
    device: &Device,
) -> (f32, Vec<Tensor<1>>) {
    let mut host: Vec<Vec<f32>> = grads.into_iter().map(into_vec).collect();
    let mut loss = [loss];
    let mut parts: Vec<&mut [f32]> = host.iter_mut().map(Vec::as_mut_slice).collect();
    parts.push(&mut loss);
    reduce.mean_in_place(comm, &mut parts);
    let grads = host.into_iter().map(|g| from_vec(g, device)).collect();
    (loss[0], grads)
}

/// A 1-d tensor of `values` on `device` (on the host backend, the vector's own buffer).
pub fn from_vec(values: Vec<f32>, device: &Device) -> Tensor<1> {
    let n = values.len();
    Tensor::from_data(TensorData::new(values, [n]), device)
}

/// Cuts `flat` into consecutive tensors of `lengths` elements, on `device`.
pub fn split(
    flat: &[f32],
    lengths: impl IntoIterator<Item = usize>,
    device: &Device,
) -> Vec<Tensor<1>> {
    let mut at = 0;
    lengths
        .into_iter()
        .map(|n| {
            let part = flat[at..at + n].to_vec();
            at += n;
            from_vec(part, device)
        })
        .collect()
}

/// A 64-bit checksum of all parameter values (bit-exact: any flipped bit changes it).
/// Hashes each tensor's host copy in turn (the same digest as hashing them concatenated,
/// without building the concatenation on the device and copying it once more).
pub fn params_checksum(params: &[Tensor<1>]) -> u64 {
    let mut h = Sha256::new();
    for p in params {
        h.update(bytemuck::cast_slice::<f32, u8>(&to_vec(p)));
    }
    let digest = h.finalize();
    u64::from_le_bytes(digest[..8].try_into().unwrap_or([0; 8]))
}

/// Whether each parameter differs from `prev` (its earlier copy: the same parameters, one
/// host read-back for all of them); an empty tensor (a rank's piece of nothing, in a
/// parameter-sharded run) has not changed.
pub fn changed_params(params: &[Tensor<1>], prev: &[Tensor<1>]) -> Vec<bool> {
    per_tensor(
        params,
        |i, a| (a - prev[i].clone().cast(FloatDType::F32)).abs().max(),
        |d| d != 0.0,
    )
}

/// Whether each tensor holds a NaN or an infinity (one host read-back for all of them): `x - x`
/// is 0 for a finite `x` and NaN otherwise, so a tensor's sum of it is NaN exactly when one
/// of its values is not finite. An empty tensor holds none.
pub fn nonfinite_tensors(tensors: &[Tensor<1>]) -> Vec<bool> {
    per_tensor(tensors, |_, t| (t.clone() - t).sum(), f32::is_nan)
}

/// For each tensor, whether `test` holds for the one-element `reduce` of it (tensor `i`, in
/// f32), the reductions of all of them read back to the host at once; false for an empty one.
fn per_tensor(
    tensors: &[Tensor<1>],
    reduce: impl Fn(usize, Tensor<1>) -> Tensor<1>,
    test: impl Fn(f32) -> bool,
) -> Vec<bool> {
    let scalars: Vec<Tensor<1>> = (tensors.iter().enumerate())
        .filter(|(_, t)| t.dims()[0] > 0)
        .map(|(i, t)| reduce(i, t.clone().cast(FloatDType::F32)))
        .collect();
    let values = match scalars.is_empty() {
        true => Vec::new(),
        false => to_vec(&Tensor::cat(scalars, 0)),
    };
    let mut values = values.into_iter();
    tensors
        .iter()
        .map(|t| t.dims()[0] > 0 && values.next().is_some_and(&test))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn flatten_round_trips() {
        let d = Device::flex();
        let ts = vec![
            Tensor::<1>::from_floats([1.0, 2.0], &d),
            Tensor::<1>::from_floats([3.0], &d),
        ];
        let flat = flatten(ts.clone(), &[]);
        assert_eq!(flat, [1.0, 2.0, 3.0]);
        let back = split(&flat, [2, 1], &d);
        assert_eq!(flatten(back.clone(), &[4.0]), [1.0, 2.0, 3.0, 4.0]);
        let half = vec![ts[0].clone().cast(FloatDType::BF16)];
        assert_eq!(flatten(half, &[]), [1.0, 2.0], "bf16 widened");
        assert_ne!(params_checksum(&ts), params_checksum(&back[..1]));
        let taken = into_vec(ts[0].clone().cast(FloatDType::BF16));
        assert_eq!(taken, [1.0, 2.0], "bf16 taken widened");
        assert_eq!(to_vec(&from_vec(vec![5.0, 6.0], &d)), [5.0, 6.0]);
    }

    #[test]
    fn non_finite_values_are_found_per_tensor() {
        let d = Device::flex();
        let ts = vec![
            Tensor::<1>::from_floats([1.0, f32::MAX, -3.0], &d),
            Tensor::<1>::from_floats([0.0, f32::NAN], &d),
            Tensor::<1>::empty([0], &d),
            Tensor::<1>::from_floats([f32::NEG_INFINITY], &d),
            Tensor::<1>::from_floats([f32::INFINITY, 2.0], &d).cast(FloatDType::BF16),
        ];
        assert_eq!(nonfinite_tensors(&ts), [false, true, false, true, true]);
        assert!(nonfinite_tensors(&[]).is_empty());
    }
}

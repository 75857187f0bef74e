//! The self-check harness: a kernel against its composed twin on a device, values and every
//! gradient. Each op's folder holds its cases (`check`), [`super::selfcheck`] runs them all;
//! the CI tests run them on CubeCL's CPU runtime, and `kiln doctor --device DEV` on a user's
//! GPU (f32, and bf16 where the device has it) before a month-long run trusts the kernels there.
//!
//! In bf16 the inputs are drawn rounded to bf16, the kernel runs in bf16 and the reference is
//! the composed path in f32 on the same values, so the difference is the kernel's own rounding.

use burn::tensor::{Device, FloatDType, Tensor, TensorData, bf16};

/// One compared output or gradient.
#[derive(Debug, Clone)]
pub struct Check {
    /// The kernel and its shape.
    pub kernel: String,
    /// The output or the gradient compared.
    pub part: &'static str,
    /// How many values were compared.
    pub values: usize,
    /// Largest |kernel - reference| over the largest |reference|.
    pub rel_diff: f32,
    /// The most `rel_diff` may be.
    pub tolerance: f32,
}

impl Check {
    /// Whether the kernel agrees with its twin within the tolerance (NaN fails).
    pub fn passed(&self) -> bool {
        self.rel_diff <= self.tolerance
    }
}

/// The tolerance of `dtype`: f32 sums taken in another order, or bf16's own rounding of
/// outputs and gradients (8 bits of mantissa: half an ulp is 2^-9, 2.0e-3 of the largest
/// value; a few of those, as the inputs of a backward kernel are rounded too).
pub fn tolerance(dtype: FloatDType) -> f32 {
    match dtype {
        FloatDType::BF16 | FloatDType::F16 => 1e-2,
        _ => 2e-5,
    }
}

/// `n` fixed values in [-1, 1) from `seed` (a small LCG: they only need to be fixed and
/// spread out), rounded to bf16 when the check runs in bf16.
pub fn random(n: usize, seed: u64, dtype: FloatDType) -> Vec<f32> {
    let mut s = seed.wrapping_mul(6364136223846793005).wrapping_add(1);
    (0..n)
        .map(|_| {
            s = s
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            let v = ((s >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0;
            match dtype {
                FloatDType::BF16 => bf16::from_f32(v).to_f32(),
                _ => v,
            }
        })
        .collect()
}

/// A tensor's values on the host, as f32.
pub fn host<const D: usize>(t: &Tensor<D>) -> Vec<f32> {
    t.clone()
        .into_data()
        .convert::<f32>()
        .try_to_vec::<f32>()
        .unwrap_or_default()
}

/// Largest |a - b| relative to the largest |b| (NaN when they differ in length or `a` holds
/// a NaN). A reference that is exactly zero everywhere (attention's `dq` over a sequence of one:
/// a softmax over one key has no gradient) is compared in absolute terms, on the unit scale of
/// the checks' random inputs: relative to zero, any rounding would be infinitely wrong.
pub fn rel_diff(a: &[f32], b: &[f32]) -> f32 {
    if a.len() != b.len() {
        return f32::NAN;
    }
    let largest = b.iter().fold(0.0f32, |m, v| m.max(v.abs()));
    let scale = if largest == 0.0 { 1.0 } else { largest };
    let worst = a.iter().zip(b).fold(0.0f32, |m, (x, y)| {
        let d = (x - y).abs();
        if d.is_nan() || m.is_nan() {
            f32::NAN
        } else {
            m.max(d)
        }
    });
    worst / scale
}

/// One run of a check: the kernel (`fused`, in the check's type, on the device checked) or the
/// reference (composed, f32, on flex), making its inputs on `device`.
pub(in crate::kernels) struct Run<'a> {
    pub(in crate::kernels) device: &'a Device,
    pub(in crate::kernels) fused: bool,
    /// The check's type (the values are rounded to it either way).
    pub(in crate::kernels) dtype: FloatDType,
}

impl Run<'_> {
    /// The type this run computes in.
    pub(in crate::kernels) fn compute_dtype(&self) -> FloatDType {
        if self.fused {
            self.dtype
        } else {
            FloatDType::F32
        }
    }

    /// A tensor of `shape` with values from `seed`, untracked.
    pub(in crate::kernels) fn input<const D: usize>(
        &self,
        shape: [usize; D],
        seed: u64,
    ) -> Tensor<D> {
        let n = shape.iter().product();
        let data = TensorData::new(random(n, seed, self.dtype), shape);
        Tensor::<D>::from_data(data, &self.device.clone().autodiff()).cast(self.compute_dtype())
    }

    /// A tracked leaf of `shape` with values from `seed`.
    pub(in crate::kernels) fn leaf<const D: usize>(
        &self,
        shape: [usize; D],
        seed: u64,
    ) -> Tensor<D> {
        self.input(shape, seed).detach().require_grad()
    }
}

/// The output and the gradients of `sum(out * r)` (r fixed) with respect to `leaves`.
pub(in crate::kernels) fn values_and_grads<const D: usize>(
    run: &Run,
    out: Tensor<D>,
    leaves: &[Leaf],
) -> Vec<Vec<f32>> {
    // In the output's own type (the head's loss is f32 whatever its inputs' type).
    let r = run.input(out.dims(), 99).cast(out.dtype());
    let grads = (out.clone() * r).sum().backward();
    let mut all = vec![host(&out)];
    all.extend(leaves.iter().map(|leaf| leaf(&grads)));
    all
}

/// Reads one leaf's gradient.
pub(in crate::kernels) type Leaf = Box<dyn Fn(&burn::tensor::Gradients) -> Vec<f32>>;

pub(in crate::kernels) fn grad_of<const D: usize>(t: &Tensor<D>) -> Leaf {
    let t = t.clone();
    Box::new(move |grads| t.grad(grads).map(|g| host(&g)).unwrap_or_default())
}

/// The kernel run (`f` with `fused`) against the reference run: output first, then each
/// gradient, named by `parts`.
pub(in crate::kernels) fn compare(
    device: &Device,
    dtype: FloatDType,
    kernel: String,
    parts: &[&'static str],
    f: impl Fn(&Run) -> Vec<Vec<f32>>,
) -> Vec<Check> {
    // The reference runs on flex, in f32 on the host, whatever the kernel's device: a
    // device's own composed ops are no exact reference (burn's f32 matmuls on CUDA round like
    // TF32), and a device that computes wrong must not be checked against itself.
    let host = Device::flex();
    let run = |fused| {
        f(&Run {
            device: if fused { device } else { &host },
            fused,
            dtype,
        })
    };
    let (got, want) = (run(true), run(false));
    parts
        .iter()
        .enumerate()
        .map(|(i, &part)| {
            let (g, w) = (got.get(i).cloned(), want.get(i).cloned());
            let (g, w) = (g.unwrap_or_default(), w.unwrap_or_default());
            Check {
                kernel: kernel.clone(),
                part,
                values: w.len(),
                rel_diff: if w.is_empty() {
                    f32::NAN
                } else {
                    rel_diff(&g, &w)
                },
                tolerance: tolerance(dtype),
            }
        })
        .collect()
}

/// `checks` with `how` after each kernel's name (the same check on another path).
#[cfg(feature = "cube")]
pub(in crate::kernels) fn named(checks: Vec<Check>, how: &str) -> Vec<Check> {
    checks
        .into_iter()
        .map(|c| Check {
            kernel: format!("{} {how}", c.kernel),
            ..c
        })
        .collect()
}

//! Each fused kernel against its composed twin on a device, values and every gradient: the
//! CI tests run it on CubeCL's CPU runtime in f32, and `kiln doctor --device DEV` runs it on a
//! user's GPU (f32, and bf16 where the device has it) before a month-long run trusts the
//! kernels there.
//!
//! Shapes fill no tile: counts that are not multiples of the 128 units a cube runs, grouped-
//! query ratios 1, 2 and 3, sequences of 1, 7 and 13, the vocabulary in one chunk and in three.
//! In bf16 the inputs are drawn rounded to bf16, the kernel runs in bf16 and the reference is
//! the composed path in f32 on the same values, so the difference is the kernel's own rounding.

use super::composed;
use burn::tensor::{DType, Device, FloatDType, Int, Tensor, TensorData, bf16};

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

/// Every kernel's checks on `device` in `dtype`.
pub fn run(device: &Device, dtype: FloatDType) -> Vec<Check> {
    [
        linear,
        mixed_linear,
        rms_norm,
        swiglu,
        rope,
        causal_attention,
        causal_attention_rising,
        causal_attention_in_chunks,
        causal_attention_flash,
        linear_cross_entropy,
    ]
    .iter()
    .flat_map(|check| check(device, dtype))
    .collect()
}

/// [`run`] in f32 and in bf16, each named, or why a type is skipped: bf16 only where kiln has
/// bf16 kernels ([`super::has_bf16_kernels`]: CubeCL devices with the type), since elsewhere
/// bf16 takes the composed ops and there would be nothing to compare.
pub fn run_each_type(device: &Device) -> Vec<(&'static str, Result<Vec<Check>, &'static str>)> {
    let bf16 = match super::has_bf16_kernels(device) {
        true => Ok(run(device, FloatDType::BF16)),
        false => Err(
            "kiln's bf16 kernels run on CubeCL devices with bf16; this one takes the composed ops",
        ),
    };
    vec![("f32", Ok(run(device, FloatDType::F32))), ("bf16", bf16)]
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
struct Run<'a> {
    device: &'a Device,
    fused: bool,
    /// The check's type (the values are rounded to it either way).
    dtype: FloatDType,
}

impl Run<'_> {
    /// The type this run computes in.
    fn compute_dtype(&self) -> FloatDType {
        if self.fused {
            self.dtype
        } else {
            FloatDType::F32
        }
    }

    /// A tensor of `shape` with values from `seed`, untracked.
    fn input<const D: usize>(&self, shape: [usize; D], seed: u64) -> Tensor<D> {
        let n = shape.iter().product();
        let data = TensorData::new(random(n, seed, self.dtype), shape);
        Tensor::<D>::from_data(data, &self.device.clone().autodiff()).cast(self.compute_dtype())
    }

    /// A tracked leaf of `shape` with values from `seed`.
    fn leaf<const D: usize>(&self, shape: [usize; D], seed: u64) -> Tensor<D> {
        self.input(shape, seed).detach().require_grad()
    }
}

/// The output and the gradients of `sum(out * r)` (r fixed) with respect to `leaves`.
fn values_and_grads<const D: usize>(run: &Run, out: Tensor<D>, leaves: &[Leaf]) -> Vec<Vec<f32>> {
    // In the output's own type (the head's loss is f32 whatever its inputs' type).
    let r = run.input(out.dims(), 99).cast(out.dtype());
    let grads = (out.clone() * r).sum().backward();
    let mut all = vec![host(&out)];
    all.extend(leaves.iter().map(|leaf| leaf(&grads)));
    all
}

/// Reads one leaf's gradient.
type Leaf = Box<dyn Fn(&burn::tensor::Gradients) -> Vec<f32>>;

fn grad_of<const D: usize>(t: &Tensor<D>) -> Leaf {
    let t = t.clone();
    Box::new(move |grads| t.grad(grads).map(|g| host(&g)).unwrap_or_default())
}

/// The kernel run (`f` with `fused`) against the reference run: output first, then each
/// gradient, named by `parts`.
fn compare(
    device: &Device,
    dtype: FloatDType,
    kernel: String,
    parts: &[&'static str],
    f: impl Fn(&Run) -> Vec<Vec<f32>>,
) -> Vec<Check> {
    // The reference runs on flex, in f32 on the host, whatever the kernel's device: a
    // device's own composed ops are no exact reference (on an H200 the composed attention was
    // 2e-4 to 7e-4 off in f32, the size of TF32 rounding in burn's matmuls), and a device
    // that computes wrong must not be checked against itself.
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

/// The bias-free projection: 74 rows of 70 into 45 (partial tiles every way), and 3 rows of
/// 9 into 130 (a sequence of one; more outputs than a cube's 128 units).
pub fn linear(device: &Device, dtype: FloatDType) -> Vec<Check> {
    [([2, 37, 70], 45, 31), ([3, 1, 9], 130, 32)]
        .into_iter()
        .flat_map(|(shape, out, seed)| {
            let name = format!("linear {shape:?} x {out}");
            compare(device, dtype, name, &["y", "dx", "dw"], |r| {
                let (x, w) = (r.leaf(shape, seed), r.leaf([shape[2], out], seed + 10));
                let y = match r.fused {
                    true => super::linear(x.clone(), w.clone(), None),
                    false => burn::tensor::module::linear(x.clone(), w.clone(), None),
                };
                values_and_grads(r, y, &[grad_of(&x), grad_of(&w)])
            })
        })
        .collect()
}

/// Mixed precision's projection (`super::mixed_linear`) at [`linear`]'s shapes: `x` and `w` in
/// f32 (master weights, the residual stream) holding values of the check's type, the product
/// in that type written in f32, the gradients in f32.
pub fn mixed_linear(device: &Device, dtype: FloatDType) -> Vec<Check> {
    [([2, 37, 70], 45, 33), ([3, 1, 9], 130, 34)]
        .into_iter()
        .flat_map(|(shape, out, seed)| {
            let name = format!("mixed_linear {shape:?} x {out}");
            compare(device, dtype, name, &["y", "dx", "dw"], |r| {
                let x = r.input(shape, seed).cast(FloatDType::F32);
                let w = r.input([shape[2], out], seed + 10).cast(FloatDType::F32);
                let (x, w) = (x.detach().require_grad(), w.detach().require_grad());
                let y = match r.fused {
                    true => super::mixed_linear(x.clone(), w.clone(), r.dtype.into(), DType::F32),
                    false => burn::tensor::module::linear(x.clone(), w.clone(), None),
                };
                values_and_grads(r, y, &[grad_of(&x), grad_of(&w)])
            })
        })
        .collect()
}

/// RMSNorm: 3 x 5 rows of 24, and 130 rows of 7 (one cube and a bit for per-row units).
pub fn rms_norm(device: &Device, dtype: FloatDType) -> Vec<Check> {
    [([3, 5, 24], 1), ([2, 65, 7], 2)]
        .into_iter()
        .flat_map(|(shape, seed)| {
            compare(
                device,
                dtype,
                format!("rms_norm {shape:?}"),
                &["y", "dx", "dw"],
                |r| {
                    let (x, w) = (r.leaf(shape, seed), r.leaf([shape[2]], seed + 10));
                    let y = match r.fused {
                        true => super::rms_norm(x.clone(), w.clone(), 1e-5),
                        false => composed::rms_norm(x.clone(), w.clone(), 1e-5),
                    };
                    values_and_grads(r, y, &[grad_of(&x), grad_of(&w)])
                },
            )
        })
        .collect()
}

/// SwiGLU over 231 elements: one full cube and a partial one.
pub fn swiglu(device: &Device, dtype: FloatDType) -> Vec<Check> {
    compare(
        device,
        dtype,
        "swiglu".into(),
        &["y", "dgate", "dup"],
        |r| {
            let (g, u) = (r.leaf([3, 7, 11], 3), r.leaf([3, 7, 11], 4));
            let y = match r.fused {
                true => super::swiglu(g.clone(), u.clone()),
                false => composed::swiglu(g.clone(), u.clone()),
            };
            values_and_grads(r, y, &[grad_of(&g), grad_of(&u)])
        },
    )
}

/// RoPE with the head transpose: batch 2, 5 positions, 3 heads of 8.
pub fn rope(device: &Device, dtype: FloatDType) -> Vec<Check> {
    let (b, t, heads, hd) = (2, 5, 3, 8);
    compare(device, dtype, "rope".into(), &["y", "dx"], |r| {
        let x = r.leaf([b, t, heads * hd], 5);
        let angles = |f: fn(f32) -> f32| {
            let v: Vec<f32> = (0..t * hd)
                .map(|i| f((i / hd) as f32 * 0.3 / (1 + i % (hd / 2)) as f32))
                .collect();
            let data = TensorData::new(v, [t, hd]);
            Tensor::<2>::from_data(data, &x.device()).cast(r.compute_dtype())
        };
        let (cos, sin) = (angles(f32::cos), angles(f32::sin));
        let y = match r.fused {
            true => super::rope(x.clone(), cos, sin, heads),
            false => composed::rope(x.clone(), cos, sin, heads),
        };
        values_and_grads(r, y, &[grad_of(&x)])
    })
}

/// Causal attention, (batch, K/V heads, query heads a K/V head, length, head dim): grouped
/// (2 query heads a K/V head) and not, a length that is a multiple of nothing, a sequence of
/// one with 3 query heads a K/V head, and 70 positions: more than one block of query rows (a
/// block crossing from one query head into the next) and three tiles of keys, the last
/// partial.
pub fn causal_attention(device: &Device, dtype: FloatDType) -> Vec<Check> {
    attention_checks(
        device,
        dtype,
        &[
            (2, 2, 2, 7, 8),
            (1, 3, 1, 13, 4),
            (2, 1, 3, 1, 8),
            (1, 2, 2, 70, 4),
        ],
    )
}

/// Causal attention at the head dimensions of real models (64 and 128) and lengths past one
/// 64-row block (150, and 80 with 4 query heads a K/V head): the flash kernels' many-fragment
/// products and partial blocks and tiles.
pub fn causal_attention_wide(device: &Device, dtype: FloatDType) -> Vec<Check> {
    attention_checks(device, dtype, &[(1, 2, 2, 150, 128), (1, 1, 4, 80, 64)])
}

/// Causal attention whose scores rise along the sequence: queries times 4 and keys times 1, 2,
/// 4 and 8 by blocks of 32 positions (powers of two, exact in every type), so a row's running
/// max rises by more than the flash forward's rescale gap from one tile of keys to the next
/// (the scores reach about 30): the pass that rescales the output accumulator, which inputs
/// on the unit scale never take. At 100 positions, head dimension 8 (CPU's tiles) and 150,
/// 64 (GPUs').
pub fn causal_attention_rising(device: &Device, dtype: FloatDType) -> Vec<Check> {
    let shapes = [(1, 2, 2, 100, 8), (1, 1, 2, 150, 64)];
    shapes
        .iter()
        .flat_map(|&shape| attention_check(device, dtype, shape, true))
        .collect()
}

/// Attention at each `(b, kv, groups, t, hd)` against the composed attention.
fn attention_checks(
    device: &Device,
    dtype: FloatDType,
    shapes: &[(usize, usize, usize, usize, usize)],
) -> Vec<Check> {
    shapes
        .iter()
        .flat_map(|&shape| attention_check(device, dtype, shape, false))
        .collect()
}

/// Attention at `(b, kv, groups, t, hd)` against the composed attention, with scores rising
/// along the sequence when `rising` ([`causal_attention_rising`]).
fn attention_check(
    device: &Device,
    dtype: FloatDType,
    (b, kv, groups, t, hd): (usize, usize, usize, usize, usize),
    rising: bool,
) -> Vec<Check> {
    let how = if rising { " rising" } else { "" };
    let name = format!("attention{how} b{b} kv{kv} g{groups} t{t} hd{hd}");
    compare(device, dtype, name, &["out", "dq", "dk", "dv"], |r| {
        let q = r.leaf([b, kv, groups * t, hd], 6);
        let k = r.leaf([b, kv, t, hd], 7);
        let v = r.leaf([b, t, kv * hd], 8);
        let (qa, ka) = match rising {
            true => {
                let ramp: Vec<f32> = (0..t).map(|p| (1 << (p / 32).min(3)) as f32).collect();
                let ramp = Tensor::<4>::from_data(
                    TensorData::new(ramp, [1, 1, t, 1]),
                    &r.device.clone().autodiff(),
                )
                .cast(r.compute_dtype());
                (q.clone() * 4.0, k.clone() * ramp)
            }
            false => (q.clone(), k.clone()),
        };
        let scale = 1.0 / (hd as f64).sqrt();
        let out = match r.fused {
            true => super::causal_attention(qa, ka, v.clone(), scale),
            false => composed::causal_attention(qa, ka, v.clone(), scale),
        };
        values_and_grads(r, out, &[grad_of(&q), grad_of(&k), grad_of(&v)])
    })
}

/// [`causal_attention`] and [`causal_attention_wide`] by the flash kernels on GPUs in bf16
/// and f16 (their tile products on the tensor cores, which take those types only; elsewhere
/// attention takes its default path, and CubeCL's CPU runtime runs these kernels' unit-by-unit
/// products only in its tests, which set that themselves).
pub fn causal_attention_flash(device: &Device, dtype: FloatDType) -> Vec<Check> {
    #[cfg(feature = "cube")]
    if super::cube::on_gpu(device) && matches!(dtype, FloatDType::BF16 | FloatDType::F16) {
        super::cube::flash::set_gpu(true);
        let mut checks = causal_attention(device, dtype);
        checks.extend(causal_attention_wide(device, dtype));
        checks.extend(causal_attention_rising(device, dtype));
        super::cube::flash::set_gpu(false);
        return named(checks, "flash");
    }
    let _ = (device, dtype);
    Vec::new()
}

/// `checks` with `how` after each kernel's name (the same check on another path).
#[cfg(feature = "cube")]
fn named(checks: Vec<Check>, how: &str) -> Vec<Check> {
    checks
        .into_iter()
        .map(|c| Check {
            kernel: format!("{} {how}", c.kernel),
            ..c
        })
        .collect()
}

/// [`causal_attention`] by products in chunks of 3 positions, on GPUs (where attention goes
/// by products): the chunk loop a long sequence takes (the shorter shapes fit one chunk
/// there), its `dk` and `dv` summed over chunks. Nothing elsewhere: CubeCL's CPU runtime keeps
/// its row kernels (its tests set the chunks themselves).
pub fn causal_attention_in_chunks(device: &Device, dtype: FloatDType) -> Vec<Check> {
    #[cfg(feature = "cube")]
    if super::cube::on_gpu(device) {
        super::set_attention_product_chunk(3);
        let checks = causal_attention(device, dtype);
        super::set_attention_product_chunk(0);
        return named(checks, "in chunks of 3");
    }
    let _ = (device, dtype);
    Vec::new()
}

/// The output head with cross-entropy: 37 rows, vocabulary 300, in one chunk and in chunks
/// of 128, 128 and 44 columns, with targets in each.
pub fn linear_cross_entropy(device: &Device, dtype: FloatDType) -> Vec<Check> {
    let (n, d, vocab) = (37, 16, 300);
    let ids: Vec<i64> = (0..n).map(|i| ((i * 89 + 7) % vocab) as i64).collect();
    [None, Some(128)]
        .into_iter()
        .flat_map(|columns| {
            let name = format!("cross_entropy columns {columns:?}");
            compare(device, dtype, name, &["loss", "dh", "dw"], |r| {
                let (h, w) = (r.leaf([n, d], 21), r.leaf([d, vocab], 22));
                let targets =
                    Tensor::<1, Int>::from_data(TensorData::new(ids.clone(), [n]), &h.device());
                let loss = match (r.fused, columns) {
                    (true, Some(c)) => {
                        super::linear_cross_entropy_in_chunks(h.clone(), w.clone(), targets, c)
                    }
                    (true, None) => super::linear_cross_entropy(h.clone(), w.clone(), targets),
                    (false, _) => composed::linear_cross_entropy(h.clone(), w.clone(), targets),
                };
                values_and_grads(r, loss, &[grad_of(&h), grad_of(&w)])
            })
        })
        .collect()
}

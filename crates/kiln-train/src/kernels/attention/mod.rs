//! Causal grouped-query attention, `softmax(q k^T * scale, causal) v`, with the query heads
//! that share a K/V head stacked along the sequence ([`dims`] has the layouts). A CPU kernel
//! ([`cpu`]) and on CubeCL devices three paths ([`cube`]: row kernels, products, flash
//! kernels), each forward and backward; [`causal_attention`] is the one place a path is
//! chosen, the composed twin ([`composed`]) what they are checked against, with the
//! self-check cases.

pub(super) mod composed;
mod cpu;
#[cfg(feature = "cube")]
pub(in crate::kernels) mod cube;
pub(in crate::kernels) mod dims;

use super::check::{Check, compare, grad_of, values_and_grads};
use super::coverage::{self, Route};
use super::settings::{self, Settings};
use burn::tensor::{Device, FloatDType, Tensor, TensorData};
#[cfg(feature = "cube")]
use {crate::config::AttentionPath, dims::Dims};

/// Causal grouped-query attention for `q` `[b, kv, groups * t, hd]`, `k` `[b, kv, t, hd]` and
/// `v` `[b, t, kv * hd]`; returns `[b, t, heads * hd]`. On CubeCL devices by the path
/// `kernels.attention` asks for, on flex by the CPU kernel, by the composed ops where neither
/// covers the tensors.
pub fn causal_attention(q: Tensor<4>, k: Tensor<4>, v: Tensor<3>, scale: f64) -> Tensor<3> {
    causal_attention_with(&settings::current(), q, k, v, scale)
}

/// [`causal_attention`] under `s`: the one place attention's implementation is chosen.
#[cfg_attr(not(feature = "cube"), allow(unused_variables))]
fn causal_attention_with(
    s: &Settings,
    q: Tensor<4>,
    k: Tensor<4>,
    v: Tensor<3>,
    scale: f64,
) -> Tensor<3> {
    match coverage::route(&q, &[k.dtype(), v.dtype()]) {
        #[cfg(feature = "cube")]
        Route::Device(device) => {
            let path = device_path(s, &device, &q, &k);
            cube::causal_attention(q, k, v, scale, path)
        }
        Route::Host => cpu::causal_attention(q, k, v, scale),
        Route::Composed => composed::causal_attention(q, k, v, scale),
    }
}

/// Attention's path on the CubeCL device `device` under `s`: the flash kernels where asked for
/// and they can run there; the row kernels where asked for, and by default on CubeCL's CPU
/// runtime; else (by default on GPUs) by products.
#[cfg(feature = "cube")]
fn device_path(s: &Settings, device: &cubecl::Device, q: &Tensor<4>, k: &Tensor<4>) -> cube::Path {
    let hd = Dims::from_shapes(&q.dims(), &k.dims()).hd;
    let flash = match s.attention {
        AttentionPath::Flash => cube::Path::flash(device, q.dtype(), hd, s.flash_tiling),
        _ => None,
    };
    let on_cpu = matches!(device, cubecl::Device::Cpu(_));
    match (flash, s.attention) {
        (Some(flash), _) => flash,
        (None, AttentionPath::Rows) => cube::Path::rows(device, s.attention_rows),
        (None, AttentionPath::Auto | AttentionPath::Flash) if on_cpu => {
            cube::Path::rows(device, s.attention_rows)
        }
        (None, _) => cube::Path::products(s.attention_chunk),
    }
}

/// Attention against [`composed`] on `device`, (batch, K/V heads, query heads a K/V head,
/// length, head dim): grouped (2 query heads a K/V head) and not, a length that is a multiple
/// of nothing, a sequence of one with 3 query heads a K/V head, and 70 positions: more than
/// one block of query rows (a block crossing from one query head into the next) and three
/// tiles of keys, the last partial.
pub fn check(device: &Device, dtype: FloatDType) -> Vec<Check> {
    checks(&settings::current(), device, dtype)
}

/// [`check`] under `s`.
fn checks(s: &Settings, device: &Device, dtype: FloatDType) -> Vec<Check> {
    let shapes = [
        (2, 2, 2, 7, 8),
        (1, 3, 1, 13, 4),
        (2, 1, 3, 1, 8),
        (1, 2, 2, 70, 4),
    ];
    shapes
        .iter()
        .flat_map(|&shape| attention_check(s, device, dtype, shape, false))
        .collect()
}

/// Attention at the head dimensions of real models (64 and 128) and lengths past one 64-row
/// block (150, and 80 with 4 query heads a K/V head): the flash kernels' many-fragment
/// products and partial blocks and tiles.
pub fn check_wide(device: &Device, dtype: FloatDType) -> Vec<Check> {
    checks_wide(&settings::current(), device, dtype)
}

/// [`check_wide`] under `s`.
fn checks_wide(s: &Settings, device: &Device, dtype: FloatDType) -> Vec<Check> {
    [(1, 2, 2, 150, 128), (1, 1, 4, 80, 64)]
        .iter()
        .flat_map(|&shape| attention_check(s, device, dtype, shape, false))
        .collect()
}

/// Attention whose scores rise along the sequence: queries times 4 and keys times 1, 2, 4 and
/// 8 by blocks of 32 positions (powers of two, exact in every type), so a row's running max
/// rises by more than the flash forward's rescale gap from one tile of keys to the next (the
/// scores reach about 30): the pass that rescales the output accumulator, which inputs on the
/// unit scale never take. At 100 positions, head dimension 8 (CPU's tiles) and 150, 64 (GPUs').
pub fn check_rising(device: &Device, dtype: FloatDType) -> Vec<Check> {
    checks_rising(&settings::current(), device, dtype)
}

/// [`check_rising`] under `s`.
fn checks_rising(s: &Settings, device: &Device, dtype: FloatDType) -> Vec<Check> {
    [(1, 2, 2, 100, 8), (1, 1, 2, 150, 64)]
        .iter()
        .flat_map(|&shape| attention_check(s, device, dtype, shape, true))
        .collect()
}

/// [`check`], [`check_wide`] and [`check_rising`] by the flash kernels on GPUs in bf16 and
/// f16 (their tile products on the tensor cores, which take those types only; elsewhere
/// attention takes its default path, and CubeCL's CPU runtime runs these kernels' unit-by-unit
/// products only in its tests, which ask for them themselves).
pub fn check_flash(device: &Device, dtype: FloatDType) -> Vec<Check> {
    #[cfg(feature = "cube")]
    if coverage::on_gpu(device) && matches!(dtype, FloatDType::BF16 | FloatDType::F16) {
        let s = Settings {
            attention: AttentionPath::Flash,
            ..(*settings::current()).clone()
        };
        let mut all = checks(&s, device, dtype);
        all.extend(checks_wide(&s, device, dtype));
        all.extend(checks_rising(&s, device, dtype));
        return super::check::named(all, "flash");
    }
    let _ = (device, dtype);
    Vec::new()
}

/// [`check`] by products in chunks of 3 positions, on GPUs (where attention goes by products):
/// the chunk loop a long sequence takes (the shorter shapes fit one chunk there), its `dk` and
/// `dv` summed over chunks. Nothing elsewhere: CubeCL's CPU runtime keeps its row kernels (its
/// tests ask for the chunks themselves).
pub fn check_in_chunks(device: &Device, dtype: FloatDType) -> Vec<Check> {
    #[cfg(feature = "cube")]
    if coverage::on_gpu(device) {
        let s = Settings {
            attention: AttentionPath::Products,
            attention_chunk: 3,
            ..(*settings::current()).clone()
        };
        return super::check::named(checks(&s, device, dtype), "in chunks of 3");
    }
    let _ = (device, dtype);
    Vec::new()
}

/// Attention under `s` at `(b, kv, groups, t, hd)` against [`composed`], with scores rising
/// along the sequence when `rising` ([`check_rising`]).
fn attention_check(
    s: &Settings,
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
            true => causal_attention_with(s, qa, ka, v.clone(), scale),
            false => composed::causal_attention(qa, ka, v.clone(), scale),
        };
        values_and_grads(r, out, &[grad_of(&q), grad_of(&k), grad_of(&v)])
    })
}

#[cfg(test)]
mod tests {
    use crate::kernels::tests::{against_composed, random};
    use burn::tensor::Tensor;

    #[test]
    fn causal_attention_matches_composed() {
        // t = 150 (two blocks of query rows, the second partial), 3 query heads per kv head
        let (b, kv, g, t, hd) = (2, 2, 3, 150, 16);
        let q = random(b * kv * g * t * hd, 18, 1.5);
        let k = random(b * kv * t * hd, 19, 1.5);
        let v = random(b * t * kv * hd, 20, 1.0);
        let shaped = move |x: &[Tensor<4>]| {
            (
                x[0].clone(),
                x[1].clone(),
                x[2].clone().reshape([b, t, kv * hd]),
            )
        };
        let out = move |y: Tensor<3>| y.reshape([b, t, kv * g, hd]);
        against_composed::<3, 4>(
            [
                (&q, vec![b, kv, g * t, hd]),
                (&k, vec![b, kv, t, hd]),
                (&v, vec![b, t, kv, hd]),
            ],
            |x| {
                let (q, k, v) = shaped(x);
                out(super::causal_attention(q, k, v, 0.25))
            },
            |x| {
                let (q, k, v) = shaped(x);
                out(super::composed::causal_attention(q, k, v, 0.25))
            },
            2e-6,
        );
    }
}

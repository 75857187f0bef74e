//! kiln's CubeCL kernels (src/kernels/cube) against their composed twins, values and
//! gradients, on CubeCL's CPU runtime (device `cubecl-cpu`): the same kernel source the GPU
//! runtimes compile. Shapes cover partial cubes (counts that are not multiples of the 128
//! units a cube runs), grouped-query ratios 1 and 2, a sequence of one and sequence lengths
//! that are multiples of nothing. Tolerance: 2e-5 of the largest reference value, for f32 sums
//! taken in another order (the composed path reduces through burn's matmul and reduce
//! kernels). Built only with the `cubecl-cpu` feature.
#![cfg(feature = "cubecl-cpu")]

mod common;

use burn::tensor::{Device, Tensor, TensorData};
use common::{host, random, rel_diff};
use kiln_train::kernels::{self, composed};

const TOLERANCE: f32 = 2e-5;

fn device() -> Device {
    kiln_train::session::parse_device("cubecl-cpu").unwrap()
}

/// A tracked leaf of `shape` with values from `seed`, on the autodiff device.
fn leaf<const D: usize>(shape: [usize; D], seed: u64) -> Tensor<D> {
    let n = shape.iter().product();
    Tensor::<D>::from_data(
        TensorData::new(random(n, seed), shape),
        &device().autodiff(),
    )
    .require_grad()
}

/// The output and the gradients of `sum(out * r)` (r fixed) with respect to `leaves`.
fn values_and_grads<const D: usize>(out: Tensor<D>, leaves: Vec<Grad>) -> Vec<Vec<f32>> {
    let r = Tensor::<D>::from_data(
        TensorData::new(random(out.shape().num_elements(), 99), out.shape()),
        &out.device(),
    );
    let grads = (out.clone() * r).sum().backward();
    let mut all = vec![host(&out)];
    all.extend(leaves.iter().map(|g| g(&grads)));
    all
}

/// Reads one leaf's gradient.
type Grad = Box<dyn Fn(&burn::tensor::Gradients) -> Vec<f32>>;

fn grad_of<const D: usize>(t: &Tensor<D>) -> Grad {
    let t = t.clone();
    Box::new(move |grads| host(&t.grad(grads).expect("leaf has a gradient")))
}

/// Compares the kernel run (`f(true)`) with the composed run (`f(false)`): output first, then
/// each gradient, named by `parts`.
fn compare(name: &str, parts: &[&str], f: impl Fn(bool) -> Vec<Vec<f32>>) {
    let (got, want) = (f(true), f(false));
    assert_eq!(got.len(), parts.len(), "{name}: parts");
    for ((g, w), part) in got.iter().zip(&want).zip(parts) {
        let d = rel_diff(g, w);
        eprintln!(
            "{name} {part}: relative difference {d:.2e} over {} values",
            g.len()
        );
        assert!(d <= TOLERANCE, "{name} {part}: {d:e} > {TOLERANCE:e}");
    }
}

#[test]
fn rms_norm_matches_composed() {
    // 3 x 5 rows of 24 and 130 rows of 7 (one cube and a bit for the per-row units).
    for (shape, seed) in [([3, 5, 24], 1), ([2, 65, 7], 2)] {
        compare(
            &format!("rms_norm {shape:?}"),
            &["y", "dx", "dw"],
            |fused| {
                let x = leaf(shape, seed);
                let w = leaf([shape[2]], seed + 10);
                let y = if fused {
                    kernels::rms_norm(x.clone(), w.clone(), 1e-5)
                } else {
                    composed::rms_norm(x.clone(), w.clone(), 1e-5)
                };
                values_and_grads(y, vec![grad_of(&x), grad_of(&w)])
            },
        );
    }
}

#[test]
fn swiglu_matches_composed() {
    // 231 elements: one full cube and a partial one.
    compare("swiglu", &["y", "dgate", "dup"], |fused| {
        let (g, u) = (leaf([3, 7, 11], 3), leaf([3, 7, 11], 4));
        let y = if fused {
            kernels::swiglu(g.clone(), u.clone())
        } else {
            composed::swiglu(g.clone(), u.clone())
        };
        values_and_grads(y, vec![grad_of(&g), grad_of(&u)])
    });
}

#[test]
fn rope_matches_composed() {
    let (b, t, heads, hd) = (2, 5, 3, 8);
    compare("rope", &["y", "dx"], |fused| {
        let x = leaf([b, t, heads * hd], 5);
        let angles = |f: fn(f32) -> f32| {
            let v: Vec<f32> = (0..t * hd)
                .map(|i| f((i / hd) as f32 * 0.3 / (1 + i % (hd / 2)) as f32))
                .collect();
            Tensor::<2>::from_data(TensorData::new(v, [t, hd]), &x.device())
        };
        let (cos, sin) = (angles(f32::cos), angles(f32::sin));
        let y = if fused {
            kernels::rope(x.clone(), cos, sin, heads)
        } else {
            composed::rope(x.clone(), cos, sin, heads)
        };
        values_and_grads(y, vec![grad_of(&x)])
    });
}

#[test]
fn causal_attention_matches_composed() {
    // (b, kv heads, groups, t, hd): grouped (2 query heads a K/V head) and not, a sequence of
    // one, and a length that is a multiple of nothing.
    for (b, kv, groups, t, hd) in [(2, 2, 2, 7, 8), (1, 3, 1, 13, 4), (2, 1, 3, 1, 8)] {
        let name = format!("attention b{b} kv{kv} g{groups} t{t} hd{hd}");
        compare(&name, &["out", "dq", "dk", "dv"], |fused| {
            let q = leaf([b, kv, groups * t, hd], 6);
            let k = leaf([b, kv, t, hd], 7);
            let v = leaf([b, t, kv * hd], 8);
            let scale = 1.0 / (hd as f64).sqrt();
            let out = if fused {
                kernels::causal_attention(q.clone(), k.clone(), v.clone(), scale)
            } else {
                composed::causal_attention(q.clone(), k.clone(), v.clone(), scale)
            };
            values_and_grads(out, vec![grad_of(&q), grad_of(&k), grad_of(&v)])
        });
    }
}

#[test]
fn adamw_update_matches_the_formula() {
    use kiln_train::kernels::{adamw::AdamWScalars, adamw_update as update};
    // 300 elements (two full cubes and a partial one), clipping and decay on.
    let n = 300;
    let (p, g, m, v) = (random(n, 11), random(n, 12), random(n, 13), random(n, 14));
    let v: Vec<f32> = v.iter().map(|x| x.abs()).collect();
    let s = AdamWScalars {
        grad_scale: Some(0.5),
        b1: (0.9, 0.1),
        b2: (0.95, 0.05),
        decay: Some(0.999),
        bc2_sqrt: 0.3,
        eps: 1e-8,
        step_size: 0.01,
    };
    let on_device = |x: &[f32]| Tensor::<1>::from_data(TensorData::new(x.to_vec(), [n]), &device());
    let Ok((p2, m2, v2)) = update(
        on_device(&p),
        on_device(&g),
        on_device(&m),
        on_device(&v),
        &s,
    ) else {
        panic!("the device update did not cover f32 device tensors");
    };
    let mut want = (vec![], vec![], vec![]);
    for i in 0..n {
        let gi = g[i] as f64 * 0.5;
        let mi = m[i] as f64 * 0.9 + gi * 0.1;
        let vi = v[i] as f64 * 0.95 + gi * gi * 0.05;
        let pi = p[i] as f64 * 0.999 - mi / (vi.sqrt() / 0.3 + 1e-8) * 0.01;
        want.0.push(pi as f32);
        want.1.push(mi as f32);
        want.2.push(vi as f32);
    }
    for (name, got, want) in [("p", p2, want.0), ("m", m2, want.1), ("v", v2, want.2)] {
        let d = rel_diff(&host(&got), &want);
        eprintln!("adamw {name}: relative difference {d:.2e}");
        assert!(d <= 1e-6, "adamw {name}: {d:e}");
    }
}

#[test]
fn gradient_norm_is_the_formula_and_the_same_bits_every_time() {
    // Sizes for one pass (1, 63, 65), two (5000: 79 partials, then 2) and three (300 000:
    // 4688, then 74, then 2), and an empty piece (a rank's share of nothing).
    let sizes = [1usize, 63, 65, 0, 5000, 300_000];
    let data: Vec<Vec<f32>> = (0..sizes.len())
        .map(|i| random(sizes[i], 40 + i as u64))
        .collect();
    let tensors: Vec<Tensor<1>> = data
        .iter()
        .map(|x| Tensor::<1>::from_data(TensorData::new(x.clone(), [x.len()]), &device()))
        .collect();
    let want: f64 = data
        .iter()
        .flatten()
        .map(|&x| f64::from(x) * f64::from(x))
        .sum();
    let got = kernels::device_square_sum(&tensors).expect("f32 device tensors are covered");
    let d = ((got - want) / want).abs();
    eprintln!(
        "square sum: relative difference {d:.2e} over {} values",
        sizes.iter().sum::<usize>()
    );
    assert!(d <= 1e-6, "square sum {got} against {want}");
    for _ in 0..3 {
        let again = kernels::device_square_sum(&tensors).expect("covered");
        assert_eq!(
            again.to_bits(),
            got.to_bits(),
            "the sum changed between calls"
        );
    }
    let norm = kiln_train::optim::global_norm(&tensors);
    assert_eq!(
        norm,
        got.sqrt() as f32,
        "global_norm takes the fixed-order sum on devices"
    );
}

#[test]
fn linear_cross_entropy_matches_composed_in_one_chunk_and_in_three() {
    use burn::tensor::Int;
    // 37 rows, vocab 300: one chunk, or chunks of 128, 128 and 44 columns, with targets in
    // each of them.
    let (n, d, vocab) = (37, 16, 300);
    let ids: Vec<i64> = (0..n).map(|i| ((i * 89 + 7) % vocab) as i64).collect();
    for columns in [None, Some(128)] {
        compare(
            &format!("cross_entropy {columns:?}"),
            &["loss", "dh", "dw"],
            |fused| {
                let h = leaf([n, d], 21);
                let w = leaf([d, vocab], 22);
                let targets =
                    Tensor::<1, Int>::from_data(TensorData::new(ids.clone(), [n]), &h.device());
                let loss = match (fused, columns) {
                    (true, Some(c)) => {
                        kernels::linear_cross_entropy_in_chunks(h.clone(), w.clone(), targets, c)
                    }
                    (true, None) => kernels::linear_cross_entropy(h.clone(), w.clone(), targets),
                    (false, _) => composed::linear_cross_entropy(h.clone(), w.clone(), targets),
                };
                values_and_grads(loss, vec![grad_of(&h), grad_of(&w)])
            },
        );
    }
}

/// Muon's arithmetic on replicated state: the fixed-kernel matmul agrees with burn's
/// autotuned one (shapes that fill no tile: 7x13 @ 13x5, and a transposed view as Newton-Schulz
/// passes it), and the Frobenius norm stays on the device, equals the f64 formula and keeps
/// its bits from call to call.
#[test]
fn replicated_matmul_and_frobenius_norm_match_burn() {
    let on_device = |x: Vec<f32>, shape: [usize; 2]| {
        Tensor::<2>::from_data(TensorData::new(x, shape), &device())
    };
    let a = on_device(random(7 * 13, 81), [7, 13]);
    let b = on_device(random(13 * 5, 82), [13, 5]);
    for (name, got, want) in [
        (
            "a @ b",
            kernels::replicated_matmul(a.clone(), b.clone()),
            a.clone().matmul(b.clone()),
        ),
        (
            "a @ a^T",
            kernels::replicated_matmul(a.clone(), a.clone().transpose()),
            a.clone().matmul(a.clone().transpose()),
        ),
    ] {
        let d = rel_diff(&host(&got), &host(&want));
        eprintln!("replicated matmul {name}: relative difference {d:.2e}");
        assert_eq!(got.dims(), want.dims());
        assert!(d <= TOLERANCE, "{name}: {d:e}");
    }
    let x = random(7 * 13, 81);
    let want = x
        .iter()
        .map(|&v| f64::from(v) * f64::from(v))
        .sum::<f64>()
        .sqrt();
    let norm = kernels::frobenius_norm(&a);
    assert_eq!(norm.dims(), [1]);
    let got = host(&norm)[0];
    assert!(
        ((f64::from(got) - want) / want).abs() <= 1e-6,
        "{got} vs {want}"
    );
    assert_eq!(
        host(&kernels::frobenius_norm(&a))[0].to_bits(),
        got.to_bits()
    );
}

/// NCCL is for CUDA devices only: on this device the gradients stay host-staged.
#[test]
fn nccl_joins_only_on_cuda_devices() {
    let joined = kiln_train::nccl::Nccl::join(&kiln_dist::Solo, &device());
    assert!(matches!(joined, Ok(None)), "NCCL joined on cubecl-cpu");
}

/// With a CUDA GPU (skipped, reason printed, without one): NCCL joins a one-rank
/// communicator, reduces gradients of several sizes in one flat device buffer and hands each
/// back unchanged (the mean over one rank), views of the right lengths and values.
#[cfg(feature = "cuda")]
#[test]
fn nccl_on_one_cuda_rank_hands_the_gradients_back() {
    let gpu = std::process::Command::new("nvidia-smi")
        .arg("-L")
        .output()
        .is_ok_and(|o| o.status.success() && o.stdout.starts_with(b"GPU "));
    if !gpu {
        eprintln!("skipped: no CUDA GPU here (nvidia-smi -L)");
        return;
    }
    let cuda = kiln_train::session::parse_device("cuda").unwrap();
    let nccl = kiln_train::nccl::Nccl::join(&kiln_dist::Solo, &cuda)
        .expect("NCCL joins")
        .expect("a CUDA device joins NCCL");
    let data: Vec<Vec<f32>> = [1usize, 300, 4097]
        .iter()
        .enumerate()
        .map(|(i, &n)| random(n, 70 + i as u64))
        .collect();
    let grads = data
        .iter()
        .map(|x| Tensor::<1>::from_data(TensorData::new(x.clone(), [x.len()]), &cuda))
        .collect();
    let back = nccl.mean(grads).expect("all-reduce");
    for (got, want) in back.iter().zip(&data) {
        assert_eq!(&host(got), want);
    }
}

//! Each fused kernel against its composed twin: forward values, and the gradients of
//! `sum(out * r)` (a fixed random `r`, so every output element matters) with respect to
//! every input; plus bit-identical results for any thread count.

use super::*;
use burn::tensor::{Device, TensorData};
use rand::{Rng, SeedableRng};

fn random(n: usize, seed: u64, scale: f32) -> Vec<f32> {
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
    (0..n).map(|_| rng.gen_range(-scale..scale)).collect()
}

fn leaf<const D: usize>(v: &[f32], shape: [usize; D]) -> Tensor<D> {
    Tensor::<D>::from_data(
        TensorData::new(v.to_vec(), shape),
        &Device::flex().autodiff(),
    )
    .require_grad()
}

fn host<const D: usize>(t: &Tensor<D>) -> Vec<f32> {
    t.clone()
        .into_data()
        .convert::<f32>()
        .try_to_vec::<f32>()
        .unwrap()
}

/// Largest |a - b| relative to the largest |b|.
fn rel_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    let scale = b.iter().fold(0.0f32, |m, v| m.max(v.abs())).max(1e-30);
    a.iter()
        .zip(b)
        .fold(0.0f32, |m, (x, y)| m.max((x - y).abs()))
        / scale
}

/// Compares `fused` and `composed` on the same inputs: outputs, and the gradients of
/// `sum(out * r)` with respect to each input.
fn check<const N: usize, const D: usize>(
    inputs: [(&[f32], Vec<usize>); N],
    fused: impl Fn(&[Tensor<D>]) -> Tensor<D>,
    composed: impl Fn(&[Tensor<D>]) -> Tensor<D>,
    tol: f32,
) {
    let run = |f: &dyn Fn(&[Tensor<D>]) -> Tensor<D>| {
        let leaves: Vec<Tensor<D>> = inputs
            .iter()
            .map(|(v, s)| {
                let shape: [usize; D] = s.clone().try_into().unwrap();
                leaf(v, shape)
            })
            .collect();
        let out = f(&leaves);
        let r = Tensor::<D>::from_data(
            TensorData::new(random(out.shape().num_elements(), 99, 1.0), out.shape()),
            &out.device(),
        );
        let grads = (out.clone() * r).sum().backward();
        let g: Vec<Vec<f32>> = leaves
            .iter()
            .map(|l| l.grad(&grads).map(|g| host(&g)).unwrap_or_default())
            .collect();
        (host(&out), g)
    };
    let (out_f, grads_f) = run(&fused);
    let (out_c, grads_c) = run(&composed);
    let d = rel_diff(&out_f, &out_c);
    assert!(d <= tol, "outputs differ by {d} (relative)");
    for (i, (gf, gc)) in grads_f.iter().zip(&grads_c).enumerate() {
        assert!(
            !gf.is_empty() && !gc.is_empty(),
            "input {i} got no gradient"
        );
        let d = rel_diff(gf, gc);
        assert!(d <= tol, "gradients of input {i} differ by {d} (relative)");
    }
}

#[test]
fn linear_matches_burn() {
    // a 3-D input (rows are flattened), the weight also as a transposed view
    let x = random(3 * 41 * 24, 16, 1.0);
    let w = random(24 * 37, 17, 1.0);
    for transposed in [false, true] {
        let weight = move |t: &Tensor<3>| {
            if transposed {
                t.clone().reshape([37, 24]).transpose()
            } else {
                t.clone().reshape([24, 37])
            }
        };
        check::<2, 3>(
            [(&x, vec![3, 41, 24]), (&w, vec![1, 1, 24 * 37])],
            |t| linear(t[0].clone(), weight(&t[1]), None),
            |t| burn::tensor::module::linear(t[0].clone(), weight(&t[1]), None),
            2e-6,
        );
    }
}

#[test]
fn rms_norm_matches_composed() {
    // 37 rows (not a multiple of the row block), 40 columns (not a multiple of the lanes)
    let x = random(37 * 40, 1, 2.0);
    let w = random(40, 2, 1.5);
    check::<2, 2>(
        [(&x, vec![37, 40]), (&w, vec![1, 40])],
        |t| rms_norm(t[0].clone(), t[1].clone().reshape([40]), 1e-5),
        |t| composed::rms_norm(t[0].clone(), t[1].clone().reshape([40]), 1e-5),
        2e-6,
    );
}

#[test]
fn swiglu_matches_composed() {
    let g = random(3 * 5000, 3, 6.0);
    let u = random(3 * 5000, 4, 2.0);
    check::<2, 2>(
        [(&g, vec![3, 5000]), (&u, vec![3, 5000])],
        |t| swiglu(t[0].clone(), t[1].clone()),
        |t| composed::swiglu(t[0].clone(), t[1].clone()),
        2e-6,
    );
}

#[test]
fn rope_matches_composed() {
    let (b, t, heads, hd) = (2, 7, 3, 8);
    let x = random(b * t * heads * hd, 5, 1.0);
    let cos = random(t * hd, 6, 1.0);
    let sin = random(t * hd, 7, 1.0);
    let tables = |d: &Device| {
        (
            Tensor::<2>::from_data(TensorData::new(cos.clone(), [t, hd]), d),
            Tensor::<2>::from_data(TensorData::new(sin.clone(), [t, hd]), d),
        )
    };
    check::<1, 3>(
        [(&x, vec![b, t, heads * hd])],
        |v| {
            let (c, s) = tables(&v[0].device());
            rope(v[0].clone(), c, s, heads).reshape([b, heads, t * hd])
        },
        |v| {
            let (c, s) = tables(&v[0].device());
            composed::rope(v[0].clone(), c, s, heads).reshape([b, heads, t * hd])
        },
        0.0,
    );
}

#[test]
fn causal_softmax_matches_composed() {
    // rows = 3 groups of t = 9 positions
    let s = random(2 * 2 * 27 * 9, 8, 4.0);
    check::<1, 4>(
        [(&s, vec![2, 2, 27, 9])],
        |t| causal_softmax(t[0].clone(), 0.3),
        |t| composed::causal_softmax(t[0].clone(), 0.3),
        2e-6,
    );
}

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
    check::<3, 4>(
        [
            (&q, vec![b, kv, g * t, hd]),
            (&k, vec![b, kv, t, hd]),
            (&v, vec![b, t, kv, hd]),
        ],
        |x| {
            let (q, k, v) = shaped(x);
            out(causal_attention(q, k, v, 0.25))
        },
        |x| {
            let (q, k, v) = shaped(x);
            out(composed::causal_attention(q, k, v, 0.25))
        },
        2e-6,
    );
}

fn targets(n: usize, vocab: usize, device: &Device) -> Tensor<1, Int> {
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(11);
    let t: Vec<i64> = (0..n).map(|_| rng.gen_range(0..vocab as i64)).collect();
    Tensor::from_data(TensorData::new(t, [n]), device)
}

#[test]
fn linear_cross_entropy_matches_composed() {
    // more rows than one block, an odd vocabulary; w also as a transposed view (as with
    // tied embeddings)
    let (n, d, v) = (CHUNK_ROWS + 89, 24, 301);
    let h = random(n * d, 9, 1.0);
    let w = random(d * v, 10, 0.5);
    for transposed in [false, true] {
        let weight = move |t: &Tensor<2>| {
            if transposed {
                t.clone().transpose()
            } else {
                t.clone()
            }
        };
        let w_shape = if transposed { vec![v, d] } else { vec![d, v] };
        check::<2, 2>(
            [(&h, vec![n, d]), (&w, w_shape)],
            |t| {
                let tg = targets(n, v, &t[0].device());
                linear_cross_entropy(t[0].clone(), weight(&t[1]), tg).reshape([1, 1])
            },
            |t| {
                let tg = targets(n, v, &t[0].device());
                composed::linear_cross_entropy(t[0].clone(), weight(&t[1]), tg).reshape([1, 1])
            },
            2e-6,
        );
    }
}

const CHUNK_ROWS: usize = 512;

#[test]
fn untracked_forward_gives_the_same_loss() {
    let (n, d, v) = (70, 16, 50);
    let dev = Device::flex();
    let h = Tensor::<2>::from_data(TensorData::new(random(n * d, 12, 1.0), [n, d]), &dev);
    let w = Tensor::<2>::from_data(TensorData::new(random(d * v, 13, 1.0), [d, v]), &dev);
    let fused = host(&linear_cross_entropy(
        h.clone(),
        w.clone(),
        targets(n, v, &dev),
    ));
    let reference = host(&composed::linear_cross_entropy(h, w, targets(n, v, &dev)));
    assert!(
        rel_diff(&fused, &reference) < 1e-6,
        "{fused:?} vs {reference:?}"
    );
}

#[test]
fn results_do_not_depend_on_the_thread_count() {
    let x = random(300 * 64, 14, 1.0);
    let w = random(64, 15, 1.0);
    let run = |threads: usize| {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .build()
            .unwrap();
        pool.install(|| {
            let xs = leaf(&x, [300, 64]);
            let ws = leaf(&w, [64]);
            let y = rms_norm(xs.clone(), ws.clone(), 1e-5);
            let s = causal_softmax(y.clone().reshape([1, 3, 100, 64]), 0.5);
            // attention over t = 100 (two blocks of query rows), 3 query heads per kv head
            let qkv = y.clone().reshape([1, 1, 300, 64]);
            let k = y.clone().slice(0..100).reshape([1, 1, 100, 64]);
            let v = y.clone().slice(100..200).reshape([1, 100, 64]);
            let a = causal_attention(qkv, k, v, 0.125);
            let g = ((s.clone() * s).sum() + (a.clone() * a).sum()).backward();
            (
                host(&y),
                host(&xs.grad(&g).unwrap()),
                host(&ws.grad(&g).unwrap()),
            )
        })
    };
    let one = run(1);
    for threads in [2, 3] {
        assert_eq!(run(threads), one, "{threads} threads");
    }
}

//! The CPU kernels' test harness: a kernel against its composed twin on flex, forward values
//! and the gradients of `sum(out * r)` (a fixed random `r`, so every output element matters)
//! with respect to every input (each op's own tests use it); and bit-identical results for
//! any thread count, across the ops of a step.

// The self-check's comparison: a NaN anywhere fails (`f32::max` would skip it), which is how
// an output element a kernel left unwritten shows (`host::tensors::written` starts test
// buffers as NaN).
pub(super) use super::check::rel_diff;
use super::{attention::causal_attention, rms_norm::rms_norm, softmax::causal_softmax};
use burn::tensor::{Device, Int, Tensor, TensorData};
use rand::{Rng, SeedableRng};

pub(super) fn random(n: usize, seed: u64, scale: f32) -> Vec<f32> {
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

pub(super) fn host<const D: usize>(t: &Tensor<D>) -> Vec<f32> {
    t.clone()
        .into_data()
        .convert::<f32>()
        .try_to_vec::<f32>()
        .unwrap()
}

/// Compares `fused` and `composed` on the same inputs: outputs, and the gradients of
/// `sum(out * r)` with respect to each input.
pub(super) fn against_composed<const N: usize, const D: usize>(
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

/// `n` targets below `vocab`, fixed.
pub(super) fn targets(n: usize, vocab: usize, device: &Device) -> Tensor<1, Int> {
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(11);
    let t: Vec<i64> = (0..n).map(|_| rng.gen_range(0..vocab as i64)).collect();
    Tensor::from_data(TensorData::new(t, [n]), device)
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

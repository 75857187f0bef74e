//! The GPU code path without a GPU: burn's CubeCL backend on CubeCL's CPU runtime (device
//! `cubecl-cpu`, cargo feature `cubecl-cpu`), against flex. Built only with that feature
//! (`scripts/install-llvm.sh` provides the LLVM it links).

use crate::common;

use burn::tensor::activation::softmax;
use burn::tensor::{Device, Tensor, TensorData};
use common::{host, random, rel_diff};
use std::time::Instant;

/// `sum(softmax(x @ w) * r)`: forward value and the gradients of x and w.
fn matmul_softmax(device: &Device, rows: usize, k: usize, cols: usize) -> Vec<Vec<f32>> {
    let ad = device.clone().autodiff();
    let leaf = |v: Vec<f32>, shape: [usize; 2]| {
        Tensor::<2>::from_data(TensorData::new(v, shape), &ad).require_grad()
    };
    let x = leaf(random(rows * k, 1), [rows, k]);
    let w = leaf(random(k * cols, 2), [k, cols]);
    let r = Tensor::<2>::from_data(TensorData::new(random(rows * cols, 3), [rows, cols]), &ad);
    let y = softmax(x.clone().matmul(w.clone()), 1);
    let loss = (y * r).sum();
    let grads = loss.backward();
    vec![
        host(&loss.reshape([1, 1])),
        host(&x.grad(&grads).unwrap()),
        host(&w.grad(&grads).unwrap()),
    ]
}

#[test]
fn forward_and_backward_match_flex() {
    let device = kiln_train::model::session::parse_device("cubecl-cpu").unwrap();
    let want = matmul_softmax(&Device::flex(), 64, 96, 32);
    // Three rounds: the first compiles every kernel (LLVM JIT, cached per kernel in the
    // process), the later ones show the steady-state cost.
    for round in 0..3 {
        let t = Instant::now();
        let got = matmul_softmax(&device, 64, 96, 32);
        eprintln!(
            "cubecl-cpu round {round}: forward+backward 64x96x32 in {:.1} ms",
            t.elapsed().as_secs_f64() * 1e3
        );
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            let d = rel_diff(g, w);
            assert!(d <= 1e-5, "output {i} differs from flex by {d} (relative)");
        }
    }
}

/// The token embedding's backward: a scatter-add with repeated ids, one per token.
fn embedding_grad(device: &Device) -> Vec<f32> {
    let ad = device.clone().autodiff();
    let w = Tensor::<2>::from_data(TensorData::new(random(10 * 8, 4), [10, 8]), &ad).require_grad();
    let ids: Vec<i64> = vec![0, 3, 3, 3, 7, 0, 9, 3, 3, 1, 3, 3];
    let ids = Tensor::<2, burn::tensor::Int>::from_data(TensorData::new(ids, [2, 6]), &ad);
    let out = burn::tensor::module::embedding(w.clone(), ids);
    let r = Tensor::<3>::from_data(TensorData::new(random(2 * 6 * 8, 5), [2, 6, 8]), &ad);
    let grads = (out * r).sum().backward();
    host(&w.grad(&grads).unwrap())
}

#[test]
fn embedding_backward_with_repeated_ids_matches_flex() {
    let device = kiln_train::model::session::parse_device("cubecl-cpu").unwrap();
    let want = embedding_grad(&Device::flex());
    let got = embedding_grad(&device);
    let d = rel_diff(&got, &want);
    assert!(
        d <= 1e-5,
        "embedding gradient differs from flex by {d} (relative)\n{got:?}\n{want:?}"
    );
}

/// `sum(x^2)` of one long vector: the reduction behind the global gradient norm.
#[test]
fn long_sums_match_flex() {
    let device = kiln_train::model::session::parse_device("cubecl-cpu").unwrap();
    let mut bad = Vec::new();
    for n in [1000usize, 4096, 20_000, 65_536, 300_000, 1 << 20] {
        let v = random(n, n as u64);
        let sq = |d: &Device| {
            Tensor::<1>::from_data(TensorData::new(v.clone(), [n]), d)
                .powi_scalar(2)
                .sum()
                .into_scalar::<f32>()
        };
        let (got, want) = (sq(&device), sq(&Device::flex()));
        eprintln!("n={n}: cubecl-cpu {got} flex {want}");
        if (got - want).abs() > 1e-4 * want.abs() {
            bad.push((n, got, want));
        }
    }
    assert!(bad.is_empty(), "sum(x^2) differs from flex: {bad:?}");
}

/// kiln's global gradient norm (per-tensor sums on rayon threads: on a CubeCL device each
/// thread has its own stream) of tensors whose producing kernels may still be queued.
#[test]
fn global_norm_of_fresh_tensors_matches_flex() {
    let device = kiln_train::model::session::parse_device("cubecl-cpu").unwrap();
    let norm = |d: &Device| {
        let grads: Vec<Tensor<1>> = (0..24)
            .map(|i| {
                let n = 500 + 3000 * i;
                let x = Tensor::<1>::from_data(TensorData::new(random(n, i as u64), [n]), d);
                x.clone() * 3.0 + x.exp()
            })
            .collect();
        kiln_train::optim::global_norm(&grads)
    };
    let want = norm(&Device::flex());
    for round in 0..1 {
        let got = norm(&device);
        eprintln!("round {round}: cubecl-cpu {got} flex {want}");
        assert!(
            (got - want).abs() <= 1e-5 * want,
            "global norm {got} on cubecl-cpu vs {want} on flex"
        );
    }
}

/// A tiny model's step on both devices from the same weights and batch: the loss and every
/// parameter's gradient, named, so a backward that differs on the GPU code path shows where.
#[test]
fn model_step_gradients_match_flex_per_parameter() {
    use kiln_train::step::{At, Step};
    use kiln_train::{Config, Session};
    let sets = |device: &str| -> Vec<String> {
        [
            "model.d_model=32",
            "model.n_layers=2",
            "model.n_heads=2",
            "model.n_kv_heads=1",
            "model.ffn_hidden=64",
            "training.seq_len=32",
            "training.batch_size=4",
        ]
        .iter()
        .map(|s| s.to_string())
        .chain([format!("training.device={device}")])
        .collect()
    };
    let step_of = |device: &str, weights: Option<&[kiln_train::checkpoint::HostTensor]>| {
        let cfg = Config::load(None, &sets(device)).unwrap();
        let data = kiln_train::data::TrainData::open(&cfg, 4, None).unwrap();
        let s = match weights {
            None => Session::new(&cfg, data.vocab(&cfg).unwrap()).unwrap(),
            Some(w) => Session::from_weights(&cfg, w, std::path::Path::new("flex")).unwrap(),
        };
        let g = Step::single(&cfg, &s)
            .unwrap()
            .gradients(
                &s,
                data.source.as_ref(),
                At {
                    base: 0,
                    batch_no: 1,
                },
            )
            .unwrap();
        let names: Vec<String> = s.model.specs().iter().map(|p| p.name.clone()).collect();
        // The concatenation the all-reduce would read back, against the tensors one by one.
        let whole = host(&Tensor::cat(g.grads.clone(), 0));
        let parts: Vec<f32> = g.grads.iter().flat_map(host).collect();
        eprintln!(
            "{device}: cat of the gradients, max rel diff {:.2e}",
            rel_diff(&whole, &parts)
        );
        (
            s.host_params(),
            g.loss,
            g.norm,
            names,
            g.grads.iter().map(host).collect::<Vec<_>>(),
        )
    };
    let (weights, want_loss, want_norm, names, want) = step_of("flex", None);
    let (_, loss, norm, _, got) = step_of("cubecl-cpu", Some(&weights));
    eprintln!("loss {loss} vs {want_loss}; grad norm {norm} vs {want_norm}");
    let mut bad = Vec::new();
    for ((name, g), w) in names.iter().zip(&got).zip(&want) {
        let d = rel_diff(g, w);
        let n = |v: &[f32]| v.iter().map(|x| x * x).sum::<f32>().sqrt();
        eprintln!("{name}: |g| {} vs {} (max rel diff {d:.2e})", n(g), n(w));
        if d > 1e-3 {
            bad.push(format!("{name}: {d:.2e}"));
        }
    }
    assert!(
        (loss - want_loss).abs() <= 1e-4 * want_loss.abs(),
        "loss {loss} vs {want_loss}"
    );
    assert!(bad.is_empty(), "gradients differ from flex: {bad:?}");
    assert!(
        (norm - want_norm).abs() <= 1e-3 * want_norm,
        "grad norm {norm} vs {want_norm}"
    );
}

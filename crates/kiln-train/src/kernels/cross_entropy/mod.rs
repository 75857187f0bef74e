//! The output head with the cross-entropy loss, `mean(logsumexp(h @ w) - (h @ w)[target])`,
//! computed a block of rows (CPU) or a chunk of the vocabulary (CubeCL) at a time, so the
//! `[tokens, vocab]` logits are never held whole. A CPU kernel ([`cpu`]) and a CubeCL kernel
//! ([`cube`]), each forward and backward, the composed twin they are checked against
//! ([`composed`]), and the self-check case ([`check`]).

pub(super) mod composed;
mod cpu;
#[cfg(feature = "cube")]
pub(in crate::kernels) mod cube;

use super::check::{Check, compare, grad_of, values_and_grads};
use super::coverage::{self, Route};
use burn::tensor::{Device, FloatDType, Int, Tensor, TensorData};

/// Mean cross-entropy of the logits `h @ w` (`h` `[n, d]`, `w` `[d, vocab]`) against
/// `targets` `[n]`, as a one-element tensor: the CubeCL kernel on CubeCL devices, the CPU
/// kernel on flex, the composed ops where neither covers the tensors.
pub fn linear_cross_entropy(h: Tensor<2>, w: Tensor<2>, targets: Tensor<1, Int>) -> Tensor<1> {
    match coverage::route(&h, &[w.dtype()]) {
        #[cfg(feature = "cube")]
        Route::Device(_) => cube::linear_cross_entropy(h, w, targets, None),
        Route::Host if coverage::fusable(&w) => cpu::linear_cross_entropy(h, w, targets),
        _ => composed::linear_cross_entropy(h, w, targets),
    }
}

/// As [`linear_cross_entropy`], with at most `columns` logits columns live at once where the
/// kernel chunks the vocabulary by a budget (CubeCL devices; elsewhere the same as
/// [`linear_cross_entropy`]): for tests and tuning.
pub fn linear_cross_entropy_in_chunks(
    h: Tensor<2>,
    w: Tensor<2>,
    targets: Tensor<1, Int>,
    columns: usize,
) -> Tensor<1> {
    #[cfg(feature = "cube")]
    if coverage::covers(&h, &[w.dtype()]) {
        return cube::linear_cross_entropy(h, w, targets, Some(columns));
    }
    let _ = columns;
    linear_cross_entropy(h, w, targets)
}

/// The kernel against [`composed`] on `device`: 37 rows, vocabulary 300, in one chunk and in
/// chunks of 128, 128 and 44 columns, with targets in each.
pub fn check(device: &Device, dtype: FloatDType) -> Vec<Check> {
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
                        linear_cross_entropy_in_chunks(h.clone(), w.clone(), targets, c)
                    }
                    (true, None) => linear_cross_entropy(h.clone(), w.clone(), targets),
                    (false, _) => composed::linear_cross_entropy(h.clone(), w.clone(), targets),
                };
                values_and_grads(r, loss, &[grad_of(&h), grad_of(&w)])
            })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use crate::kernels::tests::{against_composed, host, random, rel_diff, targets};
    use burn::tensor::{Device, Tensor, TensorData};

    /// Rows a block of the CPU kernel takes.
    const CHUNK_ROWS: usize = 512;

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
            against_composed::<2, 2>(
                [(&h, vec![n, d]), (&w, w_shape)],
                |t| {
                    let tg = targets(n, v, &t[0].device());
                    super::linear_cross_entropy(t[0].clone(), weight(&t[1]), tg).reshape([1, 1])
                },
                |t| {
                    let tg = targets(n, v, &t[0].device());
                    super::composed::linear_cross_entropy(t[0].clone(), weight(&t[1]), tg)
                        .reshape([1, 1])
                },
                2e-6,
            );
        }
    }

    #[test]
    fn untracked_forward_gives_the_same_loss() {
        let (n, d, v) = (70, 16, 50);
        let dev = Device::flex();
        let h = Tensor::<2>::from_data(TensorData::new(random(n * d, 12, 1.0), [n, d]), &dev);
        let w = Tensor::<2>::from_data(TensorData::new(random(d * v, 13, 1.0), [d, v]), &dev);
        let fused = host(&super::linear_cross_entropy(
            h.clone(),
            w.clone(),
            targets(n, v, &dev),
        ));
        let reference = host(&super::composed::linear_cross_entropy(
            h,
            w,
            targets(n, v, &dev),
        ));
        assert!(
            rel_diff(&fused, &reference) < 1e-6,
            "{fused:?} vs {reference:?}"
        );
    }
}

//! The causal softmax of attention scores, `softmax(scores * scale + causal mask)`: the
//! model's attention when it multiplies the scores itself (mixed precision where kiln has no
//! bf16 kernels, as on flex). A CPU kernel ([`cpu`]), forward and backward, and the composed
//! twin it is checked against ([`composed`]); elsewhere the composed ops.

pub(super) mod composed;
mod cpu;

use super::coverage;
use burn::tensor::Tensor;

/// Softmax over the last dimension of `scores * scale` `[.., rows, t]` under a causal mask:
/// row `r` may see columns `0..=r % t`. The CPU kernel on flex, else the composed ops.
pub fn causal_softmax(scores: Tensor<4>, scale: f64) -> Tensor<4> {
    match coverage::fusable(&scores) {
        true => cpu::causal_softmax(scores, scale),
        false => composed::causal_softmax(scores, scale),
    }
}

#[cfg(test)]
mod tests {
    use crate::kernels::tests::{against_composed, random};

    #[test]
    fn causal_softmax_matches_composed() {
        // rows = 3 groups of t = 9 positions
        let s = random(2 * 2 * 27 * 9, 8, 4.0);
        against_composed::<1, 4>(
            [(&s, vec![2, 2, 27, 9])],
            |t| super::causal_softmax(t[0].clone(), 0.3),
            |t| super::composed::causal_softmax(t[0].clone(), 0.3),
            2e-6,
        );
    }
}

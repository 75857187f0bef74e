//! Seeded pseudo-random permutations of `[0, n)` that are evaluated in O(1) per element and
//! need no storage: a 4-round Feistel network over the next even power of two, with cycle
//! walking to stay inside `[0, n)`.
//!
//! Megatron materialises its document and sample shuffles (`numpy` permutations written to
//! `.npy` files, gigabytes for a large corpus). A keyed bijection gives the same effect — every
//! element appears exactly once, in an order no simple pattern predicts — without building or
//! storing anything, which is most of why kiln's index build is fast and its cache small.

/// splitmix64's finaliser: a fast, well-mixing 64-bit hash used to derive keys and as the
/// Feistel round function.
#[inline]
pub fn mix64(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// Derive a key from a list of words (seed, fingerprint, purpose, index, ...).
pub fn derive_key(parts: &[u64]) -> u64 {
    parts
        .iter()
        .fold(0x6B69_6C6E_6461_7461, |acc, &p| mix64(acc ^ mix64(p)))
}

const ROUNDS: usize = 4;

/// A keyed bijection on `[0, n)`.
#[derive(Debug, Clone)]
pub struct Permutation {
    n: u64,
    half_bits: u32,
    mask: u64,
    keys: [u64; ROUNDS],
}

impl Permutation {
    /// The permutation of `[0, n)` for a key.
    pub fn new(n: u64, key: u64) -> Permutation {
        // Smallest even bit width whose domain covers n (at least 2 bits), so both Feistel
        // halves are equal; the domain is then < 4n and cycle walking takes < 4 steps on average.
        let mut bits = 64 - n.saturating_sub(1).leading_zeros();
        bits = bits.max(2);
        if bits % 2 == 1 {
            bits += 1;
        }
        let half_bits = bits / 2;
        let mut keys = [0u64; ROUNDS];
        for (r, k) in keys.iter_mut().enumerate() {
            *k = derive_key(&[key, r as u64]);
        }
        Permutation {
            n,
            half_bits,
            mask: (1u64 << half_bits) - 1,
            keys,
        }
    }

    /// Size of the domain.
    pub fn len(&self) -> u64 {
        self.n
    }

    /// Whether the domain is empty.
    pub fn is_empty(&self) -> bool {
        self.n == 0
    }

    #[inline]
    fn feistel(&self, x: u64) -> u64 {
        let mut l = x >> self.half_bits;
        let mut r = x & self.mask;
        for &k in &self.keys {
            let f = (r ^ k).wrapping_mul(0x9E37_79B9_7F4A_7C15);
            let f = (f ^ (f >> 32)).wrapping_mul(0xD6E8_FEB8_6659_FD93);
            let f = (f >> 32) & self.mask;
            let nl = r;
            r = l ^ f;
            l = nl;
        }
        (l << self.half_bits) | r
    }

    /// The image of `i` (`i < n`).
    #[inline]
    pub fn apply(&self, i: u64) -> u64 {
        debug_assert!(i < self.n);
        let mut x = self.feistel(i);
        while x >= self.n {
            x = self.feistel(x);
        }
        x
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn is_a_bijection_for_many_sizes() {
        for n in [1u64, 2, 3, 4, 5, 7, 8, 9, 100, 1000, 4097, 65_537] {
            let p = Permutation::new(n, 42 + n);
            let mut seen = vec![false; n as usize];
            for i in 0..n {
                let j = p.apply(i) as usize;
                assert!(!seen[j], "n={n}: {j} hit twice");
                seen[j] = true;
            }
        }
    }

    #[test]
    fn depends_on_key_and_looks_shuffled() {
        let n = 10_000;
        let a = Permutation::new(n, 1);
        let b = Permutation::new(n, 2);
        let differ = (0..n).filter(|&i| a.apply(i) != b.apply(i)).count();
        assert!(differ > 9_900);
        // Fixed points of a random permutation average 1.
        let fixed = (0..n).filter(|&i| a.apply(i) == i).count();
        assert!(fixed < 10);
        // Consecutive inputs land far apart on average (~n/3 for a random permutation).
        let mean_gap: f64 = (1..n)
            .map(|i| (a.apply(i) as f64 - a.apply(i - 1) as f64).abs())
            .sum::<f64>()
            / (n - 1) as f64;
        assert!(
            (mean_gap - n as f64 / 3.0).abs() < n as f64 * 0.05,
            "{mean_gap}"
        );
    }
}

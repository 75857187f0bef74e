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

/// `x = feistel_inverse(x)` for every element, bit for bit [`Permutation::feistel_inverse`]:
/// 32 elements at a time, each round over all of them, so that the vector units have several
/// independent multiplications in flight (one element's four rounds are a chain of eight
/// dependent 64-bit multiplications).
#[multiversion::multiversion(targets(
    "x86_64+avx512f+avx512vl+avx512dq+avx512bw",
    "x86_64+avx2+fma"
))]
fn feistel_inverse_all(p: &Permutation, xs: &mut [u64]) {
    const W: usize = 32;
    let (hb, mask) = (p.half_bits, p.mask);
    let [k0, k1, k2, k3] = p.keys;
    let round = |r: u64, k: u64| {
        let f = (r ^ k).wrapping_mul(0x9E37_79B9_7F4A_7C15);
        let f = (f ^ (f >> 32)).wrapping_mul(0xD6E8_FEB8_6659_FD93);
        (f >> 32) & mask
    };
    let mut chunks = xs.chunks_exact_mut(W);
    for c in &mut chunks {
        let mut l = [0u64; W];
        let mut r = [0u64; W];
        for j in 0..W {
            l[j] = c[j] >> hb;
            r[j] = c[j] & mask;
        }
        for k in [k3, k2, k1, k0] {
            for j in 0..W {
                let pl = l[j];
                l[j] = r[j] ^ round(pl, k);
                r[j] = pl;
            }
        }
        for j in 0..W {
            c[j] = (l[j] << hb) | r[j];
        }
    }
    for x in chunks.into_remainder() {
        *x = p.feistel_inverse(*x);
    }
}

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
            let nl = r;
            r = l ^ self.round(r, k);
            l = nl;
        }
        (l << self.half_bits) | r
    }

    #[inline]
    fn round(&self, r: u64, k: u64) -> u64 {
        let f = (r ^ k).wrapping_mul(0x9E37_79B9_7F4A_7C15);
        let f = (f ^ (f >> 32)).wrapping_mul(0xD6E8_FEB8_6659_FD93);
        (f >> 32) & self.mask
    }

    #[inline]
    fn feistel_inverse(&self, x: u64) -> u64 {
        let mut l = x >> self.half_bits;
        let mut r = x & self.mask;
        for &k in self.keys.iter().rev() {
            let pr = l;
            l = r ^ self.round(pr, k);
            r = pr;
        }
        (l << self.half_bits) | r
    }

    /// The preimage of `j` (`j < n`): `apply_inverse(apply(i)) == i`. Cycle walking backwards
    /// along the same orbit lands on the first in-range element, which is the preimage.
    #[inline]
    pub fn apply_inverse(&self, j: u64) -> u64 {
        debug_assert!(j < self.n);
        let mut x = self.feistel_inverse(j);
        while x >= self.n {
            x = self.feistel_inverse(x);
        }
        x
    }

    /// `out[k] = apply_inverse(start + k)` for a run of consecutive inputs, several times
    /// faster than one at a time: a first Feistel pass runs over the whole run without
    /// branches, vectorised ([`feistel_inverse_all`]), then only the elements still outside
    /// `[0, n)` (gathered by branch-free compaction) walk on, again a vectorised pass at a
    /// time. One at a time, the walk's unpredictable exit branch stalls the pipeline on every
    /// element, and the rounds' multiplications wait on each other.
    pub fn apply_inverse_run(&self, start: u64, out: &mut [u64]) {
        debug_assert!(start + out.len() as u64 <= self.n);
        const B: usize = 1024;
        let mut todo = [0u32; B];
        let mut walk = [0u64; B];
        for (c, chunk) in out.chunks_mut(B).enumerate() {
            let base = start + (c * B) as u64;
            for (k, y) in chunk.iter_mut().enumerate() {
                *y = base + k as u64;
            }
            feistel_inverse_all(self, chunk);
            let mut pending = 0;
            for (k, &y) in chunk.iter().enumerate() {
                todo[pending] = k as u32;
                pending += (y >= self.n) as usize;
            }
            while pending > 0 {
                for (w, &k) in walk.iter_mut().zip(&todo[..pending]) {
                    *w = chunk[k as usize];
                }
                feistel_inverse_all(self, &mut walk[..pending]);
                let mut still = 0;
                for q in 0..pending {
                    let k = todo[q] as usize;
                    chunk[k] = walk[q];
                    todo[still] = k as u32;
                    still += (walk[q] >= self.n) as usize;
                }
                pending = still;
            }
        }
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
    fn inverse_undoes_apply() {
        for n in [1u64, 2, 3, 5, 17, 1000, 4097, 65_537, 1 << 20] {
            let p = Permutation::new(n, 7 * n + 1);
            let step = (n / 5000).max(1);
            for i in (0..n).step_by(step as usize) {
                assert_eq!(p.apply_inverse(p.apply(i)), i, "n={n} i={i}");
                assert_eq!(p.apply(p.apply_inverse(i)), i, "n={n} i={i}");
            }
            // Runs longer than the vectorised chunk (1024) and not a multiple of its width.
            for start in [0, n / 3, n.saturating_sub(3001)] {
                let mut run = vec![0u64; (n - start).min(3001) as usize];
                p.apply_inverse_run(start, &mut run);
                for (k, &y) in run.iter().enumerate() {
                    assert_eq!(y, p.apply_inverse(start + k as u64), "n={n} k={k}");
                }
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

//! Branch-free scalar math that the compiler vectorises inside the kernels' loops.
//!
//! Why not `f32::exp`: it is a libm call, which keeps a loop scalar (one element at a time);
//! the polynomial below vectorises to 16 lanes under AVX-512. Accuracy: within 2 ulp of the
//! correctly rounded result over the range the kernels use (checked in the tests).

/// Lanes of the explicit accumulators: reductions keep `LANES` partial sums, so the
/// compiler can vectorise them without reordering (which it may not do on its own for
/// floats) and every instruction set gives the same result.
pub const LANES: usize = 16;

/// `e^x`, with inputs below -87.3 giving the smallest normal float (about 1.2e-38) and
/// inputs above 88.7 giving infinity. Cephes' `expf` polynomial with its two-part ln 2.
#[inline(always)]
pub fn exp(x: f32) -> f32 {
    let x = x.clamp(-87.336_55, 88.722_84);
    // n = round(x / ln 2), by the 1.5 * 2^23 trick: the rounded value lands in the low
    // mantissa bits of `t`, which also gives the integer without a float-to-int conversion.
    let t = x * std::f32::consts::LOG2_E + 12_582_912.0;
    let n = t - 12_582_912.0;
    let r = x - n * 0.693_359_4 - n * -2.121_944_4e-4;
    let p = ((((1.987_569_1e-4 * r + 1.398_199_9e-3) * r + 8.333_452e-3) * r + 4.166_579_6e-2) * r
        + 1.666_666_5e-1)
        * r
        + 0.5; // Cephes' 5.0000001e-1, which rounds to 0.5 in f32
    let y = p * (r * r) + r + 1.0;
    // 2^n as a float: the exponent field is n + 127.
    let scale = f32::from_bits(
        t.to_bits()
            .wrapping_sub(0x4B40_0000)
            .wrapping_add(127)
            .wrapping_shl(23),
    );
    y * scale
}

/// The logistic function `1 / (1 + e^-x)`.
#[inline(always)]
pub fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + exp(-x))
}

/// Sum of the lanes in a fixed order (pairwise).
#[inline(always)]
pub fn hsum(mut a: [f32; LANES]) -> f32 {
    let mut w = LANES / 2;
    while w > 0 {
        for i in 0..w {
            a[i] += a[i + w];
        }
        w /= 2;
    }
    a[0]
}

/// Largest lane.
#[inline(always)]
pub fn hmax(a: [f32; LANES]) -> f32 {
    a.into_iter().fold(f32::NEG_INFINITY, f32::max)
}

/// `sum(f(i))` over `0..n`, accumulated in [`LANES`] lanes (element `i` goes to lane
/// `i % LANES`), then summed pairwise.
#[inline(always)]
pub fn lane_sum(n: usize, mut f: impl FnMut(usize) -> f32) -> f32 {
    let mut acc = [0.0f32; LANES];
    let full = n / LANES * LANES;
    let mut i = 0;
    while i < full {
        for (l, a) in acc.iter_mut().enumerate() {
            *a += f(i + l);
        }
        i += LANES;
    }
    for (l, a) in acc.iter_mut().enumerate().take(n - full) {
        *a += f(full + l);
    }
    hsum(acc)
}

/// `max(f(i))` over `0..n` (negative infinity when `n` is 0).
#[inline(always)]
pub fn lane_max(n: usize, mut f: impl FnMut(usize) -> f32) -> f32 {
    let mut acc = [f32::NEG_INFINITY; LANES];
    let full = n / LANES * LANES;
    let mut i = 0;
    while i < full {
        for (l, a) in acc.iter_mut().enumerate() {
            *a = a.max(f(i + l));
        }
        i += LANES;
    }
    for (l, a) in acc.iter_mut().enumerate().take(n - full) {
        *a = a.max(f(full + l));
    }
    hmax(acc)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ulps(a: f32, b: f32) -> u32 {
        (a.to_bits() as i64 - b.to_bits() as i64).unsigned_abs() as u32
    }

    #[test]
    fn exp_is_within_two_ulp_of_libm() {
        let mut worst = 0;
        let mut x = -87.0f32;
        while x < 88.0 {
            worst = worst.max(ulps(exp(x), (x as f64).exp() as f32));
            x += 0.000_37;
        }
        assert!(worst <= 2, "worst error {worst} ulp");
        assert_eq!(exp(0.0), 1.0);
        assert!(exp(-1000.0) < 1.2e-38 && exp(-1000.0) >= 0.0);
        assert_eq!(exp(1000.0), f32::INFINITY);
        assert_eq!(sigmoid(-1000.0), 0.0);
        assert_eq!(sigmoid(1000.0), 1.0);
    }

    #[test]
    fn lane_reductions_cover_every_element() {
        for n in [0, 1, 15, 16, 17, 100] {
            let want: f32 = (0..n).map(|i| i as f32).sum();
            assert_eq!(lane_sum(n, |i| i as f32), want, "n={n}");
            let m = lane_max(n, |i| i as f32);
            assert_eq!(
                m,
                if n == 0 {
                    f32::NEG_INFINITY
                } else {
                    (n - 1) as f32
                }
            );
        }
    }
}

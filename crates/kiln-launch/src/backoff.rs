//! The wait between attempts that make no new progress (`--backoff`).

use std::time::Duration;

/// Exponential backoff between attempts that make no new progress: `base`, doubling per such
/// attempt in a row, at most `cap`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Backoff {
    /// First delay.
    pub base: Duration,
    /// Largest delay.
    pub cap: Duration,
}

impl Default for Backoff {
    /// 5, 10, 20, 40, 60, 60, ... seconds.
    fn default() -> Self {
        Self {
            base: Duration::from_secs(5),
            cap: Duration::from_secs(60),
        }
    }
}

impl Backoff {
    /// Parses `BASE[,CAP]` in seconds (fractions allowed, each at most a year); CAP defaults
    /// to 12 x BASE.
    pub fn parse(s: &str) -> Result<Self, String> {
        let secs = |t: &str| -> Result<Duration, String> {
            let v: f64 = t
                .trim()
                .parse()
                .map_err(|_| format!("--backoff {s:?}: {t:?} is not a number of seconds"))?;
            crate::limits::seconds("--backoff", v, true)
        };
        let (base, cap) = match s.split_once(',') {
            Some((b, c)) => (secs(b)?, secs(c)?),
            None => {
                let b = secs(s)?;
                (b, b.saturating_mul(12))
            }
        };
        if cap < base {
            return Err(format!("--backoff {s:?}: the cap is smaller than the base"));
        }
        Ok(Self { base, cap })
    }

    /// Delay before the attempt after `streak` attempts in a row that got no further than
    /// the best before them; none after one that trained further (`streak` 0).
    pub fn delay(&self, streak: u32) -> Duration {
        if streak == 0 {
            return Duration::ZERO;
        }
        let factor = 2u32.saturating_pow(streak.saturating_sub(1).min(30));
        self.base.saturating_mul(factor).min(self.cap)
    }
}

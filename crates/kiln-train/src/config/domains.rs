//! How a config's values are checked: each key's domain (finite, sign, range), collected so
//! that one error names every key out of its domain ([`Domains`]).

use super::error::{ConfigError, OutOfDomain};

/// One end of an allowed range of a real-valued key.
#[derive(Clone, Copy)]
pub(super) enum Bound {
    /// The end itself is allowed.
    Closed(f64),
    /// Only values strictly inside.
    Open(f64),
    /// No bound (but the value must be finite).
    Inf,
}
use Bound::{Closed, Inf, Open};

/// Collects the keys out of their domains, so one error names them all.
#[derive(Default)]
pub(super) struct Domains(pub(super) Vec<OutOfDomain>);

impl Domains {
    pub(super) fn check(
        &mut self,
        key: &str,
        value: impl std::fmt::Display,
        ok: bool,
        allowed: String,
    ) {
        if !ok {
            self.0.push(OutOfDomain {
                key: key.into(),
                value: value.to_string(),
                allowed,
            });
        }
    }

    pub(super) fn at_least<T: PartialOrd + std::fmt::Display + Copy>(
        &mut self,
        key: &str,
        v: T,
        min: T,
    ) {
        self.check(key, v, v >= min, format!("an integer >= {min}"));
    }

    /// A finite real in the range `lo .. hi`.
    pub(super) fn real(&mut self, key: &str, v: f64, lo: Bound, hi: Bound) {
        let above = match lo {
            Closed(x) => v >= x,
            Open(x) => v > x,
            Inf => true,
        };
        let below = match hi {
            Closed(x) => v <= x,
            Open(x) => v < x,
            Inf => true,
        };
        let allowed = match (lo, hi) {
            (Closed(f64::MIN), Closed(f64::MAX)) => "a finite number".to_string(),
            (Closed(a), Inf) => format!("a finite number >= {a}"),
            (Open(a), Inf) => format!("a finite number > {a}"),
            (lo, hi) => {
                let l = match lo {
                    Closed(a) => format!("[{a}"),
                    Open(a) => format!("({a}"),
                    Inf => "(-inf".into(),
                };
                let h = match hi {
                    Closed(b) => format!("{b}]"),
                    Open(b) => format!("{b})"),
                    Inf => "inf)".into(),
                };
                format!("a finite number in {l}, {h}")
            }
        };
        self.check(key, v, v.is_finite() && above && below, allowed);
    }

    /// A rule between keys that does not hold.
    pub(super) fn rule(&mut self, what: String) {
        self.0.push(OutOfDomain {
            key: String::new(),
            value: String::new(),
            allowed: what,
        });
    }

    pub(super) fn into_result(self) -> Result<(), ConfigError> {
        if self.0.is_empty() {
            Ok(())
        } else {
            Err(ConfigError::OutOfDomain(self.0))
        }
    }
}

/// Largest gradient all-reduce bucket, MiB.
pub const MAX_BUCKET_MB: usize = 1 << 16;

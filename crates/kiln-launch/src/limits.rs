//! Bounds on what a command line may ask for, checked before anything starts: durations that
//! fit in a timer, and rank counts a machine or a cluster can hold.

use std::time::Duration;

/// The longest duration any flag may give: a year. Longer is a typo (`1e300`), and an
/// unbounded value would overflow the timers it is added to.
pub const MAX_SECONDS: f64 = 365.0 * 86_400.0;

/// The most ranks one launch may start (as many as hosts a Slurm hostlist may name).
pub const MAX_RANKS: usize = kiln_topology::MAX_HOSTS;

/// The most ranks (or accelerators) one node may hold.
pub const MAX_PER_NODE: usize = 1024;

/// Local ranks per CPU kiln starts without `--oversubscribe`: more is a mistake on a
/// workstation (each rank is a process with its own memory), not a test.
pub const LOCAL_RANKS_PER_CPU: usize = 4;

/// The fewest local ranks always allowed, however few CPUs there are.
pub const LOCAL_RANKS_MIN: usize = 8;

/// The most local ranks even with `--oversubscribe`.
pub const MAX_LOCAL_RANKS: usize = 4096;

/// A duration flag in seconds: finite, positive (or zero when `allow_zero`), at most
/// [`MAX_SECONDS`]. The error names the flag and the bound.
pub fn seconds(flag: &str, value: f64, allow_zero: bool) -> Result<Duration, String> {
    let shown = if value.is_finite() && value.abs() >= 1e9 {
        format!("{value:e}")
    } else {
        format!("{value}")
    };
    let lower_ok = if allow_zero {
        value >= 0.0
    } else {
        value > 0.0
    };
    if !value.is_finite() || !lower_ok {
        let want = if allow_zero {
            "zero or a positive number of seconds"
        } else {
            "a positive number of seconds"
        };
        return Err(format!("{flag} {shown}: must be {want}"));
    }
    if value > MAX_SECONDS {
        return Err(format!(
            "{flag} {shown}: at most {MAX_SECONDS} seconds (365 days)"
        ));
    }
    Duration::try_from_secs_f64(value).map_err(|e| format!("{flag} {shown}: {e}"))
}

/// `3600`, `90.5` or `[[H:]MM:]SS` (each part a number), bounded like [`seconds`].
pub fn clock_time(flag: &str, text: &str) -> Result<Duration, String> {
    let bad = || format!("{flag} {text:?}: expected seconds or H:MM:SS");
    let total = if text.contains(':') {
        let parts: Vec<&str> = text.split(':').collect();
        if parts.len() > 3 {
            return Err(bad());
        }
        let mut total = 0.0;
        for part in parts {
            let v: f64 = part.trim().parse().map_err(|_| bad())?;
            if !(v.is_finite() && v >= 0.0) {
                return Err(bad());
            }
            total = total * 60.0 + v;
        }
        total
    } else {
        text.trim().parse().map_err(|_| bad())?
    };
    seconds(flag, total, false)
}

/// Checks an explicit per-node count (`--ppn`, `--gpus-per-node`).
pub fn per_node(flag: &str, value: usize) -> Result<(), String> {
    if value > MAX_PER_NODE {
        return Err(format!(
            "{flag} {value}: no node holds more than {MAX_PER_NODE}; check the value"
        ));
    }
    Ok(())
}

/// Checks a total rank count; `local_cpus` is `Some` when every rank runs on this machine.
pub fn ranks(np: usize, local_cpus: Option<usize>, oversubscribe: bool) -> Result<(), String> {
    if np > MAX_RANKS {
        return Err(format!(
            "{np} ranks requested: at most {MAX_RANKS} ranks per launch"
        ));
    }
    if let Some(cpus) = local_cpus {
        let soft = (cpus * LOCAL_RANKS_PER_CPU).max(LOCAL_RANKS_MIN);
        if np > soft && !oversubscribe {
            return Err(format!(
                "{np} ranks would start {np} processes on this machine, which has {cpus} CPUs \
                 (limit {soft}: {LOCAL_RANKS_PER_CPU} per CPU); lower --np, or pass --oversubscribe \
                 to start them anyway"
            ));
        }
        if np > MAX_LOCAL_RANKS {
            return Err(format!(
                "{np} ranks on this machine: at most {MAX_LOCAL_RANKS} local ranks, even with --oversubscribe"
            ));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_are_finite_positive_and_bounded() {
        assert_eq!(
            seconds("--timeout", 2.5, false).unwrap(),
            Duration::from_millis(2500)
        );
        assert_eq!(seconds("--grace", 0.0, true).unwrap(), Duration::ZERO);
        for bad in [0.0, -1.0, f64::NAN, f64::INFINITY, 1e300, MAX_SECONDS * 2.0] {
            let e = seconds("--timeout", bad, false).unwrap_err();
            assert!(e.starts_with("--timeout "), "{e}");
        }
        assert!(seconds("--grace", -0.5, true).is_err());
        assert_eq!(
            clock_time("--walltime", "1:00:30").unwrap(),
            Duration::from_secs(3630)
        );
        assert_eq!(
            clock_time("--walltime", "90").unwrap(),
            Duration::from_secs(90)
        );
        for bad in [
            "soon",
            "1:-5:00",
            "1:2:3:4",
            "1e300",
            "99999999:00:00",
            "nan",
        ] {
            assert!(clock_time("--walltime", bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn rank_counts_are_capped() {
        assert!(ranks(4, Some(2), false).is_ok());
        assert!(ranks(8, Some(1), false).is_ok());
        let e = ranks(100_000, Some(2), false).unwrap_err();
        assert!(e.contains("--oversubscribe") && e.contains("2 CPUs"), "{e}");
        assert!(ranks(100, Some(2), true).is_ok());
        assert!(ranks(100_000, Some(2), true).is_err());
        assert!(ranks(1 << 32, None, false).is_err());
        assert!(ranks(100_000, None, false).is_ok());
        assert!(per_node("--gpus-per-node", 1 << 32).is_err());
        assert!(per_node("--ppn", 12).is_ok());
    }
}

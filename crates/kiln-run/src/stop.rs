//! kiln's stop request to the ranks under a launcher: `$KILN_PROGRESS_DIR/stop` holds one line
//! `<signal> <unix_time> [<attempt>]`. `kiln launch` writes it when it is asked to stop
//! (SIGTERM, SIGINT, SIGUSR1) or ends an attempt; every `kiln launch --as-rank` shim polls it
//! and signals its own rank, if the request is addressed to its attempt
//! ([`crate::ATTEMPT_ENV`]). The address lets the request stay after its attempt ended: an
//! earlier attempt's shim that has not read its SIGKILL yet still finds it when the next
//! attempt has already started, whose shims leave it alone.
//!
//! Signalling the launcher (mpirun, srun, mpiexec) instead would let the launcher decide how
//! the ranks end: OpenMPI's mpirun SIGKILLs its ranks a moment after forwarding a SIGTERM, so
//! ranks that were checkpointing died before they could exit 75 or record how they ended.

use crate::beacon::BeaconError;
use crate::layout;
use std::path::Path;

/// A stop request as written by [`write_stop_request`].
#[derive(Debug, Clone, PartialEq)]
pub struct StopRecord {
    /// The signal each rank is to receive.
    pub signal: i32,
    /// When kiln was asked to stop, Unix seconds.
    pub time: f64,
    /// The attempt whose ranks are to receive it (`None`: any rank).
    pub attempt: Option<String>,
}

impl StopRecord {
    /// Whether a rank of `attempt` (its [`crate::this_attempt`]) is to act on it.
    pub fn addressed_to(&self, attempt: Option<&str>) -> bool {
        match (self.attempt.as_deref(), attempt) {
            (Some(to), Some(me)) => to == me,
            _ => true,
        }
    }
}

/// Atomically writes `dir/stop` (temporary name, then rename), addressed to the ranks of
/// `attempt` (`None`: to any rank).
pub fn write_stop_request(
    dir: &Path,
    signal: i32,
    time: f64,
    attempt: Option<&str>,
) -> Result<(), BeaconError> {
    let path = dir.join(layout::STOP_REQUEST);
    let io = |source| BeaconError::Io {
        path: path.clone(),
        source,
    };
    let to = attempt.map_or(String::new(), |a| format!(" {a}"));
    let line = format!("{signal} {time:.3}{to}\n");
    crate::files::write_atomic(&path, line.as_bytes(), crate::files::Atomic::RECORD).map_err(io)
}

/// The stop request in `dir`, if there is a readable one.
pub fn read_stop_request(dir: &Path) -> Option<StopRecord> {
    use std::io::Read;
    let path = dir.join(layout::STOP_REQUEST);
    if !std::fs::symlink_metadata(&path).ok()?.is_file() {
        return None;
    }
    let mut text = String::new();
    std::fs::File::open(path)
        .ok()?
        .take(256)
        .read_to_string(&mut text)
        .ok()?;
    let mut it = text.split_whitespace();
    let signal = it.next()?.parse().ok()?;
    let time = it.next()?.parse().ok()?;
    let attempt = it.next().map(str::to_string);
    Some(StopRecord {
        signal,
        time,
        attempt,
    })
}

/// Removes the stop request of an earlier attempt, if any.
pub fn clear_stop_request(dir: &Path) {
    let _ = std::fs::remove_file(dir.join(layout::STOP_REQUEST));
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stop_requests_round_trip_and_are_cleared() {
        let dir = tempfile::tempdir().unwrap();
        assert_eq!(read_stop_request(dir.path()), None);
        write_stop_request(dir.path(), 15, 12.5, None).unwrap();
        let any = StopRecord {
            signal: 15,
            time: 12.5,
            attempt: None,
        };
        assert_eq!(read_stop_request(dir.path()), Some(any.clone()));
        assert!(any.addressed_to(Some("a")) && any.addressed_to(None));
        write_stop_request(dir.path(), 9, 13.0, Some("a")).unwrap();
        let to_a = read_stop_request(dir.path()).unwrap();
        assert_eq!((to_a.signal, to_a.attempt.as_deref()), (9, Some("a")));
        assert!(
            to_a.addressed_to(Some("a")),
            "its own attempt's ranks act on it"
        );
        assert!(
            !to_a.addressed_to(Some("b")),
            "the next attempt's leave it alone"
        );
        assert!(
            to_a.addressed_to(None),
            "a rank without a token acts on any"
        );
        std::fs::write(dir.path().join(layout::STOP_REQUEST), "garbage").unwrap();
        assert_eq!(read_stop_request(dir.path()), None);
        clear_stop_request(dir.path());
        assert!(!dir.path().join(layout::STOP_REQUEST).exists());
    }
}

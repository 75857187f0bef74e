//! kiln's stop request to the ranks under a launcher: `$KILN_PROGRESS_DIR/stop` holds one line
//! `<signal> <unix_time>`. `kiln launch` writes it when it is asked to stop (SIGTERM, SIGINT,
//! SIGUSR1); every `kiln launch --as-rank` shim polls it and signals its own rank.
//!
//! Signalling the launcher (mpirun, srun, mpiexec) instead would let the launcher decide how
//! the ranks end: OpenMPI's mpirun SIGKILLs its ranks a moment after forwarding a SIGTERM, so
//! ranks that were checkpointing died before they could exit 75 or record how they ended.

use crate::BeaconError;
use crate::layout;
use std::path::Path;

/// A stop request as written by [`write_stop_request`].
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct StopRecord {
    /// The signal each rank is to receive.
    pub signal: i32,
    /// When kiln was asked to stop, Unix seconds.
    pub time: f64,
}

/// Atomically writes `dir/stop` (temporary name, then rename).
pub fn write_stop_request(dir: &Path, signal: i32, time: f64) -> Result<(), BeaconError> {
    let path = dir.join(layout::STOP_REQUEST);
    let io = |source| BeaconError::Io {
        path: path.clone(),
        source,
    };
    let line = format!("{signal} {time:.3}\n");
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
    Some(StopRecord { signal, time })
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
        write_stop_request(dir.path(), 15, 12.5).unwrap();
        assert_eq!(
            read_stop_request(dir.path()),
            Some(StopRecord {
                signal: 15,
                time: 12.5
            })
        );
        std::fs::write(dir.path().join(layout::STOP_REQUEST), "garbage").unwrap();
        assert_eq!(read_stop_request(dir.path()), None);
        clear_stop_request(dir.path());
        assert!(!dir.path().join(layout::STOP_REQUEST).exists());
    }
}

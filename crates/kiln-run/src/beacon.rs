//! Per-rank progress beacons: `$KILN_PROGRESS_DIR/rank-<R>` holds one line
//! `<step> <phase> <unix_time>`. Any program may write them; kiln's trainer does every step.
//! A supervisor compares them across ranks to name the rank that stopped advancing.

use std::path::{Path, PathBuf};

/// Environment variable naming the directory beacons are written to.
pub const PROGRESS_DIR_ENV: &str = "KILN_PROGRESS_DIR";

/// One rank's last reported progress.
#[derive(Debug, Clone, PartialEq)]
pub struct Beacon {
    /// The rank (from the file name).
    pub rank: usize,
    /// Last step reached.
    pub step: u64,
    /// What the rank was doing (`train`, `checkpoint`, `eval`, ...).
    pub phase: String,
    /// When it was written, Unix seconds.
    pub time: f64,
}

/// Errors reading or writing beacons.
#[derive(Debug, thiserror::Error)]
pub enum BeaconError {
    /// Filesystem error.
    #[error("progress beacon {path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The cause.
        source: std::io::Error,
    },
}

/// Atomically replaces `dir/rank-<rank>` with `<step> <phase> <time>` (write to a temporary
/// name, then rename: a reader never sees a half-written line).
pub fn write_beacon(
    dir: &Path,
    rank: usize,
    step: u64,
    phase: &str,
    time: f64,
) -> Result<(), BeaconError> {
    let path = dir.join(format!("rank-{rank}"));
    let tmp = dir.join(format!(".rank-{rank}.tmp"));
    let io = |source| BeaconError::Io {
        path: path.clone(),
        source,
    };
    std::fs::write(&tmp, format!("{step} {phase} {time:.3}\n")).map_err(io)?;
    std::fs::rename(&tmp, &path).map_err(io)
}

/// Parses one beacon line; `None` if it is not `<step> <phase> <time>`.
fn parse_beacon(rank: usize, text: &str) -> Option<Beacon> {
    let mut it = text.split_whitespace();
    let step = it.next()?.parse().ok()?;
    let phase = it.next()?.to_string();
    let time = it.next()?.parse().ok()?;
    Some(Beacon {
        rank,
        step,
        phase,
        time,
    })
}

/// Reads every `rank-<R>` beacon in `dir`, sorted by rank. Files that do not parse are
/// ignored (a foreign program may write garbage; it must not crash the supervisor).
pub fn read_beacons(dir: &Path) -> Vec<Beacon> {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return Vec::new();
    };
    let mut beacons: Vec<Beacon> = entries
        .filter_map(Result::ok)
        .filter_map(|e| {
            let name = e.file_name().into_string().ok()?;
            let rank = name.strip_prefix("rank-")?.parse().ok()?;
            let text = std::fs::read_to_string(e.path()).ok()?;
            parse_beacon(rank, &text)
        })
        .collect();
    beacons.sort_by_key(|b| b.rank);
    beacons
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn beacons_round_trip_and_garbage_is_ignored() {
        let dir = tempfile::tempdir().unwrap();
        write_beacon(dir.path(), 1, 12, "train", 100.5).unwrap();
        write_beacon(dir.path(), 0, 13, "checkpoint", 101.0).unwrap();
        std::fs::write(dir.path().join("rank-7"), b"\xff\xfe garbage").unwrap();
        let b = read_beacons(dir.path());
        assert_eq!(b.len(), 2);
        assert_eq!(
            (b[0].rank, b[0].step, b[0].phase.as_str()),
            (0, 13, "checkpoint")
        );
        assert_eq!((b[1].rank, b[1].step, b[1].time), (1, 12, 100.5));
    }
}

//! Per-rank progress beacons: `$KILN_PROGRESS_DIR/rank-<R>` holds one line
//! `<step> <phase> <unix_time> <host> [<work_s>]`. Any program may write them (the host is
//! optional, for writers that do not know it); kiln's trainer does every step, with the
//! seconds its rank worked on the step before (not counting the wait for its peers in the
//! gradient exchange), from which `kiln launch` names stragglers. A supervisor compares them
//! across ranks to name the rank that stopped advancing, and the host it ran on.
//!
//! Next to them, `exit-<R>` records how rank R's program ended (`kiln launch --as-rank`
//! writes it under a launcher), so a job is classified by its ranks' exits even when the
//! launcher itself does not say.

use crate::files::{Atomic, write_atomic};
use crate::layout;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

/// Environment variable naming the directory beacons are written to.
pub const PROGRESS_DIR_ENV: &str = "KILN_PROGRESS_DIR";

/// This process's progress directory (`$KILN_PROGRESS_DIR`); `None` when it is unset or empty
/// (an empty value means none, never the current directory).
pub fn progress_dir() -> Option<PathBuf> {
    std::env::var_os(PROGRESS_DIR_ENV)
        .filter(|d| !d.is_empty())
        .map(PathBuf::from)
}

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
    /// The host the rank runs on, when the writer said.
    pub host: Option<String>,
    /// Seconds the rank worked on its last step, without waiting for its peers, when the
    /// writer said (kiln's trainer does).
    pub work_s: Option<f64>,
}

/// Variable that overrides the host name recorded in beacons and exit records.
pub const HOST_ENV: &str = "KILN_HOST";

/// Variable naming the attempt a rank belongs to: `kiln launch` sets a fresh token for every
/// attempt, and the rank shim writes it into its exit, liveness and lost records. An earlier
/// attempt's shim that outlives its launcher for a moment (srun killed, its rank's shim still
/// polling) may write a record after the next attempt started; the token tells it apart.
pub const ATTEMPT_ENV: &str = "KILN_ATTEMPT";

/// This process's attempt token (`$KILN_ATTEMPT`, whitespace removed), if it has one.
pub fn this_attempt() -> Option<&'static str> {
    static ATTEMPT: OnceLock<Option<String>> = OnceLock::new();
    ATTEMPT
        .get_or_init(|| {
            let v = std::env::var(ATTEMPT_ENV).ok()?;
            let v: String = v.split_whitespace().collect();
            (!v.is_empty()).then_some(v)
        })
        .as_deref()
}

/// ` <token>` for a record's last field, or nothing without a token.
pub(crate) fn attempt_field() -> String {
    this_attempt().map_or(String::new(), |a| format!(" {a}"))
}

/// The name of the host this process runs on, as the scheduler knows it: `$KILN_HOST`, else
/// Slurm's `SLURMD_NODENAME` (several Slurm nodes may share one OS hostname), else the OS
/// host name. Whitespace is replaced so the name stays one field of a beacon line.
pub fn this_host() -> &'static str {
    static HOST: OnceLock<String> = OnceLock::new();
    HOST.get_or_init(|| {
        let from_env = |k: &str| std::env::var(k).ok().filter(|v| !v.trim().is_empty());
        let name = from_env(HOST_ENV)
            .or_else(|| from_env("SLURMD_NODENAME"))
            .or_else(os_hostname)
            .unwrap_or_else(|| "unknown-host".into());
        name.split_whitespace().collect::<Vec<_>>().join("_")
    })
}

fn os_hostname() -> Option<String> {
    let mut buf = [0u8; 256];
    // SAFETY: gethostname writes at most buf.len() bytes into the buffer we own.
    let rc = unsafe { libc::gethostname(buf.as_mut_ptr().cast(), buf.len()) };
    if rc != 0 {
        return None;
    }
    let end = buf.iter().position(|&b| b == 0).unwrap_or(buf.len());
    let name = String::from_utf8_lossy(&buf[..end]).trim().to_string();
    (!name.is_empty()).then_some(name)
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

/// Atomically replaces `dir/rank-<rank>` with `<step> <phase> <time> <host>` (write to a
/// temporary name, then rename: a reader never sees a half-written line). The host is
/// [`this_host`].
pub fn write_beacon(
    dir: &Path,
    rank: usize,
    step: u64,
    phase: &str,
    time: f64,
) -> Result<(), BeaconError> {
    write_beacon_with_work(dir, rank, step, phase, time, None)
}

/// [`write_beacon`], with the seconds the rank worked on its last step (`work_s`, which
/// `kiln launch` compares across ranks to name a straggler).
pub fn write_beacon_with_work(
    dir: &Path,
    rank: usize,
    step: u64,
    phase: &str,
    time: f64,
    work_s: Option<f64>,
) -> Result<(), BeaconError> {
    write_at(dir, rank, step, phase, time, work_s)?;
    // How the collective mark rewrites this beacon (see [`crate::waiting_mark`]).
    let dir = dir.to_path_buf();
    crate::waiting_mark::wrote(
        phase,
        Box::new(move |phase| {
            write_at(&dir, rank, step, phase, crate::events::unix_time(), work_s).is_ok()
        }),
    );
    Ok(())
}

fn write_at(
    dir: &Path,
    rank: usize,
    step: u64,
    phase: &str,
    time: f64,
    work_s: Option<f64>,
) -> Result<(), BeaconError> {
    let path = dir.join(layout::beacon(rank));
    let io = |source| BeaconError::Io {
        path: path.clone(),
        source,
    };
    let phase = if phase.is_empty() { "-" } else { phase };
    let phase = phase.split_whitespace().collect::<Vec<_>>().join("_");
    let work = work_s
        .filter(|w| w.is_finite() && *w >= 0.0)
        .map_or(String::new(), |w| format!(" {w:.6}"));
    let line = format!("{step} {phase} {time:.3} {}{work}\n", this_host());
    write_atomic(&path, line.as_bytes(), Atomic::RECORD).map_err(io)
}

/// Parses one beacon line; `None` if it is not `<step> <phase> <time> [<host>]`.
fn parse_beacon(rank: usize, text: &str) -> Option<Beacon> {
    let mut it = text.split_whitespace();
    let step = it.next()?.parse().ok()?;
    let phase = it.next()?.to_string();
    let time = it.next()?.parse().ok()?;
    let host = it.next().map(str::to_string);
    let work_s = it.next().and_then(|w| w.parse().ok());
    Some(Beacon {
        rank,
        step,
        phase,
        time,
        host,
        work_s,
    })
}

/// How one rank's program ended, as `kiln launch --as-rank` saw it.
#[derive(Debug, Clone, PartialEq)]
pub struct ExitRecord {
    /// The rank (from the file name).
    pub rank: usize,
    /// Its exit code, if it exited.
    pub code: Option<i32>,
    /// The signal that killed it, if one did.
    pub signal: Option<i32>,
    /// When it ended, Unix seconds.
    pub time: f64,
    /// The host it ran on.
    pub host: String,
    /// The attempt token of its writer ([`ATTEMPT_ENV`]), if it had one.
    pub attempt: Option<String>,
}

impl ExitRecord {
    /// The exit code as a shell reports it (128+N for a signal).
    pub fn shell_code(&self) -> i32 {
        match (self.code, self.signal) {
            (Some(c), _) => c,
            (None, Some(s)) => 128 + s,
            (None, None) => 1,
        }
    }
}

/// Atomically writes `dir/exit-<rank>`: `<code|-> <signal|-> <time> <host> [<attempt>]`.
pub fn write_exit_record(
    dir: &Path,
    rank: usize,
    code: Option<i32>,
    signal: Option<i32>,
    time: f64,
) -> Result<(), BeaconError> {
    let path = dir.join(layout::exit_record(rank));
    let io = |source| BeaconError::Io {
        path: path.clone(),
        source,
    };
    let field = |v: Option<i32>| v.map_or("-".to_string(), |v| v.to_string());
    let line = format!(
        "{} {} {time:.3} {}{}\n",
        field(code),
        field(signal),
        this_host(),
        attempt_field()
    );
    write_atomic(&path, line.as_bytes(), Atomic::RECORD).map_err(io)
}

fn parse_exit_record(rank: usize, text: &str) -> Option<ExitRecord> {
    let mut it = text.split_whitespace();
    let opt = |s: &str| -> Option<Option<i32>> {
        if s == "-" {
            Some(None)
        } else {
            s.parse().ok().map(Some)
        }
    };
    let code = opt(it.next()?)?;
    let signal = opt(it.next()?)?;
    let time = it.next()?.parse().ok()?;
    let host = it.next()?.to_string();
    Some(ExitRecord {
        rank,
        code,
        signal,
        time,
        host,
        attempt: it.next().map(str::to_string),
    })
}

/// Reads every `exit-<R>` record in `dir`, sorted by rank; unparsable files are ignored.
pub fn read_exit_records(dir: &(impl RankFiles + ?Sized)) -> Vec<ExitRecord> {
    let mut records: Vec<ExitRecord> = (dir.rank_files(layout::EXIT_RECORD_PREFIX))
        .into_iter()
        .filter_map(|(rank, text)| parse_exit_record(rank, &text))
        .collect();
    records.sort_by_key(|r| r.rank);
    records
}

/// What the operating system says about a rank's process: written every half second by
/// `kiln launch --as-rank`, so a hang can be pinned on the rank that does nothing (stopped,
/// or blocked without using the CPU) while the others wait for it in a collective (where MPI
/// spins).
#[derive(Debug, Clone, PartialEq)]
pub struct Liveness {
    /// The rank (from the file name).
    pub rank: usize,
    /// The process state letter of `/proc/<pid>/stat` (`R`, `S`, `D`, `T` stopped, ...).
    pub state: char,
    /// CPU time used so far, in clock ticks (user + system, all threads).
    pub cpu_ticks: u64,
    /// When it was sampled, Unix seconds.
    pub time: f64,
    /// The host.
    pub host: String,
    /// The attempt token of its writer ([`ATTEMPT_ENV`]), if it had one.
    pub attempt: Option<String>,
}

/// Atomically writes `dir/live-<rank>`: `<state> <cpu_ticks> <time> <host> [<attempt>]`.
pub fn write_liveness(
    dir: &Path,
    rank: usize,
    state: char,
    cpu_ticks: u64,
    time: f64,
) -> Result<(), BeaconError> {
    let path = dir.join(layout::liveness(rank));
    let io = |source| BeaconError::Io {
        path: path.clone(),
        source,
    };
    let state = if state.is_ascii_alphabetic() {
        state
    } else {
        '?'
    };
    let line = format!(
        "{state} {cpu_ticks} {time:.3} {}{}\n",
        this_host(),
        attempt_field()
    );
    write_atomic(&path, line.as_bytes(), Atomic::RECORD).map_err(io)
}

/// Reads every `live-<R>` record in `dir`, sorted by rank; unparsable files are ignored.
pub fn read_liveness(dir: &(impl RankFiles + ?Sized)) -> Vec<Liveness> {
    let mut v: Vec<Liveness> = (dir.rank_files(layout::LIVENESS_PREFIX))
        .into_iter()
        .filter_map(|(rank, text)| {
            let mut it = text.split_whitespace();
            let state = it.next()?.chars().next()?;
            let cpu_ticks = it.next()?.parse().ok()?;
            let time = it.next()?.parse().ok()?;
            let host = it.next()?.to_string();
            Some(Liveness {
                rank,
                state,
                cpu_ticks,
                time,
                host,
                attempt: it.next().map(str::to_string),
            })
        })
        .collect();
    v.sort_by_key(|l| l.rank);
    v
}

/// Where the ranks' records are read from: a progress directory (the `files` control plane),
/// or what the node agents sent the supervisor (`kiln launch`'s `tcp` plane keeps them in
/// memory under the same file names).
pub trait RankFiles {
    /// `(rank, contents)` of every `<prefix><rank>` record, in no particular order.
    fn rank_files(&self, prefix: &str) -> Vec<(usize, String)>;
}

impl RankFiles for Path {
    fn rank_files(&self, prefix: &str) -> Vec<(usize, String)> {
        read_rank_files(self, prefix)
    }
}

impl RankFiles for PathBuf {
    fn rank_files(&self, prefix: &str) -> Vec<(usize, String)> {
        read_rank_files(self, prefix)
    }
}

/// The largest record read: a beacon or record is one short line, and the directory may be
/// shared with foreign programs.
pub const MAX_RECORD: u64 = 4096;

/// `(rank, contents)` of every readable `<prefix><rank>` file in `dir`. Reads are bounded
/// ([`MAX_RECORD`]).
pub(crate) fn read_rank_files(dir: &Path, prefix: &str) -> Vec<(usize, String)> {
    use std::io::Read;
    let Ok(entries) = std::fs::read_dir(dir) else {
        return Vec::new();
    };
    entries
        .filter_map(Result::ok)
        .filter_map(|e| {
            let name = e.file_name().into_string().ok()?;
            let rank = record_rank(&name, prefix)?;
            if !e.file_type().ok()?.is_file() {
                return None;
            }
            let mut text = String::new();
            std::fs::File::open(e.path())
                .ok()?
                .take(MAX_RECORD)
                .read_to_string(&mut text)
                .ok()?;
            Some((rank, text))
        })
        .collect()
}

/// The prefixes of the ranks' record files: beacons, exit, liveness and lost records.
pub const RECORD_PREFIXES: [&str; 4] = [
    layout::BEACON_PREFIX,
    layout::EXIT_RECORD_PREFIX,
    layout::LIVENESS_PREFIX,
    layout::LOST_PREFIX,
];

/// The rank of `name` if it is a `<prefix><rank>` file (decimal digits only).
pub fn record_rank(name: &str, prefix: &str) -> Option<usize> {
    let rank = name.strip_prefix(prefix)?;
    if rank.is_empty() || !rank.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    rank.parse().ok()
}

/// The kind (one of [`RECORD_PREFIXES`]) and rank of a rank's record file (`rank-3`,
/// `exit-0`, ...): what a node agent forwards.
pub fn parse_record_name(name: &str) -> Option<(&'static str, usize)> {
    RECORD_PREFIXES
        .iter()
        .find_map(|p| Some((*p, record_rank(name, p)?)))
}

/// Whether `name` is a rank's record file ([`parse_record_name`]).
pub fn is_record_name(name: &str) -> bool {
    parse_record_name(name).is_some()
}

/// Removes every beacon and exit record (and their temporary files) from `dir`.
pub fn clear_rank_files(dir: &Path) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for e in entries.filter_map(Result::ok) {
        let name = e.file_name().to_string_lossy().into_owned();
        let ours = (RECORD_PREFIXES.iter()).any(|p| {
            name.starts_with(p) || name.strip_prefix('.').is_some_and(|n| n.starts_with(p))
        });
        if ours {
            let _ = std::fs::remove_file(e.path());
        }
    }
}

/// Reads every `rank-<R>` beacon in `dir`, sorted by rank. Files that do not parse are
/// ignored (a foreign program may write garbage; it must not crash the supervisor).
pub fn read_beacons(dir: &(impl RankFiles + ?Sized)) -> Vec<Beacon> {
    let mut beacons: Vec<Beacon> = (dir.rank_files(layout::BEACON_PREFIX))
        .into_iter()
        .filter_map(|(rank, text)| parse_beacon(rank, &text))
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
        assert_eq!(b[0].host.as_deref(), Some(this_host()));
        // A writer that does not know its host (the format before hosts) still parses.
        std::fs::write(dir.path().join("rank-3"), "4 train 99.0\n").unwrap();
        let b = read_beacons(dir.path());
        assert_eq!((b[2].rank, b[2].host.clone(), b[2].work_s), (3, None, None));
        // The work time of the step before, when the writer says.
        write_beacon_with_work(dir.path(), 4, 9, "train", 102.0, Some(0.25)).unwrap();
        let b = read_beacons(dir.path());
        assert_eq!((b[3].rank, b[3].work_s), (4, Some(0.25)));
    }

    #[test]
    fn exit_records_round_trip_and_are_cleared() {
        let dir = tempfile::tempdir().unwrap();
        write_exit_record(dir.path(), 2, Some(78), None, 5.0).unwrap();
        write_exit_record(dir.path(), 0, None, Some(9), 6.0).unwrap();
        write_beacon(dir.path(), 0, 1, "train", 1.0).unwrap();
        std::fs::write(dir.path().join("exit-9"), "garbage").unwrap();
        std::fs::write(dir.path().join("exit-3"), "- 9 8.000 n1 4d2-1a-0\n").unwrap();
        let mut r = read_exit_records(dir.path());
        assert_eq!(r.len(), 3);
        let tagged = r.pop().unwrap();
        assert_eq!(
            (tagged.rank, tagged.attempt.as_deref()),
            (3, Some("4d2-1a-0")),
            "the writer's attempt token is read back"
        );
        assert_eq!(r[0].attempt, None, "no $KILN_ATTEMPT here: no token");
        assert_eq!((r[0].rank, r[0].shell_code()), (0, 137));
        assert_eq!(
            (r[1].rank, r[1].code, r[1].host.as_str()),
            (2, Some(78), this_host())
        );
        write_liveness(dir.path(), 1, 'T', 42, 7.0).unwrap();
        let l = read_liveness(dir.path());
        assert_eq!((l[0].rank, l[0].state, l[0].cpu_ticks), (1, 'T', 42));
        std::fs::write(dir.path().join("unrelated"), "x").unwrap();
        clear_rank_files(dir.path());
        let left: Vec<_> = std::fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(left, ["unrelated"]);
    }
}

//! Node scope's hosts: the active set an attempt runs on, the spares that replace failed
//! hosts, and the quarantine file that keeps a bad host out of this run and of later jobs.

use kiln_topology::Host;
use serde::{Deserialize, Serialize};
use std::io::{BufRead, Write};
use std::path::{Path, PathBuf};

/// Whether two names are the same host: equal, or equal up to the domain
/// (`x1000c0s0b0n0` and `x1000c0s0b0n0.hsn.cm` are one host).
pub fn same_host(a: &str, b: &str) -> bool {
    let short = |s: &str| s.split('.').next().unwrap_or(s).to_ascii_lowercase();
    a.eq_ignore_ascii_case(b) || short(a) == short(b)
}

/// Active and spare hosts of a node-scope launch.
#[derive(Debug, Clone, PartialEq)]
pub struct HostPool {
    /// Hosts the next attempt runs on, in rank order.
    pub active: Vec<Host>,
    /// Healthy hosts kept to replace failed ones, used first to last.
    pub spares: Vec<Host>,
    /// Fewest active hosts the job may shrink to when no spare is left (the program must be
    /// able to resume on fewer ranks); at least 1.
    pub min_active: usize,
}

/// What replacing a failed host did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Replacement {
    /// A spare took its place (same rank positions).
    Swapped(String),
    /// No spare was left; the job goes on with one host fewer.
    Dropped,
    /// No spare was left and the job may not shrink further.
    Exhausted,
}

impl HostPool {
    /// Replaces `host` (an active host) by the first spare, or drops it when no spare is left
    /// and the pool may shrink. A host that is not active is left alone ([`Replacement::Swapped`]
    /// is never returned for it).
    pub fn replace(&mut self, host: &str) -> Replacement {
        let Some(at) = self.active.iter().position(|h| h.name == host) else {
            return Replacement::Exhausted;
        };
        if !self.spares.is_empty() {
            let spare = self.spares.remove(0);
            let name = spare.name.clone();
            self.active[at] = spare;
            return Replacement::Swapped(name);
        }
        if self.active.len() > self.min_active.max(1) {
            self.active.remove(at);
            return Replacement::Dropped;
        }
        Replacement::Exhausted
    }

    /// Names of the active hosts.
    pub fn active_names(&self) -> Vec<String> {
        self.active.iter().map(|h| h.name.clone()).collect()
    }

    /// Names of the spare hosts.
    pub fn spare_names(&self) -> Vec<String> {
        self.spares.iter().map(|h| h.name.clone()).collect()
    }
}

/// One line of a quarantine file.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct QuarantineEntry {
    /// Unix time it was quarantined.
    pub time: f64,
    /// The host.
    pub host: String,
    /// Why (`node-failure`, `hang`, `crash`, `replica-mismatch`, `blind`).
    pub cause: String,
    /// The evidence, for the operator.
    pub evidence: String,
    /// The batch job it happened in, if any.
    #[serde(default)]
    pub job_id: Option<String>,
    /// The run directory it happened in.
    #[serde(default)]
    pub run_dir: Option<PathBuf>,
}

/// Errors of quarantine files.
#[derive(Debug, thiserror::Error)]
pub enum QuarantineError {
    /// Unreadable or unwritable.
    #[error("quarantine file {path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The cause.
        source: std::io::Error,
    },
    /// A line is not a quarantine entry.
    #[error(
        "quarantine file {path} line {line}: {message} (each line is a JSON object with time, host, cause, evidence)"
    )]
    Parse {
        /// The file.
        path: PathBuf,
        /// 1-based line.
        line: usize,
        /// What is wrong.
        message: String,
    },
}

/// The most bytes read from a quarantine file: a few hundred bytes per host, and the file
/// may be shared with other jobs (or replaced by something else).
const MAX_QUARANTINE_BYTES: u64 = 16 << 20;

/// Reads a quarantine file (absent: empty). A torn last line (a writer killed mid-line) is
/// skipped; any other malformed line is an error naming it.
pub fn read_quarantine(path: &Path) -> Result<Vec<QuarantineEntry>, QuarantineError> {
    use std::io::Read;
    let io = |source| QuarantineError::Io {
        path: path.to_path_buf(),
        source,
    };
    // A FIFO, device or directory is refused without blocking on it.
    let file = match kiln_run::files::open_regular(path) {
        Ok(f) => f,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(io(e)),
    };
    let lines: Vec<String> = std::io::BufReader::new(file.take(MAX_QUARANTINE_BYTES))
        .lines()
        .collect::<Result<_, _>>()
        .map_err(io)?;
    let mut out = Vec::new();
    for (i, line) in lines.iter().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        match serde_json::from_str::<QuarantineEntry>(line) {
            Ok(e) if !is_host_name(&e.host) => {
                return Err(QuarantineError::Parse {
                    path: path.to_path_buf(),
                    line: i + 1,
                    message: format!(
                        "host {:?} is not a host name (letters, digits, '-', '.', '_')",
                        e.host
                    ),
                });
            }
            Ok(e) => out.push(e),
            Err(_) if i + 1 == lines.len() => {}
            Err(e) => {
                return Err(QuarantineError::Parse {
                    path: path.to_path_buf(),
                    line: i + 1,
                    message: e.to_string(),
                });
            }
        }
    }
    Ok(out)
}

/// Whether `name` can be a host name: what hostfiles accept, and nothing that could break a
/// batch-script directive or a `--exclude` list.
fn is_host_name(name: &str) -> bool {
    !name.is_empty()
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '.' | '_'))
}

/// Appends one entry as one line (one `write` with O_APPEND: concurrent jobs appending to a
/// shared file never interleave).
pub fn append_quarantine(path: &Path, entry: &QuarantineEntry) -> Result<(), QuarantineError> {
    let io = |source| QuarantineError::Io {
        path: path.to_path_buf(),
        source,
    };
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir).map_err(io)?;
    }
    let mut line = serde_json::to_vec(entry).map_err(|e| io(std::io::Error::other(e)))?;
    line.push(b'\n');
    kiln_run::files::open_append_regular(path)
        .and_then(|mut f| f.write_all(&line))
        .map_err(io)
}

/// The distinct hosts of several quarantine files.
pub fn quarantined_hosts(paths: &[PathBuf]) -> Result<Vec<String>, QuarantineError> {
    let mut hosts: Vec<String> = Vec::new();
    for p in paths {
        for e in read_quarantine(p)? {
            if !hosts.contains(&e.host) {
                hosts.push(e.host);
            }
        }
    }
    Ok(hosts)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn h(n: &str) -> Host {
        Host {
            name: n.into(),
            slots: 1,
        }
    }

    #[test]
    fn spares_replace_in_place_then_the_pool_shrinks_to_its_minimum() {
        let mut p = HostPool {
            active: vec![h("n1"), h("n2"), h("n3")],
            spares: vec![h("n4")],
            min_active: 2,
        };
        assert_eq!(p.replace("n2"), Replacement::Swapped("n4".into()));
        assert_eq!(p.active_names(), ["n1", "n4", "n3"]);
        assert_eq!(p.replace("n3"), Replacement::Dropped);
        assert_eq!(p.active_names(), ["n1", "n4"]);
        assert_eq!(p.replace("n1"), Replacement::Exhausted);
        assert_eq!(p.replace("n9"), Replacement::Exhausted);
    }

    #[test]
    fn quarantine_round_trips_and_names_a_bad_line() {
        let dir = tempfile::tempdir().unwrap();
        let f = dir.path().join("q.jsonl");
        assert!(read_quarantine(&f).unwrap().is_empty());
        let e = QuarantineEntry {
            time: 1.0,
            host: "n2".into(),
            cause: "node-failure".into(),
            evidence: "srun: error: Node failure on n2".into(),
            job_id: Some("7".into()),
            run_dir: None,
        };
        append_quarantine(&f, &e).unwrap();
        append_quarantine(&f, &e).unwrap();
        assert_eq!(read_quarantine(&f).unwrap().len(), 2);
        assert_eq!(quarantined_hosts(std::slice::from_ref(&f)).unwrap(), ["n2"]);
        // A host that could break a script directive or an --exclude list is refused.
        let hostile = QuarantineEntry {
            host: "n1\ntouch PWNED".into(),
            ..e.clone()
        };
        append_quarantine(&f, &hostile).unwrap();
        append_quarantine(&f, &e).unwrap();
        let err = read_quarantine(&f).unwrap_err().to_string();
        assert!(
            err.contains("line 3") && err.contains("not a host name"),
            "{err}"
        );
        std::fs::write(&f, "nonsense\n{\"time\":1}\n").unwrap();
        let err = read_quarantine(&f).unwrap_err().to_string();
        assert!(err.contains("line 1"), "{err}");
    }
}

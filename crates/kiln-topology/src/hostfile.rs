//! Hostfiles: PBS's `$PBS_NODEFILE` (one line per rank slot, hosts repeated), OpenMPI's
//! `host slots=N`, MPICH's `host:N`. Comments (`#`) and blank lines are skipped.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

/// One host and how many rank slots the hostfile gives it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Host {
    /// Host name as written.
    pub name: String,
    /// Slots: the sum of `slots=N`/`:N` counts, or how many times the host was listed.
    pub slots: usize,
}

/// Hosts in the order of their first appearance, repeats adding slots. Indexed by name: a
/// nodefile of a large allocation has a line per rank (10^5 and more), which a scan of the
/// hosts per line would merge in quadratic time.
#[derive(Debug, Default)]
pub(crate) struct HostTally {
    hosts: Vec<Host>,
    index: HashMap<String, usize>,
}

impl HostTally {
    /// Adds `slots` to `name`; `Err` with the host's slots so far if the sum overflows.
    pub(crate) fn add(&mut self, name: &str, slots: usize) -> Result<(), usize> {
        match self.index.get(name) {
            Some(&i) => {
                let h = &mut self.hosts[i];
                h.slots = h.slots.checked_add(slots).ok_or(h.slots)?;
            }
            None => {
                self.index.insert(name.to_string(), self.hosts.len());
                self.hosts.push(Host {
                    name: name.to_string(),
                    slots,
                });
            }
        }
        Ok(())
    }

    /// The hosts, in order of first appearance.
    pub(crate) fn into_hosts(self) -> Vec<Host> {
        self.hosts
    }
}

/// Why a hostfile could not be used. Every variant names the file; line errors name the line.
#[derive(Debug, thiserror::Error)]
pub enum HostfileError {
    /// The file could not be read.
    #[error("hostfile {path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The cause.
        source: std::io::Error,
    },
    /// A line is not `host`, `host slots=N` or `host:N`.
    #[error("hostfile {path} line {line}: {message}")]
    Line {
        /// The file.
        path: PathBuf,
        /// 1-based line number.
        line: usize,
        /// What is wrong and how to write it.
        message: String,
    },
    /// No host at all (empty, or only comments).
    #[error(
        "hostfile {path} lists no hosts (empty or only comments); write one host name per line"
    )]
    Empty {
        /// The file.
        path: PathBuf,
    },
}

/// The most bytes read from a hostfile: a line per rank slot of the largest allocation.
const MAX_HOSTFILE_BYTES: u64 = 256 * kiln_run::files::MIB;

/// Reads and parses a hostfile.
pub fn read_hostfile(path: &Path) -> Result<Vec<Host>, HostfileError> {
    // A FIFO or device is refused without blocking; a nodefile has a line per rank slot.
    let bytes = kiln_run::files::read_limited(path, MAX_HOSTFILE_BYTES, "a hostfile").map_err(
        |source| HostfileError::Io {
            path: path.to_path_buf(),
            source,
        },
    )?;
    parse_hostfile(path, &String::from_utf8_lossy(&bytes))
}

/// Parses hostfile text; `path` is only used in error messages. Hosts keep the order of their
/// first appearance; repeated lines add slots (that is how PBS expresses ranks per node).
pub fn parse_hostfile(path: &Path, text: &str) -> Result<Vec<Host>, HostfileError> {
    let mut hosts = HostTally::default();
    for (i, raw) in text.lines().enumerate() {
        let line_no = i + 1;
        let line = raw.split('#').next().unwrap_or("").trim();
        if line.is_empty() {
            continue;
        }
        let bad = |message: String| HostfileError::Line {
            path: path.to_path_buf(),
            line: line_no,
            message,
        };
        let mut words = line.split_whitespace();
        let first = words.next().unwrap_or("");
        let (name, mut slots) = match first.split_once(':') {
            Some((name, n)) => (
                name,
                Some(parse_slots(n).map_err(|m| bad(format!("{first:?}: {m}")))?),
            ),
            None => (first, None),
        };
        if let Some(c) = name
            .chars()
            .find(|c| !(c.is_ascii_alphanumeric() || matches!(c, '-' | '.' | '_')))
        {
            return Err(bad(format!(
                "{name:?} is not a host name (unexpected {c:?}); expected `host`, `host slots=N` or `host:N`"
            )));
        }
        if name.is_empty() {
            return Err(bad(format!("{line:?} has no host name")));
        }
        for word in words {
            match word.split_once('=') {
                Some(("slots", n)) => {
                    if slots.is_some() {
                        return Err(bad(format!("{line:?} gives the slot count twice")));
                    }
                    slots = Some(parse_slots(n).map_err(|m| bad(format!("{word:?}: {m}")))?);
                }
                // OpenMPI's other per-host keys constrain its own mapping; they do not change
                // how many ranks kiln places, so they are accepted and left to mpirun.
                Some(("max_slots" | "max-slots", n)) => {
                    parse_slots(n).map_err(|m| bad(format!("{word:?}: {m}")))?;
                }
                _ => {
                    return Err(bad(format!(
                        "unexpected {word:?} after the host name; expected `host`, `host slots=N` or `host:N`"
                    )));
                }
            }
        }
        let slots = slots.unwrap_or(1);
        hosts.add(name, slots).map_err(|before| {
            bad(format!(
                "{name:?} has {before} slots already; {slots} more overflow the slot count"
            ))
        })?;
    }
    let hosts = hosts.into_hosts();
    if hosts.is_empty() {
        return Err(HostfileError::Empty {
            path: path.to_path_buf(),
        });
    }
    Ok(hosts)
}

fn parse_slots(n: &str) -> Result<usize, String> {
    match n.parse::<usize>() {
        Ok(0) => Err("the slot count must be at least 1".into()),
        Ok(v) => Ok(v),
        Err(_) => Err(format!("{n:?} is not a whole number of slots")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn parse(text: &str) -> Result<Vec<Host>, HostfileError> {
        parse_hostfile(Path::new("hosts.txt"), text)
    }

    #[test]
    fn pbs_nodefile_repeats_count_as_slots() {
        let h = parse("x1\nx1\nx2\nx1\nx2\n").unwrap();
        assert_eq!(
            h,
            [
                Host {
                    name: "x1".into(),
                    slots: 3
                },
                Host {
                    name: "x2".into(),
                    slots: 2
                }
            ]
        );
    }

    #[test]
    fn openmpi_and_mpich_forms_and_comments() {
        let h = parse("# cluster\n\nnode1 slots=4\nnode2:2  # spare\nnode3 slots=2 max_slots=8\n")
            .unwrap();
        let got: Vec<_> = h.iter().map(|h| (h.name.as_str(), h.slots)).collect();
        assert_eq!(got, [("node1", 4), ("node2", 2), ("node3", 2)]);
    }

    #[test]
    fn errors_name_the_file_and_line() {
        for (text, needle) in [
            ("a\nb c\n", "line 2"),
            ("a slots=x\n", "line 1"),
            ("a\n\nb:0\n", "line 3"),
            ("a slots=1 slots=2\n", "twice"),
            ("h$st\n", "not a host name"),
            (":4\n", "no host name"),
        ] {
            let e = parse(text).unwrap_err().to_string();
            assert!(
                e.contains("hosts.txt") && e.contains(needle),
                "{text:?}: {e}"
            );
        }
        let e = parse("# nothing\n\n").unwrap_err().to_string();
        assert!(e.contains("hosts.txt") && e.contains("no hosts"), "{e}");
    }

    /// Fuzz finding (hostfile): slot counts that add up past `usize::MAX` wrapped (to 0 in
    /// a release build, a panic in a debug one).
    #[test]
    fn fuzz_slot_count_overflow_is_a_line_error() {
        let e = parse("a slots=18446744073709551615\nb\na\n")
            .unwrap_err()
            .to_string();
        assert!(e.contains("line 3") && e.contains("overflow"), "{e}");
        let e = parse("a:18446744073709551615\na:1\n")
            .unwrap_err()
            .to_string();
        assert!(e.contains("line 2") && e.contains("overflow"), "{e}");
    }

    /// Fuzz finding (hostlist, same merge): a nodefile with a line per rank of a large
    /// allocation merged its hosts in quadratic time (minutes for 10^5 distinct hosts).
    #[test]
    fn fuzz_large_nodefile_merges_in_linear_time() {
        let text: String = (0..200_000)
            .map(|i| format!("x{}\n", i % 100_000))
            .collect();
        let hosts = parse(&text).unwrap();
        assert_eq!(hosts.len(), 100_000);
        assert!(hosts.iter().all(|h| h.slots == 2));
        assert_eq!(hosts[99_999].name, "x99999");
    }

    proptest! {
        #[test]
        fn slots_add_up_and_order_is_first_appearance(
            lines in prop::collection::vec(("[a-d]", 1usize..5, 0u8..3), 1..20)
        ) {
            let text: String = lines
                .iter()
                .map(|(h, n, form)| match form {
                    0 => format!("{h}\n").repeat(*n),
                    1 => format!("{h} slots={n}\n"),
                    _ => format!("{h}:{n}  # c\n"),
                })
                .collect();
            let hosts = parse(&text).unwrap();
            let mut order: Vec<&str> = Vec::new();
            for (h, _, _) in &lines {
                if !order.contains(&h.as_str()) {
                    order.push(h);
                }
            }
            prop_assert_eq!(hosts.iter().map(|h| h.name.as_str()).collect::<Vec<_>>(), order);
            let total: usize = lines.iter().map(|(_, n, _)| n).sum();
            prop_assert_eq!(hosts.iter().map(|h| h.slots).sum::<usize>(), total);
        }

        #[test]
        fn never_panics_and_errors_name_a_real_line(text in "[a-z0-9:=# \\n\\t$]{0,80}") {
            if let Err(HostfileError::Line { line, .. }) = parse(&text) {
                prop_assert!(line >= 1 && line <= text.lines().count());
            }
        }
    }
}

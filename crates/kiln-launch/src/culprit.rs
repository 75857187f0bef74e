//! Naming the host behind a failed attempt. Swapping the rank-0 host blindly fixes about
//! one failure in ten; evidence does better. Sources, strongest first:
//! 1. the scheduler: a host that left the job or is down/drained;
//! 2. the attempt log, through [`LOG_PATTERNS`] (launcher and communication-library messages
//!    that name a host);
//! 3. the trainer's `replica_mismatch` event (the rank whose parameters disagree);
//! 4. per-rank progress beacons (which carry their host): the rank that stopped first in a hang;
//! 5. per-rank exit records: the rank that failed first in a crash.
//!
//! Evidence that points at every host at once (all ranks failed alike) names no culprit: that
//! is the program, not a node.

use crate::classify::Classification;
use crate::pool::same_host;
use crate::supervise::AttemptOutcome;
use regex::Regex;
use serde::Serialize;
use std::sync::OnceLock;

/// What went wrong with a host.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Cause {
    /// The node died or left the job.
    NodeFailure,
    /// A rank on it stopped advancing first.
    Hang,
    /// A rank on it crashed (failed first, or a peer reported it gone).
    Crash,
    /// Its rank's parameters disagreed with the other replicas.
    ReplicaMismatch,
    /// Its rank stayed slower than its peers (`--straggler-is-node-failure`).
    Straggler,
}

impl Cause {
    /// The name in events.
    pub fn name(self) -> &'static str {
        match self {
            Cause::NodeFailure => "node-failure",
            Cause::Hang => "hang",
            Cause::Crash => "crash",
            Cause::ReplicaMismatch => "replica-mismatch",
            Cause::Straggler => "straggler",
        }
    }
}

/// One host named by one piece of evidence.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Evidence {
    /// The host.
    pub host: String,
    /// What it is blamed for.
    pub cause: Cause,
    /// Where the evidence came from: `scheduler`, `log:<pattern>`, `event`, or for a rank one
    /// of [`crate::evidence_source`] (`beacon`, `output`, `liveness`, `heartbeat`,
    /// `exit-record`, `exit-status`).
    pub source: String,
    /// The line or fact, for the operator.
    pub detail: String,
}

/// A log pattern that names a host. `host` is the capture group holding it.
#[derive(Debug, Clone, Copy)]
pub struct LogPattern {
    /// Short name, used in events (`log:<name>`).
    pub name: &'static str,
    /// What it matches, for the documentation.
    pub what: &'static str,
    /// The regex (one line at a time); the named group `host` is the culprit.
    pub regex: &'static str,
    /// What the named host is blamed for.
    pub cause: Cause,
}

/// The table of log lines that name a culprit host. Extend it here: one row per message.
/// Lines that name collateral ranks (srun's `task N: Killed`/`Terminated` for the ranks it
/// stopped after the first failure) are deliberately absent.
pub const LOG_PATTERNS: &[LogPattern] = &[
    LogPattern {
        name: "slurm-node-failure",
        what: "srun: error: Node failure on nX",
        regex: r"srun: error: Node failure on (?P<host>[^\s,;]+)",
        cause: Cause::NodeFailure,
    },
    LogPattern {
        name: "slurm-task-exit",
        what: "srun: error: nX: task N: Exited with exit code C (the first rank to fail)",
        regex: r"srun: error: (?P<host>[^\s:]+): tasks? [0-9,\-]+: Exited with exit code [1-9]",
        cause: Cause::Crash,
    },
    LogPattern {
        name: "slurm-task-fault",
        what: "srun: error: nX: task N: Segmentation fault / Bus error / Aborted / Illegal instruction",
        regex: r"srun: error: (?P<host>[^\s:]+): tasks? [0-9,\-]+: (?:Segmentation fault|Bus error|Aborted|Illegal instruction|Floating point exception)",
        cause: Cause::Crash,
    },
    LogPattern {
        name: "pals-rank-signal",
        what: "PALS (mpiexec on HPE/Cray): hostX: rank N died from signal S",
        regex: r"(?P<host>[A-Za-z0-9][\w.\-]*): rank \d+ died from signal \d+",
        cause: Cause::Crash,
    },
    LogPattern {
        name: "pals-shepherd",
        what: "PALS: shepherd on hostX died from signal 9 (the node's launcher daemon is gone)",
        regex: r"shepherd (?:on |for )?\(?(?P<host>[A-Za-z0-9][\w.\-]*)\)?:? (?:\S+ )?died from signal",
        cause: Cause::NodeFailure,
    },
    LogPattern {
        name: "openmpi-rank-signal",
        what: "mpirun noticed that process rank N with PID P on node hostX exited on signal S",
        regex: r"process rank \d+ with PID \d+ on node (?P<host>[\w.\-]+) exited on signal",
        cause: Cause::Crash,
    },
    LogPattern {
        name: "openmpi-daemon-lost",
        what: "ORTE/PRTE lost a remote daemon: Remote daemon: [[..],N] on node hostX",
        regex: r"Remote daemon: \S+ on node (?P<host>[\w.\-]+)",
        cause: Cause::NodeFailure,
    },
    LogPattern {
        name: "gloo-peer-closed",
        what: "gloo: Connection closed by peer [hostX]:port",
        regex: r"Connection closed by peer \[(?P<host>[\w.\-]+)\]:\d+",
        cause: Cause::Crash,
    },
    LogPattern {
        name: "nccl-remote-closed",
        what: "NCCL WARN ... Connection closed by remote peer hostX<port>",
        regex: r"Connection closed by remote peer (?P<host>[\w.\-]+)<\d+>",
        cause: Cause::Crash,
    },
    LogPattern {
        name: "nccl-ib-completion",
        what: "NCCL WARN NET/IB : Got completion from peer hostX<port> with error",
        regex: r"NCCL WARN NET/IB ?: Got completion from peer (?P<host>[\w.\-]+)<\d+> with (?:error|status)",
        cause: Cause::Crash,
    },
    LogPattern {
        name: "hydra-proxy-error",
        what: "MPICH Hydra: [proxy:0:N@hostX] ... (error|failed|lost)",
        regex: r"\[proxy:[\d:]+@(?P<host>[\w.\-]+)\] .*(?:error|failed|lost|died)",
        cause: Cause::Crash,
    },
];

fn compiled() -> &'static [(LogPattern, Regex)] {
    static RE: OnceLock<Vec<(LogPattern, Regex)>> = OnceLock::new();
    RE.get_or_init(|| {
        LOG_PATTERNS
            .iter()
            .filter_map(|p| Some((*p, Regex::new(p.regex).ok()?)))
            .collect()
    })
}

fn canonical(host: &str, hosts: &[String]) -> Option<String> {
    hosts.iter().find(|h| same_host(h, host)).cloned()
}

/// Every log line (lossy UTF-8) matched by [`LOG_PATTERNS`] that names one of `hosts`, in
/// log order.
pub fn scan_log(log: &[u8], hosts: &[String]) -> Vec<Evidence> {
    let text = String::from_utf8_lossy(log);
    let mut found = Vec::new();
    for line in text.lines() {
        let line = crate::progress::strip_ansi(line);
        for (p, re) in compiled() {
            let Some(c) = re.captures(&line) else {
                continue;
            };
            let Some(host) = c.name("host").and_then(|m| canonical(m.as_str(), hosts)) else {
                continue;
            };
            found.push(Evidence {
                host,
                cause: p.cause,
                source: format!("log:{}", p.name),
                detail: line.trim().chars().take(300).collect(),
            });
        }
    }
    found
}

/// What is known about an attempt besides its outcome.
#[derive(Debug, Default)]
pub struct Clues<'a> {
    /// The tail of the attempt's log.
    pub log: &'a [u8],
    /// Active hosts in rank order.
    pub hosts: &'a [String],
    /// Ranks per host (block distribution), to map a rank to a host when no beacon says.
    pub ppn: usize,
    /// Hosts the scheduler says were lost (left the job, down, drained), with why.
    pub lost: Vec<(String, String)>,
    /// Ranks named by the trainer's `replica_mismatch` event (mapped to hosts through their
    /// beacons, else the block distribution).
    pub mismatch_ranks: Vec<usize>,
    /// Hosts named by that event, when it names them.
    pub mismatch_hosts: Vec<String>,
}

/// The verdict on a failed attempt.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Diagnosis {
    /// `node-failure`, `hang`, `crash`, `replica-mismatch`, or `unknown`.
    pub cause: String,
    /// The culprit hosts (empty when unknown).
    pub hosts: Vec<String>,
    /// Every piece of evidence considered.
    pub evidence: Vec<Evidence>,
}

impl Diagnosis {
    fn unknown(evidence: Vec<Evidence>) -> Self {
        Diagnosis {
            cause: "unknown".into(),
            hosts: Vec::new(),
            evidence,
        }
    }
}

/// Names the culprit hosts of a failed attempt (see the module docs for the order).
pub fn diagnose(outcome: &AttemptOutcome, clues: &Clues<'_>) -> Diagnosis {
    let w = Witness { outcome, clues };
    let (node_lines, other_lines): (Vec<Evidence>, Vec<Evidence>) =
        scan_log(clues.log, clues.hosts)
            .into_iter()
            .partition(|e| e.cause == Cause::NodeFailure);
    let mut evidence = w.lost_nodes();
    evidence.extend(node_lines);
    evidence.extend(w.mismatches());
    if outcome.classification.is_hang() {
        evidence.extend(w.hangs());
    }
    if outcome.classification == Classification::Straggler {
        evidence.extend(w.stragglers());
    }
    if matches!(
        outcome.classification,
        Classification::Failed | Classification::Signaled | Classification::ReplicaMismatch
    ) {
        evidence.extend(w.crash(other_lines));
    }
    pick(evidence, clues.hosts.len())
}

/// What [`diagnose`] reads: the attempt and the clues around it.
struct Witness<'a> {
    outcome: &'a AttemptOutcome,
    clues: &'a Clues<'a>,
}

impl Witness<'_> {
    /// The host of `rank`: where its beacon said it ran, else by the block placement.
    fn host_of_rank(&self, rank: usize) -> Option<String> {
        let hosts = self.clues.hosts;
        let from_beacon = self
            .outcome
            .progress
            .iter()
            .find(|p| p.rank == Some(rank) && p.source == "beacon")
            .and_then(|p| p.host.as_deref())
            .and_then(|h| canonical(h, hosts));
        from_beacon.or_else(|| hosts.get(rank / self.clues.ppn.max(1)).cloned())
    }

    /// The nodes the scheduler reported lost.
    fn lost_nodes(&self) -> Vec<Evidence> {
        let lost = self.clues.lost.iter();
        lost.filter_map(|(h, why)| {
            Some(Evidence {
                host: canonical(h, self.clues.hosts)?,
                cause: Cause::NodeFailure,
                source: "scheduler".into(),
                detail: why.clone(),
            })
        })
        .collect()
    }

    /// The hosts of the ranks whose replicas disagreed.
    fn mismatches(&self) -> Vec<Evidence> {
        let c = self.clues;
        let named = c
            .mismatch_ranks
            .iter()
            .filter_map(|&r| self.host_of_rank(r));
        let hosts = c.mismatch_hosts.iter().cloned().chain(named);
        hosts
            .filter_map(|h| canonical(&h, c.hosts))
            .map(|host| Evidence {
                host,
                cause: Cause::ReplicaMismatch,
                source: "event".into(),
                detail: "the trainer's replica_mismatch event names this host's rank".into(),
            })
            .collect()
    }

    /// The hosts of the ranks that stopped advancing first (or lost their heartbeat), each
    /// labelled with where that was seen.
    fn hangs(&self) -> Vec<Evidence> {
        use crate::supervise::source;
        let from = self.outcome.culprit_source.unwrap_or("watchdog");
        let culprits = self.outcome.culprits.iter();
        culprits
            .filter_map(|&rank| {
                let detail = match from {
                    source::LIVENESS => format!(
                        "rank {rank} stopped advancing with the others, and its process was stopped or idle while theirs ran"
                    ),
                    source::HEARTBEAT => format!("rank {rank} sent no heartbeat"),
                    source::AGENT => {
                        format!("the agent of rank {rank}'s node dropped its connection or fell silent")
                    }
                    source::EXIT_RECORD | source::EXIT_STATUS => {
                        format!("rank {rank} failed first")
                    }
                    _ => format!("rank {rank} stopped advancing first"),
                };
                Some(Evidence {
                    host: self.host_of_rank(rank)?,
                    cause: Cause::Hang,
                    source: from.into(),
                    detail,
                })
            })
            .collect()
    }

    /// The hosts of the ranks the attempt was stopped for as stragglers.
    fn stragglers(&self) -> Vec<Evidence> {
        let culprits = self.outcome.culprits.iter();
        culprits
            .filter_map(|&rank| {
                Some(Evidence {
                    host: self.host_of_rank(rank)?,
                    cause: Cause::Straggler,
                    source: crate::supervise::source::BEACON.into(),
                    detail: format!("rank {rank} worked longer per step than its peers"),
                })
            })
            .collect()
    }

    /// The host of the rank that failed first, and what the log's lines (`logged`, those that
    /// are not node failures) say.
    fn crash(&self, logged: Vec<Evidence>) -> Vec<Evidence> {
        let first = self
            .outcome
            .rank_exits
            .iter()
            .filter(|r| r.shell_code() != 0)
            .min_by(|a, b| a.time.total_cmp(&b.time));
        let mut crash: Vec<Evidence> = Vec::new();
        if let Some(r) = first
            && let Some(host) =
                canonical(&r.host, self.clues.hosts).or_else(|| self.host_of_rank(r.rank))
        {
            crash.push(Evidence {
                host,
                cause: Cause::Crash,
                source: "exit-record".into(),
                detail: format!("rank {} failed first (exit {})", r.rank, r.shell_code()),
            });
        }
        // A launcher's "task N exited" lines name every rank that failed, not the first: they
        // count only when they agree on one host and nothing better is known. Lines of the
        // communication libraries name the peer that went away, which is the culprit.
        let (task_lines, peer_lines): (Vec<Evidence>, Vec<Evidence>) = logged
            .into_iter()
            .partition(|e| e.source.starts_with("log:slurm-task"));
        crash.extend(peer_lines);
        let one_host = task_lines.iter().all(|e| e.host == task_lines[0].host);
        if crash.is_empty() && !task_lines.is_empty() && one_host {
            crash.extend(task_lines);
        }
        crash
    }
}

/// Takes the strongest kind of evidence present; evidence that blames every host names none.
fn pick(evidence: Vec<Evidence>, active: usize) -> Diagnosis {
    for cause in [
        Cause::NodeFailure,
        Cause::ReplicaMismatch,
        Cause::Straggler,
        Cause::Hang,
        Cause::Crash,
    ] {
        let mut named: Vec<String> = Vec::new();
        for e in evidence.iter().filter(|e| e.cause == cause) {
            if !named.contains(&e.host) {
                named.push(e.host.clone());
            }
        }
        if named.is_empty() {
            continue;
        }
        // A node that died is never the program's doing, even if every node did; any other
        // cause that blames every host at once is the program's.
        if cause != Cause::NodeFailure && named.len() >= active && active > 1 {
            continue;
        }
        if cause != Cause::NodeFailure && active <= 1 {
            continue;
        }
        return Diagnosis {
            cause: cause.name().into(),
            hosts: named,
            evidence,
        };
    }
    Diagnosis::unknown(evidence)
}

/// A normalized "what went wrong" line of an attempt: the last line of its log that reads
/// like an error (digits masked, so the same error at another step or PID is the same), to
/// recognise the same error twice. Launcher lines that name hosts or tasks are skipped.
pub fn error_signature(log: &[u8]) -> Option<String> {
    static RE: OnceLock<Option<Regex>> = OnceLock::new();
    let re = RE
        .get_or_init(|| {
            Regex::new(r"(?i)(error|exception|traceback|panicked|fatal|abort(ed)?|assert)").ok()
        })
        .as_ref()?;
    let text = String::from_utf8_lossy(log);
    let line = text
        .lines()
        .rev()
        .map(crate::progress::strip_ansi)
        .find(|l| {
            re.is_match(l)
                && !l.starts_with("srun:")
                && !l.starts_with("kiln")
                && !l.contains("slurmstepd")
        })?;
    let masked: String = line
        .trim()
        .chars()
        .map(|c| if c.is_ascii_digit() { '#' } else { c })
        .take(200)
        .collect();
    Some(masked)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hosts() -> Vec<String> {
        ["n1", "n2", "n3"].iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn every_pattern_compiles_and_names_its_example() {
        assert_eq!(compiled().len(), LOG_PATTERNS.len());
        let lines = [
            ("srun: error: Node failure on n2", "n2", Cause::NodeFailure),
            (
                "srun: error: n3: task 2: Exited with exit code 1",
                "n3",
                Cause::Crash,
            ),
            (
                "srun: error: n1: task 0: Segmentation fault (core dumped)",
                "n1",
                Cause::Crash,
            ),
            ("n2: rank 5 died from signal 9", "n2", Cause::Crash),
            (
                "shepherd on n3 died from signal 9",
                "n3",
                Cause::NodeFailure,
            ),
            (
                "mpirun noticed that process rank 1 with PID 77 on node n2 exited on signal 9 (Killed).",
                "n2",
                Cause::Crash,
            ),
            (
                "  Remote daemon: [[1234,0],1] on node n3",
                "n3",
                Cause::NodeFailure,
            ),
            (
                "RuntimeError: [../third_party/gloo/gloo/transport/tcp/pair.cc:598] Connection closed by peer [n2.cluster]:21847",
                "n2",
                Cause::Crash,
            ),
            (
                "n1:123:456 [0] misc/socket.cc:49 NCCL WARN socketProgress: Connection closed by remote peer n3<49122>",
                "n3",
                Cause::Crash,
            ),
            (
                "NCCL WARN NET/IB : Got completion from peer n2<1234> with error 12",
                "n2",
                Cause::Crash,
            ),
            (
                "[proxy:0:1@n3] HYDU_sock_write (utils/sock/sock.c:256): write error (Bad file descriptor)",
                "n3",
                Cause::Crash,
            ),
        ];
        for (line, host, cause) in lines {
            let e = scan_log(line.as_bytes(), &hosts());
            assert_eq!(e.len(), 1, "{line}: {e:?}");
            assert_eq!((e[0].host.as_str(), e[0].cause), (host, cause), "{line}");
        }
        // Collateral ranks and unknown hosts name nobody.
        for line in [
            "srun: error: n1: task 0: Killed",
            "srun: error: n2: task 1: Terminated",
            "srun: error: Node failure on n9",
            "slurmstepd: error: *** STEP 3.0 ON n1 CANCELLED AT 2024-01-01T00:00:00 DUE TO NODE FAILURE ***",
        ] {
            assert!(scan_log(line.as_bytes(), &hosts()).is_empty(), "{line}");
        }
    }

    fn failed() -> AttemptOutcome {
        let mut o = AttemptOutcome::not_started(1, String::new());
        o.classification = Classification::Failed;
        o
    }

    fn exit(rank: usize, host: &str, time: f64) -> kiln_run::ExitRecord {
        kiln_run::ExitRecord {
            rank,
            code: Some(1),
            signal: None,
            time,
            host: host.into(),
            attempt: None,
        }
    }

    /// An attempt stopped for a straggler names that rank's host (by its place without a
    /// beacon), and only then: the same culprit in a hang is a hang.
    #[test]
    fn a_straggler_names_its_host() {
        let hosts = hosts();
        let clues = Clues {
            hosts: &hosts,
            ppn: 1,
            ..Clues::default()
        };
        let mut o = AttemptOutcome::not_started(1, String::new());
        o.classification = Classification::Straggler;
        o.culprits = vec![2];
        let d = diagnose(&o, &clues);
        assert_eq!(
            (d.cause.as_str(), d.hosts.clone()),
            ("straggler", vec!["n3".to_string()])
        );
        o.classification = Classification::HungStalled;
        assert_eq!(diagnose(&o, &clues).cause, "hang");
    }

    #[test]
    fn diagnoses_by_the_strongest_evidence() {
        let hosts = hosts();
        let clues = |log: &'static str| Clues {
            log: log.as_bytes(),
            hosts: &hosts,
            ppn: 1,
            ..Clues::default()
        };
        let all_exit = "srun: error: n1: task 0: Exited with exit code 1\nsrun: error: n3: task 2: Exited with exit code 1\n";
        // Every rank failing alike, no record of who was first: no culprit.
        assert_eq!(diagnose(&failed(), &clues(all_exit)).cause, "unknown");
        // The first rank to fail, from the exit records.
        let mut o = failed();
        o.rank_exits = vec![exit(0, "n1", 2.0), exit(1, "n2", 1.0)];
        let d = diagnose(&o, &clues(all_exit));
        assert_eq!(
            (d.cause.as_str(), d.hosts.clone()),
            ("crash", vec!["n2".to_string()])
        );
        // A node failure wins over everything.
        let mut c = clues(all_exit);
        c.lost = vec![("n3".into(), "left the job".into())];
        assert_eq!(diagnose(&o, &c).hosts, ["n3"]);
        // A hang names the host of the rank that stopped first (its beacon's host).
        let mut o = failed();
        o.classification = Classification::HungStalled;
        o.culprits = vec![1];
        o.culprit_source = Some(crate::supervise::source::OUTPUT);
        o.progress = vec![crate::supervise::RankProgress {
            rank: Some(1),
            step: 3,
            phase: Some("train".into()),
            host: Some("n3".into()),
            idle_s: 5.0,
            source: "beacon",
        }];
        let d = diagnose(&o, &clues(""));
        assert_eq!(
            (d.cause.as_str(), d.hosts.clone()),
            ("hang", vec!["n3".to_string()])
        );
        // Labelled with where it came from, not always `beacon`.
        assert_eq!(d.evidence[0].source, "output");
        // Every rank stalled at once: nobody is named.
        o.culprits = vec![0, 1, 2];
        o.progress.clear();
        assert_eq!(diagnose(&o, &clues("")).cause, "unknown");
    }

    #[test]
    fn hosts_match_up_to_the_domain() {
        assert!(same_host("x1000c0s0b0n0", "x1000c0s0b0n0.hsn.cm.example"));
        assert!(!same_host("n1", "n10"));
    }

    #[test]
    fn signatures_mask_numbers_and_skip_launcher_lines() {
        let log = b"step=3\nValueError: bad shard 17 at step 3\nsrun: error: n1: task 0: Exited with exit code 1\n";
        assert_eq!(
            error_signature(log).as_deref(),
            Some("ValueError: bad shard ## at step #")
        );
        assert_eq!(error_signature(b"all fine\n"), None);
    }
}

//! What the supervisor knows from its node agents, in memory: the ranks' latest records under
//! their file names (read like a progress directory through [`kiln_run::RankFiles`]), and each
//! agent's connection (its host, its ranks, when it last spoke, how it ended). The server's
//! connections write it; the watch loop reads it.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// An agent silent this long (no digest, no keep-alive) is taken as lost with its node:
/// agents send a digest every [`super::DIGEST_EVERY`], so this is six missed ones.
pub const AGENT_SILENCE: Duration = Duration::from_millis(1500);

/// A connection that dropped is a node lost only once this long passed without a rank's
/// failed exit (which explains the drop: the launcher tearing the job down after it).
pub const DROP_SETTLE: Duration = Duration::from_millis(300);

/// One agent's connection, as the supervisor saw it.
#[derive(Debug, Clone)]
pub struct Agent {
    /// Its node.
    pub host: String,
    /// The ranks it reported.
    pub ranks: BTreeSet<usize>,
    /// When it last spoke.
    pub last_seen: Instant,
    /// When its connection ended, and whether it said goodbye first.
    pub ended: Option<(Instant, bool)>,
}

/// A node whose agent went away without saying goodbye, or fell silent.
#[derive(Debug, Clone, PartialEq)]
pub struct LostNode {
    /// The node.
    pub host: String,
    /// Its ranks.
    pub ranks: Vec<usize>,
    /// Seconds since the agent last spoke.
    pub silent_s: f64,
    /// Whether the connection dropped (else it is silent).
    pub dropped: bool,
}

#[derive(Default)]
struct State {
    /// The attempt whose agents are listened to (`None`: any).
    attempt: Option<String>,
    files: BTreeMap<String, String>,
    agents: BTreeMap<u64, Agent>,
}

/// The supervisor's view of the job's nodes.
#[derive(Default)]
pub struct Board {
    state: Mutex<State>,
}

impl std::fmt::Debug for Board {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Board")
    }
}

impl Board {
    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        // A connection task that panicked leaves plain data behind: keep using it.
        self.state
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Starts an attempt: forgets the records and agents of earlier ones and listens to the
    /// agents of `attempt` only.
    pub fn begin(&self, attempt: Option<&str>) {
        let mut s = self.lock();
        *s = State {
            attempt: attempt.map(str::to_string),
            ..State::default()
        };
    }

    /// Whether an agent of `attempt` belongs to the attempt being watched.
    pub fn wants(&self, attempt: Option<&str>) -> bool {
        let s = self.lock();
        s.attempt.is_none() || s.attempt.as_deref() == attempt
    }

    /// An agent joined.
    pub fn joined(&self, id: u64, host: &str, now: Instant) {
        self.lock().agents.insert(
            id,
            Agent {
                host: host.to_string(),
                ranks: BTreeSet::new(),
                last_seen: now,
                ended: None,
            },
        );
    }

    /// An agent's digest: its records replace the older ones of the same name.
    pub fn digest(&self, id: u64, files: Vec<(String, String)>, ranks: &[usize], now: Instant) {
        let mut s = self.lock();
        let Some(a) = s.agents.get_mut(&id) else {
            return;
        };
        a.last_seen = now;
        a.ranks.extend(ranks.iter().copied());
        for (name, text) in files {
            if kiln_run::is_record_name(&name) && text.len() as u64 <= kiln_run::MAX_RECORD {
                s.files.insert(name, text);
            }
        }
    }

    /// An agent's connection ended (`clean`: after its goodbye).
    pub fn ended(&self, id: u64, clean: bool, now: Instant) {
        if let Some(a) = self.lock().agents.get_mut(&id)
            && a.ended.is_none()
        {
            a.ended = Some((now, clean));
        }
    }

    /// The agents that joined this attempt.
    pub fn agents(&self) -> Vec<Agent> {
        self.lock().agents.values().cloned().collect()
    }

    /// The first node lost at `now`: its agent's connection dropped at least [`DROP_SETTLE`]
    /// ago without a goodbye, or it has been silent for [`AGENT_SILENCE`].
    pub fn lost_node(&self, now: Instant) -> Option<LostNode> {
        let s = self.lock();
        s.agents.values().find_map(|a| {
            let silent = now.saturating_duration_since(a.last_seen);
            let dropped = match a.ended {
                Some((_, true)) => return None,
                Some((at, false)) => now.saturating_duration_since(at) >= DROP_SETTLE,
                None => false,
            };
            (dropped || silent >= AGENT_SILENCE).then(|| LostNode {
                host: a.host.clone(),
                ranks: a.ranks.iter().copied().collect(),
                silent_s: silent.as_secs_f64(),
                dropped,
            })
        })
    }
}

impl kiln_run::RankFiles for Board {
    fn rank_files(&self, prefix: &str) -> Vec<(usize, String)> {
        let s = self.lock();
        s.files
            .range(prefix.to_string()..)
            .take_while(|(name, _)| name.starts_with(prefix))
            .filter_map(|(name, text)| Some((kiln_run::record_rank(name, prefix)?, text.clone())))
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kiln_run::RankFiles;

    #[test]
    fn records_read_like_a_progress_directory() {
        let b = Board::default();
        let t = Instant::now();
        b.begin(Some("a1"));
        b.joined(1, "n1", t);
        let rec = |n: &str, s: &str| (n.to_string(), s.to_string());
        b.digest(
            1,
            vec![
                rec("rank-3", "7 train 10.0 n1\n"),
                rec("rank-12", "7 train 10.0 n1\n"),
                rec("exit-3", "0 - 11.0 n1 a1\n"),
                rec("../etc", "x"),
                rec("stop", "9 1.0"),
            ],
            &[3, 12],
            t,
        );
        b.digest(1, vec![rec("rank-3", "8 train 11.0 n1\n")], &[], t);
        let beacons = kiln_run::read_beacons(&b);
        assert_eq!(
            beacons.iter().map(|x| (x.rank, x.step)).collect::<Vec<_>>(),
            [(3, 8), (12, 7)]
        );
        assert_eq!(kiln_run::read_exit_records(&b).len(), 1);
        assert_eq!(b.rank_files("stop").len(), 0);
        b.begin(Some("a2"));
        assert!(kiln_run::read_beacons(&b).is_empty());
        assert!(b.wants(Some("a2")) && !b.wants(Some("a1")));
    }

    #[test]
    fn a_node_is_lost_when_its_agent_drops_or_falls_silent_not_after_a_goodbye() {
        let b = Board::default();
        let t = Instant::now();
        b.begin(None);
        b.joined(1, "n1", t);
        b.joined(2, "n2", t);
        b.digest(2, Vec::new(), &[4, 5], t);
        assert_eq!(b.lost_node(t + Duration::from_millis(500)), None);
        b.ended(1, true, t);
        b.ended(2, false, t + Duration::from_millis(100));
        // The drop settles first: a failed rank's exit may explain it.
        assert_eq!(b.lost_node(t + Duration::from_millis(200)), None);
        let lost = b.lost_node(t + Duration::from_millis(400)).unwrap();
        assert_eq!(
            (lost.host.as_str(), lost.ranks, lost.dropped),
            ("n2", vec![4, 5], true)
        );
        let b = Board::default();
        b.joined(7, "n7", t);
        let lost = b.lost_node(t + AGENT_SILENCE).unwrap();
        assert!(!lost.dropped && lost.host == "n7");
    }
}

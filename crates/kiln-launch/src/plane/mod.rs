//! The control plane between `kiln launch` and its ranks: how the supervisor learns each
//! rank's progress, liveness and exit, and how its stop requests reach them.
//!
//! Two planes, one interface (the ranks' record files, [`kiln_run::RankFiles`]):
//! - `files`: every rank shim and program writes its records into the run's progress
//!   directory, and the supervisor reads them there. Right for one machine; on a cluster that
//!   directory is the shared parallel filesystem, which at thousands of ranks would take
//!   hundreds of thousands of metadata operations a second.
//! - `tcp` (the default under a launcher): each node's ranks write the same records into a
//!   node-local directory ([`node`]), one agent a node ([`agent`]) forwards them over one
//!   authenticated TCP connection ([`wire`]) to the supervisor's server ([`server`]), which
//!   keeps them in memory ([`board`]) and pushes stop requests back. The run directory then
//!   sees only the event log, attempt records and the ledger. A dropped connection is a node
//!   lost, known in about a second.

pub mod agent;
pub mod board;
pub mod node;
pub mod server;
pub mod wire;

use std::time::Duration;

/// Variable holding `host:port` of the supervisor's control-plane server, for the rank shims.
pub const ADDR_ENV: &str = "KILN_PLANE";
/// Variable holding the job's secret, which the agents prove they know.
pub const SECRET_ENV: &str = "KILN_PLANE_SECRET";

/// How often an agent sends what changed (and, when nothing did, a keep-alive).
pub const DIGEST_EVERY: Duration = Duration::from_millis(250);

/// `--control-plane`'s value for node agents over TCP (the other is `files`, the run's
/// progress directory).
pub const TCP: &str = "tcp";

/// The agent settings a rank shim finds in its environment (`None`: the `files` plane).
pub fn agent_config_from_env(attempt: Option<&str>) -> Option<agent::AgentConfig> {
    let var = |k: &str| std::env::var(k).ok().filter(|v| !v.trim().is_empty());
    let (addr, secret) = (var(ADDR_ENV)?, var(SECRET_ENV)?);
    let host = kiln_run::this_host().to_string();
    let dir = node::local_dir(&node::base_dir(), &secret, attempt, &host);
    Some(agent::AgentConfig {
        addr,
        secret,
        attempt: attempt.map(str::to_string),
        host,
        dir,
    })
}

#[cfg(test)]
mod tests {
    use super::agent::{Agent, AgentConfig};
    use super::server::Server;
    use super::wire::{self, ToAgent, ToSupervisor};
    use std::time::{Duration, Instant};

    fn server(attempt: &str) -> Server {
        let s = Server::start("127.0.0.1:0".parse().unwrap()).unwrap();
        s.begin(Some(attempt));
        s
    }

    fn config(s: &Server, dir: &std::path::Path, attempt: &str) -> AgentConfig {
        AgentConfig {
            addr: format!("127.0.0.1:{}", s.port()),
            secret: s.secret().to_string(),
            attempt: Some(attempt.to_string()),
            host: "n1".into(),
            dir: dir.to_path_buf(),
        }
    }

    /// Waits up to 5 s for `cond`; how long it took.
    fn within(cond: impl Fn() -> bool) -> Duration {
        let t = Instant::now();
        while !cond() {
            assert!(t.elapsed() < Duration::from_secs(5), "timed out");
            std::thread::sleep(Duration::from_millis(5));
        }
        t.elapsed()
    }

    #[test]
    fn an_agent_forwards_its_nodes_records_and_the_supervisors_stop_requests() {
        let s = server("a1");
        let dir = tempfile::tempdir().unwrap();
        // Written before the agent starts: found by its first scan.
        kiln_run::write_beacon(dir.path(), 3, 7, "train", 1.0).unwrap();
        let agent = Agent::spawn(config(&s, dir.path(), "a1")).unwrap();
        within(|| kiln_run::read_beacons(s.board()).len() == 1);
        kiln_run::write_beacon(dir.path(), 4, 9, "train", 2.0).unwrap();
        within(|| {
            kiln_run::read_beacons(s.board())
                .iter()
                .any(|b| b.rank == 4 && b.step == 9)
        });
        // An exit goes up at once, not at the next digest.
        kiln_run::write_exit_record(dir.path(), 4, None, Some(9), 3.0).unwrap();
        let took = within(|| kiln_run::read_exit_records(s.board()).len() == 1);
        assert!(took < super::DIGEST_EVERY, "an exit took {took:?}");
        s.request_stop(15, 4.0, Some("a1"));
        within(|| kiln_run::read_stop_request(dir.path()).is_some());
        let stop = kiln_run::read_stop_request(dir.path()).unwrap();
        assert_eq!((stop.signal, stop.attempt.as_deref()), (15, Some("a1")));
        assert_eq!(
            s.board().agents()[0]
                .ranks
                .iter()
                .copied()
                .collect::<Vec<_>>(),
            [3, 4]
        );
        agent.finish();
        within(|| s.board().agents()[0].ended.is_some_and(|(_, clean)| clean));
        assert_eq!(
            s.board().lost_node(Instant::now() + Duration::from_secs(9)),
            None
        );
    }

    #[test]
    fn a_wrong_secret_or_another_attempts_agent_is_not_heard() {
        let s = server("a1");
        let dir = tempfile::tempdir().unwrap();
        let mut wrong = config(&s, dir.path(), "a1");
        wrong.secret = "not-the-secret".into();
        let other = config(&s, dir.path(), "a0");
        let (w, o) = (Agent::spawn(wrong).unwrap(), Agent::spawn(other).unwrap());
        within(|| w.gone() && o.gone());
        assert!(s.board().agents().is_empty());
    }

    #[test]
    fn a_dropped_connection_is_its_node_lost_with_its_ranks() {
        let s = server("a1");
        let mut c = std::net::TcpStream::connect(("127.0.0.1", s.port())).unwrap();
        let ToAgent::Hello { nonce, .. } = wire::recv(&mut c).unwrap() else {
            panic!("no hello")
        };
        let mac = hex::encode(wire::proof(s.secret(), &nonce, "n9", Some("a1")));
        let join = ToSupervisor::Join {
            v: wire::VERSION,
            host: "n9".into(),
            attempt: Some("a1".into()),
            mac,
        };
        wire::send(&mut c, &join).unwrap();
        let digest = ToSupervisor::Digest {
            files: Vec::new(),
            ranks: vec![16, 17],
        };
        wire::send(&mut c, &digest).unwrap();
        within(|| {
            s.board()
                .agents()
                .first()
                .is_some_and(|a| a.ranks.len() == 2)
        });
        assert_eq!(s.board().lost_node(Instant::now()), None);
        drop(c);
        within(|| s.board().lost_node(Instant::now()).is_some());
        let lost = s.board().lost_node(Instant::now()).unwrap();
        assert_eq!(
            (lost.host.as_str(), lost.ranks, lost.dropped),
            ("n9", vec![16, 17], true)
        );
    }
}

//! A node agent: watches its node's progress directory (node-local memory, where the rank
//! shims and their programs write beacons and records as they always did) with inotify, and
//! keeps one connection to the supervisor: what changed goes up as a digest (at once for a
//! rank's exit or loss, else every [`super::DIGEST_EVERY`]; an empty one as a keep-alive),
//! and stop requests come down into the directory's `stop` file, which the shims act on.

use super::DIGEST_EVERY;
use super::wire::{self, ToAgent, ToSupervisor, VERSION, WireError};
use nix::poll::{PollFd, PollFlags, PollTimeout, poll};
use nix::sys::inotify::{AddWatchFlags, InitFlags, Inotify};
use std::collections::{BTreeMap, BTreeSet};
use std::io::Read;
use std::net::{TcpStream, ToSocketAddrs};
use std::os::fd::AsFd;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

/// How long an agent keeps trying to reach the supervisor when it starts.
const CONNECT_WITHIN: Duration = Duration::from_secs(20);

/// What an agent needs: where the supervisor listens, the job's secret, whom it serves.
#[derive(Debug, Clone)]
pub struct AgentConfig {
    /// `host:port` of the supervisor.
    pub addr: String,
    /// The job's secret.
    pub secret: String,
    /// The attempt its ranks belong to.
    pub attempt: Option<String>,
    /// Its node ([`kiln_run::this_host`]).
    pub host: String,
    /// The node-local progress directory it watches.
    pub dir: PathBuf,
}

/// A running agent (a thread).
pub struct Agent {
    finish: Arc<AtomicBool>,
    gone: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<Result<(), WireError>>>,
}

impl Agent {
    /// Starts the agent's thread.
    pub fn spawn(cfg: AgentConfig) -> std::io::Result<Agent> {
        let finish = Arc::new(AtomicBool::new(false));
        let gone = Arc::new(AtomicBool::new(false));
        let (f, g) = (Arc::clone(&finish), Arc::clone(&gone));
        let thread = std::thread::Builder::new()
            .name("kiln-agent".into())
            .spawn(move || {
                let r = run(&cfg, &f, &g);
                g.store(true, Ordering::SeqCst);
                // A connection the supervisor closed is the launch's end, not an error.
                let closed = |e: &std::io::Error| {
                    use std::io::ErrorKind::{BrokenPipe, ConnectionReset, UnexpectedEof};
                    matches!(e.kind(), BrokenPipe | ConnectionReset | UnexpectedEof)
                };
                match &r {
                    Err(WireError::Io(e)) if closed(e) => {}
                    Err(e) => eprintln!("kiln node agent on {}: {e}", cfg.host),
                    Ok(()) => {}
                }
                r
            })?;
        Ok(Agent {
            finish,
            gone,
            thread: Some(thread),
        })
    }

    /// Whether the agent stopped (the supervisor closed the connection, or it never got one).
    pub fn gone(&self) -> bool {
        self.gone.load(Ordering::SeqCst)
    }

    /// Sends what is left, says goodbye and waits for the thread.
    pub fn finish(mut self) {
        self.finish.store(true, Ordering::SeqCst);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// Runs an agent until `finish` is set (then it sends the last records and a goodbye) or the
/// supervisor goes away.
pub fn run(
    cfg: &AgentConfig,
    finish: &AtomicBool,
    gone: &Arc<AtomicBool>,
) -> Result<(), WireError> {
    let mut stream = connect(&cfg.addr)?;
    let hello: ToAgent = wire::recv(&mut stream)?;
    let ToAgent::Hello { v, nonce } = hello else {
        return Err(std::io::Error::other("the supervisor did not say hello").into());
    };
    if v != VERSION {
        return Err(std::io::Error::other(format!(
            "the supervisor speaks version {v} of the control plane, this agent {VERSION}"
        ))
        .into());
    }
    let mac = hex::encode(wire::proof(
        &cfg.secret,
        &nonce,
        &cfg.host,
        cfg.attempt.as_deref(),
    ));
    let join = ToSupervisor::Join {
        v: VERSION,
        host: cfg.host.clone(),
        attempt: cfg.attempt.clone(),
        mac,
    };
    wire::send(&mut stream, &join)?;
    stream.set_read_timeout(None)?;
    let reader = stream.try_clone()?;
    let (dir, gone_by_reader) = (cfg.dir.clone(), Arc::clone(gone));
    std::thread::Builder::new()
        .name("kiln-agent-stops".into())
        .spawn(move || {
            write_stops(reader, &dir);
            gone_by_reader.store(true, Ordering::SeqCst);
        })?;
    let mut watch = Watch::new(&cfg.dir)?;
    let mut last_sent = Instant::now() - DIGEST_EVERY;
    loop {
        let finishing = finish.load(Ordering::SeqCst);
        if gone.load(Ordering::SeqCst) && !finishing {
            return Ok(());
        }
        let wait = DIGEST_EVERY.saturating_sub(last_sent.elapsed());
        let urgent = watch.wait(wait.min(Duration::from_millis(100)), finishing)?;
        if urgent || finishing || last_sent.elapsed() >= DIGEST_EVERY {
            wire::send(&mut stream, &watch.digest())?;
            last_sent = Instant::now();
        }
        if finishing {
            wire::send(&mut stream, &ToSupervisor::Bye)?;
            let _ = stream.shutdown(std::net::Shutdown::Both);
            return Ok(());
        }
    }
}

fn connect(addr: &str) -> Result<TcpStream, WireError> {
    let until = Instant::now() + CONNECT_WITHIN;
    loop {
        let tried = addr
            .to_socket_addrs()
            .and_then(|mut a| a.next().ok_or_else(|| std::io::ErrorKind::NotFound.into()))
            .and_then(|a| TcpStream::connect_timeout(&a, Duration::from_secs(2)));
        match tried {
            Ok(s) => {
                s.set_nodelay(true)?;
                s.set_read_timeout(Some(CONNECT_WITHIN))?;
                return Ok(s);
            }
            Err(e) if Instant::now() >= until => {
                return Err(std::io::Error::new(e.kind(), format!("{addr}: {e}")).into());
            }
            Err(_) => std::thread::sleep(Duration::from_millis(200)),
        }
    }
}

/// Writes each stop request the supervisor sends into `dir`, until the connection ends.
fn write_stops(mut stream: TcpStream, dir: &Path) {
    while let Ok(msg) = wire::recv::<ToAgent>(&mut stream) {
        if let ToAgent::Stop {
            signal,
            time,
            attempt,
        } = msg
            && let Err(e) = kiln_run::write_stop_request(dir, signal, time, attempt.as_deref())
        {
            eprintln!("kiln node agent: {e}");
        }
    }
}

/// How the agent learns of changed records: inotify, or (where the user's inotify instances
/// are used up: `fs.inotify.max_user_instances`, 128 by default) a listing of the node-local
/// directory every [`POLL_EVERY`], which costs memory reads, not a filesystem's metadata server.
enum Changes {
    Inotify(Inotify),
    /// Each record's modification time and length when last taken.
    Poll(BTreeMap<String, (std::time::SystemTime, u64)>),
}

/// The node directory's listing interval without inotify.
const POLL_EVERY: Duration = Duration::from_millis(50);

/// The node's records as they change.
struct Watch {
    dir: PathBuf,
    changes: Changes,
    /// Changed since the last digest.
    pending: BTreeMap<String, String>,
    ranks: BTreeSet<usize>,
}

impl Watch {
    fn new(dir: &Path) -> Result<Watch, WireError> {
        let flags = AddWatchFlags::IN_CLOSE_WRITE | AddWatchFlags::IN_MOVED_TO;
        let inotify = Inotify::init(InitFlags::IN_NONBLOCK | InitFlags::IN_CLOEXEC)
            .and_then(|i| i.add_watch(dir, flags).map(|_| i));
        let changes = match inotify {
            Ok(i) => Changes::Inotify(i),
            Err(e) => {
                eprintln!(
                    "kiln node agent: no inotify ({e}): listing {} every {} ms instead",
                    dir.display(),
                    POLL_EVERY.as_millis()
                );
                Changes::Poll(BTreeMap::new())
            }
        };
        let mut w = Watch {
            dir: dir.to_path_buf(),
            changes,
            pending: BTreeMap::new(),
            ranks: BTreeSet::new(),
        };
        w.scan();
        Ok(w)
    }

    /// Takes every record in the directory that changed since it was last taken (with
    /// inotify, every one: those written before the watch began, and the last ones at the
    /// end); whether one is urgent.
    fn scan(&mut self) -> bool {
        let Ok(entries) = std::fs::read_dir(&self.dir) else {
            return false;
        };
        let mut urgent = false;
        for e in entries.filter_map(Result::ok) {
            let Ok(name) = e.file_name().into_string() else {
                continue;
            };
            if let Changes::Poll(seen) = &mut self.changes {
                let meta = e.metadata().ok();
                let Some(stamp) = meta.and_then(|m| Some((m.modified().ok()?, m.len()))) else {
                    continue;
                };
                if seen.get(&name) == Some(&stamp) {
                    continue;
                }
                seen.insert(name.clone(), stamp);
            }
            urgent |= self.take(name);
        }
        urgent
    }

    /// Reads the record `name` if it is one; whether it is urgent (an exit or a lost rank).
    fn take(&mut self, name: String) -> bool {
        let Some((kind, rank)) = kiln_run::parse_record_name(&name) else {
            return false;
        };
        let mut text = String::new();
        let read = std::fs::File::open(self.dir.join(&name))
            .and_then(|f| f.take(kiln_run::MAX_RECORD).read_to_string(&mut text));
        if read.is_err() {
            return false;
        }
        self.ranks.insert(rank);
        let urgent = [
            kiln_run::layout::EXIT_RECORD_PREFIX,
            kiln_run::layout::LOST_PREFIX,
        ]
        .contains(&kind);
        self.pending.insert(name, text);
        urgent
    }

    /// Waits up to `timeout` for changes and takes them; whether one is urgent. `last`:
    /// read the whole directory (nothing may be missed at the end).
    fn wait(&mut self, timeout: Duration, last: bool) -> Result<bool, WireError> {
        if last {
            if let Changes::Poll(seen) = &mut self.changes {
                seen.clear();
            }
            self.scan();
            return Ok(false);
        }
        let Changes::Inotify(inotify) = &self.changes else {
            std::thread::sleep(timeout.min(POLL_EVERY));
            return Ok(self.scan());
        };
        let ms = u16::try_from(timeout.as_millis()).unwrap_or(u16::MAX);
        let mut fds = [PollFd::new(inotify.as_fd(), PollFlags::POLLIN)];
        match poll(&mut fds, PollTimeout::from(ms)) {
            Ok(_) | Err(nix::errno::Errno::EINTR) => {}
            Err(e) => return Err(std::io::Error::from(e).into()),
        }
        let mut names = Vec::new();
        loop {
            match inotify.read_events() {
                Ok(events) if !events.is_empty() => names.extend(
                    (events.into_iter()).filter_map(|e| e.name.and_then(|n| n.into_string().ok())),
                ),
                Ok(_) | Err(nix::errno::Errno::EAGAIN) => break,
                Err(e) => return Err(std::io::Error::from(e).into()),
            }
        }
        Ok(names
            .into_iter()
            .fold(false, |urgent, n| self.take(n) | urgent))
    }

    /// The digest of what changed since the last one.
    fn digest(&mut self) -> ToSupervisor {
        ToSupervisor::Digest {
            files: std::mem::take(&mut self.pending).into_iter().collect(),
            ranks: self.ranks.iter().copied().collect(),
        }
    }
}

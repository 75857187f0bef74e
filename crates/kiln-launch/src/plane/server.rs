//! The supervisor's end of the control plane: a TCP listener on a thread of its own (a
//! single-threaded tokio runtime: one task a connection, a few hundred connections at most)
//! that authenticates node agents, writes what they send on the [`Board`], and pushes kiln's
//! stop requests to every agent at once.

use super::board::Board;
use super::wire::{self, ToAgent, ToSupervisor, VERSION, WireError};
use std::net::{SocketAddr, TcpListener};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::sync::watch;

/// How long a new connection has to prove the secret.
const JOIN_WITHIN: Duration = Duration::from_secs(10);

/// The supervisor's listener for node agents; dropping it stops it.
pub struct Server {
    addr: SocketAddr,
    secret: String,
    board: Arc<Board>,
    stop: watch::Sender<Option<ToAgent>>,
    shutdown: watch::Sender<bool>,
}

impl std::fmt::Debug for Server {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "plane::Server({})", self.addr)
    }
}

impl Server {
    /// Listens on `bind` (port 0: one the system picks) with a fresh secret.
    pub fn start(bind: SocketAddr) -> std::io::Result<Server> {
        let listener = TcpListener::bind(bind)?;
        listener.set_nonblocking(true)?;
        let addr = listener.local_addr()?;
        let secret = wire::random_hex(32)?;
        let board = Arc::new(Board::default());
        let (stop, stop_rx) = watch::channel(None);
        let (shutdown, shutdown_rx) = watch::channel(false);
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_io()
            .enable_time()
            .build()?;
        let ctx = Ctx {
            secret: secret.clone(),
            board: Arc::clone(&board),
            stop: stop_rx,
        };
        std::thread::Builder::new()
            .name("kiln-plane".into())
            .spawn(move || rt.block_on(accept(listener, ctx, shutdown_rx)))?;
        Ok(Server {
            addr,
            secret,
            board,
            stop,
            shutdown,
        })
    }

    /// The port it listens on.
    pub fn port(&self) -> u16 {
        self.addr.port()
    }

    /// The job's secret, which agents prove they know.
    pub fn secret(&self) -> &str {
        &self.secret
    }

    /// What the agents reported.
    pub fn board(&self) -> &Board {
        &self.board
    }

    /// Starts an attempt: the board forgets earlier attempts, and the stop request of an
    /// earlier attempt is not sent to this one's agents.
    pub fn begin(&self, attempt: Option<&str>) {
        self.board.begin(attempt);
        self.stop.send_replace(None);
    }

    /// Asks every agent (those that join later too) to signal its node's ranks of `attempt`.
    pub fn request_stop(&self, signal: i32, time: f64, attempt: Option<&str>) {
        self.stop.send_replace(Some(ToAgent::Stop {
            signal,
            time,
            attempt: attempt.map(str::to_string),
        }));
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        self.shutdown.send_replace(true);
    }
}

/// What every connection shares.
#[derive(Clone)]
struct Ctx {
    secret: String,
    board: Arc<Board>,
    stop: watch::Receiver<Option<ToAgent>>,
}

async fn accept(listener: TcpListener, ctx: Ctx, mut shutdown: watch::Receiver<bool>) {
    let Ok(listener) = tokio::net::TcpListener::from_std(listener) else {
        tracing::warn!("control plane: cannot listen");
        return;
    };
    static IDS: AtomicU64 = AtomicU64::new(0);
    loop {
        tokio::select! {
            conn = listener.accept() => {
                if let Ok((stream, peer)) = conn {
                    let _ = stream.set_nodelay(true);
                    let id = IDS.fetch_add(1, Ordering::Relaxed);
                    let ctx = ctx.clone();
                    tokio::spawn(async move {
                        if let Err(e) = serve(stream, id, ctx).await {
                            tracing::debug!("control plane: agent at {peer}: {e}");
                        }
                    });
                }
            }
            _ = shutdown.changed() => return,
        }
    }
}

/// One agent's connection: the handshake, then its digests until it leaves.
async fn serve(stream: TcpStream, id: u64, ctx: Ctx) -> Result<(), WireError> {
    let (mut rd, mut wr) = stream.into_split();
    let nonce = wire::random_hex(16)?;
    let hello = ToAgent::Hello {
        v: VERSION,
        nonce: nonce.clone(),
    };
    wr.write_all(&wire::encode(&hello)?).await?;
    let join = tokio::time::timeout(JOIN_WITHIN, read(&mut rd))
        .await
        .map_err(|_| std::io::Error::from(std::io::ErrorKind::TimedOut))??;
    let ToSupervisor::Join {
        v,
        host,
        attempt,
        mac,
    } = join
    else {
        return Ok(());
    };
    if v != VERSION || !wire::verify(&ctx.secret, &nonce, &host, attempt.as_deref(), &mac) {
        tracing::warn!(
            "control plane: refused an agent from {host} (version {v}, or not this job's secret)"
        );
        return Ok(());
    }
    if !ctx.board.wants(attempt.as_deref()) {
        return Ok(());
    }
    ctx.board.joined(id, &host, Instant::now());
    let pusher = tokio::spawn(push_stops(wr, ctx.stop.clone()));
    let clean = loop {
        match read(&mut rd).await {
            Ok(ToSupervisor::Digest { files, ranks }) => {
                ctx.board.digest(id, files, &ranks, Instant::now())
            }
            Ok(ToSupervisor::Bye) => break true,
            Ok(ToSupervisor::Join { .. }) => {}
            Err(_) => break false,
        }
    };
    ctx.board.ended(id, clean, Instant::now());
    pusher.abort();
    Ok(())
}

/// Sends the agent the current stop request (one made before it joined too) and each new one.
async fn push_stops(mut wr: OwnedWriteHalf, mut stop: watch::Receiver<Option<ToAgent>>) {
    loop {
        let msg = stop.borrow_and_update().clone();
        if let Some(m) = msg {
            let Ok(frame) = wire::encode(&m) else { return };
            if wr.write_all(&frame).await.is_err() {
                return;
            }
        }
        if stop.changed().await.is_err() {
            return;
        }
    }
}

async fn read(rd: &mut OwnedReadHalf) -> Result<ToSupervisor, WireError> {
    let mut header = [0u8; 4];
    rd.read_exact(&mut header).await?;
    let mut body = vec![0u8; wire::body_len(header)?];
    rd.read_exact(&mut body).await?;
    Ok(serde_json::from_slice(&body)?)
}

//! The control plane's protocol between a node agent and the supervisor: frames of a 4-byte
//! big-endian length and one JSON message, at most [`MAX_FRAME`] bytes; the version in the
//! first message of each side; and the agent's proof that it knows the job's secret.
//!
//! The session: the supervisor sends [`ToAgent::Hello`] with a fresh nonce; the agent answers
//! [`ToSupervisor::Join`] with `HMAC-SHA256(secret, nonce, host, attempt)`; a wrong proof or
//! version closes the connection. Then the agent sends [`ToSupervisor::Digest`]s (the records
//! its ranks wrote since the last one: at once for an exit or a lost rank, else every
//! [`super::DIGEST_EVERY`], empty as a keep-alive) and [`ToSupervisor::Bye`] when its node is
//! done; the supervisor sends [`ToAgent::Stop`] requests.
//!
//! The framing is written out here (a length and a JSON body, read by blocking `std` I/O on
//! the agent and by tokio on the supervisor) rather than taken from `tokio-util`'s codec:
//! the agent runs inside the rank shim, which is synchronous, and both sides read the same
//! eight lines.

use hmac::{Hmac, Mac};
use serde::{Deserialize, Serialize};
use sha2::Sha256;
use std::io::{Read, Write};

/// The protocol's version; a peer with another one is refused.
pub const VERSION: u32 = 1;

/// The largest frame accepted: a digest of a node's records (a few hundred bytes a rank).
pub const MAX_FRAME: u32 = 1 << 20;

/// What the supervisor sends an agent.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "t", rename_all = "snake_case")]
pub enum ToAgent {
    /// The first message: the protocol version and the nonce to prove the secret with.
    Hello {
        /// [`VERSION`].
        v: u32,
        /// Hex of 16 random bytes.
        nonce: String,
    },
    /// Signal the node's ranks of `attempt` (every rank when `None`), as
    /// [`kiln_run::write_stop_request`] asks the shims.
    Stop {
        /// The signal.
        signal: i32,
        /// When kiln was asked to stop, Unix seconds.
        time: f64,
        /// The attempt addressed.
        attempt: Option<String>,
    },
}

/// What an agent sends the supervisor.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "t", rename_all = "snake_case")]
pub enum ToSupervisor {
    /// The answer to [`ToAgent::Hello`].
    Join {
        /// [`VERSION`].
        v: u32,
        /// The node, as the scheduler names it ([`kiln_run::this_host`]).
        host: String,
        /// The attempt whose ranks the agent serves.
        attempt: Option<String>,
        /// Hex of [`proof`].
        mac: String,
    },
    /// The ranks' records that changed: `(file name, contents)` (`rank-3`, `exit-3`, ...),
    /// and every rank the node has seen.
    Digest {
        /// Changed records.
        files: Vec<(String, String)>,
        /// The node's ranks so far.
        ranks: Vec<usize>,
    },
    /// The node's ranks are all gone and their records sent: the connection ends cleanly.
    Bye,
}

/// Why a frame could not be read or written.
#[derive(Debug, thiserror::Error)]
pub enum WireError {
    /// The connection failed or closed.
    #[error("connection: {0}")]
    Io(#[from] std::io::Error),
    /// A frame longer than [`MAX_FRAME`].
    #[error("frame of {0} bytes (at most {MAX_FRAME})")]
    TooLong(u32),
    /// A frame that is not a message of this protocol.
    #[error("malformed message: {0}")]
    Json(#[from] serde_json::Error),
}

/// One frame's bytes for `msg`.
pub fn encode(msg: &impl Serialize) -> Result<Vec<u8>, WireError> {
    let body = serde_json::to_vec(msg)?;
    let n = u32::try_from(body.len())
        .ok()
        .filter(|n| *n <= MAX_FRAME)
        .ok_or(WireError::TooLong(u32::MAX))?;
    let mut frame = Vec::with_capacity(4 + body.len());
    frame.extend_from_slice(&n.to_be_bytes());
    frame.extend_from_slice(&body);
    Ok(frame)
}

/// Writes one message (blocking).
pub fn send(w: &mut impl Write, msg: &impl Serialize) -> Result<(), WireError> {
    w.write_all(&encode(msg)?)?;
    Ok(())
}

/// The body length a frame's header announces, if acceptable.
pub fn body_len(header: [u8; 4]) -> Result<usize, WireError> {
    let n = u32::from_be_bytes(header);
    if n > MAX_FRAME {
        return Err(WireError::TooLong(n));
    }
    Ok(n as usize)
}

/// Reads one message (blocking).
pub fn recv<T: for<'de> Deserialize<'de>>(r: &mut impl Read) -> Result<T, WireError> {
    let mut header = [0u8; 4];
    r.read_exact(&mut header)?;
    let mut body = vec![0u8; body_len(header)?];
    r.read_exact(&mut body)?;
    Ok(serde_json::from_slice(&body)?)
}

/// The proof that a joining agent knows `secret`: HMAC-SHA256 over the nonce, the host and
/// the attempt.
pub fn proof(secret: &str, nonce: &str, host: &str, attempt: Option<&str>) -> Vec<u8> {
    mac(secret, nonce, host, attempt)
        .finalize()
        .into_bytes()
        .to_vec()
}

/// Whether `mac_hex` proves `secret` for this nonce, host and attempt (compared in constant
/// time).
pub fn verify(secret: &str, nonce: &str, host: &str, attempt: Option<&str>, mac_hex: &str) -> bool {
    let Ok(given) = hex::decode(mac_hex) else {
        return false;
    };
    mac(secret, nonce, host, attempt)
        .verify_slice(&given)
        .is_ok()
}

fn mac(secret: &str, nonce: &str, host: &str, attempt: Option<&str>) -> Hmac<Sha256> {
    // HMAC takes a key of any length; `new_from_slice` cannot fail for it.
    let mut m = <Hmac<Sha256> as Mac>::new_from_slice(secret.as_bytes())
        .unwrap_or_else(|_| unreachable!("HMAC accepts keys of any length"));
    for part in [
        "kiln-plane",
        &VERSION.to_string(),
        nonce,
        host,
        attempt.unwrap_or("-"),
    ] {
        m.update(part.as_bytes());
        m.update(b"\n");
    }
    m
}

/// Hex of `n` random bytes from the operating system.
pub fn random_hex(n: usize) -> std::io::Result<String> {
    let mut bytes = vec![0u8; n];
    getrandom::getrandom(&mut bytes).map_err(|e| std::io::Error::other(e.to_string()))?;
    Ok(hex::encode(bytes))
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn messages_round_trip_through_frames() {
        let msgs = [
            ToSupervisor::Join {
                v: VERSION,
                host: "n1".into(),
                attempt: Some("a".into()),
                mac: "00".into(),
            },
            ToSupervisor::Digest {
                files: vec![("rank-3".into(), "12 train 1.0 n1\n".into())],
                ranks: vec![3, 4],
            },
            ToSupervisor::Bye,
        ];
        let mut buf = Vec::new();
        for m in &msgs {
            send(&mut buf, m).unwrap();
        }
        let mut r = buf.as_slice();
        for m in &msgs {
            assert_eq!(&recv::<ToSupervisor>(&mut r).unwrap(), m);
        }
        assert!(matches!(
            recv::<ToSupervisor>(&mut r),
            Err(WireError::Io(_))
        ));
    }

    #[test]
    fn the_proof_needs_the_secret_nonce_host_and_attempt() {
        let mac = hex::encode(proof("s3cret", "n0", "h", Some("a")));
        assert!(verify("s3cret", "n0", "h", Some("a"), &mac));
        assert!(!verify("other", "n0", "h", Some("a"), &mac));
        assert!(!verify("s3cret", "n1", "h", Some("a"), &mac));
        assert!(!verify("s3cret", "n0", "g", Some("a"), &mac));
        assert!(!verify("s3cret", "n0", "h", None, &mac));
        assert!(!verify("s3cret", "n0", "h", Some("a"), "zz"));
    }

    #[test]
    fn oversized_frames_are_refused_before_reading_them() {
        let mut r: &[u8] = &(MAX_FRAME + 1).to_be_bytes();
        assert!(matches!(
            recv::<ToAgent>(&mut r),
            Err(WireError::TooLong(n)) if n == MAX_FRAME + 1
        ));
    }

    proptest! {
        /// Whatever bytes arrive, reading them gives a message or an error, never a panic or
        /// an allocation past the frame limit.
        #[test]
        fn any_bytes_are_survived(bytes in prop::collection::vec(any::<u8>(), 0..600)) {
            let mut r = bytes.as_slice();
            for _ in 0..4 {
                if recv::<ToSupervisor>(&mut r).is_err() {
                    break;
                }
            }
        }
    }
}

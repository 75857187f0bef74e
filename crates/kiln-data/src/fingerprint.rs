//! File fingerprints: a fast sampled one (size + SHA-256 of the head, the tail and 64 pages
//! spread evenly through the file) and the full SHA-256.
//!
//! The sampled fingerprint reads at most ~2.3 MiB per file whatever its size, is independent
//! of the path and mtime (so a corpus copied to node-local disk keeps its cache and its pin),
//! and catches the usual ways a shard changes: re-emission (different size or different
//! bytes near any sampled page), truncation and appends. The full hash catches the rest.

use crate::error::{DataError, Result};
use sha2::{Digest, Sha256};
use std::fs::File;
use std::io::{Read, Seek, SeekFrom};
use std::path::Path;

const EDGE: u64 = 1 << 20;
const PAGE: u64 = 4096;
const PAGES: u64 = 64;

/// Size and sampled SHA-256 of a file, as hex.
pub fn sampled(path: &Path) -> Result<(u64, String)> {
    let io = |e| DataError::io(path, e);
    let mut f = kiln_run::files::open_regular(path).map_err(io)?;
    let size = f.metadata().map_err(io)?.len();
    let mut h = Sha256::new();
    h.update(b"kiln-sampled-v1");
    h.update(size.to_le_bytes());
    let mut buf = Vec::new();
    let mut read_at = |f: &mut File, at: u64, len: u64, h: &mut Sha256| -> Result<()> {
        buf.resize(len as usize, 0);
        f.seek(SeekFrom::Start(at)).map_err(io)?;
        f.read_exact(&mut buf).map_err(io)?;
        h.update(&buf);
        Ok(())
    };
    if size <= 2 * EDGE + PAGES * PAGE {
        read_at(&mut f, 0, size, &mut h)?;
    } else {
        read_at(&mut f, 0, EDGE, &mut h)?;
        let span = size - 2 * EDGE - PAGE;
        for i in 0..PAGES {
            read_at(&mut f, EDGE + span * i / (PAGES - 1), PAGE, &mut h)?;
        }
        read_at(&mut f, size - EDGE, EDGE, &mut h)?;
    }
    Ok((size, hex::encode(h.finalize())))
}

/// Full SHA-256 of a file, as hex; `progress` is called with the bytes read so far.
pub fn full(path: &Path, mut progress: impl FnMut(u64)) -> Result<String> {
    let io = |e| DataError::io(path, e);
    let mut f = kiln_run::files::open_regular(path).map_err(io)?;
    let mut h = Sha256::new();
    let mut buf = vec![0u8; 4 << 20];
    let mut done = 0u64;
    loop {
        let n = f.read(&mut buf).map_err(io)?;
        if n == 0 {
            break;
        }
        h.update(&buf[..n]);
        done += n as u64;
        progress(done);
    }
    Ok(hex::encode(h.finalize()))
}

/// The first 8 bytes of a hex digest as a `u64`, for deriving seeds and cache names.
pub fn digest_u64(hex_digest: &str) -> u64 {
    let bytes = hex::decode(&hex_digest[..16.min(hex_digest.len())]).unwrap_or_default();
    let mut a = [0u8; 8];
    a[..bytes.len().min(8)].copy_from_slice(&bytes[..bytes.len().min(8)]);
    u64::from_le_bytes(a)
}

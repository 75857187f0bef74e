//! The index cache: files named by a hash of everything that affects their content, written
//! to a unique temporary name and renamed into place, so that a reader (another rank, another
//! job) never sees a partial file, and two builders racing on a cold cache both end with the
//! same, complete file. An advisory lock on a sibling `.lock` file makes the second builder
//! wait for the first and reuse its result instead of repeating the work; where locks do not
//! work (some network file systems), the rename alone still keeps readers safe.
//!
//! Every cache file starts with a header: magic, format version, the 32-byte key, the payload
//! length; a file whose header or length does not match is ignored and rebuilt.

use crate::error::{DataError, Result};
use crate::indexed::tmp_name;
use memmap2::Mmap;
use sha2::{Digest, Sha256};
use std::fs::{File, OpenOptions};
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};

/// Environment variable naming the index cache directory when no explicit one is given.
pub const CACHE_DIR_ENV: &str = "KILN_DATA_CACHE";

/// The index cache directory for a corpus list: `explicit` if given (`--cache-dir`,
/// `data.cache_dir`), else `$KILN_DATA_CACHE` if set and not empty, else `.kiln-cache` next
/// to the list. `kiln data` and `kiln train` both ask here, so a cache one builds the other
/// finds.
pub fn cache_dir(explicit: Option<&Path>, list: &Path) -> PathBuf {
    if let Some(dir) = explicit.filter(|d| !d.as_os_str().is_empty()) {
        return dir.to_path_buf();
    }
    if let Some(dir) = std::env::var_os(CACHE_DIR_ENV).filter(|d| !d.is_empty()) {
        return PathBuf::from(dir);
    }
    list.parent()
        .filter(|p| !p.as_os_str().is_empty())
        .unwrap_or(Path::new("."))
        .join(".kiln-cache")
}

const MAGIC: &[u8; 8] = b"KILNIDX1";
/// Header bytes: magic, kind tag (8), key (32), payload length (8).
pub const HEADER: usize = 8 + 8 + 32 + 8;

/// A cache key: SHA-256 over a description of every input.
#[derive(Debug, Clone)]
pub struct Key {
    pub kind: [u8; 8],
    pub digest: [u8; 32],
}

impl Key {
    /// Key for a kind of file (8 ASCII bytes) and a canonical description of its inputs.
    pub fn new(kind: &[u8; 8], description: &str) -> Key {
        let mut h = Sha256::new();
        h.update(kind);
        h.update(description.as_bytes());
        Key {
            kind: *kind,
            digest: h.finalize().into(),
        }
    }

    /// The file name for this key.
    pub fn file_name(&self, stem: &str) -> String {
        format!(
            "{stem}-{}.{}",
            &hex::encode(self.digest)[..24],
            String::from_utf8_lossy(&self.kind).trim().to_lowercase()
        )
    }

    /// The cache file of this key for the dataset at `prefix`, under `cache_dir` (named
    /// after the dataset, so an operator can tell whose it is).
    pub fn dataset_path(&self, cache_dir: &Path, prefix: &Path) -> PathBuf {
        let stem = prefix
            .file_name()
            .map(|s| s.to_string_lossy().into_owned())
            .unwrap_or_else(|| "dataset".into());
        cache_dir.join(self.file_name(&stem))
    }
}

/// A cache file mapped read-only; `payload()` is the bytes after the header.
#[derive(Debug)]
pub struct CacheFile {
    pub path: PathBuf,
    map: Option<Mmap>,
    len: usize,
}

impl CacheFile {
    /// The payload bytes.
    pub fn payload(&self) -> &[u8] {
        match &self.map {
            Some(m) => &m[HEADER..HEADER + self.len],
            None => &[],
        }
    }
}

/// What the data layer asks to change when an index is too large for the machine.
pub const FIX_SAMPLES: &str =
    "lower the number of samples (`kiln data blend --samples`, or training.steps x batch size)";

/// Refuses to build `what` when it needs more than the memory this process may use
/// ([`kiln_run::host::available_memory`]) or, for the file written into `dir`, more than the
/// free space there: an error with both numbers and `fix`, instead of an allocation abort or
/// a full disk after minutes of work. Sizes are in bytes, as f64 so that absurd requests
/// cannot overflow.
pub fn ensure_room(what: &str, memory: f64, disk: f64, dir: &Path, fix: &str) -> Result<()> {
    let h = kiln_run::host::human_bytes;
    if let Some(limit) = kiln_run::host::available_memory()
        && memory > limit.bytes as f64
    {
        return Err(DataError::Invalid(format!(
            "{what} needs about {} of memory to build, but {} is available ({}); {fix}",
            h(memory),
            h(limit.bytes as f64),
            limit.source
        )));
    }
    if let Some(free) = kiln_run::host::disk_available(dir)
        && disk > free as f64
    {
        return Err(DataError::Invalid(format!(
            "{what} needs {} on disk in {}, but {} is free there; {fix}",
            h(disk),
            dir.display(),
            h(free as f64)
        )));
    }
    Ok(())
}

/// Open a cache file if it exists and is complete and matches `key`.
pub fn open(path: &Path, key: &Key) -> Result<Option<CacheFile>> {
    let file = match kiln_run::files::open_regular(path) {
        Ok(f) => f,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(DataError::io(path, e)),
    };
    let size = file.metadata().map_err(|e| DataError::io(path, e))?.len() as usize;
    if size < HEADER {
        tracing::warn!(path = %path.display(), "ignoring truncated cache file");
        return Ok(None);
    }
    // SAFETY: cache files are only ever replaced by rename, never modified in place, so the
    // mapped inode stays intact for as long as we hold it.
    let map = unsafe { Mmap::map(&file) }.map_err(|e| DataError::io(path, e))?;
    let mut l = [0u8; 8];
    l.copy_from_slice(&map[48..56]);
    let len = u64::from_le_bytes(l) as usize;
    if &map[..8] != MAGIC
        || map[8..16] != key.kind
        || map[16..48] != key.digest
        || HEADER.checked_add(len) != Some(size)
    {
        tracing::warn!(path = %path.display(), "ignoring cache file with a foreign or torn header");
        return Ok(None);
    }
    Ok(Some(CacheFile {
        path: path.to_path_buf(),
        map: Some(map),
        len,
    }))
}

/// Exclusive advisory lock on `path.lock`, held until dropped. Failing to lock (unsupported
/// file system) is not an error: correctness rests on the atomic rename.
pub struct BuildLock {
    _file: Option<File>,
}

/// Take the build lock for a cache file.
pub fn lock(path: &Path) -> Result<BuildLock> {
    let mut s = path.as_os_str().to_owned();
    s.push(".lock");
    let lock_path = PathBuf::from(s);
    let file = OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(&lock_path)
        .map_err(|e| DataError::io(&lock_path, e))?;
    match file.lock() {
        Ok(()) => Ok(BuildLock { _file: Some(file) }),
        Err(e) => {
            tracing::warn!(path = %lock_path.display(), error = %e, "cannot lock; relying on atomic rename");
            Ok(BuildLock { _file: None })
        }
    }
}

/// Write `payload` (given as parts) under `path` atomically: temporary name, fsync, rename.
pub fn write(path: &Path, key: &Key, parts: &[&[u8]]) -> Result<()> {
    let tmp = tmp_name(path);
    let io = |e| DataError::io(&tmp, e);
    let result = (|| {
        let file = File::create(&tmp).map_err(io)?;
        let mut w = BufWriter::with_capacity(1 << 20, file);
        let len: usize = parts.iter().map(|p| p.len()).sum();
        w.write_all(MAGIC).map_err(io)?;
        w.write_all(&key.kind).map_err(io)?;
        w.write_all(&key.digest).map_err(io)?;
        w.write_all(&(len as u64).to_le_bytes()).map_err(io)?;
        for p in parts {
            w.write_all(p).map_err(io)?;
        }
        let file = w.into_inner().map_err(|e| io(e.into_error()))?;
        file.sync_all().map_err(io)?;
        std::fs::rename(&tmp, path).map_err(|e| DataError::io(path, e))
    })();
    if result.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    result
}

/// A cache file being written by [`write_with`]: its payload is written at offsets, in any
/// order, straight to the file (nothing of it need be held in memory).
pub struct Payload<'a> {
    file: &'a File,
    path: &'a Path,
}

impl Payload<'_> {
    /// Write `bytes` at payload offset `at`.
    pub fn write_at(&self, at: u64, bytes: &[u8]) -> Result<()> {
        use std::os::unix::fs::FileExt;
        self.file
            .write_all_at(bytes, HEADER as u64 + at)
            .map_err(|e| DataError::io(self.path, e))
    }
}

/// [`write`] for a payload of `len` bytes that `fill` writes piece by piece
/// ([`Payload::write_at`]); a payload `fill` leaves short is an error, and nothing is
/// published.
pub fn write_with(
    path: &Path,
    key: &Key,
    len: u64,
    fill: impl FnOnce(&Payload) -> Result<()>,
) -> Result<()> {
    let tmp = tmp_name(path);
    let io = |e| DataError::io(&tmp, e);
    let result = (|| {
        use std::os::unix::fs::FileExt;
        let file = File::create(&tmp).map_err(io)?;
        let mut head = Vec::with_capacity(HEADER);
        head.extend_from_slice(MAGIC);
        head.extend_from_slice(&key.kind);
        head.extend_from_slice(&key.digest);
        head.extend_from_slice(&len.to_le_bytes());
        file.write_all_at(&head, 0).map_err(io)?;
        fill(&Payload {
            file: &file,
            path: &tmp,
        })?;
        let size = file.metadata().map_err(io)?.len();
        if size != HEADER as u64 + len {
            return Err(DataError::format(
                &tmp,
                format!(
                    "cache payload written short: {size} bytes, expected {}",
                    HEADER as u64 + len
                ),
            ));
        }
        file.sync_all().map_err(io)?;
        std::fs::rename(&tmp, path).map_err(|e| DataError::io(path, e))
    })();
    if result.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    result
}

/// [`get_or_build`] for a payload written piece by piece ([`write_with`]).
pub fn get_or_build_with(
    path: &Path,
    key: &Key,
    len: u64,
    fill: impl FnOnce(&Payload) -> Result<()>,
) -> Result<CacheFile> {
    if let Some(f) = open(path, key)? {
        return Ok(f);
    }
    let _guard = lock(path)?;
    if let Some(f) = open(path, key)? {
        tracing::debug!(path = %path.display(), "cache built by another process");
        return Ok(f);
    }
    write_with(path, key, len, fill)?;
    open(path, key)?.ok_or_else(|| {
        DataError::format(
            path,
            "cache file vanished or changed right after it was written",
        )
    })
}

/// Open a cache file, or build it under the lock and open the result.
pub fn get_or_build(
    path: &Path,
    key: &Key,
    build: impl FnOnce() -> Result<Vec<Vec<u8>>>,
) -> Result<CacheFile> {
    if let Some(f) = open(path, key)? {
        return Ok(f);
    }
    let _guard = lock(path)?;
    // Another process may have finished the build while we waited for the lock.
    if let Some(f) = open(path, key)? {
        tracing::debug!(path = %path.display(), "cache built by another process");
        return Ok(f);
    }
    let parts = build()?;
    let refs: Vec<&[u8]> = parts.iter().map(|p| p.as_slice()).collect();
    write(path, key, &refs)?;
    open(path, key)?.ok_or_else(|| {
        DataError::format(
            path,
            "cache file vanished or changed right after it was written",
        )
    })
}

/// Read a little-endian u64 at word `i` of a byte slice.
#[inline]
pub fn word(b: &[u8], i: usize) -> u64 {
    let mut a = [0u8; 8];
    a.copy_from_slice(&b[8 * i..8 * i + 8]);
    u64::from_le_bytes(a)
}

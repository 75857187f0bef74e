//! Reading files whose names come from other files (corpus lists, task files, tokenizer and
//! config paths, manifests): anything a user may have received from elsewhere.
//!
//! Such a name can point anywhere: at a FIFO (opening it blocks forever), at `/dev/zero` or
//! `/dev/urandom` (reading never ends), at a directory, or at a file far larger than the
//! format ever needs. The rule: only regular files are opened (checked before the open, and
//! again on the open descriptor, which is opened non-blocking so a FIFO swapped in between
//! cannot hang the process), and whole-file reads are bounded by a limit the caller states.
//! std has no such reader, hence this module.
//!
//! Errors are plain [`std::io::Error`]s whose message says what is wrong; callers add the
//! path, as they do for every other I/O error.
//!
//! Writing: [`write_atomic`] is kiln's one write-to-a-temporary-name-then-rename for whole
//! files (beacons, exit and stop records, batch scripts, run-directory files, manifests).

use std::fs::{File, Metadata, OpenOptions};
use std::io::{self, Read, Write};
use std::os::unix::fs::{FileTypeExt, OpenOptionsExt};
use std::path::Path;

/// One mebibyte, for stating limits.
pub const MIB: u64 = 1 << 20;

/// What kind of file `meta` describes, for error messages ("a FIFO", "a directory", ...).
fn kind(meta: &Metadata) -> &'static str {
    let t = meta.file_type();
    if t.is_dir() {
        "a directory"
    } else if t.is_fifo() {
        "a FIFO"
    } else if t.is_char_device() {
        "a character device"
    } else if t.is_block_device() {
        "a block device"
    } else if t.is_socket() {
        "a socket"
    } else {
        "not a regular file"
    }
}

fn not_regular(meta: &Metadata) -> io::Error {
    io::Error::new(
        io::ErrorKind::InvalidInput,
        format!(
            "is {}, not a regular file; kiln reads only regular files here",
            kind(meta)
        ),
    )
}

/// Opens `path` for reading if (following symlinks) it is a regular file; a FIFO, device,
/// socket or directory is refused without being opened for blocking I/O.
pub fn open_regular(path: &Path) -> io::Result<File> {
    let meta = std::fs::metadata(path)?;
    if !meta.is_file() {
        return Err(not_regular(&meta));
    }
    // Non-blocking, so that a FIFO put in place after the check above returns at once and
    // is refused below instead of blocking until a writer appears. Reads of regular files
    // ignore the flag.
    let file = OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK)
        .open(path)?;
    let meta = file.metadata()?;
    if !meta.is_file() {
        return Err(not_regular(&meta));
    }
    Ok(file)
}

/// Opens `path` for appending (creating it if absent) if it is a regular file: a FIFO with no
/// reader fails at once instead of blocking the open, and a device or directory is refused.
pub fn open_append_regular(path: &Path) -> io::Result<File> {
    if let Ok(meta) = std::fs::metadata(path)
        && !meta.is_file()
    {
        return Err(not_regular(&meta));
    }
    let file = OpenOptions::new()
        .create(true)
        .append(true)
        .custom_flags(libc::O_NONBLOCK)
        .open(path)
        .map_err(|e| match e.raw_os_error() {
            // A FIFO put in place after the check, with no reader: O_NONBLOCK makes it ENXIO.
            Some(libc::ENXIO) => io::Error::new(
                io::ErrorKind::InvalidInput,
                "is a FIFO, not a regular file; kiln writes only regular files here",
            ),
            _ => e,
        })?;
    let meta = file.metadata()?;
    if !meta.is_file() {
        return Err(not_regular(&meta));
    }
    Ok(file)
}

/// The whole of the regular file `path`, refusing one larger than `limit` bytes (`what`
/// names the kind of file in the message, e.g. "a corpus list").
pub fn read_limited(path: &Path, limit: u64, what: &str) -> io::Result<Vec<u8>> {
    let file = open_regular(path)?;
    let size = file.metadata()?.len();
    let too_big = |size: u64| {
        io::Error::new(
            io::ErrorKind::InvalidData,
            format!(
                "is {size} bytes, more than the {limit} bytes {what} may have; is this the right file?"
            ),
        )
    };
    if size > limit {
        return Err(too_big(size));
    }
    // The size can change under us (a file still being written): read at most limit + 1.
    let mut bytes = Vec::with_capacity(size as usize);
    file.take(limit + 1).read_to_end(&mut bytes)?;
    if bytes.len() as u64 > limit {
        return Err(too_big(bytes.len() as u64));
    }
    Ok(bytes)
}

/// [`read_limited`] as UTF-8 text.
pub fn read_to_string_limited(path: &Path, limit: u64, what: &str) -> io::Result<String> {
    let bytes = read_limited(path, limit, what)?;
    String::from_utf8(bytes).map_err(|e| {
        io::Error::new(
            io::ErrorKind::InvalidData,
            format!(
                "is not UTF-8 text (invalid byte at offset {})",
                e.utf8_error().valid_up_to()
            ),
        )
    })
}

/// How [`write_atomic`] writes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Atomic {
    /// fsync before the rename: the file survives a crash of the machine, not only of the
    /// writer (off for records rewritten every step, such as beacons).
    pub durable: bool,
    /// Permission bits of the new file (before the umask).
    pub mode: u32,
}

impl Atomic {
    /// A small record rewritten often (beacons, exit and stop records): no fsync.
    pub const RECORD: Self = Self {
        durable: false,
        mode: 0o666,
    };
    /// A file that must survive a crash (configs, manifests, scripts).
    pub const DURABLE: Self = Self {
        durable: true,
        mode: 0o666,
    };
}

/// Replaces `path` with `bytes` so that a reader sees the old file or the new one, never a
/// part: written to a temporary name beside it (a link planted there is not followed),
/// fsynced when [`Atomic::durable`], then renamed over `path` (a link at `path` is replaced,
/// not followed). The temporary file is removed if anything fails.
pub fn write_atomic(path: &Path, bytes: &[u8], how: Atomic) -> io::Result<()> {
    static COUNTER: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let n = COUNTER.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let tmp = path.with_file_name(format!(".{name}.tmp-{}-{n}", std::process::id()));
    let write = || -> io::Result<()> {
        let mut f = OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .mode(how.mode)
            .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
            .open(&tmp)?;
        f.write_all(bytes)?;
        if how.durable {
            f.sync_all()?;
        }
        std::fs::rename(&tmp, path)
    };
    write().inspect_err(|_| {
        let _ = std::fs::remove_file(&tmp);
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn regular_files_are_read_within_their_limit() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("a.txt");
        std::fs::write(&p, "hello").unwrap();
        assert_eq!(
            read_to_string_limited(&p, 5, "a test file").unwrap(),
            "hello"
        );
        let e = read_to_string_limited(&p, 4, "a test file").unwrap_err();
        assert!(
            e.to_string()
                .contains("5 bytes, more than the 4 bytes a test file"),
            "{e}"
        );
        std::fs::write(&p, [0xff, 0xfe]).unwrap();
        let e = read_to_string_limited(&p, 100, "x").unwrap_err();
        assert!(e.to_string().contains("not UTF-8"), "{e}");
    }

    #[test]
    fn special_files_are_refused_without_blocking() {
        let dir = tempfile::tempdir().unwrap();
        let e = read_limited(dir.path(), 100, "x").unwrap_err();
        assert!(e.to_string().contains("is a directory"), "{e}");
        let e = read_limited(Path::new("/dev/zero"), 100, "x").unwrap_err();
        assert!(e.to_string().contains("is a character device"), "{e}");
        // A FIFO with no writer: a plain open would block forever.
        let fifo = dir.path().join("fifo");
        let c = std::ffi::CString::new(fifo.to_str().unwrap()).unwrap();
        assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
        let e = open_regular(&fifo).unwrap_err();
        assert!(e.to_string().contains("is a FIFO"), "{e}");
        // Through a symlink too.
        let link = dir.path().join("link");
        std::os::unix::fs::symlink(&fifo, &link).unwrap();
        assert!(open_regular(&link).is_err());
        let e = open_append_regular(&fifo).unwrap_err();
        assert!(e.to_string().contains("is a FIFO"), "{e}");
        let e = open_append_regular(dir.path()).unwrap_err();
        assert!(e.to_string().contains("is a directory"), "{e}");
        let new = dir.path().join("new");
        open_append_regular(&new).unwrap();
        assert!(new.is_file());
        let missing = read_limited(&dir.path().join("nope"), 1, "x").unwrap_err();
        assert_eq!(missing.kind(), io::ErrorKind::NotFound);
    }
}

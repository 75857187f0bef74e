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

use std::fs::{File, Metadata, OpenOptions};
use std::io::{self, Read};
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

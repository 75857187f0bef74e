//! Opening the run directory's append-only JSON-lines files (`events.jsonl`,
//! `metrics.jsonl`) safely: never through a symlink (a planted `metrics.jsonl -> victim`
//! must not make kiln append to the victim), and with a torn last line (a writer killed
//! mid-write, or a full disk) cut off, so the next record does not get glued onto it.

use std::fs::{File, OpenOptions};
use std::io::{Read, Seek, SeekFrom};
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;

/// Opens `path` for appending (creating it), refusing a symlink, and truncates an incomplete
/// last line. Returns the file and how many bytes were cut (0 when the file was whole).
pub fn open_append(path: &Path) -> std::io::Result<(File, u64)> {
    let mut file = OpenOptions::new()
        .create(true)
        .read(true)
        .append(true)
        .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
        .open(path)
        .map_err(|e| {
            if e.raw_os_error() == Some(libc::ELOOP) {
                std::io::Error::other("is a symbolic link; kiln does not write through links in a run directory (remove it)")
            } else {
                e
            }
        })?;
    if !file.metadata()?.is_file() {
        return Err(std::io::Error::other(
            "is not a regular file; kiln appends only to regular files",
        ));
    }
    let cut = repair_torn_tail(&mut file)?;
    Ok((file, cut))
}

/// Cuts everything after the last newline. Returns the number of bytes removed.
fn repair_torn_tail(file: &mut File) -> std::io::Result<u64> {
    let len = file.metadata()?.len();
    if len == 0 {
        return Ok(0);
    }
    // Scan backwards in blocks for the last '\n'.
    const BLOCK: u64 = 64 * 1024;
    let mut end = len;
    let mut buf = vec![0u8; BLOCK as usize];
    while end > 0 {
        let start = end.saturating_sub(BLOCK);
        let n = (end - start) as usize;
        file.seek(SeekFrom::Start(start))?;
        file.read_exact(&mut buf[..n])?;
        if let Some(pos) = buf[..n].iter().rposition(|&b| b == b'\n') {
            let keep = start + pos as u64 + 1;
            if keep < len {
                file.set_len(keep)?;
            }
            return Ok(len - keep);
        }
        end = start;
    }
    // No newline at all: the whole file is one torn line.
    file.set_len(0)?;
    Ok(len)
}

/// The longest line kiln reads from a JSON-lines log: events and metrics lines are a few
/// hundred bytes; a longer one is damage (or a planted file), and reading it whole could take
/// all of the memory.
pub const MAX_LINE_BYTES: usize = 1 << 20;

/// Why a JSON-lines file could not be read.
#[derive(Debug)]
pub enum JsonlError {
    /// Reading failed (or the file is not a regular file).
    Io(std::io::Error),
    /// A line other than the last is malformed, too long or not UTF-8.
    Line {
        /// 1-based line number.
        line: usize,
        /// What is wrong.
        message: String,
    },
}

/// The next line of `reader` without its newline, keeping at most `max` bytes of it: `None`
/// at the end, `Some(Err(len))` for a line of `len` bytes longer than `max` (skipped whole).
fn next_line(
    reader: &mut impl std::io::BufRead,
    max: usize,
    line: &mut Vec<u8>,
) -> std::io::Result<Option<Result<(), u64>>> {
    line.clear();
    let (mut len, mut any) = (0u64, false);
    loop {
        let buf = reader.fill_buf()?;
        if buf.is_empty() {
            return Ok(any.then_some(if len > max as u64 { Err(len) } else { Ok(()) }));
        }
        any = true;
        let (chunk, done) = match buf.iter().position(|&b| b == b'\n') {
            Some(i) => (&buf[..i], true),
            None => (buf, false),
        };
        len += chunk.len() as u64;
        if len <= max as u64 {
            line.extend_from_slice(chunk);
        }
        let used = chunk.len() + usize::from(done);
        reader.consume(used);
        if done {
            return Ok(Some(if len > max as u64 { Err(len) } else { Ok(()) }));
        }
    }
}

/// Reads the JSON-lines file `path` with `parse` (given each non-blank line; `Ok(None)` drops
/// it), in memory bounded by `max_line` per line. Only a regular file is opened (a FIFO is
/// refused without blocking); an absent file is empty. A malformed, overlong or non-UTF-8
/// last line is a torn write and skipped; any other is an error naming it.
pub fn read_jsonl<T>(
    path: &Path,
    max_line: usize,
    mut parse: impl FnMut(&str) -> Result<Option<T>, String>,
) -> Result<Vec<T>, JsonlError> {
    let file = match crate::files::open_regular(path) {
        Ok(f) => f,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(JsonlError::Io(e)),
    };
    let mut reader = std::io::BufReader::with_capacity(64 * 1024, file);
    let (mut out, mut line, mut n) = (Vec::new(), Vec::new(), 0usize);
    // A bad line is an error only once another line follows it.
    let mut pending: Option<JsonlError> = None;
    while let Some(read) = next_line(&mut reader, max_line, &mut line).map_err(JsonlError::Io)? {
        n += 1;
        if let Some(e) = pending.take() {
            return Err(e);
        }
        let bad = |message: String| JsonlError::Line { line: n, message };
        let parsed = match read {
            Err(len) => Err(bad(format!(
                "is {len} bytes long, more than the {max_line} bytes a line may have"
            ))),
            Ok(()) => match std::str::from_utf8(&line) {
                Err(_) => Err(bad("is not UTF-8".into())),
                Ok(text) if text.trim().is_empty() => Ok(None),
                Ok(text) => parse(text).map_err(bad),
            },
        };
        match parsed {
            Ok(v) => out.extend(v),
            Err(e) => pending = Some(e),
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    #[test]
    fn torn_tail_is_cut_and_whole_files_are_untouched() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("m.jsonl");
        std::fs::write(&p, "{\"a\":1}\n{\"b\":").unwrap();
        let (mut f, cut) = open_append(&p).unwrap();
        assert_eq!(cut, 5);
        f.write_all(b"{\"c\":3}\n").unwrap();
        assert_eq!(
            std::fs::read_to_string(&p).unwrap(),
            "{\"a\":1}\n{\"c\":3}\n"
        );
        let (_, cut) = open_append(&p).unwrap();
        assert_eq!(cut, 0);
        std::fs::write(&p, "no newline at all").unwrap();
        assert_eq!(open_append(&p).unwrap().1, 17);
        assert_eq!(std::fs::read(&p).unwrap().len(), 0);
    }

    #[test]
    fn lines_are_read_within_their_bound_and_a_bad_last_line_is_torn() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("e.jsonl");
        let long = "x".repeat(100);
        let parse = |l: &str| match l {
            "bad" => Err("bad".to_string()),
            l => Ok(Some(l.len())),
        };
        std::fs::write(&p, format!("ab\n\n{long}\nabc\n{long}")).unwrap();
        match read_jsonl(&p, 10, parse) {
            Err(JsonlError::Line { line: 3, message }) => {
                assert!(message.contains("100 bytes long"), "{message}")
            }
            other => panic!("{other:?}"),
        }
        std::fs::write(&p, format!("ab\nabc\n{long}")).unwrap();
        assert_eq!(read_jsonl(&p, 10, parse).unwrap(), [2, 3]);
        std::fs::write(&p, "ab\nbad\nabc\n").unwrap();
        assert!(matches!(
            read_jsonl(&p, 10, parse),
            Err(JsonlError::Line { line: 2, .. })
        ));
        assert!(
            read_jsonl(&dir.path().join("absent"), 10, parse)
                .unwrap()
                .is_empty()
        );
        assert!(matches!(
            read_jsonl(dir.path(), 10, parse),
            Err(JsonlError::Io(_))
        ));
    }

    #[test]
    fn symlinks_are_refused() {
        let dir = tempfile::tempdir().unwrap();
        let victim = dir.path().join("victim");
        std::fs::write(&victim, "precious\n").unwrap();
        let link = dir.path().join("events.jsonl");
        std::os::unix::fs::symlink(&victim, &link).unwrap();
        let err = open_append(&link).unwrap_err().to_string();
        assert!(err.contains("symbolic link"), "{err}");
        assert_eq!(std::fs::read_to_string(&victim).unwrap(), "precious\n");
    }
}

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

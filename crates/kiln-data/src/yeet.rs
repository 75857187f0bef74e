//! `kiln yeet`: put a file, a directory or a tarball on every node's local disk, reading the
//! shared file system once.
//!
//! Rank 0 reads the source (a directory is streamed as a tar archive as it is read) and
//! broadcasts it over MPI in chunks; MPI's broadcast is a tree, so each chunk reaches N
//! nodes in log2(N) rounds while the next chunk is already being read. One rank per node
//! (its node-local rank 0) writes what it receives as it arrives (a file to a temporary file,
//! an archive unpacked by a thread into a temporary directory, so the bytes are written
//! once), checks the stream's SHA-256 against the one rank 0 computed, and renames the
//! result into place: a node has the whole tree or nothing. An archive member that would
//! land outside the destination (an absolute path, `..`, a link pointing out, a device file)
//! is refused and nothing is published.
//!
//! A writer that fails (disk full, destination exists) keeps taking part in every broadcast
//! until the stream ends and reports its failure in the final all-gather: a rank that left
//! early would leave all the others waiting in a broadcast.

use kiln_dist::Collective;
use sha2::{Digest, Sha256};
use std::fs::File;
use std::io::{BufReader, Read, Write};
use std::path::{Component, Path, PathBuf};
use std::sync::mpsc::{Receiver, SyncSender, sync_channel};
use std::thread::JoinHandle;
use std::time::Instant;

/// Bytes per broadcast.
const CHUNK: usize = 4 << 20;

/// Errors of a yeet.
#[derive(Debug, thiserror::Error)]
pub enum YeetError {
    /// Reading the source or writing the destination failed.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The cause.
        source: std::io::Error,
    },
    /// The source is not something yeet can send.
    #[error("{0}")]
    Source(String),
    /// The archive holds a member that is refused.
    #[error("archive member {member:?}: {reason}; nothing was published")]
    Unsafe {
        /// The member's path in the archive.
        member: String,
        /// Why it is refused.
        reason: String,
    },
    /// The received bytes do not match what rank 0 sent.
    #[error("checksum mismatch on this node: received {got}, rank 0 sent {want}")]
    Checksum {
        /// SHA-256 of what arrived.
        got: String,
        /// SHA-256 rank 0 computed.
        want: String,
    },
    /// Some nodes failed (reported by every rank).
    #[error("{failed} of {writers} nodes failed; see their messages above")]
    Nodes {
        /// Writers that failed.
        failed: usize,
        /// Writers in all.
        writers: usize,
    },
}

impl kiln_run::exit::ExitCoded for YeetError {
    /// A source or archive yeet refuses is invalid input (78, never retried); anything
    /// else (I/O, a checksum, failed nodes) may pass on a retry (1).
    fn exit_code(&self) -> i32 {
        match self {
            YeetError::Unsafe { .. } | YeetError::Source(_) => kiln_run::exit::CONFIG,
            _ => kiln_run::exit::FAILURE,
        }
    }
}

fn io(path: &Path) -> impl FnOnce(std::io::Error) -> YeetError + '_ {
    move |source| YeetError::Io {
        path: path.to_path_buf(),
        source,
    }
}

/// What is being sent, decided by rank 0 from the source.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
enum Kind {
    /// A single file, written as it is.
    File = 1,
    /// A tar archive (a directory streamed as tar, or a `.tar` file), unpacked.
    Tar = 2,
    /// A gzip-compressed tar archive (`.tar.gz`, `.tgz`), unpacked.
    TarGz = 3,
}

impl Kind {
    fn from_u8(v: u8) -> Option<Self> {
        match v {
            1 => Some(Self::File),
            2 => Some(Self::Tar),
            3 => Some(Self::TarGz),
            _ => None,
        }
    }
}

/// What to send and where it lands.
#[derive(Debug, Clone)]
pub struct YeetOptions {
    /// The file, directory or tarball (read by rank 0 only).
    pub source: PathBuf,
    /// The directory on every node that receives it. `{rank}` in it is replaced by each
    /// rank's number, and then every rank writes its own copy (for tests on one machine);
    /// otherwise one rank per node writes.
    pub dest: String,
    /// Replace an existing destination (moved aside, then removed) instead of refusing.
    pub force: bool,
}

/// What a yeet did (on rank 0: for the whole job).
#[derive(Debug, Clone)]
pub struct YeetReport {
    /// Where it landed on this rank's node.
    pub path: PathBuf,
    /// Bytes broadcast.
    pub bytes: u64,
    /// Ranks that wrote a copy.
    pub writers: usize,
    /// Wall time, seconds.
    pub seconds: f64,
    /// SHA-256 of the broadcast stream.
    pub sha256: String,
}

/// Runs a yeet on every rank of `comm` (all ranks must call it with the same options).
pub fn yeet(
    comm: &dyn Collective,
    opts: &YeetOptions,
    progress: impl FnMut(u64),
) -> Result<YeetReport, YeetError> {
    let t0 = Instant::now();
    let per_rank = opts.dest.contains("{rank}");
    let dest = PathBuf::from(opts.dest.replace("{rank}", &comm.rank().to_string()));
    let writer = per_rank || comm.node_local_rank().0 == 0;
    let (kind, name) = agree_on_source(comm, &opts.source)?;
    let target = dest.join(&name);
    // A writer's failure is kept, not returned, so that it stays in the broadcasts (see the
    // module comment).
    let mut sink = match writer {
        true => Some(Sink::create(&dest, &target, kind, opts.force)),
        false => None,
    };
    let (sent, mine) = stream(comm, opts, kind, &mut sink, progress)?;
    let want =
        String::from_utf8_lossy(&broadcast_blob(comm, mine.clone().into_bytes())).into_owned();
    // Verify and publish; then everyone learns how the writers fared.
    let result = match sink {
        Some(Err(e)) => Err(e),
        Some(Ok(s)) if mine != want => {
            s.discard();
            Err(YeetError::Checksum {
                got: mine,
                want: want.clone(),
            })
        }
        Some(Ok(s)) => s.publish(),
        None => Ok(()),
    };
    let writers = tally(comm, writer, result)?;
    Ok(YeetReport {
        path: target,
        bytes: sent,
        writers,
        seconds: t0.elapsed().as_secs_f64(),
        sha256: want,
    })
}

/// Rank 0 tells everyone what comes and under which name (or why it cannot): the source's
/// kind and name on every rank.
fn agree_on_source(comm: &dyn Collective, source: &Path) -> Result<(Kind, String), YeetError> {
    let plan = if comm.rank() == 0 {
        plan_source(source)
    } else {
        Ok((Kind::File, String::new()))
    };
    let header = match &plan {
        Ok((kind, name)) => format!("{}{name}", *kind as u8 as char),
        Err(e) => format!("\0{e}"),
    };
    let header = broadcast_blob(comm, header.into_bytes());
    match header.split_first() {
        Some((0, msg)) => Err(YeetError::Source(String::from_utf8_lossy(msg).into_owned())),
        Some((&k, name)) => Ok((
            Kind::from_u8(k).ok_or_else(|| YeetError::Source("bad header".into()))?,
            String::from_utf8_lossy(name).into_owned(),
        )),
        None => Err(YeetError::Source("empty header".into())),
    }
}

/// The stream: rank 0 reads and broadcasts, writers write what arrives into `sink` (which
/// becomes the writer's error when a write fails). Returns the bytes sent and this rank's
/// SHA-256 of them; an error when rank 0 could not read the source.
fn stream(
    comm: &dyn Collective,
    opts: &YeetOptions,
    kind: Kind,
    sink: &mut Option<Result<Sink, YeetError>>,
    mut progress: impl FnMut(u64),
) -> Result<(u64, String), YeetError> {
    let mut hasher = Sha256::new();
    let mut sent = 0u64;
    let mut reader = match comm.rank() {
        0 => Some(SourceReader::open(&opts.source, kind)?),
        _ => None,
    };
    loop {
        let chunk = match &mut reader {
            Some(r) => r.next_chunk(),
            None => Ok(Vec::new()),
        };
        // A read error on rank 0 is broadcast too, so no rank waits for chunks that will
        // never come.
        let (chunk, failure) = match chunk {
            Ok(c) => (Some(c), None),
            Err(e) => (None, Some(e)),
        };
        let Some(chunk) = broadcast_chunk(comm, chunk) else {
            if let Some(Ok(s)) = sink.take() {
                s.discard();
            }
            return Err(failure.unwrap_or_else(|| {
                YeetError::Source("rank 0 could not read the source (see its message)".into())
            }));
        };
        if chunk.is_empty() {
            return Ok((sent, hex::encode(hasher.finalize())));
        }
        hasher.update(&chunk);
        sent += chunk.len() as u64;
        if let Some(Ok(s)) = sink
            && let Err(e) = s.write(chunk)
            && let Some(Ok(s)) = sink.replace(Err(e))
        {
            s.discard();
        }
        progress(sent);
    }
}

/// Tells every rank how the writers fared; returns the number of writers, or the error this
/// rank must exit with.
fn tally(
    comm: &dyn Collective,
    writer: bool,
    result: Result<(), YeetError>,
) -> Result<usize, YeetError> {
    if let Err(e) = &result {
        eprintln!("kiln yeet: rank {}: {e}", comm.rank());
    }
    let failed = comm.all_gather_u64(u64::from(writer && result.is_err()));
    let writers = comm.all_gather_u64(u64::from(writer));
    let failed = failed.iter().sum::<u64>() as usize;
    let writers = writers.iter().sum::<u64>() as usize;
    // Every rank returns how the job fared, a failed writer too (its own cause is printed
    // above): the first rank to exit is the one the launcher reports before it stops the
    // others, and a failed writer that returned only its own error could exit before rank 0
    // said "1 of 3 nodes failed". A sole writer's own error is the whole story.
    if failed > 0 && (writers > 1 || result.is_ok()) {
        return Err(YeetError::Nodes { failed, writers });
    }
    result.map(|()| writers)
}

/// Broadcasts a variable-length blob from rank 0 (its length first).
fn broadcast_blob(comm: &dyn Collective, blob: Vec<u8>) -> Vec<u8> {
    broadcast_chunk(comm, Some(blob)).unwrap_or_default()
}

/// Broadcasts rank 0's chunk, or rank 0's failure (`None`, sent as the length `u64::MAX`).
fn broadcast_chunk(comm: &dyn Collective, chunk: Option<Vec<u8>>) -> Option<Vec<u8>> {
    if comm.size() == 1 {
        return chunk;
    }
    let mut len = chunk
        .as_ref()
        .map_or(u64::MAX, |c| c.len() as u64)
        .to_le_bytes();
    comm.broadcast_bytes(0, &mut len);
    let len = u64::from_le_bytes(len);
    if len == u64::MAX {
        return None;
    }
    let mut blob = chunk.unwrap_or_default();
    blob.resize(len as usize, 0);
    comm.broadcast_bytes(0, &mut blob);
    Some(blob)
}

/// What kind of source this is and the name it gets at the destination.
fn plan_source(src: &Path) -> Result<(Kind, String), YeetError> {
    let meta = std::fs::metadata(src).map_err(io(src))?;
    let file_name = src
        .file_name()
        .and_then(|n| n.to_str())
        .ok_or_else(|| YeetError::Source(format!("{}: needs a UTF-8 file name", src.display())))?
        .to_string();
    if meta.is_dir() {
        return Ok((Kind::Tar, file_name));
    }
    if !meta.is_file() {
        return Err(YeetError::Source(format!(
            "{}: not a regular file or directory",
            src.display()
        )));
    }
    for (suffix, kind) in [
        (".tar.gz", Kind::TarGz),
        (".tgz", Kind::TarGz),
        (".tar", Kind::Tar),
    ] {
        if let Some(stem) = file_name.strip_suffix(suffix)
            && !stem.is_empty()
        {
            return Ok((kind, stem.to_string()));
        }
    }
    Ok((Kind::File, file_name))
}

/// Rank 0's reader: the file's bytes, or a tar stream of a directory built by a thread as
/// the chunks are taken.
struct SourceReader {
    inner: Box<dyn Read + Send>,
    /// The tar thread's failure, if it had one (checked at the end of the stream: a tar
    /// cut short must not be sent as if whole).
    failed: std::sync::Arc<std::sync::Mutex<Option<String>>>,
}

impl SourceReader {
    fn open(src: &Path, kind: Kind) -> Result<Self, YeetError> {
        let failed = std::sync::Arc::new(std::sync::Mutex::new(None));
        if kind != Kind::Tar || !std::fs::metadata(src).map_err(io(src))?.is_dir() {
            // A FIFO or device would block or never end: only regular files are sent.
            let f = kiln_run::files::open_regular(src).map_err(io(src))?;
            return Ok(Self {
                inner: Box::new(BufReader::with_capacity(CHUNK, f)),
                failed,
            });
        }
        let (pipe_r, pipe_w) = std::io::pipe().map_err(io(src))?;
        let root = src.to_path_buf();
        let slot = std::sync::Arc::clone(&failed);
        std::thread::spawn(move || {
            let mut b = tar::Builder::new(pipe_w);
            b.follow_symlinks(false);
            if let Err(e) = b.append_dir_all(".", &root).and_then(|()| b.finish())
                && let Ok(mut s) = slot.lock()
            {
                *s = Some(format!("{}: {e}", root.display()));
            }
        });
        Ok(Self {
            inner: Box::new(pipe_r),
            failed,
        })
    }

    fn next_chunk(&mut self) -> Result<Vec<u8>, YeetError> {
        let mut buf = vec![0u8; CHUNK];
        let mut filled = 0;
        while filled < CHUNK {
            let n = self
                .inner
                .read(&mut buf[filled..])
                .map_err(io(Path::new("<source>")))?;
            if n == 0 {
                break;
            }
            filled += n;
        }
        buf.truncate(filled);
        if filled == 0
            && let Some(e) = self.failed.lock().ok().and_then(|s| s.clone())
        {
            return Err(YeetError::Source(format!("reading the source failed: {e}")));
        }
        Ok(buf)
    }
}

/// A writer's copy of the stream as it arrives, beside the destination: a temporary file,
/// or a temporary directory that a thread unpacks the archive into.
struct Sink {
    /// Where the result is staged (a file or a directory), renamed to `target` on publish.
    staged: PathBuf,
    target: PathBuf,
    force: bool,
    /// Taken by `finish`.
    into: Option<Into>,
}

enum Into {
    File(File),
    /// The unpacking thread and the channel that feeds it (`None` once it has stopped,
    /// early on an error or at the end of the archive; its result says which).
    Unpack {
        chunks: Option<SyncSender<Vec<u8>>>,
        thread: JoinHandle<Result<(), YeetError>>,
    },
}

impl Sink {
    fn create(dest: &Path, target: &Path, kind: Kind, force: bool) -> Result<Self, YeetError> {
        std::fs::create_dir_all(dest).map_err(io(dest))?;
        if std::fs::symlink_metadata(target).is_ok() && !force {
            return Err(YeetError::Source(format!(
                "{} exists; pass --force to replace it",
                target.display()
            )));
        }
        let pid = std::process::id();
        let into_file = |staged: &Path| File::create(staged).map(Into::File);
        let (staged, into) = match kind {
            Kind::File => {
                let staged = dest.join(format!(".yeet-{pid}.part"));
                let f = into_file(&staged).map_err(io(&staged))?;
                (staged, f)
            }
            Kind::Tar | Kind::TarGz => {
                let staged = dest.join(format!(".yeet-{pid}.dir"));
                // A few chunks in flight: the broadcast goes on while the disk catches up.
                let (tx, rx) = sync_channel::<Vec<u8>>(4);
                let dir = staged.clone();
                let thread = std::thread::spawn(move || {
                    let chunks = ChunkReader {
                        rx,
                        chunk: Vec::new(),
                        at: 0,
                    };
                    if kind == Kind::TarGz {
                        unpack_safely(flate2::read::GzDecoder::new(chunks), &dir)
                    } else {
                        unpack_safely(chunks, &dir)
                    }
                });
                let into = Into::Unpack {
                    chunks: Some(tx),
                    thread,
                };
                (staged, into)
            }
        };
        Ok(Self {
            staged,
            target: target.to_path_buf(),
            force,
            into: Some(into),
        })
    }

    fn write(&mut self, chunk: Vec<u8>) -> Result<(), YeetError> {
        match &mut self.into {
            None => Ok(()),
            Some(Into::File(f)) => f.write_all(&chunk).map_err(io(&self.staged)),
            Some(Into::Unpack { chunks, .. }) => {
                // A send fails once the thread has stopped reading: at the end of the
                // archive (the zero padding after it needs no reader) or on an error,
                // which `finish` reports.
                if let Some(tx) = chunks
                    && tx.send(chunk).is_err()
                {
                    *chunks = None;
                }
                Ok(())
            }
        }
    }

    /// Waits for the unpacking thread (if any): its result.
    fn finish(&mut self) -> Result<(), YeetError> {
        match self.into.take() {
            None => Ok(()),
            Some(Into::File(f)) => f.sync_all().map_err(io(&self.staged)),
            Some(Into::Unpack { chunks, thread }) => {
                drop(chunks);
                thread.join().unwrap_or_else(|_| {
                    Err(YeetError::Source("the unpacking thread panicked".into()))
                })
            }
        }
    }

    fn discard(mut self) {
        let _ = self.finish();
        let _ = std::fs::remove_file(&self.staged);
        let _ = std::fs::remove_dir_all(&self.staged);
    }

    /// Moves the verified copy into place atomically.
    fn publish(mut self) -> Result<(), YeetError> {
        if let Err(e) = self.finish() {
            self.discard();
            return Err(e);
        }
        let parent = self.target.parent().unwrap_or(Path::new("."));
        if std::fs::symlink_metadata(&self.target).is_ok() && self.force {
            let old = parent.join(format!(".yeet-{}.old", std::process::id()));
            std::fs::rename(&self.target, &old).map_err(io(&self.target))?;
            let removed = if old.is_dir() {
                std::fs::remove_dir_all(&old)
            } else {
                std::fs::remove_file(&old)
            };
            removed.map_err(io(&old))?;
        }
        std::fs::rename(&self.staged, &self.target).map_err(io(&self.target))
    }
}

/// The chunks a writer receives, as a `Read` for the tar reader.
struct ChunkReader {
    rx: Receiver<Vec<u8>>,
    chunk: Vec<u8>,
    at: usize,
}

impl Read for ChunkReader {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        while self.at == self.chunk.len() {
            match self.rx.recv() {
                Ok(next) => {
                    self.chunk = next;
                    self.at = 0;
                }
                // The sender is gone: the stream has ended.
                Err(_) => return Ok(0),
            }
        }
        let n = buf.len().min(self.chunk.len() - self.at);
        buf[..n].copy_from_slice(&self.chunk[self.at..self.at + n]);
        self.at += n;
        Ok(n)
    }
}

/// Unpacks a tar stream into `dir` (created), refusing members that would land outside it.
fn unpack_safely(reader: impl Read, dir: &Path) -> Result<(), YeetError> {
    std::fs::create_dir_all(dir).map_err(io(dir))?;
    let mut archive = tar::Archive::new(reader);
    archive.set_preserve_permissions(true);
    archive.set_overwrite(true);
    for entry in archive.entries().map_err(io(dir))? {
        let mut entry = entry.map_err(io(dir))?;
        let path = entry.path().map_err(io(dir))?.into_owned();
        let member = path.display().to_string();
        let refuse = |reason: &str| YeetError::Unsafe {
            member: member.clone(),
            reason: reason.to_string(),
        };
        let rel = inside(Path::new(""), &path).ok_or_else(|| {
            refuse("an absolute path or one with `..` would land outside the destination")
        })?;
        let kind = entry.header().entry_type();
        if kind.is_symlink() || kind.is_hard_link() {
            let link = entry
                .link_name()
                .map_err(io(dir))?
                .ok_or_else(|| refuse("a link without a target"))?
                .into_owned();
            // Symlink targets are relative to the link's directory; hard links to the root.
            let base = if kind.is_symlink() {
                rel.parent().unwrap_or(Path::new("")).to_path_buf()
            } else {
                PathBuf::new()
            };
            if link.is_absolute() || inside(&base, &link).is_none() {
                return Err(refuse(&format!(
                    "a link to {} points outside the destination",
                    link.display()
                )));
            }
        } else if !(kind.is_file()
            || kind.is_dir()
            || kind.is_pax_global_extensions()
            || kind.is_pax_local_extensions()
            || kind.is_gnu_longname()
            || kind.is_gnu_longlink())
        {
            return Err(refuse("a device, FIFO or other special file"));
        }
        if !entry.unpack_in(dir).map_err(io(dir))? {
            return Err(refuse("the tar library refused to unpack it"));
        }
    }
    Ok(())
}

/// `base/rel` normalised lexically, if it stays inside the root (no leading `..`, no root).
fn inside(base: &Path, rel: &Path) -> Option<PathBuf> {
    let mut out: Vec<&std::ffi::OsStr> = base
        .components()
        .filter_map(|c| match c {
            Component::Normal(n) => Some(n),
            _ => None,
        })
        .collect();
    for c in rel.components() {
        match c {
            Component::Normal(n) => out.push(n),
            Component::CurDir => {}
            Component::ParentDir => {
                out.pop()?;
            }
            Component::RootDir | Component::Prefix(_) => return None,
        }
    }
    Some(out.iter().collect())
}

#[cfg(test)]
mod tests {
    use super::*;
    use kiln_dist::Solo;

    fn tree(root: &Path) {
        std::fs::create_dir_all(root.join("sub/deeper")).unwrap();
        std::fs::write(root.join("a.txt"), "alpha").unwrap();
        std::fs::write(root.join("sub/deeper/b.bin"), vec![7u8; 10_000_000]).unwrap();
        std::os::unix::fs::symlink("../a.txt", root.join("sub/link")).unwrap();
    }

    #[test]
    fn a_directory_arrives_whole_and_verified() {
        let tmp = tempfile::tempdir().unwrap();
        tree(&tmp.path().join("env"));
        let opts = YeetOptions {
            source: tmp.path().join("env"),
            dest: tmp.path().join("local").display().to_string(),
            force: false,
        };
        let r = yeet(&Solo, &opts, |_| {}).unwrap();
        assert_eq!(r.path, tmp.path().join("local/env"));
        assert_eq!(std::fs::read(r.path.join("a.txt")).unwrap(), b"alpha");
        assert_eq!(
            std::fs::read(r.path.join("sub/deeper/b.bin"))
                .unwrap()
                .len(),
            10_000_000
        );
        assert_eq!(std::fs::read(r.path.join("sub/link")).unwrap(), b"alpha");
        // No temporary files are left, and a second yeet refuses to overwrite.
        let names: Vec<_> = std::fs::read_dir(tmp.path().join("local"))
            .unwrap()
            .collect();
        assert_eq!(names.len(), 1);
        assert!(yeet(&Solo, &opts, |_| {}).is_err());
        let forced = YeetOptions {
            force: true,
            ..opts
        };
        yeet(&Solo, &forced, |_| {}).unwrap();
    }

    #[test]
    fn traversal_members_are_refused_and_nothing_is_published() {
        let tmp = tempfile::tempdir().unwrap();
        for (name, evil) in [
            ("dotdot", "../escape.txt"),
            ("abs", "/tmp/kiln-yeet-abs.txt"),
        ] {
            let archive = tmp.path().join(format!("{name}.tar"));
            let mut b = tar::Builder::new(File::create(&archive).unwrap());
            let mut h = tar::Header::new_gnu();
            h.set_size(3);
            h.set_mode(0o644);
            h.set_entry_type(tar::EntryType::Regular);
            // Header::set_path refuses `..`; write the raw name as a hostile archive would.
            let raw = &mut h.as_old_mut().name;
            raw[..evil.len()].copy_from_slice(evil.as_bytes());
            h.set_cksum();
            b.append(&h, &b"bad"[..]).unwrap();
            b.finish().unwrap();
            drop(b);
            let opts = YeetOptions {
                source: archive,
                dest: tmp.path().join("dest").display().to_string(),
                force: false,
            };
            let err = yeet(&Solo, &opts, |_| {}).unwrap_err().to_string();
            assert!(err.contains("outside the destination"), "{name}: {err}");
            assert!(!tmp.path().join("dest").join(name).exists());
        }
        assert!(!tmp.path().join("escape.txt").exists());
        // A symlink pointing out of the tree.
        let archive = tmp.path().join("link.tar");
        let mut b = tar::Builder::new(File::create(&archive).unwrap());
        let mut h = tar::Header::new_gnu();
        h.set_entry_type(tar::EntryType::Symlink);
        h.set_size(0);
        b.append_link(&mut h, "evil", "../../etc").unwrap();
        b.finish().unwrap();
        drop(b);
        let opts = YeetOptions {
            source: archive,
            dest: tmp.path().join("dest").display().to_string(),
            force: false,
        };
        let err = yeet(&Solo, &opts, |_| {}).unwrap_err().to_string();
        assert!(err.contains("points outside"), "{err}");
        assert!(!tmp.path().join("dest/link").exists());
    }

    #[test]
    fn lexical_containment() {
        assert_eq!(
            inside(Path::new(""), Path::new("a/./b")),
            Some("a/b".into())
        );
        assert_eq!(inside(Path::new("a"), Path::new("../b")), Some("b".into()));
        assert_eq!(inside(Path::new("a"), Path::new("../../b")), None);
        assert_eq!(inside(Path::new(""), Path::new("/etc")), None);
    }
}

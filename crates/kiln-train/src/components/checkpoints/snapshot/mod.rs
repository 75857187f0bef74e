//! [`Snapshotter`]: the memory tier of checkpoints. Every rank snapshots its state every
//! `checkpoint.snapshot_interval` steps into node-local memory
//! (`<snapshot_dir>/kiln-<hash of the run directory>/rank-<R>/step-<N>`, `/dev/shm` by
//! default), in the checkpoint format: written by [`checkpoint::save_with`] (temporary
//! directory, manifest of XXH3-128 sums (`checkpoint/checksum.rs` says why not SHA-256),
//! atomic rename) on a writer thread of its own ([`Saver`]), and read back by
//! [`checkpoint::load`], which verifies every file. Staging costs no copy (see
//! [`crate::components::checkpoints::saver`]); a snapshot due while the previous one is still being written is
//! skipped rather than waited for: this tier must never stall the step. Retention keeps the
//! newest `checkpoint.snapshot_keep`; a successful run deletes its folder, and under
//! `kiln launch` each rank records the folder in `$KILN_PROGRESS_DIR` so that the launch
//! removes it on every node when the job ends there for good (under a scheduler: a failure
//! after the last retry, a walltime stop; see `kiln launch --memory-tier-at-end`). A resume that finds this
//! lineage's snapshots older than the persistent checkpoint it resumes from deletes them
//! ([`SnapshotStore::remove_stale`]), but for the guards' rollback point. Every start also
//! reclaims other runs' tiers on its node that no resume can use ([`tiers`]: each folder
//! holds an owner record for that).
//!
//! Recovery ([`Snapshotter::recover`]): every rank finds the newest snapshot of the run's
//! lineage that verifies (a corrupt or foreign one is deleted and reported, never used), the
//! ranks agree on the newest step any of them holds (an all-reduce max), and a rank without
//! it (its node was replaced) receives that snapshot's files from the lowest rank that has
//! it over the collective, writes them into its own store and verifies them like any
//! snapshot. In data parallelism every replica holds the same state, so any holder's copy
//! is every rank's. If a received copy does not verify, or the persistent checkpoint is
//! newer, every rank falls back to the persistent tier.

use crate::cadence::Every;
use crate::checkpoint::{
    self, Checkpoint, CheckpointError, ChecksumKind, Contents, FILES, MANIFEST_FILE, SaveReport,
    create_shared_dir_all, io_err, remove_tree,
};
use crate::components::checkpoints::saver::{Saved, Saver, Staged, Store};
use crate::components::journal::{Journal, path_text};
use crate::config::{CheckpointConfig, ConfigError, OutOfDomain};
use crate::error::TrainError;
use kiln_dist::Collective;
use kiln_run::{event, layout};
use serde_json::json;
use sha2::{Digest, Sha256};
use std::path::{Path, PathBuf};
use std::time::Instant;

pub mod tiers;

/// How a rank reads a persistent checkpoint (all of it, or in a sharded run its own pieces).
pub type Read<'a> = &'a dyn Fn(&Path) -> Result<Checkpoint, CheckpointError>;

/// One rank's memory snapshots: `step-<N>` directories in the checkpoint format.
#[derive(Debug, Clone)]
pub struct SnapshotStore {
    root: PathBuf,
    keep: usize,
    /// The guards' rollback interval: the newest snapshot at a multiple of it is kept too.
    anchor: Every,
    /// The owner record each save makes sure the run's folder (`root`'s parent) holds.
    owner: Option<tiers::Owner>,
}

/// The files of a snapshot, in the order they are sent to a peer.
const SENT: [&str; 4] = [MANIFEST_FILE, FILES[0], FILES[1], FILES[2]];

impl SnapshotStore {
    /// The store in `root`, keeping the newest `keep` snapshots and the newest at a
    /// multiple of `anchor` (0: none).
    pub fn new(root: PathBuf, keep: usize, anchor: u64) -> Self {
        Self {
            root,
            keep: keep.max(1),
            anchor: Every(anchor),
            owner: None,
        }
    }

    /// The same store, whose saves make sure the run's folder holds `owner`'s record.
    pub fn owned_by(self, owner: tiers::Owner) -> Self {
        Self {
            owner: Some(owner),
            ..self
        }
    }

    /// Its directory.
    pub fn root(&self) -> &Path {
        &self.root
    }

    /// The newest snapshot of lineage `run_id` that verifies. Every snapshot tried before
    /// it (corrupt, torn, or of another lineage) is deleted and passed to `on_reject`.
    pub fn newest(
        &self,
        run_id: &str,
        mut on_reject: impl FnMut(&Path, &str),
    ) -> Option<(PathBuf, Checkpoint)> {
        self.remove_leftovers();
        checkpoint::list_steps(&self.root)
            .into_iter()
            .find_map(|step| self.verified(run_id, step, &mut on_reject))
    }

    /// The snapshot of `step` of lineage `run_id`, verified; one that is not is deleted and
    /// passed to `on_reject`.
    fn verified(
        &self,
        run_id: &str,
        step: u64,
        mut on_reject: impl FnMut(&Path, &str),
    ) -> Option<(PathBuf, Checkpoint)> {
        let dir = self.root.join(checkpoint::dir_name(step));
        if !dir.is_dir() {
            return None;
        }
        let why = match checkpoint::load(&dir) {
            Ok(c) if checkpoint::lineage_of(&c.state) == Some(run_id) => return Some((dir, c)),
            Ok(c) => format!(
                "belongs to another run (run_id {:?}; this run is {run_id:?})",
                checkpoint::lineage_of(&c.state)
            ),
            Err(e) => e.to_string(),
        };
        let _ = remove_tree(&dir);
        on_reject(&dir, &why);
        None
    }

    /// Deletes the temporary directories of writes a killed process left (only this rank
    /// writes here).
    fn remove_leftovers(&self) {
        let Ok(entries) = std::fs::read_dir(&self.root) else {
            return;
        };
        for e in entries.filter_map(Result::ok) {
            if e.file_name().to_string_lossy().starts_with(".tmp-") {
                let _ = remove_tree(&e.path());
            }
        }
    }

    /// Deletes this store's snapshots of lineage `run_id` older than `floor` (the newest
    /// persistent checkpoint's step): no resume can use them any more. The newest one at a
    /// multiple of the guards' rollback interval at or before `floor` stays: a run resumed
    /// there restores its rollback point from it. Returns the directories deleted.
    pub fn remove_stale(&self, run_id: &str, floor: u64) -> Vec<PathBuf> {
        let steps = checkpoint::list_steps(&self.root);
        let anchor = steps
            .iter()
            .copied()
            .find(|&s| s <= floor && self.anchor.due(s));
        let mut removed = Vec::new();
        for s in steps
            .into_iter()
            .filter(|&s| s < floor && Some(s) != anchor)
        {
            let dir = self.root.join(checkpoint::dir_name(s));
            let ours = checkpoint::load_state(&dir)
                .is_ok_and(|state| checkpoint::lineage_of(&state) == Some(run_id));
            if ours && remove_tree(&dir).is_ok() {
                removed.push(dir);
            }
        }
        removed
    }

    /// Deletes every snapshot of this store.
    pub fn clear(&self) -> Result<(), CheckpointError> {
        remove_tree(&self.root)
    }

    /// The files of the snapshot in `dir`, framed for a peer: for each of [`SENT`], its
    /// length (u64, little-endian) and its bytes.
    fn frame(dir: &Path) -> Result<Vec<u8>, CheckpointError> {
        let mut out = Vec::new();
        for name in SENT {
            let path = dir.join(name);
            let bytes = std::fs::read(&path).map_err(io_err(&path))?;
            out.extend_from_slice(&(bytes.len() as u64).to_le_bytes());
            out.extend_from_slice(&bytes);
        }
        Ok(out)
    }

    /// Publishes the framed snapshot of `step` a peer sent (temporary directory, rename)
    /// and loads it back verified: a copy that does not match its manifest is deleted.
    fn adopt(&self, step: u64, framed: &[u8]) -> Result<(PathBuf, Checkpoint), CheckpointError> {
        let name = checkpoint::dir_name(step);
        let tmp = self
            .root
            .join(format!(".tmp-peer-{name}-{}", std::process::id()));
        let dir = self.root.join(&name);
        remove_tree(&tmp)?;
        create_shared_dir_all(&tmp).map_err(io_err(&tmp))?;
        let mut rest = framed;
        for file in SENT {
            let bytes = take_frame(&mut rest).ok_or_else(|| CheckpointError::Invalid {
                path: tmp.join(file),
                reason: "the peer's snapshot is truncated".into(),
            })?;
            let path = tmp.join(file);
            std::fs::write(&path, bytes).map_err(io_err(&path))?;
        }
        remove_tree(&dir)?;
        std::fs::rename(&tmp, &dir).map_err(io_err(&dir))?;
        match checkpoint::load(&dir) {
            Ok(c) if c.step == step => Ok((dir, c)),
            Ok(c) => Err(CheckpointError::Invalid {
                path: dir.clone(),
                reason: format!("the peer sent step {} for step {step}", c.step),
            }),
            Err(e) => {
                let _ = remove_tree(&dir);
                Err(e)
            }
        }
    }
}

/// The next length-prefixed frame of `rest`.
fn take_frame<'b>(rest: &mut &'b [u8]) -> Option<&'b [u8]> {
    let (len, tail) = rest.split_first_chunk::<8>()?;
    let len = usize::try_from(u64::from_le_bytes(*len)).ok()?;
    if tail.len() < len {
        return None;
    }
    let (frame, tail) = tail.split_at(len);
    *rest = tail;
    Some(frame)
}

impl Store for SnapshotStore {
    /// Publishes `ckpt`, then deletes every other snapshot but the newest `keep - 1` older
    /// ones and the newest at the anchor interval (the guards' rollback point; newer ones
    /// are left by a rollback: stale) and this process's leftovers.
    fn save(&mut self, ckpt: &Contents) -> Result<SaveReport, CheckpointError> {
        let path = checkpoint::save_with(&self.root, ckpt, ChecksumKind::Xxh3_128)?;
        if let (Some(owner), Some(folder)) = (&self.owner, self.root.parent()) {
            // Without it a later start on this node could not tell when to reclaim the tier.
            if let Err(e) = owner.ensure_in(folder) {
                tracing::warn!("cannot write the memory tier's owner record: {e}");
            }
        }
        let mut pruned = Vec::new();
        let steps = checkpoint::list_steps(&self.root);
        let anchor = steps
            .iter()
            .copied()
            .find(|&s| s <= ckpt.step && self.anchor.due(s));
        let older = steps.iter().copied().filter(|&s| s < ckpt.step);
        let newer = steps.iter().copied().filter(|&s| s > ckpt.step);
        let stale = older.skip(self.keep - 1).filter(|&s| Some(s) != anchor);
        for s in stale.chain(newer) {
            let dir = self.root.join(checkpoint::dir_name(s));
            remove_tree(&dir)?;
            pruned.push(dir);
        }
        Ok(SaveReport {
            path,
            pruned,
            superseded: Vec::new(),
        })
    }
}

/// Checks, before training starts, that `store` (this rank's [`rank_dir`]) can hold
/// memory snapshots: a `checkpoint.snapshot_dir` that is a regular file, or a directory
/// this process cannot write (read-only, no permission, a full file system), is refused
/// with the key named (exit 78), instead of a warning at every snapshot of a run that then
/// has no memory tier. Nothing to check when the tier is off (`snapshot_interval = 0`).
pub fn check_store(cfg: &CheckpointConfig, store: &Path) -> Result<(), ConfigError> {
    if cfg.snapshot_interval == 0 {
        return Ok(());
    }
    let probe = store.join(format!(".tmp-probe-{}", std::process::id()));
    let written = create_shared_dir_all(store)
        .and_then(|()| std::fs::write(&probe, b"kiln"))
        .and_then(|()| std::fs::remove_file(&probe));
    let Err(e) = written else {
        // The first snapshot creates the folders again: a run that ends before it leaves none.
        remove_if_empty(store);
        return Ok(());
    };
    let _ = std::fs::remove_file(&probe);
    let base = store
        .ancestors()
        .nth(2)
        .map_or_else(|| store.to_path_buf(), Path::to_path_buf);
    let what = match std::fs::metadata(&base) {
        Ok(m) if !m.is_dir() => format!("{} is not a directory", base.display()),
        _ => format!("cannot write {}: {e}", store.display()),
    };
    let value = if cfg.snapshot_dir.is_empty() {
        format!("\"\" (the default: {})", base.display())
    } else {
        format!("{:?}", cfg.snapshot_dir)
    };
    Err(ConfigError::OutOfDomain(vec![OutOfDomain {
        key: "checkpoint.snapshot_dir".into(),
        value,
        allowed: format!(
            "a directory this process can write ({what}); point it at a writable node-local \
             directory, or set checkpoint.snapshot_interval = 0 to turn the memory tier off"
        ),
    }]))
}

/// Where the memory snapshots of the run in `run_dir` live on this node, for `rank`.
pub fn rank_dir(cfg: &CheckpointConfig, run_dir: &Path, rank: usize) -> PathBuf {
    run_folder(&cfg.snapshot_dir, run_dir).join(layout::snapshot_rank(rank))
}

/// The memory-tier folder of the run in `run_dir` on this node, in `snapshot_dir`
/// (`checkpoint.snapshot_dir`; every rank's [`rank_dir`] is in it).
pub fn run_folder(snapshot_dir: &str, run_dir: &Path) -> PathBuf {
    let abs = std::path::absolute(run_dir).unwrap_or_else(|_| run_dir.to_path_buf());
    let key = hex::encode(&Sha256::digest(abs.as_os_str().as_encoded_bytes())[..8]);
    tiers::base_dir(snapshot_dir).join(layout::snapshot_root(&key))
}

/// Records, for `kiln launch`, that this rank keeps the run's memory-tier folder (the
/// parent of its store `root`) on this node, so that the launch removes it there when the
/// job ends for good (see [`kiln_run::node_state`]); nothing outside `kiln launch` (no
/// [`kiln_run::node_state::records_dir`]).
fn register_on_node(root: &Path, rank: usize) {
    let Some(dir) = kiln_run::node_state::records_dir() else {
        return;
    };
    let Some(folder) = root.parent() else {
        return;
    };
    let folder = std::path::absolute(folder).unwrap_or_else(|_| folder.to_path_buf());
    if let Err(e) = kiln_run::node_state::write_node_record(&dir, rank, &[folder]) {
        tracing::warn!(
            "cannot record the memory snapshots' folder for kiln launch in {}: {e}; they stay on this node when the job ends",
            dir.display()
        );
    }
}

/// A resume point the ranks agreed on in the memory tier.
pub struct Recovered {
    /// The snapshot directory this rank loaded.
    pub dir: PathBuf,
    /// Its contents, verified.
    pub ck: Checkpoint,
    /// [`event::tier::MEMORY`], or [`event::tier::PEER`] when some rank received it.
    pub tier: &'static str,
    /// The rank whose copy was sent, when one was.
    pub source_rank: Option<usize>,
    /// The ranks that received it.
    pub peer_ranks: Vec<usize>,
}

/// Removes the rank folder `store` and the run's folder above it where they hold nothing
/// (`remove_dir` refuses a folder that is not empty: snapshots, or another rank's folder that
/// its own rank removes).
fn remove_if_empty(store: &Path) {
    let _ = std::fs::remove_dir(store);
    let Some(parent) = store.parent() else {
        return;
    };
    let others = std::fs::read_dir(parent).map(|entries| {
        let names = entries.filter_map(Result::ok).map(|e| e.file_name());
        names.filter(|n| n != layout::SNAPSHOT_OWNER).count()
    });
    // Only its owner record left: a rank saving later writes it again with its snapshot.
    if others.is_ok_and(|n| n == 0) {
        let _ = std::fs::remove_file(parent.join(layout::SNAPSHOT_OWNER));
        let _ = std::fs::remove_dir(parent);
    }
}

/// The memory-tier component (see the module documentation).
pub struct Snapshotter {
    every: Every,
    /// The guards' rollback interval: a snapshot is also due there, never skipped.
    anchor: Every,
    store: SnapshotStore,
    saver: Option<Saver>,
    /// Snapshots skipped because the previous one was still being written.
    skipped: u64,
    /// Other runs' tiers on this node reclaimed at the start, not yet reported.
    reclaimed: Vec<(tiers::Held, u64)>,
}

/// A run that ends, however, leaves no empty folder of its tier on the node (its snapshots
/// stay for a resume; see [`Snapshotter::clear`] and the launcher's cleanup).
impl Drop for Snapshotter {
    fn drop(&mut self) {
        remove_if_empty(self.store.root());
    }
}

impl Snapshotter {
    /// The memory tier of `cfg` for `rank` of the run in `run_dir` (off when
    /// `snapshot_interval` is 0). `anchor` is the guards' rollback interval
    /// (`guards.snapshot_interval`): the snapshot at its newest multiple is always taken and
    /// kept, so that a resumed run can roll back where an uninterrupted one would.
    /// Other runs' tiers in the same snapshot directory that no resume can use are reclaimed
    /// here ([`tiers::reclaim`]), and reported by [`Snapshotter::report_reclaimed`].
    pub fn new(cfg: &CheckpointConfig, run_dir: &Path, rank: usize, anchor: u64) -> Self {
        let folder = run_folder(&cfg.snapshot_dir, run_dir);
        let owner = tiers::Owner {
            run_dir: std::path::absolute(run_dir).unwrap_or_else(|_| run_dir.to_path_buf()),
            anchor,
        };
        let store = SnapshotStore::new(rank_dir(cfg, run_dir, rank), cfg.snapshot_keep, anchor)
            .owned_by(owner);
        let reclaimed = tiers::reclaim(&tiers::base_dir(&cfg.snapshot_dir), &folder);
        let saver = (cfg.snapshot_interval > 0)
            .then(|| Saver::with_priority(store.clone(), cfg.asynchronous, false));
        if saver.is_some() {
            register_on_node(store.root(), rank);
        }
        Self {
            every: Every(cfg.snapshot_interval),
            anchor: Every(anchor),
            store,
            saver,
            skipped: 0,
            reclaimed,
        }
    }

    /// Reports the tiers reclaimed at the start ([`tiers::report`]).
    pub fn report_reclaimed(&mut self, journal: &mut Journal) -> Result<(), TrainError> {
        tiers::report(std::mem::take(&mut self.reclaimed), journal)
    }

    /// Whether a snapshot is due after `step` (an applied step at the interval or at the
    /// guards' rollback interval).
    pub fn due(&self, step: u64) -> bool {
        self.saver.is_some() && (self.every.due(step) || self.anchor.due(step))
    }

    /// Hands the snapshot of `step`, `staged()`, to the writer, unless the previous snapshot
    /// is still in flight: then this one is skipped (the tier never stalls the step), except
    /// at the guards' rollback interval, where it waits for the writer.
    pub fn take(
        &mut self,
        step: u64,
        staged: impl FnOnce() -> Staged,
        journal: &mut Journal,
    ) -> Result<(), TrainError> {
        self.poll(journal)?;
        if self.anchor.due(step) {
            self.wait(journal)?;
        }
        let Some(saver) = &mut self.saver else {
            return Ok(());
        };
        if saver.in_flight() {
            self.skipped += 1;
            return Ok(());
        }
        let t0 = Instant::now();
        let staged = staged();
        for outcome in saver.submit(staged, t0.elapsed().as_secs_f64()) {
            report(outcome, journal)?;
        }
        Ok(())
    }

    /// Reports the snapshot in flight if it has finished (never waits).
    pub fn poll(&mut self, journal: &mut Journal) -> Result<(), TrainError> {
        match self.saver.as_mut().and_then(Saver::poll) {
            Some(outcome) => report(outcome, journal),
            None => Ok(()),
        }
    }

    /// Waits for the snapshot in flight, if any, and reports it.
    pub fn wait(&mut self, journal: &mut Journal) -> Result<(), TrainError> {
        match self.saver.as_mut().and_then(Saver::wait) {
            Some(outcome) => report(outcome, journal),
            None => Ok(()),
        }
    }

    /// Snapshots skipped so far because the writer was busy.
    pub fn skipped(&self) -> u64 {
        self.skipped
    }

    /// Deletes this rank's snapshots (a successful end, or a run that starts afresh). The
    /// run's folder goes too once no rank's is left in it.
    pub fn clear(&mut self, journal: &mut Journal) {
        let _ = self.wait(journal);
        if let Err(e) = self.store.clear() {
            tracing::warn!("cannot delete the memory snapshots: {e}");
        }
        remove_if_empty(self.store.root());
    }

    /// The newest snapshot of lineage `run_id` any rank holds, on every rank, or `None` when
    /// there is none at or after `floor` (the persistent checkpoint's step) or a copy sent
    /// to a peer did not verify. A collective: every rank calls it.
    pub fn recover(
        &mut self,
        comm: &dyn Collective,
        run_id: &str,
        floor: Option<u64>,
        journal: &mut Journal,
    ) -> Result<Option<Recovered>, TrainError> {
        let local = reporting(comm.rank(), journal, |on| self.store.newest(run_id, on))?;
        let mine = local.as_ref().map_or(0, |(_, c)| c.step + 1);
        let mut best = [mine];
        comm.all_reduce_max_u64(&mut best);
        let Some(step) = best[0].checked_sub(1) else {
            return Ok(None);
        };
        if let Some(p) = floor.filter(|&p| step < p) {
            // Older than the persistent checkpoint: stale, and RAM the node needs back.
            let removed = self.store.remove_stale(run_id, p);
            if !removed.is_empty() {
                journal.note(&format!(
                    "deleted {} memory snapshot(s) older than the persistent checkpoint of step {p}",
                    removed.len()
                ));
            }
            return Ok(None);
        }
        let (holders, peer_ranks) = split_ranks(comm, mine == best[0]);
        let source = holders.first().copied().unwrap_or(0);
        let local = local.filter(|(_, c)| c.step == step);
        let got = if peer_ranks.is_empty() {
            local
        } else {
            self.heal(comm, step, source, &peer_ranks, local, journal)?
        };
        Ok(got.map(|(dir, ck)| Recovered {
            dir,
            ck,
            tier: if peer_ranks.is_empty() {
                event::tier::MEMORY
            } else {
                event::tier::PEER
            },
            source_rank: (!peer_ranks.is_empty()).then_some(source),
            peer_ranks,
        }))
    }

    /// The state of `step` of lineage `run_id` on every rank (the guards' rollback point):
    /// this rank's memory snapshot of it, else the persistent checkpoint `persistent` (read
    /// with `read`) when it is that step's; a rank without either receives a holder's copy.
    /// `None` on every rank when no rank holds it or a sent copy did not verify. A
    /// collective: every rank calls it.
    pub fn at_step(
        &mut self,
        comm: &dyn Collective,
        (run_id, step): (&str, u64),
        (persistent, read): (&Path, Read),
        journal: &mut Journal,
    ) -> Result<Option<(PathBuf, Checkpoint)>, TrainError> {
        let mine = reporting(comm.rank(), journal, |on| {
            self.store.verified(run_id, step, on)
        })?;
        let local = mine.or_else(|| {
            let c = read(persistent).ok()?;
            let same = c.step == step && checkpoint::lineage_of(&c.state) == Some(run_id);
            same.then(|| (persistent.to_path_buf(), c))
        });
        let (holders, receivers) = split_ranks(comm, local.is_some());
        match holders.first() {
            None => Ok(None),
            Some(_) if receivers.is_empty() => Ok(local),
            Some(&source) => self.heal(comm, step, source, &receivers, local, journal),
        }
    }

    /// Sends the snapshot of `step` from `source` to the ranks without it; `None` on every
    /// rank when a receiver's copy did not verify.
    fn heal(
        &mut self,
        comm: &dyn Collective,
        step: u64,
        source: usize,
        receivers: &[usize],
        local: Option<(PathBuf, Checkpoint)>,
        journal: &mut Journal,
    ) -> Result<Option<(PathBuf, Checkpoint)>, TrainError> {
        let t0 = Instant::now();
        let mut framed = match (&local, comm.rank() == source) {
            (Some((dir, _)), true) => SnapshotStore::frame(dir).unwrap_or_else(|e| {
                tracing::error!("cannot read the snapshot to send: {e}");
                Vec::new()
            }),
            _ => Vec::new(),
        };
        comm.broadcast_vec(source, &mut framed);
        let mut got = local;
        let mut failed = u64::from(framed.is_empty());
        if receivers.contains(&comm.rank()) && failed == 0 {
            match self.store.adopt(step, &framed) {
                Ok(c) => got = Some(c),
                Err(e) => {
                    reject(comm.rank(), self.store.root(), &e.to_string(), journal)?;
                    failed = 1;
                }
            }
        }
        let mut any = [failed];
        comm.all_reduce_max_u64(&mut any);
        if any[0] != 0 {
            return Ok(None);
        }
        journal.emit(
            event::SNAPSHOT_FROM_PEER,
            json!({"step": step, "source_rank": source, "ranks": receivers,
                   "bytes": framed.len(), "seconds": t0.elapsed().as_secs_f64()}),
        )?;
        Ok(got)
    }
}

/// What `look` found in this rank's store, after reporting every snapshot it rejected (and
/// deleted) on the way.
fn reporting<T>(
    rank: usize,
    journal: &mut Journal,
    look: impl FnOnce(&mut dyn FnMut(&Path, &str)) -> T,
) -> Result<T, TrainError> {
    let mut rejected = Vec::new();
    let found = look(&mut |p: &Path, r: &str| rejected.push((p.to_path_buf(), r.to_string())));
    for (path, reason) in rejected {
        reject(rank, &path, &reason, journal)?;
    }
    Ok(found)
}

/// The ranks for which `has` holds and those for which it does not (a collective).
fn split_ranks(comm: &dyn Collective, has: bool) -> (Vec<usize>, Vec<usize>) {
    let all = all_gather(comm, u64::from(has));
    (0..comm.size()).partition(|&r| all[r] == 1)
}

/// Every rank's `value` (one rank: just its own).
fn all_gather(comm: &dyn Collective, value: u64) -> Vec<u64> {
    if comm.size() == 1 {
        vec![value]
    } else {
        comm.all_gather_u64(value)
    }
}

/// A snapshot that was deleted unused: an event (writer rank) and a warning (any rank).
fn reject(rank: usize, path: &Path, reason: &str, journal: &mut Journal) -> Result<(), TrainError> {
    tracing::warn!(
        "rank {rank}: memory snapshot {} rejected: {reason}",
        path.display()
    );
    journal.emit(
        event::SNAPSHOT_REJECTED,
        json!({"path": path_text(path), "reason": reason, "rank": rank}),
    )?;
    journal.note(&format!(
        "rejected memory snapshot {}: {reason}",
        path.display()
    ));
    Ok(())
}

/// The `snapshot_saved` event of a finished snapshot, or `snapshot_failed`: a failed
/// snapshot does not stop training (the persistent tier still stands).
fn report(
    outcome: Result<Saved, CheckpointError>,
    journal: &mut Journal,
) -> Result<(), TrainError> {
    match outcome {
        Ok(saved) => journal.emit(
            event::SNAPSHOT_SAVED,
            json!({"step": saved.step, "path": path_text(&saved.report.path),
                   "stall_s": saved.stall_s, "write_s": saved.write_s}),
        ),
        Err(e) => {
            tracing::warn!("memory snapshot failed: {e}");
            journal.emit(event::SNAPSHOT_FAILED, json!({"error": e.to_string()}))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::checkpoint::tests::ckpt;

    #[test]
    fn retention_keeps_the_newest_and_the_guards_rollback_point() {
        let dir = tempfile::tempdir().unwrap();
        let mut store = SnapshotStore::new(dir.path().to_path_buf(), 2, 7);
        for step in (3..=24).step_by(3) {
            store.save(&ckpt(step, "a").contents()).unwrap();
        }
        // Newest two (24, 21) and the newest multiple of 7 (21 already): nothing else.
        assert_eq!(checkpoint::list_steps(dir.path()), vec![24, 21]);
        store.save(&ckpt(27, "a").contents()).unwrap();
        assert_eq!(checkpoint::list_steps(dir.path()), vec![27, 24, 21]);
        store.save(&ckpt(28, "a").contents()).unwrap();
        assert_eq!(checkpoint::list_steps(dir.path()), vec![28, 27]);
        let found = store.verified("a", 21, |_, _| {});
        assert!(found.is_none(), "pruned");
        let found = store.verified("a", 28, |_, _| {}).unwrap();
        assert_eq!(found.1.step, 28);
        let mut rejected = Vec::new();
        assert!(
            store
                .verified("b", 27, |p, _| rejected.push(p.to_path_buf()))
                .is_none()
        );
        assert_eq!(rejected.len(), 1, "another lineage's is deleted");
    }

    /// A memory tier (a snapshot every 5 steps) kept under `base`, and a run directory there.
    fn tier_in(base: &Path) -> (CheckpointConfig, PathBuf) {
        let cfg = CheckpointConfig {
            snapshot_dir: base.display().to_string(),
            snapshot_interval: 5,
            ..CheckpointConfig::default()
        };
        (cfg, base.join("run"))
    }

    /// The ranks of one node check their stores at the same time: one rank's check removes
    /// the shared run folder while it is empty, which another rank's `create_dir_all` has just
    /// made and is about to make its own folder in. Neither check may fail for that (a 3-rank
    /// start under load ended with exit 78, "cannot write").
    #[test]
    fn ranks_checking_their_stores_together_do_not_fail_each_other() {
        let base = tempfile::tempdir().unwrap();
        let (cfg, run) = tier_in(base.path());
        let checks: Vec<_> = (0..3)
            .map(|rank| {
                let (cfg, store) = (cfg.clone(), rank_dir(&cfg, &run, rank));
                std::thread::spawn(move || {
                    (0..3000)
                        .filter_map(|_| check_store(&cfg, &store).err())
                        .map(|e| e.to_string())
                        .collect::<Vec<_>>()
                })
            })
            .collect();
        for (rank, check) in checks.into_iter().enumerate() {
            let failed = check.join().unwrap();
            assert!(
                failed.is_empty(),
                "rank {rank}: {} failed, first: {}",
                failed.len(),
                failed[0]
            );
        }
    }

    /// The start-up check and a run that ends without a snapshot leave no folder on the
    /// node; one that holds snapshots keeps them (a resume needs them), and its run folder
    /// while another rank's is there.
    #[test]
    fn a_run_leaves_no_empty_folder_of_its_tier() {
        let base = tempfile::tempdir().unwrap();
        let (cfg, run) = tier_in(base.path());
        let (r0, r1) = (rank_dir(&cfg, &run, 0), rank_dir(&cfg, &run, 1));
        check_store(&cfg, &r0).unwrap();
        assert!(
            !r0.exists() && !r0.parent().unwrap().exists(),
            "left by the check"
        );
        let t0 = Snapshotter::new(&cfg, &run, 0, 0);
        std::fs::create_dir_all(&r0).unwrap(); // as a snapshot's write does
        drop(t0);
        assert!(
            !r0.parent().unwrap().exists(),
            "left by a run without snapshots"
        );
        let mut t1 = Snapshotter::new(&cfg, &run, 1, 0);
        t1.store.save(&ckpt(5, "a").contents()).unwrap();
        let t0 = Snapshotter::new(&cfg, &run, 0, 0);
        std::fs::create_dir_all(&r0).unwrap();
        drop(t0);
        drop(t1);
        assert!(!r0.exists(), "rank 0's empty folder");
        assert_eq!(
            checkpoint::list_steps(&r1),
            vec![5],
            "rank 1's snapshot is kept"
        );
    }
}

//! A run's folder of checkpoints ([`CheckpointStore`]): publishing one atomically, which to
//! resume from, moving rejected and foreign ones aside (never deleted), and retention that
//! only deletes older checkpoints of the run's own lineage.

use super::checksum::ChecksumKind;
use super::error::CheckpointError;
use super::files::{create_shared_dir_all, fsync_dir, io_err, remove_tree};
use super::manifest::{Checkpoint, Contents, lineage_of, load, load_state, write_contents};
use kiln_run::layout;
use serde::Serialize;
use std::path::{Path, PathBuf};

/// Name of a checkpoint directory.
pub fn dir_name(step: u64) -> String {
    layout::checkpoint_dir(step)
}

/// Renames the written directory `tmp` to `step`'s checkpoint directory under `root`.
pub(super) fn publish(root: &Path, tmp: &Path, step: u64) -> Result<(), CheckpointError> {
    let final_dir = root.join(dir_name(step));
    if std::fs::symlink_metadata(&final_dir).is_ok() {
        // Re-saving a step that exists (a resumed run that stops at the same step): move the
        // old one aside first, so there is never a moment without a valid step-<N>.
        let old = root.join(format!(".old-{}-{}", dir_name(step), std::process::id()));
        std::fs::rename(&final_dir, &old).map_err(io_err(&final_dir))?;
        std::fs::rename(tmp, &final_dir).map_err(io_err(&final_dir))?;
        remove_tree(&old)?;
    } else {
        std::fs::rename(tmp, &final_dir).map_err(io_err(&final_dir))?;
    }
    Ok(())
}

/// Writes `ckpt` as `root/step-<N>` atomically with SHA-256 checksums and returns its path.
pub fn save(root: &Path, ckpt: &Contents) -> Result<PathBuf, CheckpointError> {
    save_with(root, ckpt, ChecksumKind::Sha256)
}

/// [`save`] with the files' checksums of `kind`.
pub fn save_with(
    root: &Path,
    ckpt: &Contents,
    kind: ChecksumKind,
) -> Result<PathBuf, CheckpointError> {
    create_shared_dir_all(root).map_err(io_err(root))?;
    let final_dir = root.join(dir_name(ckpt.step));
    let tmp = root.join(format!(
        ".tmp-{}-{}",
        dir_name(ckpt.step),
        std::process::id()
    ));
    if std::fs::symlink_metadata(&tmp).is_ok() {
        std::fs::remove_dir_all(&tmp).map_err(io_err(&tmp))?;
    }
    std::fs::create_dir(&tmp).map_err(io_err(&tmp))?;
    let written = write_contents(&tmp, ckpt, kind)
        .and_then(|()| fsync_dir(&tmp))
        .and_then(|()| publish(root, &tmp, ckpt.step));
    if written.is_err() {
        // A failed write (a full disk, most often) must not keep what it wrote: the space
        // would be missing for the retry, which then fails at once.
        let _ = remove_tree(&tmp);
    }
    written?;
    fsync_dir(root)?;
    if !ckpt.shards.is_empty() {
        remove_tree(&root.join(layout::checkpoint_shard_staging(ckpt.step)))?;
    }
    Ok(final_dir)
}

/// Steps of the `step-<N>` directories under `root`, newest first.
pub fn list_steps(root: &Path) -> Vec<u64> {
    let Ok(entries) = std::fs::read_dir(root) else {
        return Vec::new();
    };
    let mut steps: Vec<u64> = entries
        .filter_map(Result::ok)
        .filter_map(|e| layout::parse_checkpoint_dir(e.file_name().to_str()?))
        .collect();
    steps.sort_unstable_by(|a, b| b.cmp(a));
    steps
}

/// The newest checkpoint under `root` that verifies. Each rejected one is passed to
/// `on_reject` (path and reason) before the next older one is tried. Read-only: for tools
/// that inspect a run (eval, export); a training run uses [`CheckpointStore`].
pub fn load_latest_valid(
    root: &Path,
    mut on_reject: impl FnMut(&Path, &str),
) -> Option<(PathBuf, Checkpoint)> {
    for step in list_steps(root) {
        let dir = root.join(dir_name(step));
        match load(&dir) {
            Ok(c) => return Some((dir, c)),
            Err(e) => on_reject(&dir, &e.to_string()),
        }
    }
    None
}

/// A checkpoint moved to `checkpoints/rejected/`.
#[derive(Debug, Clone, Serialize)]
pub struct Rejection {
    /// Where it was.
    pub path: PathBuf,
    /// Why it was rejected.
    pub reason: String,
    /// Where it is now.
    pub moved_to: PathBuf,
}

/// What a save did.
#[derive(Debug, Clone, Serialize)]
pub struct SaveReport {
    /// The published checkpoint.
    pub path: PathBuf,
    /// Older checkpoints of this lineage deleted by retention.
    pub pruned: Vec<PathBuf>,
    /// Newer checkpoints of this lineage that a rollback made obsolete, moved aside.
    pub superseded: Vec<Rejection>,
}

/// The checkpoints of one training run: resume choice, move-aside of bad or foreign ones,
/// saving and retention.
///
/// Retention rule: after saving step S, only checkpoints of this run's lineage (its
/// `run_id`) older than S are candidates for deletion, and the newest `keep - 1` of them
/// stay. Nothing of another lineage, nothing corrupt and nothing newer than S is ever
/// deleted: those are moved to `checkpoints/rejected/` with a note saying why.
#[derive(Debug)]
pub struct CheckpointStore {
    root: PathBuf,
    keep: usize,
    run_id: String,
    /// Steps known to be this lineage's (found at open or saved since).
    ours: Vec<u64>,
}

/// The result of [`CheckpointStore::open`].
pub struct Opened {
    /// The manager, with the lineage of the resumed checkpoint (or a new one).
    pub manager: CheckpointStore,
    /// The checkpoint to resume from, when resuming and one verified.
    pub resume: Option<(PathBuf, Checkpoint)>,
    /// Checkpoints moved aside (corrupt, torn, foreign).
    pub rejected: Vec<Rejection>,
    /// The temporary directories of earlier writers killed mid-save, deleted, with their
    /// bytes.
    pub reclaimed: Vec<(PathBuf, u64)>,
}

/// The newest checkpoint under `root` (of `steps`, newest first) that `load` accepts; each
/// one refused before it is moved aside into `rejected`.
pub(super) fn newest_valid(
    root: &Path,
    steps: &[u64],
    load: fn(&Path) -> Result<Checkpoint, CheckpointError>,
    rejected: &mut Vec<Rejection>,
) -> Result<Option<(PathBuf, Checkpoint)>, CheckpointError> {
    for &step in steps {
        let dir = root.join(dir_name(step));
        match load(&dir) {
            Ok(c) => return Ok(Some((dir, c))),
            Err(e) => rejected.push(move_aside(root, &dir, &e.to_string())?),
        }
    }
    Ok(None)
}

/// Whether the checkpoint at `dir` is this run's, beside the `chosen` one it resumes from:
/// `Ok` when it is; `Err(Some(why))` when it must be moved aside (another lineage's, or any
/// when the run starts afresh); `Err(None)` when it is left where it is, out of the run's set
/// (one older than the resume point whose state cannot be read: harmless).
pub(super) fn lineage_verdict(
    dir: &Path,
    chosen: Option<&(PathBuf, Checkpoint)>,
    resume: bool,
    run_id: &str,
) -> Result<(), Option<String>> {
    let Some((chosen_dir, chosen_ck)) = chosen else {
        let why = if resume {
            "no checkpoint of this directory verified, so this run started afresh"
        } else {
            "checkpoint.resume = false: a new run started in this directory"
        };
        return Err(Some(format!("not this run's: {why}")));
    };
    if dir == chosen_dir {
        return Ok(());
    }
    // Older than the chosen one: ours if its lineage matches (checkpoints from before
    // lineages existed belong to a lineage-less resumed run).
    let state = load_state(dir).map_err(|_| None)?;
    if lineage_of(&state) == lineage_of(&chosen_ck.state) {
        return Ok(());
    }
    Err(Some(format!(
        "belongs to another run (run_id {:?}; this run is {run_id:?})",
        lineage_of(&state)
    )))
}

impl CheckpointStore {
    /// Scans `root`. With `resume`, the newest checkpoint that verifies is chosen and its
    /// lineage adopted; corrupt checkpoints newer than it and valid ones of another lineage
    /// are moved aside. Without `resume` (or when none verifies) a new lineage `new_run_id`
    /// starts and every existing checkpoint is moved aside: none of them is this run's.
    pub fn open(
        root: &Path,
        keep: usize,
        resume: bool,
        new_run_id: &str,
    ) -> Result<Opened, CheckpointError> {
        Self::open_with(root, keep, resume, new_run_id, load)
    }

    /// [`CheckpointStore::open`], reading the candidates with `load` ([`load`], or
    /// [`verify`] for a sharded run whose ranks then read their own pieces).
    pub fn open_with(
        root: &Path,
        keep: usize,
        resume: bool,
        new_run_id: &str,
        load: fn(&Path) -> Result<Checkpoint, CheckpointError>,
    ) -> Result<Opened, CheckpointError> {
        let reclaimed = remove_dead_writers_leftovers(root)?;
        let mut rejected = Vec::new();
        let steps = list_steps(root);
        let chosen = match resume {
            true => newest_valid(root, &steps, load, &mut rejected)?,
            false => None,
        };
        let run_id = chosen.as_ref().map_or(new_run_id.to_string(), |(_, c)| {
            lineage_of(&c.state).unwrap_or(new_run_id).to_string()
        });
        let mut ours = Vec::new();
        for &step in &steps {
            let dir = root.join(dir_name(step));
            if std::fs::symlink_metadata(&dir).is_err() {
                continue; // moved aside above
            }
            match lineage_verdict(&dir, chosen.as_ref(), resume, &run_id) {
                Ok(()) => ours.push(step),
                Err(Some(why)) => rejected.push(move_aside(root, &dir, &why)?),
                Err(None) => {}
            }
        }
        Ok(Opened {
            manager: CheckpointStore {
                root: root.to_path_buf(),
                keep: keep.max(1),
                run_id,
                ours,
            },
            resume: chosen,
            rejected,
            reclaimed,
        })
    }

    /// Continues lineage `run_id` when no checkpoint of this directory was resumed (a run
    /// restarted before its first persistent checkpoint, recorded in the run directory);
    /// ignored once a checkpoint decided the lineage.
    pub fn adopt_lineage(&mut self, run_id: &str) {
        if self.ours.is_empty() {
            self.run_id = run_id.to_string();
        }
    }

    /// This run's lineage id (written into every checkpoint's state as `run_id`).
    pub fn run_id(&self) -> &str {
        &self.run_id
    }

    /// The checkpoint directory of the root.
    pub fn root(&self) -> &Path {
        &self.root
    }

    /// Publishes `ckpt`, then moves aside this lineage's checkpoints newer than it (left by
    /// a rollback) and deletes this lineage's oldest beyond `keep`.
    pub fn save(&mut self, ckpt: &Contents) -> Result<SaveReport, CheckpointError> {
        let path = save(&self.root, ckpt)?;
        let step = ckpt.step;
        let mut superseded = Vec::new();
        for &s in self.ours.iter().filter(|&&s| s > step) {
            let dir = self.root.join(dir_name(s));
            superseded.push(move_aside(
                &self.root,
                &dir,
                &format!("superseded: the run rolled back and saved step {step} after it"),
            )?);
        }
        self.ours.retain(|&s| s < step);
        self.ours.push(step);
        self.ours.sort_unstable_by(|a, b| b.cmp(a));
        let mut pruned = Vec::new();
        for &s in self.ours.iter().skip(self.keep) {
            let dir = self.root.join(dir_name(s));
            remove_tree(&dir)?;
            pruned.push(dir);
        }
        self.ours.truncate(self.keep);
        self.remove_own_leftovers()?;
        self.remove_stale_shard_staging(step)?;
        Ok(SaveReport {
            path,
            pruned,
            superseded,
        })
    }

    /// Deletes the optimizer-shard staging directories of steps before `step` (left by a
    /// sharded run that died between its ranks' writes and rank 0's publish).
    fn remove_stale_shard_staging(&self, step: u64) -> Result<(), CheckpointError> {
        let Ok(entries) = std::fs::read_dir(&self.root) else {
            return Ok(());
        };
        for e in entries.filter_map(Result::ok) {
            let stale = layout::parse_shard_staging(&e.file_name().to_string_lossy())
                .is_some_and(|s| s < step);
            if stale {
                remove_tree(&e.path())?;
            }
        }
        Ok(())
    }

    /// Deletes this process's temporary directories of earlier failed saves (another
    /// process's are not touched: the run-directory lock means there is none, but a
    /// directory shared by mistake must not lose a save in flight).
    fn remove_own_leftovers(&self) -> Result<(), CheckpointError> {
        let pid = std::process::id().to_string();
        let Ok(entries) = std::fs::read_dir(&self.root) else {
            return Ok(());
        };
        for e in entries.filter_map(Result::ok) {
            let name = e.file_name();
            let name = name.to_string_lossy();
            let own = (name.starts_with(".tmp-") || name.starts_with(".old-"))
                && name.rsplit('-').next() == Some(pid.as_str());
            if own {
                remove_tree(&e.path())?;
            }
        }
        Ok(())
    }
}

/// Deletes the temporary and replaced directories (`.tmp-*`, `.old-*`) of every earlier writer
/// of `root` and returns them with their bytes: the caller owns the directory (it holds the run
/// directory's lock, [`crate::run_dir::RunDir`]), so no other process writes there, and a writer
/// killed mid-save (SIGKILL, a lost node, a preemption) would otherwise leave up to a whole
/// checkpoint there for ever.
pub(super) fn remove_dead_writers_leftovers(
    root: &Path,
) -> Result<Vec<(PathBuf, u64)>, CheckpointError> {
    let Ok(entries) = std::fs::read_dir(root) else {
        return Ok(Vec::new());
    };
    let mut removed = Vec::new();
    for e in entries.filter_map(Result::ok) {
        let name = e.file_name();
        let name = name.to_string_lossy();
        if name.starts_with(".tmp-") || name.starts_with(".old-") {
            let bytes = tree_bytes(&e.path());
            remove_tree(&e.path())?;
            removed.push((e.path(), bytes));
        }
    }
    removed.sort();
    Ok(removed)
}

/// Bytes of the regular files under `path` (not following links).
pub(super) fn tree_bytes(path: &Path) -> u64 {
    let Ok(meta) = std::fs::symlink_metadata(path) else {
        return 0;
    };
    if !meta.is_dir() {
        return if meta.is_file() { meta.len() } else { 0 };
    }
    std::fs::read_dir(path).map_or(0, |entries| {
        entries
            .filter_map(Result::ok)
            .map(|e| tree_bytes(&e.path()))
            .sum()
    })
}

/// Moves `dir` into `root/rejected/` (a free name) with a note of `reason`.
pub(super) fn move_aside(
    root: &Path,
    dir: &Path,
    reason: &str,
) -> Result<Rejection, CheckpointError> {
    let aside = root.join(layout::REJECTED);
    std::fs::create_dir_all(&aside).map_err(io_err(&aside))?;
    let base = dir
        .file_name()
        .map_or_else(|| "checkpoint".into(), |n| n.to_string_lossy().into_owned());
    let mut target = aside.join(&base);
    let mut n = 1;
    while std::fs::symlink_metadata(&target).is_ok() {
        target = aside.join(format!("{base}.{n}"));
        n += 1;
    }
    std::fs::rename(dir, &target).map_err(io_err(dir))?;
    if std::fs::symlink_metadata(&target).is_ok_and(|m| m.is_dir()) {
        // Best effort: the move is what matters; the note only explains it.
        let _ = std::fs::write(
            target.join(REJECTED_NOTE),
            format!(
                "moved here by kiln at unix time {:.0} from {}\nreason: {reason}\n",
                kiln_run::unix_time(),
                dir.display()
            ),
        );
    }
    fsync_dir(root)?;
    Ok(Rejection {
        path: dir.to_path_buf(),
        reason: reason.to_string(),
        moved_to: target,
    })
}

/// Note left inside a directory moved to `checkpoints/rejected/`.
pub(super) const REJECTED_NOTE: &str = "REJECTED.txt";

//! The memory tiers a node holds: every run's `kiln-<hash>` folder in a snapshot directory
//! (`/dev/shm` by default), who owns it, and whether any resume can still use it.
//!
//! A tier outlives its process by design (a restart resumes from it), so nothing frees one
//! that is never resumed: a bare `kiln train` SIGKILLed, a `kiln launch` without a scheduler
//! that ended for good, a run moved or deleted. On a 7B model each is tens of GB of a node's
//! RAM. Each run's folder holds an owner record ([`layout::SNAPSHOT_OWNER`]: its run
//! directory and the guards' rollback interval); every kiln start on a node [`reclaim`]s the
//! other runs' folders that no resume can use:
//! - its run directory is gone;
//! - its run completed (the final weights were written after its newest snapshot);
//! - its snapshots are older than the run's newest persistent checkpoint, which a resume
//!   would take instead (the newest at the guards' rollback interval stays, as a resume keeps
//!   it: [`super::SnapshotStore::remove_stale`]).
//!
//! The last two only while no trainer holds the run directory's lock: a live run's tier is
//! never touched. A folder without an owner record (an older kiln's, or one being created)
//! is shown but kept. `kiln doctor` lists a node's tiers with their fate, `kiln status` the
//! run's own.

use crate::checkpoint::{self, remove_tree};
use crate::components::journal::{Journal, path_text};
use crate::error::TrainError;
use kiln_run::{event, layout};
use nix::fcntl::{Flock, FlockArg};
use serde::{Deserialize, Serialize};
use serde_json::json;
use std::path::{Path, PathBuf};

/// The owner record of a run's tier folder.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Owner {
    /// The run directory, absolute.
    pub run_dir: PathBuf,
    /// The guards' rollback interval (`guards.snapshot_interval`; 0: none).
    pub anchor: u64,
}

impl Owner {
    /// Writes the record into `folder` unless it is there (temporary file and rename: the
    /// ranks of a node write the same record at the same time).
    pub fn ensure_in(&self, folder: &Path) -> std::io::Result<()> {
        let path = folder.join(layout::SNAPSHOT_OWNER);
        if path.exists() {
            return Ok(());
        }
        std::fs::create_dir_all(folder)?;
        let tmp = folder.join(format!(".tmp-owner-{}", std::process::id()));
        std::fs::write(&tmp, serde_json::to_vec(self).unwrap_or_default())?;
        std::fs::rename(&tmp, &path)
    }

    fn read(folder: &Path) -> Option<Self> {
        let bytes = std::fs::read(folder.join(layout::SNAPSHOT_OWNER)).ok()?;
        serde_json::from_slice(&bytes).ok()
    }
}

/// What becomes of a tier folder.
#[derive(Debug, Clone, PartialEq)]
pub enum Fate {
    /// Kept: a resume may use it (or nothing says it cannot), and why.
    Keep(String),
    /// These snapshots no resume can use are deleted (the rest stay), and why.
    Trim(Vec<PathBuf>, String),
    /// The whole folder is deleted, and why.
    Remove(String),
}

/// One run's tier folder on this node.
#[derive(Debug, Clone)]
pub struct Held {
    /// The folder (`<snapshot dir>/kiln-<hash>`).
    pub folder: PathBuf,
    /// Its owner record, if it has one.
    pub owner: Option<Owner>,
    /// Bytes of its files.
    pub bytes: u64,
    /// The steps of its snapshots, each rank's, newest first.
    pub steps: Vec<u64>,
    /// What [`reclaim`] does with it.
    pub fate: Fate,
}

/// The snapshot directory of `snapshot_dir` (`checkpoint.snapshot_dir`): itself, or where it
/// is empty `/dev/shm` (else the system's temporary directory).
pub fn base_dir(snapshot_dir: &str) -> PathBuf {
    if !snapshot_dir.is_empty() {
        return PathBuf::from(snapshot_dir);
    }
    let shm = Path::new("/dev/shm");
    if shm.is_dir() {
        shm.to_path_buf()
    } else {
        std::env::temp_dir()
    }
}

/// The rank folders (`rank-<R>`) of a tier folder.
fn rank_folders(folder: &Path) -> Vec<PathBuf> {
    let Ok(entries) = std::fs::read_dir(folder) else {
        return Vec::new();
    };
    let prefix = layout::SNAPSHOT_RANK_PREFIX;
    let mut out: Vec<PathBuf> = entries
        .filter_map(Result::ok)
        .filter(|e| e.file_name().to_string_lossy().starts_with(prefix))
        .filter(|e| e.file_type().is_ok_and(|t| t.is_dir()))
        .map(|e| e.path())
        .collect();
    out.sort();
    out
}

/// Bytes of the files under `path` (links not followed).
fn size_of(path: &Path) -> u64 {
    let Ok(meta) = std::fs::symlink_metadata(path) else {
        return 0;
    };
    if !meta.is_dir() {
        return meta.len();
    }
    let entries = std::fs::read_dir(path).into_iter().flatten().flatten();
    entries.map(|e| size_of(&e.path())).sum()
}

/// Whether a trainer holds the lock of `run_dir` (a live run). The lock file is opened, never
/// created; where it cannot be taken for another reason, the run counts as live.
fn training(run_dir: &Path) -> bool {
    let Ok(file) = std::fs::File::open(run_dir.join(layout::LOCK)) else {
        return false;
    };
    match Flock::lock(file, FlockArg::LockExclusiveNonblock) {
        Ok(_released_on_drop) => false,
        Err(_) => true,
    }
}

/// The modification time of `path`, if it has one.
fn modified(path: &Path) -> Option<std::time::SystemTime> {
    std::fs::metadata(path).and_then(|m| m.modified()).ok()
}

/// Each rank folder of a tier and the steps of its snapshots, newest first (read once).
type Ranks = [(PathBuf, Vec<u64>)];

/// What becomes of a tier folder owned by `owner` whose rank folders hold `ranks` (see the
/// module documentation).
fn fate_of(owner: Option<&Owner>, ranks: &Ranks) -> Fate {
    let Some(owner) = owner else {
        return Fate::Keep("no owner record (an older kiln's, or being created)".into());
    };
    let run = &owner.run_dir;
    if !run.is_dir() {
        return Fate::Remove(format!("its run directory {} is gone", run.display()));
    }
    if training(run) {
        return Fate::Keep(format!("its run is training ({} is held)", layout::LOCK));
    }
    let snapshots: Vec<PathBuf> = (ranks.iter())
        .flat_map(|(r, steps)| steps.iter().map(move |&s| r.join(checkpoint::dir_name(s))))
        .collect();
    let newest_snapshot = snapshots.iter().filter_map(|p| modified(p)).max();
    let finished = modified(&run.join(layout::FINAL_MODEL));
    if let (Some(done), Some(newest)) = (finished, newest_snapshot)
        && done >= newest
    {
        return Fate::Remove(format!(
            "its run completed ({} was written after its newest snapshot)",
            layout::FINAL_MODEL
        ));
    }
    let checkpoints = checkpoint::list_steps(&run.join(layout::CHECKPOINTS));
    let Some(&floor) = checkpoints.first() else {
        return Fate::Keep("its run has no persistent checkpoint: a resume would use it".into());
    };
    let stale: Vec<PathBuf> = (ranks.iter())
        .flat_map(|(r, steps)| stale_in(r, steps, owner.anchor, floor))
        .collect();
    let why =
        format!("older than its run's newest checkpoint (step {floor}), which a resume takes");
    match stale.len() {
        0 => Fate::Keep(format!(
            "a resume would use it (its run's newest checkpoint is step {floor})"
        )),
        n if n == snapshots.len() => Fate::Remove(format!("its snapshots are {why}")),
        _ => Fate::Trim(stale, format!("{why}; the rest may still serve a resume")),
    }
}

/// The snapshots of one rank's store `rank` (of `steps`, newest first) below `floor` but the
/// newest at a multiple of `anchor` at or before it: what
/// [`super::SnapshotStore::remove_stale`] deletes at a resume.
fn stale_in(rank: &Path, steps: &[u64], anchor: u64, floor: u64) -> Vec<PathBuf> {
    let keep = steps
        .iter()
        .copied()
        .find(|&s| s <= floor && anchor > 0 && s % anchor == 0);
    (steps.iter().copied())
        .filter(|&s| s < floor && Some(s) != keep)
        .map(|s| rank.join(checkpoint::dir_name(s)))
        .collect()
}

/// Every run's tier folder in the snapshot directory `base`, with its fate.
pub fn survey(base: &Path) -> Vec<Held> {
    let Ok(entries) = std::fs::read_dir(base) else {
        return Vec::new();
    };
    let mut folders: Vec<PathBuf> = entries
        .filter_map(Result::ok)
        .filter(|e| {
            let name = e.file_name();
            name.to_string_lossy()
                .starts_with(layout::SNAPSHOT_ROOT_PREFIX)
                && e.file_type().is_ok_and(|t| t.is_dir())
        })
        .map(|e| e.path())
        .collect();
    folders.sort();
    folders.iter().filter_map(|f| Held::of(f)).collect()
}

impl Held {
    /// The folder as it is now (`None` where it holds no tier: neither an owner record nor
    /// a rank folder).
    pub fn of(folder: &Path) -> Option<Self> {
        let ranks: Vec<(PathBuf, Vec<u64>)> = (rank_folders(folder).into_iter())
            .map(|r| {
                let steps = checkpoint::list_steps(&r);
                (r, steps)
            })
            .collect();
        if ranks.is_empty() && !folder.join(layout::SNAPSHOT_OWNER).exists() {
            return None;
        }
        let owner = Owner::read(folder);
        let mut steps: Vec<u64> = ranks.iter().flat_map(|(_, s)| s.iter().copied()).collect();
        steps.sort_unstable_by(|a, b| b.cmp(a));
        Some(Held {
            fate: fate_of(owner.as_ref(), &ranks),
            bytes: size_of(folder),
            folder: folder.to_path_buf(),
            owner,
            steps,
        })
    }

    /// One line: the folder, its owner, its snapshots and size, and its fate.
    pub fn describe(&self) -> String {
        let owner = self.owner.as_ref().map_or("owner unknown".into(), |o| {
            format!("run {}", o.run_dir.display())
        });
        let steps = match (self.steps.first(), self.steps.last()) {
            (Some(new), Some(old)) if new != old => {
                format!("{} snapshots, steps {old}-{new}", self.steps.len())
            }
            (Some(s), _) => format!("{} snapshot(s) of step {s}", self.steps.len()),
            _ => "no snapshot".into(),
        };
        let fate = match &self.fate {
            Fate::Keep(why) => format!("kept: {why}"),
            Fate::Trim(dirs, why) => format!("{} to reclaim: {why}", dirs.len()),
            Fate::Remove(why) => format!("to reclaim: {why}"),
        };
        format!(
            "{} ({owner}): {steps}, {}; {fate}",
            self.folder.display(),
            kiln_run::host::human_bytes(self.bytes as f64)
        )
    }
}

/// Reclaims, in the snapshot directory `base`, every tier folder but `own` (this run's)
/// that no resume can use (see the module documentation); returns those it removed or
/// trimmed, with the bytes freed. One kiln start per node does it at a time (a lock on
/// `base`); the others return at once.
pub fn reclaim(base: &Path, own: &Path) -> Vec<(Held, u64)> {
    // The directory itself is the lock (flock on its descriptor): no file is left behind.
    let Ok(dir) = std::fs::File::open(base) else {
        return Vec::new();
    };
    let Ok(_held) = Flock::lock(dir, FlockArg::LockExclusiveNonblock) else {
        return Vec::new();
    };
    let mut out = Vec::new();
    for h in survey(base).into_iter().filter(|h| h.folder != own) {
        let freed = match &h.fate {
            Fate::Keep(_) => continue,
            Fate::Remove(_) => remove_tree(&h.folder).map(|()| h.bytes),
            Fate::Trim(dirs, _) => dirs.iter().try_fold(0, |n, d| {
                let b = size_of(d);
                remove_tree(d).map(|()| n + b)
            }),
        };
        match freed {
            Ok(b) => out.push((h, b)),
            Err(e) => tracing::warn!("cannot reclaim memory tier {}: {e}", h.folder.display()),
        }
    }
    out
}

/// Reports tiers [`reclaim`] freed: a line on stderr (any rank: each node's first start
/// reclaims its own), a note and a `memory_tier_reclaimed` event (the writer rank's).
pub fn report(reclaimed: Vec<(Held, u64)>, journal: &mut Journal) -> Result<(), TrainError> {
    for (held, bytes) in reclaimed {
        let (removed, why) = match &held.fate {
            Fate::Remove(why) => (true, why.as_str()),
            Fate::Trim(_, why) | Fate::Keep(why) => (false, why.as_str()),
        };
        let run_dir = held.owner.as_ref().map(|o| path_text(&o.run_dir));
        let line = format!(
            "reclaimed {} of memory tier {} on {}: {why}",
            kiln_run::host::human_bytes(bytes as f64),
            held.folder.display(),
            kiln_run::host_name()
        );
        tracing::warn!("{line}");
        journal.note(&line);
        journal.emit(
            event::MEMORY_TIER_RECLAIMED,
            json!({"folder": path_text(&held.folder), "run_dir": run_dir,
                   "removed": removed, "why": why, "bytes": bytes,
                   "host": kiln_run::host_name()}),
        )?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::super::SnapshotStore;
    use super::*;
    use crate::checkpoint::tests::ckpt;
    use crate::components::checkpoints::saver::Store;

    /// A tier folder in `base` of a run in `run` whose rank 0 holds snapshots at `steps`.
    fn tier(base: &Path, name: &str, run: &Path, steps: &[u64], anchor: u64) -> PathBuf {
        let folder = base.join(format!("kiln-{name}"));
        Owner {
            run_dir: run.to_path_buf(),
            anchor,
        }
        .ensure_in(&folder)
        .unwrap();
        let mut store = SnapshotStore::new(folder.join("rank-0"), 100, 0);
        for &s in steps {
            store.save(&ckpt(s, "a").contents()).unwrap();
        }
        folder
    }

    fn checkpoint_at(run: &Path, step: u64) {
        let dir = run.join(layout::CHECKPOINTS);
        std::fs::create_dir_all(dir.join(checkpoint::dir_name(step))).unwrap();
    }

    #[test]
    fn what_no_resume_can_use_is_reclaimed_and_the_rest_kept() {
        let base = tempfile::tempdir().unwrap();
        let b = base.path();
        let runs = tempfile::tempdir().unwrap();
        let run = |n: &str| {
            let p = runs.path().join(n);
            std::fs::create_dir_all(&p).unwrap();
            p
        };
        let (gone, done, behind, ahead, part, live) = (
            runs.path().join("gone"),
            run("done"),
            run("behind"),
            run("ahead"),
            run("part"),
            run("live"),
        );
        tier(b, "gone", &gone, &[5], 0);
        tier(b, "done", &done, &[5], 0);
        std::thread::sleep(std::time::Duration::from_millis(20));
        std::fs::write(done.join(layout::FINAL_MODEL), b"w").unwrap();
        tier(b, "behind", &behind, &[5, 10], 0);
        checkpoint_at(&behind, 20);
        tier(b, "ahead", &ahead, &[20, 25], 0);
        checkpoint_at(&ahead, 20);
        // Snapshots 4, 8, 12 with a rollback interval of 4 and a checkpoint at 10: 4 goes,
        // 8 (the rollback point at or before 10) and 12 stay.
        tier(b, "part", &part, &[4, 8, 12], 4);
        checkpoint_at(&part, 10);
        tier(b, "live", &live, &[5], 0);
        checkpoint_at(&live, 20);
        let _lock = crate::run_dir::RunDir::lock(&live).unwrap();
        let own = tier(b, "own", &runs.path().join("own-gone"), &[5], 0);
        std::fs::create_dir_all(b.join("kiln-unrelated")).unwrap();
        std::fs::write(b.join("kiln-file"), b"x").unwrap();

        let fates: Vec<(String, Fate)> = survey(b)
            .into_iter()
            .map(|h| {
                (
                    h.folder.file_name().unwrap().to_string_lossy().into(),
                    h.fate,
                )
            })
            .collect();
        let names: Vec<&str> = fates.iter().map(|(n, _)| n.as_str()).collect();
        assert_eq!(
            names,
            [
                "kiln-ahead",
                "kiln-behind",
                "kiln-done",
                "kiln-gone",
                "kiln-live",
                "kiln-own",
                "kiln-part"
            ],
            "folders without an owner record or rank folders are not tiers"
        );
        let reclaimed = reclaim(b, &own);
        let mut removed: Vec<String> = reclaimed
            .iter()
            .map(|(h, bytes)| {
                assert!(*bytes > 0, "{h:?}");
                h.folder.file_name().unwrap().to_string_lossy().into()
            })
            .collect();
        removed.sort();
        assert_eq!(
            removed,
            ["kiln-behind", "kiln-done", "kiln-gone", "kiln-part"]
        );
        for gone in ["kiln-behind", "kiln-done", "kiln-gone"] {
            assert!(!b.join(gone).exists(), "{gone}");
        }
        assert_eq!(checkpoint::list_steps(&b.join("kiln-part/rank-0")), [12, 8]);
        for kept in ["kiln-ahead", "kiln-live", "kiln-own", "kiln-unrelated"] {
            assert!(b.join(kept).exists(), "{kept}");
        }
        assert!(matches!(&fates[4].1, Fate::Keep(why) if why.contains("training")));
    }
}

//! The filesystem calls every checkpoint write and removal goes through: errors that name the
//! path, folders shared between ranks, fsync of a folder, removal that never follows a link.

use super::error::CheckpointError;
use std::fs::File;
use std::path::Path;

pub(crate) fn io_err(path: &Path) -> impl FnOnce(std::io::Error) -> CheckpointError + '_ {
    move |source| CheckpointError::Io {
        path: path.to_path_buf(),
        source,
    }
}
/// `std::fs::create_dir_all` for a folder that other processes share and remove when it is
/// empty: the ranks of one node keep their memory snapshots under one run folder, which a
/// rank that ends (or that only checked it could write there) removes when it holds nothing.
/// Between `create_dir_all`'s making of that folder and of the rank's own inside it, another
/// rank can remove it, and the second `mkdir` then fails with `NotFound`; or another rank
/// made it first and a third removed it before `create_dir_all` saw it there, which fails with
/// `AlreadyExists`. Made again, a few times, neither is an error (it would refuse the
/// rank's start with exit 78, or skip a snapshot).
pub(crate) fn create_shared_dir_all(path: &Path) -> std::io::Result<()> {
    use std::io::ErrorKind::{AlreadyExists, NotFound};
    let mut tries = 0;
    loop {
        match std::fs::create_dir_all(path) {
            Err(e) if matches!(e.kind(), NotFound | AlreadyExists) && tries < 16 => tries += 1,
            done => return done,
        }
    }
}
/// Makes a folder's entries durable (after files were created or renamed in it).
pub(crate) fn fsync_dir(dir: &Path) -> Result<(), CheckpointError> {
    File::open(dir)
        .and_then(|f| f.sync_all())
        .map_err(io_err(dir))
}
/// Removes a directory kiln wrote; a symlink is removed itself, never followed.
pub(crate) fn remove_tree(path: &Path) -> Result<(), CheckpointError> {
    match std::fs::symlink_metadata(path) {
        Ok(m) if m.is_dir() => std::fs::remove_dir_all(path).map_err(io_err(path)),
        Ok(_) => std::fs::remove_file(path).map_err(io_err(path)),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(io_err(path)(e)),
    }
}

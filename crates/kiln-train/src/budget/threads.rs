//! The CPU threads of the flex backend.

use crate::config::ConfigError;

/// Starts the flex backend's worker threads (rayon's global pool) with `threads` workers;
/// 0 keeps rayon's default (one per core). Only the first call in a process has an effect;
/// later ones (another session in the same process) are no-ops. Never panics: a count over
/// [`kiln_run::host::max_threads`] is refused, and a pool that cannot start is an error
/// (rayon's global pool is then unusable, so the process must stop rather than go on).
pub fn start_threads(threads: usize) -> Result<(), ConfigError> {
    if threads == 0 {
        return Ok(());
    }
    kiln_run::host::check_threads("training.threads", threads).map_err(ConfigError::TooBig)?;
    match rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .build_global()
    {
        Ok(()) => Ok(()),
        // rayon exposes no error kind; its Debug output names it.
        Err(e) if format!("{e:?}").contains("GlobalPoolAlreadyInitialized") => Ok(()),
        Err(e) => Err(ConfigError::TooBig(format!(
            "training.threads = {threads}: cannot start the worker threads: {e}"
        ))),
    }
}

//! Where an attempt's ranks report to (see [`crate::plane`]): the progress directory the
//! shims write into (the `files` plane), or the control plane's server, which holds what the
//! node agents sent. The watch loop reads records and sends stop requests through this one
//! view, whichever plane the launch uses.

use super::config::AttemptConfig;
use crate::plane::board::LostNode;
use crate::plane::server::Server;
use kiln_run::RankFiles;
use std::path::PathBuf;
use std::time::Instant;

/// An attempt's reports.
#[derive(Clone, Copy)]
pub(super) enum Reports<'a> {
    /// The progress directory.
    Dir(&'a PathBuf),
    /// The control plane's server.
    Plane(&'a Server),
}

impl AttemptConfig {
    /// Where this attempt's ranks report, if anywhere.
    pub(super) fn reports(&self) -> Option<Reports<'_>> {
        match (&self.plane, &self.progress_dir) {
            (Some(p), _) => Some(Reports::Plane(p)),
            (None, Some(d)) => Some(Reports::Dir(d)),
            (None, None) => None,
        }
    }
}

impl<'a> Reports<'a> {
    /// The ranks' records.
    pub(super) fn files(self) -> &'a dyn RankFiles {
        match self {
            Reports::Dir(d) => d,
            Reports::Plane(p) => p.board(),
        }
    }

    /// Starts an attempt: records of earlier ones are forgotten (`clear`: also those in the
    /// progress directory) and an earlier stop request not addressed to one is withdrawn.
    pub(super) fn begin(self, cfg: &AttemptConfig) {
        match self {
            Reports::Dir(dir) => {
                if cfg.clear_progress_dir {
                    kiln_run::clear_rank_files(dir);
                }
                // An addressed request stays: an earlier attempt's shim may not have read its
                // SIGKILL yet, and this attempt's shims leave it alone.
                if cfg.attempt.is_none() {
                    kiln_run::clear_stop_request(dir);
                }
            }
            Reports::Plane(p) => p.begin(cfg.attempt.as_deref()),
        }
    }

    /// Asks every rank shim of `attempt` to send `signal` to its rank.
    pub(super) fn request_stop(
        self,
        signal: i32,
        attempt: Option<&str>,
    ) -> Result<(), kiln_run::BeaconError> {
        let now = kiln_run::unix_time();
        match self {
            Reports::Dir(dir) => kiln_run::write_stop_request(dir, signal, now, attempt),
            Reports::Plane(p) => {
                p.request_stop(signal, now, attempt);
                Ok(())
            }
        }
    }

    /// A node whose agent went away or fell silent (the `tcp` plane only).
    pub(super) fn lost_node(self, now: Instant) -> Option<LostNode> {
        match self {
            Reports::Dir(_) => None,
            Reports::Plane(p) => p.board().lost_node(now),
        }
    }
}

//! What the ranks' exit records (written by `kiln launch --as-rank`) say about how an attempt
//! ended: the rank that failed first, the code the ranks' own exits give, and whether every
//! rank is done although the launcher still runs.

use super::config::AttemptConfig;
use super::outcome::Verdict;
use crate::classify::{Classification, classify_code, classify_exit, exit_code_of};
use kiln_run::{ExitRecord, RankFiles, read_exit_records};
use std::time::Instant;

/// Which of the ranks' records in the progress directory are this attempt's.
#[derive(Debug, Clone, Copy)]
pub(super) struct Ours<'a> {
    /// The attempt's token ([`kiln_run::ATTEMPT_ENV`]), exported to its ranks.
    pub(super) token: Option<&'a str>,
    /// When it started, Unix seconds.
    pub(super) start_time: f64,
}

impl Ours<'_> {
    /// Whether a record written at `time` by a writer with `token` is this attempt's: the
    /// same token; without one on either side, written since the attempt started (1 s of
    /// clock skew between hosts allowed). A token tells apart what time cannot: a record
    /// an earlier attempt's shim wrote just after this attempt started.
    pub(super) fn owns(&self, time: f64, token: Option<&str>) -> bool {
        match (self.token, token) {
            (Some(ours), Some(theirs)) => ours == theirs,
            _ => time + 1.0 >= self.start_time,
        }
    }
}

/// The exit records of this attempt.
pub(super) fn fresh_exit_records(files: &dyn RankFiles, ours: Ours<'_>) -> Vec<ExitRecord> {
    read_exit_records(files)
        .into_iter()
        .filter(|r| ours.owns(r.time, r.attempt.as_deref()))
        .collect()
}

/// The rank that failed first by its exit record.
pub(super) fn first_failed(records: &[ExitRecord]) -> Option<&ExitRecord> {
    records
        .iter()
        .filter(|r| r.shell_code() != 0)
        .min_by(|a, b| a.time.total_cmp(&b.time))
}

/// Classifies an attempt that ended on its own: by the launcher's (or the deciding rank's)
/// exit, unless the ranks' exit records tell more: the earliest rank to fail decides (a
/// launcher reports its own code, e.g. srun 137 after killing the other ranks).
pub(super) fn by_rank_exits(
    code: Option<i32>,
    signal: Option<i32>,
    records: &[ExitRecord],
) -> (Classification, i32, Option<String>) {
    let launcher = (classify_exit(code, signal), exit_code_of(code, signal));
    if launcher.0 == Classification::Success {
        return (launcher.0, launcher.1, None);
    }
    match first_failed(records) {
        Some(r) => {
            let c = r.shell_code();
            (
                classify_code(c, r.signal.is_some()),
                c,
                Some(format!(
                    "rank {} on {} failed first ({})",
                    r.rank,
                    r.host,
                    describe(r.code, r.signal)
                )),
            )
        }
        None => (launcher.0, launcher.1, None),
    }
}

/// Whether every one of the `expected` ranks left an exit record.
fn all_exited(expected: usize, records: &[ExitRecord]) -> bool {
    (0..expected).all(|r| records.iter().any(|x| x.rank == r))
}

/// The code the ranks' own exits give, once every expected rank left an exit record: 0 if all
/// succeeded, else the code of the rank that failed first.
pub(super) fn ranks_exit_code(cfg: &AttemptConfig, records: &[ExitRecord]) -> Option<i32> {
    let n = cfg.expected_ranks.filter(|&n| n > 0)?;
    if !all_exited(n, records) {
        return None;
    }
    Some(first_failed(records).map_or(0, ExitRecord::shell_code))
}

/// When a watchdog fires but every rank has already exited (it left an exit record), the
/// ranks' exits decide, not the silence: a launcher can hang on a leftover process that
/// holds its output after the ranks are done.
pub(super) fn ranks_already_exited(cfg: &AttemptConfig, ours: Ours<'_>) -> Option<Verdict> {
    let n = cfg.expected_ranks?;
    let records = fresh_exit_records(cfg.reports()?.files(), ours);
    if n == 0 || !all_exited(n, &records) {
        return None;
    }
    let (classification, code, msg) = by_rank_exits(Some(1), None, &records);
    let (classification, code) = if records.iter().all(|r| r.shell_code() == 0) {
        (Classification::Success, 0)
    } else {
        (classification, code)
    };
    Some(Verdict {
        classification,
        at: Instant::now(),
        detect_s: None,
        culprits: Vec::new(),
        culprit_source: None,
        message: Some(msg.unwrap_or_else(|| {
            format!(
                "all {n} ranks exited 0, but the launcher kept running (a leftover process holds its output); stopped it"
            )
        })),
        exit_code: Some(code),
    })
}

/// How a process ended, in words.
pub(super) fn describe(code: Option<i32>, signal: Option<i32>) -> String {
    match (code, signal) {
        (Some(c), _) => format!("exit code {c}"),
        (None, Some(s)) => format!("killed by signal {s}"),
        _ => "unknown status".into(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_record_is_ours_by_its_token_else_by_its_time() {
        let ours = Ours {
            token: Some("b"),
            start_time: 100.0,
        };
        assert!(
            ours.owns(50.0, Some("b")),
            "our token, whatever the clocks say"
        );
        assert!(
            !ours.owns(100.5, Some("a")),
            "an earlier attempt's shim that wrote after we started"
        );
        assert!(
            ours.owns(99.5, None),
            "a writer without a token, since the start"
        );
        assert!(
            !ours.owns(98.0, None),
            "a writer without a token, long before"
        );
        let untagged = Ours {
            token: None,
            start_time: 100.0,
        };
        assert!(untagged.owns(100.5, Some("a")) && !untagged.owns(98.0, Some("a")));
    }
}

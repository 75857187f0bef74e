//! The retry loop: run attempts until success, a non-retryable ending, or the retry budget is
//! spent, with exponential backoff between them; every attempt is recorded in events.jsonl.

use crate::classify::Classification;
use crate::signals::StopRequest;
use crate::supervise::{AttemptConfig, AttemptOutcome, SuperviseError, run_attempt};
use kiln_run::EventLog;
use serde_json::{Value, json};
use std::path::PathBuf;
use std::time::{Duration, Instant};

/// Exponential backoff: `base`, doubling per retry, at most `cap`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Backoff {
    /// First delay.
    pub base: Duration,
    /// Largest delay.
    pub cap: Duration,
}

impl Default for Backoff {
    /// 5, 10, 20, 40, 60, 60, ... seconds.
    fn default() -> Self {
        Self {
            base: Duration::from_secs(5),
            cap: Duration::from_secs(60),
        }
    }
}

impl Backoff {
    /// Parses `BASE[,CAP]` in seconds (fractions allowed); CAP defaults to 12 x BASE.
    pub fn parse(s: &str) -> Result<Self, String> {
        let secs = |t: &str| -> Result<Duration, String> {
            let v: f64 = t
                .trim()
                .parse()
                .map_err(|_| format!("--backoff {s:?}: {t:?} is not a number of seconds"))?;
            Duration::try_from_secs_f64(v)
                .map_err(|_| format!("--backoff {s:?}: {t:?} must be a non-negative number"))
        };
        let (base, cap) = match s.split_once(',') {
            Some((b, c)) => (secs(b)?, secs(c)?),
            None => {
                let b = secs(s)?;
                (b, b.saturating_mul(12))
            }
        };
        if cap < base {
            return Err(format!("--backoff {s:?}: the cap is smaller than the base"));
        }
        Ok(Self { base, cap })
    }

    /// Delay before retry number `retry` (1-based).
    pub fn delay(&self, retry: u32) -> Duration {
        let factor = 2u32.saturating_pow(retry.saturating_sub(1).min(30));
        self.base.saturating_mul(factor).min(self.cap)
    }
}

/// How many times to retry.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RetryLimit {
    /// At most this many retries after the first attempt.
    Count(u32),
    /// No fixed count: retry while attempts keep making new progress; give up after
    /// [`AUTO_RETRY_NO_PROGRESS`] attempts in a row that got no further than before.
    Auto,
}

/// Consecutive attempts without new progress after which `--auto-retry` gives up.
pub const AUTO_RETRY_NO_PROGRESS: u32 = 3;

/// Everything the loop needs beyond one attempt's config.
pub struct RetryConfig<'a> {
    /// The attempt template; `log_path` is replaced by `RUN_DIR/attempt-<i>.log`.
    pub attempt: AttemptConfig,
    /// The run directory.
    pub run_dir: PathBuf,
    /// Retry limit.
    pub limit: RetryLimit,
    /// Backoff.
    pub backoff: Backoff,
    /// Hosts used, for the events.
    pub hosts: Vec<String>,
    /// Where events go.
    pub events: &'a mut EventLog,
    /// Signals kiln received.
    pub stop: &'a dyn Fn() -> Option<StopRequest>,
    /// Called with each finished attempt (for a one-line summary on stderr).
    pub on_attempt_end: &'a dyn Fn(u32, &AttemptOutcome),
}

/// The result of the whole launch.
#[derive(Debug, Clone)]
pub struct LaunchResult {
    /// The last attempt's outcome (its classification and exit code are kiln's).
    pub last: AttemptOutcome,
    /// How many attempts ran.
    pub attempts: u32,
}

/// The attempt fields of `events.jsonl`.
pub fn outcome_json(
    attempt: u32,
    argv: &[Vec<String>],
    hosts: &[String],
    log: &str,
    o: &AttemptOutcome,
) -> Value {
    json!({
        "attempt": attempt,
        "argv": argv,
        "hosts": hosts,
        "log": log,
        "start_time": o.start_time,
        "end_time": o.end_time,
        "duration_s": o.end_time - o.start_time,
        "exit_code": o.exit_code,
        "classification": o.classification.name(),
        "signal": o.signal,
        "last_progress": o.last_progress,
        "progress": o.progress,
        "culprit_ranks": o.culprits,
        "detect_s": o.detect_s,
        "kill_s": o.kill_s,
        "message": o.message,
    })
}

/// Runs attempts with retries. Event-log write failures are reported (tracing) but never
/// stop the job: losing a log line is better than losing the run.
pub fn run_with_retries(cfg: RetryConfig<'_>) -> Result<LaunchResult, SuperviseError> {
    let RetryConfig {
        attempt: template,
        run_dir,
        limit,
        backoff,
        hosts,
        events,
        stop,
        on_attempt_end,
    } = cfg;
    let argv: Vec<Vec<String>> = template.procs.iter().map(|p| p.argv.clone()).collect();
    let mut emit = |event: &str, fields: Value| {
        if let Err(e) = events.emit(event, fields) {
            tracing::warn!("{e}");
        }
    };
    let mut attempt: u32 = 0;
    let mut best_progress: Option<u64> = None;
    let mut no_progress_streak = 0u32;
    loop {
        attempt += 1;
        let log_name = format!("attempt-{attempt}.log");
        let mut cfg = template.clone();
        cfg.log_path = run_dir.join(&log_name);
        emit(
            "attempt_start",
            json!({"attempt": attempt, "argv": argv, "hosts": hosts, "log": log_name}),
        );
        let outcome = run_attempt(&cfg, stop)?;
        emit(
            "attempt_end",
            outcome_json(attempt, &argv, &hosts, &log_name, &outcome),
        );
        on_attempt_end(attempt, &outcome);

        let advanced = match (outcome.last_progress, best_progress) {
            (Some(now), Some(best)) => now > best,
            (Some(_), None) => true,
            (None, _) => false,
        };
        if advanced {
            best_progress = outcome.last_progress;
            no_progress_streak = 0;
        } else {
            no_progress_streak += 1;
        }
        let retries_done = attempt - 1;
        let give_up = match limit {
            RetryLimit::Count(n) => retries_done >= n,
            RetryLimit::Auto => no_progress_streak >= AUTO_RETRY_NO_PROGRESS,
        };
        if !outcome.classification.retryable() || give_up {
            return Ok(LaunchResult {
                last: outcome,
                attempts: attempt,
            });
        }
        let delay = backoff.delay(attempt);
        // No attempt can start after the walltime: stop now, resumable, instead of starting
        // one that would be killed at once.
        if template
            .deadline
            .is_some_and(|d| Instant::now() + delay >= d)
        {
            let mut last = outcome;
            last.classification = Classification::Walltime;
            last.exit_code = crate::classify::WALLTIME_EXIT;
            last.message =
                Some("walltime reached before the next attempt could start; not retrying".into());
            emit("stopped", json!({"attempt": attempt, "reason": "walltime"}));
            return Ok(LaunchResult {
                last,
                attempts: attempt,
            });
        }
        emit(
            "backoff",
            json!({"attempt": attempt, "seconds": delay.as_secs_f64(), "after": outcome.classification.name()}),
        );
        tracing::info!("retrying in {:.1} s", delay.as_secs_f64());
        eprintln!(
            "kiln: attempt {attempt} ended {} (exit {}); retrying in {:.1} s",
            outcome.classification.name(),
            outcome.exit_code,
            delay.as_secs_f64()
        );
        // Sleep in small steps: a stop signal during backoff must end kiln promptly.
        let seen = stop().map_or(0, |s| s.count);
        let until = Instant::now() + delay;
        while Instant::now() < until {
            if let Some(req) = stop()
                && req.count > seen
            {
                let mut last = outcome;
                last.classification = if req.signal == libc::SIGUSR1 {
                    Classification::Walltime
                } else {
                    Classification::Interrupted
                };
                last.exit_code = 128 + req.signal;
                last.message = Some(format!(
                    "kiln received signal {} during backoff; not retrying",
                    req.signal
                ));
                emit("stopped", json!({"attempt": attempt, "signal": req.signal}));
                return Ok(LaunchResult {
                    last,
                    attempts: attempt,
                });
            }
            std::thread::sleep(
                Duration::from_millis(20).min(until.saturating_duration_since(Instant::now())),
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_doubles_to_the_cap() {
        let b = Backoff::default();
        let secs: Vec<u64> = (1..=6).map(|r| b.delay(r).as_secs()).collect();
        assert_eq!(secs, [5, 10, 20, 40, 60, 60]);
        let b = Backoff::parse("0.5,1.5").unwrap();
        assert_eq!(b.delay(3), Duration::from_millis(1500));
        assert_eq!(Backoff::parse("2").unwrap().cap, Duration::from_secs(24));
        assert!(Backoff::parse("x").is_err());
        assert!(Backoff::parse("5,1").is_err());
        assert!(Backoff::parse("-1").is_err());
        assert_eq!(b.delay(u32::MAX), Duration::from_millis(1500));
    }
}

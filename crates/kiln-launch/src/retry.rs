//! The recovery loop, process and node scope: run attempts until success, a non-retryable
//! ending, a deterministic failure, or the budget is spent. After a failed attempt, name the
//! culprit host (see [`crate::culprit`]), swap it for a spare and quarantine it, or retry on
//! the same hosts. An attempt that trained further than any before it is retried at once (a
//! fault after new progress is not a crash loop, and every second waited is lost to every
//! rank); attempts in a row that got no further back off exponentially. Every attempt and
//! decision is recorded in events.jsonl.

use crate::classify::Classification;
use crate::culprit::{Clues, Diagnosis, diagnose, error_signature};
use crate::health::HostHealth;
use crate::plan::PlanError;
use crate::pool::{HostPool, QuarantineEntry, Replacement, append_quarantine};
use crate::setup::AttemptPlan;
use crate::signals::StopRequest;
use crate::supervise::{AttemptConfig, AttemptOutcome, SuperviseError, run_attempt};
use kiln_run::{EventLog, event, exit, layout};
use kiln_topology::Host;
use serde_json::{Value, json};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use crate::backoff::Backoff;

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

/// Node scope: where hosts come from and go to.
pub struct NodeScope<'a> {
    /// Active and spare hosts.
    pub pool: HostPool,
    /// The scheduler's view of lost hosts.
    pub health: &'a dyn HostHealth,
    /// Quarantine files to append to (the run directory's, and an optional shared one).
    pub quarantine_files: Vec<PathBuf>,
    /// The batch job, for the quarantine entries.
    pub job_id: Option<String>,
}

/// Everything the loop needs beyond one attempt's config.
pub struct RetryConfig<'a> {
    /// The attempt template; `procs`, `log_path` and `expected_ranks` are set per attempt.
    pub attempt: AttemptConfig,
    /// The run directory.
    pub run_dir: PathBuf,
    /// Retry limit.
    pub limit: RetryLimit,
    /// Backoff.
    pub backoff: Backoff,
    /// Active and spare hosts, and where to record quarantined ones.
    pub scope: NodeScope<'a>,
    /// Whether failed hosts are swapped (node scope, `--auto-retry`/`--spares`); without it
    /// every attempt runs on the same hosts.
    pub swap_hosts: bool,
    /// With node scope, the crash or hang of a host that swaps it (`--strikes`).
    pub strikes: u32,
    /// Builds an attempt's processes for a set of hosts.
    pub planner: &'a dyn Fn(&[Host]) -> Result<AttemptPlan, PlanError>,
    /// Where events go.
    pub events: &'a mut EventLog,
    /// Signals kiln received.
    pub stop: &'a dyn Fn() -> Option<StopRequest>,
    /// Called with each finished attempt (for a one-line summary on stderr).
    pub on_attempt_end: &'a dyn Fn(u32, &AttemptOutcome, &Diagnosis),
    /// The slowest startup of the earlier jobs of this job's chain, which ran the same
    /// command: the startup watchdog then guards this job's first attempt too.
    pub prior_startup: Option<f64>,
}

/// The result of the whole launch.
#[derive(Debug, Clone)]
pub struct LaunchResult {
    /// The last attempt's outcome (its classification and exit code are kiln's).
    pub last: AttemptOutcome,
    /// How many attempts ran.
    pub attempts: u32,
    /// Why the loop stopped early, if it did (deterministic failure, hosts exhausted, ...).
    pub stop_reason: Option<String>,
    /// Hosts swapped out (culprit, replacement, blind).
    pub swaps: Vec<(String, String, bool)>,
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
        "start_step": o.start_step,
        "first_advance_time": o.first_advance_time,
        "last_advance_time": o.last_advance_time,
        "progress": o.progress,
        "culprit_ranks": o.culprits,
        "culprit_source": o.culprit_source,
        "rank_exits": o.rank_exits.iter().map(|r| json!({"rank": r.rank, "code": r.code, "signal": r.signal, "host": r.host, "time": r.time})).collect::<Vec<_>>(),
        "detect_s": o.detect_s,
        "kill_s": o.kill_s,
        "message": o.message,
    })
}

/// What to do after an attempt.
#[derive(Debug, Clone, PartialEq)]
pub enum Decision {
    /// The outcome is final (success, or not retryable, or the budget is spent).
    Finish,
    /// Stop early: `reason`, exiting with `code`.
    Stop {
        /// For the operator.
        reason: String,
        /// kiln's exit code.
        code: i32,
    },
    /// Run again, after replacing `replace` (culprits) on the way; `blind` when no evidence
    /// named them.
    Retry {
        /// Hosts to replace.
        replace: Vec<String>,
        /// Whether the replacement is a guess.
        blind: bool,
    },
}

/// What the loop remembers between attempts.
#[derive(Debug, Default, Clone)]
pub struct History {
    /// Attempts run so far.
    pub attempts: u32,
    /// The best progress of any attempt.
    pub best_progress: Option<u64>,
    /// Attempts in a row that got no further than `best_progress`.
    pub no_progress_streak: u32,
    /// Whether the previous attempt completed no step.
    pub previous_zero_step: bool,
    /// The previous failed attempt's error signature.
    pub previous_signature: Option<String>,
    /// The previous attempt's last step.
    pub previous_last_step: Option<u64>,
    /// Crashes and hangs each host was blamed for so far.
    pub strikes: std::collections::BTreeMap<String, u32>,
}

/// The policy, as a pure function of the attempt, its diagnosis and the history (which it
/// updates). `swap`: node scope's strike count (`--strikes`: a host blamed for a crash or a
/// hang is swapped at its Nth such failure), `None` without node scope. See `kiln launch
/// --help` for the rules in words.
pub fn decide(
    o: &AttemptOutcome,
    d: &Diagnosis,
    signature: Option<String>,
    limit: RetryLimit,
    swap: Option<u32>,
    h: &mut History,
) -> Decision {
    let node_failure = d.cause == "node-failure";
    let before = h.record(o, signature.clone(), node_failure);
    if !o.classification.retryable() {
        return Finish;
    }
    if swap.is_some()
        && !node_failure
        && let Some(stop) = deterministic(o, signature, &before)
    {
        return stop;
    }
    let retries_done = h.attempts - 1;
    let give_up = match limit {
        RetryLimit::Count(n) => retries_done >= n,
        RetryLimit::Auto => h.no_progress_streak >= AUTO_RETRY_NO_PROGRESS,
    };
    match swap {
        _ if give_up => Finish,
        None => Retry {
            replace: Vec::new(),
            blind: false,
        },
        Some(strikes) => spares(o, d, strikes, h),
    }
}

/// What [`History::record`] replaced: the previous attempt's facts.
struct Previous {
    zero_step: bool,
    signature: Option<String>,
    last_step: Option<u64>,
}

impl History {
    /// Counts attempt `o` (with its error `signature`) and returns the previous attempt's
    /// facts. A node that died says nothing about the program (`node_failure`): it is no
    /// evidence of a deterministic failure for the attempt after it.
    fn record(
        &mut self,
        o: &AttemptOutcome,
        signature: Option<String>,
        node_failure: bool,
    ) -> Previous {
        self.attempts += 1;
        let advanced_best = match (o.last_progress, self.best_progress) {
            (Some(now), Some(best)) => now > best,
            (Some(_), None) => true,
            (None, _) => false,
        };
        if advanced_best {
            self.best_progress = o.last_progress;
            self.no_progress_streak = 0;
        } else {
            self.no_progress_streak += 1;
        }
        let evidence = !node_failure;
        let zero_step = !o.advanced() && evidence;
        Previous {
            zero_step: std::mem::replace(&mut self.previous_zero_step, zero_step),
            signature: std::mem::replace(
                &mut self.previous_signature,
                signature.filter(|_| evidence),
            ),
            last_step: std::mem::replace(&mut self.previous_last_step, o.last_progress),
        }
    }
}

/// Node scope's stop for a failure that spares would not mend: two attempts in a row with no
/// step, or the same error again before any step or at the very step it happened before.
fn deterministic(
    o: &AttemptOutcome,
    signature: Option<String>,
    before: &Previous,
) -> Option<Decision> {
    if !o.advanced() && before.zero_step {
        return Some(Stop {
            reason: "two attempts in a row completed no step: the failure is deterministic; not using spares".into(),
            code: o.exit_code,
        });
    }
    let same_place = !o.advanced() || o.last_progress == before.last_step;
    let sig = signature.filter(|s| before.signature.as_ref() == Some(s) && same_place)?;
    Some(Stop {
        reason: format!("the same error twice in a row ({sig}): deterministic; not using spares"),
        code: o.exit_code,
    })
}

/// Node scope's retry: which hosts to swap for spares (`strikes`: a host blamed for a crash or
/// a hang is swapped at its Nth such failure).
fn spares(o: &AttemptOutcome, d: &Diagnosis, strikes: u32, h: &mut History) -> Decision {
    // A failure before any step is most often the program or its input: only a node that
    // died, a replica that disagreed or a straggler the user asked to treat as a node failure
    // justifies a spare then.
    let strong = matches!(
        d.cause.as_str(),
        "node-failure" | "replica-mismatch" | "straggler"
    );
    if !d.hosts.is_empty() && strong {
        return Retry {
            replace: d.hosts.clone(),
            blind: false,
        };
    }
    // A crash or a hang after progress: process scope first (the same hosts: most are the
    // process, not the node), the host swapped once it is blamed `strikes` times.
    if !d.hosts.is_empty() && o.advanced() {
        let strikes = strikes.max(1);
        let replace = d
            .hosts
            .iter()
            .filter(|host| {
                let n = h.strikes.entry((*host).clone()).or_insert(0);
                *n += 1;
                *n >= strikes
            })
            .cloned()
            .collect();
        return Retry {
            replace,
            blind: false,
        };
    }
    // No evidence: a failure after progress may be a bad host nobody named (swap one, as
    // a guess, counted as such); a preemption or a failure before any step is retried where
    // it ran.
    let guess = o.advanced()
        && matches!(
            o.classification,
            Classification::Failed
                | Classification::Signaled
                | Classification::HungSilent
                | Classification::HungStalled
        );
    Retry {
        replace: Vec::new(),
        blind: guess,
    }
}
use Decision::{Finish, Retry, Stop};

/// The last `n` bytes of a file (the end of a log holds the failure).
fn tail(path: &Path, n: u64) -> Vec<u8> {
    use std::io::{Read, Seek, SeekFrom};
    let Ok(mut f) = std::fs::File::open(path) else {
        return Vec::new();
    };
    let len = f.metadata().map(|m| m.len()).unwrap_or(0);
    let _ = f.seek(SeekFrom::Start(len.saturating_sub(n)));
    let mut buf = Vec::new();
    let _ = f.take(n).read_to_end(&mut buf);
    buf
}

/// Ranks and hosts named by the trainer's `replica_mismatch` events written during the
/// attempt.
fn mismatches(run_dir: &Path, since: f64) -> (Vec<usize>, Vec<String>) {
    let Ok(events) = kiln_run::read_events(run_dir) else {
        return (Vec::new(), Vec::new());
    };
    let (mut ranks, mut hosts) = (Vec::new(), Vec::new());
    for e in events
        .iter()
        .filter(|e| e.event == event::REPLICA_MISMATCH && e.time + 1.0 >= since)
    {
        let list = |k: &str| {
            e.fields
                .get(k)
                .and_then(Value::as_array)
                .cloned()
                .unwrap_or_default()
        };
        hosts.extend(
            list("hosts")
                .iter()
                .filter_map(|v| Some(v.as_str()?.to_string())),
        );
        ranks.extend(
            list("ranks")
                .iter()
                .filter_map(|v| Some(v.as_u64()? as usize)),
        );
    }
    (ranks, hosts)
}

/// Appends to the event log; a failed write is reported (tracing) but never stops the job:
/// losing a log line is better than losing the run.
struct Log<'a>(&'a mut EventLog);

impl Log<'_> {
    fn emit(&mut self, name: &str, fields: Value) {
        if let Err(e) = self.0.emit(name, fields) {
            tracing::warn!("{e}");
        }
    }
}

/// What recovery acts on across attempts: the event log, the host pool and quarantine files
/// (node scope), the swaps made so far, and the run directory. Its methods are the steps of
/// [`run_with_retries`] between two attempts.
struct Recovery<'a> {
    log: Log<'a>,
    scope: NodeScope<'a>,
    swaps: Vec<(String, String, bool)>,
    run_dir: PathBuf,
    /// Node scope is on: culprit hosts are swapped for spares.
    swap_hosts: bool,
}

impl Recovery<'_> {
    /// Names the culprit of a finished attempt (nothing to name after a success).
    fn diagnose(&self, outcome: &AttemptOutcome, plan: &AttemptPlan, log_tail: &[u8]) -> Diagnosis {
        if outcome.classification == Classification::Success {
            return Diagnosis {
                cause: "none".into(),
                hosts: Vec::new(),
                evidence: Vec::new(),
            };
        }
        let lost = if self.swap_hosts {
            self.scope.health.lost(&plan.hosts)
        } else {
            Vec::new()
        };
        let (mismatch_ranks, mismatch_hosts) = mismatches(&self.run_dir, outcome.start_time);
        diagnose(
            outcome,
            &Clues {
                log: log_tail,
                hosts: &plan.hosts,
                ppn: plan.sizes.ppn,
                lost,
                mismatch_ranks,
                mismatch_hosts,
            },
        )
    }

    /// Replaces each culprit by a spare (or drops it), recording swaps and quarantines. Returns
    /// the reason to stop when a host can be neither replaced nor dropped.
    fn replace_hosts(
        &mut self,
        attempt: u32,
        replace: &[String],
        blind: bool,
        cause: &str,
        diagnosis: &Diagnosis,
    ) -> Option<String> {
        for host in replace {
            let found: Vec<String> = diagnosis
                .evidence
                .iter()
                .filter(|e| &e.host == host)
                .map(|e| format!("{}: {}", e.source, e.detail))
                .collect();
            let evidence = if found.is_empty() {
                "no evidence named a host; rank 0's host swapped as a guess".to_string()
            } else {
                found.join("; ")
            };
            if blind && self.scope.pool.spares.is_empty() {
                return None; // a guess never shrinks the job
            }
            match self.scope.pool.replace(host) {
                Replacement::Swapped(with) => {
                    self.log.emit(
                        event::NODE_SWAP,
                        json!({"attempt": attempt, "host": host, "replacement": with, "cause": cause, "evidence": evidence, "blind": blind}),
                    );
                    eprintln!("kiln: swapping {host} for spare {with} ({cause}: {evidence})");
                    self.swaps.push((host.clone(), with, blind));
                }
                Replacement::Dropped => {
                    self.log.emit(
                        event::SHRINK,
                        json!({"attempt": attempt, "dropped": host, "cause": cause, "to": self.scope.pool.active.len()}),
                    );
                    eprintln!(
                        "kiln: no spare left; continuing without {host} on {} host(s)",
                        self.scope.pool.active.len()
                    );
                }
                Replacement::Exhausted => {
                    self.quarantine(host, cause, &evidence);
                    return Some(format!(
                        "no spare left to replace {host} ({cause}) and the job may not shrink below {} host(s)",
                        self.scope.pool.min_active
                    ));
                }
            }
            // A guess is not evidence: the host is set aside for this launch, not quarantined.
            if !blind {
                self.quarantine(host, cause, &evidence);
            }
        }
        None
    }

    /// Records `host` in every quarantine file and the event log.
    fn quarantine(&mut self, host: &str, cause: &str, evidence: &str) {
        let entry = QuarantineEntry {
            time: kiln_run::unix_time(),
            host: host.to_string(),
            cause: cause.to_string(),
            evidence: evidence.to_string(),
            job_id: self.scope.job_id.clone(),
            run_dir: Some(self.run_dir.clone()),
        };
        for f in &self.scope.quarantine_files {
            if let Err(e) = append_quarantine(f, &entry) {
                tracing::warn!("{e}");
                eprintln!("kiln: {e}");
            }
        }
        self.log.emit(
            event::QUARANTINE,
            json!({"host": host, "cause": cause, "evidence": evidence, "files": self.scope.quarantine_files}),
        );
    }

    /// Waits the backoff before the next attempt, after `streak` attempts in a row without
    /// new progress. Returns the outcome to end with when the walltime leaves no room for
    /// another attempt or a stop signal arrives meanwhile.
    fn wait_backoff(
        &mut self,
        (attempt, streak): (u32, u32),
        outcome: &AttemptOutcome,
        backoff: &Backoff,
        deadline: Option<Instant>,
        stop: &dyn Fn() -> Option<StopRequest>,
    ) -> Option<AttemptOutcome> {
        let delay = backoff.delay(streak);
        // No attempt can start after the walltime: stop now, resumable, instead of starting
        // one that would be killed at once.
        if deadline.is_some_and(|d| Instant::now() + delay >= d) {
            self.log.emit(
                event::STOPPED,
                json!({"attempt": attempt, "reason": "walltime"}),
            );
            let why = "walltime reached before the next attempt could start; not retrying";
            return Some(ended(
                outcome,
                Classification::Walltime,
                exit::PREEMPTED,
                why,
            ));
        }
        self.log.emit(
            event::BACKOFF,
            json!({"attempt": attempt, "seconds": delay.as_secs_f64(), "after": outcome.classification.name()}),
        );
        let when = if delay.is_zero() {
            "at once: it trained further than any attempt before it".to_string()
        } else {
            format!("in {:.1} s", delay.as_secs_f64())
        };
        eprintln!(
            "kiln: attempt {attempt} ended {} (exit {}); retrying {when}",
            outcome.classification.name(),
            outcome.exit_code,
        );
        let req = sleep_unless_stopped(delay, stop)?;
        self.log.emit(
            event::STOPPED,
            json!({"attempt": attempt, "signal": req.signal}),
        );
        let why = format!(
            "kiln received signal {} during backoff; not retrying",
            req.signal
        );
        Some(match req.signal {
            libc::SIGUSR1 => ended(outcome, Classification::Walltime, exit::PREEMPTED, &why),
            s => ended(outcome, Classification::Interrupted, 128 + s, &why),
        })
    }
}

/// `outcome`, ended as `classification` with `code` for `why` (recovery stopped after it).
fn ended(
    outcome: &AttemptOutcome,
    classification: Classification,
    code: i32,
    why: &str,
) -> AttemptOutcome {
    let mut last = outcome.clone();
    last.classification = classification;
    last.exit_code = code;
    last.message = Some(why.to_string());
    last
}

/// Sleeps `delay` in small steps, so that a stop signal ends kiln promptly: the new stop
/// request, if one came meanwhile.
fn sleep_unless_stopped(
    delay: Duration,
    stop: &dyn Fn() -> Option<StopRequest>,
) -> Option<StopRequest> {
    let seen = stop().map_or(0, |s| s.count);
    let until = Instant::now() + delay;
    while Instant::now() < until {
        if let Some(req) = stop()
            && req.count > seen
        {
            return Some(req);
        }
        std::thread::sleep(
            Duration::from_millis(20).min(until.saturating_duration_since(Instant::now())),
        );
    }
    None
}

/// Runs attempts with recovery (see the module docs).
pub fn run_with_retries(cfg: RetryConfig<'_>) -> Result<LaunchResult, SuperviseError> {
    let RetryConfig {
        attempt: template,
        run_dir,
        limit,
        backoff,
        scope,
        swap_hosts,
        strikes,
        planner,
        events,
        stop,
        on_attempt_end,
        prior_startup,
    } = cfg;
    let mut r = Recovery {
        log: Log(events),
        scope,
        swaps: Vec::new(),
        run_dir,
        swap_hosts,
    };
    let mut history = History::default();
    // The slowest startup (attempt start to first advance) so far: the startup watchdog's.
    let mut slowest_startup: Option<f64> = prior_startup;
    let end = |r: Recovery, last: AttemptOutcome, attempts, stop_reason| {
        Ok(LaunchResult {
            last,
            attempts,
            stop_reason,
            swaps: r.swaps,
        })
    };
    let mut attempt: u32 = 0;
    loop {
        attempt += 1;
        let plan = match planner(&r.scope.pool.active) {
            Ok(p) => p,
            Err(e) => {
                let o = AttemptOutcome::not_started(exit::USAGE, e.to_string());
                return end(r, o, attempt - 1, Some(e.to_string()));
            }
        };
        let (outcome, diagnosis, signature) =
            r.attempt(attempt, &template, &plan, slowest_startup, stop)?;
        on_attempt_end(attempt, &outcome, &diagnosis);
        if let Some(first) = outcome.first_advance_time {
            let took = first - outcome.start_time;
            slowest_startup = Some(slowest_startup.map_or(took, |s: f64| s.max(took)));
        }
        let swap = r.swap_hosts.then_some(strikes);
        let decision = decide(&outcome, &diagnosis, signature, limit, swap, &mut history);
        if let Some((last, reason)) = r.act(attempt, decision, &outcome, &diagnosis) {
            return end(r, last, attempt, reason);
        }
        let streak = history.no_progress_streak;
        let waited = r.wait_backoff(
            (attempt, streak),
            &outcome,
            &backoff,
            template.deadline,
            stop,
        );
        if let Some(last) = waited {
            return end(r, last, attempt, None);
        }
    }
}

impl Recovery<'_> {
    /// Runs attempt number `attempt` of `template` on `plan`, with its events: its outcome,
    /// the culprit named, and its error's signature when it failed.
    fn attempt(
        &mut self,
        attempt: u32,
        template: &AttemptConfig,
        plan: &AttemptPlan,
        slowest_startup: Option<f64>,
        stop: &dyn Fn() -> Option<StopRequest>,
    ) -> Result<(AttemptOutcome, Diagnosis, Option<String>), SuperviseError> {
        let log_name = layout::attempt_log(attempt);
        if let Some((path, text)) = &plan.hostfile_to_write
            && let Err(e) = std::fs::write(path, text)
        {
            tracing::warn!("writing {}: {e}", path.display());
        }
        let mut cfg = template.clone();
        cfg.log_path = self.run_dir.join(&log_name);
        cfg.procs = plan.procs.clone();
        cfg.attempt = Some(plan.attempt.clone());
        cfg.expected_ranks = Some(plan.sizes.np);
        if cfg.startup_auto {
            cfg.startup_timeout = crate::stall::startup_limit(slowest_startup);
        }
        let argv: Vec<Vec<String>> = cfg.procs.iter().map(|p| p.argv.clone()).collect();
        self.log.emit(
            event::ATTEMPT_START,
            json!({"attempt": attempt, "argv": argv, "hosts": plan.hosts, "spares": self.scope.pool.spare_names(), "np": plan.sizes.np, "log": log_name}),
        );
        let outcome = run_attempt(&cfg, stop)?;
        // The Open MPI segments of ranks that did not finalise, on this host (the other
        // hosts' go when the launch ends: see `kiln_run::node_state`).
        if let Some(dir) = &cfg.progress_dir {
            kiln_run::node_state::release_mpi(dir, kiln_run::this_host());
        }
        // This host's control-plane directories of the attempt, left when an agent was
        // killed with its rank (the other hosts' go at the launch's end or with the next
        // agent there: see `plane::node::sweep`).
        if let Some(plane) = &cfg.plane {
            let me = kiln_run::this_host();
            let here = plan.hosts.iter().map(String::as_str);
            let here: std::collections::BTreeSet<&str> = (here
                .filter(|h| crate::pool::same_host(h, me)))
            .chain([me])
            .collect();
            crate::plane::node::remove_unused(plane.secret(), &plan.attempt, here);
        }
        let log_tail = tail(&cfg.log_path, 256 * 1024);
        let diagnosis = self.diagnose(&outcome, plan, &log_tail);
        let mut fields = outcome_json(attempt, &argv, &plan.hosts, &log_name, &outcome);
        if let Some(obj) = fields.as_object_mut() {
            obj.insert("cause".into(), json!(diagnosis.cause));
            obj.insert("culprit_hosts".into(), json!(diagnosis.hosts));
            obj.insert("evidence".into(), json!(diagnosis.evidence));
        }
        self.log.emit(event::ATTEMPT_END, fields);
        let signature = (outcome.classification != Classification::Success)
            .then(|| error_signature(&log_tail))
            .flatten();
        Ok((outcome, diagnosis, signature))
    }

    /// Carries out `decision` on attempt `attempt`: swaps the hosts a retry replaces. Returns
    /// the outcome to end the run with and why, or `None` to go on after the backoff.
    fn act(
        &mut self,
        attempt: u32,
        decision: Decision,
        outcome: &AttemptOutcome,
        diagnosis: &Diagnosis,
    ) -> Option<(AttemptOutcome, Option<String>)> {
        let stop_with = |code, reason: String| {
            let mut last = outcome.clone();
            last.exit_code = code;
            Some((last, Some(reason)))
        };
        let (replace, blind) = match decision {
            Finish => return Some((outcome.clone(), None)),
            Stop { reason, code } => {
                self.log.emit(
                    event::STOPPED,
                    json!({"attempt": attempt, "reason": reason, "exit_code": code}),
                );
                return stop_with(code, reason);
            }
            Retry { replace, blind } => (replace, blind),
        };
        // A guess swaps rank 0's host: it does the most besides training (I/O, logging).
        let (replace, cause) = if blind {
            let first = self.scope.pool.active_names().into_iter().take(1).collect();
            (first, outcome.classification.name())
        } else {
            (replace, diagnosis.cause.as_str())
        };
        let reason = self.replace_hosts(attempt, &replace, blind, cause, diagnosis)?;
        self.log.emit(
            event::STOPPED,
            json!({"attempt": attempt, "reason": reason, "exit_code": exit::NODES_EXHAUSTED}),
        );
        stop_with(exit::NODES_EXHAUSTED, reason)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_doubles_to_the_cap() {
        let b = Backoff::default();
        let secs: Vec<u64> = (0..=6).map(|r| b.delay(r).as_secs()).collect();
        assert_eq!(secs, [0, 5, 10, 20, 40, 60, 60]);
        let b = Backoff::parse("0.5,1.5").unwrap();
        assert_eq!(b.delay(3), Duration::from_millis(1500));
        assert_eq!(Backoff::parse("2").unwrap().cap, Duration::from_secs(24));
        assert!(Backoff::parse("x").is_err());
        assert!(Backoff::parse("5,1").is_err());
        assert!(Backoff::parse("-1").is_err());
        assert!(Backoff::parse("1e300").is_err());
        assert_eq!(b.delay(u32::MAX), Duration::from_millis(1500));
    }

    fn outcome(class: Classification, code: i32, advanced: bool) -> AttemptOutcome {
        let mut o = AttemptOutcome::not_started(code, String::new());
        o.classification = class;
        if advanced {
            o.first_advance_time = Some(1.0);
            o.last_progress = Some(5);
        }
        o
    }

    fn diag(cause: &str, hosts: &[&str]) -> Diagnosis {
        Diagnosis {
            cause: cause.into(),
            hosts: hosts.iter().map(|h| h.to_string()).collect(),
            evidence: Vec::new(),
        }
    }

    /// Node scope swapping a blamed host at its first crash or hang.
    const AT_ONCE: Option<u32> = Some(1);

    /// A straggler's host is swapped at once, even where strikes would wait for a crash's
    /// third time: the user asked for it to be a node failure.
    #[test]
    fn a_straggler_is_swapped_at_once() {
        let mut h = History::default();
        let d = decide(
            &outcome(Classification::Straggler, 75, true),
            &diag("straggler", &["n3"]),
            None,
            RetryLimit::Auto,
            Some(3),
            &mut h,
        );
        assert_eq!(
            d,
            Retry {
                replace: vec!["n3".to_string()],
                blind: false
            }
        );
    }

    #[test]
    fn policy() {
        let auto = RetryLimit::Auto;
        // A named culprit is replaced.
        let mut h = History::default();
        let d = decide(
            &outcome(Classification::Failed, 1, true),
            &diag("node-failure", &["n2"]),
            None,
            auto,
            AT_ONCE,
            &mut h,
        );
        assert_eq!(
            d,
            Retry {
                replace: vec!["n2".into()],
                blind: false
            }
        );
        // Deterministic exit codes finish at once.
        let mut h = History::default();
        let d = decide(
            &outcome(Classification::Deterministic, 78, false),
            &diag("unknown", &[]),
            None,
            auto,
            AT_ONCE,
            &mut h,
        );
        assert_eq!(d, Finish);
        // Two zero-step attempts stop without spares; the first is retried in place.
        let mut h = History::default();
        let o = outcome(Classification::Failed, 1, false);
        assert_eq!(
            decide(&o, &diag("unknown", &[]), None, auto, AT_ONCE, &mut h),
            Retry {
                replace: vec![],
                blind: false
            }
        );
        assert!(matches!(
            decide(&o, &diag("unknown", &[]), None, auto, AT_ONCE, &mut h),
            Stop { code: 1, .. }
        ));
        // A crash before any step names no host worth a spare: retried in place.
        let mut h = History::default();
        assert_eq!(
            decide(&o, &diag("crash", &["n1"]), None, auto, AT_ONCE, &mut h),
            Retry {
                replace: vec![],
                blind: false
            }
        );
        // ... unless a node died: that is never the program's fault.
        let mut h = History {
            previous_zero_step: true,
            ..History::default()
        };
        assert!(matches!(
            decide(
                &o,
                &diag("node-failure", &["n3"]),
                None,
                auto,
                AT_ONCE,
                &mut h
            ),
            Retry { .. }
        ));
        // ... nor after one: a node that died at startup, then a start that hangs, is retried.
        let mut h = History::default();
        let zero = outcome(Classification::Failed, 137, false);
        let hung = outcome(Classification::HungSilent, 124, false);
        let died = decide(
            &zero,
            &diag("node-failure", &["n2"]),
            None,
            auto,
            AT_ONCE,
            &mut h,
        );
        assert!(matches!(died, Retry { .. }), "{died:?}");
        let then = decide(&hung, &diag("hang", &[]), None, auto, AT_ONCE, &mut h);
        assert!(matches!(then, Retry { .. }), "{then:?}");
        // The same error twice after a swap is the program's.
        let mut h = History::default();
        let sig = Some("ValueError: x".to_string());
        let o = outcome(Classification::Failed, 1, false);
        let _ = decide(
            &outcome(Classification::Failed, 1, true),
            &diag("crash", &["n1"]),
            sig.clone(),
            auto,
            AT_ONCE,
            &mut h,
        );
        assert!(matches!(
            decide(
                &o,
                &diag("crash", &["n4"]),
                sig.clone(),
                auto,
                AT_ONCE,
                &mut h
            ),
            Stop { .. }
        ));
        // The same error at the same step after a swap is the program's, even with progress.
        let mut h = History::default();
        let at = |step| {
            let mut o = outcome(Classification::ReplicaMismatch, 76, true);
            o.last_progress = Some(step);
            o
        };
        let _ = decide(
            &at(40),
            &diag("replica-mismatch", &["n2"]),
            sig.clone(),
            auto,
            AT_ONCE,
            &mut h,
        );
        assert!(matches!(
            decide(
                &at(40),
                &diag("replica-mismatch", &["n4"]),
                sig.clone(),
                auto,
                AT_ONCE,
                &mut h
            ),
            Stop { .. }
        ));
        // No evidence after progress: a blind swap; a preemption: retried in place.
        let mut h = History::default();
        assert_eq!(
            decide(
                &outcome(Classification::HungStalled, 124, true),
                &diag("unknown", &[]),
                None,
                auto,
                AT_ONCE,
                &mut h
            ),
            Retry {
                replace: vec![],
                blind: true
            }
        );
        assert_eq!(
            decide(
                &outcome(Classification::Preempted, 75, true),
                &diag("unknown", &[]),
                None,
                auto,
                AT_ONCE,
                &mut h
            ),
            Retry {
                replace: vec![],
                blind: false
            }
        );
        // Process scope only: never a swap; the count is respected.
        let mut h = History::default();
        let o = outcome(Classification::Failed, 1, true);
        assert_eq!(
            decide(
                &o,
                &diag("crash", &["n2"]),
                None,
                RetryLimit::Count(1),
                None,
                &mut h
            ),
            Retry {
                replace: vec![],
                blind: false
            }
        );
        assert_eq!(
            decide(
                &o,
                &diag("crash", &["n2"]),
                None,
                RetryLimit::Count(1),
                None,
                &mut h
            ),
            Finish
        );
    }

    #[test]
    fn a_crash_or_hang_is_retried_in_place_until_its_host_has_struck_out() {
        let mut h = History::default();
        // Every attempt gets further than the last (else --auto-retry would give up).
        let mut step = 0;
        let mut next = |class, cause: &str, host: &str| {
            let mut o = outcome(class, 1, true);
            step += 10;
            o.last_progress = Some(step);
            match decide(
                &o,
                &diag(cause, &[host]),
                None,
                RetryLimit::Auto,
                Some(2),
                &mut h,
            ) {
                Retry { replace, blind } if !blind => replace,
                other => panic!("{other:?}"),
            }
        };
        // First strikes of n1 and n2: process scope, the same hosts.
        assert!(next(Classification::Failed, "crash", "n1").is_empty());
        assert!(next(Classification::HungSilent, "hang", "n2").is_empty());
        // n1 again (a hang this time): its second strike swaps it.
        assert_eq!(next(Classification::HungSilent, "hang", "n1"), ["n1"]);
        // A node failure or a replica mismatch swaps at once, strikes or not.
        assert_eq!(next(Classification::Failed, "node-failure", "n3"), ["n3"]);
        assert_eq!(
            next(Classification::ReplicaMismatch, "replica-mismatch", "n4"),
            ["n4"]
        );
    }
}

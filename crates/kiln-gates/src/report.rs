//! What happened to a run, from its files: `metrics.jsonl` (step and eval lines),
//! `events.jsonl` and `checkpoints/step-N`. Backs `kiln status` and `kiln plot`.

use crate::plot::{Panel, Series, write_plots};
use crate::{GatesError, io_err};
use kiln_run::{event, layout};
use serde_json::{Map, Value};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// A step line of `metrics.jsonl`.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct StepLine {
    /// Step.
    pub step: u64,
    /// Training loss.
    pub loss: f64,
    /// Gradient norm.
    pub grad_norm: f64,
    /// Learning rate.
    pub lr: f64,
    /// Tokens per second.
    pub tokens_per_s: f64,
    /// Tokens seen so far.
    pub tokens_seen: u64,
}

/// An eval line of `metrics.jsonl`: `eval_loss` and every other number on it (for example
/// `eval_accuracy`, `unigram_loss`, multiple-choice `mc_acc`).
#[derive(Debug, Clone, PartialEq, Default)]
pub struct EvalLine {
    /// Step.
    pub step: u64,
    /// Numbers by key (includes `eval_loss`).
    pub values: BTreeMap<String, f64>,
}

/// Parsed `metrics.jsonl`.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Metrics {
    /// Step lines, in file order (a resumed run may repeat steps).
    pub steps: Vec<StepLine>,
    /// Eval lines, in file order.
    pub evals: Vec<EvalLine>,
}

fn num(obj: &Map<String, Value>, key: &str) -> f64 {
    obj.get(key).and_then(Value::as_f64).unwrap_or(f64::NAN)
}

/// Reads `RUN_DIR/metrics.jsonl` (absent: empty), a line at most [`kiln_run::jsonl::MAX_LINE_BYTES`]
/// long in memory. A torn last line is skipped; any other malformed line is an
/// error naming it. Lines that are neither step nor eval lines are ignored.
pub fn read_metrics(run_dir: &Path) -> Result<Metrics, GatesError> {
    let path = run_dir.join(layout::METRICS);
    let parse = |line: &str| match serde_json::from_str::<Value>(line) {
        Ok(Value::Object(o)) => Ok(Some(o)),
        Ok(_) | Err(_) => Err("not a JSON object".to_string()),
    };
    let lines = kiln_run::jsonl::read_jsonl(&path, kiln_run::jsonl::MAX_LINE_BYTES, parse)
        .map_err(|e| match e {
            kiln_run::jsonl::JsonlError::Io(e) => io_err(&path)(e),
            kiln_run::jsonl::JsonlError::Line { line, message } => GatesError::Parse {
                path: path.clone(),
                line,
                message,
            },
        })?;
    let mut m = Metrics::default();
    for obj in lines {
        let step = obj.get("step").and_then(Value::as_u64).unwrap_or(0);
        if obj.contains_key("step_time_s") {
            m.steps.push(StepLine {
                step,
                loss: num(&obj, "loss"),
                grad_norm: num(&obj, "grad_norm"),
                lr: num(&obj, "lr"),
                tokens_per_s: num(&obj, "tokens_per_s"),
                tokens_seen: obj.get("tokens_seen").and_then(Value::as_u64).unwrap_or(0),
            });
        } else if obj.contains_key("eval_loss") {
            let values = obj
                .iter()
                .filter(|(k, _)| k.as_str() != "step")
                .filter_map(|(k, v)| Some((k.clone(), v.as_f64()?)))
                .collect();
            m.evals.push(EvalLine { step, values });
        }
    }
    Ok(m)
}

/// Events that guards and recovery write, counted by `kiln status`.
pub const GUARD_EVENTS: &[&str] = &[
    event::INITIAL_LOSS_OK,
    event::INITIAL_LOSS_ERROR,
    event::NONFINITE_SKIP,
    event::LOSS_SPIKE,
    event::ROLLBACK,
    event::SPIKE_SKIP,
    event::FROZEN_PARAMS,
    event::CHECKPOINT_REJECTED,
    event::CONFIG_CHANGED,
];

fn check_run_dir(run_dir: &Path) -> Result<(), GatesError> {
    if !run_dir.is_dir() {
        return Err(GatesError::Invalid(format!(
            "{}: no such run directory",
            run_dir.display()
        )));
    }
    if !run_dir.join(layout::METRICS).exists() && !run_dir.join(layout::EVENTS).exists() {
        return Err(GatesError::Invalid(format!(
            "{}: not a run directory (no metrics.jsonl or events.jsonl); give the --run-dir of `kiln train`",
            run_dir.display()
        )));
    }
    Ok(())
}

fn fmt_value(v: &Value) -> String {
    match v {
        Value::String(s) => s.clone(),
        Value::Array(a) => a.iter().map(fmt_value).collect::<Vec<_>>().join(","),
        other => other.to_string(),
    }
}

/// The metrics and events of the run in `run_dir`, and its planned total steps.
fn read_run(run_dir: &Path) -> Result<(Metrics, Vec<kiln_run::Event>, Option<u64>), GatesError> {
    check_run_dir(run_dir)?;
    let metrics = if run_dir.join(layout::METRICS).exists() {
        read_metrics(run_dir)?
    } else {
        Metrics::default()
    };
    let events = kiln_run::read_events(run_dir)?;
    let total = events
        .iter()
        .rev()
        .find(|e| e.event == event::START)
        .and_then(|e| e.fields.get("total_steps").and_then(Value::as_u64));
    Ok((metrics, events, total))
}

/// `kiln status --json`: the step reached, the total, ETTR and the goodput ledger (buckets,
/// attempts, faults with their detection time, resume tier and lost work, swaps, timeline
/// spans) as one JSON object.
pub fn status_json(run_dir: &Path) -> Result<Value, GatesError> {
    let (metrics, events, total) = read_run(run_dir)?;
    let l = kiln_run::ledger::ledger(&events);
    Ok(serde_json::json!({
        "run_dir": run_dir.display().to_string(),
        "step": metrics.steps.last().map(|s| s.step),
        "total_steps": total,
        "ettr": l.ettr(),
        "ledger": l,
    }))
}

/// The text of `kiln status RUN_DIR`.
pub fn status(run_dir: &Path) -> Result<String, GatesError> {
    let (metrics, events, total) = read_run(run_dir)?;
    let mut out = format!("run: {}\n", run_dir.display());
    out.push_str(&progress_lines(&metrics, total));
    out.push_str(&eval_line(&metrics));
    out.push_str(&checkpoints_line(run_dir));
    out.push_str(&memory_tier_line(run_dir));
    out.push_str(&event_lines(&events, saved_checkpoints(run_dir, &events)));
    out.push_str(&goodput(&events));
    Ok(out)
}

/// The steps done and the last step's metrics.
fn progress_lines(metrics: &Metrics, total: Option<u64>) -> String {
    let of = total.map_or(String::new(), |t| format!(" of {t}"));
    let Some(s) = metrics.steps.last() else {
        return format!("steps: 0{of}  (no step metrics yet)\n");
    };
    format!(
        "steps: {}{of}  tokens: {}\nlast loss: {:.4} (step {}), grad_norm {:.3}, lr {:.3e}, {:.0} tokens/s\n",
        s.step, s.tokens_seen, s.loss, s.step, s.grad_norm, s.lr, s.tokens_per_s
    )
}

/// The last evaluation's values.
fn eval_line(metrics: &Metrics) -> String {
    let Some(e) = metrics.evals.last() else {
        return "last eval: none\n".into();
    };
    let rest: Vec<String> = e
        .values
        .iter()
        .filter(|(k, _)| k.as_str() != "eval_loss")
        .map(|(k, v)| format!("{k} {v:.4}"))
        .collect();
    format!(
        "last eval: step {}: eval_loss {:.4}{}{}\n",
        e.step,
        e.values.get("eval_loss").copied().unwrap_or(f64::NAN),
        if rest.is_empty() { "" } else { ", " },
        rest.join(", ")
    )
}

/// The checkpoints on disk, newest first, and whether the final weights are there.
fn checkpoints_line(run_dir: &Path) -> String {
    let mut steps = kiln_train::checkpoint::list_steps(&run_dir.join(layout::CHECKPOINTS));
    steps.reverse();
    let names: Vec<String> = steps
        .iter()
        .map(|s| kiln_train::checkpoint::dir_name(*s))
        .collect();
    let list = if names.is_empty() {
        "none".to_string()
    } else {
        names.join(", ")
    };
    let final_weights = match run_dir.join(layout::FINAL_MODEL).exists() {
        true => "; final weights: model.safetensors",
        false => "",
    };
    format!("checkpoints: {list}{final_weights}\n")
}

/// The run's memory tier on this host (in the snapshot directory of its `config.toml`):
/// what it holds, and whether a later kiln start would reclaim it.
fn memory_tier_line(run_dir: &Path) -> String {
    let config = std::fs::read_to_string(run_dir.join(layout::CONFIG)).unwrap_or_default();
    let table: toml::Table = toml::from_str(&config).unwrap_or_default();
    let dir = table
        .get("checkpoint")
        .and_then(|c| c.get("snapshot_dir"))
        .and_then(toml::Value::as_str)
        .unwrap_or_default();
    let folder = kiln_train::components::checkpoints::snapshot::run_folder(dir, run_dir);
    let host = kiln_run::host_name();
    match kiln_train::components::checkpoints::snapshot::tiers::Held::of(&folder) {
        Some(held) => format!("memory tier on {host}: {}\n", held.describe()),
        None => format!("memory tier on {host}: none\n"),
    }
}

/// How many persistent checkpoints the run saved: the steps of its `checkpoint_saved`
/// events, and of the checkpoints that are on disk or that an attempt resumed from without
/// such an event (a rank killed after the checkpoint was published but before the event was
/// written), each counted once.
fn saved_checkpoints(run_dir: &Path, events: &[kiln_run::Event]) -> usize {
    let step = |e: &kiln_run::Event| e.fields.get("step").and_then(Value::as_u64);
    let persistent_resume = |e: &&kiln_run::Event| {
        e.event == event::RESUME
            && e.fields
                .get("tier")
                .and_then(Value::as_str)
                .is_none_or(|t| t == event::tier::PERSISTENT)
    };
    let mut steps: std::collections::BTreeSet<u64> = events
        .iter()
        .filter(|e| e.event == event::CHECKPOINT_SAVED)
        .chain(events.iter().filter(persistent_resume))
        .filter_map(step)
        .collect();
    steps.extend(kiln_train::checkpoint::list_steps(
        &run_dir.join(layout::CHECKPOINTS),
    ));
    steps.len()
}

/// Counts of starts, resumes and saves (`saved`: see [`saved_checkpoints`]), the guards'
/// events (the last five in full), and the last exit.
fn event_lines(events: &[kiln_run::Event], saved: usize) -> String {
    let mut counts: BTreeMap<&str, usize> = BTreeMap::new();
    for e in events {
        *counts.entry(e.event.as_str()).or_default() += 1;
    }
    let count = |name: &str| counts.get(name).copied().unwrap_or(0);
    let mut out = format!(
        "attempts: {} start(s), {} resume(s), {} checkpoint(s) saved\n",
        count(event::START),
        count(event::RESUME),
        saved
    );
    let guards: Vec<String> = GUARD_EVENTS
        .iter()
        .filter_map(|g| counts.get(g).map(|n| format!("{g} x{n}")))
        .collect();
    let guards = if guards.is_empty() {
        "none".to_string()
    } else {
        guards.join(", ")
    };
    out.push_str(&format!("guard events: {guards}\n"));
    let shown = |e: &&kiln_run::Event| {
        GUARD_EVENTS.contains(&e.event.as_str()) && e.event != event::INITIAL_LOSS_OK
    };
    let recent: Vec<&kiln_run::Event> = events.iter().filter(shown).collect();
    for e in &recent[recent.len().saturating_sub(5)..] {
        let fields: Vec<String> = e
            .fields
            .iter()
            .map(|(k, v)| format!("{k}={}", fmt_value(v)))
            .collect();
        out.push_str(&format!("  {}: {}\n", e.event, fields.join(" ")));
    }
    let field = |e: &kiln_run::Event, k: &str| e.fields.get(k).map_or("?".into(), fmt_value);
    match events.iter().rev().find(|e| e.event == event::EXIT) {
        Some(e) => out.push_str(&format!(
            "last exit: {} (code {}) at step {}\n",
            field(e, "reason"),
            field(e, "code"),
            field(e, "step"),
        )),
        None => out.push_str("last exit: none recorded (running, or killed without a trace)\n"),
    }
    out
}

/// The goodput ledger, attempts, swaps and quarantined hosts, as text.
fn goodput(events: &[kiln_run::Event]) -> String {
    let l = kiln_run::ledger::ledger(events);
    if l.total <= 0.0 {
        return String::new();
    }
    let mut out = format!(
        "goodput: ETTR {:.1} % of {:.1} s wall ({} job(s), {} attempt(s), {} step(s) redone)\n",
        l.ettr() * 100.0,
        l.total,
        l.jobs,
        l.attempts.len(),
        l.lost_steps
    );
    for (name, secs) in l.buckets.rows() {
        out.push_str(&format!(
            "  {name:<17} {secs:>10.1} s {:>6.1} %\n",
            100.0 * secs / l.total
        ));
    }
    if l.attempts.len() > 1 || l.attempts.iter().any(|a| a.classification != "success") {
        out.push_str("attempts:\n");
        for (i, a) in l.attempts.iter().enumerate() {
            out.push_str(&attempt_line(i + 1, a));
        }
    }
    out.push_str(&crate::recovery::fault_lines(&l));
    out.push_str(&swaps_line(&l.swaps));
    out.push_str(&recovery_lines(events));
    out
}

/// Attempt number `n`: its span, ending, steps, culprit, resume, lost steps, hosts and
/// startup phases.
fn attempt_line(n: usize, a: &kiln_run::ledger::AttemptSummary) -> String {
    let steps = match a.steps {
        (Some(s), Some(e)) => format!(", steps {s}-{e}"),
        (None, Some(e)) => format!(", to step {e}"),
        _ => String::new(),
    };
    let mut culprit = if a.culprits.is_empty() {
        String::new()
    } else {
        format!(", culprit {}", a.culprits.join(","))
    };
    if let Some(tier) = &a.resumed_from {
        culprit.push_str(&format!(", resumed from {tier}"));
    }
    if let Some(n) = a.lost_steps {
        culprit.push_str(&format!(", {n} step(s) lost"));
    }
    let hosts = if a.hosts.is_empty() {
        String::new()
    } else {
        format!("  on {}", a.hosts.join(","))
    };
    let mut out = format!(
        "  {n:>3}  {:>8.1}-{:<8.1} s  {}{steps}{culprit}{hosts}\n",
        a.from, a.to, a.classification,
    );
    out.extend(phases_line(&a.phases));
    out
}

/// The node swaps, named and blind (nothing when there were none).
fn swaps_line(swaps: &[kiln_run::ledger::Swap]) -> String {
    if swaps.is_empty() {
        return String::new();
    }
    let list: Vec<String> = swaps
        .iter()
        .map(|s| {
            format!(
                "{} -> {} ({}{})",
                s.host,
                s.replacement.as_deref().unwrap_or("dropped"),
                s.cause,
                if s.blind { ", blind" } else { "" }
            )
        })
        .collect();
    let blind = swaps.iter().filter(|s| s.blind).count();
    format!(
        "node swaps: {} ({} named, {blind} blind): {}\n",
        swaps.len(),
        swaps.len() - blind,
        list.join(", ")
    )
}

/// The hosts quarantined, why recovery stopped and where the job chain stands, where the
/// events say.
fn recovery_lines(events: &[kiln_run::Event]) -> String {
    let mut out = String::new();
    let mut quarantined: Vec<String> = events
        .iter()
        .filter(|e| e.event == event::QUARANTINE)
        .filter_map(|e| {
            Some(format!(
                "{} ({})",
                e.fields.get("host")?.as_str()?,
                e.fields.get("cause").and_then(Value::as_str).unwrap_or("?")
            ))
        })
        .collect();
    quarantined.dedup();
    if !quarantined.is_empty() {
        out.push_str(&format!("quarantined: {}\n", quarantined.join(", ")));
    }
    let stragglers: Vec<String> = events
        .iter()
        .filter(|e| e.event == event::STRAGGLER)
        .map(|e| {
            let f = |k: &str| e.fields.get(k).map_or("?".into(), fmt_value);
            let cost = e.fields.get("cost").and_then(Value::as_f64);
            let cost = cost.map_or(String::new(), |c| {
                format!(", costing the job {:.0} % of its speed", c * 100.0)
            });
            format!(
                "rank {} on {} at step {}: {} x its peers ({} s against {} s a step){cost}",
                f("rank"),
                f("host"),
                f("step"),
                f("ratio"),
                f("work_s"),
                f("peers_s")
            )
        })
        .collect();
    if !stragglers.is_empty() {
        out.push_str(&format!("stragglers: {}\n", stragglers.join("; ")));
    }
    let last = |name: &str| events.iter().rev().find(|e| e.event == name);
    let field = |e: &kiln_run::Event, k: &str| e.fields.get(k).map_or("?".into(), fmt_value);
    if let Some(e) = last(event::STOPPED) {
        out.push_str(&format!("recovery stopped: {}\n", field(e, "reason")));
    }
    if let Some(e) = last(event::CHAIN) {
        out.push_str(&format!(
            "chain: job {} of {}: {}\n",
            field(e, "chain_index"),
            field(e, "chain_limit"),
            field(e, "reason")
        ));
    }
    out
}

/// The panels of a run's curves: loss (train, eval, and the unigram baseline when it was
/// measured), eval accuracies, learning rate, gradient norm and tokens/s, over steps.
fn curve_panels(m: &Metrics) -> Vec<Panel> {
    let step_series = |name: &str, f: fn(&StepLine) -> f64| Series {
        name: name.into(),
        points: m.steps.iter().map(|s| (s.step as f64, f(s))).collect(),
    };
    let eval_series = |key: &str| Series {
        name: key.into(),
        points: m
            .evals
            .iter()
            .filter_map(|e| Some((e.step as f64, *e.values.get(key)?)))
            .collect(),
    };
    let mut keys: Vec<&String> = m.evals.iter().flat_map(|e| e.values.keys()).collect();
    keys.sort();
    keys.dedup();
    let mut loss = vec![
        step_series("train loss", |s| s.loss),
        eval_series("eval_loss"),
    ];
    if keys.iter().any(|k| *k == "unigram_loss") {
        loss.push(eval_series("unigram_loss"));
    }
    let acc = keys.iter().filter(|k| k.contains("acc"));
    let panel = |title: &str, series: Vec<Series>| Panel {
        title: title.into(),
        x_label: "step".into(),
        series,
        ..Default::default()
    };
    vec![
        panel("loss (nats/token)", loss),
        panel("eval accuracy", acc.map(|k| eval_series(k)).collect()),
        panel("learning rate", vec![step_series("lr", |s| s.lr)]),
        panel(
            "gradient norm (before clipping)",
            vec![step_series("grad_norm", |s| s.grad_norm)],
        ),
        panel(
            "tokens/s",
            vec![step_series("tokens/s", |s| s.tokens_per_s)],
        ),
    ]
}

/// Draws a run's curves (loss and eval loss, eval accuracies, LR, gradient norm, tokens/s)
/// to `out_stem.svg` and `out_stem.png` (default stem: `RUN_DIR/plots/curves`), and, when the
/// run was launched by `kiln launch`, its timeline (attempts, failures, swaps, the goodput
/// ledger) to `<stem dir>/timeline.svg` and `.png`. Returns every file written.
pub fn plot_run(run_dir: &Path, out_stem: Option<&Path>) -> Result<Vec<PathBuf>, GatesError> {
    check_run_dir(run_dir)?;
    let stem = out_stem.map_or_else(
        || run_dir.join(kiln_run::layout::PLOTS).join("curves"),
        Path::to_path_buf,
    );
    let mut written = Vec::new();
    let events = kiln_run::read_events(run_dir)?;
    let l = kiln_run::ledger::ledger(&events);
    if !l.attempts.is_empty() && l.total > 0.0 {
        let t = stem.with_file_name("timeline");
        let (svg, png) =
            crate::plot::write_timeline(&t, &format!("kiln run {}", run_dir.display()), &l)?;
        written.extend([svg, png]);
    }
    let has_metrics = run_dir.join(kiln_run::layout::METRICS).exists();
    let m = if has_metrics {
        read_metrics(run_dir)?
    } else {
        Metrics::default()
    };
    if m.steps.is_empty() && m.evals.is_empty() {
        if !written.is_empty() {
            return Ok(written);
        }
        return Err(GatesError::Invalid(format!(
            "{}: metrics.jsonl has no step or eval lines yet",
            run_dir.join(kiln_run::layout::METRICS).display()
        )));
    }
    let panels = curve_panels(&m);
    let (svg, png) = write_plots(
        &stem,
        &format!("kiln run {}", run_dir.display()),
        &panels,
        3,
    )?;
    written.extend([svg, png]);
    Ok(written)
}

/// `       startup: spawn 0.1 s, mpi_init 0.3 s, ... (largest: mpi_init)` for an attempt.
fn phases_line(phases: &[(String, f64)]) -> Option<String> {
    let largest = phases.iter().max_by(|a, b| a.1.total_cmp(&b.1))?;
    let each: Vec<String> = phases
        .iter()
        .map(|(n, v)| format!("{n} {v:.2} s"))
        .collect();
    Some(format!(
        "       startup: {} (largest: {})\n",
        each.join(", "),
        largest.0
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn metrics_lines_are_sorted_into_steps_and_evals() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(
            dir.path().join("metrics.jsonl"),
            "{\"step\":1,\"loss\":2.5,\"grad_norm\":1.0,\"lr\":0.001,\"tokens_per_s\":100.0,\"step_time_s\":0.1,\"mfu\":0.0,\"rss_mib\":10.0,\"tokens_seen\":64}\n\
             {\"step\":1,\"eval_loss\":2.4,\"eval_accuracy\":0.0,\"unigram_loss\":2.1}\n\
             {\"step\":2,\"loss\":2.",
        )
        .unwrap();
        let m = read_metrics(dir.path()).unwrap();
        assert_eq!(m.steps.len(), 1);
        assert_eq!(m.steps[0].tokens_seen, 64);
        assert_eq!(m.evals[0].values["eval_accuracy"], 0.0);
        std::fs::write(dir.path().join("metrics.jsonl"), "oops\n{\"step\":1}\n").unwrap();
        let e = read_metrics(dir.path()).unwrap_err().to_string();
        assert!(e.contains("metrics.jsonl line 1"), "{e}");
        let e = status(&dir.path().join("nope")).unwrap_err().to_string();
        assert!(e.contains("no such run directory"), "{e}");
    }

    /// A run directory with `events` (`(time, event, fields)`, from the trainer) and the
    /// checkpoint directories of `on_disk`.
    fn run_with(events: &[(f64, &str, Value)], on_disk: &[u64]) -> tempfile::TempDir {
        let dir = tempfile::tempdir().unwrap();
        let lines: String = events
            .iter()
            .map(|(t, name, fields)| {
                let mut line = serde_json::json!({"time": t, "source": "train", "event": name});
                if let (Some(l), Value::Object(f)) = (line.as_object_mut(), fields) {
                    l.extend(f.clone());
                }
                format!("{line}\n")
            })
            .collect();
        std::fs::write(dir.path().join(layout::EVENTS), lines).unwrap();
        std::fs::write(dir.path().join(layout::METRICS), "").unwrap();
        for s in on_disk {
            let ck = dir
                .path()
                .join(layout::CHECKPOINTS)
                .join(layout::checkpoint_dir(s));
            std::fs::create_dir_all(ck).unwrap();
        }
        dir
    }

    fn saved_line(dir: &Path) -> String {
        let text = status(dir).unwrap();
        text.lines()
            .find(|l| l.starts_with("attempts: "))
            .unwrap()
            .to_string()
    }

    /// Issue 46: a rank killed right after the checkpoint of step 30 was published but
    /// before its `checkpoint_saved` event; the next attempt resumed from it. `kiln status`
    /// counted one checkpoint fewer than exist.
    #[test]
    fn a_checkpoint_published_without_its_event_is_counted() {
        use serde_json::json;
        let events = [
            (1.0, event::START, json!({"step": 0})),
            (2.0, event::CHECKPOINT_SAVED, json!({"step": 10})),
            (3.0, event::CHECKPOINT_SAVED, json!({"step": 20})),
            (5.0, event::START, json!({"step": 30})),
            (
                5.1,
                event::RESUME,
                json!({"step": 30, "tier": "persistent"}),
            ),
            (6.0, event::CHECKPOINT_SAVED, json!({"step": 40})),
        ];
        let dir = run_with(&events, &[20, 30, 40]);
        let line = saved_line(dir.path());
        assert!(line.ends_with("4 checkpoint(s) saved"), "{line}");
    }

    /// Held out: other steps and tiers. A resume from memory is no checkpoint; a checkpoint
    /// on disk without an event that nothing resumed from (the run's last, its writer killed)
    /// counts; pruned ones count by their events; none is counted twice.
    #[test]
    fn saved_checkpoints_count_each_step_once_from_every_trace() {
        use serde_json::json;
        let events = [
            (1.0, event::START, json!({"step": 0})),
            (2.0, event::CHECKPOINT_SAVED, json!({"step": 7})),
            (3.0, event::CHECKPOINT_SAVED, json!({"step": 14})),
            (4.0, event::START, json!({"step": 18})),
            (4.1, event::RESUME, json!({"step": 18, "tier": "memory"})),
            (5.0, event::CHECKPOINT_SAVED, json!({"step": 21})),
            (6.0, event::START, json!({"step": 21})),
            (6.1, event::RESUME, json!({"step": 21})),
        ];
        let dir = run_with(&events, &[14, 21, 28]);
        let line = saved_line(dir.path());
        assert!(line.ends_with("4 checkpoint(s) saved"), "{line}");
        let none = run_with(&[(1.0, event::START, json!({"step": 0}))], &[]);
        assert!(saved_line(none.path()).ends_with(" 0 checkpoint(s) saved"));
    }
}

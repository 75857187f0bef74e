//! How a run recovered, from its goodput ledger ([`kiln_run::ledger`]): each fault with its
//! detection time, the tier the next attempt resumed from and the work it lost, as the lines
//! of `kiln status`, and the per-cause and per-fault tables as Markdown (what the soak prints
//! for bench/soak/results.md).

use kiln_run::ledger::{Fault, Ledger};
use std::collections::BTreeMap;

fn secs(v: Option<f64>, digits: usize) -> String {
    v.map_or("-".to_string(), |v| format!("{v:.digits$}"))
}

fn culprit(f: &Fault) -> String {
    let ranks: Vec<String> = f.ranks.iter().map(|r| format!("rank {r}")).collect();
    match (ranks.is_empty(), f.hosts.is_empty()) {
        (true, true) => "no culprit named".into(),
        (false, true) => ranks.join(","),
        (true, false) => f.hosts.join(","),
        (false, false) => format!("{} on {}", ranks.join(","), f.hosts.join(",")),
    }
}

/// `resumed from memory x3, peer x1` over the faults (tiers in name order).
fn tiers(faults: &[Fault]) -> String {
    let mut n: BTreeMap<&str, usize> = BTreeMap::new();
    for f in faults {
        *n.entry(f.resumed_from.as_deref().unwrap_or("no resume"))
            .or_default() += 1;
    }
    let each: Vec<String> = n.iter().map(|(t, k)| format!("{t} x{k}")).collect();
    each.join(", ")
}

/// Mean and largest of the recorded values.
fn mean_max(v: impl Iterator<Item = f64>) -> Option<(f64, f64)> {
    let v: Vec<f64> = v.collect();
    let max = v.iter().copied().reduce(f64::max)?;
    Some((v.iter().sum::<f64>() / v.len() as f64, max))
}

/// The `faults:` section of `kiln status` (empty when nothing failed).
pub fn fault_lines(l: &Ledger) -> String {
    if l.faults.is_empty() {
        return String::new();
    }
    let detect = mean_max(l.faults.iter().filter_map(|f| f.detect_s))
        .map_or(String::new(), |(m, x)| {
            format!("; detection mean {m:.2} s, max {x:.2} s")
        });
    let mut out = format!(
        "faults: {}{detect}; resumed from {}\n",
        l.faults.len(),
        tiers(&l.faults)
    );
    for f in &l.faults {
        let detected = match (f.detect_s, f.kill_s) {
            (Some(d), Some(k)) => format!("detected in {d:.2} s (+{k:.2} s to stop the ranks)"),
            (Some(d), None) => format!("detected in {d:.2} s"),
            _ => "detection time not recorded".into(),
        };
        let resumed = match (&f.resumed_from, f.resumed_step) {
            (Some(t), Some(s)) => format!("resumed from {t} at step {s}"),
            (Some(t), None) => format!("resumed from {t}"),
            _ => "not resumed".into(),
        };
        let lost = match (f.lost_steps, f.lost_s) {
            (Some(n), Some(s)) => format!("; {s:.1} s of work lost ({n} step(s) redone)"),
            (None, Some(s)) => format!("; {s:.1} s of work lost"),
            (Some(n), None) => format!("; {n} step(s) redone"),
            _ => String::new(),
        };
        out.push_str(&format!(
            "  attempt {} at {:.1} s: {}, {}: {detected}; {resumed}{lost}\n",
            f.attempt,
            f.at,
            f.classification,
            culprit(f)
        ));
    }
    out
}

/// The per-cause ETTR table (seconds, share of the wall time, seconds per fault) and the
/// per-fault table, as Markdown.
pub fn markdown(l: &Ledger) -> String {
    let n = l.faults.len();
    let mut out = format!(
        "ETTR {:.1} % of {:.1} s wall: {} job(s), {} attempt(s), {n} fault(s), {} step(s) redone\n\n",
        l.ettr() * 100.0,
        l.total,
        l.jobs,
        l.attempts.len(),
        l.lost_steps
    );
    out.push_str("| cause | seconds | % of wall | per fault (s) |\n| --- | ---: | ---: | ---: |\n");
    let share = |s: f64| {
        if l.total > 0.0 {
            100.0 * s / l.total
        } else {
            0.0
        }
    };
    for (name, s) in l.buckets.rows() {
        let per = if n > 0 && name != kiln_run::ledger::bucket::PRODUCTIVE {
            format!("{:.2}", s / n as f64)
        } else {
            "-".into()
        };
        out.push_str(&format!(
            "| {name} | {s:.1} | {:.1} % | {per} |\n",
            share(s)
        ));
    }
    if n == 0 {
        return out;
    }
    out.push_str(
        "\n| # | at (s) | ending | culprit | detection (s) | stop (s) | resumed from | step | steps lost | work lost (s) |\n\
         | ---: | ---: | --- | --- | ---: | ---: | --- | ---: | ---: | ---: |\n",
    );
    for (i, f) in l.faults.iter().enumerate() {
        out.push_str(&format!(
            "| {} | {:.1} | {} | {} | {} | {} | {} | {} | {} | {} |\n",
            i + 1,
            f.at,
            f.classification,
            culprit(f),
            secs(f.detect_s, 2),
            secs(f.kill_s, 2),
            f.resumed_from.as_deref().unwrap_or("-"),
            f.resumed_step.map_or("-".into(), |s| s.to_string()),
            f.lost_steps.map_or("-".into(), |s| s.to_string()),
            secs(f.lost_s, 2),
        ));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fault(attempt: usize, tier: Option<&str>, detect: Option<f64>) -> Fault {
        Fault {
            attempt,
            at: 10.0 * attempt as f64,
            classification: "no-heartbeat".into(),
            ranks: vec![1],
            hosts: vec!["n2".into()],
            detect_s: detect,
            kill_s: Some(0.25),
            resumed_from: tier.map(str::to_string),
            resumed_step: tier.map(|_| 100),
            lost_steps: Some(3),
            step_s: Some(0.05),
            lost_s: Some(0.15),
        }
    }

    #[test]
    fn faults_show_detection_tier_and_lost_work() {
        let mut l = Ledger::default();
        assert_eq!(fault_lines(&l), "");
        l.total = 100.0;
        l.buckets.productive = 97.0;
        l.buckets.detection = 3.0;
        l.faults = vec![
            fault(1, Some("memory"), Some(1.0)),
            fault(3, Some("peer"), Some(2.0)),
            fault(5, None, None),
        ];
        let text = fault_lines(&l);
        assert!(
            text.starts_with("faults: 3; detection mean 1.50 s, max 2.00 s; resumed from memory x1, no resume x1, peer x1\n"),
            "{text}"
        );
        assert!(
            text.contains("attempt 1 at 10.0 s: no-heartbeat, rank 1 on n2: detected in 1.00 s (+0.25 s to stop the ranks); resumed from memory at step 100; 0.1 s of work lost (3 step(s) redone)"),
            "{text}"
        );
        assert!(text.contains("attempt 5 at 50.0 s: no-heartbeat, rank 1 on n2: detection time not recorded; not resumed"), "{text}");
        let md = markdown(&l);
        assert!(md.starts_with("ETTR 97.0 % of 100.0 s wall"), "{md}");
        assert!(md.contains("| detection | 3.0 | 3.0 % | 1.00 |"), "{md}");
        assert!(md.contains("| productive | 97.0 | 97.0 % | - |"), "{md}");
        assert!(
            md.contains(
                "| 2 | 30.0 | no-heartbeat | rank 1 on n2 | 2.00 | 0.25 | peer | 100 | 3 | 0.15 |"
            ),
            "{md}"
        );
    }
}

//! What `kiln launch --dry-run` prints: what was detected and the exact argv (and added
//! variables) of every process.

use crate::setup::Setup;

/// What `--dry-run` prints.
pub(crate) fn describe(setup: &Setup, run_dir: &std::path::Path) -> String {
    let (acc, sizes) = (setup.accelerators.value, setup.sizes);
    let mut lines = vec![
        format!(
            "scheduler:    {} ({})",
            setup.scheduler.value.name(),
            setup.scheduler.reason
        ),
        format!(
            "hosts:        {} ({})",
            setup.used_hosts.join(","),
            setup.hosts.reason
        ),
    ];
    lines.extend(spares_line(setup));
    lines.extend([
        format!(
            "accelerators: {} x {} per node ({})",
            acc.count,
            acc.kind.name(),
            setup.accelerators.reason
        ),
        format!(
            "launcher:     {} (np {}, ppn {}, nnodes {})",
            setup.launcher.name(),
            sizes.np,
            sizes.ppn,
            sizes.nnodes
        ),
        format!("run dir:      {}", run_dir.display()),
    ]);
    if let Some((path, text)) = &setup.hostfile_to_write {
        lines.push(format!(
            "hostfile:     {} would contain {text:?}",
            path.display()
        ));
    }
    for p in &setup.procs {
        let rank = p.rank.map_or(String::new(), |r| format!(" (rank {r})"));
        let env: Vec<String> = p.env.iter().map(|(k, v)| format!("{k}={v}")).collect();
        let json = |v: &[String]| serde_json::to_string(v).unwrap_or_default();
        lines.push(format!("argv{rank}: {}", json(&p.argv)));
        lines.push(format!("env{rank}:  {}", json(&env)));
    }
    lines.iter().map(|l| format!("{l}\n")).collect()
}

/// The `--dry-run` line of spares and quarantined hosts, when there is either.
fn spares_line(setup: &Setup) -> Option<String> {
    let spares: Vec<String> = setup.spares.iter().map(|h| h.name.clone()).collect();
    let list = |v: &[String]| match v {
        [] => "none".to_string(),
        v => v.join(","),
    };
    (!spares.is_empty() || !setup.excluded.is_empty()).then(|| {
        format!(
            "spares:       {}; quarantined: {}",
            list(&spares),
            list(&setup.excluded)
        )
    })
}

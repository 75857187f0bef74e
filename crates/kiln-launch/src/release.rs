//! The end of a launch on its nodes: what the ranks recorded as kept on each node (the memory
//! tier's snapshots, Open MPI segments, control-plane directories) is removed there, on this
//! host directly and on the others by `kiln launch --release-node`, run once per node through
//! the attempts' launcher.

use crate::launch::{Running, quarantine_files};
use crate::plan::Launcher;
use crate::pool::quarantined_hosts;
use kiln_run::{PROGRESS_DIR_ENV, event, exit};
use kiln_topology::Scheduler;
use serde_json::json;
use std::time::{Duration, Instant};

impl Running<'_> {
    /// Whether the memory tier stays on the nodes when the launch ends
    /// (`--memory-tier-at-end`). `auto` tells a job that ends for good on its nodes from one
    /// that will resume on them by the scheduler: under Slurm or PBS the allocation ends
    /// with the job (the batch script runs one launch) and the next job of a chain lands on
    /// whatever nodes the scheduler gives, so the snapshots go; without a scheduler the
    /// machines outlive the launch and running the same command again resumes on them, so
    /// they stay (that run deletes those its persistent checkpoint made stale, and a run
    /// that completes deletes its own).
    fn keeps_memory_tier(&self) -> bool {
        match self.req.memory_tier_at_end.as_str() {
            "keep" => true,
            "remove" => false,
            _ => matches!(self.setup.scheduler.value, Scheduler::None),
        }
    }

    /// The launch ended for good: removes what the ranks recorded as kept on their nodes
    /// (the memory tier's snapshots, RAM in /dev/shm, unless [`Self::keeps_memory_tier`];
    /// Open MPI segments of ranks that did not finalise, always) on every node any attempt
    /// used. Its own host's here;
    /// the other hosts' through the launcher, once per node (`kiln launch --release-node`).
    /// Quarantined hosts are left out (out of service). The `nodes_released` event says what
    /// went, and what could not.
    pub(crate) fn release_nodes(&mut self) {
        let progress = &self.dirs.progress;
        let hosts = kiln_run::node_state::recorded_hosts(progress);
        if hosts.is_empty() {
            return;
        }
        let keep = self.keeps_memory_tier();
        let me = kiln_run::this_host();
        let local = self.setup.launcher == Launcher::Local;
        let here = match keep {
            true => kiln_run::node_state::release_mpi(progress, me),
            false => kiln_run::node_state::release(progress, me),
        };
        let files = quarantine_files(&self.dirs.run, &self.req.quarantine_file);
        let quarantined = quarantined_hosts(&files).unwrap_or_default();
        let (skipped, remote): (Vec<String>, Vec<String>) = hosts
            .into_iter()
            .filter(|h| !local && !crate::pool::same_host(h, me))
            .partition(|h| quarantined.iter().any(|q| crate::pool::same_host(q, h)));
        let (there, problem) = self.release_remote(&remote);
        let mut removed: Vec<String> = (here.removed.iter())
            .map(|p| format!("{me}:{}", p.display()))
            .collect();
        let mut failed: Vec<String> = here
            .failed
            .iter()
            .map(|(p, why)| format!("{me}: {}: {why}", p.display()))
            .collect();
        removed.extend(there.iter().flat_map(|r| r.removed.clone()));
        failed.extend(there.iter().flat_map(|r| r.failed.clone()));
        if let Some(p) = &problem {
            failed.push(p.clone());
        }
        for f in &failed {
            eprintln!("kiln: could not release node state: {f}");
        }
        let _ = self.events.emit(
            event::NODES_RELEASED,
            json!({"kept": keep, "host": me, "hosts": remote, "removed": removed,
                   "failed": failed, "skipped_quarantined": skipped}),
        );
    }

    /// Runs `kiln launch --release-node` once on each of `hosts` through the launcher; what
    /// each reported, and what went wrong with the step, if anything.
    fn release_remote(&self, hosts: &[String]) -> (Vec<NodeRelease>, Option<String>) {
        if hosts.is_empty() {
            return (Vec::new(), None);
        }
        let alloc = &self.setup.hosts.value;
        let targets: Vec<kiln_topology::Host> = alloc
            .iter()
            .filter(|h| hosts.iter().any(|r| crate::pool::same_host(r, &h.name)))
            .cloned()
            .collect();
        let exe = match std::env::current_exe() {
            Ok(exe) => exe.display().to_string(),
            Err(e) => return (Vec::new(), Some(format!("{}: {e}", hosts.join(",")))),
        };
        let mut command = vec![exe, "launch".into(), "--release-node".into()];
        if self.keeps_memory_tier() {
            command.push("--memory-tier-at-end=keep".into());
        }
        let plan = match self.setup.plan_once_per_node(&targets, command) {
            Ok(p) => p,
            Err(e) => return (Vec::new(), Some(format!("{}: {e}", hosts.join(",")))),
        };
        if let Some((path, text)) = &plan.hostfile_to_write
            && let Err(e) = std::fs::write(path, text)
        {
            return (Vec::new(), Some(format!("{}: {e}", path.display())));
        }
        let Some(proc) = plan.procs.first() else {
            return (Vec::new(), None);
        };
        match run_bounded(proc, RELEASE_LIMIT) {
            Ok((status, stdout)) => {
                let reports: Vec<NodeRelease> = String::from_utf8_lossy(&stdout)
                    .lines()
                    .filter_map(|l| serde_json::from_str(l.trim()).ok())
                    .collect();
                let problem = (!status.success())
                    .then(|| format!("{}: the release step exited with {status}", hosts.join(",")));
                (reports, problem)
            }
            Err(e) => (Vec::new(), Some(format!("{}: {e}", hosts.join(",")))),
        }
    }
}

/// The longest the step that releases the nodes may take.
const RELEASE_LIMIT: Duration = Duration::from_secs(120);

/// What `kiln launch --release-node` did on one node: one JSON line on its stdout.
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct NodeRelease {
    /// The node.
    pub host: String,
    /// The directories it removed.
    pub removed: Vec<String>,
    /// What it could not remove, with why.
    pub failed: Vec<String>,
}

/// `kiln launch --release-node`: removes what the run's ranks recorded in
/// `$KILN_PROGRESS_DIR` as kept on this node (with `keep_memory_tier`
/// (`--memory-tier-at-end=keep`), only the Open MPI segments), and prints a [`NodeRelease`]
/// line. Exit 0, or 1 when something could not be removed.
pub fn release_node(keep_memory_tier: bool) -> i32 {
    let host = kiln_run::this_host();
    let Some(dir) = kiln_run::progress_dir() else {
        eprintln!("kiln launch --release-node: {PROGRESS_DIR_ENV} is not set");
        return exit::USAGE;
    };
    let dir = std::path::Path::new(&dir);
    // The control plane's node directories of agents killed with their ranks.
    let base = crate::plane::node::base_dir();
    crate::plane::node::sweep(&base, crate::plane::node::SWEEP_AT_END);
    let r = match keep_memory_tier {
        true => kiln_run::node_state::release_mpi(dir, host),
        false => kiln_run::node_state::release(dir, host),
    };
    let report = NodeRelease {
        host: host.to_string(),
        removed: r
            .removed
            .iter()
            .map(|p| format!("{host}:{}", p.display()))
            .collect(),
        failed: (r.failed.iter())
            .map(|(p, why)| format!("{host}: {}: {why}", p.display()))
            .collect(),
    };
    println!("{}", serde_json::to_string(&report).unwrap_or_default());
    i32::from(!report.failed.is_empty())
}

/// Runs `proc` (in a process group of its own) to its end or `limit` (then the group is
/// killed); its status and stdout.
fn run_bounded(
    proc: &crate::plan::ProcSpec,
    limit: Duration,
) -> std::io::Result<(std::process::ExitStatus, Vec<u8>)> {
    use std::io::Read;
    use std::os::unix::process::CommandExt;
    let Some((program, args)) = proc.argv.split_first() else {
        return Err(std::io::Error::other("empty argv"));
    };
    let mut child = std::process::Command::new(program)
        .args(args)
        .envs(proc.env.iter().map(|(k, v)| (k, v)))
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::inherit())
        .process_group(0)
        .spawn()?;
    let mut out = child.stdout.take();
    let reader = std::thread::spawn(move || {
        let mut buf = Vec::new();
        if let Some(o) = out.as_mut() {
            let _ = o.read_to_end(&mut buf);
        }
        buf
    });
    let until = Instant::now() + limit;
    let status = loop {
        if let Some(s) = child.try_wait()? {
            break s;
        }
        if Instant::now() >= until {
            let group = nix::unistd::Pid::from_raw(child.id() as i32);
            crate::groups::finish_groups(&[group], Duration::from_secs(2), false);
            let _ = child.wait();
            return Err(std::io::Error::other(format!(
                "the release step took longer than {} s; killed",
                limit.as_secs()
            )));
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    Ok((status, reader.join().unwrap_or_default()))
}

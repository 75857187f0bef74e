//! Asking the scheduler which hosts are gone: the strongest evidence of a node failure.

use crate::pool::same_host;
use crate::probe::{SCHEDULER_TIMEOUT, find_in_path, probe_tool_within};
use kiln_topology::expand_hostlist;

/// Which of `hosts` the scheduler says are lost (left the job, down, drained, failing), with
/// the scheduler's words.
pub trait HostHealth {
    /// The lost hosts among `hosts`.
    fn lost(&self, hosts: &[String]) -> Vec<(String, String)>;
}

/// No scheduler to ask.
#[derive(Debug, Clone, Copy, Default)]
pub struct NoHealth;

impl HostHealth for NoHealth {
    fn lost(&self, _: &[String]) -> Vec<(String, String)> {
        Vec::new()
    }
}

/// Slurm: the job's current `NodeList` (a node that failed under `--no-kill` leaves it) and
/// the node states from `sinfo`.
#[derive(Debug, Clone)]
pub struct SlurmHealth {
    /// `SLURM_JOB_ID`.
    pub job_id: String,
}

/// Node states that mean "do not run here".
const BAD_STATES: &[&str] = &["down", "drain", "fail", "not_responding", "maint", "reboot"];

/// Parses `NodeList=...` out of `scontrol show job -o` output.
pub fn slurm_job_nodes(scontrol: &str) -> Option<Vec<String>> {
    let field = scontrol
        .split_whitespace()
        .find_map(|f| f.strip_prefix("NodeList="))?;
    if field == "(null)" {
        return Some(Vec::new());
    }
    expand_hostlist(field).ok()
}

/// Parses `sinfo -h -N -o "%N %T"` lines into the hosts in a bad state.
pub fn slurm_bad_nodes(sinfo: &str) -> Vec<(String, String)> {
    sinfo
        .lines()
        .filter_map(|l| {
            let mut it = l.split_whitespace();
            let (node, state) = (it.next()?, it.next()?.to_ascii_lowercase());
            BAD_STATES
                .iter()
                .any(|b| state.contains(b))
                .then(|| (node.to_string(), format!("sinfo: node state {state}")))
        })
        .collect()
}

/// The scheduler's answer to `program args` (within [`SCHEDULER_TIMEOUT`]); when a scheduler
/// tool that exists gives none, says so on the launcher's log, since the diagnosis then goes
/// without the scheduler's word on its hosts.
fn ask_scheduler(program: &str, args: &[&str]) -> Option<String> {
    let out = probe_tool_within(program, args, SCHEDULER_TIMEOUT);
    if out.is_none() && find_in_path(program).is_some() {
        eprintln!(
            "kiln: `{program} {}` gave no answer within {} s (failed or timed out): the hosts' \
             states are unknown to this diagnosis",
            args.join(" "),
            SCHEDULER_TIMEOUT.as_secs()
        );
    }
    out
}

impl HostHealth for SlurmHealth {
    fn lost(&self, hosts: &[String]) -> Vec<(String, String)> {
        let mut lost: Vec<(String, String)> = Vec::new();
        if let Some(out) = ask_scheduler("scontrol", &["show", "job", &self.job_id, "-o"])
            && let Some(nodes) = slurm_job_nodes(&out)
            && !nodes.is_empty()
        {
            for h in hosts.iter().filter(|h| !nodes.contains(h)) {
                lost.push((
                    h.clone(),
                    format!("left job {} (scontrol: NodeList without it)", self.job_id),
                ));
            }
        }
        let list = hosts.join(",");
        if let Some(out) = ask_scheduler("sinfo", &["-h", "-N", "-n", &list, "-o", "%N %T"]) {
            for (h, why) in slurm_bad_nodes(&out) {
                if hosts.contains(&h) && !lost.iter().any(|(x, _)| *x == h) {
                    lost.push((h, why));
                }
            }
        }
        lost
    }
}

/// PBS: `pbsnodes -l` lists the nodes that are down or offline.
#[derive(Debug, Clone, Copy, Default)]
pub struct PbsHealth;

impl HostHealth for PbsHealth {
    fn lost(&self, hosts: &[String]) -> Vec<(String, String)> {
        let Some(out) = ask_scheduler("pbsnodes", &["-l"]) else {
            return Vec::new();
        };
        out.lines()
            .filter_map(|l| {
                let mut it = l.split_whitespace();
                let (node, state) = (it.next()?, it.next().unwrap_or("down"));
                let host = hosts.iter().find(|h| same_host(h, node))?;
                Some((host.clone(), format!("pbsnodes -l: {state}")))
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slurm_outputs_parse() {
        let job = "JobId=7 JobName=x UserId=root(0) NodeList=n[1,3-4] BatchHost=n1 NumNodes=3";
        assert_eq!(slurm_job_nodes(job).unwrap(), ["n1", "n3", "n4"]);
        assert_eq!(slurm_job_nodes("JobId=7 NodeList=(null)").unwrap().len(), 0);
        let bad = slurm_bad_nodes("n1 idle\nn2 down*\nn3 allocated\nn4 draining\n");
        let names: Vec<_> = bad.iter().map(|b| b.0.as_str()).collect();
        assert_eq!(names, ["n2", "n4"]);
    }
}

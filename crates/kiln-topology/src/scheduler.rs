//! Which batch scheduler (if any) this process runs under, and the hosts it allocated.

use crate::hostfile::{Host, HostTally, HostfileError, read_hostfile};
use crate::hostlist::{HostlistError, expand_hostlist};
use std::path::PathBuf;

/// The batch scheduler of the allocation.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Scheduler {
    /// PBS Pro / OpenPBS (`PBS_JOBID`); hosts come from `PBS_NODEFILE`.
    Pbs {
        /// `PBS_JOBID`.
        job_id: String,
        /// `PBS_NODEFILE`, when set.
        nodefile: Option<PathBuf>,
    },
    /// Slurm (`SLURM_JOB_ID`); hosts come from `SLURM_JOB_NODELIST`.
    Slurm {
        /// `SLURM_JOB_ID`.
        job_id: String,
        /// `SLURM_JOB_NODELIST` (or `SLURM_NODELIST`), unexpanded.
        nodelist: Option<String>,
    },
    /// No scheduler: a workstation, a login node, a CI box.
    None,
}

impl Scheduler {
    /// Short lowercase name: `pbs`, `slurm`, `none`.
    pub fn name(&self) -> &'static str {
        match self {
            Scheduler::Pbs { .. } => "pbs",
            Scheduler::Slurm { .. } => "slurm",
            Scheduler::None => "none",
        }
    }
}

/// A detection result with the reason, so `kiln doctor` can say why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Detected<T> {
    /// What was detected.
    pub value: T,
    /// Which variables or tools decided it.
    pub reason: String,
}

/// Detects the scheduler from environment variables (`vars` looks one up).
pub fn detect_scheduler(vars: &dyn Fn(&str) -> Option<String>) -> Detected<Scheduler> {
    let get = |k: &str| vars(k).filter(|v| !v.trim().is_empty());
    let pbs = get("PBS_JOBID");
    let slurm = get("SLURM_JOB_ID").or_else(|| get("SLURM_JOBID"));
    match (pbs, slurm) {
        (Some(job_id), other) => {
            let nodefile = get("PBS_NODEFILE").map(PathBuf::from);
            let mut reason = format!("PBS_JOBID={job_id}");
            match &nodefile {
                Some(f) => reason += &format!(", PBS_NODEFILE={}", f.display()),
                None => reason += ", PBS_NODEFILE unset",
            }
            if other.is_some() {
                reason += " (SLURM_JOB_ID is set too; PBS wins; pass --scheduler to choose)";
            }
            Detected {
                value: Scheduler::Pbs { job_id, nodefile },
                reason,
            }
        }
        (None, Some(job_id)) => {
            let nodelist = get("SLURM_JOB_NODELIST").or_else(|| get("SLURM_NODELIST"));
            let reason = match &nodelist {
                Some(n) => format!("SLURM_JOB_ID={job_id}, SLURM_JOB_NODELIST={n}"),
                None => format!("SLURM_JOB_ID={job_id}, SLURM_JOB_NODELIST unset"),
            };
            Detected {
                value: Scheduler::Slurm { job_id, nodelist },
                reason,
            }
        }
        (None, None) => Detected {
            value: Scheduler::None,
            reason: "neither PBS_JOBID nor SLURM_JOB_ID is set".into(),
        },
    }
}

/// Why the allocation's hosts could not be listed.
#[derive(Debug, thiserror::Error)]
pub enum HostsError {
    /// A hostfile (given or `PBS_NODEFILE`) is unreadable or malformed.
    #[error(transparent)]
    Hostfile(#[from] HostfileError),
    /// `SLURM_JOB_NODELIST` is malformed.
    #[error("SLURM_JOB_NODELIST: {0}")]
    Hostlist(#[from] HostlistError),
    /// The scheduler is known but does not say which hosts it gave.
    #[error("{0}")]
    Missing(String),
}

/// The hosts of the allocation: `hostfile` if given (it overrides the scheduler), else the
/// scheduler's list, else the local machine (`localhost`, one slot).
pub fn allocation_hosts(
    scheduler: &Scheduler,
    hostfile: Option<&std::path::Path>,
) -> Result<Detected<Vec<Host>>, HostsError> {
    if let Some(path) = hostfile {
        let hosts = read_hostfile(path)?;
        return Ok(Detected {
            value: hosts,
            reason: format!("--hostfile {}", path.display()),
        });
    }
    match scheduler {
        Scheduler::Pbs { nodefile: Some(f), .. } => {
            let hosts = read_hostfile(f)?;
            Ok(Detected { value: hosts, reason: format!("PBS_NODEFILE {}", f.display()) })
        }
        Scheduler::Pbs { nodefile: None, .. } => Err(HostsError::Missing(
            "PBS_JOBID is set but PBS_NODEFILE is not: pass --hostfile, or --scheduler none".into(),
        )),
        Scheduler::Slurm { nodelist: Some(list), .. } => {
            let mut hosts = HostTally::default();
            for name in expand_hostlist(list)? {
                // At most MAX_HOSTS names: one slot each cannot overflow.
                let _ = hosts.add(&name, 1);
            }
            Ok(Detected { value: hosts.into_hosts(), reason: format!("SLURM_JOB_NODELIST {list}") })
        }
        Scheduler::Slurm { nodelist: None, .. } => Err(HostsError::Missing(
            "SLURM_JOB_ID is set but SLURM_JOB_NODELIST is not: pass --hostfile, or --scheduler none".into(),
        )),
        Scheduler::None => Ok(Detected {
            value: vec![Host { name: "localhost".into(), slots: 1 }],
            reason: "no scheduler: this machine only".into(),
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn env(pairs: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
        let map: HashMap<String, String> = pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        move |k| map.get(k).cloned()
    }

    #[test]
    fn detects_pbs_slurm_and_none() {
        let d = detect_scheduler(&env(&[
            ("PBS_JOBID", "123.pbs"),
            ("PBS_NODEFILE", "/var/nodes"),
        ]));
        assert_eq!(
            d.value,
            Scheduler::Pbs {
                job_id: "123.pbs".into(),
                nodefile: Some("/var/nodes".into())
            }
        );
        let d = detect_scheduler(&env(&[
            ("SLURM_JOB_ID", "9"),
            ("SLURM_JOB_NODELIST", "n[1-2]"),
        ]));
        assert_eq!(d.value.name(), "slurm");
        assert!(d.reason.contains("n[1-2]"));
        assert_eq!(
            detect_scheduler(&env(&[("PBS_JOBID", "")])).value,
            Scheduler::None
        );
    }

    #[test]
    fn slurm_hosts_are_expanded() {
        let s = Scheduler::Slurm {
            job_id: "1".into(),
            nodelist: Some("nid[001-002],x9".into()),
        };
        let hosts = allocation_hosts(&s, None).unwrap().value;
        let names: Vec<_> = hosts.iter().map(|h| h.name.as_str()).collect();
        assert_eq!(names, ["nid001", "nid002", "x9"]);
    }

    /// Fuzz finding (hostlist): `-[0-99999]` timed out: the allocation merged repeated names
    /// with a scan per name, quadratic in the hosts (hours at MAX_HOSTS).
    #[test]
    fn fuzz_slurm_allocation_of_max_hosts_merges_in_linear_time() {
        let s = Scheduler::Slurm {
            job_id: "1".into(),
            nodelist: Some(
                format!("n[0-{}]", crate::MAX_HOSTS / 2 - 1)
                    + &format!(",n[0-{}]", crate::MAX_HOSTS / 2 - 1),
            ),
        };
        let hosts = allocation_hosts(&s, None).unwrap().value;
        assert_eq!(hosts.len(), crate::MAX_HOSTS / 2);
        assert!(hosts.iter().all(|h| h.slots == 2));
    }

    #[test]
    fn pbs_without_nodefile_is_an_actionable_error() {
        let s = Scheduler::Pbs {
            job_id: "1".into(),
            nodefile: None,
        };
        let e = allocation_hosts(&s, None).unwrap_err().to_string();
        assert!(e.contains("--hostfile"), "{e}");
    }
}

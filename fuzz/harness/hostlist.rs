//! Fuzz harness: Slurm hostlist expressions (`SLURM_JOB_NODELIST`,
//! `kiln_topology::expand_hostlist`) and the allocation built from one.
//!
//! Expansion is bounded by `MAX_HOSTS`; names are valid host names; the allocation has one
//! entry per distinct name whose slots count its repeats.

use kiln_topology::{MAX_HOSTS, Scheduler, allocation_hosts, expand_hostlist};

pub fn run(data: &[u8]) {
    let Ok(expr) = std::str::from_utf8(data) else {
        return;
    };
    let names = match expand_hostlist(expr) {
        Ok(n) => n,
        Err(e) => {
            assert!(e.offset <= expr.len(), "{e}");
            return;
        }
    };
    assert!(!names.is_empty() && names.len() <= MAX_HOSTS);
    for n in &names {
        assert!(!n.is_empty(), "empty name from {expr:?}");
        assert!(
            n.bytes()
                .all(|b| b.is_ascii_alphanumeric() || b"-._".contains(&b)),
            "{n:?} from {expr:?}"
        );
    }
    let slurm = Scheduler::Slurm {
        job_id: "1".into(),
        nodelist: Some(expr.to_string()),
    };
    let hosts = allocation_hosts(&slurm, None)
        .expect("an expanded list allocates")
        .value;
    assert_eq!(hosts.iter().map(|h| h.slots).sum::<usize>(), names.len());
    let mut distinct: Vec<&String> = names.iter().collect();
    distinct.sort();
    distinct.dedup();
    assert_eq!(hosts.len(), distinct.len());
}

//! Fuzz harness: hostfiles, both as `--hostfile` and as PBS's `$PBS_NODEFILE`
//! (`kiln_topology::read_hostfile`, `allocation_hosts`).
//!
//! Parsed hosts are unique, valid names with at least one slot, and the two ways in agree.

use kiln_topology::{Scheduler, allocation_hosts, read_hostfile};

pub fn run(data: &[u8]) {
    let dir = tempfile::tempdir().expect("temporary directory");
    let path = dir.path().join("fuzz-nodefile");
    std::fs::write(&path, data).expect("write the input");
    let direct = read_hostfile(&path);
    let pbs = Scheduler::Pbs {
        job_id: "1.pbs".into(),
        nodefile: Some(path.clone()),
    };
    let via_pbs = allocation_hosts(&pbs, None);
    let via_flag = allocation_hosts(&Scheduler::None, Some(&path));
    match direct {
        Ok(hosts) => {
            assert!(!hosts.is_empty());
            for (i, h) in hosts.iter().enumerate() {
                assert!(h.slots >= 1, "{h:?}");
                assert!(!h.name.is_empty());
                assert!(
                    h.name
                        .bytes()
                        .all(|b| b.is_ascii_alphanumeric() || b"-._".contains(&b)),
                    "{h:?}"
                );
                assert!(
                    hosts[..i].iter().all(|o| o.name != h.name),
                    "duplicate {h:?}"
                );
            }
            assert_eq!(via_pbs.expect("PBS_NODEFILE agrees").value, hosts);
            assert_eq!(via_flag.expect("--hostfile agrees").value, hosts);
        }
        Err(e) => {
            let msg = e.to_string();
            assert!(
                msg.contains("fuzz-nodefile"),
                "error does not name the file: {msg}"
            );
            assert!(via_pbs.is_err() && via_flag.is_err());
        }
    }
}

//! The process groups of an attempt's ranks: signalling them, asking whether any member is
//! alive and in what state, adopting the descendants that leave them (subreaper), and ending
//! them (SIGTERM, a grace period, SIGKILL). Used by the supervisor and by each rank's shim.

use nix::sys::signal::{Signal, killpg};
use nix::unistd::Pid;
use std::time::{Duration, Instant};

/// Makes this process adopt orphaned descendants (Linux `PR_SET_CHILD_SUBREAPER`), so that a
/// grandchild that left the process group (`setsid`) still cannot outlive the attempt.
pub fn become_subreaper() -> bool {
    #[cfg(target_os = "linux")]
    {
        // SAFETY: prctl with integer arguments has no memory-safety preconditions.
        unsafe { libc::prctl(libc::PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0 }
    }
    #[cfg(not(target_os = "linux"))]
    {
        false
    }
}

/// After a rank was killed by a signal or fell silent, the others get at most this long
/// between SIGTERM and SIGKILL: without it they cannot finish a collective (they wait in one,
/// deaf to SIGTERM), so a longer grace only delays the next attempt. A save in flight is
/// atomic: the previous checkpoint and snapshot stay. 50 ms, not 0: a rank between
/// collectives (a stand-in replica, a rank still loading) can still log its exit.
pub const LOST_RANK_GRACE: Duration = Duration::from_millis(50);

/// The grace the other ranks get when a rank ended the attempt: [`LOST_RANK_GRACE`] at most
/// when it was `lost` (killed by a signal, or silent), else all of `grace` (a rank that
/// exited with a code chose to: the others may be handling the same error, checkpointing
/// after a 75, or still have output on its way through the launcher).
pub(crate) fn grace_after_loss(grace: Duration, lost: bool) -> Duration {
    if lost {
        grace.min(LOST_RANK_GRACE)
    } else {
        grace
    }
}

pub(crate) fn kill_groups(groups: &[Pid], sig: Signal) {
    for &pg in groups {
        // ESRCH (group already empty) is the normal case at the end; nothing to report.
        let _ = killpg(pg, sig);
    }
}

pub(crate) fn any_alive(groups: &[Pid]) -> bool {
    groups.iter().any(|&pg| killpg(pg, None).is_ok())
}

/// Ends whatever is left in the groups: SIGTERM, up to `grace`, SIGKILL, up to one second.
pub(crate) fn finish_groups(groups: &[Pid], grace: Duration, reap: bool) {
    if !any_alive(groups) {
        return;
    }
    kill_groups(groups, Signal::SIGTERM);
    let until = Instant::now() + grace;
    while any_alive(groups) && Instant::now() < until {
        if reap {
            reap_any_adopted_zombies();
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    if any_alive(groups) {
        kill_groups(groups, Signal::SIGKILL);
        let until = Instant::now() + Duration::from_secs(1);
        while any_alive(groups) && Instant::now() < until {
            reap_any_adopted_zombies();
            std::thread::sleep(Duration::from_millis(10));
        }
    }
}

/// Children of this process that are not ones we spawned: descendants re-parented to us.
pub(crate) fn adopted_children() -> Vec<i32> {
    let me = std::process::id() as i32;
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    entries
        .filter_map(Result::ok)
        .filter_map(|e| e.file_name().to_str()?.parse::<i32>().ok())
        .filter(|&pid| {
            std::fs::read_to_string(format!("/proc/{pid}/stat"))
                .ok()
                .and_then(|s| {
                    // Fields after the command name, which may itself contain spaces and ')'.
                    let rest = &s[s.rfind(')')? + 1..];
                    rest.split_whitespace().nth(1)?.parse::<i32>().ok()
                })
                == Some(me)
        })
        .collect()
}

/// Reaps adopted zombies (a killed grandchild whose parent was already gone is re-parented to
/// us as subreaper; until reaped it still counts as a member of its group).
pub(crate) fn reap_any_adopted_zombies() {
    use nix::sys::wait::{WaitPidFlag, waitpid};
    for pid in adopted_children() {
        let _ = waitpid(Pid::from_raw(pid), Some(WaitPidFlag::WNOHANG));
    }
}

/// Kills and reaps every adopted descendant, repeating while killing one orphans another.
pub(crate) fn reap_adopted() {
    use nix::sys::wait::waitpid;
    for _ in 0..16 {
        let pids = adopted_children();
        if pids.is_empty() {
            return;
        }
        for &pid in &pids {
            let _ = nix::sys::signal::kill(Pid::from_raw(pid), Signal::SIGKILL);
        }
        for pid in pids {
            let _ = waitpid(Pid::from_raw(pid), None);
        }
    }
}

/// The state and CPU ticks of the processes of group `pgid`: `T` if any is stopped, else `R`
/// if any runs, else the state of the group leader; CPU summed over the group (so a wrapper
/// script's worker counts).
pub(crate) fn group_liveness(pgid: i32) -> Option<(char, u64)> {
    let mut cpu = 0u64;
    let (mut stopped, mut running, mut leader) = (false, false, None);
    for e in std::fs::read_dir("/proc").ok()?.filter_map(Result::ok) {
        let Some(pid) = e.file_name().to_str().and_then(|n| n.parse::<i32>().ok()) else {
            continue;
        };
        let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
            continue;
        };
        // Fields after the command name, which may contain spaces and ')'.
        let Some(rest) = stat.rfind(')').map(|i| &stat[i + 1..]) else {
            continue;
        };
        let f: Vec<&str> = rest.split_whitespace().collect();
        if f.len() < 13 || f[2].parse::<i32>().ok() != Some(pgid) {
            continue;
        }
        let state = f[0].chars().next().unwrap_or('?');
        stopped |= matches!(state, 'T' | 't');
        running |= state == 'R';
        if pid == pgid {
            leader = Some(state);
        }
        cpu += f[11].parse::<u64>().unwrap_or(0) + f[12].parse::<u64>().unwrap_or(0);
    }
    let state = if stopped {
        'T'
    } else if running {
        'R'
    } else {
        leader?
    };
    Some((state, cpu))
}

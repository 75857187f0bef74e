//! Where a process runs: scheduler (PBS, Slurm, none), hosts, accelerators, and the rank
//! environment of the current process.
//!
//! Everything here reads variables and files; nothing spawns a process (tools such as
//! `nvidia-smi` are asked through a probe the caller supplies), so detection is testable
//! with any environment.

mod accel;
mod hostfile;
mod hostlist;
mod rank_env;
mod scheduler;

pub use accel::{
    AcceleratorKind, Accelerators, MAX_VISIBLE_DEVICES, Probe, RANKS_AS_NCCL_HOSTS,
    VISIBLE_DEVICE_VARS, VisibleDevicesError, accelerators_from_env, accelerators_to_env,
    count_nvidia_smi, count_rocm_smi, count_xpu_smi, detect_accelerators, device_for_local_rank,
    parse_visible_devices, rank_device, ranks_as_nccl_hosts,
};
pub use hostfile::{Host, HostfileError, parse_hostfile, read_hostfile};
pub use hostlist::{HostlistError, MAX_HOSTS, expand_hostlist};
pub use rank_env::{RankEnv, RankEnvError, rank_env_from, rank_env_from_os, rank_variables};
pub use scheduler::{Detected, HostsError, Scheduler, allocation_hosts, detect_scheduler};

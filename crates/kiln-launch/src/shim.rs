//! What runs on each rank under a launcher: map the launcher's rank variables onto RANK,
//! LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE (and keep MASTER_ADDR/PORT), then become the
//! program (exec, so no extra process sits between the launcher and the rank).

use kiln_topology::{RankEnv, RankEnvError};
use std::os::unix::process::CommandExt;
use std::process::Command;

/// Why the rank program could not be started.
#[derive(Debug, thiserror::Error)]
pub enum ShimError {
    /// The launcher's rank variables are unusable.
    #[error("rank environment: {0}")]
    RankEnv(#[from] RankEnvError),
    /// No command given.
    #[error("no command given after `--`")]
    NoCommand,
    /// exec failed.
    #[error("{program}: {source}")]
    Exec {
        /// The program.
        program: String,
        /// The cause.
        source: std::io::Error,
    },
}

impl ShimError {
    /// Exit code as a shell would give: 127 not found, 126 not executable, 2 otherwise.
    pub fn exit_code(&self) -> i32 {
        match self {
            ShimError::Exec { source, .. } if source.kind() == std::io::ErrorKind::NotFound => 127,
            ShimError::Exec { .. } => 126,
            _ => 2,
        }
    }
}

/// Replaces this process with `command`, with the rank variables set. Returns only on error.
pub fn exec_as_rank(command: &[String]) -> ShimError {
    let env = match RankEnv::from_process_env() {
        Ok(e) => e,
        Err(e) => return e.into(),
    };
    let Some((program, args)) = command.split_first() else {
        return ShimError::NoCommand;
    };
    let source = Command::new(program).args(args).envs(env.to_vars()).exec();
    ShimError::Exec {
        program: program.clone(),
        source,
    }
}

/// A TCP port free on this machine right now, for MASTER_PORT (the OS picks it).
pub fn free_port() -> Option<u16> {
    std::net::TcpListener::bind(("0.0.0.0", 0))
        .ok()?
        .local_addr()
        .ok()
        .map(|a| a.port())
}

/// Whether kiln runs as root (OpenMPI then needs explicit consent).
pub fn running_as_root() -> bool {
    // SAFETY: geteuid has no preconditions and cannot fail.
    unsafe { libc::geteuid() == 0 }
}

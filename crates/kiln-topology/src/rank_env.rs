//! The rank environment of the current process, whatever launcher started it.
//!
//! Launchers disagree on names: torchrun sets `RANK`, OpenMPI `OMPI_COMM_WORLD_RANK`, MPICH and
//! Intel MPI `PMI_RANK` and `MPI_LOCALRANKID`, Cray PALS `PALS_RANKID`, Slurm `SLURM_PROCID`.
//! [`rank_env_from`] maps them all onto one [`RankEnv`]; `kiln launch` exports the result as
//! `RANK`/`LOCAL_RANK`/`WORLD_SIZE`/`LOCAL_WORLD_SIZE` so PyTorch's `env://` works unchanged,
//! and kiln's trainer calls [`RankEnv::from_process_env`] directly.

/// Where a process sits among the ranks of a job.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RankEnv {
    /// Global rank, `0..world_size`.
    pub rank: usize,
    /// Rank among the ranks of this node, `0..local_world_size`.
    pub local_rank: usize,
    /// Number of ranks in the job.
    pub world_size: usize,
    /// Number of ranks on this node.
    pub local_world_size: usize,
    /// `MASTER_ADDR`: where rank 0 listens for rendezvous, if known.
    pub master_addr: Option<String>,
    /// `MASTER_PORT`, if known.
    pub master_port: Option<u16>,
    /// Which launcher's variables were used: `torchrun`, `openmpi`, `pmi`, `pals`, `slurm`,
    /// or `single` (none found: one process, rank 0 of 1).
    pub source: &'static str,
}

/// A rank variable that is set but unusable. Silently defaulting would start a job whose ranks
/// disagree on the world size and hang; an error names the variable instead.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RankEnvError {
    /// A variable is not a whole number.
    #[error("{var}={value:?} is not a non-negative whole number")]
    NotANumber {
        /// The variable.
        var: &'static str,
        /// Its value.
        value: String,
    },
    /// A variable is set but is not valid UTF-8 (so it cannot hold a number); ignoring it
    /// would silently make this process rank 0.
    #[error("{var} is set but is not valid UTF-8 ({value:?}); unset it or give a whole number")]
    NotUnicode {
        /// The variable.
        var: &'static str,
        /// Its value, with invalid bytes replaced.
        value: String,
    },
    /// `MASTER_PORT` is 0, which names no port a rank could connect to.
    #[error("MASTER_PORT=0 is not a port ranks can meet on; give a port from 1 to 65535")]
    PortZero,
    /// A rank is not below its size.
    #[error("{rank_var}={rank} is not below {size_var}={size}")]
    OutOfRange {
        /// The rank variable.
        rank_var: &'static str,
        /// Its value.
        rank: usize,
        /// The size variable.
        size_var: &'static str,
        /// Its value.
        size: usize,
    },
}

/// Variable names of one launcher, in the order tried.
struct Scheme {
    source: &'static str,
    rank: &'static [&'static str],
    size: &'static [&'static str],
    local_rank: &'static [&'static str],
    local_size: &'static [&'static str],
}

/// Tried in order; the first whose rank variable is set wins. torchrun's (and kiln's own)
/// names come first: when they are set, someone already did this mapping on purpose.
const SCHEMES: &[Scheme] = &[
    Scheme {
        source: "torchrun",
        rank: &["RANK"],
        size: &["WORLD_SIZE"],
        local_rank: &["LOCAL_RANK"],
        local_size: &["LOCAL_WORLD_SIZE"],
    },
    Scheme {
        source: "openmpi",
        rank: &["OMPI_COMM_WORLD_RANK"],
        size: &["OMPI_COMM_WORLD_SIZE"],
        local_rank: &["OMPI_COMM_WORLD_LOCAL_RANK"],
        local_size: &["OMPI_COMM_WORLD_LOCAL_SIZE"],
    },
    Scheme {
        source: "pmi",
        rank: &["PMI_RANK"],
        size: &["PMI_SIZE"],
        local_rank: &["MPI_LOCALRANKID", "PMI_LOCAL_RANK", "PALS_LOCAL_RANKID"],
        local_size: &["MPI_LOCALNRANKS", "PMI_LOCAL_SIZE", "PALS_LOCAL_SIZE"],
    },
    Scheme {
        source: "pals",
        rank: &["PALS_RANKID"],
        size: &["PMI_SIZE", "PALS_SIZE"],
        local_rank: &["PALS_LOCAL_RANKID", "PMI_LOCAL_RANK"],
        local_size: &["PALS_LOCAL_SIZE", "PMI_LOCAL_SIZE"],
    },
    // Inside an `srun` step SLURM_STEP_NUM_TASKS is the step's size; SLURM_NTASKS is the
    // allocation's, which differs when a step uses part of it.
    Scheme {
        source: "slurm",
        rank: &["SLURM_PROCID"],
        size: &["SLURM_STEP_NUM_TASKS", "SLURM_NTASKS", "SLURM_NPROCS"],
        local_rank: &["SLURM_LOCALID"],
        local_size: &[
            "SLURM_STEP_TASKS_PER_NODE",
            "SLURM_NTASKS_PER_NODE",
            "SLURM_TASKS_PER_NODE",
        ],
    },
];

/// Maps launcher variables (looked up through `vars`) onto a [`RankEnv`].
///
/// Missing sizes fall back conservatively: no world size means the launcher ran one process;
/// no local rank/size means one node (`local_rank = rank`, `local_world_size = world_size`).
pub fn rank_env_from(vars: impl Fn(&str) -> Option<String>) -> Result<RankEnv, RankEnvError> {
    let vars = Lookup(vars);
    let master_addr = vars.get("MASTER_ADDR");
    let master_port = match vars.get("MASTER_PORT") {
        Some(p) => match p.parse::<u16>() {
            Ok(0) => return Err(RankEnvError::PortZero),
            Ok(port) => Some(port),
            Err(_) => {
                return Err(RankEnvError::NotANumber {
                    var: "MASTER_PORT",
                    value: p,
                });
            }
        },
        None => None,
    };
    for scheme in SCHEMES {
        if let Some([rank, world_size, local_rank, local_world_size]) = scheme.read(&vars)? {
            return Ok(RankEnv {
                rank,
                local_rank,
                world_size,
                local_world_size,
                master_addr,
                master_port,
                source: scheme.source,
            });
        }
    }
    Ok(RankEnv {
        rank: 0,
        local_rank: 0,
        world_size: 1,
        local_world_size: 1,
        master_addr,
        master_port,
        source: "single",
    })
}

/// Environment variables through a lookup, trimmed, an empty value as unset.
struct Lookup<F>(F);

impl<F: Fn(&str) -> Option<String>> Lookup<F> {
    fn get(&self, k: &str) -> Option<String> {
        (self.0)(k)
            .map(|v| v.trim().to_string())
            .filter(|v| !v.is_empty())
    }

    /// The first of `names` that is set, with its number.
    fn num(
        &self,
        names: &'static [&'static str],
    ) -> Result<Option<(&'static str, usize)>, RankEnvError> {
        let Some((var, value)) = names.iter().find_map(|&var| Some((var, self.get(var)?))) else {
            return Ok(None);
        };
        // Slurm writes tasks per node as `4(x2),3`: the first count is this layout's common
        // case; a heterogeneous layout is better described by the launcher's own local size
        // variable, which comes first in the list.
        let head = value.split([',', '(']).next().unwrap_or("");
        head.parse::<usize>()
            .map(|n| Some((var, n)))
            .map_err(|_| RankEnvError::NotANumber { var, value })
    }
}

impl Scheme {
    /// `[rank, world size, local rank, local world size]` by this scheme's variables; `None`
    /// when its rank variable is unset, an error when a rank is not below its size.
    fn read<F: Fn(&str) -> Option<String>>(
        &self,
        vars: &Lookup<F>,
    ) -> Result<Option<[usize; 4]>, RankEnvError> {
        let Some((rank_var, rank)) = vars.num(self.rank)? else {
            return Ok(None);
        };
        let (size_var, world_size) = vars.num(self.size)?.unwrap_or(("(unset size)", 1));
        if rank >= world_size {
            return Err(RankEnvError::OutOfRange {
                rank_var,
                rank,
                size_var,
                size: world_size,
            });
        }
        let local = vars.num(self.local_rank)?;
        let local_size = vars.num(self.local_size)?;
        let (local_rank_var, local_rank) = local.unwrap_or((rank_var, rank));
        let (local_size_var, local_world_size) = local_size.unwrap_or(match local {
            Some(_) => ("(unset local size)", world_size),
            None => (size_var, world_size),
        });
        if local_rank >= local_world_size {
            return Err(RankEnvError::OutOfRange {
                rank_var: local_rank_var,
                rank: local_rank,
                size_var: local_size_var,
                size: local_world_size,
            });
        }
        Ok(Some([rank, world_size, local_rank, local_world_size]))
    }
}

/// Every variable [`rank_env_from`] may read, each once.
pub fn rank_variables() -> Vec<&'static str> {
    let mut names: Vec<&'static str> = vec!["MASTER_ADDR", "MASTER_PORT"];
    for s in SCHEMES {
        for &n in s
            .rank
            .iter()
            .chain(s.size)
            .chain(s.local_rank)
            .chain(s.local_size)
        {
            if !names.contains(&n) {
                names.push(n);
            }
        }
    }
    names
}

/// Like [`rank_env_from`], over a lookup that returns raw values: any rank variable that is
/// set but not valid UTF-8 is an error naming it (whether or not its scheme would be used).
pub fn rank_env_from_os(
    vars: impl Fn(&str) -> Option<std::ffi::OsString>,
) -> Result<RankEnv, RankEnvError> {
    for var in rank_variables() {
        if let Some(v) = vars(var)
            && v.to_str().is_none()
        {
            return Err(RankEnvError::NotUnicode {
                var,
                value: v.to_string_lossy().into_owned(),
            });
        }
    }
    rank_env_from(|k| vars(k).and_then(|v| v.into_string().ok()))
}

impl RankEnv {
    /// [`rank_env_from_os`] over this process's environment.
    pub fn from_process_env() -> Result<RankEnv, RankEnvError> {
        rank_env_from_os(|k| std::env::var_os(k))
    }

    /// The torchrun-style variables that describe this rank, for exporting to a child:
    /// `RANK`, `LOCAL_RANK`, `WORLD_SIZE`, `LOCAL_WORLD_SIZE`, and `MASTER_ADDR`/`MASTER_PORT`
    /// when known.
    pub fn to_vars(&self) -> Vec<(&'static str, String)> {
        let mut v = vec![
            ("RANK", self.rank.to_string()),
            ("LOCAL_RANK", self.local_rank.to_string()),
            ("WORLD_SIZE", self.world_size.to_string()),
            ("LOCAL_WORLD_SIZE", self.local_world_size.to_string()),
        ];
        if let Some(a) = &self.master_addr {
            v.push(("MASTER_ADDR", a.clone()));
        }
        if let Some(p) = self.master_port {
            v.push(("MASTER_PORT", p.to_string()));
        }
        v
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn from(pairs: &[(&str, &str)]) -> Result<RankEnv, RankEnvError> {
        let map: HashMap<String, String> = pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        rank_env_from(|k| map.get(k).cloned())
    }

    type Key = (usize, usize, usize, usize, &'static str);

    fn key(r: &RankEnv) -> Key {
        (
            r.rank,
            r.local_rank,
            r.world_size,
            r.local_world_size,
            r.source,
        )
    }

    #[test]
    fn every_launcher_maps() {
        let cases: &[(&[(&str, &str)], Key)] = &[
            (
                &[
                    ("RANK", "3"),
                    ("WORLD_SIZE", "8"),
                    ("LOCAL_RANK", "1"),
                    ("LOCAL_WORLD_SIZE", "2"),
                ],
                (3, 1, 8, 2, "torchrun"),
            ),
            (
                &[
                    ("OMPI_COMM_WORLD_RANK", "5"),
                    ("OMPI_COMM_WORLD_SIZE", "6"),
                    ("OMPI_COMM_WORLD_LOCAL_RANK", "2"),
                    ("OMPI_COMM_WORLD_LOCAL_SIZE", "3"),
                ],
                (5, 2, 6, 3, "openmpi"),
            ),
            (
                &[
                    ("PMI_RANK", "4"),
                    ("PMI_SIZE", "12"),
                    ("MPI_LOCALRANKID", "0"),
                    ("MPI_LOCALNRANKS", "4"),
                ],
                (4, 0, 12, 4, "pmi"),
            ),
            (
                &[
                    ("PALS_RANKID", "7"),
                    ("PALS_LOCAL_RANKID", "3"),
                    ("PMI_SIZE", "24"),
                    ("PALS_LOCAL_SIZE", "12"),
                ],
                (7, 3, 24, 12, "pals"),
            ),
            (
                &[
                    ("SLURM_PROCID", "9"),
                    ("SLURM_LOCALID", "1"),
                    ("SLURM_NTASKS", "16"),
                    ("SLURM_STEP_TASKS_PER_NODE", "4(x4)"),
                ],
                (9, 1, 16, 4, "slurm"),
            ),
            (&[], (0, 0, 1, 1, "single")),
        ];
        for (vars, want) in cases {
            assert_eq!(key(&from(vars).unwrap()), *want, "{vars:?}");
        }
    }

    #[test]
    fn torchrun_names_win_and_master_is_read() {
        let r = from(&[
            ("RANK", "1"),
            ("WORLD_SIZE", "2"),
            ("PMI_RANK", "0"),
            ("PMI_SIZE", "2"),
            ("MASTER_ADDR", "n1"),
            ("MASTER_PORT", "29500"),
        ])
        .unwrap();
        assert_eq!(
            (r.rank, r.master_addr.as_deref(), r.master_port),
            (1, Some("n1"), Some(29500))
        );
        assert_eq!(r.to_vars()[0], ("RANK", "1".to_string()));
    }

    #[test]
    fn bad_values_name_the_variable() {
        let e = from(&[("RANK", "x")]).unwrap_err().to_string();
        assert!(e.contains("RANK=\"x\""), "{e}");
        let e = from(&[("PMI_RANK", "4"), ("PMI_SIZE", "4")])
            .unwrap_err()
            .to_string();
        assert!(e.contains("PMI_RANK=4") && e.contains("PMI_SIZE=4"), "{e}");
        let e = from(&[("MASTER_PORT", "99999")]).unwrap_err().to_string();
        assert!(e.contains("MASTER_PORT"), "{e}");
        let e = from(&[("MASTER_PORT", "0")]).unwrap_err().to_string();
        assert!(e.contains("MASTER_PORT=0"), "{e}");
    }

    #[test]
    fn non_utf8_rank_variables_are_errors_naming_them() {
        use std::ffi::OsString;
        use std::os::unix::ffi::OsStringExt;
        for var in [
            "RANK",
            "PMI_RANK",
            "SLURM_LOCALID",
            "MASTER_PORT",
            "OMPI_COMM_WORLD_SIZE",
        ] {
            let lookup = |k: &str| (k == var).then(|| OsString::from_vec(b"\xff1".to_vec()));
            let e = rank_env_from_os(lookup).unwrap_err().to_string();
            assert!(
                e.starts_with(&format!("{var} is set but is not valid UTF-8")),
                "{e}"
            );
        }
        let ok = |k: &str| (k == "RANK").then(|| OsString::from("0"));
        assert_eq!(rank_env_from_os(ok).unwrap().source, "torchrun");
    }
}

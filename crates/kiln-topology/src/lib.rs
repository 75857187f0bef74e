//! Where a process runs: scheduler (PBS, Slurm, none), hosts, accelerators, and the rank environment of the current process.

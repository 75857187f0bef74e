//! Builds launcher argv (mpiexec, srun, mpirun, local) and supervises attempts: output capture, watchdogs, process-group kill, retries.

//! Run-directory conventions shared by every kiln component.
//!
//! A run directory holds everything an operator needs at 3 a.m., in plain files (the same
//! listing as [`layout::entries`], which `--help` prints):
//!
//! | file                        | written by      | what it holds                                  |
//! | --------------------------- | --------------- | ---------------------------------------------- |
//! | `config.toml`               | kiln train      | the effective config                           |
//! | `metrics.jsonl`             | kiln train      | one JSON line per step and per eval            |
//! | `events.jsonl`              | every component | one [`Event`] per line (see below)             |
//! | `checkpoints/step-<N>/`     | kiln train      | safetensors + `state.json` + `manifest.json`   |
//! | `checkpoints/rejected/`     | kiln train      | checkpoints moved aside; never deleted         |
//! | `model.safetensors`         | kiln train      | the final weights                              |
//! | `device-cache-<R>.db`       | kiln train      | GPU devices: rank R's kernel choices, kernels  |
//! | `train.lock`                | kiln train      | the one writer's lock (pid and host)           |
//! | `run_id`                    | kiln train      | the run's lineage                              |
//! | `attempt-<i>.log`           | kiln launch     | raw bytes of one attempt's output              |
//! | `progress/`                 | kiln launch     | beacons, exit, liveness, lost, node records    |
//! | `hostfile`                  | kiln launch     | the hosts used, when fewer than allocated      |
//! | `hostfile.release`          | kiln launch     | the hosts released at the end, when fewer      |
//! | `quarantine.jsonl`          | kiln launch     | hosts taken out of service, with the evidence  |
//! | `job.sbatch`, `job.pbs`     | kiln submit     | the batch script of every job of the chain     |
//! | `job-<id>.out`              | the scheduler   | a batch job's own output                       |
//! | `plots/`                    | kiln plot       | curves and the goodput timeline                |
//!
//! File names live in [`layout`], event names in [`event`], exit codes in [`exit`]. Two
//! helpers every component needs sit here too: [`files`] (bounded reads of regular files
//! only, for names taken from files a user received) and [`host`] (memory and cores this
//! process may use, for checks before allocating).
//!
//! Progress beacons live in `$KILN_PROGRESS_DIR/rank-<R>`: one line
//! `<step> <phase> <unix_time> <host>`, replaced atomically, so a supervisor can tell which
//! rank stopped advancing and on which host.

mod beacon;
pub mod event;
mod events;
pub mod exit;
pub mod files;
mod heartbeat;
pub mod host;
pub mod jsonl;
pub mod layout;
pub mod ledger;
pub mod node_state;
mod stop;
pub mod waiting_mark;

pub use beacon::{
    ATTEMPT_ENV, Beacon, BeaconError, ExitRecord, HOST_ENV, Liveness, MAX_RECORD, PROGRESS_DIR_ENV,
    RECORD_PREFIXES, RankFiles, clear_rank_files, is_record_name, parse_record_name, progress_dir,
    read_beacons, read_exit_records, read_liveness, record_rank, this_attempt, this_host,
    write_beacon, write_beacon_with_work, write_exit_record, write_liveness,
};
pub use events::{Event, EventLog, EventLogError, read_events, unix_time};
pub use heartbeat::{
    HEARTBEAT_EVERY, HEARTBEAT_FD_ENV, Heartbeat, LostRecord, read_lost_records, write_lost_record,
};
pub use stop::{StopRecord, clear_stop_request, read_stop_request, write_stop_request};

/// This machine's host name (as `hostname` prints it), for lock files, beacons and events;
/// `unknown` if it cannot be read.
pub fn host_name() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .ok()
        .map(|s| s.trim().to_string())
        .filter(|s| !s.is_empty())
        .or_else(|| std::env::var("HOSTNAME").ok())
        .unwrap_or_else(|| "unknown".into())
}

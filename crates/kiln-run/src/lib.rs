//! Run-directory conventions shared by every kiln component.
//!
//! A run directory holds everything an operator needs at 3 a.m., in plain files:
//!
//! | file                     | written by        | format                                   |
//! | ------------------------ | ----------------- | ---------------------------------------- |
//! | `config.toml`            | `kiln train`      | the effective config                     |
//! | `metrics.jsonl`          | `kiln train`      | one JSON object per logged step          |
//! | `events.jsonl`           | every component   | one [`Event`] per line (see below)       |
//! | `checkpoints/step-<N>/`  | `kiln train`      | safetensors + `state.json` + `manifest`  |
//! | `attempt-<i>.log`        | `kiln launch`     | raw bytes of one attempt's output        |
//!
//! File names live in [`layout`], event names in [`event`], exit codes in [`exit`].
//!
//! Progress beacons live in `$KILN_PROGRESS_DIR/rank-<R>`: one line `<step> <phase> <unix_time>`,
//! replaced atomically, so a supervisor can tell which rank stopped advancing.

mod beacon;
pub mod event;
mod events;
pub mod exit;
pub mod jsonl;
pub mod layout;

pub use beacon::{Beacon, BeaconError, PROGRESS_DIR_ENV, read_beacons, write_beacon};
pub use events::{Event, EventLog, EventLogError, read_events, unix_time};

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

/// Exit code of a process that was asked to stop; see [`exit::PREEMPTED`].
pub const EXIT_PREEMPTED: i32 = exit::PREEMPTED;

/// Exit code of a watchdog kill; see [`exit::WATCHDOG`].
pub const EXIT_WATCHDOG: i32 = exit::WATCHDOG;

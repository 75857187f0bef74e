//! [`Startup`]: when each phase from the process's start to its first step ended (MPI init,
//! the run directory, data open, model init, checkpoint load, first step), reported once as
//! the `startup_phases` event. The process's own start time is read from the kernel, so the
//! ledger can also tell the launcher's spawn time (its `attempt_start` to the process start).

use crate::components::journal::Journal;
use crate::error::TrainError;
use kiln_run::event;
use serde_json::{Map, Value};

/// Phase names (the event's fields are `<phase>_s`).
pub use kiln_run::event::phase;

/// The phase clock (see the module documentation).
#[derive(Debug, Clone)]
pub struct Startup {
    process_start: Option<f64>,
    begun: f64,
    marks: Vec<(&'static str, f64)>,
    reported: bool,
}

impl Startup {
    /// Starts the clock (at the top of `train`).
    pub fn begin() -> Self {
        Self {
            process_start: process_start_time(),
            begun: kiln_run::unix_time(),
            marks: Vec::new(),
            reported: false,
        }
    }

    /// `phase` ended now.
    pub fn mark(&mut self, phase: &'static str) {
        if !self.reported {
            self.marks.push((phase, kiln_run::unix_time()));
        }
    }

    /// The first step is done: reports every phase once.
    pub fn first_step(&mut self, journal: &mut Journal) -> Result<(), TrainError> {
        if self.reported {
            return Ok(());
        }
        self.mark(phase::FIRST_STEP);
        self.reported = true;
        let start = self.process_start.unwrap_or(self.begun);
        let mut fields = Map::new();
        fields.insert("process_start".into(), Value::from(start));
        let mut prev = start;
        for &(name, at) in &self.marks {
            fields.insert(format!("{name}_s"), Value::from((at - prev).max(0.0)));
            prev = at;
        }
        let largest = self
            .marks
            .iter()
            .scan(start, |p, &(n, at)| {
                Some((n, at - std::mem::replace(p, at)))
            })
            .max_by(|a, b| a.1.total_cmp(&b.1))
            .map(|(n, _)| n);
        fields.insert("largest".into(), Value::from(largest));
        journal.emit(event::STARTUP_PHASES, Value::Object(fields))
    }
}

/// The unix time this process started: its start in clock ticks after boot
/// (`/proc/self/stat`, field 22) set against the time since boot now (`CLOCK_BOOTTIME`);
/// `None` where they cannot be read.
fn process_start_time() -> Option<f64> {
    let stat = std::fs::read_to_string("/proc/self/stat").ok()?;
    // Fields after the command name (which may hold spaces) start at field 3.
    let after = stat.rsplit_once(')')?.1;
    let ticks: f64 = after.split_whitespace().nth(19)?.parse().ok()?;
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: sysconf has no memory effects; clock_gettime writes the timespec we own.
    let (hz, rc) = unsafe {
        (
            libc::sysconf(libc::_SC_CLK_TCK),
            libc::clock_gettime(libc::CLOCK_BOOTTIME, &mut ts),
        )
    };
    if hz <= 0 || rc != 0 {
        return None;
    }
    let since_boot = ts.tv_sec as f64 + ts.tv_nsec as f64 * 1e-9;
    Some(kiln_run::unix_time() - (since_boot - ticks / hz as f64))
}

#[cfg(test)]
mod tests {
    use super::process_start_time;

    #[test]
    fn this_process_started_in_the_past_few_hours() {
        let now = kiln_run::unix_time();
        let start = process_start_time().expect("Linux has /proc");
        assert!(
            start <= now + 1.0 && start > now - 86_400.0,
            "{start} vs {now}"
        );
    }
}

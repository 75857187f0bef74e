//! Signals sent to kiln itself (Ctrl-C, `kill`, a scheduler's walltime warning): recorded by
//! an async-signal-safe handler, acted on by the supervision loop, which forwards them.

use std::sync::atomic::{AtomicI32, AtomicU32, Ordering};

static LAST_SIGNAL: AtomicI32 = AtomicI32::new(0);
static SIGNAL_COUNT: AtomicU32 = AtomicU32::new(0);

/// A request to stop, from a signal kiln received.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StopRequest {
    /// The signal number (SIGINT, SIGTERM, SIGUSR1, SIGHUP).
    pub signal: i32,
    /// How many stop signals arrived so far: a second one escalates to SIGKILL.
    pub count: u32,
}

extern "C" fn on_signal(sig: libc::c_int) {
    // Only atomics here: anything else is not async-signal-safe.
    LAST_SIGNAL.store(sig, Ordering::SeqCst);
    SIGNAL_COUNT.fetch_add(1, Ordering::SeqCst);
}

/// Installs handlers for SIGINT, SIGTERM, SIGHUP and SIGUSR1 (Slurm's `--signal` and PBS
/// send those before the walltime). Call once, before starting ranks.
pub fn install_stop_handlers() -> Result<(), nix::Error> {
    use nix::sys::signal::{SaFlags, SigAction, SigHandler, SigSet, Signal, sigaction};
    let action = SigAction::new(
        SigHandler::Handler(on_signal),
        SaFlags::SA_RESTART,
        SigSet::empty(),
    );
    for sig in [
        Signal::SIGINT,
        Signal::SIGTERM,
        Signal::SIGHUP,
        Signal::SIGUSR1,
    ] {
        // SAFETY: the handler only touches atomics, which is async-signal-safe.
        unsafe { sigaction(sig, &action) }?;
    }
    Ok(())
}

/// The latest stop request, if any signal arrived since the handlers were installed.
pub fn stop_requested() -> Option<StopRequest> {
    let count = SIGNAL_COUNT.load(Ordering::SeqCst);
    (count > 0).then(|| StopRequest {
        signal: LAST_SIGNAL.load(Ordering::SeqCst),
        count,
    })
}

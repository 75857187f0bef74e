//! A pseudo-terminal for a rank's stdout. Programs buffer stdout in blocks when it is a pipe
//! (Python, C stdio): a rank that prints one line per step would look silent to the watchdog
//! and lose its last lines when killed. On a terminal they flush every line, as under
//! `mpirun`, which gives ranks a pty too. The terminal is raw (no `\n` -> `\r\n`, no echo),
//! so the bytes kiln logs are the bytes the program wrote.

use nix::fcntl::OFlag;
use nix::pty::{grantpt, posix_openpt, ptsname_r, unlockpt};
use nix::sys::termios::{SetArg, cfmakeraw, tcgetattr, tcsetattr};
use std::fs::File;
use std::os::fd::{AsRawFd, FromRawFd, IntoRawFd, OwnedFd};

/// Columns and rows the terminal reports (progress bars size themselves to it).
const COLS: u16 = 160;
const ROWS: u16 = 48;

/// A pty pair: kiln reads `master`; the rank's stdout is `slave`.
pub struct Pty {
    /// The side kiln reads.
    pub master: File,
    /// The side handed to the child as stdout.
    pub slave: OwnedFd,
}

/// Opens a raw pty with both ends close-on-exec (so no other child inherits them and keeps
/// the terminal open after the rank exits). `None` if the system has no ptys left.
pub fn open_raw_pty() -> Option<Pty> {
    let master = posix_openpt(OFlag::O_RDWR | OFlag::O_NOCTTY | OFlag::O_CLOEXEC).ok()?;
    grantpt(&master).ok()?;
    unlockpt(&master).ok()?;
    let name = ptsname_r(&master).ok()?;
    let slave: OwnedFd = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .custom_flags_noctty()
        .open(name)
        .ok()?
        .into();
    let mut t = tcgetattr(&slave).ok()?;
    cfmakeraw(&mut t);
    tcsetattr(&slave, SetArg::TCSANOW, &t).ok()?;
    let size = libc::winsize {
        ws_row: ROWS,
        ws_col: COLS,
        ws_xpixel: 0,
        ws_ypixel: 0,
    };
    // SAFETY: TIOCSWINSZ reads one winsize struct that lives for the call.
    unsafe { libc::ioctl(slave.as_raw_fd(), libc::TIOCSWINSZ, &size) };
    // SAFETY: into_raw_fd hands over sole ownership of a valid, open descriptor.
    let master = unsafe { OwnedFd::from_raw_fd(master.into_raw_fd()) };
    Some(Pty {
        master: File::from(master),
        slave,
    })
}

trait NoCtty {
    fn custom_flags_noctty(&mut self) -> &mut Self;
}

impl NoCtty for std::fs::OpenOptions {
    /// The slave must not become kiln's controlling terminal (kiln may have none).
    fn custom_flags_noctty(&mut self) -> &mut Self {
        use std::os::unix::fs::OpenOptionsExt;
        // std opens with O_CLOEXEC already.
        self.custom_flags(libc::O_NOCTTY)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Read;
    use std::process::{Command, Stdio};

    #[test]
    fn a_child_sees_a_terminal_and_its_bytes_arrive_unchanged() {
        let pty = open_raw_pty().expect("a pty");
        let mut child = Command::new("sh")
            .args(["-c", "[ -t 1 ] && printf 'tty\\n\\377end'"])
            .stdout(Stdio::from(pty.slave))
            .spawn()
            .unwrap();
        let mut master = pty.master;
        let mut out = Vec::new();
        let mut buf = [0u8; 256];
        // EIO once the child (the only holder of the slave) is gone.
        while let Ok(n) = master.read(&mut buf) {
            if n == 0 {
                break;
            }
            out.extend_from_slice(&buf[..n]);
        }
        assert!(child.wait().unwrap().success());
        assert_eq!(out, b"tty\n\xffend");
    }
}

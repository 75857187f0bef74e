//! Progress bars for long work: drawn on stderr only when it is a terminal (and
//! `KILN_NO_PROGRESS` is unset), so logs and CI output stay clean.

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use std::io::IsTerminal;

/// Whether progress bars are drawn.
pub fn enabled() -> bool {
    std::io::stderr().is_terminal() && std::env::var_os("KILN_NO_PROGRESS").is_none()
}

/// A bar over `len` units with rate and ETA, or a hidden one.
pub fn bar(len: u64, msg: &str) -> ProgressBar {
    if !enabled() {
        return ProgressBar::hidden();
    }
    let pb = ProgressBar::with_draw_target(Some(len), ProgressDrawTarget::stderr());
    if let Ok(style) = ProgressStyle::with_template(
        "{msg:>10} [{bar:30}] {human_pos}/{human_len} {per_sec} eta {eta}",
    ) {
        pb.set_style(style.progress_chars("=> "));
    }
    pb.set_message(msg.to_string());
    pb
}

/// A byte-counting bar (`MiB/s`), or a hidden one.
pub fn bytes_bar(len: u64, msg: &str) -> ProgressBar {
    if !enabled() {
        return ProgressBar::hidden();
    }
    let pb = ProgressBar::with_draw_target(Some(len), ProgressDrawTarget::stderr());
    if let Ok(style) = ProgressStyle::with_template(
        "{msg:>10} [{bar:30}] {bytes}/{total_bytes} {bytes_per_sec} eta {eta}",
    ) {
        pb.set_style(style.progress_chars("=> "));
    }
    pb.set_message(msg.to_string());
    pb
}

//! The processes' output as kiln reads it: raw bytes echoed, teed to the attempt log and
//! scanned for progress (a step counter per source), by one thread per stream; what they saw
//! is [`Shared`] with the watch loop.

use crate::progress::{LineSplitter, ProgressRegex, StepCounter};
use std::collections::BTreeMap;
use std::fs::File;
use std::io::{Read, Write};
use std::sync::{Arc, Mutex};
use std::time::Instant;

/// What the output readers saw, read by the watch loop.
#[derive(Default)]
pub(super) struct Shared {
    pub(super) last_output: Option<Instant>,
    /// Output-derived progress per source (rank for local spawns, `None` for a launcher).
    pub(super) output_progress: BTreeMap<Option<usize>, (u64, Instant)>,
    /// Each output source's step counter (what counts as progress).
    output_counters: BTreeMap<Option<usize>, StepCounter>,
    /// When progress first and last advanced (output or beacons).
    pub(super) first_advance: Option<Instant>,
    pub(super) last_advance: Option<Instant>,
}

impl Shared {
    /// Nothing seen yet; the silence watchdog counts from `start`.
    pub(super) fn started(start: Instant) -> Self {
        Shared {
            last_output: Some(start),
            ..Shared::default()
        }
    }

    /// Progress advanced at `now` (by output or beacons).
    pub(super) fn advanced(&mut self, now: Instant) {
        self.first_advance.get_or_insert(now);
        self.last_advance = Some(now);
    }

    /// Records steps seen in the output of `source`.
    fn note_steps(&mut self, source: Option<usize>, steps: Vec<u64>, now: Instant) {
        let mut moved = false;
        for step in steps {
            moved |= self.advance(source, step, now);
        }
        if moved {
            self.advanced(now);
        }
    }

    /// Records a step seen in the output; returns whether it is progress (see
    /// [`StepCounter`]: a printed step means a step completed, so the first one counts too).
    fn advance(&mut self, source: Option<usize>, step: u64, now: Instant) -> bool {
        if !self
            .output_counters
            .entry(source)
            .or_default()
            .observe(step)
        {
            return false;
        }
        self.output_progress.insert(source, (step, now));
        true
    }
}

/// Where one reader sends what it reads.
pub(super) struct ReaderCtx {
    pub(super) echo: bool,
    pub(super) to_stderr: bool,
    pub(super) log: Arc<Mutex<File>>,
    pub(super) shared: Arc<Mutex<Shared>>,
    pub(super) regex: Option<ProgressRegex>,
    pub(super) source: Option<usize>,
}

/// Whole lines of one stream, for the echo and the log: the streams of several ranks share
/// kiln's output and the attempt log, so each writes complete lines only (up to its last
/// `\n` or `\r`; a line longer than [`crate::progress::MAX_LINE`] in pieces), and a last
/// line without its end gets one, so that two ranks' lines never run into each other
/// (`rank 0 donerank 1 done`).
#[derive(Default)]
struct Lines {
    pending: Vec<u8>,
}

impl Lines {
    /// The complete lines `chunk` ends (with what came before it), if any.
    fn feed(&mut self, chunk: &[u8]) -> Option<Vec<u8>> {
        self.pending.extend_from_slice(chunk);
        let end = match self.pending.iter().rposition(|&b| b == b'\n' || b == b'\r') {
            Some(i) => i + 1,
            None if self.pending.len() >= crate::progress::MAX_LINE => self.pending.len(),
            None => return None,
        };
        let rest = self.pending.split_off(end);
        Some(std::mem::replace(&mut self.pending, rest))
    }

    /// What is left at the end of the stream, ended with a newline.
    fn finish(&mut self) -> Option<Vec<u8>> {
        if self.pending.is_empty() {
            return None;
        }
        let mut last = std::mem::take(&mut self.pending);
        last.push(b'\n');
        Some(last)
    }
}

/// Echoes and logs `lines` (whole lines of one stream); returns whether the echo still works.
fn pass_on(lines: &[u8], echo: bool, ctx: &ReaderCtx) -> bool {
    let echo = echo && echo_chunk(lines, ctx.to_stderr).is_ok();
    if let Ok(mut f) = ctx.log.lock() {
        let _ = f.write_all(lines);
    }
    echo
}

/// Reads raw bytes until EOF: echo and tee them (line by line, see [`Lines`]), and scan for
/// progress. Invalid UTF-8 or escape codes cannot stop it; write errors (a closed terminal)
/// only stop the echo.
pub(super) fn read_stream(mut pipe: Box<dyn Read + Send>, ctx: ReaderCtx) {
    let mut buf = vec![0u8; 64 * 1024];
    let mut splitter = LineSplitter::default();
    let mut lines = Lines::default();
    let mut echo = ctx.echo;
    loop {
        let n = match pipe.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(_) => break,
        };
        let chunk = &buf[..n];
        if let Some(whole) = lines.feed(chunk) {
            echo = pass_on(&whole, echo, &ctx);
        }
        let now = Instant::now();
        let mut steps = Vec::new();
        if let Some(re) = &ctx.regex {
            splitter.feed(chunk, |line| steps.extend(re.find(line)));
        }
        if let Ok(mut s) = ctx.shared.lock() {
            s.last_output = Some(now);
            s.note_steps(ctx.source, steps, now);
        }
    }
    if let Some(last) = lines.finish() {
        pass_on(&last, echo, &ctx);
    }
    if let Some(re) = &ctx.regex {
        let mut steps = Vec::new();
        splitter.finish(|line| steps.extend(re.find(line)));
        if let Ok(mut s) = ctx.shared.lock() {
            s.note_steps(ctx.source, steps, Instant::now());
        }
    }
}

/// Passes whole lines through to kiln's stdout or stderr.
fn echo_chunk(chunk: &[u8], to_stderr: bool) -> std::io::Result<()> {
    if to_stderr {
        let mut e = std::io::stderr().lock();
        e.write_all(chunk).and_then(|()| e.flush())
    } else {
        let mut o = std::io::stdout().lock();
        o.write_all(chunk).and_then(|()| o.flush())
    }
}

#[cfg(test)]
mod tests {
    use super::Lines;

    #[test]
    fn lines_pass_whole_and_the_last_one_gets_its_end() {
        let mut l = Lines::default();
        assert_eq!(l.feed(b"rank 0 "), None);
        assert_eq!(
            l.feed(b"part\nrank 0 tail").as_deref(),
            Some(&b"rank 0 part\n"[..])
        );
        assert_eq!(
            l.feed(b" 50%\r").as_deref(),
            Some(&b"rank 0 tail 50%\r"[..])
        );
        assert_eq!(l.feed(b"done"), None);
        assert_eq!(l.finish().as_deref(), Some(&b"done\n"[..]));
        assert_eq!(l.finish(), None);
        let long = vec![b'x'; crate::progress::MAX_LINE];
        assert_eq!(l.feed(&long).map(|v| v.len()), Some(long.len()));
    }
}

//! Progress from output: byte chunks -> lines (lossy UTF-8, ANSI escapes stripped) -> the
//! largest step number the progress regex finds.

use regex::Regex;

/// Default progress regex: `step=12`, `step: 12` and torchtitan's `step:  12`, any case.
pub const DEFAULT_PROGRESS_REGEX: &str = r"(?i)\bstep\s*[=:]\s*(\d+)";

/// A compiled progress regex: the first capture group (or the one named `step`) is the step.
#[derive(Debug, Clone)]
pub struct ProgressRegex(Regex);

impl ProgressRegex {
    /// Compiles `pattern`; it must have a capture group holding the number.
    pub fn new(pattern: &str) -> Result<Self, String> {
        let re = Regex::new(pattern).map_err(|e| format!("--progress-regex {pattern:?}: {e}"))?;
        if re.captures_len() < 2 {
            return Err(format!(
                "--progress-regex {pattern:?} has no capture group: wrap the step number in (...), e.g. step=(\\d+)"
            ));
        }
        Ok(Self(re))
    }

    /// The largest step number in `line`, if any.
    pub fn find(&self, line: &str) -> Option<u64> {
        self.0
            .captures_iter(line)
            .filter_map(|c| c.name("step").or_else(|| c.get(1)))
            .filter_map(|m| m.as_str().parse::<u64>().ok())
            .max()
    }
}

/// The largest number taken as a step: no run takes 10^12 steps, so a larger value (or one
/// that does not fit 64 bits) is noise, such as a hash or an uninitialised counter.
pub const MAX_PLAUSIBLE_STEP: u64 = 1_000_000_000_000;

/// One output source's step counter as its lines show it. A step counts as progress when it
/// is plausible and moves forward from the last one counted; a step at most half of that is
/// the counter starting again (a new run of the program printing from 1), which counts and
/// becomes the new base. Values in between (a rank a step behind, a heartbeat repeating an
/// older step) are not progress, so a stuck job does not look busy.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct StepCounter {
    last: Option<u64>,
}

impl StepCounter {
    /// Feeds a step printed by the source; returns whether it is progress.
    pub fn observe(&mut self, step: u64) -> bool {
        if step > MAX_PLAUSIBLE_STEP {
            return false;
        }
        let counts = match self.last {
            None => true,
            Some(last) => step > last || step <= last / 2 && step < last,
        };
        if counts {
            self.last = Some(step);
        }
        counts
    }

    /// The last step counted.
    pub fn step(&self) -> Option<u64> {
        self.last
    }
}

/// Removes terminal escape sequences (CSI `ESC [ ... final`, OSC `ESC ] ... BEL/ST`, and
/// two-byte `ESC x`) so that a colored `step=\x1b[1m12` still reads as `step=12`.
pub fn strip_ansi(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut chars = text.chars().peekable();
    while let Some(c) = chars.next() {
        if c != '\x1b' {
            out.push(c);
            continue;
        }
        match chars.next() {
            Some('[') => {
                // Parameters and intermediates, then one final byte in @..~.
                for c in chars.by_ref() {
                    if ('@'..='~').contains(&c) {
                        break;
                    }
                }
            }
            Some(']') => {
                while let Some(c) = chars.next() {
                    if c == '\x07' {
                        break;
                    }
                    if c == '\x1b' && chars.peek() == Some(&'\\') {
                        chars.next();
                        break;
                    }
                }
            }
            _ => {}
        }
    }
    out
}

/// Splits a byte stream into lines at `\n` or `\r` (progress bars redraw with `\r`). A line
/// that never ends is cut at `MAX_LINE` bytes so memory stays bounded.
#[derive(Debug, Default)]
pub struct LineSplitter {
    partial: Vec<u8>,
}

/// Longest line kept whole; longer output is processed in pieces of this size.
pub const MAX_LINE: usize = 64 * 1024;

impl LineSplitter {
    /// Feeds a chunk; calls `on_line` with each complete line (decoded lossily, ANSI stripped).
    pub fn feed(&mut self, chunk: &[u8], mut on_line: impl FnMut(&str)) {
        for &b in chunk {
            if b == b'\n' || b == b'\r' {
                self.flush(&mut on_line);
            } else {
                self.partial.push(b);
                if self.partial.len() >= MAX_LINE {
                    self.flush(&mut on_line);
                }
            }
        }
    }

    /// Processes whatever is left (end of stream).
    pub fn finish(&mut self, mut on_line: impl FnMut(&str)) {
        self.flush(&mut on_line);
    }

    fn flush(&mut self, on_line: &mut impl FnMut(&str)) {
        if !self.partial.is_empty() {
            on_line(&strip_ansi(&String::from_utf8_lossy(&self.partial)));
            self.partial.clear();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn default_regex_matches_both_styles() {
        let re = ProgressRegex::new(DEFAULT_PROGRESS_REGEX).unwrap();
        assert_eq!(re.find("step=12 loss=3.1"), Some(12));
        assert_eq!(re.find("[titan] step:  12  loss:  7.9"), Some(12));
        assert_eq!(re.find("Step: 7"), Some(7));
        assert_eq!(re.find("heartbeat"), None);
        assert_eq!(re.find("steps=4"), None);
        assert!(ProgressRegex::new("step=\\d+").is_err());
        assert!(ProgressRegex::new("(").is_err());
        let named = ProgressRegex::new(r"it (?<x>\d+)/(?<step>\d+)").unwrap();
        assert_eq!(named.find("it 3/9"), Some(9));
    }

    #[test]
    fn ansi_and_invalid_utf8_do_not_hide_progress() {
        let re = ProgressRegex::new(DEFAULT_PROGRESS_REGEX).unwrap();
        let mut lines = Vec::new();
        let mut s = LineSplitter::default();
        s.feed(b"\x1b[32mstep=\x1b[1m4\x1b[0m\n\xff\xfe step", |l| {
            lines.push(l.to_string())
        });
        s.feed(b"=5\rtail \x1b]0;title\x07done", |l| {
            lines.push(l.to_string())
        });
        s.finish(|l| lines.push(l.to_string()));
        assert_eq!(lines[0], "step=4");
        assert_eq!(re.find(&lines[1]), Some(5));
        assert_eq!(lines[2], "tail done");
    }

    #[test]
    fn steps_count_when_plausible_and_forward_and_a_restart_is_not_a_stall() {
        let counts = |steps: &[u64]| {
            let mut c = StepCounter::default();
            steps.iter().map(|&s| c.observe(s)).collect::<Vec<_>>()
        };
        // A garbage value first: not a step; the healthy count that follows is progress.
        assert_eq!(counts(&[u64::MAX, 1, 2, 3]), [false, true, true, true]);
        // A counter that starts again (a new run printing from 1) goes on counting.
        assert_eq!(
            counts(&[7, 8, 1, 2, 8, 9]),
            [true, true, true, true, true, true]
        );
        // Repeats and a rank one step behind are not progress.
        assert_eq!(
            counts(&[10, 10, 9, 10, 9]),
            [true, false, false, false, false]
        );
        let mut c = StepCounter::default();
        assert!(c.observe(MAX_PLAUSIBLE_STEP) && !c.observe(MAX_PLAUSIBLE_STEP + 1));
        assert_eq!(c.step(), Some(MAX_PLAUSIBLE_STEP));
    }

    proptest! {
        #[test]
        fn any_bytes_are_survived(chunks in prop::collection::vec(prop::collection::vec(any::<u8>(), 0..200), 0..8)) {
            let mut s = LineSplitter::default();
            let mut n = 0usize;
            for c in &chunks {
                s.feed(c, |l| n += l.len());
            }
            s.finish(|l| n += l.len());
            prop_assert!(n <= chunks.iter().map(|c| c.len() * 3).sum::<usize>());
        }
    }
}

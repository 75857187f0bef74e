//! `events.jsonl`: an append-only log of what happened to a run, one JSON object per line.

use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};
use std::fs::File;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::{SystemTime, UNIX_EPOCH};

/// Errors of the event log.
#[derive(Debug, thiserror::Error)]
pub enum EventLogError {
    /// The log file could not be opened or written.
    #[error("event log {path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The cause.
        source: std::io::Error,
    },
    /// A line is not a JSON object with `time` and `event`.
    #[error("event log {path} line {line}: {message}")]
    Parse {
        /// The file.
        path: PathBuf,
        /// 1-based line number.
        line: usize,
        /// What is wrong.
        message: String,
    },
}

/// Seconds since the Unix epoch, as a float (sub-second resolution).
pub fn unix_time() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs_f64())
        .unwrap_or(0.0)
}

/// One line of `events.jsonl`: `{"time": <unix s>, "source": "train", "event": "resume", ...fields}`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Event {
    /// Unix time in seconds.
    pub time: f64,
    /// Which component wrote it (`train`, `launch`, `supervise`, ...).
    pub source: String,
    /// What happened (`start`, `resume`, `checkpoint_saved`, `attempt_end`, ...).
    pub event: String,
    /// Everything else, flattened into the same object.
    #[serde(flatten)]
    pub fields: Map<String, Value>,
}

/// Appends events to `RUN_DIR/events.jsonl`. Each event is one `write` of one line, so lines
/// from several processes appending to the same file never interleave (O_APPEND).
#[derive(Debug)]
pub struct EventLog {
    path: PathBuf,
    file: File,
    source: String,
}

impl EventLog {
    /// Opens (creating) `dir/events.jsonl` for appending; `source` names the writer.
    pub fn open(dir: &Path, source: &str) -> Result<Self, EventLogError> {
        let path = dir.join(crate::layout::EVENTS);
        let io = |source| EventLogError::Io {
            path: path.clone(),
            source,
        };
        std::fs::create_dir_all(dir).map_err(io)?;
        let (file, cut) = crate::jsonl::open_append(&path).map_err(io)?;
        let mut log = Self {
            path,
            file,
            source: source.to_string(),
        };
        if cut > 0 {
            let path = log.path.display().to_string();
            log.emit(
                crate::event::LOG_REPAIRED,
                serde_json::json!({"path": path, "bytes_removed": cut}),
            )?;
        }
        Ok(log)
    }

    /// The file written to.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Appends one event; `fields` must serialize to a JSON object (or `()`/null for none).
    pub fn emit<T: Serialize>(&mut self, event: &str, fields: T) -> Result<(), EventLogError> {
        let fields = match serde_json::to_value(fields) {
            Ok(Value::Object(map)) => map,
            _ => Map::new(),
        };
        let record = Event {
            time: unix_time(),
            source: self.source.clone(),
            event: event.to_string(),
            fields,
        };
        let mut line = serde_json::to_vec(&record).unwrap_or_default();
        line.push(b'\n');
        self.file
            .write_all(&line)
            .and_then(|()| self.file.flush())
            .map_err(|source| EventLogError::Io {
                path: self.path.clone(),
                source,
            })
    }
}

/// Reads every event of `dir/events.jsonl` (an absent file is an empty log). A torn last line
/// (a writer killed mid-write) is skipped; any other malformed line is an error naming it.
pub fn read_events(dir: &Path) -> Result<Vec<Event>, EventLogError> {
    let path = dir.join(crate::layout::EVENTS);
    let parse = |line: &str| {
        serde_json::from_str::<Event>(line)
            .map(Some)
            .map_err(|e| e.to_string())
    };
    crate::jsonl::read_jsonl(&path, crate::jsonl::MAX_LINE_BYTES, parse).map_err(|e| match e {
        crate::jsonl::JsonlError::Io(source) => EventLogError::Io { path, source },
        crate::jsonl::JsonlError::Line { line, message } => EventLogError::Parse {
            path,
            line,
            message,
        },
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn events_round_trip_and_torn_tail_is_skipped() {
        let dir = tempfile::tempdir().unwrap();
        let mut log = EventLog::open(dir.path(), "train").unwrap();
        log.emit("start", json!({"step": 0})).unwrap();
        log.emit("exit", ()).unwrap();
        std::fs::OpenOptions::new()
            .append(true)
            .open(log.path())
            .unwrap()
            .write_all(b"{\"time\": 1, \"sou")
            .unwrap();
        let events = read_events(dir.path()).unwrap();
        assert_eq!(events.len(), 2);
        assert_eq!(events[0].event, "start");
        assert_eq!(events[0].fields["step"], json!(0));
        assert_eq!(events[1].source, "train");
    }

    #[test]
    fn malformed_middle_line_names_the_line() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(
            dir.path().join("events.jsonl"),
            "not json\n{\"time\":1,\"source\":\"a\",\"event\":\"b\"}\n",
        )
        .unwrap();
        let err = read_events(dir.path()).unwrap_err().to_string();
        assert!(err.contains("line 1"), "{err}");
    }
}

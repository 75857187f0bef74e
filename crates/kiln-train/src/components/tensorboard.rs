//! TensorBoard event files (`metrics.tensorboard = true`): the run's scalars (loss, gradient
//! norm, LR, tokens/s, MFU, step time, eval metrics) and the guards' events as text, in
//! `RUN_DIR/tensorboard/events.out.tfevents.<time>.<host>`, as torchtitan writes them.
//!
//! The format is TensorBoard's own: TFRecord framing (length, masked CRC-32C of the length,
//! the bytes, masked CRC-32C of the bytes) around `tensorflow.Event` protocol buffers
//! (`event.proto`, `summary.proto`; the few messages used are declared below with `prost`'s
//! derive, no code generation). No maintained crate writes tfevents (`tensorboard-rs` was
//! last released in 2020), and the framing is a dozen lines.
//!
//! A run keeps one event file. On every start the file is cut after the last intact record of
//! a step at or before the step the run starts from, then appended to: a resumed run writes
//! the steps after its checkpoint once more, and the file holds each step once (a torn last
//! record, from a kill mid-write, is cut too).

use crate::error::{TrainError, io};
use prost::Message;
use std::fs::File;
use std::io::{BufReader, Read, Seek, Write};
use std::path::{Path, PathBuf};

/// The folder of the event file in the run directory.
pub const DIR: &str = "tensorboard";
/// What every TensorBoard event file name holds.
const MARK: &str = "events.out.tfevents.";
/// The largest record read back (kiln's are a few hundred bytes); a longer length field is
/// damage, and the file is cut there.
const MAX_RECORD: u64 = 16 << 20;
/// `tensorflow.DataType.DT_STRING`.
const DT_STRING: i32 = 7;

/// `tensorflow.Event`.
#[derive(Clone, PartialEq, Message)]
pub struct Event {
    /// Seconds since the epoch.
    #[prost(double, tag = "1")]
    pub wall_time: f64,
    /// The training step.
    #[prost(int64, tag = "2")]
    pub step: i64,
    /// What the event holds.
    #[prost(oneof = "What", tags = "3, 5")]
    pub what: Option<What>,
}

/// `Event.what`.
#[derive(Clone, PartialEq, prost::Oneof)]
pub enum What {
    /// `file_version`: the first event of a file.
    #[prost(string, tag = "3")]
    FileVersion(String),
    /// `summary`.
    #[prost(message, tag = "5")]
    Summary(Summary),
}

/// `tensorflow.Summary`.
#[derive(Clone, PartialEq, Message)]
pub struct Summary {
    /// The values.
    #[prost(message, repeated, tag = "1")]
    pub value: Vec<Value>,
}

/// `tensorflow.Summary.Value`.
#[derive(Clone, PartialEq, Message)]
pub struct Value {
    /// The series' name.
    #[prost(string, tag = "1")]
    pub tag: String,
    /// Which plugin reads it (text).
    #[prost(message, optional, tag = "9")]
    pub metadata: Option<SummaryMetadata>,
    /// The value.
    #[prost(oneof = "Kind", tags = "2, 8")]
    pub kind: Option<Kind>,
}

/// `Summary.Value.value`.
#[derive(Clone, PartialEq, prost::Oneof)]
pub enum Kind {
    /// `simple_value`: a scalar.
    #[prost(float, tag = "2")]
    SimpleValue(f32),
    /// `tensor`: here a scalar string (text).
    #[prost(message, tag = "8")]
    Tensor(TensorProto),
}

/// `tensorflow.SummaryMetadata`.
#[derive(Clone, PartialEq, Message)]
pub struct SummaryMetadata {
    /// `plugin_data`.
    #[prost(message, optional, tag = "1")]
    pub plugin_data: Option<PluginData>,
}

/// `SummaryMetadata.PluginData`.
#[derive(Clone, PartialEq, Message)]
pub struct PluginData {
    /// `plugin_name`.
    #[prost(string, tag = "1")]
    pub plugin_name: String,
}

/// `tensorflow.TensorProto` (a scalar string).
#[derive(Clone, PartialEq, Message)]
pub struct TensorProto {
    /// `dtype`.
    #[prost(int32, tag = "1")]
    pub dtype: i32,
    /// `tensor_shape` (no dimensions: a scalar).
    #[prost(message, optional, tag = "2")]
    pub tensor_shape: Option<TensorShape>,
    /// `string_val`.
    #[prost(bytes = "vec", repeated, tag = "8")]
    pub string_val: Vec<Vec<u8>>,
}

/// `tensorflow.TensorShapeProto` with no dimensions.
#[derive(Clone, PartialEq, Message)]
pub struct TensorShape {}

/// TFRecord's masked CRC-32C.
fn masked_crc(bytes: &[u8]) -> u32 {
    let crc = crc32c::crc32c(bytes);
    crc.rotate_right(15).wrapping_add(0xa282_ead8)
}

/// One TFRecord around `data`.
pub fn record(data: &[u8]) -> Vec<u8> {
    let len = (data.len() as u64).to_le_bytes();
    let mut out = Vec::with_capacity(data.len() + 16);
    out.extend_from_slice(&len);
    out.extend_from_slice(&masked_crc(&len).to_le_bytes());
    out.extend_from_slice(data);
    out.extend_from_slice(&masked_crc(data).to_le_bytes());
    out
}

/// Reads the intact records of `r` in order, calling `each(event, end offset)`, until the
/// end, a torn or damaged record, or `each` returns false. Returns the end of the last record
/// `each` accepted.
pub fn scan(r: &mut impl Read, mut each: impl FnMut(&Event) -> bool) -> u64 {
    let mut kept = 0u64;
    let mut header = [0u8; 12];
    loop {
        if r.read_exact(&mut header).is_err() {
            return kept;
        }
        let len_bytes: [u8; 8] = header[..8].try_into().unwrap_or_default();
        let crc = u32::from_le_bytes(header[8..].try_into().unwrap_or_default());
        let len = u64::from_le_bytes(len_bytes);
        if masked_crc(&len_bytes) != crc || len > MAX_RECORD {
            return kept;
        }
        let mut data = vec![0u8; len as usize + 4];
        if r.read_exact(&mut data).is_err() {
            return kept;
        }
        let (body, tail) = data.split_at(len as usize);
        let crc = u32::from_le_bytes(tail.try_into().unwrap_or_default());
        let Ok(event) = Event::decode(body).map_err(|_| ()).and_then(|e| {
            if masked_crc(body) == crc {
                Ok(e)
            } else {
                Err(())
            }
        }) else {
            return kept;
        };
        if !each(&event) {
            return kept;
        }
        kept += 12 + len + 4;
    }
}

/// The run's TensorBoard event file, open for appending.
pub struct TensorBoard {
    path: PathBuf,
    file: File,
}

impl TensorBoard {
    /// Opens (or creates) the event file of the run directory `run_dir` for a run that
    /// starts after step `from`: records of later steps, and a torn tail, are cut first.
    pub fn open(run_dir: &Path, from: u64) -> Result<Self, TrainError> {
        let dir = run_dir.join(DIR);
        std::fs::create_dir_all(&dir).map_err(io(&dir))?;
        let existing = existing_file(&dir)?;
        let path = match existing {
            Some(p) => p,
            None => {
                let secs = std::time::SystemTime::now()
                    .duration_since(std::time::UNIX_EPOCH)
                    .map_or(0, |d| d.as_secs());
                dir.join(format!("{MARK}{secs}.{}", kiln_run::host_name()))
            }
        };
        let file = kiln_run::files::open_append_regular(&path).map_err(io(&path))?;
        let mut tb = Self { path, file };
        tb.cut_after(from)?;
        if tb.file.metadata().map_err(io(&tb.path))?.len() == 0 {
            tb.write(Event {
                wall_time: now(),
                step: 0,
                what: Some(What::FileVersion("brain.Event:2".into())),
            })?;
        }
        Ok(tb)
    }

    /// Cuts the file after its last intact record of a step at or before `step` (a resume
    /// or a rollback to `step`: the later steps come again). The file's first record, its
    /// version, always stays.
    pub fn cut_after(&mut self, step: u64) -> Result<(), TrainError> {
        let path = &self.path;
        let mut read = File::open(path).map_err(io(path))?;
        read.rewind().map_err(io(path))?;
        let mut first = true;
        let keep = scan(&mut BufReader::new(read), |e| {
            let ok = first || u64::try_from(e.step).is_ok_and(|s| s <= step);
            first = false;
            ok
        });
        self.file.set_len(keep).map_err(io(path))
    }

    /// A guard's rollback to `step`: the file cut after it as [`TensorBoard::cut_after`] does
    /// (the later steps come again), but the guards' texts of the steps cut (what made the
    /// guard roll back: the non-finite parameters, the spike) written again at `step`, so that
    /// the reason stays beside the rollback. The texts keep their own step in their fields.
    pub fn rollback_to(&mut self, step: u64) -> Result<(), TrainError> {
        let path = &self.path;
        let mut read = File::open(path).map_err(io(path))?;
        read.rewind().map_err(io(path))?;
        let mut guards = Vec::new();
        scan(&mut BufReader::new(read), |e| {
            let later = u64::try_from(e.step).is_ok_and(|s| s > step);
            if let (true, Some(What::Summary(summary))) = (later, &e.what) {
                let texts = summary
                    .value
                    .iter()
                    .filter(|v| v.tag.starts_with("guards/"));
                guards.extend(texts.cloned());
            }
            true
        });
        self.cut_after(step)?;
        if guards.is_empty() {
            return Ok(());
        }
        self.summary(step, guards)
    }

    /// The event file.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Scalars `(tag, value)` of `step`.
    pub fn scalars(&mut self, step: u64, values: &[(&str, f64)]) -> Result<(), TrainError> {
        let value = values
            .iter()
            .filter(|(_, v)| v.is_finite())
            .map(|&(tag, v)| Value {
                tag: tag.to_string(),
                metadata: None,
                kind: Some(Kind::SimpleValue(v as f32)),
            })
            .collect();
        self.summary(step, value)
    }

    /// A text under `tag` at `step` (TensorBoard's text plugin).
    pub fn text(&mut self, step: u64, tag: &str, text: &str) -> Result<(), TrainError> {
        let value = Value {
            tag: tag.to_string(),
            metadata: Some(SummaryMetadata {
                plugin_data: Some(PluginData {
                    plugin_name: "text".into(),
                }),
            }),
            kind: Some(Kind::Tensor(TensorProto {
                dtype: DT_STRING,
                tensor_shape: Some(TensorShape {}),
                string_val: vec![text.as_bytes().to_vec()],
            })),
        };
        self.summary(step, vec![value])
    }

    fn summary(&mut self, step: u64, value: Vec<Value>) -> Result<(), TrainError> {
        self.write(Event {
            wall_time: now(),
            step: i64::try_from(step).unwrap_or(i64::MAX),
            what: Some(What::Summary(Summary { value })),
        })
    }

    fn write(&mut self, e: Event) -> Result<(), TrainError> {
        self.file
            .write_all(&record(&e.encode_to_vec()))
            .map_err(io(&self.path))
    }
}

/// The event file already in `dir`, if any (the newest by name when there are several).
fn existing_file(dir: &Path) -> Result<Option<PathBuf>, TrainError> {
    let mut found: Vec<PathBuf> = std::fs::read_dir(dir)
        .map_err(io(dir))?
        .filter_map(Result::ok)
        .map(|e| e.path())
        .filter(|p| {
            p.file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n.starts_with(MARK))
        })
        .collect();
    found.sort();
    Ok(found.pop())
}

fn now() -> f64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn steps(path: &Path) -> Vec<i64> {
        let mut out = Vec::new();
        scan(&mut File::open(path).unwrap(), |e| {
            if matches!(e.what, Some(What::Summary(_))) {
                out.push(e.step);
            }
            true
        });
        out
    }

    /// The CRC of TFRecord: masked CRC-32C (the value TensorFlow's tests give for "hello").
    #[test]
    fn records_are_framed_as_tfrecord() {
        let r = record(b"hello");
        assert_eq!(&r[..8], &5u64.to_le_bytes());
        assert_eq!(r.len(), 8 + 4 + 5 + 4);
        assert_eq!(crc32c::crc32c(b"123456789"), 0xe306_9283);
    }

    #[test]
    fn a_resumed_run_cuts_later_steps_and_a_torn_tail() {
        let dir = tempfile::tempdir().unwrap();
        let mut tb = TensorBoard::open(dir.path(), 0).unwrap();
        for s in 1..=8 {
            tb.scalars(s, &[("train/loss", s as f64)]).unwrap();
        }
        tb.text(8, "guards/loss_spike", "{\"loss\": 9}").unwrap();
        let path = tb.path().to_path_buf();
        drop(tb);
        // A kill mid-write leaves half a record.
        let mut f = std::fs::OpenOptions::new()
            .append(true)
            .open(&path)
            .unwrap();
        f.write_all(&record(b"xxxxxxxx")[..7]).unwrap();
        let mut tb = TensorBoard::open(dir.path(), 5).unwrap();
        assert_eq!(tb.path(), path);
        assert_eq!(steps(&path), [1, 2, 3, 4, 5]);
        for s in 6..=9 {
            tb.scalars(s, &[("train/loss", s as f64), ("train/lr", f64::NAN)])
                .unwrap();
        }
        assert_eq!(steps(&path), [1, 2, 3, 4, 5, 6, 7, 8, 9]);
        // A fresh start in the same directory begins again.
        drop(TensorBoard::open(dir.path(), 0).unwrap());
        assert!(steps(&path).is_empty());
        // A rollback to step 2 cuts what came after it.
        let mut tb = TensorBoard::open(dir.path(), 0).unwrap();
        for s in 1..=4 {
            tb.scalars(s, &[("train/loss", 1.0)]).unwrap();
        }
        tb.cut_after(2).unwrap();
        tb.scalars(3, &[("train/loss", 1.0)]).unwrap();
        assert_eq!(steps(&path), [1, 2, 3]);
    }

    /// Issue 60: a guard's rollback cut the file back, and with it the text of the guard
    /// event that caused it (the non-finite parameters): only `guards/rollback` was left.
    /// The cut texts are written again at the rollback's step; the scalars stay cut.
    #[test]
    fn a_rollback_keeps_the_guards_texts_that_caused_it() {
        let dir = tempfile::tempdir().unwrap();
        let mut tb = TensorBoard::open(dir.path(), 0).unwrap();
        for s in 1..=4 {
            tb.scalars(s, &[("train/loss", 1.0)]).unwrap();
        }
        tb.text(4, "guards/nonfinite_skip", "{\"params\": [\"w\"]}")
            .unwrap();
        tb.rollback_to(2).unwrap();
        tb.text(2, "guards/rollback", "{\"to_step\": 2}").unwrap();
        let path = tb.path().to_path_buf();
        let mut tags = Vec::new();
        scan(&mut File::open(&path).unwrap(), |e| {
            if let Some(What::Summary(sm)) = &e.what {
                tags.extend(sm.value.iter().map(|v| (e.step, v.tag.clone())));
            }
            true
        });
        let want = [
            (1, "train/loss"),
            (2, "train/loss"),
            (2, "guards/nonfinite_skip"),
            (2, "guards/rollback"),
        ];
        let want: Vec<(i64, String)> = want.iter().map(|(s, t)| (*s, t.to_string())).collect();
        assert_eq!(tags, want);
    }

    proptest! {
        /// Any bytes scan without a panic, keeping at most the whole input.
        #[test]
        fn scanning_damage_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..300)) {
            let kept = scan(&mut bytes.as_slice(), |_| true);
            prop_assert!(kept <= bytes.len() as u64);
        }
    }
}

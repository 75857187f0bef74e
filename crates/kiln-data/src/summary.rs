//! A dataset at a glance, as `kiln data inspect` shows it: counts, the distribution of
//! sequence lengths, and what its tokenizer sidecar says.

use crate::error::Result;
use crate::index::total_tokens;
use crate::indexed::IndexedDataset;
use crate::tokenize::read_sidecar;

/// What `kiln data inspect` reports of `ds`: counts, the sequence lengths' distribution and the
/// tokenizer's sidecar; with `check`, every length and pointer checked first.
pub fn summary(ds: &IndexedDataset, check: bool) -> Result<Summary> {
    let idx = ds.index();
    let tokens = match check {
        true => idx.check_all()?,
        false => total_tokens(idx)?,
    };
    let mut lengths: Vec<u32> = (0..idx.sequences())
        .map(|i| idx.length(i))
        .collect::<Result<_>>()?;
    lengths.sort_unstable();
    let at = |p: f64| match lengths.len() {
        0 => 0,
        n => lengths[((n - 1) as f64 * p).round() as usize],
    };
    let mean = match lengths.len() {
        0 => 0.0,
        n => tokens as f64 / n as f64,
    };
    let sidecar = read_sidecar(ds.prefix());
    Ok(Summary {
        prefix: ds.prefix().display().to_string(),
        dtype: ds.dtype().name(),
        documents: idx.documents(),
        sequences: idx.sequences(),
        tokens,
        multimodal_modes: idx.has_modes(),
        length: Lengths {
            min: lengths.first().copied().unwrap_or(0),
            mean,
            p50: at(0.5),
            p90: at(0.9),
            p99: at(0.99),
            max: lengths.last().copied().unwrap_or(0),
        },
        vocab_size: sidecar.as_ref().map(|s| s.vocab_size),
        eos_id: sidecar.as_ref().and_then(|s| s.eos_id),
        checked: check,
    })
}

/// A dataset at a glance ([`summary`]); its JSON is `kiln data inspect --json`'s.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Summary {
    /// The dataset's path prefix.
    pub prefix: String,
    /// The token dtype's name.
    pub dtype: &'static str,
    /// Documents.
    pub documents: usize,
    /// Sequences.
    pub sequences: usize,
    /// Tokens in all sequences.
    pub tokens: u64,
    /// Whether the index has a mode byte per sequence (multimodal).
    pub multimodal_modes: bool,
    /// Sequence lengths.
    pub length: Lengths,
    /// The tokenizer's vocabulary size, from the sidecar.
    pub vocab_size: Option<usize>,
    /// The end-of-document token, from the sidecar.
    pub eos_id: Option<u32>,
    /// Whether every length and pointer was checked.
    pub checked: bool,
}

/// The distribution of sequence lengths, in tokens (nearest-rank percentiles).
#[derive(Debug, Clone, serde::Serialize)]
pub struct Lengths {
    /// Shortest.
    pub min: u32,
    /// Mean.
    pub mean: f64,
    /// Median.
    pub p50: u32,
    /// 90th percentile.
    pub p90: u32,
    /// 99th percentile.
    pub p99: u32,
    /// Longest.
    pub max: u32,
}

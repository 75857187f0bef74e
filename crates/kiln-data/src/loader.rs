//! The deterministic, resumable loader: `(step, dp_rank, dp_size, batch_size)` to token rows.
//!
//! # Addressing
//!
//! With `global_batch = batch_size * dp_size`, row `r` of rank `k` at step `s` is global
//! sample
//!
//! ```text
//! i = s * global_batch + k * batch_size + r
//! ```
//!
//! Global sample `i` comes from dataset `d` and that dataset's sample `j` per the blend
//! ([`crate::blend`]), and its tokens from the dataset's sample index ([`crate::index`]). Every
//! step is computed from cached tables in O(1) (plus a walk of at most [`crate::index::GROUP`]
//! sequences), so resuming at step `S` costs nothing, and the result depends only on the
//! corpus contents, the weights, `seq_len` and `seed` — not on thread count, host or history
//! of restarts.
//!
//! # Weight-stable resumption
//!
//! [`BlendedLoader::schedule`] is the run's weight history; the trainer stores it (JSON) in
//! its checkpoint. On resume at step `S` it passes it back in [`LoaderConfig::resume`] with
//! `at_sample = S * global_batch`; if the corpus list's weights differ from those in force, a
//! new blend segment starts at `at_sample` and only samples from there on change.

use crate::blend::{Blend, BlendSchedule};
use crate::corpus::CorpusList;
use crate::error::{DataError, Result};
use crate::index::DatasetIndex;
use crate::indexed::IndexedDataset;
use crate::manifest::{self, Manifest, Verify};
use rayon::prelude::*;
use std::path::{Path, PathBuf};

/// Longest sequence the loader packs (16M tokens: beyond any model's context).
pub const MAX_SEQ_LEN: usize = 1 << 24;
/// Most samples one blend may index (2^56: keeps every derived count inside 64 bits).
pub const MAX_SAMPLES: u64 = 1 << 56;

/// Where a resumed run picks up its weight history.
#[derive(Debug, Clone, PartialEq)]
pub struct Resume {
    /// The schedule stored with the checkpoint ([`BlendedLoader::schedule`]).
    pub schedule: BlendSchedule,
    /// First global sample of the resumed step: `step * global_batch`.
    pub at_sample: u64,
}

/// How to open a [`BlendedLoader`].
#[derive(Debug, Clone)]
pub struct LoaderConfig {
    /// Tokens per training sequence; each sample has `seq_len + 1` tokens (inputs + shifted
    /// targets).
    pub seq_len: usize,
    /// Seed of every shuffle.
    pub seed: u64,
    /// Global samples the run will draw: `steps * global_batch`. Requests beyond it fail.
    pub total_samples: u64,
    /// Directory for the index cache (shared by ranks and runs; created if missing).
    pub cache_dir: PathBuf,
    /// How to check shards against the manifest (default: fast).
    pub verify: Verify,
    /// Manifest to check against; `None` means `LIST.manifest.json` next to the list, if it
    /// exists.
    pub manifest: Option<PathBuf>,
    /// Fail when there is no manifest to check against (default: warn and go on).
    pub require_manifest: bool,
    /// Weight history of a resumed run; `None` for a fresh run.
    pub resume: Option<Resume>,
    /// A `tokenizer.json` to take the vocabulary size from.
    pub tokenizer: Option<PathBuf>,
}

impl LoaderConfig {
    /// A config with the defaults for everything but the essentials.
    pub fn new(seq_len: usize, seed: u64, total_samples: u64, cache_dir: PathBuf) -> Self {
        LoaderConfig {
            seq_len,
            seed,
            total_samples,
            cache_dir,
            verify: Verify::Fast,
            manifest: None,
            require_manifest: false,
            resume: None,
            tokenizer: None,
        }
    }
}

/// One dataset of the blend, as the loader sees it.
#[derive(Debug)]
pub struct LoadedDataset {
    /// The prefix as written in the list.
    pub key: String,
    /// Corpus name.
    pub corpus: String,
    /// Relative weight currently in force.
    pub weight: f64,
    /// Samples the whole blend draws from it.
    pub samples: u64,
    /// Its line in the corpus list.
    pub line: usize,
    index: DatasetIndex,
}

impl LoadedDataset {
    /// The dataset's sample index.
    pub fn index(&self) -> &DatasetIndex {
        &self.index
    }
}

/// One dataset's part of a blend ([`BlendedLoader::shares`]).
#[derive(Debug, Clone, serde::Serialize)]
pub struct Share {
    /// The dataset's key.
    pub key: String,
    /// Its corpus.
    pub corpus: String,
    /// Its weight, normalised over the list.
    pub weight: f64,
    /// Samples the blend draws from it.
    pub samples: u64,
    /// Those samples' share of the blend.
    pub share: f64,
    /// Tokens in one epoch of it.
    pub tokens_per_epoch: u64,
    /// Epochs of it the blend's samples take (each sample is `seq_len` new tokens).
    pub epochs: f64,
}

/// Blended, shuffled, packed samples over the datasets of a corpus list.
#[derive(Debug)]
pub struct BlendedLoader {
    list: PathBuf,
    seq_len: usize,
    datasets: Vec<LoadedDataset>,
    blend: Blend,
    schedule: BlendSchedule,
    vocab: Option<usize>,
}

impl LoaderConfig {
    /// The sequence length and the sample count within what a loader can address.
    fn check_ranges(&self) -> Result<()> {
        if self.seq_len == 0 || self.seq_len > MAX_SEQ_LEN {
            return Err(DataError::Invalid(format!(
                "seq_len {} is out of range: it must be in [1, {MAX_SEQ_LEN}]",
                self.seq_len
            )));
        }
        if self.total_samples == 0 || self.total_samples > MAX_SAMPLES {
            return Err(DataError::Invalid(format!(
                "{} samples is out of range: the sample count must be in [1, {MAX_SAMPLES}]",
                self.total_samples
            )));
        }
        Ok(())
    }
}

/// Checks the shards of `prefixes` against the manifest of the corpus list `list` (an error
/// without one when `cfg.require_manifest`, else a warning).
fn verify_shards(list: &Path, cfg: &LoaderConfig, prefixes: &[PathBuf]) -> Result<()> {
    let mpath = cfg
        .manifest
        .clone()
        .unwrap_or_else(|| manifest::default_path(list));
    if mpath.exists() {
        return Manifest::read(&mpath)?.verify(&mpath, prefixes, cfg.verify);
    }
    if cfg.require_manifest {
        return Err(DataError::Io {
            path: mpath,
            error: std::io::Error::new(
                std::io::ErrorKind::NotFound,
                "no manifest; pin the shards with `kiln data manifest`",
            ),
        });
    }
    tracing::warn!(manifest = %mpath.display(), "no shard manifest; shards are not checked for changes (pin them with `kiln data manifest`)");
    Ok(())
}

/// Opens the dataset of list entry `e` and its sample index for at most `bound` samples; an
/// error names the entry's line of `list`. The index is checked against the `.bin` (every
/// length and pointer, [`crate::indexed::IndexFile::check_all`]) the first time this `.idx` is
/// opened with this cache, in the same pass that builds its sample index; the verdict is
/// cached, so damage is an error here, before any step, and a reopen reads nothing per
/// sequence.
fn open_index(
    list: &Path,
    e: &crate::corpus::CorpusEntry,
    bound: u64,
    cfg: &LoaderConfig,
) -> Result<DatasetIndex> {
    let at_line = |err: DataError| DataError::line(list, e.line, err.to_string());
    let ds = IndexedDataset::open(&e.prefix).map_err(at_line)?;
    let (_, fp) = crate::fingerprint::sampled(ds.index().path()).map_err(at_line)?;
    let seq_len = cfg.seq_len as u64;
    DatasetIndex::open(ds, &fp, cfg.seed, seq_len, bound, &cfg.cache_dir).map_err(at_line)
}

/// The vocabulary size: the tokenizer's when one is given, else the largest that the
/// datasets' tokenizer sidecars name (`None` without any).
fn vocab(cfg: &LoaderConfig, datasets: &[LoadedDataset]) -> Result<Option<usize>> {
    Ok(match &cfg.tokenizer {
        Some(t) => Some(crate::tokenize::load(t)?.get_vocab_size(true)),
        None => datasets
            .iter()
            .filter_map(|d| {
                crate::tokenize::read_sidecar(d.index.dataset().prefix()).map(|s| s.vocab_size)
            })
            .max(),
    })
}

impl BlendedLoader {
    /// Open from a corpus-list file (lines `weight prefix [corpus]`, `#` comments; relative
    /// prefixes resolve against the list file's directory), checking shards against the
    /// manifest and building or loading the cached indices under `cfg.cache_dir`. Safe to call
    /// from every rank at once: ranks that find the cache cold wait for the first builder and
    /// share its files.
    pub fn open(list: &Path, cfg: &LoaderConfig) -> Result<BlendedLoader> {
        cfg.check_ranges()?;
        let corpus = CorpusList::read(list)?;
        let prefixes: Vec<PathBuf> = corpus.entries.iter().map(|e| e.prefix.clone()).collect();
        if cfg.verify != Verify::Off {
            verify_shards(list, cfg, &prefixes)?;
        }
        std::fs::create_dir_all(&cfg.cache_dir).map_err(|e| DataError::io(&cfg.cache_dir, e))?;
        let weights: Vec<(String, f64)> = corpus
            .entries
            .iter()
            .map(|e| (e.key.clone(), e.weight))
            .collect();
        let schedule = match &cfg.resume {
            None => BlendSchedule::single(weights),
            Some(r) => r.schedule.continued(weights, r.at_sample),
        };
        let table: Vec<String> = corpus.entries.iter().map(|e| e.key.clone()).collect();
        let bounds = crate::blend::sample_bounds(&schedule, &table, cfg.total_samples)?;
        // The blend is one sequential pass; the dataset indices are parallel work sized by an
        // upper bound of each dataset's share, so both run at once.
        let (blend, opened) = rayon::join(
            || Blend::build(&schedule, &table, cfg.total_samples, &cfg.cache_dir),
            || -> Vec<Result<DatasetIndex>> {
                let entries = corpus.entries.par_iter().zip(bounds.par_iter());
                entries
                    .map(|(e, &bound)| open_index(list, e, bound, cfg))
                    .collect()
            },
        );
        let blend = blend?;
        let datasets = (opened.into_iter().zip(&corpus.entries).zip(blend.totals()))
            .map(|((index, e), samples)| {
                Ok(LoadedDataset {
                    key: e.key.clone(),
                    corpus: e.corpus.clone(),
                    weight: e.weight,
                    samples,
                    line: e.line,
                    index: index?,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(BlendedLoader {
            list: list.to_path_buf(),
            seq_len: cfg.seq_len,
            vocab: vocab(cfg, &datasets)?,
            datasets,
            blend,
            schedule,
        })
    }

    /// The rows of one step for one data-parallel rank: `batch_size` rows of `seq_len + 1`
    /// token ids. Row `r` is global sample `step * batch_size * dp_size + dp_rank * batch_size
    /// + r`. Identical on every run; O(1) in `step`.
    pub fn batch(
        &self,
        step: u64,
        dp_rank: usize,
        dp_size: usize,
        batch_size: usize,
    ) -> Result<Vec<Vec<u32>>> {
        if dp_size == 0 || dp_rank >= dp_size || batch_size == 0 {
            return Err(DataError::Invalid(format!(
                "bad batch request: dp_rank {dp_rank} of dp_size {dp_size}, batch_size {batch_size}"
            )));
        }
        let global = (batch_size as u64)
            .checked_mul(dp_size as u64)
            .and_then(|gb| step.checked_mul(gb))
            .and_then(|x| x.checked_add(dp_rank as u64 * batch_size as u64))
            .ok_or_else(|| DataError::Invalid(format!("step {step} overflows the sample index")))?;
        (0..batch_size as u64)
            .map(|r| self.sample(global + r))
            .collect()
    }

    /// Global sample `i`: `seq_len + 1` token ids.
    pub fn sample(&self, i: u64) -> Result<Vec<u32>> {
        let (d, j) = self.blend.get(i)?;
        let mut out = Vec::with_capacity(self.seq_len + 1);
        self.datasets[d].index.sample_into(j, &mut out)?;
        Ok(out)
    }

    /// Which dataset (position in the list) and which of its samples global sample `i` is.
    pub fn source(&self, i: u64) -> Result<(usize, u64)> {
        self.blend.get(i)
    }

    /// Vocabulary size, if known from `cfg.tokenizer` or the datasets' `kiln tokenize`
    /// sidecars (`PREFIX.kiln.json`).
    pub fn vocab_hint(&self) -> Option<usize> {
        self.vocab
    }

    /// Checks that every dataset's token ids are below `vocab` (a model's vocabulary size),
    /// so that no sample can index past the embedding. A dataset whose `kiln tokenize`
    /// sidecar records a vocabulary within `vocab`, or whose dtype cannot hold a larger id,
    /// needs no reading; any other (a Megatron-LM corpus, say) is scanned once for its
    /// largest id, and the result cached under the cache directory by the `.bin`'s
    /// fingerprint. An error names the dataset, its list line and the largest id.
    pub fn check_vocab(&self, vocab: usize, cache_dir: &Path) -> Result<()> {
        for d in &self.datasets {
            let ds = d.index.dataset();
            let declared = crate::tokenize::read_sidecar(ds.prefix()).map(|s| s.vocab_size);
            if declared.is_some_and(|v| v <= vocab) || ds.dtype_max_token() < vocab as u64 {
                continue;
            }
            if let Some(max) = max_token_cached(ds, cache_dir)?
                && max as usize >= vocab
            {
                return Err(DataError::line(
                    &self.list,
                    d.line,
                    format!(
                        "dataset {} holds token id {max}, but the vocabulary has {vocab} ids (0..{}); the vocabulary must be at least {}",
                        d.key,
                        vocab.saturating_sub(1),
                        max as u64 + 1
                    ),
                ));
            }
        }
        Ok(())
    }

    /// The weight history to store with a checkpoint (serde-serialisable).
    pub fn schedule(&self) -> &BlendSchedule {
        &self.schedule
    }

    /// Global samples available.
    pub fn total_samples(&self) -> u64 {
        self.blend.samples()
    }

    /// The datasets, in list order.
    pub fn datasets(&self) -> &[LoadedDataset] {
        &self.datasets
    }

    /// Each dataset's part of the blend, in list order (`kiln data blend`).
    pub fn shares(&self) -> Vec<Share> {
        let weights: Vec<f64> = self.datasets.iter().map(|d| d.weight).collect();
        let total = self.total_samples().max(1) as f64;
        let per_sample = self.seq_len as f64;
        (self.datasets.iter().zip(crate::corpus::normalize(&weights)))
            .map(|(d, weight)| {
                let tokens_per_epoch = d.index.tokens_per_epoch();
                Share {
                    key: d.key.clone(),
                    corpus: d.corpus.clone(),
                    weight,
                    samples: d.samples,
                    share: d.samples as f64 / total,
                    tokens_per_epoch,
                    epochs: d.samples as f64 * per_sample / tokens_per_epoch.max(1) as f64,
                }
            })
            .collect()
    }

    /// The corpus list this loader was opened from.
    pub fn list(&self) -> &Path {
        &self.list
    }

    /// The blend cache file.
    pub fn blend_path(&self) -> &Path {
        self.blend.path()
    }
}

/// The largest token id of a dataset (see [`IndexedDataset::scan_max_token`]), from the
/// cache when this `.bin` was scanned before.
fn max_token_cached(ds: &IndexedDataset, cache_dir: &Path) -> Result<Option<u32>> {
    let bin = crate::indexed::bin_path(ds.prefix());
    let (_, fp) = crate::fingerprint::sampled(&bin)?;
    let key = crate::cache::Key::new(b"MAXTOKEN", &format!("v1 bin={fp}"));
    let path = key.dataset_path(cache_dir, ds.prefix());
    let file = crate::cache::get_or_build(&path, &key, || {
        let _span = tracing::info_span!("max token id", dataset = %ds.prefix().display()).entered();
        // Stored as max + 1, so that 0 means "no tokens".
        let v = ds.scan_max_token()?.map_or(0, |m| m as u64 + 1);
        Ok(vec![v.to_le_bytes().to_vec()])
    })?;
    let p = file.payload();
    if p.len() != 8 {
        return Err(DataError::format(
            &file.path,
            "max-token cache has the wrong size; delete it to rebuild",
        ));
    }
    let v = crate::cache::word(p, 0);
    Ok(v.checked_sub(1).and_then(|m| u32::try_from(m).ok()))
}

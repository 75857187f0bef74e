//! Where the trainer's tokens come from: the built-in synthetic corpus, or Megatron indexed
//! datasets blended by `kiln-data` when `data.corpus_list` is set. Both are addressed by a
//! global sample index, so the data cursor in a checkpoint is a single number.

pub mod synthetic;

use std::sync::atomic::{AtomicUsize, Ordering};
use synthetic::Synthetic;

/// Why a sample could not be served.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum SampleError {
    /// The data itself is wrong (a damaged file, a token id outside the vocabulary): the
    /// same sample fails the same way on every retry.
    #[error("{0}")]
    Corrupt(String),
    /// Reading failed (I/O): perhaps transient, worth a retry.
    #[error("{0}")]
    Read(String),
}

impl From<kiln_data::DataError> for SampleError {
    fn from(e: kiln_data::DataError) -> Self {
        match e {
            kiln_data::DataError::Io { .. } => Self::Read(e.to_string()),
            _ => Self::Corrupt(e.to_string()),
        }
    }
}

/// A source of training sequences addressed by global sample index.
pub trait TokenSource: Send {
    /// Vocabulary size the data declares (the model's vocab must be at least this); 0 when
    /// the data does not say (a corpus without a `kiln tokenize` record).
    fn vocab(&self) -> usize;
    /// Checks that every token id the data can serve is below `vocab`, the model's
    /// vocabulary, and from then on refuses samples with larger ids (instead of letting the
    /// embedding lookup index out of range).
    fn fit_vocab(&self, vocab: usize) -> Result<(), String> {
        if vocab < self.vocab() {
            return Err(format!(
                "the data uses {} token ids, more than the vocabulary of {vocab}",
                self.vocab()
            ));
        }
        Ok(())
    }
    /// `len` token ids of training sample `index`.
    fn sample(&self, index: u64, len: usize) -> Result<Vec<u32>, SampleError>;
    /// Short description for the event log.
    fn describe(&self) -> String;
    /// State to save in checkpoints and hand back on resume (the blend's weight history).
    fn resume_state(&self) -> Option<serde_json::Value> {
        None
    }
}

/// The synthetic copy corpus.
pub struct SyntheticSource(pub Synthetic);

impl TokenSource for SyntheticSource {
    fn vocab(&self) -> usize {
        synthetic::VOCAB
    }
    fn sample(&self, index: u64, len: usize) -> Result<Vec<u32>, SampleError> {
        Ok(self.0.train_sample(index, len))
    }
    fn describe(&self) -> String {
        "synthetic copy corpus (built in)".into()
    }
}

/// Megatron indexed datasets blended by `kiln-data` (`data.corpus_list`).
pub struct BlendedSource {
    loader: kiln_data::BlendedLoader,
    seq_len: usize,
    cache_dir: std::path::PathBuf,
    /// The model's vocabulary once [`TokenSource::fit_vocab`] checked it (0: not yet).
    vocab_limit: AtomicUsize,
}

impl BlendedSource {
    /// Opens the corpus list for a run of `total_samples` samples of `seq_len + 1` tokens.
    /// `resume` is the weight history saved in the checkpoint being resumed (see
    /// [`TokenSource::resume_state`]) and the first sample of the resumed step; with it,
    /// samples before that point stay exactly what they were even if the weights changed.
    pub fn open(
        list: &std::path::Path,
        seq_len: usize,
        seed: u64,
        total_samples: u64,
        cache_dir: std::path::PathBuf,
        full_verify: bool,
        resume: Option<(serde_json::Value, u64)>,
    ) -> Result<Self, String> {
        let mut cfg = kiln_data::LoaderConfig::new(seq_len, seed, total_samples, cache_dir.clone());
        if full_verify {
            cfg.verify = kiln_data::Verify::Full;
        }
        if let Some((schedule, at_sample)) = resume {
            let schedule = serde_json::from_value(schedule)
                .map_err(|e| format!("checkpoint data schedule is unreadable: {e}"))?;
            cfg.resume = Some(kiln_data::Resume {
                schedule,
                at_sample,
            });
        }
        let loader = kiln_data::BlendedLoader::open(list, &cfg).map_err(|e| e.to_string())?;
        Ok(Self {
            loader,
            seq_len,
            cache_dir,
            vocab_limit: AtomicUsize::new(0),
        })
    }
}

impl TokenSource for BlendedSource {
    fn vocab(&self) -> usize {
        self.loader.vocab_hint().unwrap_or(0)
    }
    fn fit_vocab(&self, vocab: usize) -> Result<(), String> {
        self.loader
            .check_vocab(vocab, &self.cache_dir)
            .map_err(|e| e.to_string())?;
        self.vocab_limit.store(vocab, Ordering::Relaxed);
        Ok(())
    }
    fn sample(&self, index: u64, len: usize) -> Result<Vec<u32>, SampleError> {
        if len != self.seq_len + 1 {
            return Err(SampleError::Corrupt(format!(
                "asked for {len} tokens, the loader packs {}",
                self.seq_len + 1
            )));
        }
        let tokens = self.loader.sample(index)?;
        // A dataset whose record understates its vocabulary is caught here, at the sample.
        let limit = self.vocab_limit.load(Ordering::Relaxed);
        if limit > 0
            && let Some(bad) = tokens.iter().find(|&&t| t as usize >= limit)
        {
            let (d, _) = self.loader.source(index)?;
            return Err(SampleError::Corrupt(format!(
                "sample {index} from dataset {} holds token id {bad}, outside the model's vocabulary of {limit} (model.vocab_size)",
                self.loader.datasets()[d].key
            )));
        }
        Ok(tokens)
    }
    fn describe(&self) -> String {
        format!("blended corpus list {}", self.loader.list().display())
    }
    fn resume_state(&self) -> Option<serde_json::Value> {
        serde_json::to_value(self.loader.schedule()).ok()
    }
}

/// The training data of a run: the token source, and the synthetic corpus when it is the
/// source (for the built-in held-out eval).
pub struct TrainData {
    /// Where samples come from.
    pub source: Box<dyn TokenSource>,
    /// The synthetic corpus, when it is the data.
    pub synthetic: Option<Synthetic>,
}

impl TrainData {
    /// Opens the data of `config`: the synthetic corpus, or `data.corpus_list` sized for
    /// `total_samples` samples. `resume` is the blend's weight history from a checkpoint and
    /// the first sample of the resumed step.
    pub fn open(
        config: &crate::config::Config,
        total_samples: u64,
        resume: Option<(serde_json::Value, u64)>,
    ) -> Result<Self, String> {
        let t = &config.training;
        if config.data.corpus_list.is_empty() {
            let s = Synthetic::new(t.seed);
            return Ok(Self {
                source: Box::new(SyntheticSource(s.clone())),
                synthetic: Some(s),
            });
        }
        let list = std::path::Path::new(&config.data.corpus_list);
        let cache_dir =
            kiln_data::cache::cache_dir(Some(std::path::Path::new(&config.data.cache_dir)), list);
        let source = BlendedSource::open(
            list,
            t.seq_len,
            t.seed,
            total_samples,
            cache_dir,
            config.data.full_verify,
            resume,
        )
        .map_err(|e| format!("data.corpus_list {}: {e}", list.display()))?;
        // Every open (a resume reopens with the checkpoint's weight history) checks the
        // data's token ids against the model's vocabulary and arms the per-sample check.
        model_vocab(config, &source)?;
        Ok(Self {
            source: Box::new(source),
            synthetic: None,
        })
    }

    /// The vocabulary of the model: `model.vocab_size`, or the data's when that is 0; an
    /// error when the data says nothing and the config neither, or when the data holds ids
    /// the model would not have (see [`model_vocab`]).
    pub fn vocab(&self, config: &crate::config::Config) -> Result<usize, String> {
        model_vocab(config, self.source.as_ref())
    }
}

/// The model's vocabulary for `data`: `model.vocab_size`, or the data's declared one when
/// that is 0; checked against every token id the data can serve (see
/// [`TokenSource::fit_vocab`]).
pub fn model_vocab(
    config: &crate::config::Config,
    data: &dyn TokenSource,
) -> Result<usize, String> {
    let declared = data.vocab();
    let vocab = match (config.model.vocab_size, declared) {
        (0, 0) => {
            return Err(format!(
                "{}: no dataset records its vocabulary (the PREFIX.kiln.json that `kiln data tokenize` writes; Megatron-LM does not); set model.vocab_size to the tokenizer's vocabulary size",
                data.describe()
            ));
        }
        (0, d) => d,
        (v, _) => v,
    };
    if vocab < declared {
        return Err(format!(
            "model.vocab_size = {vocab} but the data uses {declared} token ids"
        ));
    }
    data.fit_vocab(vocab).map_err(|e| {
        if config.model.vocab_size > 0 {
            format!("model.vocab_size = {vocab} is too small: {e}")
        } else {
            e
        }
    })?;
    Ok(vocab)
}

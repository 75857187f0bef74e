//! Where the trainer's tokens come from: the built-in synthetic corpus, or Megatron indexed
//! datasets blended by `kiln-data` when `data.corpus_list` is set. Both are addressed by a
//! global sample index, so the data cursor in a checkpoint is a single number.

use crate::synthetic::{self, Synthetic};

/// A source of training sequences addressed by global sample index.
pub trait TokenSource: Send {
    /// Vocabulary size the data needs (the model's vocab must be at least this).
    fn vocab(&self) -> usize;
    /// `len` token ids of training sample `index`.
    fn sample(&self, index: u64, len: usize) -> Result<Vec<u32>, String>;
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
    fn sample(&self, index: u64, len: usize) -> Result<Vec<u32>, String> {
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
        let mut cfg = kiln_data::LoaderConfig::new(seq_len, seed, total_samples, cache_dir);
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
        Ok(Self { loader, seq_len })
    }
}

impl TokenSource for BlendedSource {
    fn vocab(&self) -> usize {
        self.loader.vocab_hint().unwrap_or(0)
    }
    fn sample(&self, index: u64, len: usize) -> Result<Vec<u32>, String> {
        if len != self.seq_len + 1 {
            return Err(format!(
                "asked for {len} tokens, the loader packs {}",
                self.seq_len + 1
            ));
        }
        self.loader.sample(index).map_err(|e| e.to_string())
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
        config: &crate::Config,
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
        let cache_dir = if config.data.cache_dir.is_empty() {
            list.parent()
                .unwrap_or(std::path::Path::new("."))
                .join(".kiln-cache")
        } else {
            std::path::PathBuf::from(&config.data.cache_dir)
        };
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
        Ok(Self {
            source: Box::new(source),
            synthetic: None,
        })
    }

    /// The vocabulary of the model: `model.vocab_size`, or the data's when that is 0. An
    /// error when the data uses more ids than the model would have.
    pub fn vocab(&self, config: &crate::Config) -> Result<usize, String> {
        let data = self.source.vocab();
        let vocab = if config.model.vocab_size == 0 {
            data
        } else {
            config.model.vocab_size
        };
        if vocab < data {
            return Err(format!(
                "model.vocab_size = {vocab} but the data uses {data} token ids"
            ));
        }
        Ok(vocab)
    }
}

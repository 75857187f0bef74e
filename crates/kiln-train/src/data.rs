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
}

/// The synthetic arithmetic corpus.
pub struct SyntheticSource(pub Synthetic);

impl TokenSource for SyntheticSource {
    fn vocab(&self) -> usize {
        synthetic::VOCAB
    }
    fn sample(&self, index: u64, len: usize) -> Result<Vec<u32>, String> {
        Ok(self.0.train_sample(index, len))
    }
    fn describe(&self) -> String {
        "synthetic arithmetic corpus (built in)".into()
    }
}

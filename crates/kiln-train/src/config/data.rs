//! The `[data]` section.

use serde::{Deserialize, Serialize};

/// Where tokens come from.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, Default)]
#[serde(deny_unknown_fields, default)]
pub struct DataConfig {
    /// Corpus list file (lines `weight prefix [corpus]`) of Megatron indexed datasets; empty =
    /// the built-in synthetic copy corpus.
    pub corpus_list: String,
    /// Directory for cached blend indices; empty = `$KILN_DATA_CACHE` if set, else
    /// `.kiln-cache` beside the corpus list (shared by all ranks and runs that read it, and
    /// by `kiln data blend`).
    pub cache_dir: String,
    /// Verify every shard's full SHA-256 against the manifest at start (slow; the default
    /// checks sizes and a sampled hash).
    pub full_verify: bool,
    /// The `tokenizer.json` the corpus was tokenized with (a relative path is resolved from
    /// the working directory, else beside the config); `kiln export` ships it with the
    /// model. Empty = none recorded (the synthetic corpus has its own).
    pub tokenizer: String,
}

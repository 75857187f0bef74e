//! The `[model]` section: the decoder's shape, and its keys' domains.

use super::domains::{Bound::*, Domains};
use serde::{Deserialize, Serialize};

/// Model shape (Llama-style decoder).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ModelConfig {
    /// Vocabulary size; 0 = take it from the data (the synthetic corpus has 16 symbols; a
    /// tokenized corpus records it in its `PREFIX.kiln.json`). A corpus without that record
    /// (e.g. written by Megatron-LM) needs it set, at least its largest token id + 1.
    pub vocab_size: usize,
    /// Hidden width.
    pub d_model: usize,
    /// Number of transformer blocks.
    pub n_layers: usize,
    /// Query heads.
    pub n_heads: usize,
    /// Key/value heads (grouped-query attention); must divide n_heads.
    pub n_kv_heads: usize,
    /// SwiGLU hidden width.
    pub ffn_hidden: usize,
    /// RoPE base frequency.
    pub rope_theta: f64,
    /// RMSNorm epsilon.
    pub norm_eps: f64,
    /// RMSNorm on queries and keys per head (QK-norm).
    pub qk_norm: bool,
    /// Share the embedding matrix with the output head.
    pub tie_embeddings: bool,
    /// Standard deviation of the normal init of every matrix.
    pub init_std: f64,
    /// Scale the init of residual output projections (wo, w_down) by 1/sqrt(2 * n_layers).
    pub scale_residual_init: bool,
    /// A Hugging Face Llama directory (`config.json`, `model.safetensors` or its shards,
    /// `tokenizer.json`) whose weights start a fresh run (continued pre-training). The model
    /// keys are taken from its `config.json` (a config or `--set` that sets one differently
    /// is an error naming both), and `data.tokenizer` from its `tokenizer.json` unless set.
    /// A run that resumes from a checkpoint ignores it: the checkpoint wins. Empty = none.
    #[serde(skip_serializing_if = "String::is_empty")]
    pub init_from: String,
}

impl Default for ModelConfig {
    fn default() -> Self {
        Self {
            vocab_size: 0,
            d_model: 128,
            n_layers: 4,
            n_heads: 4,
            n_kv_heads: 2,
            ffn_hidden: 384,
            rope_theta: 10000.0,
            norm_eps: 1e-5,
            qk_norm: false,
            tie_embeddings: false,
            init_std: 0.02,
            scale_residual_init: true,
            init_from: String::new(),
        }
    }
}

impl ModelConfig {
    /// The model keys' domains.
    pub(super) fn domains(&self, d: &mut Domains) {
        let m = self;
        d.check(
            "model.vocab_size",
            m.vocab_size,
            m.vocab_size == 0 || (2..=MAX_VOCAB).contains(&m.vocab_size),
            format!("0 (take it from the data) or an integer in [2, {MAX_VOCAB}]"),
        );
        d.at_least("model.d_model", m.d_model, 1);
        d.at_least("model.n_layers", m.n_layers, 1);
        d.at_least("model.n_heads", m.n_heads, 1);
        d.at_least("model.n_kv_heads", m.n_kv_heads, 1);
        d.at_least("model.ffn_hidden", m.ffn_hidden, 1);
        d.real("model.rope_theta", m.rope_theta, Open(1.0), Inf);
        d.real("model.norm_eps", m.norm_eps, Open(0.0), Closed(1.0));
        d.real("model.init_std", m.init_std, Open(0.0), Closed(100.0));
    }
}

/// Largest vocabulary: token ids must fit Megatron's int32 dtype.
pub const MAX_VOCAB: usize = i32::MAX as usize;

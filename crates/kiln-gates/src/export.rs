//! `kiln export --to hf`: a run's (or a checkpoint's) weights as a Hugging Face Llama
//! directory that `transformers` loads with `LlamaForCausalLM`, no custom code:
//!
//! - `config.json` — `LlamaForCausalLM`, the model's shape, `rope_theta`, `rms_norm_eps`,
//!   GQA (`num_key_value_heads`), tied embeddings, dtype;
//! - `model.safetensors` — the weights under their Hugging Face names (kiln uses them too),
//!   every linear layer transposed: kiln stores matrices `[in, out]` (x @ W), `nn.Linear`
//!   holds `[out, in]`; the embedding (`[vocab, hidden]`) and the norms keep their layout.
//!   Dtypes are kept (a bf16-master run exports bf16);
//! - `generation_config.json`;
//! - the tokenizer (`tokenizer.json`, `tokenizer_config.json`): the run's `data.tokenizer`
//!   (or `--tokenizer`), or for the built-in synthetic corpus a one-character-per-token
//!   tokenizer of its 16 symbols.
//!
//! Conventions that make the weights mean the same in both: kiln's RoPE is rotate-half with
//! `inv_freq = 1 / theta^(2i/d)` (Hugging Face's Llama), query head h reads K/V head
//! `h / (n_heads / n_kv_heads)` (Hugging Face's `repeat_kv`), attention is scaled by
//! 1/sqrt(head_dim), RMSNorm is `x / sqrt(mean(x^2) + eps) * w` in f32. A model Hugging
//! Face's Llama cannot represent (QK-norm) is refused rather than exported as a different
//! model.

use crate::mc::{LoadedModel, load_model};
use crate::{GatesError, io_err};
use kiln_train::checkpoint::{HostTensor, StoredDtype, to_safetensors};
use kiln_train::data::synthetic;
use kiln_train::{Config, Session};
use serde_json::json;
use std::path::{Path, PathBuf};

/// What to export and where.
#[derive(Debug, Clone)]
pub struct ExportOptions {
    /// A run directory (its final weights or newest valid checkpoint) or a checkpoint
    /// directory.
    pub source: PathBuf,
    /// The config to rebuild the model with; default: the run's `config.toml`.
    pub config: Option<PathBuf>,
    /// The output directory (must not exist, or be empty).
    pub out: PathBuf,
    /// The tokenizer to ship; default: the run's `data.tokenizer`.
    pub tokenizer: Option<PathBuf>,
}

/// What an export wrote.
#[derive(Debug, Clone)]
pub struct ExportReport {
    /// The output directory.
    pub out: PathBuf,
    /// The weights exported (file or checkpoint directory).
    pub weights: PathBuf,
    /// Step of the checkpoint, when known.
    pub step: Option<u64>,
    /// Files written, relative to `out`.
    pub files: Vec<String>,
    /// Where the tokenizer came from (`None`: no tokenizer known for this run).
    pub tokenizer: Option<String>,
}

/// The Hugging Face layout of one kiln tensor: matrices other than the embedding are
/// transposed from `[in, out]` to `[out, in]` (`model.init_from` reads them back).
pub use kiln_train::model::hf::to_hf_layout;

/// Hugging Face's name of a dtype (`torch_dtype`).
fn torch_dtype(d: StoredDtype) -> &'static str {
    match d {
        StoredDtype::F32 => "float32",
        StoredDtype::Bf16 => "bfloat16",
    }
}

/// The tokenizer of a run: its JSON text, its end-of-text token and where it came from.
struct Tokenizer {
    json: String,
    eos: Option<(String, u32)>,
    origin: String,
}

/// A `tokenizer.json` of the synthetic corpus: one token per character of its alphabet
/// (BPE without merges splits text into characters; the `Fuse` decoder joins them back).
fn synthetic_tokenizer() -> Tokenizer {
    let vocab: serde_json::Map<String, serde_json::Value> = synthetic::ALPHABET
        .iter()
        .enumerate()
        .map(|(i, &c)| ((c as char).to_string(), json!(i)))
        .collect();
    let tok = json!({
        "version": "1.0", "truncation": null, "padding": null, "added_tokens": [],
        "normalizer": null, "pre_tokenizer": null, "post_processor": null,
        "decoder": {"type": "Fuse"},
        "model": {"type": "BPE", "dropout": null, "unk_token": null,
                  "continuing_subword_prefix": null, "end_of_word_suffix": null,
                  "fuse_unk": false, "byte_fallback": false, "ignore_merges": false,
                  "vocab": vocab, "merges": []},
    });
    Tokenizer {
        json: format!("{tok:#}\n"),
        // A line ends each example of the copy task.
        eos: Some(("\n".into(), 0)),
        origin: "built-in synthetic corpus (one token per character)".into(),
    }
}

/// The largest `tokenizer.json` read (the biggest public ones are tens of MB).
const MAX_TOKENIZER_BYTES: u64 = 1024 * kiln_run::files::MIB;

/// Reads a `tokenizer.json`; its end-of-text token is the first of kiln-data's EOS names
/// that it has as an added token.
fn read_tokenizer(path: &Path) -> Result<Tokenizer, GatesError> {
    let json = kiln_run::files::read_to_string_limited(path, MAX_TOKENIZER_BYTES, "a tokenizer")
        .map_err(io_err(path))?;
    let parsed: serde_json::Value = serde_json::from_str(&json).map_err(|e| GatesError::Parse {
        path: path.to_path_buf(),
        line: e.line(),
        message: format!("not a tokenizer.json: {e}"),
    })?;
    if !parsed
        .get("model")
        .is_some_and(serde_json::Value::is_object)
    {
        return Err(GatesError::Parse {
            path: path.to_path_buf(),
            line: 0,
            message: "not a Hugging Face tokenizer.json (no \"model\" object)".into(),
        });
    }
    let added = parsed["added_tokens"]
        .as_array()
        .cloned()
        .unwrap_or_default();
    let eos = ["<|endoftext|>", "</s>", "<eos>", "<|end_of_text|>"]
        .iter()
        .find_map(|name| {
            added.iter().find_map(|t| {
                (t["content"].as_str() == Some(name))
                    .then(|| t["id"].as_u64())
                    .flatten()
                    .map(|id| (name.to_string(), id as u32))
            })
        });
    Ok(Tokenizer {
        json,
        eos,
        origin: path.display().to_string(),
    })
}

/// The tokenizer to ship: `--tokenizer`, else the config's `data.tokenizer`, else the
/// synthetic corpus's when the run used it.
fn choose_tokenizer(
    opts: &ExportOptions,
    cfg: &Config,
    config_path: &Path,
) -> Result<Option<Tokenizer>, GatesError> {
    if let Some(p) = &opts.tokenizer {
        return read_tokenizer(p).map(Some);
    }
    if !cfg.data.tokenizer.is_empty() {
        // A relative path is as the run was started (the working directory), else beside
        // the config.
        let p = Path::new(&cfg.data.tokenizer);
        let beside = config_path.parent().unwrap_or(Path::new(".")).join(p);
        let p = if p.is_relative() && !p.exists() && beside.exists() {
            beside
        } else {
            p.to_path_buf()
        };
        return read_tokenizer(&p).map(Some);
    }
    if cfg.data.corpus_list.is_empty() {
        return Ok(Some(synthetic_tokenizer()));
    }
    Ok(None)
}

/// `config.json` of a `LlamaForCausalLM` with this model's shape.
fn hf_config(
    cfg: &Config,
    vocab: usize,
    dtype: StoredDtype,
    eos: Option<u32>,
) -> serde_json::Value {
    let m = &cfg.model;
    json!({
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": vocab,
        "hidden_size": m.d_model,
        "intermediate_size": m.ffn_hidden,
        "num_hidden_layers": m.n_layers,
        "num_attention_heads": m.n_heads,
        "num_key_value_heads": m.n_kv_heads,
        "head_dim": m.d_model / m.n_heads,
        "hidden_act": "silu",
        "max_position_embeddings": cfg.training.seq_len,
        "rms_norm_eps": m.norm_eps,
        "rope_theta": m.rope_theta,
        "rope_scaling": null,
        "attention_bias": false,
        "attention_dropout": 0.0,
        "mlp_bias": false,
        "tie_word_embeddings": m.tie_embeddings,
        "initializer_range": m.init_std,
        "pretraining_tp": 1,
        "use_cache": true,
        "bos_token_id": null,
        "eos_token_id": eos,
        "torch_dtype": torch_dtype(dtype),
    })
}

/// Exports as a Hugging Face Llama directory; see the module documentation.
pub fn export_hf(opts: &ExportOptions) -> Result<ExportReport, GatesError> {
    let loaded = load_model(&opts.source, opts.config.as_deref())?;
    export_loaded(&loaded, opts)
}

fn export_loaded(loaded: &LoadedModel, opts: &ExportOptions) -> Result<ExportReport, GatesError> {
    let s = &loaded.session;
    let cfg = &s.config;
    if cfg.model.qk_norm {
        return Err(GatesError::Invalid(format!(
            "{}: the model uses QK-norm (model.qk_norm = true), which Hugging Face's LlamaForCausalLM does not have; its weights would load as a different model, so the export is refused",
            loaded.weights.display()
        )));
    }
    let tokenizer = choose_tokenizer(opts, cfg, &loaded.config_path)?;
    let tensors: Vec<HostTensor> = s.host_params().iter().map(to_hf_layout).collect();
    let dtype = tensors.first().map_or(StoredDtype::F32, |t| t.dtype);
    let weights = to_safetensors(&tensors)
        .map_err(|e| GatesError::Invalid(format!("serialising the weights: {e}")))?;
    let eos = tokenizer.as_ref().and_then(|t| t.eos.as_ref().map(|e| e.1));
    let mut files: Vec<(String, Vec<u8>)> = vec![
        ("model.safetensors".into(), weights),
        (
            "config.json".into(),
            pretty(&hf_config(cfg, s.model.vocab(), dtype, eos)),
        ),
        (
            "generation_config.json".into(),
            pretty(&json!({"_from_model_config": true, "bos_token_id": null, "eos_token_id": eos})),
        ),
    ];
    if let Some(t) = &tokenizer {
        files.push(("tokenizer.json".into(), t.json.clone().into_bytes()));
        let mut tc = json!({
            "tokenizer_class": "PreTrainedTokenizerFast",
            "model_max_length": cfg.training.seq_len,
            "clean_up_tokenization_spaces": false,
        });
        if let Some((name, _)) = &t.eos {
            tc["eos_token"] = json!(name);
        }
        files.push(("tokenizer_config.json".into(), pretty(&tc)));
    }
    publish(&opts.out, &files)?;
    Ok(ExportReport {
        out: opts.out.clone(),
        weights: loaded.weights.clone(),
        step: loaded.step,
        files: files.into_iter().map(|(n, _)| n).collect(),
        tokenizer: tokenizer.map(|t| t.origin),
    })
}

/// kiln's logits for `text` of the synthetic corpus (one token per character), as the JSON
/// `scripts/hf-parity.py` compares an export's logits with: `{text, ids, shape, logits}`.
pub fn reference_logits(session: &Session, text: &str) -> Result<serde_json::Value, GatesError> {
    let ids: Vec<u32> = text
        .bytes()
        .map(|c| {
            synthetic::token_of(c).ok_or_else(|| {
                GatesError::Invalid(format!(
                    "{:?} is not a symbol of the synthetic corpus",
                    c as char
                ))
            })
        })
        .collect::<Result<_, _>>()?;
    let tokens =
        kiln_train::tensor::int_tensor(std::slice::from_ref(&ids), ids.len(), &session.device);
    let logits = session.model.forward(&session.params, tokens);
    let dims = logits.dims();
    let flat = kiln_train::tensor::to_vec(&logits.reshape([dims.iter().product::<usize>()]));
    Ok(json!({"text": text, "ids": ids, "shape": dims, "logits": flat}))
}

fn pretty(v: &serde_json::Value) -> Vec<u8> {
    format!("{v:#}\n").into_bytes()
}

/// Refuses an output directory that exists and is not empty (before any work is done).
pub(crate) fn refuse_non_empty(out: &Path) -> Result<(), GatesError> {
    if let Ok(meta) = std::fs::symlink_metadata(out) {
        let empty_dir = meta.is_dir()
            && std::fs::read_dir(out)
                .map_err(io_err(out))?
                .next()
                .is_none();
        if !empty_dir {
            return Err(GatesError::Invalid(format!(
                "{}: exists and is not an empty directory; choose a new output directory (kiln never overwrites it)",
                out.display()
            )));
        }
    }
    Ok(())
}

/// Writes `files` into a temporary directory beside `out` and renames it to `out`, so a
/// reader never sees half an export. `out` must not exist or be an empty directory.
pub(crate) fn publish(out: &Path, files: &[(String, Vec<u8>)]) -> Result<(), GatesError> {
    if let Ok(meta) = std::fs::symlink_metadata(out) {
        let empty_dir = meta.is_dir()
            && std::fs::read_dir(out)
                .map_err(io_err(out))?
                .next()
                .is_none();
        if !empty_dir {
            return Err(GatesError::Invalid(format!(
                "{}: exists and is not an empty directory; choose a new output directory (kiln export never overwrites)",
                out.display()
            )));
        }
        std::fs::remove_dir(out).map_err(io_err(out))?;
    }
    let parent = out
        .parent()
        .filter(|p| !p.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    std::fs::create_dir_all(parent).map_err(io_err(parent))?;
    let name = out.file_name().map_or_else(
        || "export".to_string(),
        |n| n.to_string_lossy().into_owned(),
    );
    let tmp = parent.join(format!(".{name}.tmp-{}", std::process::id()));
    if std::fs::symlink_metadata(&tmp).is_ok() {
        std::fs::remove_dir_all(&tmp).map_err(io_err(&tmp))?;
    }
    std::fs::create_dir(&tmp).map_err(io_err(&tmp))?;
    for (file, bytes) in files {
        let path = tmp.join(file);
        std::fs::write(&path, bytes).map_err(io_err(&path))?;
    }
    std::fs::rename(&tmp, out).map_err(io_err(out))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn linear_layers_are_transposed_and_the_rest_kept() {
        let w = HostTensor::f32(
            "model.layers.0.mlp.up_proj.weight".into(),
            vec![2, 3],
            vec![1.0, 2.0, 3.0, 4.0, 5.0, 6.0],
        );
        let t = to_hf_layout(&w);
        assert_eq!(t.shape, [3, 2]);
        // HF row o (output unit o) holds kiln's column o.
        assert_eq!(t.values, [1.0, 4.0, 2.0, 5.0, 3.0, 6.0]);
        let e = HostTensor::f32("model.embed_tokens.weight".into(), vec![2, 3], w.values);
        assert_eq!(to_hf_layout(&e), e);
    }

    #[test]
    fn the_synthetic_tokenizer_has_every_symbol_once() {
        let t = synthetic_tokenizer();
        let v: serde_json::Value = serde_json::from_str(&t.json).unwrap();
        let vocab = v["model"]["vocab"].as_object().unwrap();
        assert_eq!(vocab.len(), synthetic::VOCAB);
        assert_eq!(vocab["="], json!(synthetic::token_of(b'=').unwrap()));
        assert_eq!(vocab["\n"], json!(0));
    }
}

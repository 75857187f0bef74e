//! A Hugging Face Llama directory's `config.json` as `model.init_from` reads it into the config,
//! before any model exists: its file names, its errors, and the model shape it gives
//! ([`HfShape`]); the weights are read by [`crate::model::hf`], above the model. Only what
//! kiln's Llama computes is accepted (`LlamaForCausalLM`, SiLU, no biases, no RoPE scaling,
//! `head_dim` = `hidden_size / num_attention_heads`); anything else is refused naming the key,
//! since its weights would load as a different model.

use std::path::{Path, PathBuf};

/// `config.json` of a Hugging Face model directory.
pub const CONFIG_JSON: &str = "config.json";
/// The tokenizer shipped beside the weights.
pub const TOKENIZER_JSON: &str = "tokenizer.json";
/// Largest `config.json` or index read (real ones are a few KB to a few hundred KB).
pub(crate) const MAX_JSON_BYTES: u64 = 64 * kiln_run::files::MIB;

/// Errors reading a Hugging Face directory.
#[derive(Debug, thiserror::Error)]
pub enum HfError {
    /// The directory, a file or a tensor in it is not what kiln can load.
    #[error("{path}: {reason}")]
    Invalid {
        /// The directory or file.
        path: PathBuf,
        /// What is wrong.
        reason: String,
    },
    /// A file could not be read.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The cause.
        source: std::io::Error,
    },
}

impl HfError {
    /// The exit code: bad input (a missing or wrong file) is 78, never retried; another I/O
    /// error may be transient (1).
    pub fn exit_code(&self) -> i32 {
        match self {
            Self::Io { source, .. }
                if !matches!(
                    source.kind(),
                    std::io::ErrorKind::NotFound
                        | std::io::ErrorKind::InvalidData
                        | std::io::ErrorKind::InvalidInput
                ) =>
            {
                kiln_run::exit::FAILURE
            }
            _ => kiln_run::exit::CONFIG,
        }
    }
}

pub(crate) fn invalid(path: &Path, reason: impl Into<String>) -> HfError {
    HfError::Invalid {
        path: path.to_path_buf(),
        reason: reason.into(),
    }
}

pub(crate) fn io_err(path: &Path) -> impl FnOnce(std::io::Error) -> HfError + '_ {
    move |source| HfError::Io {
        path: path.to_path_buf(),
        source,
    }
}

/// The model's shape as a Hugging Face Llama `config.json` gives it.
#[derive(Debug, Clone, PartialEq)]
pub struct HfShape {
    /// `vocab_size`.
    pub vocab_size: usize,
    /// `hidden_size`.
    pub hidden_size: usize,
    /// `num_hidden_layers`.
    pub num_hidden_layers: usize,
    /// `num_attention_heads`.
    pub num_attention_heads: usize,
    /// `num_key_value_heads` (default: `num_attention_heads`).
    pub num_key_value_heads: usize,
    /// `intermediate_size`.
    pub intermediate_size: usize,
    /// `rope_theta` (or `rope_parameters.rope_theta`, transformers 5's spelling).
    pub rope_theta: f64,
    /// `rms_norm_eps`.
    pub rms_norm_eps: f64,
    /// `tie_word_embeddings`.
    pub tie_word_embeddings: bool,
}

/// One model key [`HfShape`] sets: kiln's key (in `[model]`), its value, and the
/// `config.json` key it comes from.
pub type ShapeKey = (&'static str, toml::Value, &'static str);

impl HfShape {
    /// Reads `dir/config.json`.
    pub fn read(dir: &Path) -> Result<Self, HfError> {
        if !dir.is_dir() {
            return Err(invalid(
                dir,
                "not a directory; model.init_from takes a Hugging Face model directory (config.json, model.safetensors or its shards, tokenizer.json)",
            ));
        }
        let path = dir.join(CONFIG_JSON);
        let text = kiln_run::files::read_to_string_limited(&path, MAX_JSON_BYTES, "a config.json")
            .map_err(io_err(&path))?;
        Self::parse(&text, &path)
    }

    /// Parses the text of a `config.json` (`path` names it in errors).
    pub fn parse(text: &str, path: &Path) -> Result<Self, HfError> {
        let v: serde_json::Value = serde_json::from_str(text).map_err(|e| {
            invalid(
                path,
                format!("not JSON (line {}, column {}): {e}", e.line(), e.column()),
            )
        })?;
        let obj = v
            .as_object()
            .ok_or_else(|| invalid(path, "not a JSON object"))?;
        let c = Keys { obj, path };
        c.architecture()?;
        let hidden_size = c.count("hidden_size", None)?;
        let heads = c.count("num_attention_heads", None)?;
        let shape = Self {
            vocab_size: c.count("vocab_size", None)?,
            hidden_size,
            num_hidden_layers: c.count("num_hidden_layers", None)?,
            num_attention_heads: heads,
            num_key_value_heads: c.count("num_key_value_heads", Some(heads))?,
            intermediate_size: c.count("intermediate_size", None)?,
            rope_theta: c.rope_theta()?,
            rms_norm_eps: c.real("rms_norm_eps", 1e-6)?,
            tie_word_embeddings: c.flag("tie_word_embeddings", false)?,
        };
        c.unsupported(&shape)?;
        Ok(shape)
    }

    /// The `[model]` keys [`HfShape::keys`] sets, in its order.
    pub const KEYS: [&str; 10] = [
        "vocab_size",
        "d_model",
        "n_layers",
        "n_heads",
        "n_kv_heads",
        "ffn_hidden",
        "rope_theta",
        "norm_eps",
        "tie_embeddings",
        "qk_norm",
    ];

    /// The `[model]` keys of kiln's config this shape sets.
    pub fn keys(&self) -> Vec<ShapeKey> {
        let int = |v: usize| toml::Value::Integer(i64::try_from(v).unwrap_or(i64::MAX));
        vec![
            ("vocab_size", int(self.vocab_size), "vocab_size"),
            ("d_model", int(self.hidden_size), "hidden_size"),
            ("n_layers", int(self.num_hidden_layers), "num_hidden_layers"),
            (
                "n_heads",
                int(self.num_attention_heads),
                "num_attention_heads",
            ),
            (
                "n_kv_heads",
                int(self.num_key_value_heads),
                "num_key_value_heads",
            ),
            (
                "ffn_hidden",
                int(self.intermediate_size),
                "intermediate_size",
            ),
            (
                "rope_theta",
                toml::Value::Float(self.rope_theta),
                "rope_theta",
            ),
            (
                "norm_eps",
                toml::Value::Float(self.rms_norm_eps),
                "rms_norm_eps",
            ),
            (
                "tie_embeddings",
                toml::Value::Boolean(self.tie_word_embeddings),
                "tie_word_embeddings",
            ),
            // Llama has no QK-norm.
            (
                "qk_norm",
                toml::Value::Boolean(false),
                "(no QK-norm in Llama)",
            ),
        ]
    }
}

/// Whether two TOML values mean the same config value (an integer and a float compare by
/// value: `--set model.rope_theta=10000` is the float 10000.0).
pub fn same_value(a: &toml::Value, b: &toml::Value) -> bool {
    let num = |v: &toml::Value| match v {
        toml::Value::Integer(i) => Some(*i as f64),
        toml::Value::Float(f) => Some(*f),
        _ => None,
    };
    match (num(a), num(b)) {
        (Some(x), Some(y)) => x == y,
        _ => a == b,
    }
}

/// The keys of a `config.json` object, read with errors naming the file and key.
struct Keys<'a> {
    obj: &'a serde_json::Map<String, serde_json::Value>,
    path: &'a Path,
}

impl Keys<'_> {
    fn get(&self, key: &str) -> Option<&serde_json::Value> {
        self.obj.get(key).filter(|v| !v.is_null())
    }

    fn bad(&self, key: &str, want: &str) -> HfError {
        let got = self
            .obj
            .get(key)
            .map_or("nothing".into(), |v| v.to_string());
        invalid(self.path, format!("{key} must be {want}, got {got}"))
    }

    /// A positive integer (`default` when absent).
    fn count(&self, key: &str, default: Option<usize>) -> Result<usize, HfError> {
        match (self.get(key), default) {
            (None, Some(d)) => Ok(d),
            (None, None) => Err(invalid(self.path, format!("{key} is missing"))),
            (Some(v), _) => v
                .as_u64()
                .filter(|&n| n >= 1)
                .and_then(|n| usize::try_from(n).ok())
                .ok_or_else(|| self.bad(key, "a positive integer")),
        }
    }

    fn real(&self, key: &str, default: f64) -> Result<f64, HfError> {
        match self.get(key) {
            None => Ok(default),
            Some(v) => v
                .as_f64()
                .filter(|x| x.is_finite())
                .ok_or_else(|| self.bad(key, "a finite number")),
        }
    }

    fn flag(&self, key: &str, default: bool) -> Result<bool, HfError> {
        match self.get(key) {
            None => Ok(default),
            Some(v) => v.as_bool().ok_or_else(|| self.bad(key, "true or false")),
        }
    }

    /// `model_type` "llama" and, when listed, `LlamaForCausalLM` among `architectures`.
    fn architecture(&self) -> Result<(), HfError> {
        let model_type = self.get("model_type").and_then(|v| v.as_str());
        let archs: Vec<&str> = self
            .get("architectures")
            .and_then(|v| v.as_array())
            .map(|a| a.iter().filter_map(|s| s.as_str()).collect())
            .unwrap_or_default();
        let llama = match model_type {
            Some(t) => t == "llama" && (archs.is_empty() || archs.contains(&"LlamaForCausalLM")),
            None => archs.contains(&"LlamaForCausalLM"),
        };
        if llama {
            return Ok(());
        }
        Err(invalid(
            self.path,
            format!(
                "unsupported architecture (model_type {}, architectures {archs:?}): kiln imports Hugging Face Llama models (model_type \"llama\", LlamaForCausalLM) only",
                model_type.map_or("missing".into(), |t| format!("{t:?}"))
            ),
        ))
    }

    /// `rope_theta`, or transformers 5's `rope_parameters.rope_theta` (default 10000).
    fn rope_theta(&self) -> Result<f64, HfError> {
        if let Some(p) = self.get("rope_parameters") {
            let theta = p.get("rope_theta").and_then(serde_json::Value::as_f64);
            if let Some(t) = theta.filter(|t| t.is_finite()) {
                return Ok(t);
            }
        }
        self.real("rope_theta", 10000.0)
    }

    /// What kiln's Llama does not compute, refused by key.
    fn unsupported(&self, shape: &HfShape) -> Result<(), HfError> {
        let refuse = |what: String| {
            Err(invalid(
                self.path,
                format!(
                    "{what}, which kiln's Llama does not compute; its weights would load as a different model"
                ),
            ))
        };
        let act = self
            .get("hidden_act")
            .and_then(|v| v.as_str())
            .unwrap_or("silu");
        if act != "silu" {
            return refuse(format!("hidden_act is {act:?}, not \"silu\""));
        }
        for key in ["attention_bias", "mlp_bias"] {
            if self.flag(key, false)? {
                return refuse(format!("{key} is true (biases)"));
            }
        }
        for key in ["rope_scaling", "rope_parameters"] {
            if let Some(s) = self.get(key) {
                let kind = s
                    .get("rope_type")
                    .or_else(|| s.get("type"))
                    .and_then(|v| v.as_str())
                    .unwrap_or("default");
                if kind != "default" {
                    return refuse(format!("{key} has rope_type {kind:?} (RoPE scaling)"));
                }
            }
        }
        if !shape.hidden_size.is_multiple_of(shape.num_attention_heads) {
            return Err(invalid(
                self.path,
                format!(
                    "hidden_size {} is not a multiple of num_attention_heads {}",
                    shape.hidden_size, shape.num_attention_heads
                ),
            ));
        }
        if !shape
            .num_attention_heads
            .is_multiple_of(shape.num_key_value_heads)
        {
            return Err(invalid(
                self.path,
                format!(
                    "num_key_value_heads {} does not divide num_attention_heads {}",
                    shape.num_key_value_heads, shape.num_attention_heads
                ),
            ));
        }
        let head_dim = shape.hidden_size / shape.num_attention_heads;
        if let Some(hd) = self.get("head_dim")
            && hd.as_u64() != Some(head_dim as u64)
        {
            return refuse(format!(
                "head_dim is {hd}, not hidden_size / num_attention_heads = {head_dim}"
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const LLAMA: &str = r#"{"architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "vocab_size": 32, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "rms_norm_eps": 1e-05,
        "rope_theta": 10000.0, "tie_word_embeddings": false, "hidden_act": "silu",
        "head_dim": 16, "rope_scaling": null, "attention_bias": false}"#;

    fn parse(text: &str) -> Result<HfShape, HfError> {
        HfShape::parse(text, Path::new("hf/config.json"))
    }

    fn with(key: &str, value: serde_json::Value) -> String {
        let mut v: serde_json::Value = serde_json::from_str(LLAMA).unwrap();
        v[key] = value;
        v.to_string()
    }

    #[test]
    fn a_llama_config_gives_the_model_keys() {
        let s = parse(LLAMA).unwrap();
        assert_eq!(
            (s.vocab_size, s.hidden_size, s.num_key_value_heads),
            (32, 64, 2)
        );
        assert_eq!(s.rms_norm_eps, 1e-5);
        // transformers 5 writes rope_parameters instead of rope_theta.
        let v5 = with(
            "rope_parameters",
            serde_json::json!({"rope_theta": 500000.0, "rope_type": "default"}),
        );
        assert_eq!(parse(&v5).unwrap().rope_theta, 500000.0);
        let keys = s.keys();
        assert!(
            keys.iter()
                .any(|(k, v, _)| *k == "d_model" && v.as_integer() == Some(64))
        );
    }

    #[test]
    fn what_kiln_cannot_compute_is_refused_by_key() {
        for (key, value, want) in [
            (
                "model_type",
                serde_json::json!("mistral"),
                "unsupported architecture",
            ),
            ("hidden_act", serde_json::json!("gelu"), "hidden_act"),
            ("attention_bias", serde_json::json!(true), "attention_bias"),
            (
                "rope_scaling",
                serde_json::json!({"rope_type": "llama3", "factor": 8.0}),
                "rope_scaling has rope_type \"llama3\"",
            ),
            ("head_dim", serde_json::json!(8), "head_dim is 8"),
            (
                "hidden_size",
                serde_json::json!(-3),
                "hidden_size must be a positive integer",
            ),
            (
                "vocab_size",
                serde_json::json!("many"),
                "vocab_size must be",
            ),
            (
                "num_hidden_layers",
                serde_json::Value::Null,
                "num_hidden_layers is missing",
            ),
        ] {
            let err = parse(&with(key, value)).unwrap_err().to_string();
            assert!(
                err.contains("hf/config.json") && err.contains(want),
                "{key}: {err}"
            );
        }
        let err = parse("[1,").unwrap_err().to_string();
        assert!(
            err.contains("hf/config.json") && err.contains("not JSON"),
            "{err}"
        );
    }

    proptest! {
        /// Any text, and any JSON object of plausible keys, parses or is refused naming the
        /// file: never a panic.
        #[test]
        fn config_json_never_panics(text in ".{0,200}") {
            if let Err(e) = parse(&text) {
                prop_assert!(e.to_string().contains("hf/config.json"));
            }
        }

        #[test]
        fn config_values_never_panic(
            key in prop::sample::select(vec!["vocab_size", "hidden_size", "num_attention_heads",
                "num_key_value_heads", "head_dim", "rope_theta", "rope_scaling", "rope_parameters",
                "rms_norm_eps", "tie_word_embeddings", "architectures", "model_type"]),
            value in prop_oneof![
                any::<i64>().prop_map(serde_json::Value::from),
                any::<f64>().prop_map(|f| serde_json::Number::from_f64(f).map_or(serde_json::Value::Null, serde_json::Value::Number)),
                ".{0,10}".prop_map(serde_json::Value::from),
                Just(serde_json::json!({"rope_type": "yarn"})),
                Just(serde_json::json!([])),
                Just(serde_json::Value::Null),
            ],
        ) {
            match parse(&with(key, value)) {
                Ok(s) => prop_assert!(s.hidden_size.is_multiple_of(s.num_attention_heads)),
                Err(e) => prop_assert!(e.to_string().contains("hf/config.json")),
            }
        }
    }
}

//! Hugging Face Llama directories as the starting weights of a run (`model.init_from`): the
//! inverse of `kiln export --to hf`.
//!
//! - `config.json` gives the model's shape ([`crate::config::hf_config::HfShape`], which the config reads
//!   before any model exists).
//! - The weights are `model.safetensors`, or the files `model.safetensors.index.json` maps
//!   each tensor to (`save_pretrained`'s shards). Every tensor of the model must be there with
//!   its shape; a tensor the model has no place for is refused by name rather than dropped
//!   (rotary `inv_freq` buffers of old checkpoints, and `lm_head.weight` of a tied model,
//!   which transformers ignores too, excepted). F32, BF16 and F16 are read (widened to f32
//!   exactly); linear layers are transposed from `nn.Linear`'s `[out, in]` to kiln's
//!   `[in, out]`, everything else keeps its layout, so export then import is bit-exact.
//!
//! Files are read only if they are regular files; the index may name only files beside it.

use crate::checkpoint::{HostTensor, StoredDtype};
use crate::config::hf_config::{HfError, MAX_JSON_BYTES, invalid, io_err};
use crate::model::ParamSpec;
use std::collections::{BTreeMap, HashMap};
use std::path::Path;

/// The weights of an unsharded directory.
pub const SINGLE_FILE: &str = "model.safetensors";
/// The index of a sharded directory: `{"weight_map": {tensor: file}}`.
pub const INDEX_FILE: &str = "model.safetensors.index.json";

/// Whether kiln stores `name` transposed from Hugging Face's layout: every matrix but the
/// embedding (kiln `[in, out]`, `nn.Linear` `[out, in]`).
pub fn is_linear(name: &str, shape: &[usize]) -> bool {
    shape.len() == 2 && !name.contains("embed_tokens")
}

/// `values` of a `rows x cols` matrix, transposed.
fn transpose(values: &[f32], rows: usize, cols: usize) -> Vec<f32> {
    let mut out = vec![0.0f32; values.len()];
    for r in 0..rows {
        for c in 0..cols {
            out[c * rows + r] = values[r * cols + c];
        }
    }
    out
}

/// The Hugging Face layout of one kiln tensor: matrices other than the embedding are
/// transposed from `[in, out]` to `[out, in]`.
pub fn to_hf_layout(t: &HostTensor) -> HostTensor {
    if !is_linear(&t.name, &t.shape) {
        return t.clone();
    }
    let (rows, cols) = (t.shape[0], t.shape[1]);
    HostTensor {
        name: t.name.clone(),
        shape: vec![cols, rows],
        dtype: t.dtype,
        values: transpose(&t.values, rows, cols),
    }
}

/// kiln's layout of one Hugging Face tensor ([`to_hf_layout`]'s inverse).
pub fn from_hf_layout(t: &HostTensor) -> HostTensor {
    // Transposing back is the same operation on the transposed shape.
    to_hf_layout(t)
}

/// Where each tensor of the directory is: `tensor name -> file name` (beside `dir`).
fn weight_files(dir: &Path) -> Result<BTreeMap<String, String>, HfError> {
    let index = dir.join(INDEX_FILE);
    if index.exists() {
        let text = kiln_run::files::read_to_string_limited(&index, MAX_JSON_BYTES, "an index")
            .map_err(io_err(&index))?;
        return parse_index(&text, &index);
    }
    let single = dir.join(SINGLE_FILE);
    if !single.exists() {
        return Err(invalid(
            dir,
            format!("has neither {SINGLE_FILE} nor {INDEX_FILE}: no weights to load"),
        ));
    }
    Ok(BTreeMap::new())
}

/// Parses `model.safetensors.index.json`'s `weight_map`; every file it names must be a plain
/// file name (beside the index).
pub fn parse_index(text: &str, path: &Path) -> Result<BTreeMap<String, String>, HfError> {
    let v: serde_json::Value = serde_json::from_str(text).map_err(|e| {
        invalid(
            path,
            format!("not JSON (line {}, column {}): {e}", e.line(), e.column()),
        )
    })?;
    let map = v
        .get("weight_map")
        .and_then(|m| m.as_object())
        .ok_or_else(|| invalid(path, "no \"weight_map\" object (tensor name -> file)"))?;
    let mut out = BTreeMap::new();
    for (name, file) in map {
        let file = file
            .as_str()
            .ok_or_else(|| invalid(path, format!("tensor {name}: the file must be a string")))?;
        let plain = !file.is_empty()
            && file != "."
            && file != ".."
            && !file.contains('/')
            && !file.contains('\0');
        if !plain {
            return Err(invalid(
                path,
                format!("tensor {name}: file {file:?} is not a file name beside the index"),
            ));
        }
        out.insert(name.clone(), file.to_string());
    }
    Ok(out)
}

/// A tensor read from a safetensors file.
struct Raw {
    file: String,
    dtype: safetensors::Dtype,
    shape: Vec<usize>,
    bytes: Vec<u8>,
}

/// Every tensor of the directory's safetensors files (read through a memory map, each
/// file once).
fn read_tensors(dir: &Path) -> Result<HashMap<String, Raw>, HfError> {
    let map = weight_files(dir)?;
    let files: Vec<String> = if map.is_empty() {
        vec![SINGLE_FILE.to_string()]
    } else {
        let mut f: Vec<String> = map.values().cloned().collect();
        f.sort();
        f.dedup();
        f
    };
    let mut out: HashMap<String, Raw> = HashMap::new();
    for file in &files {
        let path = dir.join(file);
        let handle = kiln_run::files::open_regular(&path).map_err(io_err(&path))?;
        // SAFETY: a read-only map of a regular file; a file changed while it is read gives
        // wrong values, not unsoundness beyond what any reader of a changing file sees.
        let mmap = unsafe { memmap2::Mmap::map(&handle) }.map_err(io_err(&path))?;
        let st = safetensors::SafeTensors::deserialize(&mmap)
            .map_err(|e| invalid(&path, format!("not a safetensors file: {e}")))?;
        for (name, view) in st.tensors() {
            if !map.is_empty() && map.get(&name) != Some(file) {
                // The index says another file holds it (or does not know it): transformers
                // reads what the index says, so does kiln.
                continue;
            }
            out.insert(
                name,
                Raw {
                    file: file.clone(),
                    dtype: view.dtype(),
                    shape: view.shape().to_vec(),
                    bytes: view.data().to_vec(),
                },
            );
        }
    }
    for (name, file) in &map {
        if !out.contains_key(name) {
            return Err(invalid(
                &dir.join(file),
                format!("tensor {name} is missing (the index says this file holds it)"),
            ));
        }
    }
    Ok(out)
}

/// The values of a raw tensor as f32 (exact for F32, BF16 and F16) and the dtype kiln keeps.
fn decode(raw: &Raw, name: &str, path: &Path) -> Result<(Vec<f32>, StoredDtype), HfError> {
    use safetensors::Dtype;
    let b = &raw.bytes;
    Ok(match raw.dtype {
        Dtype::F32 => (
            b.chunks_exact(4)
                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect(),
            StoredDtype::F32,
        ),
        Dtype::BF16 => (
            b.chunks_exact(2)
                .map(|c| burn::tensor::bf16::from_bits(u16::from_le_bytes([c[0], c[1]])).to_f32())
                .collect(),
            StoredDtype::Bf16,
        ),
        Dtype::F16 => (
            b.chunks_exact(2)
                .map(|c| burn::tensor::f16::from_bits(u16::from_le_bytes([c[0], c[1]])).to_f32())
                .collect(),
            StoredDtype::F32,
        ),
        other => {
            return Err(invalid(
                path,
                format!("tensor {name} has dtype {other:?}; kiln reads F32, BF16 and F16"),
            ));
        }
    })
}

/// Tensors a directory may hold that the model has no place for and that mean nothing to it.
fn ignorable(name: &str, specs: &[ParamSpec]) -> bool {
    let tied = !specs.iter().any(|s| s.name == "lm_head.weight");
    name.ends_with("rotary_emb.inv_freq") || (tied && name == "lm_head.weight")
}

/// The weights of the Hugging Face directory `dir` for the parameters `specs` (of the model
/// its `config.json` describes), in kiln's names, layouts and order. See the module
/// documentation for what is read and refused.
pub fn load_weights(dir: &Path, specs: &[ParamSpec]) -> Result<Vec<HostTensor>, HfError> {
    let mut raw = read_tensors(dir)?;
    let mut out = Vec::with_capacity(specs.len());
    for s in specs {
        let r = raw.remove(&s.name).ok_or_else(|| {
            invalid(
                dir,
                format!(
                    "tensor {} is missing: the model of config.json needs it (shape {:?})",
                    s.name,
                    hf_shape(s)
                ),
            )
        })?;
        let path = dir.join(&r.file);
        let want = hf_shape(s);
        if r.shape != want {
            return Err(invalid(
                &path,
                format!(
                    "tensor {} has shape {:?}; the model of config.json needs {want:?}",
                    s.name, r.shape
                ),
            ));
        }
        let (values, dtype) = decode(&r, &s.name, &path)?;
        let t = HostTensor {
            name: s.name.clone(),
            shape: want,
            dtype,
            values,
        };
        out.push(from_hf_layout(&t));
    }
    let mut extra: Vec<(String, String)> = raw
        .into_iter()
        .filter(|(n, _)| !ignorable(n, specs))
        .map(|(n, r)| (n, r.file))
        .collect();
    extra.sort();
    if let Some((name, file)) = extra.first() {
        return Err(invalid(
            &dir.join(file),
            format!(
                "tensor {name} (and {} more) has no place in the Llama model of config.json; refusing rather than dropping it",
                extra.len() - 1
            ),
        ));
    }
    Ok(out)
}

/// The Hugging Face shape of parameter `s`: its whole tensor's, whatever box of it this rank
/// holds (tensor parallelism cuts it after the import, [`crate::model::session::Session`]).
fn hf_shape(s: &ParamSpec) -> Vec<usize> {
    let whole = &s.placement.global;
    if is_linear(&s.name, whole) {
        vec![whole[1], whole[0]]
    } else {
        whole.clone()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn the_index_names_only_files_beside_it() {
        let p = Path::new("hf/model.safetensors.index.json");
        let ok = parse_index(
            r#"{"metadata": {}, "weight_map": {"a": "model-00001-of-00002.safetensors"}}"#,
            p,
        )
        .unwrap();
        assert_eq!(ok["a"], "model-00001-of-00002.safetensors");
        for bad in [
            r#"{"weight_map": {"a": "../../etc/passwd"}}"#,
            r#"{"weight_map": {"a": ""}}"#,
            r#"{"weight_map": {"a": 3}}"#,
            r#"{"weights": {}}"#,
        ] {
            let err = parse_index(bad, p).unwrap_err().to_string();
            assert!(err.contains("index.json"), "{bad}: {err}");
        }
    }

    #[test]
    fn layouts_round_trip() {
        let w = HostTensor::f32(
            "model.layers.0.mlp.up_proj.weight".into(),
            vec![2, 3],
            vec![1.0, 2.0, 3.0, 4.0, 5.0, 6.0],
        );
        let hf = to_hf_layout(&w);
        assert_eq!(hf.shape, [3, 2]);
        assert_eq!(hf.values, [1.0, 4.0, 2.0, 5.0, 3.0, 6.0]);
        assert_eq!(from_hf_layout(&hf), w);
    }

    proptest! {
        #[test]
        fn index_never_panics(text in ".{0,200}") {
            if let Err(e) = parse_index(&text, Path::new("hf/i.json")) {
                prop_assert!(e.to_string().contains("hf/i.json"));
            }
        }
    }
}

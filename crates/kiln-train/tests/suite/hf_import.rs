//! `model.init_from` against transformers itself: small random `LlamaForCausalLM`s saved by
//! `save_pretrained` (GQA; an untied head in f32 sharded over several files with their index,
//! a tied head in bf16 in one file), committed in `tests/fixtures/hf-llama/` with the logits
//! transformers computed for a fixed prompt (`scripts/hf-import-fixture.py` writes them). kiln
//! loads each directory as a run's starting weights and its forward pass must give the same
//! logits within [`TOLERANCE`].

use kiln_train::model::hf;
use kiln_train::{Config, Session};
use std::path::{Path, PathBuf};

/// Largest absolute logit difference allowed: both sides compute in f32 from the same
/// values, so only summation order differs (measured: about 1e-6 on logits of size ~5).
const TOLERANCE: f32 = 1e-4;

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/hf-llama")
        .join(name)
}

/// Loads the fixture `name` as `kiln train --set model.init_from=...` would and returns the
/// largest difference from transformers' logits.
fn max_logit_diff(name: &str) -> f32 {
    let dir = fixture(name);
    let cfg = Config::load(
        None,
        &[
            format!("model.init_from={}", dir.display()),
            "training.threads=1".into(),
        ],
    )
    .unwrap();
    assert_eq!(
        cfg.data.tokenizer,
        dir.join("tokenizer.json").display().to_string()
    );
    let mut session = Session::new(&cfg, cfg.model.vocab_size).unwrap();
    let tensors = hf::load_weights(&dir, session.model.specs()).unwrap();
    session.load_params(&tensors, &dir).unwrap();
    let reference: serde_json::Value =
        serde_json::from_slice(&std::fs::read(fixture(&format!("{name}.logits.json"))).unwrap())
            .unwrap();
    let ids: Vec<u32> = reference["ids"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_u64().unwrap() as u32)
        .collect();
    let want: Vec<f32> = reference["logits"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_f64().unwrap() as f32)
        .collect();
    let tokens =
        kiln_train::tensor::int_tensor(std::slice::from_ref(&ids), ids.len(), &session.device);
    let logits = session.model.forward(&session.params, tokens);
    let n = logits.dims().iter().product::<usize>();
    let got = kiln_train::tensor::to_vec(&logits.reshape([n]));
    assert_eq!(got.len(), want.len());
    let diff = got
        .iter()
        .zip(&want)
        .map(|(a, b)| (a - b).abs())
        .fold(0.0f32, f32::max);
    let argmax = |v: &[f32]| -> Vec<usize> {
        v.chunks(cfg.model.vocab_size)
            .map(|row| {
                (0..row.len())
                    .max_by(|&a, &b| row[a].total_cmp(&row[b]))
                    .unwrap()
            })
            .collect()
    };
    assert_eq!(argmax(&got), argmax(&want), "{name}: argmax differs");
    println!(
        "{name}: max |kiln - transformers {}| = {diff:e} over {} logits",
        reference["transformers"], n
    );
    diff
}

#[test]
fn untied_sharded_f32_logits_match_transformers() {
    let dir = fixture("untied");
    assert!(dir.join("model.safetensors.index.json").is_file());
    let d = max_logit_diff("untied");
    assert!(d < TOLERANCE, "untied: {d}");
}

#[test]
fn tied_bf16_logits_match_transformers() {
    let d = max_logit_diff("tied");
    assert!(d < TOLERANCE, "tied: {d}");
}

/// A tensor missing from a shard, or one of another shape, is an error naming the tensor.
#[test]
fn missing_or_misshapen_tensors_are_named() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("hf");
    std::fs::create_dir(&dir).unwrap();
    for f in std::fs::read_dir(fixture("tied")).unwrap() {
        let f = f.unwrap().path();
        std::fs::copy(&f, dir.join(f.file_name().unwrap())).unwrap();
    }
    let cfg = Config::load(None, &[format!("model.init_from={}", dir.display())]).unwrap();
    let session = Session::new(&cfg, cfg.model.vocab_size).unwrap();
    let specs = session.model.specs();
    let path = dir.join("model.safetensors");
    let tensors =
        kiln_train::checkpoint::from_safetensors(&std::fs::read(&path).unwrap(), &path).unwrap();
    let gone = "model.layers.1.mlp.up_proj.weight";
    let fewer: Vec<_> = tensors.iter().filter(|t| t.name != gone).cloned().collect();
    std::fs::write(
        &path,
        kiln_train::checkpoint::to_safetensors(&fewer).unwrap(),
    )
    .unwrap();
    let err = hf::load_weights(&dir, specs).unwrap_err().to_string();
    assert!(err.contains(gone) && err.contains("missing"), "{err}");
    let mut wrong = tensors.clone();
    let t = wrong.iter_mut().find(|t| t.name == gone).unwrap();
    t.shape = vec![t.shape[1], t.shape[0]];
    std::fs::write(
        &path,
        kiln_train::checkpoint::to_safetensors(&wrong).unwrap(),
    )
    .unwrap();
    let err = hf::load_weights(&dir, specs).unwrap_err().to_string();
    assert!(err.contains(gone) && err.contains("shape"), "{err}");
    let mut extra = tensors;
    extra.push(kiln_train::checkpoint::HostTensor::f32(
        "model.layers.0.self_attn.q_proj.bias".into(),
        vec![32],
        vec![0.0; 32],
    ));
    std::fs::write(
        &path,
        kiln_train::checkpoint::to_safetensors(&extra).unwrap(),
    )
    .unwrap();
    let err = hf::load_weights(&dir, specs).unwrap_err().to_string();
    assert!(
        err.contains("q_proj.bias") && err.contains("no place"),
        "{err}"
    );
}

/// The model keys come from config.json; a --set that says otherwise is an error naming both.
#[test]
fn a_conflicting_set_names_both() {
    let dir = fixture("untied");
    let init = format!("model.init_from={}", dir.display());
    let err = Config::load(None, &[init.clone(), "model.d_model=64".into()])
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("--set model.d_model=64")
            && err.contains("hidden_size = 32")
            && err.contains("config.json"),
        "{err}"
    );
    // Agreeing keys are fine (an integer rope_theta is the float).
    let cfg = Config::load(
        None,
        &[
            init,
            "model.rope_theta=10000".into(),
            "model.n_kv_heads=2".into(),
        ],
    )
    .unwrap();
    assert_eq!(
        (
            cfg.model.d_model,
            cfg.model.n_kv_heads,
            cfg.model.tie_embeddings
        ),
        (32, 2, false)
    );
    let err = Config::load(None, &["model.init_from=/nonexistent/hf".into()])
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("/nonexistent/hf") && err.contains("not a directory"),
        "{err}"
    );
}

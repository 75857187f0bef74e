//! `kiln export --to hf` with the real binary: the directory's files and layouts, the
//! refusals (QK-norm, a non-empty output), and, gated on a Python with transformers
//! (`KILN_TORCH_PYTHON`, see `scripts/peer-venv.sh`), that `LlamaForCausalLM` loads the export
//! and computes the same logits as kiln on the same tokens.

use std::path::Path;
use std::process::Command;

use crate::common;
use common::KILN;

const RUN: &[&str] = &[
    "training.batch_size=4",
    "training.steps=6",
    "training.threads=1",
    "checkpoint.interval=3",
    "eval.interval=0",
    "eval.samples=8",
];

fn train(dir: &Path, extra: &[&str]) {
    let sets: Vec<&str> = RUN.iter().chain(extra).copied().collect();
    let out = common::train_cmd(dir, &sets).output().unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

fn export(src: &Path, out: &Path) -> (i32, String) {
    let o = Command::new(KILN)
        .arg("export")
        .arg(src)
        .args(["--to", "hf"])
        .arg(out)
        .output()
        .unwrap();
    (
        o.status.code().unwrap_or(-1),
        format!(
            "{}{}",
            String::from_utf8_lossy(&o.stdout),
            String::from_utf8_lossy(&o.stderr)
        ),
    )
}

/// The safetensors header of a file: name -> (dtype, shape).
fn header(path: &Path) -> serde_json::Map<String, serde_json::Value> {
    let bytes = std::fs::read(path).unwrap();
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let v: serde_json::Value = serde_json::from_slice(&bytes[8..8 + n]).unwrap();
    v.as_object().unwrap().clone()
}

#[test]
fn export_writes_a_hugging_face_llama_directory() {
    let tmp = tempfile::tempdir().unwrap();
    let run = tmp.path().join("run");
    train(&run, &[]);
    let out = tmp.path().join("hf");
    let (code, text) = export(&run, &out);
    assert_eq!(code, 0, "{text}");
    assert!(text.contains("synthetic"), "{text}");
    for f in [
        "config.json",
        "model.safetensors",
        "generation_config.json",
        "tokenizer.json",
        "tokenizer_config.json",
    ] {
        assert!(out.join(f).is_file(), "{f} missing");
    }
    let cfg: serde_json::Value =
        serde_json::from_slice(&std::fs::read(out.join("config.json")).unwrap()).unwrap();
    assert_eq!(cfg["architectures"][0], "LlamaForCausalLM");
    // The tiny model of tests/common: d 32, 2 layers, 2 heads, 1 KV head, SwiGLU 64.
    assert_eq!(cfg["hidden_size"], 32);
    assert_eq!(cfg["num_hidden_layers"], 2);
    assert_eq!(cfg["num_attention_heads"], 2);
    assert_eq!(cfg["num_key_value_heads"], 1);
    assert_eq!(cfg["intermediate_size"], 64);
    assert_eq!(cfg["vocab_size"], 16);
    assert_eq!(cfg["torch_dtype"], "float32");
    let h = header(&out.join("model.safetensors"));
    // nn.Linear layout [out, in]: q_proj [32, 32], k_proj [16, 32], gate [64, 32], down [32, 64],
    // lm_head [vocab, hidden]; the embedding [vocab, hidden] as it is.
    let shape = |n: &str| h[n]["shape"].clone();
    assert_eq!(
        shape("model.layers.0.self_attn.k_proj.weight"),
        serde_json::json!([16, 32])
    );
    assert_eq!(
        shape("model.layers.0.mlp.gate_proj.weight"),
        serde_json::json!([64, 32])
    );
    assert_eq!(
        shape("model.layers.1.mlp.down_proj.weight"),
        serde_json::json!([32, 64])
    );
    assert_eq!(shape("lm_head.weight"), serde_json::json!([16, 32]));
    assert_eq!(
        shape("model.embed_tokens.weight"),
        serde_json::json!([16, 32])
    );
    assert_eq!(shape("model.norm.weight"), serde_json::json!([32]));
    assert_eq!(h.len(), 1 + 2 * 9 + 1 + 1 + 1, "{:?}", h.keys());

    // A checkpoint exports too, and an existing non-empty directory is never overwritten.
    let ck = run.join("checkpoints/step-3");
    let (code, text) = export(&ck, &out);
    assert_eq!(code, kiln_run::exit::CONFIG, "{text}");
    assert!(text.contains("not an empty directory"), "{text}");
    let (code, text) = export(&ck, &tmp.path().join("hf-3"));
    assert_eq!(code, 0, "{text}");
    assert!(text.contains("step 3"), "{text}");

    if let Ok(python) = std::env::var("KILN_TORCH_PYTHON") {
        compare_with_transformers(&python, &run, &out);
    } else {
        eprintln!("transformers check skipped: set KILN_TORCH_PYTHON (scripts/peer-venv.sh)");
    }
}

/// kiln's logits on a few lines of the synthetic corpus, against transformers' on the
/// export (which also tokenizes the text itself, to check the shipped tokenizer).
fn compare_with_transformers(python: &str, run: &Path, out: &Path) {
    let loaded = kiln_gates::mc::load_model(run, None).unwrap();
    let reference =
        kiln_gates::export::reference_logits(&loaded.session, "58213=58213\n90417=90417\n33=")
            .unwrap();
    let ref_path = out.with_extension("kiln-logits.json");
    std::fs::write(&ref_path, reference.to_string()).unwrap();
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../scripts/hf-parity.py");
    let o = Command::new(python)
        .arg(&script)
        .arg(out)
        .arg(&ref_path)
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&o.stdout);
    assert!(
        o.status.success(),
        "{text}\n{}",
        String::from_utf8_lossy(&o.stderr)
    );
    println!("{text}");
    let r: serde_json::Value = serde_json::from_str(text.lines().last().unwrap()).unwrap();
    assert!(r["max_abs_diff"].as_f64().unwrap() < 1e-4, "{r}");
    assert_eq!(r["tokenizer_ids_match"], true, "{r}");
}

#[test]
fn qk_norm_models_are_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let run = tmp.path().join("qk");
    train(&run, &["model.qk_norm=true", "training.steps=1"]);
    let out = tmp.path().join("hf");
    let (code, text) = export(&run, &out);
    assert_eq!(code, kiln_run::exit::CONFIG, "{text}");
    assert!(
        text.contains("QK-norm") && text.contains("refused"),
        "{text}"
    );
    assert!(!out.exists());
}

#[test]
fn bf16_master_weights_export_as_bf16() {
    let tmp = tempfile::tempdir().unwrap();
    let run = tmp.path().join("bf16");
    train(
        &run,
        &[
            "training.master_dtype=bf16",
            "training.dtype=bf16",
            "training.steps=2",
        ],
    );
    let out = tmp.path().join("hf");
    let (code, text) = export(&run, &out);
    assert_eq!(code, 0, "{text}");
    let cfg: serde_json::Value =
        serde_json::from_slice(&std::fs::read(out.join("config.json")).unwrap()).unwrap();
    assert_eq!(cfg["torch_dtype"], "bfloat16");
    let h = header(&out.join("model.safetensors"));
    assert!(
        h.iter()
            .filter(|(k, _)| *k != "__metadata__")
            .all(|(_, v)| v["dtype"] == "BF16"),
        "{h:?}"
    );
}

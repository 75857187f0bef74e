//! `kiln train --set model.init_from=HF_DIR` with the real binary: a run exported to a
//! Hugging Face directory starts a new run with bit-identical weights (the `init_from`
//! event's checksum is that of the exported run's weights), the model keys come from the
//! directory's config.json, a conflicting `--set` and a directory that is not a Llama are
//! refused (exit 78) naming what is wrong, and a resumed run ignores `init_from`.

use std::path::Path;
use std::process::Command;

use crate::common;
use common::KILN;

/// The tiny model's run settings that are not model keys (those come from config.json).
const RUN: &[&str] = &[
    "training.batch_size=4",
    "training.seq_len=32",
    "training.threads=1",
    "eval.interval=0",
    "eval.samples=8",
];

fn init_cmd(run: &Path, hf: &Path, extra: &[&str]) -> Command {
    let mut c = common::kiln_cmd(&["train", "--no-progress-bar"]);
    c.arg("--run-dir").arg(run);
    c.arg("--set")
        .arg(format!("model.init_from={}", hf.display()));
    for s in RUN.iter().chain(extra) {
        c.arg("--set").arg(s);
    }
    c
}

fn output(mut c: Command) -> (i32, String) {
    let o = c.output().unwrap();
    (
        o.status.code().unwrap_or(-1),
        format!(
            "{}{}",
            String::from_utf8_lossy(&o.stdout),
            String::from_utf8_lossy(&o.stderr)
        ),
    )
}

fn events(run: &Path, name: &str) -> Vec<serde_json::Value> {
    std::fs::read_to_string(run.join("events.jsonl"))
        .unwrap()
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter(|e| e["event"] == name)
        .collect()
}

/// A run of the tiny model in `src` trained `steps` steps, exported to a Hugging Face
/// directory `hf`.
fn exported(src: &Path, steps: u64, hf: &Path) {
    let steps = format!("training.steps={steps}");
    let sets = [RUN, &[steps.as_str(), "checkpoint.interval=0"]].concat();
    let o = common::train_cmd(src, &sets).output().unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let (code, text) = output({
        let mut c = Command::new(KILN);
        c.arg("export").arg(src).args(["--to", "hf"]).arg(hf);
        c
    });
    assert_eq!(code, 0, "{text}");
}

#[test]
fn export_then_init_from_is_bit_exact_and_resume_ignores_it() {
    let tmp = tempfile::tempdir().unwrap();
    let (src, hf) = (tmp.path().join("src"), tmp.path().join("hf"));
    exported(&src, 4, &hf);

    // The exported run's weights, and the new run's starting ones.
    let loaded = kiln_gates::mc::load_model(&src, None).unwrap();
    let want = kiln_train::tensor::params_checksum(&loaded.session.params);
    let run = tmp.path().join("run");
    let (code, text) = output(init_cmd(&run, &hf, &["training.steps=2"]));
    assert_eq!(code, 0, "{text}");
    assert!(
        text.contains("starting from the Hugging Face weights"),
        "{text}"
    );
    let init = events(&run, "init_from");
    assert_eq!(init.len(), 1, "{init:?}");
    assert_eq!(init[0]["checksum"], format!("{want:016x}"), "{init:?}");
    // The model keys came from config.json, the tokenizer from the directory.
    let cfg = std::fs::read_to_string(run.join("config.toml")).unwrap();
    assert!(
        cfg.contains("d_model = 32") && cfg.contains("n_kv_heads = 1"),
        "{cfg}"
    );
    assert!(cfg.contains("tokenizer.json"), "{cfg}");
    // A trained start is not held to a fresh model's first loss (ln vocab).
    assert!(events(&run, "initial_loss_ok").is_empty());

    // Resumed: the checkpoint wins and init_from is not read (even once its weights and
    // config.json are gone, the run's own record rebuilds the model for export; the
    // tokenizer, which the run's data.tokenizer names, stays).
    let (code, text) = output(init_cmd(&run, &hf, &["training.steps=3"]));
    assert_eq!(code, 0, "{text}");
    assert!(
        text.contains("model.init_from") && text.contains("is not read"),
        "{text}"
    );
    assert_eq!(events(&run, "init_from").len(), 1);
    for f in ["config.json", "model.safetensors"] {
        std::fs::remove_file(hf.join(f)).unwrap();
    }
    let (code, text) = output({
        let mut c = Command::new(KILN);
        c.arg("export")
            .arg(&run)
            .args(["--to", "hf"])
            .arg(tmp.path().join("again"));
        c
    });
    assert_eq!(code, 0, "{text}");
}

#[test]
fn bad_init_from_is_refused_naming_what_is_wrong() {
    let tmp = tempfile::tempdir().unwrap();
    let hf = tmp.path().join("hf");
    std::fs::create_dir(&hf).unwrap();
    let fixture =
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../kiln-train/tests/fixtures/hf-llama/untied");
    for f in std::fs::read_dir(&fixture).unwrap() {
        let f = f.unwrap().path();
        std::fs::copy(&f, hf.join(f.file_name().unwrap())).unwrap();
    }
    let run = tmp.path().join("run");
    // A --set that contradicts config.json names both.
    let (code, text) = output(init_cmd(&run, &hf, &["model.n_layers=3"]));
    assert_eq!(code, kiln_run::exit::CONFIG, "{text}");
    assert!(
        text.contains("--set model.n_layers=3") && text.contains("num_hidden_layers = 2"),
        "{text}"
    );
    // A shard gone: the tensor and the file are named.
    std::fs::remove_file(hf.join("model-00002-of-00003.safetensors")).unwrap();
    let (code, text) = output(init_cmd(&run, &hf, &["training.steps=1"]));
    assert_eq!(code, kiln_run::exit::CONFIG, "{text}");
    assert!(text.contains("model-00002-of-00003.safetensors"), "{text}");
    // Not a Llama.
    let cfg = std::fs::read_to_string(hf.join("config.json")).unwrap();
    std::fs::write(hf.join("config.json"), cfg.replace("\"llama\"", "\"gpt2\"")).unwrap();
    let (code, text) = output(init_cmd(
        &tmp.path().join("run2"),
        &hf,
        &["training.steps=1"],
    ));
    assert_eq!(code, kiln_run::exit::CONFIG, "{text}");
    assert!(
        text.contains("config.json") && text.contains("unsupported architecture"),
        "{text}"
    );
}

/// Issue 60: a run started from Hugging Face weights could not resume once their folder was
/// gone: the same command, and `kiln train RUN/config.toml`, exited 78 "not a directory",
/// though only a fresh start reads the folder. Both resume now, from the shape the run
/// recorded; a fresh start without the folder is refused, saying how such a run resumes.
#[test]
fn a_run_started_from_hugging_face_weights_resumes_once_their_folder_is_gone() {
    let tmp = tempfile::tempdir().unwrap();
    let (src, hf) = (tmp.path().join("src"), tmp.path().join("hf"));
    exported(&src, 2, &hf);
    let run = tmp.path().join("run");
    let (code, text) = output(init_cmd(
        &run,
        &hf,
        &["training.steps=4", "checkpoint.interval=2"],
    ));
    assert_eq!(code, 0, "{text}");
    std::fs::remove_dir_all(&hf).unwrap();
    // The last checkpoint lost: the same command resumes from step 2 without the folder.
    std::fs::remove_dir_all(run.join("checkpoints/step-4")).unwrap();
    std::fs::remove_file(run.join("model.safetensors")).unwrap();
    let (code, text) = output(init_cmd(
        &run,
        &hf,
        &["training.steps=4", "checkpoint.interval=2"],
    ));
    assert_eq!(code, 0, "{text}");
    assert!(text.contains("resumed from"), "{text}");
    // So does the run's recorded config.
    let mut c = common::kiln_cmd(&["train", "--no-progress-bar"]);
    c.arg(run.join("config.toml")).arg("--run-dir").arg(&run);
    c.args(["--set", "training.steps=6"]);
    let (code, text) = output(c);
    assert_eq!(code, 0, "{text}");
    // A fresh start needs the folder.
    let (code, text) = output(init_cmd(
        &tmp.path().join("fresh"),
        &hf,
        &["training.steps=2"],
    ));
    assert_eq!(code, 78, "{text}");
    assert!(
        text.contains("is not a directory") && text.contains("resumes without it"),
        "{text}"
    );
}

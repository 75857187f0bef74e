//! `kiln merge` with the real binary: the weighted average of a run's checkpoints, element by
//! element, which `kiln eval` and `kiln export` then take; checkpoints of another run, bad
//! weights and a path that is not a checkpoint are refused naming what is wrong.

use std::path::Path;
use std::process::Command;

use crate::common;
use common::KILN;
use kiln_train::checkpoint::{from_safetensors, load};

const RUN: &[&str] = &[
    "training.batch_size=4",
    "training.steps=6",
    "training.threads=1",
    "checkpoint.interval=2",
    "eval.interval=0",
    "eval.samples=8",
];

fn kiln(args: &[&str]) -> (i32, String) {
    let o = Command::new(KILN).args(args).output().unwrap();
    (
        o.status.code().unwrap_or(-1),
        format!(
            "{}{}",
            String::from_utf8_lossy(&o.stdout),
            String::from_utf8_lossy(&o.stderr)
        ),
    )
}

fn train(dir: &Path, extra: &[&str]) {
    let sets: Vec<&str> = RUN.iter().chain(extra).copied().collect();
    let out = common::train_cmd(dir, &sets).output().unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

#[test]
fn merge_averages_checkpoints_of_one_run() {
    let tmp = tempfile::tempdir().unwrap();
    let run = tmp.path().join("run");
    train(&run, &[]);
    let a = run.join("checkpoints/step-4");
    let b = run.join("checkpoints/step-6");
    let out = tmp.path().join("merged");
    let (s, o) = (a.to_str().unwrap(), out.to_str().unwrap());
    let (code, text) = kiln(&[
        "merge",
        s,
        b.to_str().unwrap(),
        "--to",
        o,
        "--weights",
        "1,3",
    ]);
    assert_eq!(code, 0, "{text}");
    assert!(
        text.contains("step 4 x 0.2500") && text.contains("step 6 x 0.7500"),
        "{text}"
    );
    let path = out.join("model.safetensors");
    let merged = from_safetensors(&std::fs::read(&path).unwrap(), &path).unwrap();
    let (ca, cb) = (load(&a).unwrap().model, load(&b).unwrap().model);
    for t in &merged {
        let x = ca.iter().find(|u| u.name == t.name).unwrap();
        let y = cb.iter().find(|u| u.name == t.name).unwrap();
        for ((m, p), q) in t.values.iter().zip(&x.values).zip(&y.values) {
            let want = (0.25 * f64::from(*p) + 0.75 * f64::from(*q)) as f32;
            assert_eq!(m.to_bits(), want.to_bits(), "{}", t.name);
        }
    }
    // The result is a run directory eval and export take.
    let (code, text) = kiln(&["eval", o]);
    assert_eq!(code, 0, "{text}");
    let (code, text) = kiln(&[
        "export",
        o,
        "--to",
        "hf",
        tmp.path().join("hf").to_str().unwrap(),
    ]);
    assert_eq!(code, 0, "{text}");
    // Uniform by default; the output is never overwritten.
    let (code, text) = kiln(&["merge", s, b.to_str().unwrap(), "--to", o]);
    assert_eq!(code, kiln_run::exit::CONFIG, "{text}");
    assert!(text.contains("not an empty directory"), "{text}");

    // Another run's checkpoint is refused, naming both.
    let other = tmp.path().join("other");
    train(&other, &["training.seed=7"]);
    let c = other.join("checkpoints/step-6");
    let o2 = tmp.path().join("m2");
    let (code, text) = kiln(&[
        "merge",
        s,
        c.to_str().unwrap(),
        "--to",
        o2.to_str().unwrap(),
    ]);
    assert_eq!(code, kiln_run::exit::CONFIG, "{text}");
    assert!(
        text.contains("another run") && text.contains("step-4") && text.contains("other"),
        "{text}"
    );
    // Bad weights, a single checkpoint, a path that is not a checkpoint.
    let (code, text) = kiln(&[
        "merge",
        s,
        b.to_str().unwrap(),
        "--to",
        o2.to_str().unwrap(),
        "--weights",
        "1",
    ]);
    assert_eq!(code, kiln_run::exit::USAGE, "{text}");
    assert!(text.contains("--weights has 1 value(s) for 2"), "{text}");
    let (code, text) = kiln(&[
        "merge",
        s,
        run.to_str().unwrap(),
        "--to",
        o2.to_str().unwrap(),
    ]);
    assert_eq!(code, kiln_run::exit::CONFIG, "{text}");
    assert!(text.contains("not a checkpoint directory"), "{text}");
    assert!(!o2.exists());
}

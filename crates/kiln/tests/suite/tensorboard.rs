//! `metrics.tensorboard = true` with the real binary: a run killed after a checkpoint and
//! resumed writes one TensorBoard event file whose steps each appear once, with the values of
//! `metrics.jsonl`; guard events are text. Read back with kiln's own TFRecord reader always,
//! and, gated on a Python with `tensorboard` (`KILN_TORCH_PYTHON`, see
//! `scripts/peer-venv.sh`), with TensorBoard's `EventAccumulator` (`scripts/tensorboard-peer.py`).

use std::collections::BTreeMap;
use std::path::Path;
use std::process::Command;

use crate::common;
use kiln_train::components::tensorboard::{Kind, What, scan};

const SETS: &[&str] = &[
    "training.batch_size=4",
    "training.threads=1",
    "training.steps=8",
    "checkpoint.interval=3",
    "checkpoint.snapshot_interval=0",
    "checkpoint.async=false",
    "eval.interval=4",
    "eval.samples=8",
    "metrics.tensorboard=true",
    "debug.nan_at_step=7",
];

/// (step, tag) -> value of every scalar in the run's event file, and the steps in file order.
/// (step, tag) -> value of every scalar.
type Scalars = BTreeMap<(i64, String), f32>;

fn read_events(run: &Path) -> (Scalars, Vec<i64>, Vec<String>) {
    let dir = run.join("tensorboard");
    let files: Vec<_> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    assert_eq!(files.len(), 1, "{files:?}");
    let mut values = BTreeMap::new();
    let mut order = Vec::new();
    let mut texts = Vec::new();
    scan(&mut std::fs::File::open(&files[0]).unwrap(), |e| {
        if let Some(What::Summary(s)) = &e.what {
            for v in &s.value {
                match &v.kind {
                    Some(Kind::SimpleValue(x)) => {
                        let dup = values.insert((e.step, v.tag.clone()), *x);
                        assert!(dup.is_none(), "step {} {} twice", e.step, v.tag);
                        if v.tag == "train/loss" {
                            order.push(e.step);
                        }
                    }
                    Some(Kind::Tensor(_)) => texts.push(v.tag.clone()),
                    None => {}
                }
            }
        }
        true
    });
    (values, order, texts)
}

#[test]
fn resumed_runs_append_each_step_once() {
    let tmp = tempfile::tempdir().unwrap();
    let run = tmp.path().join("run");
    let mut child = common::spawn_until(common::train_cmd(&run, SETS), 5, Some(3));
    child.kill().unwrap();
    child.wait().unwrap();
    let out = common::train_cmd(&run, SETS).output().unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );

    let (values, order, texts) = read_events(&run);
    // Every step once, in order, whatever the kill left (steps 4 and 5 were trained twice).
    let sorted: Vec<i64> = {
        let mut o = order.clone();
        o.sort();
        o.dedup();
        o
    };
    assert_eq!(order, sorted, "{order:?}");
    assert_eq!(*order.last().unwrap(), 8);
    // The values are metrics.jsonl's (its last line of each step: the resumed run's).
    let metrics = std::fs::read_to_string(run.join("metrics.jsonl")).unwrap();
    let mut last: BTreeMap<i64, serde_json::Value> = BTreeMap::new();
    for l in metrics.lines() {
        let v: serde_json::Value = serde_json::from_str(l).unwrap();
        if v.get("loss").is_some() {
            last.insert(v["step"].as_i64().unwrap(), v);
        }
    }
    for (step, m) in &last {
        if let Some(x) = values.get(&(*step, "train/loss".to_string())) {
            assert_eq!(*x, m["loss"].as_f64().unwrap() as f32, "step {step}");
        }
    }
    for tag in [
        "train/grad_norm",
        "train/lr",
        "train/tokens_per_s",
        "train/mfu",
        "eval/loss",
    ] {
        assert!(values.keys().any(|(_, t)| t == tag), "{tag} missing");
    }
    assert!(texts.iter().any(|t| t.starts_with("guards/")), "{texts:?}");

    if let Ok(python) = std::env::var("KILN_TORCH_PYTHON") {
        peer_check(&python, &run, &values);
    } else {
        eprintln!("TensorBoard check skipped: set KILN_TORCH_PYTHON (scripts/peer-venv.sh)");
    }
}

/// TensorBoard's EventAccumulator reads the same scalars, each step once.
fn peer_check(python: &str, run: &Path, values: &Scalars) {
    let has = Command::new(python)
        .args(["-c", "import tensorboard"])
        .status();
    if !has.is_ok_and(|s| s.success()) {
        eprintln!("TensorBoard check skipped: {python} has no tensorboard (scripts/peer-venv.sh)");
        return;
    }
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../scripts/tensorboard-peer.py");
    let o = Command::new(python)
        .arg(script)
        .arg(run.join("tensorboard"))
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&o.stdout);
    assert!(
        o.status.success(),
        "{text}{}",
        String::from_utf8_lossy(&o.stderr)
    );
    let r: serde_json::Value = serde_json::from_str(text.lines().last().unwrap()).unwrap();
    let loss = r["scalars"]["train/loss"].as_array().unwrap();
    let steps: Vec<i64> = loss.iter().map(|p| p[0].as_i64().unwrap()).collect();
    assert_eq!(steps, (1..=8).collect::<Vec<_>>(), "{r}");
    let mut compared = 0;
    for (tag, points) in r["scalars"].as_object().unwrap() {
        for p in points.as_array().unwrap() {
            let key = (p[0].as_i64().unwrap(), tag.clone());
            assert_eq!(values[&key], p[1].as_f64().unwrap() as f32, "{key:?}");
            compared += 1;
        }
    }
    println!(
        "TensorBoard {}: EventAccumulator read {compared} scalars ({} tags), steps 1..8 once each, texts {}",
        r["tensorboard"],
        r["scalars"].as_object().unwrap().len(),
        r["texts"]
    );
}

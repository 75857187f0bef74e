//! The trainer on real token data: Megatron indexed datasets blended by kiln-data, with exact
//! resume (the data cursor and the blend's weight history are in the checkpoint).

use kiln_data::{DType, IndexedDatasetBuilder};
use kiln_train::{Config, Outcome, Silent, TrainOptions, train};
use std::path::Path;

fn write_dataset(prefix: &Path, seed: u32, docs: usize) {
    let mut b = IndexedDatasetBuilder::create(prefix, DType::optimal(64)).unwrap();
    let mut x = seed;
    for d in 0..docs {
        // Documents with a learnable pattern: counting up modulo the vocab from a random start.
        x = x.wrapping_mul(1_103_515_245).wrapping_add(12_345);
        let start = (x >> 16) % 60;
        let len = 20 + (d % 40);
        let doc: Vec<u32> = (0..len as u32).map(|i| (start + i) % 60 + 1).collect();
        b.add_document(&doc).unwrap();
    }
    b.finish().unwrap();
}

fn config(list: &Path) -> Config {
    let sets: Vec<String> = [
        "model.vocab_size=64",
        "model.d_model=32",
        "model.n_layers=2",
        "model.n_heads=2",
        "model.n_kv_heads=1",
        "model.ffn_hidden=64",
        "training.seq_len=32",
        "training.batch_size=4",
        "training.steps=12",
        "checkpoint.interval=6",
        "eval.interval=0",
    ]
    .iter()
    .map(|s| s.to_string())
    .chain([format!("data.corpus_list={:?}", list.display().to_string())])
    .collect();
    Config::load(None, &sets).unwrap()
}

#[test]
fn trains_on_a_blended_corpus_list_and_resumes_exactly() {
    let tmp = tempfile::tempdir().unwrap();
    write_dataset(&tmp.path().join("a"), 1, 300);
    write_dataset(&tmp.path().join("b"), 2, 200);
    let list = tmp.path().join("corpora.txt");
    std::fs::write(&list, "# two corpora\n0.7 a web\n0.3 b code\n").unwrap();
    let cfg = config(&list);

    let full = tmp.path().join("full");
    let report = train(
        &TrainOptions {
            config: cfg.clone(),
            run_dir: full.clone(),
        },
        &mut Silent,
    )
    .unwrap();
    assert_eq!(report.outcome, Outcome::Completed);
    assert!(
        report.last_loss.unwrap() < (64f32).ln(),
        "it learned something: {:?}",
        report.last_loss
    );
    let state: serde_json::Value = serde_json::from_slice(
        &std::fs::read(full.join("checkpoints/step-12/state.json")).unwrap(),
    )
    .unwrap();
    assert!(
        state["data_schedule"].is_object(),
        "the blend's weight history is checkpointed: {state}"
    );

    // Lose the last checkpoint and the final weights; the rerun resumes at step 6.
    let final_model = std::fs::read(full.join("model.safetensors")).unwrap();
    std::fs::remove_dir_all(full.join("checkpoints/step-12")).unwrap();
    std::fs::remove_file(full.join("model.safetensors")).unwrap();
    train(
        &TrainOptions {
            config: cfg,
            run_dir: full.clone(),
        },
        &mut Silent,
    )
    .unwrap();
    assert!(
        std::fs::read(full.join("model.safetensors")).unwrap() == final_model,
        "resume on blended data is not exact"
    );
    let events = kiln_run::read_events(&full).unwrap();
    assert!(
        events
            .iter()
            .any(|e| e.event == "resume" && e.fields["step"] == 6)
    );
}

#[test]
fn a_bad_corpus_list_is_a_clear_error() {
    let tmp = tempfile::tempdir().unwrap();
    let list = tmp.path().join("bad.txt");
    std::fs::write(&list, "not-a-weight missing_prefix\n").unwrap();
    let err = match train(
        &TrainOptions {
            config: config(&list),
            run_dir: tmp.path().join("r"),
        },
        &mut Silent,
    ) {
        Ok(_) => panic!("training on a bad list must fail"),
        Err(e) => e.to_string(),
    };
    assert!(err.contains("bad.txt"), "{err}");
}

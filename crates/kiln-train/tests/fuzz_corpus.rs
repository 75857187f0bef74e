//! The fuzz targets of kiln-train's parsers (checkpoint directories, safetensors, state.json
//! as resume reads it, config files, `--set` overrides), run over their committed seed
//! corpora and crash regressions (`fuzz/corpus/<target>/`, `fuzz/regressions/<target>/`) as
//! ordinary tests. The harnesses are the fuzz targets' own (`fuzz/harness/`);
//! `scripts/fuzz.sh` runs them under libFuzzer.

#[path = "../../../fuzz/harness/alloc_cap.rs"]
mod alloc_cap;
#[path = "../../../fuzz/harness/checkpoint.rs"]
mod checkpoint_target;
#[path = "../../../fuzz/harness/config_set.rs"]
mod config_set;
#[path = "../../../fuzz/harness/config_toml.rs"]
mod config_toml;
#[path = "../../../fuzz/harness/corpus.rs"]
mod corpus;
#[path = "../../../fuzz/harness/safetensors.rs"]
mod safetensors_target;
#[path = "../../../fuzz/harness/state_json.rs"]
mod state_json;

use kiln_data::blend::BlendSchedule;
use kiln_train::checkpoint::{self, Checkpoint, HostTensor};
use kiln_train::{Config, TrainState};

fn tensors(prefix: &str, n: usize) -> Vec<HostTensor> {
    (0..n)
        .map(|i| {
            HostTensor::f32(
                format!("{prefix}layers.{i}.w"),
                vec![2, i + 1],
                (0..2 * (i + 1)).map(|v| v as f32 * 0.5 - 1.0).collect(),
            )
        })
        .collect()
}

/// A `state.json` value as the trainer writes it, with a two-segment data schedule.
fn state(step: u64) -> serde_json::Value {
    let mut st = TrainState::fresh(1234, "0123456789abcdef".into(), 32, 2);
    st.step = step;
    st.tokens_seen = step * 32 * 64;
    st.advance_data(step + 1);
    st.optimizer_step = step;
    st.schedule = "cosine".into();
    st.lr = 3e-4;
    st.model_hash = "ab".repeat(32);
    st.config_hash = "cd".repeat(32);
    st.kiln_version = "0.1.0".into();
    let schedule = BlendSchedule::single(vec![("web/cc_text".into(), 0.7), ("code".into(), 0.3)])
        .continued(
            vec![("web/cc_text".into(), 0.2), ("code".into(), 0.8)],
            4096 + 17,
        );
    st.data_schedule = Some(serde_json::to_value(&schedule).unwrap());
    serde_json::to_value(&st).unwrap()
}

#[test]
fn checkpoint_seeds_and_regressions() {
    let dir = tempfile::tempdir().unwrap();
    let ck = Checkpoint {
        step: 7,
        model: tensors("", 3),
        optimizer: tensors("opt.", 2),
        state: state(7),
        shards: Vec::new(),
    };
    let saved = checkpoint::save(dir.path(), &ck.contents()).unwrap();
    let read = |name: &str| std::fs::read(saved.join(name)).unwrap();
    let parts: Vec<Vec<u8>> = checkpoint_target::FILES.iter().map(|f| read(f)).collect();
    let join = |parts: &[Vec<u8>]| parts.join(checkpoint_target::SEP);
    let mut auto = parts.clone();
    auto[0].clear();
    // A sharded run's checkpoint: each of two ranks wrote its pieces of the state.
    let pieces = |rank: usize| {
        let t = tensors("opt.", 2);
        let piece = |t: &HostTensor, lo: usize, hi: usize| {
            HostTensor::f32(
                format!("{}@{lo}", t.name),
                vec![hi - lo],
                t.values[lo..hi].to_vec(),
            )
        };
        let (n0, n1) = (t[0].values.len(), t[1].values.len());
        match rank {
            0 => vec![piece(&t[0], 0, n0), piece(&t[1], 0, 1)],
            _ => vec![piece(&t[1], 1, n1)],
        }
    };
    let root = dir.path().join("sharded");
    let shards = (0..2)
        .map(|r| {
            checkpoint::write_shard(
                &root,
                7,
                kiln_run::layout::checkpoint_optimizer_shard(r, 2),
                &pieces(r),
            )
            .unwrap()
        })
        .collect();
    let sharded_ck = Checkpoint {
        optimizer: Vec::new(),
        shards,
        ..ck
    };
    let sharded = checkpoint::save(&root, &sharded_ck.contents()).unwrap();
    let whole = checkpoint::load(&saved).unwrap().optimizer;
    let assembled = checkpoint::load(&sharded).unwrap().optimizer;
    assert_eq!(whole.len(), assembled.len());
    for (a, b) in whole.iter().zip(&assembled) {
        assert_eq!((&a.name, &a.values), (&b.name, &b.values));
    }
    let read_sharded = |name: &str| std::fs::read(sharded.join(name)).unwrap();
    let sharded_parts: Vec<Vec<u8>> = checkpoint_target::SHARDED
        .iter()
        .map(|f| read_sharded(f))
        .collect();
    let mut sharded_auto = sharded_parts.clone();
    sharded_auto[0].clear();
    let seeds = [
        ("saved-step-7", join(&parts)),
        ("saved-step-7-auto-manifest", join(&auto)),
        ("sharded-step-7", join(&sharded_parts)),
        ("sharded-step-7-auto-manifest", join(&sharded_auto)),
    ];
    corpus::check_seeds("checkpoint", &seeds);
    assert!(corpus::run_all("checkpoint", checkpoint_target::run) >= seeds.len());
}

#[test]
fn safetensors_seeds_and_regressions() {
    let seeds = [
        (
            "model",
            checkpoint::to_safetensors(&tensors("", 3)).unwrap(),
        ),
        ("empty", checkpoint::to_safetensors(&[]).unwrap()),
        (
            "scalar-and-zero-dim",
            checkpoint::to_safetensors(&[
                HostTensor::f32("s".into(), vec![], vec![2.5]),
                HostTensor::f32("z".into(), vec![0, 3], vec![]),
            ])
            .unwrap(),
        ),
    ];
    corpus::check_seeds("safetensors", &seeds);
    assert!(corpus::run_all("safetensors", safetensors_target::run) >= seeds.len());
}

#[test]
fn state_json_seeds_and_regressions() {
    let seeds = [
        (
            "state-two-segments",
            serde_json::to_vec_pretty(&state(7)).unwrap(),
        ),
        (
            "state-at-zero",
            serde_json::to_vec_pretty(&state(0)).unwrap(),
        ),
    ];
    corpus::check_seeds("state_json", &seeds);
    assert!(corpus::run_all("state_json", state_json::run) >= seeds.len());
}

#[test]
fn config_toml_seeds_and_regressions() {
    // (The corpus also holds a copy of the shipped configs/tiny.toml.)
    let seeds = [("defaults", Config::default().to_toml().into_bytes())];
    corpus::check_seeds("config_toml", &seeds);
    assert!(corpus::run_all("config_toml", config_toml::run) >= seeds.len());
}

#[test]
fn config_set_seeds_and_regressions() {
    assert!(corpus::run_all("config_set", config_set::run) >= 2);
}

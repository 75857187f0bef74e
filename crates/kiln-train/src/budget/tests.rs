use super::advice::*;
use super::device::*;
use super::host::*;
use super::verdict::*;
use super::*;
use crate::config::Config;
use crate::model::Llama;
use kiln_run::host::MemoryLimit;
use std::path::Path;

fn config(sets: &[&str]) -> Config {
    let sets: Vec<String> = sets.iter().map(|s| s.to_string()).collect();
    Config::load(None, &sets).unwrap()
}

#[test]
fn param_count_matches_the_model() {
    for sets in [
        &[][..],
        &["model.tie_embeddings=true", "model.qk_norm=true"][..],
        &[
            "model.d_model=96",
            "model.n_heads=6",
            "model.n_kv_heads=3",
            "model.ffn_hidden=200",
        ][..],
    ] {
        let c = config(sets);
        for vocab in [16, 1000] {
            let exact = Llama::new(&c.model, vocab).num_params() as f64;
            assert_eq!(
                param_count(&c.model, vocab),
                exact,
                "{sets:?} vocab {vocab}"
            );
        }
    }
}

#[test]
fn each_part_grows_with_its_keys() {
    let base = estimate(&config(&[]), 16, 1);
    let longer = estimate(&config(&["training.seq_len=128"]), 16, 1);
    // Attention scores are quadratic in the sequence: more than twice the activations.
    assert!(longer.activations > 2.0 * base.activations);
    assert_eq!(longer.resident, base.resident);
    let wider = estimate(&config(&["model.d_model=256"]), 16, 1);
    assert!(wider.params > 2.0 * base.params);
    let no_guards = estimate(
        &config(&[
            "guards.snapshot_interval=0",
            "guards.frozen_check_interval=0",
        ]),
        16,
        1,
    );
    assert_eq!(no_guards.resident, 12.0 * base.params);
    assert!(base.need() > OVERHEAD);
    // Activation checkpointing keeps one block's activations and every block's input.
    let deep = &["model.n_layers=8", "training.seq_len=256"];
    let kept = estimate(&config(deep), 16, 1);
    let mut sets = deep.to_vec();
    sets.push("training.activation_checkpointing=blocks");
    let recomputed = estimate(&config(&sets), 16, 1);
    assert!(
        recomputed.activations < kept.activations / 4.0,
        "{recomputed:?} {kept:?}"
    );
    assert_eq!(recomputed.resident, kept.resident);
}

/// With replicas the state is cut over one replica's ranks: 4 ranks as 2 replicas need
/// what 2 ranks of one replica do, more than 4 ranks of one; a hybrid run that does not
/// fit is told the most replicas that would.
#[test]
fn on_an_accelerator_only_the_host_copies_count() {
    let long = &["training.seq_len=2048", "training.batch_size=4"][..];
    let host = estimate(&config(long), 32000, 1);
    let mut gpu = config(long);
    for device in ["cuda", "cuda:1", "rocm:0", "vulkan"] {
        gpu.training.device = device.into();
        let on_gpu = estimate(&gpu, 32000, 1);
        assert!(on_gpu.on_accelerator, "{device}");
        // The same parts; the activations, weights and moments are device memory.
        assert_eq!(on_gpu.activations, host.activations);
        let want = on_gpu.checkpoint * SAFETY + OVERHEAD;
        assert!((on_gpu.need() - want).abs() < 1.0, "{device}");
        assert!(on_gpu.need() < host.need() / 2.0);
    }
    for device in ["flex", "cpu", "cubecl-cpu"] {
        gpu.training.device = device.into();
        assert_eq!(estimate(&gpu, 32000, 1).need(), host.need(), "{device}");
    }
}

/// The 1B-class model of the GPU benchmark (bench/gpu/models.py) as it ran on an H200:
/// batch 4 x 2048, bf16 on f32 masters, no guard copies, on `cuda`.
fn one_b(extra: &[&str]) -> Config {
    let mut sets = vec![
        "model.vocab_size=32000",
        "model.d_model=2048",
        "model.n_layers=16",
        "model.n_heads=16",
        "model.n_kv_heads=4",
        "model.ffn_hidden=5632",
        "training.batch_size=4",
        "training.seq_len=2048",
        "training.dtype=bf16",
        "training.device=cuda",
        "guards.snapshot_interval=0",
        "guards.frozen_check_interval=0",
    ];
    sets.extend_from_slice(extra);
    config(&sets)
}

const GIB: f64 = 1024.0 * 1024.0 * 1024.0;

/// The device estimate against the one measurement: the 1B-class model replicated on an
/// H200 peaked at 34,966 MiB (nvidia-smi, bench/gpu/results/h200.md run 7); the table,
/// before the safety factor and with the context, within 10 % of it, and the need above it.
#[test]
fn the_device_estimate_matches_the_h200_measurement() {
    let e = device_estimate_on(&one_b(&[]), 32000, 1).unwrap();
    let table = e.state + e.step + DEVICE_CONTEXT;
    let measured = 34_966.0 * 1024.0 * 1024.0;
    assert!(
        (table / measured - 1.0).abs() < 0.10,
        "table {:.1} GiB vs measured {:.1} GiB",
        table / GIB,
        measured / GIB
    );
    assert!(e.need() > measured && e.need() < 1.4 * measured);
    // Not an accelerator: no device estimate.
    let mut cpu = one_b(&[]);
    cpu.training.device = "cubecl-cpu".into();
    assert!(device_estimate_on(&cpu, 32000, 1).is_none());
}

/// Full sharding holds `1/N` of the replicated state per rank (weights, moments), and
/// each mode's state lies between (the goal: at most 1/N + 10 %).
#[test]
fn the_device_state_per_rank_shrinks_with_the_mode() {
    let state = |mode: &str, r: usize| {
        let set = format!("parallelism.shard={mode}");
        device_estimate_on(&one_b(&[&set]), 32000, r).unwrap().state
    };
    let whole = state("none", 4);
    for r in [2usize, 4, 8] {
        let full = state("parameters", r);
        assert!((full / (whole / r as f64) - 1.0).abs() < 1e-9, "{r} ranks");
        assert!(state("optimizer", r) < whole && state("optimizer", r) > full);
        assert_eq!(state("gradients", r), state("optimizer", r));
    }
    // The step of full sharding holds a stage or two, not the model: far below.
    let step = |mode: &str| {
        let set = format!("parallelism.shard={mode}");
        device_estimate_on(&one_b(&[&set]), 32000, 4).unwrap().step
    };
    assert!(step("parameters") < step("none") / 2.0);
}

/// A 7B-class Llama (d 4096, 32 layers, 32/8 heads, SwiGLU 11008, seq 2048) does not fit
/// one 80 GB GPU replicated; the refusal names the fewest ranks full sharding fits on,
/// and on 4 ranks with activation checkpointing it fits.
#[test]
fn a_7b_model_is_refused_on_one_gpu_naming_what_fits() {
    let seven = |extra: &[&str]| {
        let mut sets = vec![
            "model.d_model=4096",
            "model.n_layers=32",
            "model.n_heads=32",
            "model.n_kv_heads=8",
            "model.ffn_hidden=11008",
            "training.batch_size=1",
        ];
        sets.extend_from_slice(extra);
        let mut c = one_b(&sets);
        c.training.batch_size = 1;
        c
    };
    let limit = 80.0 * GIB;
    let replicated = seven(&[]);
    let est = device_estimate_on(&replicated, 32000, 1).unwrap();
    let err = device_verdict(&replicated, 32000, 1, est, limit, "test")
        .unwrap_err()
        .to_string();
    assert!(err.contains("of device memory per rank"), "{err}");
    assert!(err.contains("parallelism.shard = \"parameters\""), "{err}");
    assert!(err.contains("train it on"), "{err}");
    // On 2 ranks the least sharding that fits is named (no rank count).
    let est = device_estimate_on(&replicated, 32000, 2).unwrap();
    let err = device_verdict(&replicated, 32000, 2, est, limit, "test")
        .unwrap_err()
        .to_string();
    assert!(err.contains("on these 2 ranks"), "{err}");
    let full = seven(&[
        "parallelism.shard=parameters",
        "training.activation_checkpointing=blocks",
    ]);
    let est = device_estimate_on(&full, 32000, 4).unwrap();
    assert!(est.need() < limit, "{:.1} GiB", est.need() / GIB);
    assert!(device_verdict(&full, 32000, 4, est, limit, "test").is_ok());
}

#[test]
fn the_device_limit_comes_from_the_key() {
    let mut c = one_b(&[]);
    c.training.device_memory_gb = 80.0;
    let (bytes, source) = device_limit(&c).unwrap();
    assert!(source.starts_with("training.device_memory_gb"), "{source}");
    assert!(bytes <= 80.0 * GIB && bytes > 0.0);
    // Without the key and off CUDA nothing says (the check is skipped).
    c.training.device_memory_gb = 0.0;
    c.training.device = "rocm".into();
    assert!(device_limit(&c).is_none());
}

#[test]
fn hybrid_sharding_cuts_the_state_over_one_replica() {
    let sharded = config(&["parallelism.shard=parameters"]);
    let hybrid = config(&["parallelism.shard=parameters", "parallelism.dp_replicate=2"]);
    let need = |c: &Config, r: usize| estimate_on(c, 16, r).need();
    assert_eq!(need(&hybrid, 4), need(&sharded, 2));
    assert!(need(&hybrid, 4) > need(&sharded, 4));
    let four = config(&["parallelism.shard=parameters", "parallelism.dp_replicate=4"]);
    let limit = need(&hybrid, 4);
    assert!(need(&four, 4) > limit);
    let advice = sharding_advice(&four, 16, 4, limit).unwrap();
    assert!(
        advice.contains("parallelism.dp_replicate = 2 (the state cut over 2 ranks"),
        "{advice}"
    );
    assert_eq!(sharding_advice(&four, 16, 4, need(&sharded, 4) - 1.0), None);
}

/// Tensor parallelism cuts the state and most activations by tp; a run that does not
/// fit on its ranks is told the tp that would.
#[test]
fn tensor_parallelism_cuts_a_ranks_share_and_is_advised() {
    let one = config(&[]);
    let tp2 = config(&["parallelism.tp=2"]);
    let (a, b) = (estimate_on(&one, 16, 2), estimate_on(&tp2, 16, 2));
    assert!((b.resident - a.resident / 2.0).abs() < 1e-6 * a.resident);
    assert!(b.activations < a.activations && b.step < a.step);
    let need = |c: &Config, r: usize| estimate_on(c, 16, r).need();
    let limit = need(&tp2, 2);
    assert!(need(&one, 2) > limit);
    let advice = sharding_advice(&one, 16, 2, limit).unwrap();
    assert!(
        advice.contains("parallelism.tp = 2 (the matrices cut over 2 ranks"),
        "{advice}"
    );
}

#[test]
fn absurd_sizes_are_refused_naming_the_key() {
    for (set, key) in [
        ("model.d_model=1000000", "model.d_model"),
        ("model.n_layers=1000000000", "model.n_layers"),
        ("model.ffn_hidden=1000000000", "model.ffn_hidden"),
        ("model.vocab_size=1000000000", "model.vocab_size"),
        ("training.seq_len=1000000", "training.seq_len"),
        ("training.batch_size=1000000000", "training.batch_size"),
    ] {
        let c = config(&[set]);
        let err = check(&c, known_vocab(&c), 1).unwrap_err().to_string();
        assert!(err.contains(&format!("Lower {key}")), "{set}: {err}");
        assert!(err.contains("is available"), "{err}");
    }
    // The default run fits anywhere kiln's tests run.
    let c = config(&[]);
    assert!(check(&c, 16, 1).is_ok());
}

#[test]
fn memory_snapshots_count_when_they_use_ram_and_are_named_when_they_do_not_fit() {
    let c = config(&["checkpoint.snapshot_keep=2"]);
    let est = estimate(&c, 16, 1);
    let each = 12.0 * est.params;
    // On a disk they cost no RAM.
    let disk = Path::new(env!("CARGO_MANIFEST_DIR"));
    if !kiln_run::host::in_memory_fs(disk) {
        assert_eq!(snapshot_bytes(&c, est.params, disk), 0.0);
    }
    let shm = Path::new("/dev/shm");
    if !kiln_run::host::in_memory_fs(shm) {
        return; // no memory file system on this machine
    }
    let dir = tempfile::tempdir_in(shm).unwrap();
    let store = dir.path().join("rank-0");
    // Two kept, one being written, one at the guards' rollback point.
    assert_eq!(snapshot_bytes(&c, est.params, &store), 4.0 * each);
    let no_rollbacks = config(&["checkpoint.snapshot_keep=2", "guards.snapshot_interval=0"]);
    assert_eq!(
        snapshot_bytes(&no_rollbacks, est.params, &store),
        3.0 * each
    );
    // Snapshots already in the store are out of the available memory already.
    std::fs::create_dir_all(store.join("step-5")).unwrap();
    std::fs::write(store.join("step-5/model.safetensors"), vec![0u8; 1000]).unwrap();
    assert_eq!(snapshot_bytes(&c, est.params, &store), 4.0 * each - 1000.0);
    let off = config(&["checkpoint.snapshot_interval=0"]);
    assert_eq!(snapshot_bytes(&off, est.params, &store), 0.0);
    // The run fits without them but not with them: the error names the keys.
    let mut with = est.clone();
    with.snapshots = snapshot_bytes(&c, est.params, &store);
    assert_eq!(with.need(), est.need() + with.snapshots);
    let limit = |bytes: f64| {
        Some(MemoryLimit {
            bytes: bytes as u64,
            source: "a test".into(),
        })
    };
    let short = limit(with.need() - with.snapshots / 2.0);
    let err = verdict(&c, (16, 1), with.clone(), short, Some(&store))
        .unwrap_err()
        .to_string();
    for want in [
        "the memory snapshots do not fit: checkpoint.snapshot_keep = 2 keeps 2 copies",
        "lower checkpoint.snapshot_keep (now 2; 1 saves",
        "checkpoint.snapshot_dir",
        "checkpoint.snapshot_interval = 0",
        "(a test)",
    ] {
        assert!(err.contains(want), "{want:?} not in {err}");
    }
    assert!(
        verdict(
            &c,
            (16, 1),
            with.clone(),
            limit(with.need() + 1.0),
            Some(&store)
        )
        .is_ok()
    );
}

#[test]
fn thread_counts_are_bounded_and_never_panic() {
    let err = start_threads(100_000).unwrap_err().to_string();
    assert!(
        err.contains("training.threads = 100000: must be 0"),
        "{err}"
    );
    // 0 leaves the pool alone (a count > 0 would set this test binary's global pool).
    assert!(start_threads(0).is_ok());
}

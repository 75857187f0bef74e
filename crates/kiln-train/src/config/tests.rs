use super::*;

/// Issue 60: `--print-config` left out the keys the recorded config skips at their
/// defaults; it names every key a config sets when none is at its default.
#[test]
fn every_key_is_printed() {
    let keys = |text: &str| -> Vec<String> {
        let t: toml::Table = toml::from_str(text).unwrap();
        let mut out: Vec<String> = t
            .iter()
            .flat_map(|(s, v)| {
                let inner = v.as_table().cloned().unwrap_or_default();
                inner.keys().map(|k| format!("{s}.{k}")).collect::<Vec<_>>()
            })
            .collect();
        out.sort();
        out
    };
    let mut set = Config::default();
    set.model.init_from = "hf".into();
    set.training.activation_checkpointing = ActivationCheckpointing::Blocks;
    set.training.device_memory_gb = 80.0;
    set.metrics.tensorboard = true;
    let printed = Config::default().to_toml_every_key();
    assert_eq!(keys(&printed), keys(&set.to_toml()));
    assert!(printed.contains("tensorboard = false"), "{printed}");
    assert_eq!(
        Config::from_toml(&printed, "printed").unwrap(),
        Config::default()
    );
}

#[test]
fn defaults_are_valid_and_round_trip() {
    let c = Config::load(None, &[]).unwrap();
    let back = Config::from_toml(&c.to_toml(), "x").unwrap();
    assert_eq!(c, back);
}

#[test]
fn unknown_key_is_named() {
    let err = Config::from_toml("[training]\nstepz = 3\n", "f.toml")
        .unwrap_err()
        .to_string();
    assert!(err.contains("stepz") && err.contains("f.toml"), "{err}");
}

#[test]
fn collectives_are_chosen_by_name() {
    let c = Config::load(None, &["parallelism.collectives=device".into()]).unwrap();
    assert_eq!(c.parallelism.collectives, Collectives::Device);
    let err = Config::load(None, &["parallelism.collectives=nccl".into()])
        .unwrap_err()
        .to_string();
    assert!(err.contains("collectives") && err.contains("nccl"), "{err}");
}

#[test]
fn overrides_apply_and_are_checked() {
    let c = Config::load(
        None,
        &["training.steps=7".into(), "optimizer.lr=1e-4".into()],
    )
    .unwrap();
    assert_eq!(c.training.steps, 7);
    assert_eq!(c.optimizer.lr, 1e-4);
    assert!(matches!(
        Config::load(None, &["steps=7".into()]),
        Err(ConfigError::BadOverride(_))
    ));
    let err = Config::load(None, &["training.nope=1".into()])
        .unwrap_err()
        .to_string();
    assert!(err.contains("nope"), "{err}");
    let err = Config::load(None, &["model.n_kv_heads=3".into()])
        .unwrap_err()
        .to_string();
    assert!(err.contains("n_kv_heads"), "{err}");
}

#[test]
fn sharding_refuses_what_it_cannot_shard_naming_the_keys() {
    let refused = |extra: &str| {
        let sets = ["parallelism.shard=gradients".to_string(), extra.to_string()];
        Config::load(None, &sets).unwrap_err().to_string()
    };
    for kind in ["muon", "sophiag"] {
        let sets = [
            "parallelism.shard=parameters".into(),
            format!("optimizer.kind={kind}"),
        ];
        assert!(Config::load(None, &sets).is_ok(), "{kind} shards");
    }
    let err = refused("training.master_dtype=bf16");
    assert!(err.contains("training.master_dtype"), "{err}");
    let err = Config::load(None, &["parallelism.shard=params".into()])
        .unwrap_err()
        .to_string();
    assert!(err.contains("params"), "{err}");
    let err = Config::load(None, &["parallelism.dp_replicate=2".into()])
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("parallelism.dp_replicate") && err.contains("parallelism.shard"),
        "{err}"
    );
    let err = refused("parallelism.dp_replicate=0");
    assert!(err.contains("parallelism.dp_replicate"), "{err}");
    let sharded = Config::load(None, &["parallelism.shard=optimizer".into()]).unwrap();
    assert_eq!(sharded.effective_checkpoint().snapshot_interval, 0);
    assert_eq!(
        Config::default().effective_checkpoint(),
        Config::default().checkpoint
    );
}

fn domain_error(set: &str) -> String {
    match Config::load(None, &[set.to_string()]) {
        Err(ConfigError::OutOfDomain(v)) => v
            .iter()
            .map(|d| d.to_string())
            .collect::<Vec<_>>()
            .join("; "),
        other => panic!("{set}: {other:?}"),
    }
}

#[test]
fn every_numeric_key_is_checked_against_its_domain() {
    for (set, want) in [
        (
            "model.vocab_size=1",
            "model.vocab_size = 1: must be 0 (take it from the data)",
        ),
        (
            "model.d_model=0",
            "model.d_model = 0: must be an integer >= 1",
        ),
        (
            "model.rope_theta=nan",
            "model.rope_theta = NaN: must be a finite number > 1",
        ),
        ("model.rope_theta=1", "model.rope_theta = 1"),
        (
            "model.norm_eps=0",
            "model.norm_eps = 0: must be a finite number in (0, 1]",
        ),
        (
            "model.init_std=-0.1",
            "model.init_std = -0.1: must be a finite number in (0, 100]",
        ),
        (
            "optimizer.lr=-1",
            "optimizer.lr = -1: must be a finite number > 0",
        ),
        (
            "optimizer.beta1=nan",
            "optimizer.beta1 = NaN: must be a finite number in [0, 1)",
        ),
        ("optimizer.eps=0", "optimizer.eps = 0"),
        (
            "optimizer.weight_decay=-0.1",
            "optimizer.weight_decay = -0.1: must be a finite number >= 0",
        ),
        (
            "optimizer.max_grad_norm=inf",
            "optimizer.max_grad_norm = inf",
        ),
        (
            "lr_scheduler.min_lr_ratio=1.5",
            "lr_scheduler.min_lr_ratio = 1.5",
        ),
        (
            "lr_scheduler.decay_ratio=nan",
            "lr_scheduler.decay_ratio = NaN",
        ),
        (
            "training.steps=0",
            "training.steps = 0: must be an integer in [1, 1000000000000]",
        ),
        ("training.batch_size=0", "training.batch_size = 0"),
        ("training.seq_len=0", "training.seq_len = 0"),
        (
            "training.grad_accum_steps=0",
            "training.grad_accum_steps = 0",
        ),
        (
            "training.threads=100000",
            "training.threads = 100000: must be 0 (all cores)",
        ),
        (
            "training.compute_shards=0",
            "training.compute_shards = 0: must be an integer in [1, 256]",
        ),
        ("training.peak_flops=-1", "training.peak_flops = -1"),
        ("checkpoint.keep_latest_k=0", "checkpoint.keep_latest_k = 0"),
        ("metrics.log_interval=0", "metrics.log_interval = 0"),
        (
            "guards.initial_loss_tolerance=0",
            "guards.initial_loss_tolerance = 0",
        ),
        (
            "guards.max_nonfinite_in_row=0",
            "guards.max_nonfinite_in_row = 0",
        ),
        ("guards.spike_sigma=-1", "guards.spike_sigma = -1"),
        ("guards.spike_min_ratio=nan", "guards.spike_min_ratio = NaN"),
        (
            "guards.spike_window=10000000",
            "guards.spike_window = 10000000",
        ),
        (
            "debug.spike_scale=nan",
            "debug.spike_scale = NaN: must be a finite number",
        ),
        (
            "optimizer.weight_decay=1200",
            "optimizer.lr x optimizer.weight_decay = 1.2",
        ),
        (
            "training.batch_size=1000000000000000",
            "sequences is more than the",
        ),
    ] {
        let err = domain_error(set);
        assert!(err.contains(want), "{set}: {err}");
    }
    // Every offender is listed, in one error.
    let err = Config::load(
        None,
        &["optimizer.eps=nan".into(), "model.norm_eps=-1".into()],
    )
    .unwrap_err()
    .to_string();
    assert!(
        err.starts_with("config: model.norm_eps = -1") && err.contains("; optimizer.eps = NaN"),
        "{err}"
    );
    // Edges that are allowed.
    for ok in [
        "model.vocab_size=2",
        "optimizer.beta1=0",
        "optimizer.weight_decay=0",
        "lr_scheduler.min_lr_ratio=0",
        "lr_scheduler.min_lr_ratio=1",
        "training.threads=0",
        "eval.samples=0",
        "guards.spike_sigma=0",
    ] {
        assert!(Config::load(None, &[ok.into()]).is_ok(), "{ok}");
    }
}

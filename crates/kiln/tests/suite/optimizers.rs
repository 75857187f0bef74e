//! End-to-end tests of the optimizers and precisions with the real binary: Muon and SophiaG
//! resume bit-exactly after SIGKILL, their state is keyed by parameter name, a checkpoint of
//! one optimizer is not resumed by another; bf16 master weights freeze the RMSNorm weights
//! (the frozen-parameter guard names them) while bf16 compute on f32 masters does not, and
//! checkpoints keep their dtypes.

use std::path::Path;
use std::process::Child;

use crate::common;

use common::events;

const SHORT: &[&str] = &[
    "training.batch_size=4",
    "training.steps=24",
    "training.threads=1",
    "checkpoint.interval=4",
    "checkpoint.keep_latest_k=2",
    "eval.interval=0",
    "eval.samples=8",
    "lr_scheduler.warmup_steps=4",
    // Hessian estimates every 3 steps, so kills land between and after them.
    "optimizer.sophia.hessian_interval=3",
];

fn sets<'a>(extra: &[&'a str]) -> Vec<&'a str> {
    SHORT.iter().copied().chain(extra.iter().copied()).collect()
}

fn run_to_end(dir: &Path, extra: &[&str]) -> std::process::Output {
    let out = common::train_cmd(dir, &sets(extra))
        .output()
        .expect("spawn kiln");
    assert!(
        out.status.success(),
        "kiln train failed: {}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

/// Spawns a run and returns once it printed step `n` and the note of the checkpoint at or
/// before it (written in the background).
fn spawn_until_step(dir: &Path, extra: &[&str], n: u64) -> Child {
    common::spawn_until(common::train_cmd(dir, &sets(extra)), n, Some(n / 4 * 4))
}

/// Names and dtypes of the tensors of a safetensors file.
fn tensors(path: &Path) -> Vec<(String, String)> {
    let bytes = std::fs::read(path).unwrap();
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let header: serde_json::Value = serde_json::from_slice(&bytes[8..8 + n]).unwrap();
    let mut out: Vec<(String, String)> = header
        .as_object()
        .unwrap()
        .iter()
        .filter(|(k, _)| *k != "__metadata__")
        .map(|(k, v)| (k.clone(), v["dtype"].as_str().unwrap().to_string()))
        .collect();
    out.sort();
    out
}

fn sigkill_resume_is_bit_identical(kind: &str) {
    sigkill_resume_is_bit_identical_with(kind, &[]);
}

/// A run of optimizer `kind` with `extra` settings, SIGKILLed at steps 6 and 15 and resumed,
/// ends with the weights and optimizer state of an uninterrupted run.
fn sigkill_resume_is_bit_identical_with(kind: &str, extra: &[&str]) {
    let tmp = tempfile::tempdir().unwrap();
    let opt = format!("optimizer.kind={kind}");
    let sets: Vec<&str> = [opt.as_str()]
        .into_iter()
        .chain(extra.iter().copied())
        .collect();
    let reference = tmp.path().join("reference");
    run_to_end(&reference, &sets);
    let dir = tmp.path().join("killed");
    for at in [6, 15] {
        let mut child = spawn_until_step(&dir, &sets, at);
        // SAFETY: kill(2) on the child we spawned.
        assert_eq!(unsafe { libc::kill(child.id() as i32, libc::SIGKILL) }, 0);
        assert!(!child.wait().unwrap().success());
    }
    run_to_end(&dir, &sets);
    let resumes = events(&dir)
        .iter()
        .filter(|e| e["event"] == "resume")
        .count();
    assert_eq!(resumes, 2, "{:?}", events(&dir));
    for f in [
        "model.safetensors",
        "checkpoints/step-24/model.safetensors",
        "checkpoints/step-24/optimizer.safetensors",
    ] {
        assert!(
            std::fs::read(reference.join(f)).unwrap() == std::fs::read(dir.join(f)).unwrap(),
            "{kind}: {f} differs after SIGKILL + resume"
        );
    }
}

#[test]
fn muon_resumes_bit_exactly_after_sigkill() {
    sigkill_resume_is_bit_identical("muon");
}

#[test]
fn sophiag_resumes_bit_exactly_after_sigkill() {
    sigkill_resume_is_bit_identical("sophiag");
}

#[test]
fn mano_resumes_bit_exactly_after_sigkill() {
    sigkill_resume_is_bit_identical("mano");
}

/// SPAM with a reset every 6 updates (and spikes clipped from the 3rd after it), so that the
/// 24-step run resets three times and the kill lands between resets.
#[test]
fn spam_resumes_bit_exactly_after_sigkill_across_its_resets() {
    sigkill_resume_is_bit_identical_with(
        "spam",
        &[
            "optimizer.spam.reset_interval=6",
            "optimizer.spam.warmup_steps=2",
            "optimizer.spam.clip_after=3",
        ],
    );
}

/// Schedule-Free AdamW publishes x (checkpoints, the final weights) and trains at y, which
/// its state keeps and a resume puts back: SIGKILLed twice, it ends bit-identical to an
/// uninterrupted run (with its lr_max and weight sum from state.json). Its checkpoints' weights
/// are x: not the training point y in the optimizer file.
#[test]
fn schedule_free_adamw_resumes_bit_exactly_and_publishes_its_average() {
    let constant = ["lr_scheduler.kind=constant", "lr_scheduler.warmup_steps=4"];
    sigkill_resume_is_bit_identical_with("schedule_free_adamw", &constant);
    let tmp = tempfile::tempdir().unwrap();
    let sets: Vec<&str> = ["optimizer.kind=schedule_free_adamw", "training.steps=4"]
        .into_iter()
        .chain(constant)
        .collect();
    run_to_end(tmp.path(), &sets);
    let ck = tmp.path().join("checkpoints/step-4");
    let state: serde_json::Value =
        serde_json::from_slice(&std::fs::read(ck.join("state.json")).unwrap()).unwrap();
    let scalars = state["optimizer_scalars"].to_string();
    assert!(
        scalars.contains("lr_max") && scalars.contains("weight_sum"),
        "{state}"
    );
    let names: Vec<String> = tensors(&ck.join("optimizer.safetensors"))
        .into_iter()
        .map(|(n, _)| n)
        .collect();
    for slot in [".z", ".exp_avg_sq", ".y"] {
        assert!(names.iter().any(|n| n.ends_with(slot)), "{slot}: {names:?}");
    }
    let model = std::fs::read(ck.join("model.safetensors")).unwrap();
    assert!(
        model == std::fs::read(tmp.path().join("model.safetensors")).unwrap(),
        "the final weights are the checkpoint's x"
    );
}

/// Its rules: no decay schedule (it replaces one), and no sharding that keeps whole weights
/// beside a sharded state.
#[test]
fn schedule_free_adamw_refuses_a_decay_schedule_and_split_state() {
    for (set, key) in [
        ("lr_scheduler.kind=cosine", "lr_scheduler.kind"),
        ("parallelism.shard=gradients", "parallelism.shard"),
    ] {
        let dir = tempfile::tempdir().unwrap();
        let out = common::train_cmd(
            dir.path(),
            &sets(&[
                "optimizer.kind=schedule_free_adamw",
                "lr_scheduler.kind=constant",
                set,
            ]),
        )
        .output()
        .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(kiln_run::exit::CONFIG), "{err}");
        assert!(
            err.contains(key) && err.contains("schedule_free_adamw"),
            "{err}"
        );
    }
}

#[test]
fn optimizer_state_is_keyed_by_parameter_name_and_kind_is_checked_on_resume() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("muon");
    run_to_end(&dir, &["optimizer.kind=muon", "training.steps=4"]);
    let state = tensors(&dir.join("checkpoints/step-4/optimizer.safetensors"));
    let names: Vec<&str> = state.iter().map(|(n, _)| n.as_str()).collect();
    // Hidden matrices: a momentum buffer; embeddings, norms and the head: AdamW moments.
    for n in [
        "model.layers.0.self_attn.q_proj.weight.momentum_buffer",
        "model.layers.1.mlp.down_proj.weight.momentum_buffer",
        "model.embed_tokens.weight.exp_avg",
        "model.embed_tokens.weight.exp_avg_sq",
        "lm_head.weight.exp_avg",
        "model.norm.weight.exp_avg_sq",
        "model.layers.0.input_layernorm.weight.exp_avg",
    ] {
        assert!(names.contains(&n), "{n} missing from {names:?}");
    }
    assert!(!names.contains(&"model.layers.0.self_attn.q_proj.weight.exp_avg"));
    assert!(!names.contains(&"model.embed_tokens.weight.momentum_buffer"));
    assert!(state.iter().all(|(_, d)| d == "F32"), "{state:?}");

    let sophia = tmp.path().join("sophia");
    run_to_end(&sophia, &["optimizer.kind=sophiag", "training.steps=4"]);
    let names = tensors(&sophia.join("checkpoints/step-4/optimizer.safetensors"));
    assert!(
        names.iter().any(|(n, _)| n == "lm_head.weight.hessian"),
        "{names:?}"
    );

    // Resuming the Muon run as SophiaG is refused, naming both (exit 78).
    let out = common::train_cmd(&dir, &sets(&["optimizer.kind=sophiag", "training.steps=8"]))
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(78));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("muon") && err.contains("sophiag") && err.contains("optimizer.kind"),
        "{err}"
    );
}

/// The steps at which the frozen-parameter guard named parameters, and their names.
fn frozen_reports(dir: &Path) -> Vec<(u64, Vec<String>)> {
    events(dir)
        .iter()
        .filter(|e| e["event"] == "frozen_params")
        .map(|e| {
            let names = e["params"]
                .as_array()
                .unwrap()
                .iter()
                .map(|n| n.as_str().unwrap().to_string())
                .collect();
            (e["step"].as_u64().unwrap(), names)
        })
        .collect()
}

#[test]
fn bf16_master_weights_freeze_the_norms_and_the_guard_names_them() {
    let tmp = tempfile::tempdir().unwrap();
    // A typical LLM learning rate: AdamW moves each weight by about lr per step, under half
    // a bf16 step (2^-8) for weights near 1.0, the RMSNorm gains.
    let common_sets = [
        "optimizer.lr=1e-3",
        "training.steps=10",
        "guards.frozen_check_interval=5",
        "checkpoint.interval=0",
    ];
    let bad = tmp.path().join("bf16-master");
    let mut s: Vec<&str> = common_sets.to_vec();
    s.extend(["training.dtype=bf16", "training.master_dtype=bf16"]);
    run_to_end(&bad, &s);
    let reports = frozen_reports(&bad);
    assert_eq!(
        reports.len(),
        1,
        "one check after the first interval: {reports:?}"
    );
    let (step, names) = &reports[0];
    assert_eq!(*step, 10);
    let norms: Vec<&String> = names.iter().filter(|n| n.contains("norm")).collect();
    // Every RMSNorm of the tiny model (2 layers x 2 + the final one) and nothing else.
    assert_eq!(norms.len(), 5, "{names:?}");
    assert_eq!(names.len(), 5, "only the norms froze: {names:?}");
    // The weights stay bf16 on disk; the optimizer state f32.
    let model = tensors(&bad.join("checkpoints/step-10/model.safetensors"));
    assert!(model.iter().all(|(_, d)| d == "BF16"), "{model:?}");
    let opt = tensors(&bad.join("checkpoints/step-10/optimizer.safetensors"));
    assert!(opt.iter().all(|(_, d)| d == "F32"), "{opt:?}");

    // bf16 compute on f32 master weights (the seeds' fix): nothing freezes.
    let good = tmp.path().join("bf16-compute");
    let mut s: Vec<&str> = common_sets.to_vec();
    s.push("training.dtype=bf16");
    run_to_end(&good, &s);
    assert!(
        frozen_reports(&good).is_empty(),
        "{:?}",
        frozen_reports(&good)
    );
    let model = tensors(&good.join("checkpoints/step-10/model.safetensors"));
    assert!(model.iter().all(|(_, d)| d == "F32"), "{model:?}");
}

#[test]
fn bf16_compute_resumes_bit_exactly_after_sigkill() {
    let tmp = tempfile::tempdir().unwrap();
    let bf16 = "training.dtype=bf16";
    let reference = tmp.path().join("reference");
    run_to_end(&reference, &[bf16]);
    let dir = tmp.path().join("killed");
    let mut child = spawn_until_step(&dir, &[bf16], 10);
    // SAFETY: kill(2) on the child we spawned.
    assert_eq!(unsafe { libc::kill(child.id() as i32, libc::SIGKILL) }, 0);
    let _ = child.wait();
    run_to_end(&dir, &[bf16]);
    assert!(
        std::fs::read(reference.join("model.safetensors")).unwrap()
            == std::fs::read(dir.join("model.safetensors")).unwrap(),
        "bf16 compute: final weights differ after SIGKILL + resume"
    );
}

#[test]
fn checkpoint_events_report_the_stall_and_the_write_time() {
    let tmp = tempfile::tempdir().unwrap();
    for (name, mode) in [
        ("async", "checkpoint.async=true"),
        ("sync", "checkpoint.async=false"),
    ] {
        let dir = tmp.path().join(name);
        run_to_end(&dir, &[mode, "training.steps=8"]);
        let saved: Vec<serde_json::Value> = events(&dir)
            .into_iter()
            .filter(|e| e["event"] == "checkpoint_saved")
            .collect();
        let steps: Vec<u64> = saved.iter().map(|e| e["step"].as_u64().unwrap()).collect();
        assert_eq!(steps, [4, 8], "{saved:?}");
        for e in &saved {
            let stall = e["stall_s"].as_f64().unwrap();
            let write = e["write_s"].as_f64().unwrap();
            assert!(stall >= 0.0 && write > 0.0, "{e}");
            assert_eq!(e["async"], name == "async", "{e}");
            if name == "sync" {
                assert!(
                    stall >= write,
                    "a synchronous save stalls for its write: {e}"
                );
            }
        }
        // The run's last event is the exit, after the last save was reported.
        let ev = events(&dir);
        assert_eq!(ev.last().unwrap()["event"], "exit");
        assert!(dir.join("checkpoints/step-8/manifest.json").exists());
    }
}

//! End-to-end tests of the gates through the real binary: `kiln smoke` against the committed
//! baseline (and failing readably when numerics change), `kiln eval`, `kiln status`,
//! `kiln plot` and `kiln lr-find`.

use std::path::{Path, PathBuf};
use std::process::Command;

use crate::common;
use common::KILN;

/// The tiny model, so the tests stay fast on two cores.
fn tiny() -> Vec<&'static str> {
    let mut sets = common::TINY_MODEL.to_vec();
    sets.push("training.batch_size=4");
    sets
}

fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

fn kiln(args: &[&str], sets: &[&str]) -> (i32, String) {
    let mut cmd = Command::new(KILN);
    cmd.current_dir(repo_root()).args(args);
    for s in sets {
        cmd.args(["--set", s]);
    }
    let out = cmd.output().expect("run kiln");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status.code().unwrap_or(-1), text)
}

#[test]
fn smoke_passes_against_the_committed_default_baseline() {
    let (code, out) = kiln(&["smoke", "--baseline", "gates/smoke-default.json"], &[]);
    assert_eq!(code, 0, "{out}");
    assert!(out.contains("smoke: PASS: 20 steps bit-identical"), "{out}");
}

/// Issue 61: on an AMD EPYC with AVX2 the committed baseline (blessed with AVX-512) failed on
/// an unchanged tree, 1 ULP in a gradient norm: the SIMD level of the matrix products changes
/// their summation order. A baseline blessed on another kind of CPU is not compared (the
/// gate says which kind lacks one and exits 0), `--bless` then writes that kind's baseline
/// beside it (never over the other kind's), and the gate compares with it bit for bit.
#[test]
fn smoke_keeps_a_baseline_per_cpu_kind_and_says_which_kind_lacks_one() {
    let dir = tempfile::tempdir().unwrap();
    let base = dir.path().join("tiny.json");
    let b = base.to_str().unwrap();
    let (code, out) = kiln(
        &["smoke", "--steps", "3", "--bless", "--baseline", b],
        &tiny(),
    );
    assert_eq!(code, 0, "{out}");
    // As if blessed on another kind of CPU.
    let mut v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&base).unwrap()).unwrap();
    v["cpu"] = "x86_64 avx9000".into();
    std::fs::write(&base, serde_json::to_string(&v).unwrap()).unwrap();
    let other = std::fs::read(&base).unwrap();
    let (code, out) = kiln(&["smoke", "--baseline", b], &tiny());
    assert_eq!(code, 0, "{out}");
    let here = kiln_gates::smoke::cpu_description();
    let sibling = kiln_gates::smoke::kind_path(&base, &here);
    assert!(
        out.contains("NOT COMPARED") && out.contains("x86_64 avx9000"),
        "{out}"
    );
    assert!(
        out.contains(&here) && out.contains(&sibling.display().to_string()),
        "{out}"
    );
    let (code, out) = kiln(&["smoke", "--bless", "--baseline", b], &tiny());
    assert_eq!(code, 0, "{out}");
    assert!(
        out.contains(&format!("blessed {}", sibling.display())),
        "{out}"
    );
    assert_eq!(
        std::fs::read(&base).unwrap(),
        other,
        "the other kind's baseline is kept"
    );
    let (code, out) = kiln(&["smoke", "--baseline", b], &tiny());
    assert_eq!(code, 0, "{out}");
    assert!(out.contains("PASS: 3 steps bit-identical"), "{out}");
}

#[test]
fn smoke_fails_readably_when_numerics_change() {
    let dir = tempfile::tempdir().unwrap();
    let base = dir.path().join("tiny.json");
    let base = base.to_str().unwrap();
    let (code, out) = kiln(
        &["smoke", "--steps", "3", "--bless", "--baseline", base],
        &tiny(),
    );
    assert_eq!(code, 0, "{out}");
    assert!(out.contains("blessed"), "{out}");
    let (code, out) = kiln(&["smoke", "--baseline", base], &tiny());
    assert_eq!(code, 0, "{out}");
    assert!(out.contains("PASS: 3 steps"), "{out}");

    // A changed init seed: refused as a different config, naming the key...
    let seven: Vec<&str> = tiny().iter().copied().chain(["training.seed=7"]).collect();
    let (code, out) = kiln(&["smoke", "--baseline", base], &seven);
    assert_eq!(code, 1, "{out}");
    assert!(out.contains("config differs"), "{out}");
    assert!(
        out.contains("training.seed: baseline 1234, this run 7"),
        "{out}"
    );
    // ...and compared anyway, the first differing step with both values and the ULPs.
    let (code, out) = kiln(&["smoke", "--baseline", base, "--ignore-config"], &seven);
    assert_eq!(code, 1, "{out}");
    assert!(out.contains("smoke: FAIL: numerics differ"), "{out}");
    assert!(out.contains("first differing step: 1 (loss)"), "{out}");
    assert!(
        out.contains("baseline: ") && out.contains("this run: "),
        "{out}"
    );
    assert!(out.contains(" ULPs"), "{out}");

    // A one-ULP change of one recorded value (as a dependency upgrade might make) is caught.
    let text = std::fs::read_to_string(base).unwrap();
    let mut v: serde_json::Value = serde_json::from_str(&text).unwrap();
    let rec = &mut v["records"][1]["grad_norm_bits"];
    let bits = u32::from_str_radix(rec.as_str().unwrap().trim_start_matches("0x"), 16).unwrap();
    *rec = serde_json::Value::String(format!("{:#010x}", bits + 1));
    std::fs::write(base, serde_json::to_string(&v).unwrap()).unwrap();
    let (code, out) = kiln(&["smoke", "--baseline", base], &tiny());
    assert_eq!(code, 1, "{out}");
    assert!(out.contains("first differing step: 2 (grad_norm)"), "{out}");
    assert!(out.contains("difference: 1 ULPs"), "{out}");

    // A malformed baseline is invalid input (78), named.
    std::fs::write(base, "{ nope").unwrap();
    let (code, out) = kiln(&["smoke", "--baseline", base], &tiny());
    assert_eq!(code, kiln_run::exit::CONFIG, "{out}");
    assert!(
        out.contains("tiny.json") && out.contains("--bless"),
        "{out}"
    );
}

#[test]
fn eval_status_and_plot_on_a_tiny_run() {
    let dir = tempfile::tempdir().unwrap();
    let run = dir.path().join("run");
    let run_s = run.to_str().unwrap();
    let sets: Vec<&str> = tiny()
        .into_iter()
        .chain([
            "training.steps=6",
            "checkpoint.interval=3",
            "eval.interval=3",
            "eval.samples=8",
        ])
        .collect();
    let (code, out) = kiln(&["train", "--run-dir", run_s, "--no-progress-bar"], &sets);
    assert_eq!(code, 0, "{out}");

    // eval on the run dir (final weights) with the shipped task file
    let (code, out) = kiln(
        &["eval", run_s, "--tasks", "tasks/synthetic-copy-mc.jsonl"],
        &[],
    );
    assert_eq!(code, 0, "{out}");
    assert!(out.contains("held-out loss:"), "{out}");
    assert!(out.contains("200 tasks, acc "), "{out}");
    // Not a terminal: progress comes as a line at each tenth of the scored sequences.
    assert!(
        out.contains("eval: ") && out.contains(" sequences scored"),
        "{out}"
    );
    // on a checkpoint directory, as JSON
    let ck = run.join("checkpoints/step-3");
    let (code, out) = kiln(&["eval", ck.to_str().unwrap(), "--json"], &[]);
    assert_eq!(code, 0, "{out}");
    let v: serde_json::Value = serde_json::from_str(out.trim()).unwrap();
    assert_eq!(v["step"], 3);
    let acc = v["mc"]["acc"].as_f64().unwrap();
    assert!((0.0..=1.0).contains(&acc), "{v}");
    assert!(v["held_out_loss"].as_f64().unwrap() > 0.0, "{v}");
    // bad task files and paths are named
    let bad = dir.path().join("bad.jsonl");
    std::fs::write(
        &bad,
        "{\"context\": \"1=\", \"choices\": [\"1\", \"2\"], \"answer\": 0}\n{\"context\": \"x=\", \"choices\": [\"1\", \"2\"], \"answer\": 0}\n",
    )
    .unwrap();
    let (code, out) = kiln(&["eval", run_s, "--tasks", bad.to_str().unwrap()], &[]);
    assert_eq!(code, kiln_run::exit::CONFIG, "{out}");
    assert!(
        out.contains("bad.jsonl line 2") && out.contains("'x'"),
        "{out}"
    );
    let (code, out) = kiln(&["eval", dir.path().join("nope").to_str().unwrap()], &[]);
    assert_eq!(code, kiln_run::exit::CONFIG, "{out}");
    assert!(out.contains("nope"), "{out}");

    // status
    let (code, out) = kiln(&["status", run_s], &[]);
    assert_eq!(code, 0, "{out}");
    assert!(out.contains("steps: 6 of 6"), "{out}");
    assert!(out.contains("tokens: 768"), "{out}");
    assert!(out.contains("last eval: step 6"), "{out}");
    assert!(out.contains("checkpoints: step-3, step-6"), "{out}");
    assert!(out.contains("initial_loss_ok x1"), "{out}");
    assert!(
        out.contains("last exit: completed (code 0) at step 6"),
        "{out}"
    );
    let (code, out) = kiln(&["status", dir.path().join("nope").to_str().unwrap()], &[]);
    assert_eq!(code, kiln_run::exit::CONFIG, "{out}");
    assert!(out.contains("no such run directory"), "{out}");

    // plot
    let (code, out) = kiln(&["plot", run_s], &[]);
    assert_eq!(code, 0, "{out}");
    let svg = std::fs::read_to_string(run.join("plots/curves.svg")).unwrap();
    assert!(svg.contains("<svg") && svg.contains("<polyline"), "svg");
    let png = std::fs::read(run.join("plots/curves.png")).unwrap();
    assert_eq!(&png[1..4], b"PNG");
}

#[test]
fn lr_find_suggests_a_sensible_lr_and_writes_its_files() {
    let dir = tempfile::tempdir().unwrap();
    let out_dir = dir.path().join("lr");
    // the default config and the default sweep (1e-6 .. 1 over 100 steps): about 20 s
    let (code, out) = kiln(&["lr-find", "--out", out_dir.to_str().unwrap()], &[]);
    assert_eq!(code, 0, "{out}");
    let v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out_dir.join("lr-find.json")).unwrap())
            .unwrap();
    let lr = v["suggested_lr"].as_f64().unwrap();
    assert!((1e-4..=1e-1).contains(&lr), "suggested {lr}: {out}");
    // Not a terminal: progress comes as a line at every tenth of the sweep.
    assert!(out.contains("lr-find: 10/100 step=10 lr="), "{out}");
    let csv = std::fs::read_to_string(out_dir.join("lr-find.csv")).unwrap();
    assert!(
        csv.starts_with("step,lr,loss,smoothed_loss,grad_norm\n"),
        "{csv}"
    );
    assert!(csv.lines().count() > 10, "{csv}");
    assert!(
        std::fs::read_to_string(out_dir.join("lr-find.svg"))
            .unwrap()
            .contains("<svg")
    );
    assert_eq!(
        &std::fs::read(out_dir.join("lr-find.png")).unwrap()[1..4],
        b"PNG"
    );
}

#[test]
fn smoke_passes_against_the_committed_bf16_baseline() {
    let (code, out) = kiln(
        &["smoke", "--baseline", "gates/smoke-bf16.json"],
        &["training.dtype=bf16"],
    );
    assert_eq!(code, 0, "{out}");
    assert!(out.contains("smoke: PASS: 20 steps bit-identical"), "{out}");
}

#[test]
fn lr_find_sweeps_every_optimizer_kind() {
    for kind in ["muon", "sophiag", "spam", "mano", "schedule_free_adamw"] {
        let dir = tempfile::tempdir().unwrap();
        let out_dir = dir.path().join("lr");
        let mut sets = tiny();
        let k = format!("optimizer.kind={kind}");
        sets.push(&k);
        // 30 steps: SophiaG takes three Hessian estimates on the way.
        sets.push("optimizer.sophia.hessian_interval=10");
        // Schedule-Free refuses a decay schedule (lr-find sweeps the LR itself anyway).
        sets.push("lr_scheduler.kind=constant");
        let (code, out) = kiln(
            &[
                "lr-find",
                "--steps",
                "30",
                "--out",
                out_dir.to_str().unwrap(),
            ],
            &sets,
        );
        assert_eq!(code, 0, "{kind}: {out}");
        let v: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(out_dir.join("lr-find.json")).unwrap())
                .unwrap();
        let lr = v["suggested_lr"].as_f64().unwrap();
        assert!(lr > 0.0 && lr < 1.0, "{kind}: suggested {lr}: {out}");
        assert!(v["steps_run"].as_u64().unwrap() >= 10, "{kind}: {v}");
    }
}

/// `kiln lr-find --steps 1000000000` was accepted and ran silently for days: step counts with
/// no sense are refused at once (exit 2, naming the flag), for every gate that takes one.
#[test]
fn gate_step_counts_with_no_sense_are_refused_at_once() {
    let dir = tempfile::tempdir().unwrap();
    let out_dir = dir.path().join("lr");
    for args in [
        &[
            "lr-find",
            "--steps",
            "1000000000",
            "--out",
            out_dir.to_str().unwrap(),
        ][..],
        &[
            "lr-find",
            "--steps",
            "4",
            "--out",
            out_dir.to_str().unwrap(),
        ][..],
        &[
            "smoke",
            "--steps",
            "1000000000",
            "--bless",
            "--baseline",
            "/nonexistent/b.json",
        ][..],
    ] {
        let mut child = Command::new(KILN)
            .current_dir(repo_root())
            .args(args)
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        // A generous guard so that the old behaviour fails instead of hanging the suite.
        let until = std::time::Instant::now() + std::time::Duration::from_secs(120);
        let status = loop {
            if let Some(s) = child.try_wait().unwrap() {
                break s;
            }
            if std::time::Instant::now() > until {
                let _ = child.kill();
                let _ = child.wait();
                panic!("{args:?} was accepted and still running after 2 minutes");
            }
            std::thread::sleep(std::time::Duration::from_millis(50));
        };
        let mut err = String::new();
        std::io::Read::read_to_string(&mut child.stderr.take().unwrap(), &mut err).unwrap();
        assert_eq!(status.code(), Some(2), "{args:?}: {err}");
        assert!(err.contains("--steps"), "{args:?}: {err}");
        assert!(!out_dir.exists(), "{args:?} wrote outputs");
    }
}

/// A gate's error exits with the code `kiln_run::exit` gives it (through
/// `kiln_gates::GatesError`'s `ExitCoded`), not the generic 1: bad input is 78 and bad flag
/// values are 2, which `kiln launch` never retries.
#[test]
fn gate_errors_exit_with_their_mapped_codes() {
    let dir = tempfile::tempdir().unwrap();
    let empty = dir.path().join("empty");
    std::fs::create_dir(&empty).unwrap();
    let (code, out) = kiln(&["status", empty.to_str().unwrap()], &[]);
    assert_eq!(code, kiln_run::exit::CONFIG, "{out}");
    assert!(out.contains("not a run directory"), "{out}");

    let tasks = dir.path().join("tasks.jsonl");
    std::fs::write(&tasks, "{\"context\": \"a\"}\nnot json\n").unwrap();
    let (code, out) = kiln(
        &["eval", "nowhere", "--tasks", tasks.to_str().unwrap()],
        &[],
    );
    assert_eq!(code, kiln_run::exit::CONFIG, "{out}");
    assert!(out.contains("tasks.jsonl line 1"), "{out}");

    let (code, out) = kiln(&["smoke", "--mem-tolerance", "inf"], &[]);
    assert_eq!(code, kiln_run::exit::USAGE, "{out}");
    assert!(out.contains("--mem-tolerance inf"), "{out}");
}

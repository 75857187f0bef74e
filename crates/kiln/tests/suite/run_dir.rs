//! The run directory keeps what it promises, with the real binary: retention never deletes
//! what the run just saved, one trainer per directory, checkpoint manifests cannot reach
//! outside their directory, no write follows a planted symlink, torn log lines are repaired,
//! every way out writes an `exit` event, and runs that cannot make progress stop.

use std::path::Path;
use std::process::{Command, Output, Stdio};

use crate::common;

const QUICK: &[&str] = &[
    "training.batch_size=4",
    "training.threads=1",
    "eval.interval=0",
    "eval.samples=8",
    "checkpoint.interval=10",
    "checkpoint.keep_latest_k=3",
];

fn train(run_dir: &Path, extra: &[&str]) -> Output {
    cmd(run_dir, extra).output().expect("spawn kiln")
}

fn cmd(run_dir: &Path, extra: &[&str]) -> Command {
    let sets: Vec<&str> = QUICK.iter().chain(extra).copied().collect();
    common::train_cmd(run_dir, &sets)
}

fn text(out: &Output) -> String {
    format!(
        "{}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

fn events(run_dir: &Path) -> Vec<serde_json::Value> {
    std::fs::read_to_string(run_dir.join("events.jsonl"))
        .unwrap_or_default()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("bad line {l:?}: {e}")))
        .collect()
}

fn steps(run_dir: &Path) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(run_dir.join("checkpoints"))
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .filter(|n| n.starts_with("step-"))
        .collect();
    v.sort();
    v
}

fn flip_last_byte(f: &Path) {
    let mut bytes = std::fs::read(f).unwrap();
    let last = bytes.len() - 1;
    bytes[last] ^= 1;
    std::fs::write(f, bytes).unwrap();
}

#[test]
fn retention_never_deletes_what_a_fresh_run_just_saved() {
    let tmp = tempfile::tempdir().unwrap();
    let rd = tmp.path().join("run");
    assert!(train(&rd, &["training.steps=60"]).status.success());
    for s in steps(&rd) {
        flip_last_byte(&rd.join("checkpoints").join(s).join("model.safetensors"));
    }
    // Every checkpoint is corrupt, so the run restarts at 0; its own saves must survive.
    let out = train(&rd, &["training.steps=30"]);
    assert!(out.status.success(), "{}", text(&out));
    assert_eq!(steps(&rd), ["step-10", "step-20", "step-30"]);
    // The events of the second run only.
    let all = events(&rd);
    let second = all.iter().rposition(|e| e["event"] == "start").unwrap();
    let ev = &all[second..];
    for e in ev.iter().filter(|e| e["event"] == "checkpoint_saved") {
        assert_eq!(e["pruned"], serde_json::json!([]), "{e}");
    }
    // Rejections are reported before the start event of the run that made them.
    let moved: Vec<_> = all
        .iter()
        .filter(|e| e["event"] == "checkpoint_rejected")
        .collect();
    assert_eq!(moved.len(), 3, "{moved:?}");
    for m in &moved {
        let to = Path::new(m["moved_to"].as_str().unwrap());
        assert!(
            to.join("model.safetensors").exists(),
            "moved aside, not deleted: {m}"
        );
        assert!(to.join("REJECTED.txt").exists());
    }

    // checkpoint.resume=false in a used directory: the old run's checkpoints are another
    // lineage, moved aside; the new run keeps its own.
    let out = train(&rd, &["training.steps=20", "checkpoint.resume=false"]);
    assert!(out.status.success(), "{}", text(&out));
    assert_eq!(steps(&rd), ["step-10", "step-20"]);
    // A crash now resumes from this run's newest checkpoint.
    let out = train(&rd, &["training.steps=20"]);
    assert!(text(&out).contains("resumed from"), "{}", text(&out));
}

#[test]
fn a_second_trainer_on_the_same_directory_is_refused_naming_the_holder() {
    let tmp = tempfile::tempdir().unwrap();
    let rd = tmp.path().join("run");
    // The memory tier off: the first trainer is SIGKILLed and would leave its snapshots.
    let sets = [
        "training.steps=100000",
        "checkpoint.interval=0",
        "checkpoint.snapshot_interval=0",
    ];
    let mut first = cmd(&rd, &sets)
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    // Wait for the first to hold the lock (it writes its start event after locking).
    let t0 = std::time::Instant::now();
    while !events(&rd).iter().any(|e| e["event"] == "start") {
        assert!(t0.elapsed().as_secs() < 60, "first trainer never started");
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    let out = train(&rd, &["training.steps=5", "model.n_layers=1"]);
    let _ = first.kill();
    let _ = first.wait();
    assert_eq!(out.status.code(), Some(73), "{}", text(&out));
    let msg = text(&out);
    assert!(
        msg.contains(&format!("pid {}", first.id())) && msg.contains("in use"),
        "{msg}"
    );
    // The refused trainer wrote nothing: one start event, the first trainer's config.
    let starts = events(&rd).iter().filter(|e| e["event"] == "start").count();
    assert_eq!(starts, 1);
    let config = std::fs::read_to_string(rd.join("config.toml")).unwrap();
    assert!(config.contains("n_layers = 2"), "{config}");
}

#[test]
fn checkpoint_manifests_cannot_name_files_outside_or_special_files() {
    let tmp = tempfile::tempdir().unwrap();
    let rd = tmp.path().join("run");
    assert!(train(&rd, &["training.steps=20"]).status.success());
    let manifest = rd.join("checkpoints/step-20/manifest.json");
    let good = std::fs::read_to_string(&manifest).unwrap();
    for evil in ["../../../../../../etc/hostname", "/dev/zero"] {
        std::fs::write(
            &manifest,
            good.replace("\"state.json\"", &format!("{evil:?}")),
        )
        .unwrap();
        // eval reads the checkpoint directly: a clear refusal, nothing read.
        let out = Command::new(common::KILN)
            .args(["eval"])
            .arg(rd.join("checkpoints/step-20"))
            .output()
            .unwrap();
        assert_ne!(out.status.code(), Some(0));
        assert!(
            text(&out).contains("not a file of a kiln checkpoint"),
            "{evil}: {}",
            text(&out)
        );
    }
    // Training moves the bad checkpoint aside and resumes from the one before it.
    let out = train(&rd, &["training.steps=20"]);
    assert!(out.status.success(), "{}", text(&out));
    assert!(text(&out).contains("resumed from"), "{}", text(&out));
    assert!(rd.join("checkpoints/rejected/step-20").is_dir());
}

#[test]
fn writes_never_follow_symlinks_planted_in_the_run_directory() {
    let tmp = tempfile::tempdir().unwrap();
    let rd = tmp.path().join("run");
    std::fs::create_dir_all(&rd).unwrap();
    let victim = tmp.path().join("victim");
    std::fs::write(&victim, "precious\n").unwrap();
    std::os::unix::fs::symlink(&victim, rd.join("config.toml")).unwrap();
    std::os::unix::fs::symlink(&victim, rd.join("model.safetensors")).unwrap();
    let out = train(&rd, &["training.steps=10"]);
    assert!(out.status.success(), "{}", text(&out));
    assert_eq!(std::fs::read_to_string(&victim).unwrap(), "precious\n");
    assert!(!rd.join("config.toml").is_symlink());

    // An append-only log that is a link is refused with a clear error, not written through.
    let rd2 = tmp.path().join("run2");
    std::fs::create_dir_all(&rd2).unwrap();
    std::os::unix::fs::symlink(&victim, rd2.join("metrics.jsonl")).unwrap();
    let out = train(&rd2, &["training.steps=10"]);
    assert_ne!(out.status.code(), Some(0));
    assert!(text(&out).contains("symbolic link"), "{}", text(&out));
    assert_eq!(std::fs::read_to_string(&victim).unwrap(), "precious\n");
}

#[test]
fn torn_log_lines_are_repaired_on_resume_and_reported() {
    let tmp = tempfile::tempdir().unwrap();
    let rd = tmp.path().join("run");
    assert!(train(&rd, &["training.steps=10"]).status.success());
    for f in ["metrics.jsonl", "events.jsonl"] {
        let mut file = std::fs::OpenOptions::new()
            .append(true)
            .open(rd.join(f))
            .unwrap();
        std::io::Write::write_all(&mut file, b"{\"step\": 11, \"lo").unwrap();
    }
    let out = train(&rd, &["training.steps=20"]);
    assert!(out.status.success(), "{}", text(&out));
    // Every line of both files parses again (events() panics on a glued line).
    let ev = events(&rd);
    let repaired: Vec<_> = ev.iter().filter(|e| e["event"] == "log_repaired").collect();
    assert_eq!(repaired.len(), 2, "{repaired:?}");
    for line in std::fs::read_to_string(rd.join("metrics.jsonl"))
        .unwrap()
        .lines()
    {
        serde_json::from_str::<serde_json::Value>(line).unwrap_or_else(|e| panic!("{line}: {e}"));
    }
}

#[test]
fn every_way_out_writes_an_exit_event_and_runs_that_cannot_progress_stop() {
    let tmp = tempfile::tempdir().unwrap();
    // A guard stop (first-step loss check): exit 65, with an exit event naming the error.
    let rd = tmp.path().join("guard");
    let out = train(
        &rd,
        &[
            "training.steps=10",
            "guards.initial_loss_tolerance=0.0001",
            "model.init_std=0.5",
        ],
    );
    assert_eq!(out.status.code(), Some(65), "{}", text(&out));
    let last = events(&rd).pop().unwrap();
    assert_eq!(last["event"], "exit", "{last}");
    assert_eq!(last["code"], 65);
    assert!(last["error"].as_str().unwrap().contains("first-step loss"));

    // Every step non-finite (a learning rate that blows the model up at once, no clipping):
    // skips, rollbacks, then a stop naming the likely cause, not an endless loop.
    let rd = tmp.path().join("diverge");
    let t0 = std::time::Instant::now();
    let out = train(
        &rd,
        &[
            "training.steps=200",
            "optimizer.lr=1e30",
            "optimizer.weight_decay=0",
            "optimizer.max_grad_norm=0",
            "lr_scheduler.warmup_steps=0",
            "guards.snapshot_interval=5",
        ],
    );
    assert!(t0.elapsed().as_secs() < 60, "took {:?}", t0.elapsed());
    assert_eq!(out.status.code(), Some(65), "{}", text(&out));
    assert!(text(&out).contains("rollbacks in a row"), "{}", text(&out));
    let ev = events(&rd);
    assert!(ev.iter().any(|e| e["event"] == "rollback_limit"));
    assert_eq!(ev.last().unwrap()["event"], "exit");

    // A run directory whose name is not UTF-8 works (and is named lossily in events).
    use std::os::unix::ffi::OsStrExt;
    let odd = tmp.path().join(std::ffi::OsStr::from_bytes(b"bad\xffname"));
    let out = train(&odd, &["training.steps=10"]);
    assert!(out.status.success(), "{}", text(&out));
    let out = train(&odd, &["training.steps=20"]);
    assert!(out.status.success(), "{}", text(&out));
}

#[test]
fn a_closed_stdout_does_not_stop_training() {
    use std::io::{BufRead, BufReader};
    let tmp = tempfile::tempdir().unwrap();
    let rd = tmp.path().join("run");
    let mut child = cmd(&rd, &["training.steps=40"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // Read one line, then go away, as `kiln train | head -1` does.
    let mut first = String::new();
    BufReader::new(child.stdout.take().unwrap())
        .read_line(&mut first)
        .unwrap();
    let out = child.wait_with_output().unwrap();
    assert_eq!(out.status.code(), Some(0), "{}", text(&out));
    assert!(rd.join("model.safetensors").exists());
}

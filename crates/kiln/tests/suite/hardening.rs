//! Bad input through the real binary (issue 9): every case ends quickly with a clear error
//! naming what to change and a non-zero exit that is neither a panic (101) nor an abort
//! (134), or with the right answer. Each test is one class of the audit.
use crate::common;

use common::{KILN, train_cmd};
use kiln_data::{DType, IndexedDatasetBuilder};
use std::io::Read;
use std::os::unix::ffi::OsStrExt;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// What a run printed and how it ended.
struct Run {
    code: i32,
    stdout: String,
    stderr: String,
    seconds: f64,
}

/// Runs `cmd` with a deadline: a hang (the failure mode of several of these inputs) fails
/// the test instead of stalling the suite. The child is killed by its own handle.
fn run(mut cmd: Command, limit_s: u64) -> Run {
    let t0 = Instant::now();
    let mut child = cmd
        .env("KILN_NO_PROGRESS", "1")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start kiln");
    // Drain the pipes on threads so a chatty child never blocks on a full pipe.
    let mut out = child.stdout.take().expect("stdout");
    let mut err = child.stderr.take().expect("stderr");
    let out_t = std::thread::spawn(move || {
        let mut s = Vec::new();
        let _ = out.read_to_end(&mut s);
        s
    });
    let err_t = std::thread::spawn(move || {
        let mut s = Vec::new();
        let _ = err.read_to_end(&mut s);
        s
    });
    let status = loop {
        if let Some(s) = child.try_wait().expect("wait") {
            break s;
        }
        if t0.elapsed() > Duration::from_secs(limit_s) {
            let _ = child.kill();
            let _ = child.wait();
            panic!("{cmd:?} still running after {limit_s}s (hang)");
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let stdout = String::from_utf8_lossy(&out_t.join().unwrap_or_default()).into_owned();
    let stderr = String::from_utf8_lossy(&err_t.join().unwrap_or_default()).into_owned();
    Run {
        code: status.code().unwrap_or(-1),
        stdout,
        stderr,
        seconds: t0.elapsed().as_secs_f64(),
    }
}

fn kiln(args: &[&str], dir: &Path) -> Command {
    let mut c = Command::new(KILN);
    c.args(args).current_dir(dir);
    c
}

/// Exit code of `kiln train` for invalid input (never retried by `kiln launch`).
const INVALID: i32 = kiln_run::exit::CONFIG;

/// A clean refusal: exit 1, no panic or abort, and the message says each of `needles`.
/// (Data verbs refuse bad input with [`INVALID`], as `kiln train` does: issue 46.)
fn refused(r: &Run, what: &str, needles: &[&str]) {
    refused_with(r, 1, what, needles)
}

/// A clean refusal with exit `code`.
fn refused_with(r: &Run, code: i32, what: &str, needles: &[&str]) {
    assert_eq!(r.code, code, "{what}: exit {}\n{}", r.code, r.stderr);
    assert!(!r.stderr.contains("panicked"), "{what}: {}", r.stderr);
    for n in needles {
        assert!(r.stderr.contains(n), "{what}: no {n:?} in:\n{}", r.stderr);
    }
}

/// A Megatron dataset at `prefix` with `docs` documents of ids `0..max_id` (ids cycle),
/// and no `kiln tokenize` sidecar, as Megatron-LM's preprocess_data.py writes it.
fn megatron_dataset(prefix: &Path, docs: usize, max_id: u32) {
    let mut b = IndexedDatasetBuilder::create(prefix, DType::U16).unwrap();
    for d in 0..docs {
        let doc: Vec<u32> = (0..50u32)
            .map(|k| (d as u32 * 7 + k * 13) % (max_id + 1))
            .collect();
        b.add_document(&doc).unwrap();
    }
    // One token with the largest id, so the maximum is exactly max_id.
    b.add_document(&[max_id, 1, 2]).unwrap();
    b.finish().unwrap();
}

#[test]
fn config_domains_are_checked_before_anything_runs() {
    let dir = tempfile::tempdir().unwrap();
    for (set, needle) in [
        (
            "optimizer.eps=nan",
            "optimizer.eps = NaN: must be a finite number in (0, 1]",
        ),
        ("optimizer.eps=-1", "optimizer.eps = -1"),
        ("optimizer.weight_decay=nan", "optimizer.weight_decay = NaN"),
        ("model.norm_eps=-1", "model.norm_eps = -1"),
        (
            "model.rope_theta=0",
            "model.rope_theta = 0: must be a finite number > 1",
        ),
        ("model.init_std=nan", "model.init_std = NaN"),
        (
            "lr_scheduler.min_lr_ratio=-5",
            "lr_scheduler.min_lr_ratio = -5: must be a finite number in [0, 1]",
        ),
        (
            "optimizer.beta2=1",
            "optimizer.beta2 = 1: must be a finite number in [0, 1)",
        ),
        ("optimizer.lr=0", "optimizer.lr = 0"),
        ("optimizer.lr=inf", "optimizer.lr = inf"),
        ("optimizer.max_grad_norm=-1", "optimizer.max_grad_norm = -1"),
        (
            "metrics.log_interval=0",
            "metrics.log_interval = 0: must be an integer >= 1",
        ),
        ("guards.spike_sigma=nan", "guards.spike_sigma = NaN"),
        (
            "training.threads=100000",
            "training.threads = 100000: must be 0 (all cores) or an integer in [1,",
        ),
        (
            "optimizer.weight_decay=1000",
            "optimizer.lr x optimizer.weight_decay",
        ),
    ] {
        let run_dir = dir.path().join(set.replace(['=', '.'], "_"));
        let mut cmd = train_cmd(&run_dir, &[set, "training.steps=3"]);
        cmd.current_dir(dir.path());
        let r = run(cmd, 60);
        refused_with(&r, INVALID, set, &["config: ", needle]);
        assert!(r.seconds < 20.0, "{set}: took {:.1}s", r.seconds);
        assert!(!run_dir.join("checkpoints").exists(), "{set}: it trained");
    }
    // Several bad keys are named in one error.
    let mut cmd = train_cmd(
        &dir.path().join("two"),
        &["optimizer.eps=nan", "model.norm_eps=-1"],
    );
    cmd.current_dir(dir.path());
    let r = run(cmd, 60);
    refused_with(
        &r,
        INVALID,
        "two keys",
        &["optimizer.eps = NaN", "model.norm_eps = -1"],
    );

    // eval.samples = 0 means no held-out eval (it wrote eval_loss 0.0); training.threads
    // within the bound works.
    let run_dir = dir.path().join("no-eval");
    let r = run(
        train_cmd(
            &run_dir,
            &["eval.samples=0", "training.steps=2", "training.threads=1"],
        ),
        120,
    );
    assert_eq!(r.code, 0, "{}", r.stderr);
    let metrics = std::fs::read_to_string(run_dir.join("metrics.jsonl")).unwrap();
    assert!(metrics.contains("\"loss\""), "{metrics}");
    assert!(
        !metrics.contains("eval_loss"),
        "eval with 0 samples: {metrics}"
    );
}

#[test]
fn sizes_that_cannot_fit_are_refused_with_the_estimate_and_the_key() {
    let dir = tempfile::tempdir().unwrap();
    for (set, key) in [
        ("model.d_model=1000000", "model.d_model"),
        ("model.vocab_size=1000000000", "model.vocab_size"),
        ("model.n_layers=1000000000", "model.n_layers"),
        ("model.ffn_hidden=1000000000", "model.ffn_hidden"),
        ("training.seq_len=1000000", "training.seq_len"),
        ("training.batch_size=1000000000", "training.batch_size"),
    ] {
        let mut cmd = train_cmd(&dir.path().join("run"), &[set]);
        cmd.current_dir(dir.path());
        let r = run(cmd, 60);
        refused_with(
            &r,
            INVALID,
            set,
            &[
                "needs about",
                "is available (",
                &format!("Lower {key} (now "),
            ],
        );
        assert!(r.seconds < 10.0, "{set}: took {:.1}s", r.seconds);
    }
    // The limit an operator sets is honoured and named.
    let mut cmd = train_cmd(&dir.path().join("run"), &["training.steps=2"]);
    cmd.current_dir(dir.path()).env("KILN_MEMORY_LIMIT", "64M");
    let r = run(cmd, 60);
    refused_with(
        &r,
        INVALID,
        "KILN_MEMORY_LIMIT",
        &["$KILN_MEMORY_LIMIT=64M"],
    );

    // The data layer estimates its index sizes before building them.
    megatron_dataset(&dir.path().join("d"), 20, 100);
    std::fs::write(dir.path().join("list.txt"), "1 d\n").unwrap();
    let r = run(
        kiln(
            &[
                "data",
                "blend",
                "list.txt",
                "--seq-len",
                "16",
                "--samples",
                "100000000000000",
                "--verify",
                "off",
            ],
            dir.path(),
        ),
        60,
    );
    refused_with(
        &r,
        INVALID,
        "data blend --samples 1e14",
        &["needs about", "lower the number of samples"],
    );
    assert!(r.seconds < 10.0, "took {:.1}s", r.seconds);
}

/// Memory snapshots on a memory file system use RAM: a run that fits without them but not with
/// them is refused naming `checkpoint.snapshot_keep`; the same run with its snapshots on a
/// disk trains under the same limit.
#[test]
fn memory_snapshots_on_tmpfs_count_in_the_memory_budget() {
    let shm = Path::new("/dev/shm");
    if !kiln_run::host::in_memory_fs(shm) {
        eprintln!("no tmpfs at /dev/shm: nothing to check");
        return;
    }
    let store = tempfile::tempdir_in(shm).unwrap();
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let sets = |snapshots: &Path| {
        vec![
            "training.steps=2".to_string(),
            "training.threads=1".to_string(),
            format!("checkpoint.snapshot_dir={}", snapshots.display()),
        ]
    };
    let all: Vec<String> = common::TINY_MODEL
        .iter()
        .map(|s| s.to_string())
        .chain(sets(store.path()))
        .collect();
    let cfg = kiln_train::config::Config::load(None, &all).unwrap();
    let est = kiln_train::budget::estimate(&cfg, kiln_train::budget::known_vocab(&cfg), 1);
    let snapshots = 12.0 * est.params * (cfg.checkpoint.snapshot_keep + 1) as f64;
    let limit = ((est.need() + snapshots / 2.0) as u64).to_string();
    let train = |name: &str, snapshots: &Path| {
        let sets = sets(snapshots);
        let sets: Vec<&str> = sets.iter().map(String::as_str).collect();
        let mut cmd = train_cmd(&dir.path().join(name), &sets);
        cmd.env("KILN_MEMORY_LIMIT", &limit);
        run(cmd, 120)
    };
    let r = train("on-tmpfs", store.path());
    refused_with(
        &r,
        INVALID,
        "snapshots on tmpfs",
        &[
            "the memory snapshots do not fit: checkpoint.snapshot_keep = 2",
            "checkpoint.snapshot_dir",
            "checkpoint.snapshot_interval = 0",
        ],
    );
    let disk = dir.path().join("snapshots");
    if !kiln_run::host::in_memory_fs(&disk) {
        let r = train("on-disk", &disk);
        assert_eq!(r.code, 0, "{}", r.stderr);
    }
}

/// `sh -c SCRIPT` in a user and mount namespace of its own (`unshare -rm`), where it may
/// mount; `None` when this machine allows no such namespace.
fn in_own_mounts(script: &str) -> Option<Command> {
    let ok = Command::new("unshare")
        .args(["-rm", "true"])
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    ok.then(|| {
        let mut c = Command::new("unshare");
        c.args(["-rm", "sh", "-c", script]);
        c
    })
}

/// Issue 46: `checkpoint.snapshot_dir` pointing at a regular file ran to exit 0 with a
/// warning at every snapshot (20 in 60 steps), the key never named. It is refused at the
/// start, exit 78, naming the key; with the tier off (`snapshot_interval = 0`) the same
/// value is not used and the run goes on.
#[test]
fn a_snapshot_dir_that_is_a_regular_file_is_refused_at_start() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("snapshots");
    std::fs::write(&file, "not a directory").unwrap();
    let set = format!("checkpoint.snapshot_dir={}", file.display());
    let sets = ["training.steps=60", "training.threads=1", set.as_str()];
    let r = run(train_cmd(&dir.path().join("run"), &sets), 120);
    refused_with(
        &r,
        INVALID,
        "snapshot_dir a regular file",
        &[
            "checkpoint.snapshot_dir",
            "is not a directory",
            "checkpoint.snapshot_interval = 0",
        ],
    );
    assert!(!r.stderr.contains("memory snapshot failed"), "{}", r.stderr);
    assert!(
        !dir.path().join("run/metrics.jsonl").exists()
            || std::fs::read_to_string(dir.path().join("run/metrics.jsonl"))
                .unwrap()
                .is_empty(),
        "it trained"
    );
    let off = [
        "training.steps=2",
        "checkpoint.snapshot_interval=0",
        set.as_str(),
    ];
    let r = run(train_cmd(&dir.path().join("off"), &off), 120);
    assert_eq!(r.code, 0, "{}", r.stderr);
}

/// Held out: a snapshot directory below a regular file, and a read-only directory (a
/// read-only bind mount, which binds root too) on a run of other sizes.
#[test]
fn a_snapshot_dir_below_a_file_or_read_only_is_refused_at_start() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("notes.txt"), "x").unwrap();
    let below = dir.path().join("notes.txt/shm");
    let set = format!("checkpoint.snapshot_dir={}", below.display());
    let sets = [
        "training.steps=9",
        "checkpoint.snapshot_interval=3",
        set.as_str(),
    ];
    let r = run(train_cmd(&dir.path().join("run"), &sets), 120);
    refused_with(
        &r,
        INVALID,
        "snapshot_dir below a file",
        &["checkpoint.snapshot_dir", "notes.txt"],
    );
    let ro = dir.path().join("ro");
    std::fs::create_dir(&ro).unwrap();
    let cmd = train_cmd(
        &dir.path().join("run2"),
        &[
            "training.steps=12",
            "checkpoint.snapshot_interval=4",
            &format!("checkpoint.snapshot_dir={}", ro.display()),
        ],
    );
    let argv: Vec<String> = std::iter::once(cmd.get_program())
        .chain(cmd.get_args())
        .map(|a| format!("'{}'", a.to_string_lossy()))
        .collect();
    let script = format!(
        "mount --bind '{d}' '{d}' && mount -o remount,bind,ro '{d}' && exec {}",
        argv.join(" "),
        d = ro.display()
    );
    let Some(ns) = in_own_mounts(&script) else {
        eprintln!("no user namespace to mount a read-only directory in: read-only case not run");
        return;
    };
    let r = run(ns, 120);
    refused_with(
        &r,
        INVALID,
        "read-only snapshot_dir",
        &["checkpoint.snapshot_dir", "Read-only file system"],
    );
}

#[test]
fn a_megatron_corpus_without_a_vocab_record_needs_a_vocab_that_fits() {
    let dir = tempfile::tempdir().unwrap();
    megatron_dataset(&dir.path().join("mega"), 200, 999);
    std::fs::write(dir.path().join("list.txt"), "1.0 mega\n").unwrap();
    let train = |name: &str, sets: &[&str]| {
        let mut all = vec![
            "data.corpus_list=list.txt",
            "training.steps=2",
            "eval.samples=0",
        ];
        all.extend_from_slice(sets);
        let mut cmd = train_cmd(&dir.path().join(name), &all);
        cmd.current_dir(dir.path());
        run(cmd, 120)
    };
    let r = train("zero", &[]);
    refused_with(
        &r,
        INVALID,
        "vocab 0",
        &["no dataset records its vocabulary", "set model.vocab_size"],
    );
    let r = train("small", &["model.vocab_size=500"]);
    refused_with(
        &r,
        INVALID,
        "vocab 500",
        &[
            "model.vocab_size = 500 is too small",
            "list.txt:1",
            "holds token id 999",
            "at least 1000",
        ],
    );
    let r = train("fits", &["model.vocab_size=1000"]);
    assert_eq!(r.code, 0, "{}", r.stderr);

    // A record that understates the vocabulary is caught at the first sample with a larger
    // id, as an error rather than an out-of-range embedding lookup.
    std::fs::write(
        dir.path().join("mega.kiln.json"),
        r#"{"vocab_size": 100, "eos_id": null, "tokenizer_sha256": "", "documents": 201, "tokens": 10003, "dtype": "u16"}"#,
    )
    .unwrap();
    // Damage found during training is a data error (78), not a retryable failure.
    let r = train("lying", &[]);
    refused_with(
        &r,
        INVALID,
        "lying sidecar",
        &["outside the model's vocabulary of 100"],
    );
}

#[test]
fn train_and_data_share_the_cache_named_by_kiln_data_cache() {
    let dir = tempfile::tempdir().unwrap();
    megatron_dataset(&dir.path().join("d"), 200, 300);
    std::fs::write(dir.path().join("list.txt"), "1.0 d\n").unwrap();
    let cache = dir.path().join("shared-cache");
    let mut blend = kiln(
        &[
            "data",
            "blend",
            "list.txt",
            "--seq-len",
            "32",
            "--samples",
            "64",
        ],
        dir.path(),
    );
    blend.env("KILN_DATA_CACHE", &cache);
    let r = run(blend, 60);
    assert_eq!(r.code, 0, "{}", r.stderr);
    let built: Vec<_> = std::fs::read_dir(&cache).unwrap().collect();
    assert!(!built.is_empty());
    let mut cmd = train_cmd(
        &dir.path().join("run"),
        &[
            "data.corpus_list=list.txt",
            "model.vocab_size=301",
            "training.steps=2",
            "eval.samples=0",
        ],
    );
    cmd.current_dir(dir.path()).env("KILN_DATA_CACHE", &cache);
    let r = run(cmd, 120);
    assert_eq!(r.code, 0, "{}", r.stderr);
    assert!(
        !dir.path().join(".kiln-cache").exists(),
        "kiln train ignored $KILN_DATA_CACHE and cached beside the list"
    );
    // The dataset's sample index (which does not depend on the run's length) was found,
    // not built again: still one prefix file.
    let prefix_files = std::fs::read_dir(&cache)
        .unwrap()
        .filter_map(|e| e.ok())
        .filter(|e| e.file_name().to_string_lossy().ends_with(".prefix"))
        .count();
    assert_eq!(prefix_files, 1);
}

fn mkfifo(path: &Path) {
    let c = std::ffi::CString::new(path.as_os_str().as_bytes()).unwrap();
    assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
}

#[test]
fn names_taken_from_received_files_are_read_only_if_regular_and_bounded() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    // A corpus list whose shard is a FIFO (an open would block forever) ...
    megatron_dataset(&d.join("ok"), 20, 50);
    mkfifo(&d.join("pipe.idx"));
    std::fs::copy(d.join("ok.bin"), d.join("pipe.bin")).unwrap();
    std::fs::write(d.join("fifo-list.txt"), "1 pipe\n").unwrap();
    let r = run(
        kiln(
            &[
                "data",
                "blend",
                "fifo-list.txt",
                "--seq-len",
                "8",
                "--samples",
                "8",
                "--verify",
                "off",
            ],
            d,
        ),
        30,
    );
    refused_with(
        &r,
        INVALID,
        "FIFO shard",
        &["pipe.idx: is a FIFO, not a regular file"],
    );
    // ... whose sidecar is /dev/zero (read whole, it never ends) ...
    std::os::unix::fs::symlink("/dev/zero", d.join("ok.kiln.json")).unwrap();
    std::fs::write(d.join("list.txt"), "1 ok\n").unwrap();
    let r = run(
        kiln(
            &[
                "data",
                "blend",
                "list.txt",
                "--seq-len",
                "8",
                "--samples",
                "8",
                "--json",
            ],
            d,
        ),
        30,
    );
    assert_eq!(r.code, 0, "{}", r.stderr);
    assert!(
        r.stderr.contains("ignoring unreadable dataset sidecar"),
        "{}",
        r.stderr
    );
    // ... a corpus list that is itself /dev/zero, a manifest that is a FIFO.
    std::os::unix::fs::symlink("/dev/zero", d.join("zero-list.txt")).unwrap();
    let r = run(kiln(&["data", "verify", "zero-list.txt"], d), 30);
    refused_with(
        &r,
        INVALID,
        "list /dev/zero",
        &["zero-list.txt: is a character device"],
    );
    mkfifo(&d.join("list.txt.manifest.json"));
    let r = run(kiln(&["data", "verify", "list.txt"], d), 30);
    refused_with(
        &r,
        INVALID,
        "FIFO manifest",
        &["list.txt.manifest.json: is a FIFO"],
    );

    // A config naming /dev/zero as its task file, and a task file far too large.
    let mut cmd = train_cmd(
        &d.join("run"),
        &["eval.tasks=/dev/zero", "training.steps=1"],
    );
    cmd.current_dir(d);
    let r = run(cmd, 30);
    refused_with(
        &r,
        INVALID,
        "tasks /dev/zero",
        &["/dev/zero: is a character device"],
    );
    let big = std::fs::File::create(d.join("big.jsonl")).unwrap();
    big.set_len(600 << 20).unwrap(); // sparse: no disk used
    let r = run(kiln(&["eval", "nowhere", "--tasks", "big.jsonl"], d), 30);
    refused(
        &r,
        "huge task file",
        &["big.jsonl: is 629145600 bytes, more than the"],
    );
    // A tokenizer path that is a FIFO.
    mkfifo(&d.join("tok.json"));
    std::fs::write(d.join("in.txt"), "hello\n").unwrap();
    let r = run(
        kiln(
            &[
                "data", "tokenize", "-t", "tok.json", "-i", "in.txt", "-o", "out",
            ],
            d,
        ),
        30,
    );
    refused_with(&r, INVALID, "FIFO tokenizer", &["tok.json: is a FIFO"]);
    // An input that never ends is refused before it is read (a regular file without
    // newlines is an error after a bounded read).
    let r = run(
        kiln(
            &[
                "data",
                "train-tokenizer",
                "-i",
                "/dev/zero",
                "-o",
                "t.json",
                "--vocab-size",
                "300",
            ],
            d,
        ),
        60,
    );
    refused_with(
        &r,
        INVALID,
        "input /dev/zero",
        &["/dev/zero: is a character device, not a regular file"],
    );
}

#[test]
fn data_and_gates_verbs_answer_right_or_refuse_bad_numbers() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    // A dataset whose name is not UTF-8 is inspected, not a panic.
    let name = std::ffi::OsStr::from_bytes(b"bad\xffname");
    megatron_dataset(&d.join(name), 5, 40);
    let mut cmd = Command::new(KILN);
    cmd.arg("data")
        .arg("inspect")
        .arg(name)
        .arg("--json")
        .current_dir(d);
    let r = run(cmd, 30);
    assert_eq!(r.code, 0, "{}", r.stderr);
    assert!(r.stdout.contains("\"documents\":6"), "{}", r.stdout);
    // --dump-doc past the end (u64::MAX used to wrap and print nothing).
    megatron_dataset(&d.join("ds"), 5, 40);
    for i in ["18446744073709551615", "6", "3..7"] {
        let r = run(kiln(&["data", "inspect", "ds", "--dump-doc", i], d), 30);
        refused_with(&r, kiln_run::exit::USAGE, i, &["--dump-doc"]);
    }
    let r = run(kiln(&["data", "inspect", "ds", "--dump-doc", "5"], d), 30);
    assert_eq!(r.code, 0, "{}", r.stderr);
    assert_eq!(r.stdout.trim(), "[40,1,2]");

    // tokenize whose output is its own input leaves the input alone.
    std::fs::write(d.join("text.txt"), "one two three\n\nfour five\n").unwrap();
    let r = run(
        kiln(
            &[
                "data",
                "train-tokenizer",
                "-i",
                "text.txt",
                "--vocab-size",
                "300",
                "-o",
                "tok.json",
            ],
            d,
        ),
        60,
    );
    assert_eq!(r.code, 0, "{}", r.stderr);
    std::fs::copy(d.join("text.txt"), d.join("corpus.bin")).unwrap();
    let before = std::fs::read(d.join("corpus.bin")).unwrap();
    let r = run(
        kiln(
            &[
                "data",
                "tokenize",
                "-t",
                "tok.json",
                "-i",
                "corpus.bin",
                "-o",
                "corpus",
            ],
            d,
        ),
        60,
    );
    refused_with(
        &r,
        INVALID,
        "tokenize onto its input",
        &["is the input", "corpus.bin"],
    );
    assert_eq!(std::fs::read(d.join("corpus.bin")).unwrap(), before);
    let r = run(
        kiln(
            &[
                "data",
                "train-tokenizer",
                "-i",
                "text.txt",
                "-o",
                "text.txt",
                "--vocab-size",
                "300",
            ],
            d,
        ),
        60,
    );
    refused_with(
        &r,
        INVALID,
        "train-tokenizer onto its input",
        &["is the input"],
    );

    // Bad flag values, checked by the verbs (kiln's CliError) and the gates
    // (kiln_gates::GatesError::Usage): usage errors, exit 2, before anything runs.
    for (args, needles) in [
        (
            &[
                "data",
                "train-tokenizer",
                "-i",
                "text.txt",
                "--vocab-size",
                "0",
            ][..],
            &["--vocab-size 0: must be in [257,"][..],
        ),
        (
            &[
                "data",
                "train-tokenizer",
                "-i",
                "text.txt",
                "--vocab-size",
                "10",
            ],
            &["--vocab-size 10"],
        ),
        (
            &["data", "blend", "l.txt", "--samples", "0"],
            &["must be at least 1"],
        ),
        (
            &[
                "data",
                "blend",
                "l.txt",
                "--samples",
                "8",
                "--threads",
                "100000",
            ],
            &["--threads = 100000"],
        ),
        (
            &[
                "data",
                "tokenize",
                "-t",
                "tok.json",
                "-i",
                "text.txt",
                "-o",
                "x",
                "--workers",
                "100000",
            ],
            &["--workers = 100000"],
        ),
        (
            &["eval", "somewhere", "--samples", "0"],
            &["--samples 0: must be at least 1"],
        ),
        (
            &["smoke", "--mem-tolerance", "nan"],
            &["--mem-tolerance NaN: must be a finite number"],
        ),
        (
            &["lr-find", "--blowup=-1"],
            &["--blowup -1: must be a finite number > 1"],
        ),
        (&["lr-find", "--blowup", "nan"], &["--blowup NaN"]),
    ] {
        let r = run(kiln(args, d), 60);
        refused_with(&r, kiln_run::exit::USAGE, &format!("{args:?}"), needles);
        assert!(r.seconds < 20.0, "{args:?} took {:.1}s", r.seconds);
    }

    // eval of a checkpoint directory whose manifest is gone names the manifest, not
    // config.toml.
    let run_dir = d.join("run");
    let r = run(
        train_cmd(
            &run_dir,
            &[
                "training.steps=2",
                "checkpoint.interval=2",
                "eval.samples=0",
            ],
        ),
        120,
    );
    assert_eq!(r.code, 0, "{}", r.stderr);
    let ck = run_dir.join("checkpoints").join("step-2");
    std::fs::remove_file(ck.join("manifest.json")).unwrap();
    let mut cmd = Command::new(KILN);
    cmd.arg("eval").arg(&ck).current_dir(d);
    let r = run(cmd, 60);
    refused_with(
        &r,
        INVALID,
        "eval without manifest",
        &["without manifest.json"],
    );
    assert!(!r.stderr.contains("config.toml"), "{}", r.stderr);
}

#[test]
fn output_has_no_colour_in_pipes_and_says_each_error_once() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    // A WARN line (no shard manifest) into a pipe: no escape codes.
    megatron_dataset(&d.join("ds"), 20, 40);
    std::fs::write(d.join("list.txt"), "1 ds\n").unwrap();
    let r = run(
        kiln(
            &[
                "data",
                "blend",
                "list.txt",
                "--seq-len",
                "8",
                "--samples",
                "8",
            ],
            d,
        ),
        30,
    );
    assert_eq!(r.code, 0, "{}", r.stderr);
    assert!(r.stderr.contains("WARN"), "{}", r.stderr);
    assert!(
        !r.stderr.contains('\x1b'),
        "colour in a pipe: {:?}",
        r.stderr
    );

    // A real ENOSPC: lr-find's CSV goes to /dev/full. The OS error is said once.
    let out = d.join("lr");
    std::fs::create_dir(&out).unwrap();
    std::os::unix::fs::symlink("/dev/full", out.join("lr-find.csv")).unwrap();
    let mut cmd = kiln(&["lr-find", "--steps", "5", "--out", "lr"], d);
    for s in common::TINY_MODEL {
        cmd.arg("--set").arg(s);
    }
    let r = run(cmd, 120);
    refused(&r, "ENOSPC", &["lr-find.csv", "(os error 28)"]);
    assert_eq!(r.stderr.matches("os error 28").count(), 1, "{}", r.stderr);
    // And a missing config file.
    let r = run(kiln(&["train", "missing.toml"], d), 30);
    refused_with(
        &r,
        INVALID,
        "missing config",
        &["missing.toml", "(os error 2)"],
    );
    assert_eq!(r.stderr.matches("os error 2)").count(), 1, "{}", r.stderr);
}

/// A quarantine file that is a FIFO blocked `kiln launch` and `kiln submit` forever: every
/// path kiln opens from a flag or from the run directory is checked to be a regular file
/// before it is opened, without blocking (quarantine files, hostfiles, tokenizer inputs,
/// event logs, weights).
#[test]
fn paths_that_are_fifos_are_refused_without_blocking() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    mkfifo(&d.join("q"));
    let usage = kiln_run::exit::USAGE;
    let launch = |extra: &[&str]| {
        let mut args = vec!["launch", "--run-dir", "run"];
        args.extend_from_slice(extra);
        args.extend(["--", "true"]);
        let mut c = kiln(&args, d);
        for v in common::DETECTED {
            c.env_remove(v);
        }
        run(c, 30)
    };
    let r = launch(&["--quarantine-file", "q"]);
    refused_with(
        &r,
        usage,
        "launch quarantine FIFO",
        &["quarantine file q: is a FIFO"],
    );
    let r = launch(&["--mpi", "--hostfile", "q"]);
    refused_with(&r, usage, "hostfile FIFO", &["hostfile q: is a FIFO"]);
    let submit = [
        "submit",
        "--scheduler",
        "slurm",
        "--nodes",
        "1",
        "--time",
        "2:00",
        "--dry-run",
        "--run-dir",
        "run",
        "--quarantine-file",
        "q",
        "--",
        "true",
    ];
    let r = run(kiln(&submit, d), 30);
    refused_with(&r, usage, "submit quarantine FIFO", &["q: is a FIFO"]);
    // The run directory's own quarantine file and event log.
    std::fs::create_dir(d.join("run")).unwrap();
    mkfifo(&d.join("run/quarantine.jsonl"));
    let r = launch(&[]);
    refused_with(
        &r,
        usage,
        "run-dir quarantine FIFO",
        &["quarantine.jsonl: is a FIFO"],
    );
    mkfifo(&d.join("run/events.jsonl"));
    let r = run(kiln(&["status", "run"], d), 30);
    refused(&r, "events FIFO", &["events.jsonl: is a FIFO"]);
    // Weights and tokenizer inputs.
    std::fs::create_dir(d.join("m")).unwrap();
    mkfifo(&d.join("m/model.safetensors"));
    let r = run(kiln(&["eval", "m"], d), 30);
    refused(&r, "weights FIFO", &["model.safetensors: is a FIFO"]);
    std::fs::write(d.join("a.txt"), "ant bee cat\n\ndog eel fox\n").unwrap();
    let tok = [
        "data",
        "train-tokenizer",
        "-i",
        "a.txt",
        "--vocab-size",
        "300",
        "-o",
        "t.json",
    ];
    assert_eq!(run(kiln(&tok, d), 60).code, 0);
    let r = run(
        kiln(
            &["data", "tokenize", "-t", "t.json", "-i", "q", "-o", "out"],
            d,
        ),
        30,
    );
    refused_with(&r, INVALID, "input FIFO", &["q: is a FIFO"]);
}

/// Runs `cmd` to its end and returns its exit code, stderr and peak resident memory (KiB):
/// the largest `VmHWM` of its /proc status, read every few milliseconds while it runs. (The
/// kernel's rusage of a child is no use here: it counts the memory of the test process that
/// forked it.) Polling can only miss memory used in the last moments, never add any.
fn peak_memory(mut cmd: Command) -> (i32, String, u64) {
    let mut child = cmd
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start kiln");
    let mut err = child.stderr.take().expect("stderr");
    let err_t = std::thread::spawn(move || {
        let mut s = String::new();
        let _ = err.read_to_string(&mut s);
        s
    });
    let status_file = format!("/proc/{}/status", child.id());
    let mut peak = 0u64;
    let status = loop {
        let hwm = std::fs::read_to_string(&status_file)
            .ok()
            .and_then(|t| {
                let line = t.lines().find(|l| l.starts_with("VmHWM:"))?.to_string();
                line.split_whitespace().nth(1)?.parse::<u64>().ok()
            })
            .unwrap_or(0);
        peak = peak.max(hwm);
        if let Some(s) = child.try_wait().expect("wait") {
            break s;
        }
        std::thread::sleep(Duration::from_millis(2));
    };
    (
        status.code().unwrap_or(-1),
        err_t.join().unwrap_or_default(),
        peak,
    )
}

/// `kiln status` on a 1 GiB single-line events.jsonl used 2.1 GB: logs are read a line at a
/// time with a bound on the line, so an overlong line costs no memory and is named.
#[test]
fn status_reads_logs_with_a_line_bound() {
    let dir = tempfile::tempdir().unwrap();
    let run_dir = dir.path().join("run");
    std::fs::create_dir(&run_dir).unwrap();
    let event = r#"{"time":1.0,"source":"launch","event":"launch_start"}"#;
    let write = |name: &str, last: bool| {
        use std::io::Write;
        let mut f = std::fs::File::create(run_dir.join(name)).unwrap();
        let chunk = vec![b'x'; 1 << 20];
        f.write_all(b"{\"time\":1.0,\"junk\":\"").unwrap();
        for _ in 0..256 {
            f.write_all(&chunk).unwrap();
        }
        f.write_all(b"\"}").unwrap();
        if !last {
            writeln!(f, "\n{event}").unwrap();
        }
    };
    // A 256 MiB line followed by an event: invalid input, an error naming the line, in little
    // memory.
    write("events.jsonl", false);
    let (code, err, kib) = peak_memory(kiln(&["status", "run"], dir.path()));
    assert_eq!(code, INVALID, "{err}");
    assert!(
        err.contains("events.jsonl line 1: is 268435478 bytes long"),
        "{err}"
    );
    assert!(
        kib < 64 << 10,
        "kiln status peaked at {kib} KiB on a 256 MiB line"
    );
    // As the last line it is a torn write: skipped, and status answers.
    write("events.jsonl", true);
    let (code, err, kib) = peak_memory(kiln(&["status", "run"], dir.path()));
    assert_eq!(code, 0, "{err}");
    assert!(kib < 64 << 10, "kiln status peaked at {kib} KiB");
    // The same bound holds for metrics.jsonl.
    std::fs::write(run_dir.join("events.jsonl"), format!("{event}\n")).unwrap();
    write("metrics.jsonl", false);
    let (code, err, kib) = peak_memory(kiln(&["status", "run"], dir.path()));
    assert_eq!(code, INVALID, "{err}");
    assert!(
        err.contains("metrics.jsonl line 1: is 268435478 bytes long"),
        "{err}"
    );
    assert!(kib < 64 << 10, "kiln status peaked at {kib} KiB on metrics");
}

/// `kiln data tokenize` of one 195 MB line used 18.7 GB (96 times its input): a document
/// longer than PIECE_BYTES is encoded in pieces, so peak memory stays within the documented
/// multiple (about 3 times the longest line plus about 100 times a piece per thread) however
/// long the document, and the output says how many documents were split.
#[test]
fn tokenize_memory_is_bounded_on_one_huge_line() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let words = [
        "ant", "bee", "cat", "dog", "eel", "fox", "gnu", "hen", "owl", "yak",
    ];
    let mut small = String::new();
    let mut line = String::with_capacity(16 << 20);
    let mut x = 1u64;
    for i in 0..4_000_000usize {
        x = x
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        let w = words[(x >> 33) as usize % words.len()];
        if i < 10_000 {
            small += w;
            small += if i % 50 == 49 { "\n\n" } else { " " };
        }
        line += w;
        line.push(' ');
    }
    line.push('\n');
    std::fs::write(d.join("small.txt"), small).unwrap();
    std::fs::write(d.join("big.txt"), &line).unwrap();
    let tok = [
        "data",
        "train-tokenizer",
        "-i",
        "small.txt",
        "--vocab-size",
        "300",
        "-o",
        "t.json",
    ];
    assert_eq!(run(kiln(&tok, d), 60).code, 0);
    let mut cmd = kiln(
        &[
            "data", "tokenize", "-t", "t.json", "-i", "big.txt", "-o", "out", "--split", "line",
        ],
        d,
    );
    cmd.env("KILN_NO_PROGRESS", "1");
    let (code, err, kib) = peak_memory(cmd);
    assert_eq!(code, 0, "{err}");
    // 16 MB of input: 3 x 16 MB + 100 x 256 KiB x 2 threads is about 100 MB (the unbounded
    // tokenizer took about 1.5 GB).
    assert!(
        kib < 160 << 10,
        "tokenize peaked at {kib} KiB on a 16 MB line"
    );
    let out = run(kiln(&["data", "inspect", "out", "--json"], d), 30);
    let info: serde_json::Value = serde_json::from_str(&out.stdout).unwrap();
    assert_eq!(info["documents"], 1, "{}", out.stdout);
    assert!(
        info["tokens"].as_u64().unwrap() > 1_000_000,
        "{}",
        out.stdout
    );
}

/// An `.idx` whose document pointer lies far past the end of the `.bin` was found only during
/// training and ended the run with exit 1 (retryable, so `--retries` looped on bad data).
/// Every pointer and size is checked against the `.bin` when the data is opened (cached like
/// the vocabulary scan): exit 78 before any step, naming the file and the sequence.
#[test]
fn index_damage_is_a_data_error_when_the_data_is_opened() {
    let dir = tempfile::tempdir().unwrap();
    megatron_dataset(&dir.path().join("mega"), 200, 999);
    // Header: magic (9), version (8), dtype (1), sequences (8), documents (8); then the i32
    // lengths and the i64 pointers.
    let idx = dir.path().join("mega.idx");
    let mut bytes = std::fs::read(&idx).unwrap();
    let n = u64::from_le_bytes(bytes[18..26].try_into().unwrap()) as usize;
    let at = 34 + 4 * n + 8 * 5;
    bytes[at..at + 8].copy_from_slice(&(1i64 << 40).to_le_bytes());
    std::fs::write(&idx, bytes).unwrap();
    std::fs::write(dir.path().join("list.txt"), "1.0 mega\n").unwrap();
    let sets = [
        "data.corpus_list=list.txt",
        "training.steps=2",
        "eval.samples=0",
        "model.vocab_size=1000",
    ];
    let mut cmd = train_cmd(&dir.path().join("run"), &sets);
    cmd.current_dir(dir.path());
    let r = run(cmd, 120);
    refused_with(
        &r,
        INVALID,
        "pointer past the .bin",
        &[
            "list.txt:1",
            "mega.idx",
            "sequence 5 points at byte 1099511627776",
        ],
    );
    assert!(!r.stdout.contains("step=1"), "a step ran: {}", r.stdout);
}

/// Issue 46, held out with a real full disk (a small tmpfs in a mount namespace of the
/// test's own): a checkpoint write that failed on it left `.tmp-step-<N>-<pid>` holding the
/// space, so the retry on the same disk failed at once (`config.toml: No space left on
/// device`). The failed write removes its files: the retry gets as far as the first run.
#[test]
fn a_checkpoint_that_fills_the_disk_leaves_the_space_for_the_retry() {
    let dir = tempfile::tempdir().unwrap();
    let disk = dir.path().join("disk");
    std::fs::create_dir(&disk).unwrap();
    let rd = disk.join("run");
    // About 5 MB of weights and 10 MB of moments: the weights fit in 8 MB, the moments not.
    let cmd = train_cmd(
        &rd,
        &[
            "model.d_model=256",
            "model.n_heads=4",
            "model.n_kv_heads=2",
            "model.ffn_hidden=512",
            "training.steps=2",
            "training.threads=1",
            "checkpoint.snapshot_interval=0",
            "eval.interval=0",
        ],
    );
    let argv: Vec<String> = std::iter::once(cmd.get_program())
        .chain(cmd.get_args())
        .map(|a| format!("'{}'", a.to_string_lossy()))
        .collect();
    let train = argv.join(" ");
    let script = format!(
        "mount -t tmpfs -o size=8m tmpfs '{d}' || exit 99; \
         {train} 2>&1; echo \"first exit $?\"; \
         echo left: $(ls -A '{r}/checkpoints'); \
         {train} 2>&1; echo \"second exit $?\"",
        d = disk.display(),
        r = rd.display()
    );
    let Some(ns) = in_own_mounts(&script) else {
        eprintln!("no user namespace to mount a small disk in: not run");
        return;
    };
    let r = run(ns, 240);
    let out = &r.stdout;
    assert!(out.contains("first exit 1"), "{out}\n{}", r.stderr);
    assert!(out.contains("No space left on device"), "{out}");
    let left = out
        .lines()
        .find(|l| l.starts_with("left:"))
        .unwrap_or_default();
    assert!(!left.contains(".tmp-"), "{left}");
    let second = out.split("left:").nth(1).unwrap_or_default();
    assert!(second.contains("second exit 1"), "{out}");
    assert!(
        !second.contains("config.toml"),
        "the retry failed at once on the space the first run left: {second}"
    );
    assert!(second.contains("checkpoints"), "{second}");
}

/// Issue 60: a trainer SIGKILLed while it writes a checkpoint (a preemption, a lost node)
/// left `checkpoints/.tmp-step-<N>-<pid>` for ever: the rerun removed only its own process's.
/// The next start removes every killed writer's, says so (`checkpoint_leftover_removed`, with
/// its bytes), and resumes.
#[test]
fn a_writer_killed_mid_save_leaves_nothing_behind_after_the_next_start() {
    let dir = tempfile::tempdir().unwrap();
    let rd = dir.path().join("run");
    // About 40M parameters: a checkpoint of about 500 MB, long enough to be caught writing.
    let sets = [
        "model.d_model=768",
        "model.n_layers=6",
        "model.n_heads=6",
        "model.n_kv_heads=2",
        "model.ffn_hidden=2048",
        "training.batch_size=1",
        "training.seq_len=16",
        "training.compute_shards=1",
        "training.steps=4",
        "checkpoint.interval=2",
        "checkpoint.async=false",
        "checkpoint.snapshot_interval=0",
        "guards.snapshot_interval=0",
        "guards.frozen_check_interval=0",
        "eval.interval=0",
        "eval.samples=0",
    ];
    let tmp_dirs = |rd: &Path| -> Vec<String> {
        std::fs::read_dir(rd.join("checkpoints"))
            .map(|d| {
                d.filter_map(|e| Some(e.ok()?.file_name().to_str()?.to_string()))
                    .filter(|n| n.starts_with(".tmp-"))
                    .collect()
            })
            .unwrap_or_default()
    };
    let mut child = train_cmd(&rd, &sets)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    // Caught once the writer has put bytes in its folder (the report says how many it frees:
    // a kill right after the folder's creation left 0, which the test took for a defect).
    let written = |rd: &Path| -> u64 {
        let folders = tmp_dirs(rd)
            .into_iter()
            .map(|n| rd.join("checkpoints").join(n));
        let files = folders.flat_map(|f| std::fs::read_dir(f).into_iter().flatten().flatten());
        files
            .filter_map(|e| e.metadata().ok())
            .map(|m| m.len())
            .sum()
    };
    let t0 = Instant::now();
    while written(&rd) == 0 {
        assert!(
            child.try_wait().unwrap().is_none(),
            "the run ended before a save was caught in flight"
        );
        assert!(t0.elapsed() < Duration::from_secs(120), "no save started");
        std::thread::sleep(Duration::from_millis(2));
    }
    child.kill().unwrap(); // SIGKILL, by PID
    child.wait().unwrap();
    let left = tmp_dirs(&rd);
    assert_eq!(left.len(), 1, "{left:?}");
    let out = train_cmd(&rd, &sets).output().unwrap();
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(
        tmp_dirs(&rd),
        Vec::<String>::new(),
        "a killed writer's folder stays"
    );
    let removed: Vec<serde_json::Value> = common::events(&rd)
        .into_iter()
        .filter(|e| e["event"] == "checkpoint_leftover_removed")
        .collect();
    assert_eq!(removed.len(), 1, "{removed:?}");
    assert!(removed[0]["path"].as_str().unwrap().ends_with(&left[0]));
    assert!(removed[0]["bytes"].as_u64().unwrap() > 0, "{removed:?}");
}

//! End-to-end tests of `kiln data` through the real binary.
use std::path::Path;
use std::process::{Command, Output};

fn kiln(args: &[&str], dir: &Path) -> Output {
    Command::new(env!("CARGO_BIN_EXE_kiln"))
        .arg("data")
        .args(args)
        .current_dir(dir)
        .env("KILN_NO_PROGRESS", "1")
        .output()
        .expect("run kiln")
}

fn ok(args: &[&str], dir: &Path) -> String {
    let out = kiln(args, dir);
    assert!(
        out.status.success(),
        "kiln data {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// Text -> tokenizer -> shards -> manifest -> blend, as the README shows it.
fn corpus(dir: &Path) {
    let words = [
        "ant", "bee", "cat", "dog", "eel", "fox", "gnu", "hen", "owl", "yak",
    ];
    let mut text = String::new();
    let mut jsonl = String::new();
    for i in 0..4000usize {
        let doc: Vec<&str> = (0..(5 + i * 7 % 90))
            .map(|k| words[(i * 31 + k * k) % 10])
            .collect();
        if i % 2 == 0 {
            text += &format!("{}\n\n", doc.join(" "));
        } else {
            jsonl += &format!("{}\n", serde_json::json!({"text": doc.join(" ")}));
        }
    }
    std::fs::write(dir.join("a.txt"), text).unwrap();
    std::fs::write(dir.join("b.jsonl"), jsonl).unwrap();
    ok(
        &[
            "train-tokenizer",
            "-i",
            "a.txt",
            "b.jsonl",
            "--vocab-size",
            "400",
            "-o",
            "tok.json",
        ],
        dir,
    );
    ok(
        &[
            "tokenize", "-t", "tok.json", "-i", "a.txt", "-o", "shards/a",
        ],
        dir,
    );
    ok(
        &[
            "tokenize", "-t", "tok.json", "-i", "b.jsonl", "-o", "shards/b",
        ],
        dir,
    );
    std::fs::write(
        dir.join("list.txt"),
        "# weight prefix corpus\n0.6 shards/a text\n0.4 shards/b json\n",
    )
    .unwrap();
}

#[test]
fn text_to_blend_and_inspect() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    corpus(d);
    let info: serde_json::Value =
        serde_json::from_str(&ok(&["inspect", "shards/a", "--json", "--check"], d)).unwrap();
    assert_eq!(info["documents"], 2000);
    assert_eq!(info["dtype"], "uint16");
    let doc: Vec<u32> =
        serde_json::from_str(&ok(&["inspect", "shards/a", "--dump-doc", "3"], d)).unwrap();
    assert_eq!(
        doc.last().copied(),
        info["eos_id"].as_u64().map(|x| x as u32)
    );
    ok(&["manifest", "list.txt"], d);
    ok(&["verify", "list.txt", "--full"], d);
    let report: serde_json::Value = serde_json::from_str(&ok(
        &[
            "blend",
            "list.txt",
            "--seq-len",
            "32",
            "--steps",
            "50",
            "--global-batch",
            "8",
            "--json",
            "--require-manifest",
        ],
        d,
    ))
    .unwrap();
    assert_eq!(report["samples"], 400);
    assert_eq!(report["datasets"][0]["samples"], 240);
    let rows = ok(
        &[
            "blend",
            "list.txt",
            "--seq-len",
            "32",
            "--samples",
            "400",
            "--dump-samples",
            "0..5",
        ],
        d,
    );
    for line in rows.lines() {
        let row: Vec<u32> = serde_json::from_str(line).unwrap();
        assert_eq!(row.len(), 33);
    }
    // A re-emitted shard is refused by name.
    ok(
        &[
            "tokenize", "-t", "tok.json", "-i", "b.jsonl", "a.txt", "-o", "shards/b",
        ],
        d,
    );
    let out = kiln(
        &["blend", "list.txt", "--seq-len", "32", "--samples", "400"],
        d,
    );
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && err.contains("shards/b.") && err.contains("changed"),
        "{err}"
    );
    // Bad list line: file and line named, non-zero exit, no panic.
    std::fs::write(d.join("bad.txt"), "0.5 shards/a\nheavy shards/b\n").unwrap();
    let out = kiln(&["blend", "bad.txt", "--samples", "10"], d);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && err.contains("bad.txt:2:") && !err.contains("panicked"),
        "{err}"
    );
}

/// Two processes building the same cold cache at once end with identical, correct indices.
#[test]
fn two_processes_build_the_same_cache() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    corpus(d);
    let args = [
        "blend",
        "list.txt",
        "--seq-len",
        "16",
        "--samples",
        "200000",
        "--cache-dir",
        "cache",
        "--dump-samples",
        "199990..200000",
    ];
    let spawn = || {
        Command::new(env!("CARGO_BIN_EXE_kiln"))
            .arg("data")
            .args(args)
            .current_dir(d)
            .env("KILN_NO_PROGRESS", "1")
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap()
    };
    let (a, b) = (spawn(), spawn());
    let (a, b) = (a.wait_with_output().unwrap(), b.wait_with_output().unwrap());
    assert!(
        a.status.success() && b.status.success(),
        "{}",
        String::from_utf8_lossy(&a.stderr)
    );
    assert_eq!(a.stdout, b.stdout);
    // A third run from a fresh cache gives the same samples: the race left correct files.
    let mut fresh: Vec<String> = args.iter().map(|s| s.to_string()).collect();
    fresh[7] = "cache2".into();
    let c = ok(&fresh.iter().map(|s| s.as_str()).collect::<Vec<_>>(), d);
    assert_eq!(String::from_utf8_lossy(&a.stdout), c);
    let names = |p: &str| {
        let mut v: Vec<(String, Vec<u8>)> = std::fs::read_dir(d.join(p))
            .unwrap()
            .map(|e| e.unwrap().path())
            .filter(|p| !p.to_string_lossy().ends_with(".lock"))
            .map(|p| {
                (
                    p.file_name().unwrap().to_string_lossy().into_owned(),
                    std::fs::read(&p).unwrap(),
                )
            })
            .collect();
        v.sort();
        v
    };
    let (x, y) = (names("cache"), names("cache2"));
    assert!(
        x.iter().all(|(n, _)| !n.contains(".tmp.")),
        "temporary files left behind"
    );
    assert_eq!(x, y);
}

#[test]
fn every_verb_has_complete_help() {
    let dir = tempfile::tempdir().unwrap();
    for verb in [
        "train-tokenizer",
        "tokenize",
        "inspect",
        "blend",
        "manifest",
        "verify",
    ] {
        let help = ok(&[verb, "--help"], dir.path());
        assert!(
            help.contains("Usage:") && help.len() > 200,
            "{verb}: {help}"
        );
    }
}

/// A corpus list naming one shard twice by different spellings (`a` and `./a`, or through a
/// link) silently gave it double weight: the duplicate check compares files, not strings.
#[test]
fn one_shard_under_two_spellings_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    std::fs::write(d.join("a.txt"), "ant bee cat\n\ndog eel fox\n").unwrap();
    ok(
        &[
            "train-tokenizer",
            "-i",
            "a.txt",
            "--vocab-size",
            "300",
            "-o",
            "tok.json",
        ],
        d,
    );
    ok(
        &[
            "tokenize", "-t", "tok.json", "-i", "a.txt", "-o", "shards/a",
        ],
        d,
    );
    std::fs::create_dir(d.join("links")).unwrap();
    for ext in ["bin", "idx"] {
        std::os::unix::fs::symlink(
            d.join(format!("shards/a.{ext}")),
            d.join(format!("links/alias.{ext}")),
        )
        .unwrap();
    }
    for (second, line) in [
        ("./shards/a", 2),
        ("shards//a.idx", 2),
        ("links/../shards/a", 2),
        ("links/alias", 2),
    ] {
        let list = format!("0.5 shards/a\n0.5 {second}\n");
        std::fs::write(d.join("list.txt"), &list).unwrap();
        let out = kiln(
            &["blend", "list.txt", "--seq-len", "4", "--samples", "10"],
            d,
        );
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(
            !out.status.success()
                && err.contains(&format!("list.txt:{line}:"))
                && err.contains("same dataset as shards/a"),
            "{list:?} was accepted: {err}"
        );
    }
    // Distinct shards still blend.
    ok(
        &[
            "tokenize", "-t", "tok.json", "-i", "a.txt", "-o", "shards/b",
        ],
        d,
    );
    std::fs::write(d.join("list.txt"), "0.5 shards/a\n0.5 ./shards/b\n").unwrap();
    ok(
        &["blend", "list.txt", "--seq-len", "4", "--samples", "10"],
        d,
    );
}

/// A tokenizer trained on a few words, in `dir/tok.json`.
fn small_tokenizer(dir: &Path) {
    std::fs::write(
        dir.join("seed.txt"),
        "ant bee cat\n\ndog eel fox\n\ngnu hen owl\n",
    )
    .unwrap();
    ok(
        &[
            "train-tokenizer",
            "-i",
            "seed.txt",
            "--vocab-size",
            "300",
            "-o",
            "tok.json",
        ],
        dir,
    );
}

/// The names of the files in `dir` (recursively) that hold `needle`.
fn files_named(dir: &Path, needle: &str) -> Vec<String> {
    let mut found = Vec::new();
    for e in std::fs::read_dir(dir).unwrap().flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        if e.path().is_dir() {
            found.extend(files_named(&e.path(), needle));
        } else if name.contains(needle) {
            found.push(e.path().display().to_string());
        }
    }
    found
}

/// Runs `kiln data ARGS` expecting a refusal of bad input: exit 78 (fix it, do not retry),
/// each of `wants` in stderr, no panic, no temporary file left in `dir`, and none of
/// `outputs` written.
fn refused_78(args: &[&str], dir: &Path, wants: &[&str], outputs: &[&str]) {
    let out = kiln(args, dir);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(78), "{args:?}: {err}");
    for want in wants {
        assert!(err.contains(want), "{args:?}: want {want:?} in {err}");
    }
    assert!(!err.contains("panicked"), "{err}");
    let left = files_named(dir, ".tmp.");
    assert!(left.is_empty(), "{args:?} left {left:?}");
    for o in outputs {
        assert!(!dir.join(o).exists(), "{args:?} wrote {o}");
    }
}

/// Issue 46: `kiln data tokenize` on a `.jsonl` whose line 3 is not UTF-8 said `stream did
/// not contain valid UTF-8` without a line; a line that is not JSON, or whose `text` is a
/// number, named its line; all three exited 1 ("may be transient") instead of 78 and left
/// `PREFIX.bin.tmp.<pid>.0` behind.
#[test]
fn bad_records_name_their_line_and_offset_exit_78_and_leave_no_partial_output() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    small_tokenizer(d);
    let good = b"{\"text\": \"ant bee\"}\n{\"text\": \"cat dog\"}\n".to_vec();
    let offset = good.len().to_string();
    for (line3, want) in [
        (&b"{\"text\": \"eel \xff fox\"}\n"[..], "not valid UTF-8"),
        (&b"eel fox, no JSON here\n"[..], "not a JSON object"),
        (&b"{\"text\": 17}\n"[..], "is a number, not a string"),
    ] {
        let mut bytes = good.clone();
        bytes.extend_from_slice(line3);
        bytes.extend_from_slice(b"{\"text\": \"gnu\"}\n");
        std::fs::write(d.join("bad.jsonl"), &bytes).unwrap();
        refused_78(
            &[
                "tokenize",
                "-t",
                "tok.json",
                "-i",
                "bad.jsonl",
                "-o",
                "out/x",
            ],
            d,
            &["bad.jsonl:3:", want, &format!("starts at byte {offset}")],
            &["out/x.bin", "out/x.idx", "out/x.kiln.json"],
        );
    }
    // The first bad byte's own offset is named too.
    let mut bytes = good.clone();
    bytes.extend_from_slice(b"{\"text\": \"eel \xff fox\"}\n");
    std::fs::write(d.join("bad.jsonl"), &bytes).unwrap();
    let err = kiln(
        &[
            "tokenize",
            "-t",
            "tok.json",
            "-i",
            "bad.jsonl",
            "-o",
            "out/x",
        ],
        d,
    );
    let at = good.len() + b"{\"text\": \"eel ".len();
    assert!(
        String::from_utf8_lossy(&err.stderr).contains(&format!("0xff at offset {at}")),
        "{}",
        String::from_utf8_lossy(&err.stderr)
    );
}

/// Held out from the case: other formats and sizes. A bad record after more than a
/// batch of documents was already written (a partial `.bin` on disk), in the second of two
/// inputs (`.ndjson`); a plain-text file split by lines; a tokenizer trained on bad input;
/// the same bad input refused by `train-tokenizer` too.
#[test]
fn bad_records_in_any_input_or_position_are_refused_whole() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    small_tokenizer(d);
    std::fs::write(d.join("first.jsonl"), "{\"body\": \"ant\"}\n").unwrap();
    let mut big = String::new();
    for i in 0..5000 {
        big += &format!("{{\"body\": \"cat dog {i}\"}}\n");
    }
    let offset = big.len();
    let mut bytes = big.into_bytes();
    bytes.extend_from_slice(b"{\"body\": [\"eel\"]}\n");
    std::fs::write(d.join("second.ndjson"), &bytes).unwrap();
    refused_78(
        &[
            "tokenize",
            "-t",
            "tok.json",
            "-i",
            "first.jsonl",
            "second.ndjson",
            "--json-key",
            "body",
            "-o",
            "shards/big",
        ],
        d,
        &[
            "second.ndjson:5001:",
            "is an array, not a string",
            &format!("starts at byte {offset}"),
        ],
        &["shards/big.bin", "shards/big.idx"],
    );
    let mut text = b"ant\nbee\ncat\ndog\neel\nfox\n".to_vec();
    let offset = text.len();
    text.extend_from_slice(b"g\xc3nu\nhen\n");
    std::fs::write(d.join("notes.txt"), &text).unwrap();
    let wants = [
        "notes.txt:7:",
        "not valid UTF-8",
        &format!("starts at byte {offset}"),
    ];
    refused_78(
        &[
            "tokenize",
            "-t",
            "tok.json",
            "-i",
            "notes.txt",
            "--split",
            "line",
            "-o",
            "notes",
        ],
        d,
        &wants,
        &["notes.bin", "notes.idx"],
    );
    refused_78(
        &[
            "train-tokenizer",
            "-i",
            "notes.txt",
            "--vocab-size",
            "300",
            "-o",
            "tok2.json",
        ],
        d,
        &wants,
        &["tok2.json"],
    );
}

/// Issue 46: `kiln data blend` exited 1 for a corpus list with a `nan` weight, where
/// `kiln train` exits 78 for the same file; held out: other bad weights, a missing list.
#[test]
fn a_bad_corpus_list_exits_78_as_it_does_for_train() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    for (list, want) in [
        ("1 a\nnan b\n", "weights.txt:2: weight nan"),
        ("inf a\n", "weights.txt:1: weight inf"),
        ("0.5 a\n-0.25 b\n", "weights.txt:2: weight -0.25"),
        ("0 a\n0 b\n", "weights.txt: every weight is 0"),
    ] {
        std::fs::write(d.join("weights.txt"), list).unwrap();
        refused_78(
            &["blend", "weights.txt", "--seq-len", "4", "--samples", "10"],
            d,
            &[want],
            &[],
        );
    }
    refused_78(
        &["blend", "absent.txt", "--seq-len", "4", "--samples", "10"],
        d,
        &["absent.txt"],
        &[],
    );
}

/// Issue 60: a killed `kiln data tokenize` left `PREFIX.bin.tmp.<pid>.0`, and the next
/// successful run of the same command kept it (GBs on real shards). It removes a dead
/// writer's now, and says so; a live process's is kept.
#[test]
fn tokenize_removes_what_a_killed_run_of_it_left() {
    let tmp = tempfile::tempdir().unwrap();
    let d = tmp.path();
    small_tokenizer(d);
    std::fs::write(d.join("a.txt"), "ant bee cat\n\ndog eel fox\n").unwrap();
    // A process that ran and is gone, and one that runs (this test's).
    let mut child = std::process::Command::new("true").spawn().unwrap();
    let dead = child.id();
    child.wait().unwrap();
    std::fs::create_dir_all(d.join("shards")).unwrap();
    let left = d.join(format!("shards/a.bin.tmp.{dead}.0"));
    std::fs::write(&left, vec![7u8; 4096]).unwrap();
    let live = d.join(format!("shards/a.idx.tmp.{}.3", std::process::id()));
    std::fs::write(&live, b"in flight").unwrap();
    let out = ok(
        &[
            "tokenize", "-t", "tok.json", "-i", "a.txt", "-o", "shards/a",
        ],
        d,
    );
    assert!(!left.exists(), "{out}");
    assert!(
        out.contains("left by a writer killed before it finished"),
        "{out}"
    );
    assert!(live.exists(), "a live writer's file was removed");
}

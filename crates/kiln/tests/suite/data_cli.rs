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

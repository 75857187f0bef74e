//! `kiln data tokenize` on parquet through the real binary, on files written by pyarrow
//! (`tests/fixtures/parquet/`, `scripts/parquet-fixture.py`): the token shards of a parquet
//! file equal, byte for byte, those of the same documents given as JSONL (null rows skipped,
//! snappy and zstd, `string` and `large_string`, several row groups); a missing column is an
//! error naming the file and the columns it has. The Rust writer's files, and the 1 GB memory
//! measurement, are kiln-data's tests (`parquet` and `tests/parquet_memory.rs`).

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/parquet")
        .join(name)
}

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

fn same_files(dir: &Path, a: &str, b: &str) {
    for ext in ["bin", "idx"] {
        let x = std::fs::read(dir.join(format!("{a}.{ext}"))).unwrap();
        let y = std::fs::read(dir.join(format!("{b}.{ext}"))).unwrap();
        assert!(!x.is_empty());
        assert!(x == y, "{a}.{ext} and {b}.{ext} differ");
    }
}

#[test]
fn parquet_tokenizes_byte_identical_to_jsonl() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    for f in ["docs.parquet", "docs-zstd.parquet", "docs.jsonl"] {
        std::fs::copy(fixture(f), dir.join(f)).unwrap();
    }
    ok(
        &[
            "train-tokenizer",
            "-i",
            "docs.jsonl",
            "--vocab-size",
            "300",
            "-o",
            "tok.json",
        ],
        dir,
    );
    ok(
        &[
            "tokenize",
            "-t",
            "tok.json",
            "-i",
            "docs.jsonl",
            "-o",
            "jsonl",
        ],
        dir,
    );
    let text = ok(
        &[
            "tokenize",
            "-t",
            "tok.json",
            "-i",
            "docs.parquet",
            "-o",
            "pq",
        ],
        dir,
    );
    assert!(
        text.contains("53 documents") && text.contains("7 null row(s)"),
        "{text}"
    );
    same_files(dir, "jsonl", "pq");
    ok(
        &[
            "tokenize",
            "-t",
            "tok.json",
            "-i",
            "docs-zstd.parquet",
            "--text-column",
            "content",
            "-o",
            "zstd",
        ],
        dir,
    );
    same_files(dir, "jsonl", "zstd");

    // Issue 60: the throughput is of the text tokenized, not of the (compressed) file: the
    // parquet and JSONL inputs hold the same documents, so the same text bytes.
    let stats = |input: &str, out: &str, extra: &[&str]| -> serde_json::Value {
        let mut args = vec![
            "tokenize", "-t", "tok.json", "-i", input, "-o", out, "--json",
        ];
        args.extend_from_slice(extra);
        serde_json::from_str(ok(&args, dir).trim()).unwrap()
    };
    let (j, p) = (
        stats("docs.jsonl", "j2", &[]),
        stats("docs.parquet", "p2", &[]),
    );
    assert_eq!(j["text_bytes"], p["text_bytes"], "{j} {p}");
    assert!(p["text_bytes"].as_u64().unwrap() > 0);
    let file = std::fs::metadata(dir.join("docs.parquet")).unwrap().len();
    assert_ne!(p["text_bytes"].as_u64(), Some(file), "{p}");

    // A missing column names the file and its columns.
    let out = kiln(
        &[
            "tokenize",
            "-t",
            "tok.json",
            "-i",
            "docs.parquet",
            "--text-column",
            "body",
            "-o",
            "bad",
        ],
        dir,
    );
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{err}");
    assert!(
        err.contains("docs.parquet")
            && err.contains("no column \"body\"")
            && err.contains("\"text\""),
        "{err}"
    );
    // A file that is not parquet.
    std::fs::write(dir.join("fake.parquet"), "{\"text\": \"x\"}\n").unwrap();
    let out = kiln(
        &[
            "tokenize",
            "-t",
            "tok.json",
            "-i",
            "fake.parquet",
            "-o",
            "bad",
        ],
        dir,
    );
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && err.contains("fake.parquet") && err.contains("parquet"),
        "{err}"
    );
}

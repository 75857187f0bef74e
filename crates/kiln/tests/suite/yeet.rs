//! `kiln yeet` over a real MPI: 3 ranks, each with its own destination (`{rank}`), receive a
//! tree byte for byte; a hostile archive is refused on every rank and nothing is published.
//! Needs a kiln built with `--features mpi` (the README's test command builds it so).
#![cfg(feature = "mpi")]

use std::path::Path;
use std::process::{Command, Output};

use crate::common;

fn yeet(src: &Path, dest: &str) -> Output {
    let mut cmd = Command::new(common::KILN);
    cmd.args([
        "launch",
        "--mpi",
        "--np",
        "3",
        "--timeout",
        "60",
        "--run-dir",
    ])
    .arg(src.with_extension("launch"))
    .args(["--", common::KILN, "yeet"])
    .arg(src)
    .args(["--dest", dest]);
    for v in [
        "PBS_JOBID",
        "SLURM_JOB_ID",
        "RANK",
        "WORLD_SIZE",
        "LOCAL_RANK",
    ] {
        cmd.env_remove(v);
    }
    cmd.output().expect("spawn kiln launch")
}

fn text(out: &Output) -> String {
    format!(
        "{}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

/// Every file under `root`, relative, with its bytes.
fn files(root: &Path) -> Vec<(String, Vec<u8>)> {
    let mut out = Vec::new();
    let mut stack = vec![root.to_path_buf()];
    while let Some(dir) = stack.pop() {
        for e in std::fs::read_dir(&dir).unwrap().flatten() {
            let p = e.path();
            if p.is_dir() {
                stack.push(p);
            } else {
                let rel = p.strip_prefix(root).unwrap().display().to_string();
                out.push((rel, std::fs::read(&p).unwrap()));
            }
        }
    }
    out.sort();
    out
}

#[test]
fn a_tree_reaches_three_destinations_and_a_traversal_archive_is_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let src = tmp.path().join("env");
    std::fs::create_dir_all(src.join("lib/python")).unwrap();
    std::fs::write(src.join("activate"), "export X=1\n").unwrap();
    let big: Vec<u8> = (0..9_000_000u32).map(|i| (i * 7 % 251) as u8).collect();
    std::fs::write(src.join("lib/python/blob.so"), &big).unwrap();
    let dest = format!("{}/node-{{rank}}", tmp.path().display());
    let out = yeet(&src, &dest);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out));
    assert!(text(&out).contains("to 3 node(s)"), "{}", text(&out));
    let want = files(&src);
    for r in 0..3 {
        let got = files(&tmp.path().join(format!("node-{r}/env")));
        assert_eq!(got, want, "rank {r}'s copy differs");
    }

    // A tarball with a member climbing out of the destination.
    let evil = tmp.path().join("evil.tar");
    {
        let mut b = tar::Builder::new(std::fs::File::create(&evil).unwrap());
        let mut h = tar::Header::new_gnu();
        h.set_size(3);
        h.set_mode(0o644);
        h.set_entry_type(tar::EntryType::Regular);
        let name = b"../../escaped.txt";
        h.as_old_mut().name[..name.len()].copy_from_slice(name);
        h.set_cksum();
        b.append(&h, &b"bad"[..]).unwrap();
        b.finish().unwrap();
    }
    let out = yeet(&evil, &dest);
    assert_ne!(out.status.code(), Some(0), "{}", text(&out));
    assert!(
        text(&out).contains("outside the destination"),
        "{}",
        text(&out)
    );
    for r in 0..3 {
        assert!(!tmp.path().join(format!("node-{r}/evil")).exists());
    }
    assert!(!tmp.path().join("escaped.txt").exists());
}

#[test]
fn a_node_that_cannot_write_is_named_and_the_others_still_get_their_copy() {
    let tmp = tempfile::tempdir().unwrap();
    let src = tmp.path().join("env");
    std::fs::create_dir_all(src.join("lib")).unwrap();
    let big: Vec<u8> = (0..12_000_000u32).map(|i| (i * 13 % 241) as u8).collect();
    std::fs::write(src.join("lib/blob.so"), &big).unwrap();
    // Rank 1's destination already holds a copy (and no --force): its writer fails before
    // the first chunk, but it must stay in the broadcasts, or ranks 0 and 2 would wait
    // in one forever.
    std::fs::create_dir_all(tmp.path().join("node-1/env")).unwrap();
    std::fs::write(tmp.path().join("node-1/env/old"), "keep me").unwrap();
    let dest = format!("{}/node-{{rank}}", tmp.path().display());
    let t0 = std::time::Instant::now();
    let out = yeet(&src, &dest);
    assert!(t0.elapsed().as_secs() < 50, "took {:?}", t0.elapsed());
    assert_ne!(out.status.code(), Some(0), "{}", text(&out));
    assert_ne!(out.status.code(), Some(124), "a rank hung: {}", text(&out));
    assert!(
        text(&out).contains("exists; pass --force"),
        "{}",
        text(&out)
    );
    assert!(text(&out).contains("1 of 3 nodes failed"), "{}", text(&out));
    let want = files(&src);
    for r in [0, 2] {
        let got = files(&tmp.path().join(format!("node-{r}/env")));
        assert_eq!(got, want, "rank {r}'s copy differs");
    }
    assert_eq!(
        std::fs::read_to_string(tmp.path().join("node-1/env/old")).unwrap(),
        "keep me"
    );
    // Nothing staged is left behind.
    for r in 0..3 {
        for e in std::fs::read_dir(tmp.path().join(format!("node-{r}"))).unwrap() {
            let name = e.unwrap().file_name();
            assert!(
                !name.to_string_lossy().starts_with(".yeet-"),
                "{name:?} left"
            );
        }
    }
}

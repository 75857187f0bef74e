//! Helpers shared by the end-to-end tests of the `kiln` binary.
// Each test binary uses a different subset.
#![allow(dead_code)]

pub mod slurm;

use std::path::Path;
use std::process::Command;

pub const KILN: &str = env!("CARGO_BIN_EXE_kiln");

/// The tiny model of every end-to-end training test, so that a run takes a second or two.
pub const TINY_MODEL: &[&str] = &[
    "model.d_model=32",
    "model.n_layers=2",
    "model.n_heads=2",
    "model.n_kv_heads=1",
    "model.ffn_hidden=64",
    "training.seq_len=32",
];

/// `kiln train --run-dir DIR --no-progress-bar` on the tiny model, with `sets` on top.
pub fn train_cmd(run_dir: &Path, sets: &[&str]) -> Command {
    let mut cmd = Command::new(KILN);
    cmd.arg("train")
        .arg("--run-dir")
        .arg(run_dir)
        .arg("--no-progress-bar");
    for s in TINY_MODEL.iter().chain(sets) {
        cmd.arg("--set").arg(s);
    }
    cmd
}

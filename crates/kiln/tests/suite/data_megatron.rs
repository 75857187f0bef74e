//! megatron-core compatibility (scripts/megatron-compat.sh): runs only when
//! `KILN_MEGATRON_VENV` names the python of a venv with torch and megatron-core.
use std::process::Command;

#[test]
fn megatron_core_compat() {
    let Some(py) = std::env::var_os("KILN_MEGATRON_VENV") else {
        eprintln!("skipped: set KILN_MEGATRON_VENV=/path/to/venv/bin/python to run");
        return;
    };
    let root = concat!(env!("CARGO_MANIFEST_DIR"), "/../..");
    let out = Command::new("bash")
        .arg(format!("{root}/scripts/megatron-compat.sh"))
        .arg(env!("CARGO_BIN_EXE_kiln"))
        .env("KILN_MEGATRON_VENV", py)
        .output()
        .expect("run scripts/megatron-compat.sh");
    let text = String::from_utf8_lossy(&out.stdout);
    eprintln!("{text}{}", String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "megatron-core compatibility failed");
    assert!(text.contains("OK: 0 failed"));
}

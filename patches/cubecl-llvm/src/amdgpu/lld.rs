//! AMDGPU code object linking.
//!
//! kiln patch: the link runs an external LLD (a process) instead of LLD linked into this
//! crate. Upstream compiled `cpp_shims/lld.cpp` against LLD's static libraries (`lldELF`,
//! `lldCommon`), which no package registry has for LLVM 23; the only job is one link of a
//! relocatable object into a shared code object, which any LLD with the AMDGPU target does.
//! Looked for, in order: `CUBECL_AMDGPU_LINKER` (a path, or a name on `PATH`), then
//! `ld.lld` under `$ROCM_PATH/llvm/bin`, `$HIP_PATH/llvm/bin` and `/opt/rocm/llvm/bin`,
//! then `ld.lld` and `rust-lld` (the Rust toolchain's LLD, run as `-flavor gnu`) on `PATH`.

use std::{
    ffi::OsString,
    path::{Path, PathBuf},
    process::Command,
    sync::atomic::{AtomicUsize, Ordering},
};

/// Names the linker to run, a path or a name looked up on `PATH`.
pub const LINKER_VAR: &str = "CUBECL_AMDGPU_LINKER";

/// `ROCm` roots whose `llvm/bin/ld.lld` is looked for, after [`LINKER_VAR`].
const ROCM_ROOT_VARS: [&str; 2] = ["ROCM_PATH", "HIP_PATH"];
const DEFAULT_ROCM_ROOT: &str = "/opt/rocm";

/// Linkers looked for on `PATH`, after the `ROCm` roots.
const PATH_LINKERS: [&str; 2] = ["ld.lld", "rust-lld"];

/// Unique identifiers for temporary directories.
static CALL_COUNTER: AtomicUsize = AtomicUsize::new(0);

/// Links an AMDGPU object into a loadable code object.
pub fn link_relocatable(object: &[u8], name: &str) -> Result<Vec<u8>, String> {
    let linker = find_linker(&|var| std::env::var_os(var))?;
    let unique = CALL_COUNTER.fetch_add(1, Ordering::Relaxed);
    let dir = std::env::temp_dir().join(format!("cubecl-lld-{}-{unique}", std::process::id()));
    let result = link_in(&linker, &dir, object, name);
    let _ = std::fs::remove_dir_all(&dir);
    result
}

/// The linker [`link_relocatable`] runs, looked up in `env` (the process environment's
/// `var_os`), or an error naming everything looked for.
pub fn find_linker(env: &dyn Fn(&str) -> Option<OsString>) -> Result<PathBuf, String> {
    let path = env("PATH");
    if let Some(chosen) = env(LINKER_VAR).filter(|v| !v.is_empty()) {
        let chosen = PathBuf::from(chosen);
        return resolve(&chosen, path.as_deref()).ok_or_else(|| {
            format!(
                "{LINKER_VAR}={} is not an executable file, nor a program on PATH",
                chosen.display()
            )
        });
    }
    let roots: Vec<PathBuf> = ROCM_ROOT_VARS
        .iter()
        .filter_map(|var| env(var))
        .filter(|v| !v.is_empty())
        .map(PathBuf::from)
        .chain([PathBuf::from(DEFAULT_ROCM_ROOT)])
        .collect();
    let in_roots = roots.iter().map(|root| root.join("llvm/bin/ld.lld"));
    if let Some(found) = in_roots.clone().find(|p| is_executable(p)) {
        return Ok(found);
    }
    if let Some(found) = PATH_LINKERS
        .iter()
        .find_map(|name| resolve(Path::new(name), path.as_deref()))
    {
        return Ok(found);
    }
    let looked: Vec<String> = in_roots.map(|p| p.display().to_string()).collect();
    Err(format!(
        "no linker for AMDGPU code objects: {LINKER_VAR} is not set, there is no {} \
         (from {}, then {DEFAULT_ROCM_ROOT}), and neither {} is on PATH. Install ROCm \
         (its llvm/bin/ld.lld), or LLD (ld.lld), or set {LINKER_VAR} to an LLD, such as the \
         Rust toolchain's: $(rustc --print sysroot)/lib/rustlib/<host>/bin/rust-lld",
        looked.join(" nor "),
        ROCM_ROOT_VARS.join(", "),
        PATH_LINKERS.join(" nor "),
    ))
}

/// `program` itself if it names a path (has a separator), else the first executable of that
/// name in the directories of `path`.
fn resolve(program: &Path, path: Option<&std::ffi::OsStr>) -> Option<PathBuf> {
    if program.components().count() > 1 || program.is_absolute() {
        return is_executable(program).then(|| program.to_path_buf());
    }
    std::env::split_paths(path?)
        .map(|dir| dir.join(program))
        .find(|p| is_executable(p))
}

fn is_executable(path: &Path) -> bool {
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        path.metadata()
            .is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
    }
    #[cfg(not(unix))]
    {
        path.is_file()
    }
}

/// The arguments before the link's own: `rust-lld` is every LLD flavour in one program and
/// must be told it links ELF (`ld.lld` is the same program under the name that says so).
fn flavor_args(linker: &Path) -> &'static [&'static str] {
    let name = linker.file_stem().and_then(|n| n.to_str()).unwrap_or("");
    if name == "rust-lld" || name == "lld" {
        &["-flavor", "gnu"]
    } else {
        &[]
    }
}

fn link_in(linker: &Path, dir: &Path, object: &[u8], name: &str) -> Result<Vec<u8>, String> {
    std::fs::create_dir_all(dir).map_err(|e| format!("temp dir: {e}"))?;
    let obj_path = dir.join("kernel.o");
    let out_path = dir.join("kernel.hsaco");
    std::fs::write(&obj_path, object).map_err(|e| format!("write object: {e}"))?;

    let output = Command::new(linker)
        .args(flavor_args(linker))
        .arg("--shared")
        .arg("-o")
        .arg(&out_path)
        .arg(&obj_path)
        .output()
        .map_err(|e| format!("could not run the AMDGPU linker {}: {e}", linker.display()))?;

    if output.status.success() {
        std::fs::read(&out_path).map_err(|e| format!("read code object: {e}"))
    } else {
        Err(format!(
            "{} failed to link '{name}' ({}):\n{}",
            linker.display(),
            output.status,
            String::from_utf8_lossy(&output.stderr).trim_end()
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env_of<'a>(pairs: &'a [(&'a str, &'a str)]) -> impl Fn(&str) -> Option<OsString> + 'a {
        move |var| {
            pairs
                .iter()
                .find(|(k, _)| *k == var)
                .map(|(_, v)| OsString::from(v))
        }
    }

    #[test]
    fn nothing_found_names_what_was_looked_for() {
        let err = find_linker(&env_of(&[
            ("ROCM_PATH", "/nonexistent-rocm"),
            ("PATH", "/nonexistent-bin"),
        ]))
        .unwrap_err();
        for looked in [
            LINKER_VAR,
            "/nonexistent-rocm/llvm/bin/ld.lld",
            "/opt/rocm/llvm/bin/ld.lld",
            "ld.lld nor rust-lld",
        ] {
            assert!(err.contains(looked), "{looked} missing from: {err}");
        }
    }

    #[test]
    fn a_chosen_linker_that_is_not_there_is_an_error() {
        let err = find_linker(&env_of(&[(LINKER_VAR, "/nonexistent/ld.lld")])).unwrap_err();
        assert!(err.contains("/nonexistent/ld.lld"), "{err}");
    }

    #[test]
    fn rust_lld_is_told_its_flavour() {
        assert_eq!(flavor_args(Path::new("/x/rust-lld")), ["-flavor", "gnu"]);
        assert!(flavor_args(Path::new("/opt/rocm/llvm/bin/ld.lld")).is_empty());
    }
}

//! Batch scripts under hostile values: for every field of a `kiln submit` request, a value
//! full of newlines, quotes, `$(...)`, backquotes and bytes that are not UTF-8 is either
//! refused (where it would be written bare into a directive or a comment) or quoted so that
//! the script keeps its lines and bash runs exactly the argv kiln meant.

use kiln_launch::{BatchScheduler, SubmitRequest, batch_script, launch_argv};
use proptest::prelude::*;
use std::ffi::OsString;
use std::os::unix::ffi::{OsStrExt, OsStringExt};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

/// Pieces of hostile values: line breaks, shell syntax, injections (that would create
/// `PWNED` in the test's directory), Unicode and bytes that are not UTF-8.
const ATOMS: &[&[u8]] = &[
    b"\n",
    b"\r",
    b"\t",
    b"\x0b",
    b"\x7f",
    b"'",
    b"\"",
    b"$",
    b"`",
    b"\\",
    b";",
    b"&",
    b"|",
    b" ",
    b"#",
    b"*",
    b"~",
    b"!",
    b">",
    b"$(touch PWNED)",
    b"`touch PWNED`",
    b"\ntouch PWNED\n#",
    b"';touch PWNED;'",
    b"--x",
    b"a",
    "é".as_bytes(),
    "\u{2028}".as_bytes(),
    "\u{85}".as_bytes(),
    b"\xff",
];

fn hostile_bytes() -> impl Strategy<Value = Vec<u8>> {
    prop::collection::vec(prop::sample::select(ATOMS), 0..6).prop_map(|v| v.concat())
}

fn hostile() -> impl Strategy<Value = String> {
    hostile_bytes().prop_map(|b| String::from_utf8_lossy(&b).into_owned())
}

fn path_under(root: &Path, tail: Vec<u8>) -> PathBuf {
    let mut p = root.as_os_str().as_bytes().to_vec();
    p.push(b'/');
    p.extend(tail);
    PathBuf::from(OsString::from_vec(p))
}

#[derive(Debug, Clone)]
struct Hostile {
    pbs: bool,
    run_dir: Vec<u8>,
    workdir: Vec<u8>,
    kiln: Vec<u8>,
    job_name: String,
    account: Option<String>,
    queue: Option<String>,
    scheduler_args: Vec<String>,
    launch_args: Vec<String>,
    quarantine_file: Option<Vec<u8>>,
    command: Vec<String>,
    exclude: Vec<String>,
}

fn hostile_request() -> impl Strategy<Value = Hostile> {
    let words = || prop::collection::vec(hostile(), 0..3);
    (
        (
            any::<bool>(),
            hostile_bytes(),
            hostile_bytes(),
            hostile_bytes(),
        ),
        (
            hostile(),
            prop::option::of(hostile()),
            prop::option::of(hostile()),
        ),
        (words(), words(), prop::option::of(hostile_bytes())),
        (prop::collection::vec(hostile(), 1..4), words()),
    )
        .prop_map(
            |((pbs, run_dir, workdir, kiln), (job_name, account, queue), (s, l, q), (c, x))| {
                Hostile {
                    pbs,
                    run_dir,
                    workdir,
                    kiln,
                    job_name,
                    account,
                    queue,
                    scheduler_args: s,
                    launch_args: l,
                    quarantine_file: q,
                    command: c,
                    exclude: x,
                }
            },
        )
}

fn request(h: &Hostile, root: &Path) -> SubmitRequest {
    SubmitRequest {
        scheduler: if h.pbs {
            BatchScheduler::Pbs
        } else {
            BatchScheduler::Slurm
        },
        nodes: 2,
        spares: 1,
        time: Duration::from_secs(3600),
        chain: 3,
        signal_lead: None,
        // Under a directory that does not exist: the PBS script's output redirection fails
        // instead of creating files anywhere.
        run_dir: path_under(&root.join("absent"), h.run_dir.clone()),
        workdir: path_under(root, h.workdir.clone()),
        kiln: path_under(root, h.kiln.clone()),
        job_name: h.job_name.clone(),
        account: h.account.clone(),
        queue: h.queue.clone(),
        scheduler_args: h.scheduler_args.clone(),
        launch_args: h.launch_args.clone(),
        quarantine_file: h.quarantine_file.clone().map(|q| path_under(root, q)),
        command: h.command.clone(),
    }
}

/// Whether a value that is written bare (in a directive or a comment) could end its line.
fn must_refuse(req: &SubmitRequest, exclude: &[String]) -> bool {
    let breaks = |s: &str| {
        s.chars()
            .any(|c| c.is_control() || matches!(c, '\u{2028}' | '\u{2029}'))
    };
    let bare = [
        Some(&req.job_name),
        req.account.as_ref(),
        req.queue.as_ref(),
    ];
    req.run_dir.to_str().is_none_or(breaks)
        || bare.into_iter().flatten().any(|s| breaks(s))
        || req.scheduler_args.iter().chain(exclude).any(|s| breaks(s))
}

/// Runs `script` with bash, `exec` and `cd` replaced by functions that record their
/// arguments; returns (cd's arguments, exec's arguments), NUL-separated.
fn run_script(dir: &Path, script: &str) -> (Vec<u8>, Vec<u8>) {
    let defs = dir.join("defs.sh");
    std::fs::write(
        &defs,
        "exec() { if [ $# -gt 0 ]; then printf '%s\\0' \"$@\" > \"$T/argv\"; builtin exit 0; fi; }\n\
         cd() { printf '%s\\0' \"$@\" > \"$T/cd\"; }\n",
    )
    .unwrap();
    let path = dir.join("job.sh");
    std::fs::write(&path, script).unwrap();
    let out = Command::new("bash")
        .arg(&path)
        .current_dir(dir)
        .env("BASH_ENV", &defs)
        .env("T", dir)
        .env_remove("PBS_JOBID")
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(0), "{out:?}\n{script}");
    let read = |f: &str| std::fs::read(dir.join(f)).unwrap_or_default();
    (read("cd"), read("argv"))
}

fn nul_joined<'a>(words: impl IntoIterator<Item = &'a [u8]>) -> Vec<u8> {
    words
        .into_iter()
        .flat_map(|w| w.iter().copied().chain([0]))
        .collect()
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 200, ..ProptestConfig::default() })]

    #[test]
    fn hostile_values_are_refused_or_stay_on_their_line(h in hostile_request()) {
        let dir = tempfile::tempdir().unwrap();
        let req = request(&h, dir.path());
        let script = match batch_script(&req, &h.exclude) {
            Err(e) => {
                prop_assert!(must_refuse(&req, &h.exclude), "refused {e} for {req:?}");
                prop_assert!(e.to_string().contains("control character") || e.to_string().contains("not UTF-8"), "{e}");
                return Ok(());
            }
            Ok(s) => s,
        };
        prop_assert!(!must_refuse(&req, &h.exclude), "accepted {req:?}:\n{script}");
        // Every line is a comment/directive, or one of the script's own commands.
        let commands: Vec<&str> = script.lines().filter(|l| !l.starts_with('#') && !l.is_empty()).collect();
        let expected = if h.pbs { 4 } else { 3 };
        prop_assert_eq!(commands.len(), expected, "{}", script);
        prop_assert_eq!(commands[0], "set -u");
        prop_assert!(commands[expected - 2].starts_with("cd "));
        prop_assert!(commands[expected - 1].starts_with("exec "));
        // And bash runs exactly the argv kiln meant, with nothing else run.
        let (cd, argv) = run_script(dir.path(), &script);
        prop_assert_eq!(cd, nul_joined([req.workdir.as_os_str().as_bytes()]));
        let want = launch_argv(&req).expect("the script was written, so its argv was");
        prop_assert_eq!(argv, nul_joined(want.iter().map(|a| a.as_bytes())));
        prop_assert!(!dir.path().join("PWNED").exists());
    }
}

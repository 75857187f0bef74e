//! `kiln submit`: the Slurm and PBS scripts (`--dry-run`), submission through a stand-in
//! `qsub` (no PBS can be installed here: OpenPBS/Torque have no Debian package), flag errors,
//! and PBS_NODEFILE handling with quarantined hosts and spares. Real Slurm submission and
//! chaining are in tests/slurm.rs.

use std::path::Path;
use std::process::Command;

use crate::common;
use common::KILN;

fn kiln(args: &[&str]) -> Command {
    common::kiln_cmd(args)
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

fn s(p: &Path) -> String {
    p.display().to_string()
}

fn quarantine(run: &Path, host: &str) {
    std::fs::create_dir_all(run).unwrap();
    let line = format!(
        "{{\"time\":1.0,\"host\":\"{host}\",\"cause\":\"node-failure\",\"evidence\":\"srun: error: Node failure on {host}\"}}\n"
    );
    std::fs::write(run.join("quarantine.jsonl"), line).unwrap();
}

#[test]
fn dry_run_prints_the_slurm_script() {
    let dir = tempfile::tempdir().unwrap();
    let run = dir.path().join("run a");
    quarantine(&run, "n7");
    let out = kiln(&[
        "submit",
        "--scheduler",
        "slurm",
        "--nodes",
        "8",
        "--spares",
        "2",
        "--time",
        "2:00:00",
        "--chain",
        "5",
        "--account",
        "proj",
        "--queue",
        "debug",
        "--scheduler-arg=--gpus-per-node=4",
        "--launch-arg=--stall-timeout=300",
        "--run-dir",
        &s(&run),
        "--dry-run",
        "--",
        "kiln",
        "train",
        "--run-dir",
        &s(&run),
        "--set",
        "training.steps=1000",
    ])
    .output()
    .unwrap();
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    let script = text(&out.stdout);
    let r = s(&run);
    for line in [
        "#!/bin/bash".to_string(),
        "#SBATCH --nodes=10".into(),
        "#SBATCH --time=2:00:00".into(),
        "#SBATCH --signal=B:USR1@300".into(),
        "#SBATCH --no-kill".into(),
        "#SBATCH --exclude=n7".into(),
        "#SBATCH --account=proj".into(),
        "#SBATCH --partition=debug".into(),
        "#SBATCH --gpus-per-node=4".into(),
        format!("#SBATCH --output='{r}/job-%j.out'"),
        format!(
            "exec {KILN} launch --walltime=7100 --auto-retry --spares=2 --chain=5 '--chain-script={r}/job.sbatch' '--run-dir={r}' --stall-timeout=300 -- kiln train --run-dir '{r}' --set training.steps=1000"
        ),
    ] {
        assert!(script.contains(&line), "missing {line:?} in\n{script}");
    }
    assert!(!run.join("job.sbatch").exists(), "--dry-run writes nothing");
    // The script is valid shell.
    let check = Command::new("bash")
        .args(["-n", "-c", &script])
        .output()
        .unwrap();
    assert!(check.status.success(), "{}", text(&check.stderr));
}

#[test]
fn dry_run_prints_the_pbs_script() {
    let dir = tempfile::tempdir().unwrap();
    let run = dir.path().join("run");
    let out = kiln(&[
        "submit",
        "--scheduler",
        "pbs",
        "--nodes",
        "2",
        "--spares",
        "1",
        "--time",
        "1:00:00",
        "--queue",
        "debug",
        "--account",
        "proj",
        "--scheduler-arg=-l filesystems=home:flare",
        "--run-dir",
        &s(&run),
        "--dry-run",
        "--",
        "python3",
        "train.py",
    ])
    .output()
    .unwrap();
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    let script = text(&out.stdout);
    for line in [
        "#PBS -l select=3",
        "#PBS -l walltime=1:00:00",
        "#PBS -l place=scatter",
        "#PBS -q debug",
        "#PBS -A proj",
        "#PBS -l filesystems=home:flare",
        "--auto-retry --spares=1",
        // PBS sends no warning: kiln's own walltime stops the ranks 5 minutes early.
        "--walltime=3300",
        "-- python3 train.py",
    ] {
        assert!(script.contains(line), "missing {line:?} in\n{script}");
    }
    let check = Command::new("bash")
        .args(["-n", "-c", &script])
        .output()
        .unwrap();
    assert!(check.status.success(), "{}", text(&check.stderr));
}

#[test]
fn submit_goes_through_qsub_and_keeps_the_script() {
    let dir = tempfile::tempdir().unwrap();
    let bin = dir.path().join("bin");
    std::fs::create_dir_all(&bin).unwrap();
    let log = dir.path().join("qsub.args");
    // A stand-in, because no PBS can be installed here; it says so, records its arguments and
    // answers with a job id as qsub does.
    let qsub = format!(
        "#!/bin/sh\necho 'stand-in qsub for tests: not PBS' >&2\nprintf '%s\\n' \"$@\" > '{}'\necho 1234.pbs-standin\n",
        s(&log)
    );
    std::fs::write(bin.join("qsub"), qsub).unwrap();
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(bin.join("qsub"), std::fs::Permissions::from_mode(0o755)).unwrap();
    let run = dir.path().join("run");
    let path = format!("{}:{}", s(&bin), std::env::var("PATH").unwrap_or_default());
    let out = kiln(&[
        "submit",
        "--scheduler",
        "pbs",
        "--nodes",
        "1",
        "--time",
        "10:00",
        "--chain",
        "3",
        "--run-dir",
        &s(&run),
        "--",
        "true",
    ])
    .env("PATH", &path)
    .output()
    .unwrap();
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    assert!(
        text(&out.stdout).contains("submitted job 1234.pbs-standin"),
        "{}",
        text(&out.stdout)
    );
    let args: Vec<String> = std::fs::read_to_string(&log)
        .unwrap()
        .lines()
        .map(String::from)
        .collect();
    assert_eq!(args, ["-v", "KILN_CHAIN_INDEX=1", &s(&run.join("job.pbs"))]);
    let script = std::fs::read_to_string(run.join("job.pbs")).unwrap();
    assert!(script.contains("--chain=3"), "{script}");
    let ev = kiln_run::read_events(&run).unwrap();
    let sub = ev.iter().find(|e| e.event == "job_submitted").unwrap();
    assert_eq!(sub.fields["job_id"], "1234.pbs-standin");
    assert_eq!(sub.fields["chain_index"], 1);
    // A scheduler that refuses: exit 1 with its words.
    std::fs::write(
        bin.join("qsub"),
        "#!/bin/sh\necho 'qsub: Unknown queue' >&2\nexit 3\n",
    )
    .unwrap();
    let out = kiln(&[
        "submit",
        "--scheduler",
        "pbs",
        "--nodes",
        "1",
        "--time",
        "10:00",
        "--run-dir",
        &s(&run),
        "--",
        "true",
    ])
    .env("PATH", &path)
    .output()
    .unwrap();
    assert_eq!(out.status.code(), Some(1));
    assert!(
        text(&out.stderr).contains("Unknown queue"),
        "{}",
        text(&out.stderr)
    );
}

#[test]
fn bad_submit_flags_are_usage_errors() {
    let dir = tempfile::tempdir().unwrap();
    let run = s(&dir.path().join("run"));
    for (flags, needle) in [
        (&["--time", "30"][..], "1 minute"),
        (&["--time", "soon"][..], "--time"),
        (&["--time", "1e300"][..], "--time"),
        (
            &["--time", "1:00:00", "--nodes", "0"][..],
            "--nodes must be at least 1",
        ),
        (&["--time", "1:00:00", "--chain", "0"][..], "--chain"),
        (
            &["--time", "1:00", "--signal-lead", "50"][..],
            "--signal-lead",
        ),
    ] {
        let mut args = vec![
            "submit",
            "--scheduler",
            "slurm",
            "--run-dir",
            &run,
            "--dry-run",
        ];
        if !flags.contains(&"--nodes") {
            args.extend(["--nodes", "1"]);
        }
        args.extend_from_slice(flags);
        args.extend(["--", "true"]);
        let out = kiln(&args).output().unwrap();
        assert_eq!(
            out.status.code(),
            Some(2),
            "{flags:?}: {}",
            text(&out.stderr)
        );
        assert!(
            text(&out.stderr).contains(needle),
            "{flags:?}: {}",
            text(&out.stderr)
        );
    }
}

#[test]
fn pbs_nodefile_with_a_quarantined_host_and_spares() {
    let dir = tempfile::tempdir().unwrap();
    let nodefile = dir.path().join("nodefile");
    std::fs::write(&nodefile, "x1\nx2\nx3\nx4\n").unwrap();
    let run = dir.path().join("run");
    quarantine(&run, "x2");
    let out = kiln(&[
        "launch",
        "--dry-run",
        "--auto-retry",
        "--ppn",
        "2",
        "--run-dir",
        &s(&run),
        "--",
        "python3",
        "train.py",
    ])
    .env("PBS_JOBID", "9.pbs")
    .env("PBS_NODEFILE", &nodefile)
    .output()
    .unwrap();
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    let stdout = text(&out.stdout);
    assert!(stdout.contains("hosts:        x1,x3 "), "{stdout}");
    assert!(
        stdout.contains("spares:       x4; quarantined: x2"),
        "{stdout}"
    );
    assert!(stdout.contains("would contain \"x1\\nx3\\n\""), "{stdout}");
    assert!(
        stdout.contains("\"-n\",\"4\",\"-ppn\",\"2\",\"--hostfile\""),
        "{stdout}"
    );
}

/// The example: a run directory with a newline broke out of the script's comment line
/// and `bash job.pbs` ran `touch PWNED`. Values written bare into directives and comments are
/// refused; values on the command line are quoted onto one line and reach the program intact.
#[test]
fn hostile_values_cannot_inject_commands_into_the_batch_script() {
    let dir = tempfile::tempdir().unwrap();
    let injection = "x\ntouch PWNED\n#";
    let run = format!("runs/{injection}");
    for scheduler in ["pbs", "slurm"] {
        for (flag, value) in [
            ("--run-dir", run.as_str()),
            ("--account", injection),
            ("--job-name", injection),
            ("--queue", injection),
            ("--scheduler-arg", injection),
        ] {
            let mut args = vec!["submit", "--scheduler", scheduler, "--nodes", "1"];
            args.extend(["--time", "2:00", "--dry-run", flag, value]);
            if flag != "--run-dir" {
                args.extend(["--run-dir", "runs/ok"]);
            }
            args.extend(["--", "/bin/echo", "hi"]);
            let out = kiln(&args).current_dir(dir.path()).output().unwrap();
            let err = text(&out.stderr);
            assert_eq!(out.status.code(), Some(2), "{flag}: {err}");
            assert!(
                err.contains(flag) && err.contains("control character"),
                "{flag}: {err}"
            );
            assert!(out.stdout.is_empty(), "{flag}: a script was printed");
        }
    }
    // On the command line a newline and `$(...)` are data: the script runs the real kiln
    // launch, which hands the program exactly the argument given, and nothing else runs.
    let arg = "hi\n$(touch PWNED)`touch PWNED`'";
    let out = kiln(&[
        "submit",
        "--scheduler",
        "pbs",
        "--nodes",
        "1",
        "--spares",
        "0",
        "--time",
        "2:00",
        "--dry-run",
        "--run-dir",
        "runs/ok",
        "--",
        "/bin/sh",
        "-c",
        "printf %s \"$1\" > got",
        "sh",
        arg,
    ])
    .current_dir(dir.path())
    .output()
    .unwrap();
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    let script = text(&out.stdout);
    assert!(script.lines().all(|l| !l.starts_with("touch")), "{script}");
    std::fs::write(dir.path().join("s"), &script).unwrap();
    let mut bash = Command::new("bash");
    bash.arg("s").current_dir(dir.path());
    for v in common::DETECTED {
        bash.env_remove(v);
    }
    let status = bash.status().unwrap();
    assert!(status.success(), "{script}");
    assert!(!dir.path().join("PWNED").exists(), "the script ran touch");
    assert_eq!(
        std::fs::read_to_string(dir.path().join("got")).unwrap(),
        arg
    );
}

//! Launcher argv for PBS, Slurm, mpirun and local spawns, from given environments and
//! hostfiles, checked against the exact expected lists.

use kiln_launch::{LaunchOptions, LaunchRequest, Launcher, prepare};
use std::collections::HashMap;
use std::path::{Path, PathBuf};

fn env(pairs: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> + use<> {
    let map: HashMap<String, String> = pairs
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    move |k| map.get(k).cloned()
}

fn no_gpu_tools(_: &str, _: &[&str]) -> Option<String> {
    None
}

fn opts(run_dir: &Path) -> LaunchOptions {
    LaunchOptions {
        rank_shim: vec![
            "/opt/kiln".into(),
            "launch".into(),
            "--as-rank".into(),
            "--".into(),
        ],
        command: vec!["python".into(), "-m".into(), "torchtitan.train".into()],
        request: LaunchRequest {
            master_port: Some(29500),
            ..LaunchRequest::default()
        },
        progress_dir: run_dir.join("progress"),
        run_dir: run_dir.to_path_buf(),
        ..LaunchOptions::default()
    }
}

fn strs(v: &[&str]) -> Vec<String> {
    v.iter().map(|s| s.to_string()).collect()
}

fn tail() -> Vec<String> {
    strs(&[
        "/opt/kiln",
        "launch",
        "--as-rank",
        "--",
        "python",
        "-m",
        "torchtitan.train",
    ])
}

#[test]
fn pbs_uses_mpiexec_with_the_nodefile_and_gpus_per_node() {
    let dir = tempfile::tempdir().unwrap();
    let nodefile = dir.path().join("nodefile");
    std::fs::write(
        &nodefile,
        "x4000c0s0b0n0\nx4000c0s0b0n0\nx4000c0s1b0n0\nx4000c0s1b0n0\n",
    )
    .unwrap();
    let nf = nodefile.display().to_string();
    let vars = env(&[
        ("PBS_JOBID", "42.aurora"),
        ("PBS_NODEFILE", &nf),
        ("ZE_AFFINITY_MASK", "0,1,2,3,4,5"),
    ]);
    let mut o = opts(dir.path());
    o.launcher_args = strs(&["--no-vni"]);
    let s = prepare(&o, &vars, &no_gpu_tools, 96, false).unwrap();
    assert_eq!(s.launcher, Launcher::Mpiexec);
    assert_eq!((s.sizes.np, s.sizes.ppn, s.sizes.nnodes), (12, 6, 2));
    let mut want = strs(&[
        "mpiexec",
        "--envall",
        "-n",
        "12",
        "-ppn",
        "6",
        "--hostfile",
        &nf,
        "--cpu-bind",
        "depth",
        "-d",
        "16",
        "--no-vni",
    ]);
    want.extend(tail());
    assert_eq!(s.procs.len(), 1);
    assert_eq!(s.procs[0].argv, want);
    let env: HashMap<_, _> = s.procs[0].env.iter().cloned().collect();
    assert_eq!(env["MASTER_ADDR"], "x4000c0s0b0n0");
    assert_eq!(env["MASTER_PORT"], "29500");
    assert_eq!(
        env["KILN_PROGRESS_DIR"],
        dir.path().join("progress").display().to_string()
    );
}

#[test]
fn pbs_with_fewer_nodes_writes_a_trimmed_hostfile() {
    let dir = tempfile::tempdir().unwrap();
    let nodefile = dir.path().join("nodefile");
    std::fs::write(&nodefile, "a\nb\nc\n").unwrap();
    let nf = nodefile.display().to_string();
    let vars = env(&[("PBS_JOBID", "1"), ("PBS_NODEFILE", &nf)]);
    let mut o = opts(dir.path());
    (o.request.np, o.request.ppn, o.request.nnodes) = (Some(4), Some(2), None);
    o.request.cpu_bind = Some("none".into());
    let s = prepare(&o, &vars, &no_gpu_tools, 8, false).unwrap();
    let written: PathBuf = dir.path().join("hostfile");
    assert_eq!(
        s.hostfile_to_write,
        Some((written.clone(), "a\nb\n".to_string()))
    );
    let mut want = strs(&[
        "mpiexec",
        "--envall",
        "-n",
        "4",
        "-ppn",
        "2",
        "--hostfile",
        &written.display().to_string(),
    ]);
    want.extend(tail());
    assert_eq!(s.procs[0].argv, want);
}

#[test]
fn slurm_uses_srun_with_expanded_nodes_and_gpus() {
    let dir = tempfile::tempdir().unwrap();
    let vars = env(&[
        ("SLURM_JOB_ID", "77"),
        ("SLURM_JOB_NODELIST", "nid[001-003,007]"),
        ("CUDA_VISIBLE_DEVICES", "0,1,2,3"),
    ]);
    let mut o = opts(dir.path());
    o.request.cpu_bind = Some("cores".into());
    let s = prepare(&o, &vars, &no_gpu_tools, 64, false).unwrap();
    assert_eq!(s.used_hosts, ["nid001", "nid002", "nid003", "nid007"]);
    let mut want = strs(&[
        "srun",
        "--nodes=4",
        "--ntasks=16",
        "--ntasks-per-node=4",
        "--gpus-per-node=4",
        "--cpu-bind=cores",
        "--kill-on-bad-exit=1",
        "--overlap",
    ]);
    want.extend(tail());
    assert_eq!(s.procs[0].argv, want);
    assert!(
        s.procs[0]
            .env
            .contains(&("MASTER_ADDR".into(), "nid001".into()))
    );
}

#[test]
fn slurm_with_a_hostfile_and_nnodes_names_the_nodes() {
    let dir = tempfile::tempdir().unwrap();
    let hostfile = dir.path().join("hosts");
    std::fs::write(
        &hostfile,
        "# spares last\ng1 slots=8\ng2 slots=8\ng3 slots=8\n",
    )
    .unwrap();
    let vars = env(&[("SLURM_JOB_ID", "77"), ("SLURM_JOB_NODELIST", "g[1-3]")]);
    let mut o = opts(dir.path());
    o.request.topology.hostfile = Some(hostfile);
    (o.request.np, o.request.ppn, o.request.nnodes) = (None, Some(2), Some(2));
    o.request.topology.gpus_per_node = Some(0);
    let s = prepare(&o, &vars, &no_gpu_tools, 64, false).unwrap();
    let mut want = strs(&[
        "srun",
        "--nodes=2",
        "--ntasks=4",
        "--ntasks-per-node=2",
        "--nodelist=g1,g2",
        "--kill-on-bad-exit=1",
        "--overlap",
    ]);
    want.extend(tail());
    assert_eq!(s.procs[0].argv, want);
}

#[test]
fn mpirun_without_scheduler_forwards_variables_and_consents_as_root() {
    let dir = tempfile::tempdir().unwrap();
    let mut o = opts(dir.path());
    o.request.topology.mpi = true;
    (o.request.np, o.request.ppn, o.request.nnodes) = (Some(4), None, None);
    o.launcher_args = strs(&["--mca", "btl", "self,tcp"]);
    let s = prepare(&o, &env(&[]), &no_gpu_tools, 2, true).unwrap();
    let mut want = strs(&[
        "mpirun",
        "-np",
        "4",
        "--oversubscribe",
        "-x",
        "MASTER_ADDR",
        "-x",
        "MASTER_PORT",
        "-x",
        "KILN_PROGRESS_DIR",
        "-x",
        "KILN_ATTEMPT",
        "-x",
        "PYTHONUNBUFFERED",
        "--mca",
        "btl",
        "self,tcp",
    ]);
    want.extend(tail());
    assert_eq!(s.procs[0].argv, want);
    assert!(
        s.procs[0]
            .env
            .contains(&("OMPI_ALLOW_RUN_AS_ROOT".into(), "1".into()))
    );
    assert!(
        s.procs[0]
            .env
            .contains(&("MASTER_ADDR".into(), "127.0.0.1".into()))
    );
    // Every attempt exports its own token (the shims' records carry it).
    let token = |procs: &[kiln_launch::ProcSpec]| {
        procs[0]
            .env
            .iter()
            .find(|(k, _)| k == "KILN_ATTEMPT")
            .map(|(_, v)| v.clone())
            .expect("KILN_ATTEMPT exported")
    };
    let again = prepare(&o, &env(&[]), &no_gpu_tools, 2, true).unwrap();
    assert_ne!(token(&s.procs), token(&again.procs));
}

#[test]
fn local_spawn_gives_each_rank_its_variables() {
    let dir = tempfile::tempdir().unwrap();
    let mut o = opts(dir.path());
    (o.request.np, o.request.ppn, o.request.nnodes) = (Some(3), None, None);
    let s = prepare(&o, &env(&[]), &no_gpu_tools, 2, false).unwrap();
    assert_eq!(s.procs.len(), 3);
    for (r, p) in s.procs.iter().enumerate() {
        assert_eq!(p.argv, strs(&["python", "-m", "torchtitan.train"]));
        let e: HashMap<_, _> = p.env.iter().cloned().collect();
        assert_eq!(e["RANK"], r.to_string());
        assert_eq!(e["LOCAL_RANK"], r.to_string());
        assert_eq!(e["WORLD_SIZE"], "3");
        assert_eq!(e["LOCAL_WORLD_SIZE"], "3");
    }
}

#[test]
fn actionable_errors() {
    let dir = tempfile::tempdir().unwrap();
    let bad = dir.path().join("bad-hosts");
    std::fs::write(&bad, "n1\nn2 slots=two\n").unwrap();
    let mut o = opts(dir.path());
    o.request.topology.hostfile = Some(bad.clone());
    o.request.topology.mpi = true;
    let e = prepare(&o, &env(&[]), &no_gpu_tools, 2, false)
        .unwrap_err()
        .to_string();
    assert!(e.contains("bad-hosts") && e.contains("line 2"), "{e}");

    let empty = dir.path().join("empty-hosts");
    std::fs::write(&empty, "\n# none\n").unwrap();
    o.request.topology.hostfile = Some(empty);
    let e = prepare(&o, &env(&[]), &no_gpu_tools, 2, false)
        .unwrap_err()
        .to_string();
    assert!(e.contains("empty-hosts") && e.contains("no hosts"), "{e}");

    let mut o = opts(dir.path());
    (o.request.np, o.request.ppn, o.request.nnodes) = (Some(2), Some(1), None);
    let e = prepare(&o, &env(&[]), &no_gpu_tools, 2, false)
        .unwrap_err()
        .to_string();
    assert!(e.contains("--np 2 with --ppn 1"), "{e}");

    let mut o = opts(dir.path());
    o.launcher_args = strs(&["--bind-to", "core"]);
    let e = prepare(&o, &env(&[]), &no_gpu_tools, 2, false)
        .unwrap_err()
        .to_string();
    assert!(e.contains("no launcher runs"), "{e}");

    let vars = env(&[("SLURM_JOB_ID", "1"), ("SLURM_JOB_NODELIST", "n[1-")]);
    let e = prepare(&opts(dir.path()), &vars, &no_gpu_tools, 2, false)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("SLURM_JOB_NODELIST") && e.contains("never closed"),
        "{e}"
    );
}

#[test]
fn node_scope_keeps_spares_and_replans_for_a_swapped_host() {
    let dir = tempfile::tempdir().unwrap();
    let vars = env(&[("SLURM_JOB_ID", "5"), ("SLURM_JOB_NODELIST", "n[1-4]")]);
    let mut o = opts(dir.path());
    o.request.auto_retry = true;
    o.exclude = vec!["n2".into()];
    let s = prepare(&o, &vars, &no_gpu_tools, 2, false).unwrap();
    // n2 is quarantined; of n1, n3, n4 one (2 %, at least 1) is a spare.
    assert_eq!(s.used_hosts, ["n1", "n3"]);
    assert_eq!(
        s.spares.iter().map(|h| h.name.as_str()).collect::<Vec<_>>(),
        ["n4"]
    );
    assert_eq!(s.excluded, ["n2"]);
    assert!(
        s.procs[0].argv.contains(&"--nodelist=n1,n3".to_string()),
        "{:?}",
        s.procs[0].argv
    );
    let swapped = [s.active[0].clone(), s.spares[0].clone()];
    let p = s.plan_for(&swapped).unwrap();
    assert!(p.procs[0].argv.contains(&"--nodelist=n1,n4".to_string()));
    assert!(p.procs[0].argv.contains(&"--ntasks=2".to_string()));
    // Fewer hosts: fewer ranks, same ranks per node.
    let p = s.plan_for(&swapped[..1]).unwrap();
    assert!(p.procs[0].argv.contains(&"--ntasks=1".to_string()));
    // --spares explicit; --nnodes leaves the rest as spares.
    o.exclude.clear();
    o.request.spares = Some(2);
    let s = prepare(&o, &vars, &no_gpu_tools, 2, false).unwrap();
    assert_eq!((s.used_hosts.len(), s.spares.len()), (2, 2));
    o.request.spares = None;
    o.request.nnodes = Some(3);
    let s = prepare(&o, &vars, &no_gpu_tools, 2, false).unwrap();
    assert_eq!((s.used_hosts.len(), s.spares.len()), (3, 1));
    o.request.nnodes = None;
    o.request.spares = Some(4);
    let e = prepare(&o, &vars, &no_gpu_tools, 2, false)
        .unwrap_err()
        .to_string();
    assert!(e.contains("--spares 4 leaves no active host"), "{e}");
}

#[test]
fn absurd_sizes_and_ports_are_refused_before_anything_starts() {
    let dir = tempfile::tempdir().unwrap();
    type Edit = Box<dyn Fn(&mut LaunchOptions)>;
    let cases: Vec<(Edit, &str)> = vec![
        (Box::new(|o| o.request.np = Some(1usize << 32)), "at most"),
        (
            Box::new(|o| o.request.topology.gpus_per_node = Some(1usize << 32)),
            "--gpus-per-node",
        ),
        (Box::new(|o| o.request.ppn = Some(5000)), "--ppn 5000"),
        (
            Box::new(|o| o.request.np = Some(100_000)),
            "--oversubscribe",
        ),
        (
            Box::new(|o| o.request.master_port = Some(0)),
            "--master-port 0",
        ),
    ];
    for (edit, needle) in cases {
        let mut o = opts(dir.path());
        edit(&mut o);
        let e = prepare(&o, &env(&[]), &no_gpu_tools, 2, false)
            .unwrap_err()
            .to_string();
        assert!(e.contains(needle), "{needle}: {e}");
    }
    let mut o = opts(dir.path());
    o.request.np = Some(100);
    o.request.oversubscribe = true;
    assert_eq!(
        prepare(&o, &env(&[]), &no_gpu_tools, 2, false)
            .unwrap()
            .procs
            .len(),
        100
    );
    // Under a scheduler the local CPU count does not cap the ranks.
    let vars = env(&[("SLURM_JOB_ID", "5"), ("SLURM_JOB_NODELIST", "n[1-1000]")]);
    let mut o = opts(dir.path());
    o.request.ppn = Some(8);
    assert_eq!(
        prepare(&o, &vars, &no_gpu_tools, 2, false)
            .unwrap()
            .sizes
            .np,
        8000
    );
    let vars = env(&[("CUDA_VISIBLE_DEVICES", "GPU-zzz,,%%")]);
    let e = prepare(&opts(dir.path()), &vars, &no_gpu_tools, 2, false)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("CUDA_VISIBLE_DEVICES") && e.contains("GPU-zzz"),
        "{e}"
    );
}

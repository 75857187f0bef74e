//! A real Slurm cluster for tests: Debian's slurm-wlm daemons (`slurmctld`, one `slurmd` per
//! fake node), all on this machine, as root, without munge or systemd. Each cluster has its
//! own directory, config, state and port range, so tests run in parallel; dropping it cancels
//! its jobs and stops only the processes it started (daemons by PID, job-step daemons by the
//! cluster's own `SLURM_CONF` in their environment).
//!
//! Settings (verified with slurm-wlm 22.05): `AuthType=auth/none` + `CredType=cred/none`;
//! fake nodes `NodeName=nI NodeHostname=localhost NodeAddr=127.0.0.1 Port=<own>` with `%n` in
//! the slurmd paths and `SlurmdParameters=config_overrides`; `batch_sched_delay=0,bf_interval=1`,
//! `AuthInfo=cred_expire=5` (a requeued job restarts in seconds), `ReturnToService=1`,
//! `MinJobAge=600`, `JobCompType=jobcomp/filetxt` (no slurmdbd, so no sacct); MPI jobs
//! through `MpiDefault=pmix` with `TmpFS=<dir>/tmp-%n` (the PMIx plugin's per-step directory
//! would collide between fake nodes in one /tmp).

use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

/// A running test cluster.
pub struct Cluster {
    pub dir: tempfile::TempDir,
    pub conf: PathBuf,
    pub nodes: Vec<String>,
    daemons: Vec<Child>,
}

static NEXT: AtomicU32 = AtomicU32::new(0);

/// `n` consecutive TCP ports free on 127.0.0.1 now, below the kernel's ephemeral range and
/// different for every cluster of this process.
fn free_ports(n: u16) -> u16 {
    for _ in 0..200 {
        let seed = std::process::id()
            .wrapping_mul(2_654_435_761)
            .wrapping_add(NEXT.fetch_add(1, Ordering::SeqCst).wrapping_mul(97))
            .wrapping_add(
                std::time::SystemTime::now()
                    .duration_since(std::time::UNIX_EPOCH)
                    .map_or(0, |d| d.subsec_nanos()),
            );
        let base = 12_000 + (seed % 1_800) as u16 * 10;
        if (0..n).all(|i| TcpListener::bind(("127.0.0.1", base + i)).is_ok()) {
            return base;
        }
    }
    panic!("no free port range for a test Slurm cluster");
}

fn require(tool: &str) {
    let found = std::env::var_os("PATH")
        .map(|p| std::env::split_paths(&p).any(|d| d.join(tool).is_file()))
        .unwrap_or(false)
        || Path::new("/usr/sbin").join(tool).is_file();
    assert!(
        found,
        "{tool} not found: install Slurm (Debian: apt-get install -y slurm-wlm; .ci/run does)"
    );
}

fn sbin(tool: &str) -> PathBuf {
    let p = Path::new("/usr/sbin").join(tool);
    if p.is_file() { p } else { PathBuf::from(tool) }
}

impl Cluster {
    /// Starts `n` nodes of `cpus` CPUs each and waits until they are idle.
    pub fn start(n: usize, cpus: usize) -> Cluster {
        Self::start_with_kill_wait(n, cpus, 5)
    }

    /// [`Cluster::start`] with Slurm's `KillWait` (how long a step's processes may outlive
    /// their srun before slurmd kills them) set to `kill_wait` seconds.
    pub fn start_with_kill_wait(n: usize, cpus: usize, kill_wait: u32) -> Cluster {
        for t in ["slurmctld", "slurmd", "sbatch", "srun", "scontrol"] {
            require(t);
        }
        let dir = tempfile::Builder::new()
            .prefix("kiln-slurm-")
            .tempdir()
            .unwrap();
        let d = dir.path();
        std::fs::create_dir_all(d.join("state")).unwrap();
        let base = free_ports(n as u16 + 1);
        let name = format!("k{}", base);
        let mut conf = format!(
            "ClusterName={name}\n\
             SlurmctldHost=localhost\n\
             SlurmctldPort={base}\n\
             AuthType=auth/none\n\
             CredType=cred/none\n\
             AuthInfo=cred_expire=5\n\
             SlurmUser=root\n\
             SlurmdUser=root\n\
             StateSaveLocation={d}/state\n\
             SlurmctldPidFile={d}/slurmctld.pid\n\
             SlurmctldLogFile={d}/slurmctld.log\n\
             SlurmdSpoolDir={d}/spool-%n\n\
             SlurmdPidFile={d}/slurmd-%n.pid\n\
             SlurmdLogFile={d}/slurmd-%n.log\n\
             SlurmdParameters=config_overrides\n\
             ProctrackType=proctrack/linuxproc\n\
             TaskPlugin=task/none\n\
             MpiDefault=pmix\n\
             TmpFS={d}/tmp-%n\n\
             SchedulerType=sched/backfill\n\
             SchedulerParameters=batch_sched_delay=0,bf_interval=1\n\
             SelectType=select/linear\n\
             ReturnToService=1\n\
             MinJobAge=600\n\
             KillWait={kill_wait}\n\
             InactiveLimit=0\n\
             JobCompType=jobcomp/filetxt\n\
             JobCompLoc={d}/jobcomp.txt\n",
            d = d.display()
        );
        let nodes: Vec<String> = (1..=n).map(|i| format!("n{i}")).collect();
        // Per-node temporary directories: Slurm's PMIx plugin (MPI jobs) keeps one per job
        // step in TmpFS, and the fake nodes share one machine.
        for node in &nodes {
            std::fs::create_dir_all(d.join(format!("tmp-{node}"))).unwrap();
        }
        for (i, node) in nodes.iter().enumerate() {
            conf.push_str(&format!(
                "NodeName={node} NodeHostname=localhost NodeAddr=127.0.0.1 Port={} CPUs={cpus}\n",
                base + 1 + i as u16
            ));
        }
        conf.push_str("PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP\n");
        let conf_path = d.join("slurm.conf");
        std::fs::write(&conf_path, conf).unwrap();
        let mut cluster = Cluster {
            conf: conf_path.clone(),
            nodes,
            daemons: Vec::new(),
            dir,
        };
        let ctld = cluster.daemon(
            Command::new(sbin("slurmctld"))
                .args(["-D", "-c", "-f"])
                .arg(&conf_path),
            "slurmctld",
        );
        cluster.daemons.push(ctld);
        for node in cluster.nodes.clone() {
            let child = cluster.daemon(
                Command::new(sbin("slurmd"))
                    .args(["-D", "-N", &node, "-f"])
                    .arg(&conf_path),
                &node,
            );
            cluster.daemons.push(child);
        }
        cluster.wait_idle(Duration::from_secs(30));
        cluster
    }

    fn daemon(&self, cmd: &mut Command, name: &str) -> Child {
        let log = std::fs::File::create(self.dir.path().join(format!("{name}.out"))).unwrap();
        let err = log.try_clone().unwrap();
        cmd.env("SLURM_CONF", &self.conf)
            .stdin(Stdio::null())
            .stdout(log)
            .stderr(err);
        use std::os::unix::process::CommandExt;
        // Its own session: no test pipe or terminal is held by the daemon.
        // SAFETY: setsid is async-signal-safe and the child owns no locks after fork.
        unsafe {
            cmd.pre_exec(|| {
                libc::setsid();
                Ok(())
            });
        }
        cmd.spawn()
            .unwrap_or_else(|e| panic!("starting {name}: {e}"))
    }

    /// A command with this cluster's `SLURM_CONF`.
    pub fn cmd(&self, program: &str) -> Command {
        let mut c = Command::new(program);
        c.env("SLURM_CONF", &self.conf);
        c
    }

    /// Runs a Slurm client command; its stdout (panics with stderr on failure).
    pub fn run(&self, program: &str, args: &[&str]) -> String {
        let out = self.cmd(program).args(args).output().unwrap();
        assert!(
            out.status.success(),
            "{program} {args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    fn wait_idle(&self, limit: Duration) {
        let until = Instant::now() + limit;
        loop {
            let out = self
                .cmd("sinfo")
                .args(["-h", "-N", "-o", "%N %T"])
                .output()
                .ok();
            let text = out
                .map(|o| String::from_utf8_lossy(&o.stdout).into_owned())
                .unwrap_or_default();
            let idle = text.lines().filter(|l| l.ends_with(" idle")).count();
            if idle == self.nodes.len() {
                return;
            }
            assert!(
                Instant::now() < until,
                "the test cluster did not come up: {text}\n{}",
                std::fs::read_to_string(self.dir.path().join("slurmctld.out")).unwrap_or_default()
            );
            std::thread::sleep(Duration::from_millis(200));
        }
    }

    /// Takes a node down (its job steps are killed; a `--no-kill` job goes on without it).
    pub fn down(&self, node: &str) {
        self.run(
            "scontrol",
            &[
                "update",
                &format!("nodename={node}"),
                "state=down",
                "reason=kiln-test",
            ],
        );
    }

    /// `scontrol show job ID -o` as `Key=Value` pairs.
    pub fn job(&self, id: &str) -> std::collections::HashMap<String, String> {
        let out = self
            .cmd("scontrol")
            .args(["show", "job", id, "-o"])
            .output()
            .unwrap();
        String::from_utf8_lossy(&out.stdout)
            .split_whitespace()
            .filter_map(|kv| kv.split_once('='))
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    /// Waits until job `id` reached a final state; returns it.
    pub fn wait_job(&self, id: &str, limit: Duration) -> String {
        let until = Instant::now() + limit;
        loop {
            let state = self.job(id).get("JobState").cloned().unwrap_or_default();
            if [
                "COMPLETED",
                "FAILED",
                "CANCELLED",
                "TIMEOUT",
                "NODE_FAIL",
                "OUT_OF_MEMORY",
            ]
            .contains(&state.as_str())
            {
                return state;
            }
            assert!(
                Instant::now() < until,
                "job {id} still {state:?} after {limit:?}"
            );
            std::thread::sleep(Duration::from_millis(250));
        }
    }

    /// Job ids of this cluster that are not finished.
    fn live_jobs(&self) -> Vec<String> {
        let out = self.cmd("squeue").args(["-h", "-o", "%i"]).output();
        out.map(|o| {
            String::from_utf8_lossy(&o.stdout)
                .lines()
                .map(|l| l.trim().to_string())
                .filter(|l| !l.is_empty())
                .collect()
        })
        .unwrap_or_default()
    }

    /// PIDs of processes started by this cluster's daemons (job steps and their tasks),
    /// recognised by this cluster's `SLURM_CONF` in their environment.
    fn cluster_processes(&self) -> Vec<i32> {
        let needle = format!("SLURM_CONF={}", self.conf.display());
        let me = std::process::id() as i32;
        let daemons: Vec<i32> = self.daemons.iter().map(|c| c.id() as i32).collect();
        std::fs::read_dir("/proc")
            .map(|rd| {
                rd.filter_map(Result::ok)
                    .filter_map(|e| e.file_name().to_str()?.parse::<i32>().ok())
                    .filter(|&pid| pid != me && !daemons.contains(&pid))
                    .filter(|pid| {
                        std::fs::read(format!("/proc/{pid}/environ"))
                            .map(|env| env.split(|&b| b == 0).any(|v| v == needle.as_bytes()))
                            .unwrap_or(false)
                    })
                    .collect()
            })
            .unwrap_or_default()
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        let jobs = self.live_jobs();
        if !jobs.is_empty() {
            let _ = self.cmd("scancel").args(&jobs).output();
            let until = Instant::now() + Duration::from_secs(10);
            while !self.live_jobs().is_empty() && Instant::now() < until {
                std::thread::sleep(Duration::from_millis(200));
            }
        }
        for c in &mut self.daemons {
            // SAFETY: kill(2) on a child we spawned.
            unsafe { libc::kill(c.id() as i32, libc::SIGTERM) };
        }
        let until = Instant::now() + Duration::from_secs(5);
        for c in &mut self.daemons {
            while c.try_wait().ok().flatten().is_none() && Instant::now() < until {
                std::thread::sleep(Duration::from_millis(50));
            }
            let _ = c.kill();
            let _ = c.wait();
        }
        for pid in self.cluster_processes() {
            // SAFETY: kill(2) on a process this cluster started.
            unsafe { libc::kill(pid, libc::SIGKILL) };
        }
    }
}

/// Waits until `cond` holds, polling; panics with `what` after `limit`.
pub fn wait_until(limit: Duration, what: &str, mut cond: impl FnMut() -> bool) {
    let until = Instant::now() + limit;
    while !cond() {
        assert!(Instant::now() < until, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// The stand-in rank program of the Slurm tests: rank 0 runs `train` alone (WORLD_SIZE=1),
/// the other ranks follow its progress beacon, so a fault on any node looks like a real
/// job's. Each rank records its PID in `dir` so a test can stop it.
pub fn standin_rank_script(dir: &Path, train: &[String]) -> PathBuf {
    let quoted: Vec<String> = train.iter().map(|a| format!("'{a}'")).collect();
    let script = format!(
        r#"#!/bin/sh
echo $$ > "{pids}/rank-$RANK"
if [ "$RANK" = 0 ]; then
  exec env RANK=0 WORLD_SIZE=1 LOCAL_RANK=0 LOCAL_WORLD_SIZE=1 {train}
fi
while :; do
  set -- $(cat "$KILN_PROGRESS_DIR/rank-0" 2>/dev/null)
  step=${{1:-0}}; phase=${{2:-start}}
  printf '%s %s %s %s\n' "$step" "$phase" "$(date +%s.%N)" "$SLURMD_NODENAME" > "$KILN_PROGRESS_DIR/.f$RANK"
  mv -f "$KILN_PROGRESS_DIR/.f$RANK" "$KILN_PROGRESS_DIR/rank-$RANK"
  [ "$phase" = done ] && exit 0
  sleep 0.2
done
"#,
        pids = dir.display(),
        train = quoted.join(" ")
    );
    let path = dir.join("rank.sh");
    std::fs::write(&path, script).unwrap();
    path
}

/// Whether the Slurm tests train one model over MPI on every rank (built with `mpi`), or
/// rank 0 trains alone while the others stand in (the rank script).
pub const DATA_PARALLEL: bool = cfg!(feature = "mpi");

/// The PID of rank `rank`'s program: the trainer whose environment has RANK=<rank> (set by
/// `kiln launch --as-rank`), or the rank script's recorded PID.
pub fn rank_pid(dir: &Path, run: &Path, rank: usize) -> Option<i32> {
    if !DATA_PARALLEL {
        let text = std::fs::read_to_string(dir.join(format!("rank-{rank}"))).ok()?;
        return text.trim().parse().ok();
    }
    super::trainer_pid(run, rank)
}

/// `kiln submit --scheduler slurm ...` on `cluster`; returns the first job's id.
pub fn submit(cluster: &Cluster, run: &Path, flags: &[&str], command: &[String]) -> String {
    let mut c = cluster.cmd(super::KILN);
    c.args(["submit", "--scheduler", "slurm", "--run-dir"])
        .arg(run)
        .args(flags)
        .arg("--")
        .args(command);
    for v in [
        "SLURM_JOB_ID",
        "SLURM_JOBID",
        "PBS_JOBID",
        "KILN_PROGRESS_DIR",
        "RANK",
        "WORLD_SIZE",
    ] {
        c.env_remove(v);
    }
    let out = c.output().unwrap();
    assert!(
        out.status.success(),
        "kiln submit: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let ev = kiln_run::read_events(run).unwrap_or_default();
    let sub = ev
        .iter()
        .find(|e| e.event == "job_submitted")
        .expect("job_submitted");
    sub.fields["job_id"].as_str().unwrap().to_string()
}

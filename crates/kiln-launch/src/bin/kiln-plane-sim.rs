//! A job of many nodes on one machine, to measure kiln's control plane (`bench/launch/scale.sh`).
//!
//! `scale` runs kiln's real supervisor (`run_attempt`, the watch loop of `kiln launch`) in a
//! process of its own (`supervise`), and N simulated nodes (`node`), each a process with its own
//! `KILN_HOST` and M simulated ranks (threads that write beacons and liveness records as kiln's
//! trainer and rank shim do, at a step time). Under `--plane tcp` each node runs the real node
//! agent (it takes a seat as the shims do); under `--plane files` every rank writes into the run
//! directory and polls its stop file every 25 ms, as the shims of the old plane do. After the
//! warm-up one fault is injected (a rank stopped, killed, slowed, or a whole node with its agent
//! killed), and one JSON line says how long the supervisor took to end the attempt for it, whom
//! it named, its CPU share in steady state and the operations on the run directory a second
//! (counted with strace when asked).

use clap::{Parser, Subcommand};
use kiln_launch::plane::{node::Seat, server::Server};
use kiln_launch::{AttemptConfig, ProcSpec, run_attempt};
use std::path::{Path, PathBuf};
use std::process::{Child, Command};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

#[derive(Parser)]
struct Cli {
    #[command(subcommand)]
    role: Role,
}

#[derive(clap::Args, Clone, Debug)]
struct Job {
    /// Simulated nodes.
    #[arg(long, default_value_t = 4)]
    nodes: usize,
    /// Simulated ranks per node.
    #[arg(long, default_value_t = 12)]
    ranks_per_node: usize,
    /// `tcp` (node agents) or `files` (the run directory).
    #[arg(long, default_value = "tcp")]
    plane: String,
    /// `stop`, `kill`, `agent` or `straggler`.
    #[arg(long, default_value = "stop")]
    fault: String,
    /// Seconds a simulated step takes.
    #[arg(long, default_value_t = 1.0)]
    step_s: f64,
    /// Seconds of steady state before the fault.
    #[arg(long, default_value_t = 8.0)]
    warmup_s: f64,
    /// A rank silent this long is lost (the shims' heartbeat bound, `--heartbeat-timeout`).
    #[arg(long, default_value_t = 0.5)]
    heartbeat_s: f64,
}

#[derive(Subcommand)]
enum Role {
    /// The whole simulation: prints one JSON line.
    Scale {
        #[command(flatten)]
        job: Job,
        /// Count the supervisor's file operations on the run directory with strace.
        #[arg(long)]
        count_ops: bool,
        /// Where the run directory goes [default: a temporary directory].
        #[arg(long)]
        run_dir: Option<PathBuf>,
    },
    /// kiln's supervisor for the simulated job.
    Supervise {
        #[command(flatten)]
        job: Job,
        #[arg(long)]
        run_dir: PathBuf,
        /// Unix time of the fault.
        #[arg(long)]
        fault_at: f64,
    },
    /// One simulated node.
    Node {
        #[command(flatten)]
        job: Job,
        #[arg(long)]
        index: usize,
        #[arg(long)]
        run_dir: PathBuf,
        #[arg(long)]
        fault_at: f64,
    },
    /// What the supervisor starts in place of a launcher: waits to be killed.
    Hold,
}

fn main() -> std::process::ExitCode {
    let cli = Cli::parse();
    let r = match cli.role {
        Role::Scale {
            job,
            count_ops,
            run_dir,
        } => scale(&job, count_ops, run_dir),
        Role::Supervise {
            job,
            run_dir,
            fault_at,
        } => supervise(&job, &run_dir, fault_at),
        Role::Node {
            job,
            index,
            run_dir,
            fault_at,
        } => node(&job, index, &run_dir, fault_at),
        Role::Hold => loop {
            std::thread::sleep(Duration::from_secs(3600));
        },
    };
    match r {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("kiln-plane-sim: {e}");
            std::process::ExitCode::FAILURE
        }
    }
}

type Res<T> = Result<T, String>;

fn unix_now() -> f64 {
    kiln_run::unix_time()
}

impl Job {
    fn args(&self) -> Vec<String> {
        [
            ("--nodes", self.nodes.to_string()),
            ("--ranks-per-node", self.ranks_per_node.to_string()),
            ("--plane", self.plane.clone()),
            ("--fault", self.fault.clone()),
            ("--step-s", self.step_s.to_string()),
            ("--warmup-s", self.warmup_s.to_string()),
            ("--heartbeat-s", self.heartbeat_s.to_string()),
        ]
        .into_iter()
        .flat_map(|(k, v)| [k.to_string(), v])
        .collect()
    }

    fn tcp(&self) -> bool {
        self.plane == "tcp"
    }

    /// The faulted node and rank: the middle node's middle rank.
    fn victim(&self) -> (usize, usize) {
        let n = self.nodes / 2;
        (n, n * self.ranks_per_node + self.ranks_per_node / 2)
    }
}

/// The simulated node `i`'s host name.
fn node_host(i: usize) -> String {
    format!("node-{i:04}")
}

/// Where the supervisor tells the nodes how to reach it.
fn plane_file(run_dir: &Path) -> PathBuf {
    run_dir.join("plane.json")
}

/// What the supervisor tells the nodes (`plane.json` in the run directory), as `kiln launch`
/// exports it to its ranks.
#[derive(serde::Serialize, serde::Deserialize)]
struct PlaneInfo {
    addr: String,
    secret: String,
    attempt: String,
}

impl PlaneInfo {
    fn write(&self, run_dir: &Path) -> Res<()> {
        let text = serde_json::to_string(self).map_err(|e| e.to_string())?;
        let atomic = kiln_run::files::Atomic::RECORD;
        kiln_run::files::write_atomic(&plane_file(run_dir), text.as_bytes(), atomic)
            .map_err(|e| e.to_string())
    }

    fn read(run_dir: &Path) -> Res<PlaneInfo> {
        let text = std::fs::read(plane_file(run_dir)).map_err(|e| e.to_string())?;
        serde_json::from_slice(&text).map_err(|e| e.to_string())
    }
}

/// One simulated job's processes and files, as `scale` runs them.
struct Sim<'a> {
    job: &'a Job,
    exe: PathBuf,
    run_dir: PathBuf,
    fault_at: f64,
    count_ops: bool,
    /// Trace the nodes too (small jobs only: see [`TRACE_NODES_UP_TO`]).
    trace_nodes: bool,
}

impl<'a> Sim<'a> {
    fn new(job: &'a Job, count_ops: bool, run_dir: PathBuf) -> Res<Self> {
        if !matches!(job.fault.as_str(), "stop" | "kill" | "agent" | "straggler") {
            let f = &job.fault;
            return Err(format!(
                "--fault {f}: expected stop, kill, agent or straggler"
            ));
        }
        if job.fault == "agent" && !job.tcp() {
            return Err("--fault agent needs --plane tcp (the files plane has no agents)".into());
        }
        std::fs::create_dir_all(run_dir.join("progress")).map_err(|e| e.to_string())?;
        // Nodes need a moment each to start on a small machine: the warm-up counts from when
        // they are all up, roughly.
        let fault_at = unix_now() + job.warmup_s + job.nodes as f64 * 0.01;
        Ok(Sim {
            job,
            exe: std::env::current_exe().map_err(|e| e.to_string())?,
            run_dir: std::path::absolute(&run_dir).map_err(|e| e.to_string())?,
            fault_at,
            count_ops,
            trace_nodes: count_ops && job.nodes <= TRACE_NODES_UP_TO,
        })
    }

    fn ops_log(&self, who: &str) -> PathBuf {
        self.run_dir.with_extension(format!("{who}.strace"))
    }

    /// This program in role `role` for `who`, under strace when its operations are counted.
    fn command(&self, role: &str, who: &str, traced: bool) -> Command {
        let mut c = match traced {
            true => {
                let mut c = Command::new("strace");
                c.args(STRACE).arg(self.ops_log(who)).arg(&self.exe);
                c
            }
            false => Command::new(&self.exe),
        };
        c.arg(role)
            .args(self.job.args())
            .arg("--run-dir")
            .arg(&self.run_dir)
            .args(["--fault-at", &self.fault_at.to_string()]);
        c
    }

    fn start_supervisor(&self) -> Res<Child> {
        let mut c = self.command("supervise", "supervisor", self.count_ops);
        let child = c.stdout(std::process::Stdio::piped()).spawn();
        let child = child.map_err(|e| format!("supervisor: {e}"))?;
        let t = Instant::now();
        while self.job.tcp() && !plane_file(&self.run_dir).exists() {
            if t.elapsed() > Duration::from_secs(20) {
                return Err("the supervisor did not start its server".into());
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        Ok(child)
    }

    /// The nodes, each with its own `KILN_HOST` and, under `tcp`, the variables `kiln launch`
    /// exports to its ranks (the plane's address and secret, the attempt).
    fn start_nodes(&self) -> Res<Vec<Child>> {
        let plane = match self.job.tcp() {
            true => {
                let info = PlaneInfo::read(&self.run_dir)?;
                vec![
                    (kiln_launch::plane::ADDR_ENV, info.addr),
                    (kiln_launch::plane::SECRET_ENV, info.secret),
                    (kiln_run::ATTEMPT_ENV, info.attempt),
                ]
            }
            false => Vec::new(),
        };
        (0..self.job.nodes)
            .map(|i| {
                let mut c = self.command("node", &format!("node-{i}"), self.trace_nodes);
                c.args(["--index", &i.to_string()])
                    .env(kiln_run::HOST_ENV, node_host(i))
                    .envs(plane.iter().cloned())
                    .stdout(std::process::Stdio::null())
                    .spawn()
                    .map_err(|e| format!("node {i}: {e}"))
            })
            .collect()
    }

    /// Ends the simulated nodes as a launcher ends its ranks with the launch: asked to stop,
    /// then killed (by PID) after 5 s; removes the node directories of killed agents, as
    /// `kiln launch` removes its own host's after an attempt.
    fn end_nodes(&self, mut nodes: Vec<Child>) {
        let progress = self.run_dir.join("progress");
        let _ = kiln_run::write_stop_request(&progress, libc::SIGTERM, unix_now(), None);
        let t = Instant::now();
        for n in &mut nodes {
            while n.try_wait().ok().flatten().is_none() && t.elapsed() < Duration::from_secs(5) {
                std::thread::sleep(Duration::from_millis(10));
            }
            let _ = n.kill();
            let _ = n.wait();
        }
        if let Ok(info) = PlaneInfo::read(&self.run_dir) {
            let hosts: Vec<String> = (0..self.job.nodes).map(node_host).collect();
            let hosts = hosts.iter().map(String::as_str);
            kiln_launch::plane::node::remove_unused(&info.secret, &info.attempt, hosts);
        }
    }

    /// Adds the run-directory operations a second in the report's steady state.
    fn count(&self, report: &mut serde_json::Value) {
        let from = report["measure_from"].as_f64().unwrap_or(self.fault_at);
        let window = (from, report["measure_to"].as_f64().unwrap_or(self.fault_at));
        let ops = |who: &str| ops_per_s(&self.ops_log(who), &self.run_dir, window);
        let supervisor = ops("supervisor");
        let nodes: Option<f64> = match self.trace_nodes {
            true => (0..self.job.nodes).map(|i| ops(&format!("node-{i}"))).sum(),
            false => None,
        };
        report["supervisor_run_dir_ops_per_s"] = serde_json::json!(supervisor);
        report["run_dir_ops_per_s"] = serde_json::json!(nodes.zip(supervisor).map(|(n, s)| n + s));
        let logs = (0..self.job.nodes).map(|i| format!("node-{i}"));
        for who in std::iter::once("supervisor".to_string()).chain(logs) {
            let _ = std::fs::remove_file(self.ops_log(&who));
        }
    }
}

fn scale(job: &Job, count_ops: bool, run_dir: Option<PathBuf>) -> Res<()> {
    let own = run_dir.is_none();
    let run_dir = run_dir.unwrap_or_else(|| {
        std::env::temp_dir().join(format!("kiln-plane-sim-{}", std::process::id()))
    });
    let sim = Sim::new(job, count_ops, run_dir)?;
    let supervisor = sim.start_supervisor()?;
    let nodes = sim.start_nodes()?;
    let out = supervisor.wait_with_output().map_err(|e| e.to_string())?;
    sim.end_nodes(nodes);
    let mut report: serde_json::Value =
        serde_json::from_slice(&out.stdout).map_err(|e| format!("the supervisor's report: {e}"))?;
    if count_ops {
        sim.count(&mut report);
    }
    println!("{report}");
    if own {
        let _ = std::fs::remove_dir_all(&sim.run_dir);
    }
    Ok(())
}

/// strace's flags for counting file operations: every thread, only file and descriptor
/// calls stopped (seccomp), times, descriptors shown as paths; then `-o LOG`.
const STRACE: [&str; 8] = [
    "-f",
    "--seccomp-bpf",
    "-qq",
    "-ttt",
    "-y",
    "-e",
    "trace=%file,%desc",
    "-o",
];

/// The most nodes whose every thread is traced with `--count-ops` (beyond it only the
/// supervisor is).
const TRACE_NODES_UP_TO: usize = 16;

/// Operations on paths under `run_dir` a second in the strace log, within `window`.
fn ops_per_s(log: &Path, run_dir: &Path, window: (f64, f64)) -> Option<f64> {
    let text = std::fs::read_to_string(log).ok()?;
    let needle = run_dir.to_string_lossy().into_owned();
    let n = text
        .lines()
        .filter(|l| l.contains(&needle))
        .filter_map(|l| l.split_whitespace().nth(1)?.parse::<f64>().ok())
        .filter(|t| *t >= window.0 && *t < window.1)
        .count();
    Some(n as f64 / (window.1 - window.0).max(1e-9))
}

/// The control plane's server under `--plane tcp`, its address and secret written for the
/// nodes into the run directory.
fn start_server(job: &Job, run_dir: &Path, attempt: &str) -> Res<Option<Arc<Server>>> {
    if !job.tcp() {
        return Ok(None);
    }
    let s =
        Server::start("127.0.0.1:0".parse().map_err(|_| "address")?).map_err(|e| e.to_string())?;
    s.begin(Some(attempt));
    let info = PlaneInfo {
        addr: format!("127.0.0.1:{}", s.port()),
        secret: s.secret().to_string(),
        attempt: attempt.to_string(),
    };
    info.write(run_dir)?;
    Ok(Some(Arc::new(s)))
}

/// The attempt `kiln launch` would watch: one launcher process (here one that waits to be
/// killed), every rank under a shim, the heartbeat bound of the job.
fn attempt_config(
    job: &Job,
    run_dir: &Path,
    plane: Option<Arc<Server>>,
    attempt: String,
) -> Res<AttemptConfig> {
    let exe = std::env::current_exe().map_err(|e| e.to_string())?;
    Ok(AttemptConfig {
        procs: vec![ProcSpec {
            argv: vec![exe.display().to_string(), "hold".into()],
            env: Vec::new(),
            rank: None,
        }],
        log_path: run_dir.join("attempt-1.log"),
        silence_timeout: None,
        stall_timeout: None,
        stall_auto: false,
        progress_regex: None,
        progress_dir: Some(run_dir.join("progress")),
        clear_progress_dir: false,
        plane,
        attempt: Some(attempt),
        grace: Duration::from_secs(2),
        deadline: None,
        echo: false,
        reap_orphans: false,
        stdout_pty: false,
        expected_ranks: Some(job.nodes * job.ranks_per_node),
        rank_shims: true,
        heartbeat_timeout: Some(Duration::from_secs_f64(job.heartbeat_s)),
        straggler_ends_attempt: job.fault == "straggler",
        straggler_cost: kiln_launch::straggler::COST,
        startup_timeout: None,
        startup_auto: false,
    })
}

/// This process's `(time, CPU seconds)` at `from` and at `to` (Unix times), sampled on a
/// thread of its own.
fn sample_cpu(from: f64, to: f64) -> std::thread::JoinHandle<((f64, f64), (f64, f64))> {
    std::thread::spawn(move || {
        let at = |t: f64| {
            std::thread::sleep(Duration::from_secs_f64((t - unix_now()).max(0.0)));
            (unix_now(), cpu_seconds())
        };
        (at(from), at(to))
    })
}

fn supervise(job: &Job, run_dir: &Path, fault_at: f64) -> Res<()> {
    let attempt = format!("sim-{}", std::process::id());
    let plane = start_server(job, run_dir, &attempt)?;
    let cfg = attempt_config(job, run_dir, plane, attempt)?;
    // The steady state: from half the warm-up to the fault.
    let sampler = sample_cpu(fault_at - job.warmup_s / 2.0, fault_at);
    let outcome = run_attempt(&cfg, &|| None).map_err(|e| e.to_string())?;
    let ((t0, c0), (t1, c1)) = sampler.join().map_err(|_| "sampler")?;
    let verdict_at = outcome.end_time - outcome.kill_s.unwrap_or(0.0);
    let (victim_node, victim) = job.victim();
    let m = job.ranks_per_node;
    let expected: Vec<usize> = match job.fault.as_str() {
        "agent" => (victim_node * m..(victim_node + 1) * m).collect(),
        _ => vec![victim],
    };
    let report = serde_json::json!({
        "plane": job.plane,
        "nodes": job.nodes,
        "ranks": job.nodes * m,
        "fault": job.fault,
        "classification": format!("{:?}", outcome.classification),
        "detect_s": verdict_at - fault_at,
        "culprit_ok": outcome.culprits == expected,
        "culprits": outcome.culprits,
        "message": outcome.message,
        "supervisor_cpu": (c1 - c0) / (t1 - t0).max(1e-9),
        "peak_rss_mib": peak_rss_mib(),
        "measure_from": t0,
        "measure_to": t1,
    });
    println!("{report}");
    Ok(())
}

/// This process's CPU time (user + system, every thread), seconds.
fn cpu_seconds() -> f64 {
    // SAFETY: getrusage fills the struct we own.
    let mut u: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: as above.
    unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut u) };
    let tv = |t: libc::timeval| t.tv_sec as f64 + t.tv_usec as f64 * 1e-6;
    tv(u.ru_utime) + tv(u.ru_stime)
}

fn peak_rss_mib() -> Option<f64> {
    let s = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = s.lines().find(|l| l.starts_with("VmHWM:"))?;
    let kib: f64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib / 1024.0)
}

/// A simulated node's seat under `--plane tcp`, from its environment as a rank shim takes it
/// (`None` under `files`).
fn take_seat() -> Res<Option<Seat>> {
    let Some(cfg) = kiln_launch::plane::agent_config_from_env(kiln_run::this_attempt()) else {
        return Ok(None);
    };
    Seat::take(cfg).map(Some).map_err(|e| e.to_string())
}

/// One simulated node: its ranks (threads), the shims' liveness and heartbeat watch, and
/// under `tcp` its seat (which runs the agent).
fn node(job: &Job, index: usize, run_dir: &Path, fault_at: f64) -> Res<()> {
    let seat = take_seat()?;
    let dir = seat
        .as_ref()
        .map_or_else(|| run_dir.join("progress"), |s| s.dir().to_path_buf());
    let stop = Arc::new(AtomicBool::new(false));
    let (victim_node, victim) = job.victim();
    let m = job.ranks_per_node;
    let ranks: Vec<_> = (index * m..(index + 1) * m)
        .map(|rank| {
            let r = SimRank {
                rank,
                dir: dir.clone(),
                step_s: job.step_s,
                heartbeat_s: job.heartbeat_s,
                fault: (rank == victim).then(|| job.fault.clone()),
                fault_at,
                poll_stop: !job.tcp(),
            };
            let stop = Arc::clone(&stop);
            std::thread::spawn(move || r.run(&stop))
        })
        .collect();
    if index == victim_node && job.fault == "agent" {
        std::thread::sleep(Duration::from_secs_f64((fault_at - unix_now()).max(0.0)));
        // SAFETY: kill(2) of this process: the node and its agent are lost at once.
        unsafe { libc::kill(libc::getpid(), libc::SIGKILL) };
    }
    if let Some(seat) = &seat {
        watch_stop(seat, &stop);
    }
    for r in ranks {
        let _ = r.join();
    }
    if let Some(s) = seat {
        s.leave();
    }
    Ok(())
}

/// Under `tcp`: the node's shims watch the node directory's stop file (here one watcher for
/// the node's simulated ranks); a launcher kills the ranks when the launch is gone, here
/// they stop.
fn watch_stop(seat: &Seat, stop: &AtomicBool) {
    while !stop.load(Ordering::SeqCst) {
        if kiln_run::read_stop_request(seat.dir()).is_some() || seat.supervisor_gone() {
            stop.store(true, Ordering::SeqCst);
        }
        std::thread::sleep(Duration::from_millis(25));
    }
}

/// One simulated rank: its trainer's beacon every step, its shim's liveness record every half
/// second and heartbeat watch, and its fault.
struct SimRank {
    rank: usize,
    dir: PathBuf,
    step_s: f64,
    heartbeat_s: f64,
    fault: Option<String>,
    fault_at: f64,
    /// Poll the stop file every 25 ms (the files plane's shims do).
    poll_stop: bool,
}

impl SimRank {
    fn run(&self, stop: &AtomicBool) {
        let start = unix_now();
        let (mut step, mut next_step, mut next_live) = (0u64, start, start);
        let mut last_beat = start;
        let mut faulted = false;
        let mut lost_written = false;
        let work = self.step_s * 0.6;
        while !stop.load(Ordering::SeqCst) {
            let now = unix_now();
            let fault_now = now >= self.fault_at && self.fault.is_some();
            if fault_now && !faulted {
                faulted = true;
                if self.fault.as_deref() == Some("kill") {
                    let _ = kiln_run::write_exit_record(&self.dir, self.rank, None, Some(9), now);
                    return;
                }
            }
            let stopped = faulted && self.fault.as_deref() == Some("stop");
            if !stopped {
                last_beat = now;
            }
            if now >= next_step && !stopped {
                step += 1;
                let slow = faulted && self.fault.as_deref() == Some("straggler");
                let w = if slow { work * 2.0 } else { work };
                let _ = kiln_run::write_beacon_with_work(
                    &self.dir,
                    self.rank,
                    step,
                    "train",
                    now,
                    Some(w),
                );
                next_step += self.step_s;
            }
            if now >= next_live {
                let state = if stopped { 'T' } else { 'S' };
                let _ = kiln_run::write_liveness(&self.dir, self.rank, state, step * 10, now);
                next_live += 0.5;
            }
            if stopped && !lost_written && now - last_beat >= self.heartbeat_s {
                lost_written = true;
                let _ = kiln_run::write_lost_record(&self.dir, self.rank, now - last_beat, now);
            }
            if self.poll_stop && kiln_run::read_stop_request(&self.dir).is_some() {
                stop.store(true, Ordering::SeqCst);
            }
            let next = [next_step, next_live, last_beat + self.heartbeat_s]
                .into_iter()
                .filter(|t| *t > now)
                .fold(f64::INFINITY, f64::min);
            let wait = if self.poll_stop {
                0.025
            } else {
                (next - now).clamp(0.005, 0.1)
            };
            std::thread::sleep(Duration::from_secs_f64(wait));
        }
        let _ = kiln_run::write_exit_record(&self.dir, self.rank, Some(75), None, unix_now());
    }
}

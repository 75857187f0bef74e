//! The flags of `kiln launch`, defined once ([`LaunchRequest`], with clap's attributes and
//! help), as ripgrep keeps its flags in one place: the CLI flattens it, [`kiln_flags`] lists
//! their names (to catch one written after a launcher flag), and [`LaunchRequest::to_argv`]
//! writes a request back as a command line (what `kiln submit` puts in a batch script),
//! derived from the same definition, so `parse(to_argv(x)) == x`. The flags that override
//! detection ([`TopologyFlags`]) are shared with `kiln doctor`.

use clap::{Args, FromArgMatches};
use serde::Serialize;
use serde_json::Value;
use std::ffi::OsString;
use std::os::unix::ffi::OsStringExt;
use std::path::PathBuf;

/// The flags of `kiln launch`, and the program it runs: the one definition of each flag.
#[derive(Debug, Clone, PartialEq, clap::Args, Serialize)]
pub struct LaunchRequest {
    /// Total number of ranks [default: nodes x ranks per node].
    #[arg(long, value_name = "N", help_heading = "Sizes")]
    pub np: Option<usize>,
    /// Ranks per node [default: accelerators per node, or 1 on CPU nodes; all ranks locally].
    #[arg(long, value_name = "N", help_heading = "Sizes")]
    pub ppn: Option<usize>,
    /// Number of nodes to use [default: every host of the allocation, or as --np needs].
    #[arg(long, value_name = "N", help_heading = "Sizes")]
    pub nnodes: Option<usize>,
    /// Allow more local ranks than 4 per CPU (at most 4096).
    #[arg(long, help_heading = "Sizes")]
    pub oversubscribe: bool,

    /// Where the ranks run: the flags that override detection, shared with `kiln doctor`.
    #[command(flatten)]
    #[serde(flatten)]
    pub topology: TopologyFlags,
    /// CPU binding for the launcher (mpiexec --cpu-bind, srun --cpu-bind, mpirun --bind-to);
    /// `none` adds no flag [default: depth under PBS, none elsewhere].
    #[arg(long, value_name = "BIND", help_heading = "Topology")]
    pub cpu_bind: Option<String>,
    /// MASTER_ADDR for the ranks [default: 127.0.0.1 locally, else the first host].
    #[arg(long, value_name = "HOST", help_heading = "Topology")]
    pub master_addr: Option<String>,
    /// MASTER_PORT for the ranks, 1-65535 [default: a port free on this machine].
    #[arg(long, value_name = "PORT", help_heading = "Topology")]
    pub master_port: Option<u16>,
    /// Under a launcher, run PROGRAM directly instead of through `kiln launch --as-rank`
    /// (then the program must read the launcher's own rank variables).
    #[arg(long, help_heading = "Topology")]
    pub no_rank_env: bool,

    /// Silence watchdog: kill when there is no output and no beacon update for S seconds.
    #[arg(long, value_name = "S", help_heading = "Watchdogs")]
    pub timeout: Option<f64>,
    /// Stall watchdog: kill when progress has not advanced for S seconds although output
    /// continues (armed once the first progress is seen); 0 turns it off [default: for ranks
    /// that write beacons, 10 x the slowest recent step time, at least 3 s].
    #[arg(long, value_name = "S", help_heading = "Watchdogs")]
    pub stall_timeout: Option<f64>,
    /// Startup watchdog: kill an attempt in which no rank reached a step S seconds after it
    /// started (a wire-up or launch that hangs); 0 turns it off [default: from a launch's
    /// second attempt on (from the first in a later job of a `kiln submit` chain), 10 x the
    /// slowest startup of its (its chain's) earlier attempts, at least 10 s].
    #[arg(long, value_name = "S", help_heading = "Watchdogs")]
    pub startup_timeout: Option<f64>,
    /// Regex whose first capture group (or group `step`) is the step number.
    #[arg(long, value_name = "REGEX", default_value = crate::progress::DEFAULT_PROGRESS_REGEX, help_heading = "Watchdogs")]
    pub progress_regex: String,
    /// Liveness watchdog: a rank that sends heartbeats (kiln's trainer does, every 0.1 s from
    /// a thread) and then stays silent for S seconds (stopped, wedged, gone) is killed and the
    /// attempt ends at once, naming the rank and its host.
    #[arg(
        long,
        value_name = "S",
        default_value_t = 1.0,
        help_heading = "Watchdogs"
    )]
    pub heartbeat_timeout: f64,
    /// Seconds between SIGTERM and SIGKILL when kiln stops the ranks (after a rank was killed
    /// by a signal or fell silent: at most 1 s, as the others cannot finish a collective
    /// without it).
    #[arg(
        long,
        value_name = "S",
        default_value_t = 10.0,
        help_heading = "Watchdogs"
    )]
    pub grace: f64,
    /// How the ranks report to kiln under a launcher: `tcp`, one agent per node that keeps a
    /// connection to kiln (the ranks' files stay in node memory); `files`, every rank's files
    /// in the run directory (one machine; on a cluster's shared filesystem it costs ~50
    /// metadata operations a rank-second). See docs/recovery.md.
    #[arg(long, value_name = "PLANE", value_parser = ["tcp", "files"], default_value = "tcp", help_heading = "Watchdogs")]
    pub control_plane: String,
    /// Stop the job after this long, all attempts together (SIGTERM so ranks can checkpoint);
    /// seconds or H:MM:SS.
    #[arg(long, value_name = "TIME", help_heading = "Watchdogs")]
    pub walltime: Option<String>,

    /// Retry a failed or hung attempt up to N times [default: 0].
    #[arg(
        long,
        value_name = "N",
        conflicts_with = "auto_retry",
        help_heading = "Retries"
    )]
    pub retries: Option<u32>,
    /// Retry without a fixed count while attempts keep making new progress (give up after 3
    /// attempts in a row that got no further), with node scope: swap culprit hosts for spares.
    #[arg(long, help_heading = "Retries")]
    pub auto_retry: bool,
    /// The share of the job's speed a rank must cost it for 20 steps in a row to be named a
    /// straggler: at r x its peers' work per step (beacons' `<work_s>`) it costs 1 - 1/r of
    /// the speed, every rank waiting for it [default: 0.25, a rank at 4/3 of its peers'].
    #[arg(long, value_name = "SHARE", help_heading = "Watchdogs")]
    pub straggler_cost: Option<f64>,
    /// With --auto-retry: a rank named a straggler (--straggler-cost) ends the attempt as a
    /// failing node would: the ranks get SIGTERM and checkpoint, its host is swapped for a
    /// spare and quarantined [default: off].
    #[arg(long, requires = "auto_retry", help_heading = "Retries")]
    pub straggler_is_node_failure: bool,
    /// Hosts kept as spares for node scope [default with --auto-retry: about 2 %, at least 1].
    #[arg(long, value_name = "N", help_heading = "Retries")]
    pub spares: Option<usize>,
    /// With node scope, a host blamed for a crash or a hang is swapped at its Nth such
    /// failure in this launch; before that the attempt is retried on the same hosts (process
    /// scope: most crashes and hangs are the process, not the node). A node failure or a
    /// replica mismatch swaps its host at once.
    #[arg(
        long,
        value_name = "N",
        default_value_t = 2,
        value_parser = clap::value_parser!(u32).range(1..),
        help_heading = "Retries"
    )]
    pub strikes: u32,
    /// Fewest hosts the job may shrink to when no spare is left (the program must resume on
    /// fewer ranks) [default: no shrinking].
    #[arg(long, value_name = "N", help_heading = "Retries")]
    pub min_nodes: Option<usize>,
    /// A shared quarantine file (JSON lines) read at start and appended with every host node
    /// scope takes out, besides RUN_DIR/quarantine.jsonl.
    #[arg(long, value_name = "FILE", help_heading = "Retries")]
    #[serde(serialize_with = "path_bytes")]
    pub quarantine_file: Option<PathBuf>,
    /// Backoff between retries, BASE[,CAP] seconds: BASE after an attempt that got no
    /// further than the best before it, doubling with each such attempt in a row, at most CAP
    /// [default: 5,60 = 5, 10, 20, 40, 60, 60 ...]; an attempt that trained further than any
    /// before it is retried at once.
    #[arg(
        long,
        value_name = "BASE[,CAP]",
        default_value = "5,60",
        help_heading = "Retries"
    )]
    pub backoff: String,

    /// What becomes of the ranks' memory snapshots (the memory tier, in /dev/shm: RAM) on the
    /// nodes when the launch ends for good (success, recovery given up, a stop, the
    /// walltime): `remove` them on every node an attempt used; `keep` them (the next launch
    /// of this run starts on the same nodes: a batch script that launches again in its
    /// allocation); `auto`: remove under a scheduler (the allocation ends with the job, and
    /// a chained job starts on other nodes), keep without one (the same command resumes on
    /// the same machines, and deletes the snapshots its persistent checkpoint made stale).
    #[arg(long, value_name = "WHAT", value_parser = ["auto", "keep", "remove"], default_value = "auto", help_heading = "Retries")]
    pub memory_tier_at_end: String,

    /// Internal (kiln submit): most jobs of a batch chain; at the end of a resumable job kiln
    /// submits --chain-script again.
    #[arg(long, value_name = "K", hide = true)]
    pub chain: Option<u32>,
    /// Internal (kiln submit): the batch script to resubmit.
    #[arg(long, value_name = "FILE", hide = true)]
    #[serde(serialize_with = "path_bytes")]
    pub chain_script: Option<PathBuf>,

    /// Run directory for events.jsonl and attempt logs [default: runs/launch-<UTC time>].
    #[arg(long, value_name = "DIR")]
    #[serde(serialize_with = "path_bytes")]
    pub run_dir: Option<PathBuf>,
    /// Print what was detected and the exact argv (and added variables), then exit.
    #[arg(long)]
    pub dry_run: bool,
    /// Internal, what each rank runs under a launcher: set RANK/LOCAL_RANK/WORLD_SIZE/
    /// LOCAL_WORLD_SIZE from the launcher's variables, run PROGRAM and record its exit.
    #[arg(long)]
    pub as_rank: bool,
    /// Internal, what runs once on each node when a launch ends: remove what the run's ranks
    /// recorded in $KILN_PROGRESS_DIR as kept on this node.
    #[arg(long, hide = true)]
    pub release_node: bool,

    /// Everything after kiln's flags: `[LAUNCHER FLAGS] -- PROGRAM [ARGS...]` (parsed by the
    /// CLI as its trailing arguments).
    #[arg(skip)]
    #[serde(skip)]
    pub command: Vec<String>,
}

/// The flags that override what kiln detects about where it runs (scheduler, hosts,
/// accelerators, launcher without a scheduler): defined once, flattened into
/// [`LaunchRequest`] and into `kiln doctor`, which reports what they lead to.
#[derive(Debug, Clone, PartialEq, clap::Args, Serialize)]
pub struct TopologyFlags {
    /// Hosts to use instead of the scheduler's: `host`, `host slots=N` or `host:N` per line.
    #[arg(long, value_name = "FILE", help_heading = "Topology")]
    #[serde(serialize_with = "path_bytes")]
    pub hostfile: Option<PathBuf>,
    /// Scheduler, overriding detection from PBS_JOBID / SLURM_JOB_ID.
    #[arg(long, value_name = "NAME", value_parser = ["auto", "pbs", "slurm", "none"], default_value = "auto", help_heading = "Topology")]
    pub scheduler: String,
    /// Without a scheduler, start ranks with OpenMPI's mpirun instead of spawning them.
    #[arg(long, help_heading = "Topology")]
    pub mpi: bool,
    /// Accelerator kind, overriding detection (visible-device variables, nvidia-smi, rocm-smi, xpu-smi).
    #[arg(long, value_name = "KIND", value_parser = ["auto", "nvidia", "amd", "intel", "cpu"], default_value = "auto", help_heading = "Topology")]
    pub accelerator: String,
    /// Accelerators per node, overriding detection (0: CPU only); also srun's --gpus-per-node.
    #[arg(long, value_name = "N", help_heading = "Topology")]
    pub gpus_per_node: Option<usize>,
}

impl Default for TopologyFlags {
    /// Everything detected: what `kiln launch` and `kiln doctor` get without these flags.
    fn default() -> Self {
        LaunchRequest::default().topology
    }
}

impl Default for LaunchRequest {
    /// What `kiln launch -- PROGRAM` gets: every flag at its default.
    fn default() -> Self {
        Self::parse_flags(std::iter::empty::<OsString>())
            .unwrap_or_else(|e| unreachable!("kiln launch's defaults parse: {e}"))
    }
}

impl LaunchRequest {
    /// The flags as clap sees them (a command named `launch` holding only kiln's flags).
    fn command_line() -> clap::Command {
        Self::augment_args(clap::Command::new("launch").no_binary_name(true))
    }

    /// Parses kiln's flags alone (no program), as the CLI would.
    pub fn parse_flags<I, T>(args: I) -> Result<Self, clap::Error>
    where
        I: IntoIterator<Item = T>,
        T: Into<OsString> + Clone,
    {
        let matches = Self::command_line().try_get_matches_from(args)?;
        Self::from_arg_matches(&matches)
    }

    /// Whether node scope is on (`--auto-retry`, or `--spares N`): spare hosts are kept and
    /// swapped in for culprit hosts.
    pub fn node_scope(&self) -> bool {
        self.auto_retry || self.spares.is_some()
    }

    /// The flags of this request that differ from their defaults, as `--name=value` (or
    /// `--name` for a switch), in the order they are defined; `command` is not included.
    /// Every name and value comes from the one definition above: no flag is spelled here.
    pub fn to_argv(&self) -> Result<Vec<OsString>, String> {
        let values = object(self)?;
        let defaults = object(&Self::default())?;
        let mut argv = Vec::new();
        for arg in Self::command_line().get_arguments() {
            let (Some(long), id) = (arg.get_long(), arg.get_id().as_str()) else {
                continue;
            };
            let value = values.get(id).unwrap_or(&Value::Null);
            if value.is_null() || Some(value) == defaults.get(id) {
                continue;
            }
            match value {
                Value::Bool(true) => argv.push(format!("--{long}").into()),
                Value::Bool(false) => {}
                Value::String(s) => argv.push(format!("--{long}={s}").into()),
                // A path, as its bytes (see `path_bytes`): written back byte for byte.
                Value::Array(bytes) => {
                    let mut arg = format!("--{long}=").into_bytes();
                    arg.extend(bytes.iter().filter_map(|b| u8::try_from(b.as_u64()?).ok()));
                    argv.push(OsString::from_vec(arg));
                }
                other => argv.push(format!("--{long}={other}").into()),
            }
        }
        Ok(argv)
    }
}

/// Paths as their bytes, so a path that is not UTF-8 is written back exactly.
fn path_bytes<S: serde::Serializer>(path: &Option<PathBuf>, s: S) -> Result<S::Ok, S::Error> {
    use std::os::unix::ffi::OsStrExt;
    path.as_ref().map(|p| p.as_os_str().as_bytes()).serialize(s)
}

/// A request's fields by name (clap's argument ids are the field names).
fn object(req: &LaunchRequest) -> Result<serde_json::Map<String, Value>, String> {
    match serde_json::to_value(req) {
        Ok(Value::Object(map)) => Ok(map),
        Ok(_) => Err("a launch request is not an object".into()),
        // Paths that are not UTF-8 cannot be written as text.
        Err(e) => Err(format!(
            "cannot write the launch flags as a command line: {e}"
        )),
    }
}

/// Every long flag of `kiln launch` (`--np`, ...), derived from [`LaunchRequest`].
pub fn kiln_flags() -> Vec<String> {
    LaunchRequest::command_line()
        .get_arguments()
        .filter_map(|a| a.get_long().map(|l| format!("--{l}")))
        .collect()
}

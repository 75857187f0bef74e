//! Accelerators per node: NVIDIA, AMD or Intel GPUs, else CPU.
//!
//! Visible-device variables win over tools: they are what the job was told to use. Tools are
//! asked through a caller-supplied probe, so this crate never spawns processes itself (and
//! tests can feed canned tool output).

use crate::scheduler::Detected;

/// Kind of accelerator.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AcceleratorKind {
    /// NVIDIA GPUs (CUDA).
    Nvidia,
    /// AMD GPUs (ROCm/HIP).
    Amd,
    /// Intel GPUs (Level Zero / XPU).
    Intel,
    /// No accelerator: ranks run on CPU cores.
    Cpu,
}

impl AcceleratorKind {
    /// Lowercase name: `nvidia`, `amd`, `intel`, `cpu`.
    pub fn name(self) -> &'static str {
        match self {
            AcceleratorKind::Nvidia => "nvidia",
            AcceleratorKind::Amd => "amd",
            AcceleratorKind::Intel => "intel",
            AcceleratorKind::Cpu => "cpu",
        }
    }
}

/// Accelerators of one node.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Accelerators {
    /// Their kind.
    pub kind: AcceleratorKind,
    /// How many per node (0 for CPU).
    pub count: usize,
}

/// A tool to ask, its arguments, what it finds, and how to count GPUs in its output.
type ToolProbe = (
    &'static str,
    &'static [&'static str],
    AcceleratorKind,
    fn(&str) -> usize,
);

/// Runs a tool (`program`, `args`) and returns its stdout if it exited successfully.
pub type Probe<'a> = &'a dyn Fn(&str, &[&str]) -> Option<String>;

/// A visible-device variable that is set but cannot be read: the job would otherwise start
/// with a wrong rank count per node.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{var}={value:?}: {message}")]
pub struct VisibleDevicesError {
    /// The variable.
    pub var: &'static str,
    /// Its value.
    pub value: String,
    /// What is wrong, naming the entry.
    pub message: String,
}

/// The visible-device variables, in the order they are consulted, and the kind each means.
pub const VISIBLE_DEVICE_VARS: [(&str, AcceleratorKind); 4] = [
    ("CUDA_VISIBLE_DEVICES", AcceleratorKind::Nvidia),
    ("ROCR_VISIBLE_DEVICES", AcceleratorKind::Amd),
    ("HIP_VISIBLE_DEVICES", AcceleratorKind::Amd),
    ("ZE_AFFINITY_MASK", AcceleratorKind::Intel),
];

/// The most devices one variable may list: no node has more, and a longer list is a
/// generated mistake, not a machine.
pub const MAX_VISIBLE_DEVICES: usize = 1024;

/// Whether `id` is a device UUID as the runtimes print them: `GPU-`/`MIG-` (or
/// `MIG-GPU-`) followed by hex digits in dash-separated groups (`GPU-8c1a...-...`), or a MIG
/// `MIG-GPU-<uuid>/<gi>/<ci>` triple.
fn is_device_uuid(id: &str) -> bool {
    let rest = id
        .strip_prefix("MIG-GPU-")
        .or_else(|| id.strip_prefix("GPU-"))
        .or_else(|| id.strip_prefix("MIG-"));
    let Some(rest) = rest else { return false };
    let (uuid, mig) = match rest.split_once('/') {
        Some((u, m)) => (u, Some(m)),
        None => (rest, None),
    };
    let hex_groups = !uuid.is_empty()
        && uuid
            .split('-')
            .all(|g| !g.is_empty() && g.bytes().all(|b| b.is_ascii_hexdigit()));
    let mig_ok = mig.is_none_or(|m| {
        m.split('/')
            .all(|p| !p.is_empty() && p.bytes().all(|b| b.is_ascii_digit()))
    });
    hex_groups && mig_ok
}

/// One entry of a visible-device list.
enum Entry {
    /// A device this entry makes visible.
    Device,
    /// A negative index: CUDA and ROCm stop the list there (`-1` alone hides every GPU).
    End,
}

fn parse_entry(var: &str, entry: &str) -> Result<Entry, String> {
    if entry.is_empty() {
        return Err("is empty".into());
    }
    if let Some(digits) = entry.strip_prefix('-')
        && !digits.is_empty()
        && digits.bytes().all(|b| b.is_ascii_digit())
    {
        return Ok(Entry::End);
    }
    let index = |s: &str| !s.is_empty() && s.len() <= 9 && s.bytes().all(|b| b.is_ascii_digit());
    let ok = match var {
        // Level Zero: `<device>` or `<device>.<sub-device>` (tiles).
        "ZE_AFFINITY_MASK" => match entry.split_once('.') {
            Some((d, t)) => index(d) && index(t),
            None => index(entry),
        },
        _ => index(entry) || is_device_uuid(entry),
    };
    if ok {
        Ok(Entry::Device)
    } else {
        Err(format!(
            "is neither a device index nor a device UUID (GPU-<hex>, MIG-<hex>){}",
            if var == "ZE_AFFINITY_MASK" {
                " nor <device>.<tile>"
            } else {
                ""
            }
        ))
    }
}

/// Parses a visible-device list (`0,1,2`, `GPU-<uuid>,...`, `0.0,0.1`) into the devices it
/// makes visible, by the runtimes' rules: an empty value or a leading negative index (`-1`)
/// hides every device; a negative index later ends the list (`0,2,-1,1` is `0,2`);
/// `NoDevFiles` (Slurm without GPUs) hides every device. Anything else malformed (an empty
/// entry, garbage, a repeated device) is an error naming the entry: guessing a count would
/// start the wrong number of ranks.
pub fn parse_visible_devices(
    var: &'static str,
    value: &str,
) -> Result<Vec<String>, VisibleDevicesError> {
    let err = |message: String| VisibleDevicesError {
        var,
        value: value.to_string(),
        message,
    };
    let trimmed = value.trim();
    if trimmed.is_empty() || trimmed == "NoDevFiles" {
        return Ok(Vec::new());
    }
    let mut devices: Vec<String> = Vec::new();
    for (i, raw) in trimmed.split(',').enumerate() {
        let entry = raw.trim();
        match parse_entry(var, entry) {
            Ok(Entry::End) => break,
            Ok(Entry::Device) => {
                if devices.iter().any(|d| d == entry) {
                    return Err(err(format!("entry {} ({entry:?}) repeats a device", i + 1)));
                }
                if devices.len() == MAX_VISIBLE_DEVICES {
                    return Err(err(format!(
                        "lists more than {MAX_VISIBLE_DEVICES} devices"
                    )));
                }
                devices.push(entry.to_string());
            }
            Err(what) => return Err(err(format!("entry {} ({entry:?}) {what}", i + 1))),
        }
    }
    Ok(devices)
}

/// Detects this node's accelerators from visible-device variables, then from
/// `nvidia-smi -L`, `rocm-smi --showid`, `xpu-smi discovery`; else CPU. A visible-device
/// variable that is set wins over the tools, even when it hides every device (then the node
/// counts as CPU-only: that is what the job was told to use). A malformed one is an error.
pub fn detect_accelerators(
    vars: &dyn Fn(&str) -> Option<String>,
    probe: Probe<'_>,
) -> Result<Detected<Accelerators>, VisibleDevicesError> {
    for (var, kind) in VISIBLE_DEVICE_VARS {
        let Some(value) = vars(var) else { continue };
        let devices = parse_visible_devices(var, &value)?;
        if devices.is_empty() {
            return Ok(Detected {
                value: Accelerators {
                    kind: AcceleratorKind::Cpu,
                    count: 0,
                },
                reason: format!("{var}={value:?} hides every device"),
            });
        }
        return Ok(Detected {
            value: Accelerators {
                kind,
                count: devices.len(),
            },
            reason: format!("{var}={value}"),
        });
    }
    let tools: [ToolProbe; 3] = [
        (
            "nvidia-smi",
            &["-L"],
            AcceleratorKind::Nvidia,
            count_nvidia_smi,
        ),
        (
            "rocm-smi",
            &["--showid"],
            AcceleratorKind::Amd,
            count_rocm_smi,
        ),
        (
            "xpu-smi",
            &["discovery"],
            AcceleratorKind::Intel,
            count_xpu_smi,
        ),
    ];
    for (tool, args, kind, count) in tools {
        if let Some(out) = probe(tool, args) {
            let n = count(&out);
            if n > 0 {
                return Ok(Detected {
                    value: Accelerators { kind, count: n },
                    reason: format!("`{tool} {}` lists {n}", args.join(" ")),
                });
            }
        }
    }
    Ok(Detected {
        value: Accelerators { kind: AcceleratorKind::Cpu, count: 0 },
        reason: "no visible-device variable, and nvidia-smi, rocm-smi, xpu-smi are absent or list no GPU".into(),
    })
}

/// The variable that gives one process its devices of `kind`, as the runtime reads it: for
/// AMD the one already set (`ROCR_VISIBLE_DEVICES` first, as detection reads them), else
/// `ROCR_VISIBLE_DEVICES`; `None` for CPU.
fn binding_var(
    kind: AcceleratorKind,
    vars: &dyn Fn(&str) -> Option<String>,
) -> Option<&'static str> {
    match kind {
        AcceleratorKind::Nvidia => Some("CUDA_VISIBLE_DEVICES"),
        AcceleratorKind::Amd => Some(
            ["ROCR_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES"]
                .into_iter()
                .find(|v| vars(v).is_some())
                .unwrap_or("ROCR_VISIBLE_DEVICES"),
        ),
        AcceleratorKind::Intel => Some("ZE_AFFINITY_MASK"),
        AcceleratorKind::Cpu => None,
    }
}

/// The device of local rank `local_rank`: the variable to set for that rank and its value,
/// one entry of the node's visible-device list (`vars`' current value of that variable, or
/// `0..count` when it is unset), chosen round-robin by local rank so that N ranks on N
/// GPUs get one each (more ranks than GPUs share them). `None` when there is nothing to
/// choose: a CPU node, or a single visible device (one GPU, or a scheduler that already
/// bound each task to its own, as `srun --gpus-per-task` does). A device then opens as
/// index 0 (`training.device = "cuda"`), whichever GPU it is.
pub fn device_for_local_rank(
    acc: Accelerators,
    vars: &dyn Fn(&str) -> Option<String>,
    local_rank: usize,
) -> Result<Option<(&'static str, String)>, VisibleDevicesError> {
    let Some(var) = binding_var(acc.kind, vars) else {
        return Ok(None);
    };
    let devices = match vars(var) {
        Some(value) => parse_visible_devices(var, &value)?,
        None => (0..acc.count).map(|i| i.to_string()).collect(),
    };
    if devices.len() < 2 {
        return Ok(None);
    }
    Ok(Some((var, devices[local_rank % devices.len()].clone())))
}

/// `kind:count` as `kiln launch` hands the detected accelerators to its ranks
/// ([`kiln_run::host::ACCELERATORS_ENV`]), so a rank's shim binds its device by the same
/// detection the launcher made.
pub fn accelerators_to_env(acc: Accelerators) -> String {
    format!("{}:{}", acc.kind.name(), acc.count)
}

/// Reads [`accelerators_to_env`]'s form back; `None` for anything else (then no binding).
pub fn accelerators_from_env(value: &str) -> Option<Accelerators> {
    let (kind, count) = value.trim().split_once(':')?;
    let kind = [
        AcceleratorKind::Nvidia,
        AcceleratorKind::Amd,
        AcceleratorKind::Intel,
        AcceleratorKind::Cpu,
    ]
    .into_iter()
    .find(|k| k.name() == kind)?;
    let count = count.parse().ok().filter(|&n| n <= MAX_VISIBLE_DEVICES)?;
    Some(Accelerators { kind, count })
}

/// The device binding of local rank `local_rank` under `kiln launch`: the accelerators the
/// launcher detected ([`kiln_run::host::ACCELERATORS_ENV`] in `vars`) split by
/// [`device_for_local_rank`]. `None` outside `kiln launch` or when there is nothing to choose.
pub fn rank_device(
    vars: &dyn Fn(&str) -> Option<String>,
    local_rank: usize,
) -> Result<Option<(&'static str, String)>, VisibleDevicesError> {
    match vars(kiln_run::host::ACCELERATORS_ENV).and_then(|v| accelerators_from_env(&v)) {
        Some(acc) => device_for_local_rank(acc, vars, local_rank),
        None => Ok(None),
    }
}

/// Set to `1`, asks `kiln launch` to make each rank its own NCCL host, so that several ranks
/// can share one GPU (for tests and benchmarks on a machine with fewer GPUs than ranks; never
/// on a real cluster). NCCL refuses two ranks of one communicator on one GPU ("Duplicate GPU
/// detected"): its check compares the host hash, taken from `NCCL_HOSTID`, and the bus id.
pub const RANKS_AS_NCCL_HOSTS: &str = "KILN_NCCL_RANKS_AS_HOSTS";

/// The variables rank `rank` gets when `vars` sets [`RANKS_AS_NCCL_HOSTS`] to `1`: its own
/// `NCCL_HOSTID` (`kiln-rank-<rank>`), and NCCL's socket transport over loopback, which is
/// what ranks on different "hosts" then use (`NCCL_SHM_DISABLE=1`, `NCCL_P2P_DISABLE=1`,
/// `NCCL_IB_DISABLE=1`, `NCCL_SOCKET_IFNAME=lo`; each only where `vars` does not set it
/// already). Empty otherwise.
pub fn ranks_as_nccl_hosts(
    vars: &dyn Fn(&str) -> Option<String>,
    rank: usize,
) -> Vec<(&'static str, String)> {
    if vars(RANKS_AS_NCCL_HOSTS).as_deref().map(str::trim) != Some("1") {
        return Vec::new();
    }
    let mut out = vec![("NCCL_HOSTID", format!("kiln-rank-{rank}"))];
    for (k, v) in [
        ("NCCL_SHM_DISABLE", "1"),
        ("NCCL_P2P_DISABLE", "1"),
        ("NCCL_IB_DISABLE", "1"),
        ("NCCL_SOCKET_IFNAME", "lo"),
    ] {
        if vars(k).is_none() {
            out.push((k, v.to_string()));
        }
    }
    out
}

/// `nvidia-smi -L`: one `GPU <i>: <name> (UUID: ...)` line per GPU (MIG lines are indented).
pub fn count_nvidia_smi(out: &str) -> usize {
    out.lines().filter(|l| l.starts_with("GPU ")).count()
}

/// `rocm-smi --showid`: several `GPU[<i>] : ...` lines per GPU; count distinct indices.
pub fn count_rocm_smi(out: &str) -> usize {
    let mut ids: Vec<&str> = out
        .lines()
        .filter_map(|l| l.trim_start().strip_prefix("GPU[")?.split(']').next())
        .collect();
    ids.sort_unstable();
    ids.dedup();
    ids.len()
}

/// `xpu-smi discovery`: a table with one `| <id> | Device Name: ... |` row per GPU.
pub fn count_xpu_smi(out: &str) -> usize {
    out.lines()
        .filter(|l| {
            let mut cells = l.split('|').map(str::trim).filter(|c| !c.is_empty());
            matches!((cells.next(), cells.next()), (Some(id), Some(info))
                if id.bytes().all(|b| b.is_ascii_digit()) && info.starts_with("Device Name"))
        })
        .count()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranks_become_nccl_hosts_only_when_asked() {
        let none = |_: &str| None;
        assert!(ranks_as_nccl_hosts(&none, 3).is_empty());
        let asked = |k: &str| match k {
            RANKS_AS_NCCL_HOSTS => Some("1".to_string()),
            "NCCL_SOCKET_IFNAME" => Some("eth0".to_string()),
            _ => None,
        };
        let got = ranks_as_nccl_hosts(&asked, 3);
        assert_eq!(got[0], ("NCCL_HOSTID", "kiln-rank-3".to_string()));
        assert!(got.contains(&("NCCL_SHM_DISABLE", "1".to_string())));
        assert!(got.contains(&("NCCL_P2P_DISABLE", "1".to_string())));
        // What the environment sets already stays.
        assert!(!got.iter().any(|(k, _)| *k == "NCCL_SOCKET_IFNAME"));
        let zero = |k: &str| (k == RANKS_AS_NCCL_HOSTS).then(|| "0".to_string());
        assert!(ranks_as_nccl_hosts(&zero, 0).is_empty());
    }
    use proptest::prelude::*;

    fn no_tools(_: &str, _: &[&str]) -> Option<String> {
        None
    }

    fn with(var: &'static str, value: &'static str) -> impl Fn(&str) -> Option<String> {
        move |k: &str| (k == var).then(|| value.to_string())
    }

    #[test]
    fn each_local_rank_gets_its_own_device() {
        let nvidia = |count| Accelerators {
            kind: AcceleratorKind::Nvidia,
            count,
        };
        let unset = |_: &str| None;
        let pick = |acc, vars: &dyn Fn(&str) -> Option<String>, r| {
            device_for_local_rank(acc, vars, r).unwrap()
        };
        for r in 0..4 {
            assert_eq!(
                pick(nvidia(4), &unset, r),
                Some(("CUDA_VISIBLE_DEVICES", r.to_string()))
            );
        }
        // More ranks than GPUs share them round-robin.
        assert_eq!(pick(nvidia(2), &unset, 3).unwrap().1, "1");
        // The entries of a set list are handed out, not indices.
        let listed = with("CUDA_VISIBLE_DEVICES", "4,6,GPU-8c1a");
        assert_eq!(pick(nvidia(3), &listed, 2).unwrap().1, "GPU-8c1a");
        // One device (or a scheduler that bound each task): nothing to choose.
        assert_eq!(pick(nvidia(1), &unset, 0), None);
        assert_eq!(pick(nvidia(4), &with("CUDA_VISIBLE_DEVICES", "3"), 1), None);
        let cpu = Accelerators {
            kind: AcceleratorKind::Cpu,
            count: 0,
        };
        assert_eq!(pick(cpu, &unset, 1), None);
        // AMD keeps the variable the job set; Intel uses Level Zero's mask.
        let amd = Accelerators {
            kind: AcceleratorKind::Amd,
            count: 2,
        };
        let hip = with("HIP_VISIBLE_DEVICES", "0,1");
        assert_eq!(
            pick(amd, &hip, 1),
            Some(("HIP_VISIBLE_DEVICES", "1".into()))
        );
        assert_eq!(
            pick(amd, &unset, 1),
            Some(("ROCR_VISIBLE_DEVICES", "1".into()))
        );
        let tiles = with("ZE_AFFINITY_MASK", "0.0,0.1");
        let intel = Accelerators {
            kind: AcceleratorKind::Intel,
            count: 2,
        };
        assert_eq!(pick(intel, &tiles, 1).unwrap().1, "0.1");
        // A malformed list is the same error detection gives.
        assert!(
            device_for_local_rank(nvidia(2), &with("CUDA_VISIBLE_DEVICES", "0,,1"), 0).is_err()
        );
    }

    #[test]
    fn accelerators_round_trip_through_the_environment() {
        for kind in [
            AcceleratorKind::Nvidia,
            AcceleratorKind::Amd,
            AcceleratorKind::Intel,
            AcceleratorKind::Cpu,
        ] {
            let acc = Accelerators { kind, count: 8 };
            assert_eq!(accelerators_from_env(&accelerators_to_env(acc)), Some(acc));
        }
        for bad in [
            "",
            "nvidia",
            "gpu:2",
            "nvidia:x",
            "nvidia:-1",
            "nvidia:100000",
        ] {
            assert_eq!(accelerators_from_env(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn visible_device_variables_win() {
        let d = detect_accelerators(&with("CUDA_VISIBLE_DEVICES", "0,1,2,3"), &no_tools).unwrap();
        assert_eq!(
            d.value,
            Accelerators {
                kind: AcceleratorKind::Nvidia,
                count: 4
            }
        );
        let d = detect_accelerators(&with("ZE_AFFINITY_MASK", "0.0,0.1"), &no_tools).unwrap();
        assert_eq!(d.value.kind, AcceleratorKind::Intel);
        // -1 or an empty value hides every GPU: a CPU job, even where nvidia-smi sees GPUs.
        let gpus = |_: &str, _: &[&str]| Some("GPU 0: A100\nGPU 1: A100\n".to_string());
        for hidden in ["-1", "", "NoDevFiles"] {
            let vars = move |k: &str| (k == "CUDA_VISIBLE_DEVICES").then(|| hidden.to_string());
            let d = detect_accelerators(&vars, &gpus).unwrap();
            assert_eq!(d.value.count, 0, "{hidden:?}");
            assert_eq!(d.value.kind, AcceleratorKind::Cpu, "{hidden:?}");
        }
    }

    #[test]
    fn malformed_lists_are_errors_naming_the_entry() {
        for (value, needle) in [
            ("GPU-zzz,,%%", "entry 1 (\"GPU-zzz\")"),
            ("0,,1", "entry 2 (\"\") is empty"),
            ("0,1,", "entry 3"),
            ("0,%%", "entry 2 (\"%%\")"),
            ("0,0", "repeats"),
            ("GPU-", "entry 1"),
        ] {
            let e = parse_visible_devices("CUDA_VISIBLE_DEVICES", value)
                .unwrap_err()
                .to_string();
            assert!(
                e.contains("CUDA_VISIBLE_DEVICES=") && e.contains(needle),
                "{value:?}: {e}"
            );
        }
        let e = detect_accelerators(&with("CUDA_VISIBLE_DEVICES", "GPU-zzz,,%%"), &no_tools)
            .unwrap_err()
            .to_string();
        assert!(e.contains("GPU-zzz"), "{e}");
        assert!(parse_visible_devices("ZE_AFFINITY_MASK", "0.x").is_err());
    }

    #[test]
    fn runtime_rules_for_negative_indices_and_uuids() {
        let p = |v| parse_visible_devices("CUDA_VISIBLE_DEVICES", v).unwrap();
        assert_eq!(p("0,2,-1,1"), ["0", "2"]);
        assert_eq!(p(" 3 , 1 "), ["3", "1"]);
        assert_eq!(
            p(
                "GPU-8c1a2b3c-1d2e-3f40-5a6b-7c8d9e0f1a2b,MIG-GPU-8c1a2b3c-1d2e-3f40-5a6b-7c8d9e0f1a2b/1/0"
            ),
            [
                "GPU-8c1a2b3c-1d2e-3f40-5a6b-7c8d9e0f1a2b",
                "MIG-GPU-8c1a2b3c-1d2e-3f40-5a6b-7c8d9e0f1a2b/1/0"
            ]
        );
        assert_eq!(
            parse_visible_devices("ZE_AFFINITY_MASK", "0.0,0.1,1")
                .unwrap()
                .len(),
            3
        );
    }

    fn device() -> impl Strategy<Value = String> {
        prop_oneof![
            (0u32..64).prop_map(|i| i.to_string()),
            "[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}".prop_map(|u| format!("GPU-{u}")),
        ]
    }

    proptest! {
        /// Any string: a count or an error, never a panic; a count never exceeds the entries.
        #[test]
        fn any_value_is_parsed_or_refused(value in ".{0,40}") {
            if let Ok(d) = parse_visible_devices("CUDA_VISIBLE_DEVICES", &value) {
                prop_assert!(d.len() <= value.split(',').count());
            }
        }

        /// A list of distinct valid devices counts exactly its entries, in order.
        #[test]
        fn valid_lists_count_every_device(devs in prop::collection::btree_set(device(), 1..10)) {
            let devs: Vec<String> = devs.into_iter().collect();
            let value = devs.join(",");
            prop_assert_eq!(parse_visible_devices("CUDA_VISIBLE_DEVICES", &value).unwrap(), devs);
        }

        /// An empty entry or a garbage entry anywhere before a terminator is an error
        /// naming its position.
        #[test]
        fn a_bad_entry_anywhere_is_named(
            devs in prop::collection::btree_set(device(), 1..8),
            at in 0usize..8,
            bad in prop_oneof![Just(String::new()), "[%#!@ zq]{1,4}", Just("GPU-zzz".to_string())],
        ) {
            let mut entries: Vec<String> = devs.into_iter().collect();
            let at = at.min(entries.len());
            entries.insert(at, bad);
            let value = entries.join(",");
            let e = parse_visible_devices("CUDA_VISIBLE_DEVICES", &value).unwrap_err();
            let needle = format!("entry {}", at + 1);
            prop_assert!(e.message.contains(&needle), "{}", e);
        }
    }

    #[test]
    fn tools_are_counted() {
        let probe = |tool: &str, _: &[&str]| {
            match tool {
            "rocm-smi" => Some("GPU[0]\t\t: Device ID: 0x740c\nGPU[0]\t\t: Device Rev: 0x01\nGPU[1]\t\t: Device ID: 0x740c\n".into()),
            _ => None,
        }
        };
        let d = detect_accelerators(&|_| None, &probe).unwrap();
        assert_eq!(
            d.value,
            Accelerators {
                kind: AcceleratorKind::Amd,
                count: 2
            }
        );
        assert_eq!(
            count_nvidia_smi(
                "GPU 0: A100 (UUID: x)\n  MIG 1g.5gb Device 0: (UUID: y)\nGPU 1: A100\n"
            ),
            2
        );
        let xpu = "+---+---+\n| Device ID | Device Information |\n+---+\n| 0 | Device Name: Intel Max 1550 |\n|   | Vendor Name: Intel |\n| 1 | Device Name: Intel Max 1550 |\n";
        assert_eq!(count_xpu_smi(xpu), 2);
        assert_eq!(
            detect_accelerators(&|_| None, &no_tools)
                .unwrap()
                .value
                .kind,
            AcceleratorKind::Cpu
        );
    }
}

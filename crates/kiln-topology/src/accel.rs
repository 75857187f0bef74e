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

/// Detects this node's accelerators from visible-device variables, then from
/// `nvidia-smi -L`, `rocm-smi --showid`, `xpu-smi discovery`; else CPU.
pub fn detect_accelerators(
    vars: &dyn Fn(&str) -> Option<String>,
    probe: Probe<'_>,
) -> Detected<Accelerators> {
    let visible: [(&str, AcceleratorKind); 4] = [
        ("CUDA_VISIBLE_DEVICES", AcceleratorKind::Nvidia),
        ("ROCR_VISIBLE_DEVICES", AcceleratorKind::Amd),
        ("HIP_VISIBLE_DEVICES", AcceleratorKind::Amd),
        ("ZE_AFFINITY_MASK", AcceleratorKind::Intel),
    ];
    for (var, kind) in visible {
        let Some(value) = vars(var) else { continue };
        let ids: Vec<&str> = value
            .split(',')
            .map(str::trim)
            .filter(|s| !s.is_empty())
            .collect();
        // CUDA treats "-1" (or any invalid id) as "hide everything": not a GPU job.
        if ids.is_empty() || ids[0].starts_with('-') {
            continue;
        }
        return Detected {
            value: Accelerators {
                kind,
                count: ids.len(),
            },
            reason: format!("{var}={value}"),
        };
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
                return Detected {
                    value: Accelerators { kind, count: n },
                    reason: format!("`{tool} {}` lists {n}", args.join(" ")),
                };
            }
        }
    }
    Detected {
        value: Accelerators { kind: AcceleratorKind::Cpu, count: 0 },
        reason: "no visible-device variable, and nvidia-smi, rocm-smi, xpu-smi are absent or list no GPU".into(),
    }
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

    fn no_tools(_: &str, _: &[&str]) -> Option<String> {
        None
    }

    #[test]
    fn visible_device_variables_win() {
        let vars = |k: &str| (k == "CUDA_VISIBLE_DEVICES").then(|| "0,1,2,3".to_string());
        let d = detect_accelerators(&vars, &no_tools);
        assert_eq!(
            d.value,
            Accelerators {
                kind: AcceleratorKind::Nvidia,
                count: 4
            }
        );
        let vars = |k: &str| (k == "ZE_AFFINITY_MASK").then(|| "0.0,0.1".to_string());
        assert_eq!(
            detect_accelerators(&vars, &no_tools).value.kind,
            AcceleratorKind::Intel
        );
        let vars = |k: &str| (k == "CUDA_VISIBLE_DEVICES").then(|| "-1".to_string());
        assert_eq!(
            detect_accelerators(&vars, &no_tools).value.kind,
            AcceleratorKind::Cpu
        );
    }

    #[test]
    fn tools_are_counted() {
        let probe = |tool: &str, _: &[&str]| {
            match tool {
            "rocm-smi" => Some("GPU[0]\t\t: Device ID: 0x740c\nGPU[0]\t\t: Device Rev: 0x01\nGPU[1]\t\t: Device ID: 0x740c\n".into()),
            _ => None,
        }
        };
        let d = detect_accelerators(&|_| None, &probe);
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
            detect_accelerators(&|_| None, &no_tools).value.kind,
            AcceleratorKind::Cpu
        );
    }
}

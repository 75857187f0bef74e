//! The bit-exact smoke gate: run N deterministic training steps, record every step's loss
//! and gradient norm as exact f32 bits plus the peak memory, and compare with a stored
//! baseline. Any difference in the numbers, even one unit in the last place, fails the gate:
//! it is how an upgrade of burn (or any dependency, or a refactor of the model) that changes
//! the numerics is caught within minutes instead of after a week of training.
//!
//! The baseline file (JSON) keeps the effective config it was made with; a run with a
//! different config is refused (the numbers would not be comparable) unless the caller asks
//! to compare anyway. Memory is compared with a tolerance, never exactly.
//!
//! Under several ranks (`kiln launch -- kiln smoke`, MPI) the gate runs the trainer's
//! data-parallel (and sharded) step on every rank; rank 0 records, compares and writes.
//! The number of ranks is part of what a baseline was made with: the average over the ranks
//! sums in another order, so a baseline is per rank count.
//!
//! A baseline is per device. On flex it is bits. On a CubeCL device (`cubecl-cpu`, `cuda`,
//! ...) burn picks some kernels per process by timing them (autotune), and candidates sum in
//! different orders, so two runs of the same config may differ in the last bits: a baseline
//! blessed there carries a relative `tolerance` (`kiln smoke --bless --tolerance 1e-3`),
//! which catches a changed computation but not a changed summation order.

use crate::{GatesError, io_err};
use kiln_train::{Config, Observer, StepMetrics, TrainOptions};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use std::path::Path;
use std::time::Instant;

/// Where a smoke run finds the baseline for the CPU it runs on.
#[derive(Debug)]
pub enum Baseline {
    /// The file to compare with, and its run.
    Found(std::path::PathBuf, SmokeRun),
    /// None for this CPU kind: the file named was blessed on another kind, whose SIMD
    /// kernels may sum in another order, and no baseline of this kind is beside it.
    OtherKind {
        /// The file given.
        given: std::path::PathBuf,
        /// Its run (blessed on `run.cpu`; a baseline for this kind takes its step count).
        run: Box<SmokeRun>,
        /// Where this kind's baseline would be ([`kind_path`]).
        wanted: std::path::PathBuf,
    },
}

/// The baseline of this CPU's kind for the file `path`: `path` itself when it was blessed on
/// this kind, or when it compares within a tolerance (a CubeCL device: the tolerance covers
/// the summation order); else `path`'s sibling for this kind ([`kind_path`]).
///
/// Bit-exact numerics depend on the SIMD level of the matrix products burn and gemm pick at
/// run time (AVX-512 and AVX2 kernels accumulate in different orders; kiln's own kernels do
/// not: 16 explicit lanes, no FMA): a baseline blessed with AVX-512 differed from an AVX2 run
/// by 1 ULP in a gradient norm. One baseline per CPU kind keeps the gate bit-exact on each.
pub fn baseline_for_this_cpu(path: &Path) -> Result<Baseline, GatesError> {
    let run = load(path)?;
    let here = cpu_description();
    if run.cpu == here || run.tolerance > 0.0 {
        return Ok(Baseline::Found(path.to_path_buf(), run));
    }
    let wanted = kind_path(path, &here);
    if wanted.exists() {
        let run = load(&wanted)?;
        return Ok(Baseline::Found(wanted, run));
    }
    Ok(Baseline::OtherKind {
        given: path.to_path_buf(),
        run: Box::new(run),
        wanted,
    })
}

/// The baseline file of CPU kind `cpu` beside `path`: `<stem>@<kind>.json`, the kind's
/// spaces as dashes (`gates/smoke-default@x86_64-avx2.json`).
pub fn kind_path(path: &Path, cpu: &str) -> std::path::PathBuf {
    let stem = path.file_stem().map(|s| s.to_string_lossy().into_owned());
    let ext = path.extension().map(|e| e.to_string_lossy().into_owned());
    let kind = cpu.replace(' ', "-");
    let name = match ext {
        Some(e) => format!("{}@{kind}.{e}", stem.unwrap_or_default()),
        None => format!("{}@{kind}", stem.unwrap_or_default()),
    };
    path.with_file_name(name)
}

/// Format tag of smoke baseline files.
pub const FORMAT: &str = "kiln-smoke/1";

/// One recorded step.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StepRecord {
    /// Optimizer step (1-based) as the trainer reported it.
    pub step: u64,
    /// Loss as f32 bits, hex (`0x40312345`): the value that is compared.
    pub loss_bits: String,
    /// Gradient norm (before clipping) as f32 bits, hex: compared.
    pub grad_norm_bits: String,
    /// The loss as a decimal, for people (not compared).
    pub loss: f32,
    /// The gradient norm as a decimal, for people (not compared).
    pub grad_norm: f32,
}

impl StepRecord {
    fn new(step: u64, loss: f32, grad_norm: f32) -> Self {
        Self {
            step,
            loss_bits: format!("{:#010x}", loss.to_bits()),
            grad_norm_bits: format!("{:#010x}", grad_norm.to_bits()),
            loss,
            grad_norm,
        }
    }
}

/// A smoke run: what is stored as a baseline and what a new run is compared with.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SmokeRun {
    /// Always [`FORMAT`].
    pub format: String,
    /// kiln version that made it.
    pub kiln_version: String,
    /// CPU architecture and the SIMD level kernels may pick at run time (informational:
    /// a baseline made on another CPU may legitimately differ).
    pub cpu: String,
    /// Steps run.
    pub steps: u64,
    /// SHA-256 of `config`.
    pub config_sha256: String,
    /// The effective config (TOML) the run used.
    pub config: String,
    /// Peak resident memory (VmHWM) of the process at the end, MiB (compared with a tolerance).
    pub peak_rss_mib: f64,
    /// Wall time of the training, seconds (informational).
    pub seconds: f64,
    /// Every step, in the order the trainer reported them.
    pub records: Vec<StepRecord>,
    /// Relative tolerance of the comparison: 0 (the default) compares bits; set when blessed
    /// on a device whose kernels are picked per process (see the module documentation).
    #[serde(default)]
    pub tolerance: f64,
    /// Data-parallel ranks the run trained on (baselines from before this field: one).
    #[serde(default = "one")]
    pub ranks: u64,
}

fn one() -> u64 {
    1
}

/// The config a smoke run of `steps` steps uses: `base` with `training.steps = steps`.
/// Checkpoint and eval cadence do not change the numerics, so they are set to "only at the
/// end" for speed.
pub fn smoke_config(base: &Config, steps: u64) -> Config {
    let mut c = base.clone();
    c.training.steps = steps;
    c.checkpoint.interval = 0;
    c.checkpoint.resume = false;
    c.eval.interval = 0;
    c
}

/// The CPU description stored in a baseline: the architecture and the SIMD level kernels
/// pick at run time (its kind, for [`baseline_for_this_cpu`]).
pub fn cpu_description() -> String {
    #[cfg(target_arch = "x86_64")]
    {
        let level = if std::arch::is_x86_feature_detected!("avx512f") {
            "avx512f"
        } else if std::arch::is_x86_feature_detected!("avx2") {
            "avx2"
        } else {
            "sse2"
        };
        format!("x86_64 {level}")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        std::env::consts::ARCH.to_string()
    }
}

struct Recorder<'a> {
    records: Vec<StepRecord>,
    progress: &'a mut dyn FnMut(&StepRecord),
}

impl Observer for Recorder<'_> {
    fn on_step(&mut self, m: &StepMetrics) {
        let r = StepRecord::new(m.step, m.loss, m.grad_norm);
        (self.progress)(&r);
        self.records.push(r);
    }
}

/// Runs `config` (already passed through [`smoke_config`]) in a temporary run directory and
/// records every step. `progress` sees each step as it completes. Under several ranks every
/// rank trains and only rank 0, the one that records, returns the run (`None` elsewhere).
pub fn run(
    config: &Config,
    progress: &mut dyn FnMut(&StepRecord),
) -> Result<Option<SmokeRun>, GatesError> {
    let ranks = kiln_topology::RankEnv::from_process_env()
        .map_err(|e| GatesError::Invalid(format!("rank environment: {e}")))?;
    let dir = tempfile::Builder::new()
        .prefix("kiln-smoke-")
        .tempdir()
        .map_err(io_err(&std::env::temp_dir()))?;
    let mut rec = Recorder {
        records: Vec::new(),
        progress,
    };
    let t0 = Instant::now();
    let opts = TrainOptions {
        config: config.clone(),
        run_dir: dir.path().to_path_buf(),
    };
    kiln_train::train(&opts, &mut rec)?;
    if ranks.rank != 0 {
        return Ok(None);
    }
    let text = config.to_toml();
    Ok(Some(SmokeRun {
        format: FORMAT.to_string(),
        kiln_version: env!("CARGO_PKG_VERSION").to_string(),
        cpu: cpu_description(),
        steps: config.training.steps,
        config_sha256: hex::encode(Sha256::digest(text.as_bytes())),
        config: text,
        peak_rss_mib: kiln_train::components::metrics::peak_rss_mib(),
        seconds: t0.elapsed().as_secs_f64(),
        records: rec.records,
        tolerance: 0.0,
        ranks: ranks.world_size as u64,
    }))
}

/// Checks a comparison tolerance: 0 (bits) or a positive relative difference below 1.
pub fn check_tolerance(tolerance: f64) -> Result<(), String> {
    if (0.0..1.0).contains(&tolerance) {
        Ok(())
    } else {
        Err(format!(
            "tolerance {tolerance}: must be 0 (compare bits) or a relative difference in (0, 1), e.g. 1e-3"
        ))
    }
}

/// Writes a run as a baseline file (pretty JSON, one record per line block).
pub fn save(run: &SmokeRun, path: &Path) -> Result<(), GatesError> {
    if let Some(parent) = path.parent().filter(|p| !p.as_os_str().is_empty()) {
        std::fs::create_dir_all(parent).map_err(io_err(parent))?;
    }
    let mut text =
        serde_json::to_string_pretty(run).map_err(|e| GatesError::Invalid(e.to_string()))?;
    text.push('\n');
    std::fs::write(path, text).map_err(io_err(path))
}

/// Reads and checks a baseline file.
pub fn load(path: &Path) -> Result<SmokeRun, GatesError> {
    let text = kiln_run::files::read_to_string_limited(
        path,
        64 * kiln_run::files::MIB,
        "a smoke baseline",
    )
    .map_err(io_err(path))?;
    let run: SmokeRun = serde_json::from_str(&text).map_err(|e| GatesError::Parse {
        path: path.to_path_buf(),
        line: e.line(),
        message: format!("not a kiln smoke baseline: {e}; re-create it with `kiln smoke --bless`"),
    })?;
    if run.format != FORMAT {
        return Err(GatesError::Parse {
            path: path.to_path_buf(),
            line: 0,
            message: format!(
                "format {:?}, this kiln reads {FORMAT:?}; re-create it with `kiln smoke --bless`",
                run.format
            ),
        });
    }
    if let Err(message) = check_tolerance(run.tolerance) {
        return Err(GatesError::Parse {
            path: path.to_path_buf(),
            line: 0,
            message,
        });
    }
    if run.steps == 0 {
        return Err(GatesError::Parse {
            path: path.to_path_buf(),
            line: 0,
            message: "steps 0: a baseline records at least one step; re-create it with `kiln smoke --bless`".into(),
        });
    }
    for r in &run.records {
        for bits in [&r.loss_bits, &r.grad_norm_bits] {
            if parse_bits(bits).is_none() {
                return Err(GatesError::Parse {
                    path: path.to_path_buf(),
                    line: 0,
                    message: format!(
                        "step {}: {bits:?} is not f32 bits as hex (0x + 8 hex digits)",
                        r.step
                    ),
                });
            }
        }
    }
    Ok(run)
}

/// `0x40312345` -> the f32 bits.
pub fn parse_bits(s: &str) -> Option<u32> {
    let hex = s.strip_prefix("0x")?;
    if hex.len() != 8 {
        return None;
    }
    u32::from_str_radix(hex, 16).ok()
}

/// Distance in units in the last place between two f32 bit patterns (0 = identical bits;
/// +0 and -0 are 1 apart; NaNs compare by their bits).
pub fn ulp_distance(a: u32, b: u32) -> u64 {
    // Map sign-magnitude to a monotonic integer line.
    let key = |x: u32| -> i64 {
        if x & 0x8000_0000 != 0 {
            -i64::from(x & 0x7FFF_FFFF) - 1
        } else {
            i64::from(x)
        }
    };
    key(a).abs_diff(key(b))
}

/// Keys (`section.key`) whose values differ between two config TOML texts, with both values.
pub fn config_differences(a: &str, b: &str) -> Vec<(String, String, String)> {
    use std::collections::BTreeMap;
    fn flatten(prefix: &str, v: &toml::Value, out: &mut BTreeMap<String, String>) {
        match v {
            toml::Value::Table(t) => {
                for (k, v) in t {
                    let key = if prefix.is_empty() {
                        k.clone()
                    } else {
                        format!("{prefix}.{k}")
                    };
                    flatten(&key, v, out);
                }
            }
            other => {
                out.insert(prefix.to_string(), other.to_string());
            }
        }
    }
    // Each side as the effective config it stands for: a key added to kiln after a baseline
    // was blessed compares at its default (the baseline ran with that behaviour).
    let parse = |text: &str| {
        let effective = kiln_train::Config::from_toml(text, "smoke baseline")
            .map(|c| c.to_toml())
            .unwrap_or_else(|_| text.to_string());
        let mut out = BTreeMap::new();
        if let Ok(t) = effective.parse::<toml::Table>() {
            flatten("", &toml::Value::Table(t), &mut out);
        }
        out
    };
    let (fa, fb) = (parse(a), parse(b));
    let mut keys: Vec<&String> = fa.keys().chain(fb.keys()).collect();
    keys.sort();
    keys.dedup();
    keys.into_iter()
        .filter(|k| fa.get(*k) != fb.get(*k))
        .map(|k| {
            let v = |m: &BTreeMap<String, String>| {
                m.get(k).cloned().unwrap_or_else(|| "(absent)".into())
            };
            (k.clone(), v(&fa), v(&fb))
        })
        .collect()
}

/// What differs between a baseline and a new run.
#[derive(Debug, Clone, PartialEq)]
pub enum Verdict {
    /// Every recorded value is bit-identical and memory is within tolerance.
    Identical,
    /// The configs differ: the runs are not comparable. Each entry: key, baseline value, run value.
    ConfigMismatch(Vec<(String, String, String)>),
    /// A number differs.
    NumericsDiffer {
        /// First differing step.
        step: u64,
        /// `loss` or `grad_norm`.
        quantity: &'static str,
        /// Baseline bits.
        baseline: u32,
        /// New bits.
        run: u32,
        /// How many recorded values differ in all.
        differing_values: usize,
    },
    /// The runs have different numbers of recorded steps (a guard rolled back in one only).
    LengthDiffers {
        /// Records in the baseline.
        baseline: usize,
        /// Records in the run.
        run: usize,
    },
    /// Peak memory grew beyond the tolerance.
    MemoryGrew {
        /// Baseline MiB.
        baseline: f64,
        /// Run MiB.
        run: f64,
        /// The allowed relative growth.
        tolerance: f64,
    },
}

/// Checks a memory tolerance: a finite number (negative disables the memory check). NaN
/// would silently disable it (every comparison with NaN is false).
pub fn check_mem_tolerance(mem_tolerance: f64) -> Result<(), GatesError> {
    if mem_tolerance.is_finite() {
        Ok(())
    } else {
        Err(GatesError::Usage(format!(
            "--mem-tolerance {mem_tolerance}: must be a finite number (0.25 allows 25 % growth; a negative value disables the memory check)"
        )))
    }
}

/// Which differences between a run's setup and its baseline's a comparison accepts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Setup {
    /// None: the same config and rank count (the default).
    Same,
    /// The layout's (`parallelism.*` keys and the rank count): the same training on other
    /// ranks, compared within the baseline's tolerance, which must not be 0.
    Layout,
    /// Any (`--ignore-config`).
    Any,
}

/// The report that refuses a run of `config` (its TOML) on `ranks` ranks against `baseline`
/// (read from `path`) before it starts, when their setups differ beyond what `setup`
/// accepts; `None` when they agree.
pub fn refuse_config(
    baseline: &SmokeRun,
    config: &str,
    ranks: u64,
    path: &Path,
    setup: Setup,
) -> Option<String> {
    let planned = SmokeRun {
        config: config.to_string(),
        ranks,
        ..baseline.clone()
    };
    let diffs = setup_differences(baseline, &planned, setup);
    if diffs.is_empty() {
        return None;
    }
    Some(report(
        &Verdict::ConfigMismatch(diffs),
        baseline,
        &planned,
        path,
    ))
}

/// How the setups of two runs differ beyond what `setup` accepts: their configs' keys, and
/// the number of ranks (`ranks`), whose average sums in another order. A layout comparison
/// against a baseline that compares bits is itself a difference: another layout sums in
/// another order.
fn setup_differences(
    baseline: &SmokeRun,
    run: &SmokeRun,
    setup: Setup,
) -> Vec<(String, String, String)> {
    let mut diffs = match setup {
        Setup::Any => return Vec::new(),
        Setup::Same => config_differences(&baseline.config, &run.config),
        Setup::Layout => config_differences(&baseline.config, &run.config)
            .into_iter()
            .filter(|(key, _, _)| !key.starts_with("parallelism."))
            .collect(),
    };
    if setup == Setup::Same && baseline.ranks != run.ranks {
        let (b, r) = (baseline.ranks.to_string(), run.ranks.to_string());
        diffs.push(("ranks (data-parallel)".to_string(), b, r));
    }
    if setup == Setup::Layout && baseline.tolerance == 0.0 {
        diffs.push((
            "tolerance (a layout comparison needs a baseline blessed with --tolerance)".into(),
            "0 (bits)".into(),
            "> 0".into(),
        ));
    }
    diffs
}

/// Compares `run` with `baseline`; `setup`: which differences of config and rank count are
/// accepted. `mem_tolerance`: allowed relative growth of peak memory (0.25 = 25 %; negative
/// disables).
pub fn compare(baseline: &SmokeRun, run: &SmokeRun, setup: Setup, mem_tolerance: f64) -> Verdict {
    let differences = setup_differences(baseline, run, setup);
    if !differences.is_empty() {
        return Verdict::ConfigMismatch(differences);
    }
    let mut first = None;
    let mut differing = 0usize;
    for (b, r) in baseline.records.iter().zip(&run.records) {
        for (quantity, bb, rb) in [
            ("loss", &b.loss_bits, &r.loss_bits),
            ("grad_norm", &b.grad_norm_bits, &r.grad_norm_bits),
        ] {
            let (bb, rb) = (parse_bits(bb).unwrap_or(0), parse_bits(rb).unwrap_or(0));
            if differs(bb, rb, baseline.tolerance) {
                differing += 1;
                if first.is_none() {
                    first = Some((b.step, quantity, bb, rb));
                }
            }
        }
    }
    if let Some((step, quantity, baseline, run)) = first {
        return Verdict::NumericsDiffer {
            step,
            quantity,
            baseline,
            run,
            differing_values: differing,
        };
    }
    if baseline.records.len() != run.records.len() {
        return Verdict::LengthDiffers {
            baseline: baseline.records.len(),
            run: run.records.len(),
        };
    }
    // Another layout holds another share of the model: its memory is not the baseline's.
    let mem_checked = mem_tolerance >= 0.0 && setup != Setup::Layout;
    if mem_checked && run.peak_rss_mib > baseline.peak_rss_mib * (1.0 + mem_tolerance) {
        return Verdict::MemoryGrew {
            baseline: baseline.peak_rss_mib,
            run: run.peak_rss_mib,
            tolerance: mem_tolerance,
        };
    }
    Verdict::Identical
}

/// Whether the f32 values of bits `b` (baseline) and `r` differ: in any bit, or with a
/// tolerance by more than `tolerance` times `|b|` (a NaN on either side differs unless both
/// have the same bits).
fn differs(b: u32, r: u32, tolerance: f64) -> bool {
    if b == r {
        return false;
    }
    let (b, r) = (f64::from(f32::from_bits(b)), f64::from(f32::from_bits(r)));
    let within = (r - b).abs() <= tolerance * b.abs(); // false when either is NaN
    tolerance == 0.0 || !within
}

/// A human-readable report of a verdict (several lines; the first says pass or FAIL).
pub fn report(
    verdict: &Verdict,
    baseline: &SmokeRun,
    run: &SmokeRun,
    baseline_path: &Path,
) -> String {
    let bp = baseline_path.display();
    let mem = format!(
        "peak memory {:.1} MiB (baseline {:.1} MiB)",
        run.peak_rss_mib, baseline.peak_rss_mib
    );
    let cpu_note = if baseline.cpu != run.cpu {
        format!(
            "\nnote: the baseline was made on a different CPU ({}; this one: {}): SIMD kernels chosen at run time can change the last bits",
            baseline.cpu, run.cpu
        )
    } else {
        String::new()
    };
    match verdict {
        Verdict::Identical if baseline.tolerance > 0.0 => format!(
            "smoke: PASS: {} steps within {:e} (relative) of {bp} (loss and grad_norm); {mem}; {:.1}s",
            run.records.len(),
            baseline.tolerance,
            run.seconds
        ),
        Verdict::Identical => format!(
            "smoke: PASS: {} steps bit-identical to {bp} (loss and grad_norm); {mem}; {:.1}s",
            run.records.len(),
            run.seconds
        ),
        Verdict::ConfigMismatch(diffs) => {
            let mut s = format!(
                "smoke: FAIL: the config differs from the one {bp} was made with, so the numbers are not comparable:\n"
            );
            for (k, b, r) in diffs {
                s.push_str(&format!("  {k}: baseline {b}, this run {r}\n"));
            }
            s.push_str(
                "use the baseline's config (its `config` field), re-bless with --bless, or pass --ignore-config to compare anyway",
            );
            s
        }
        Verdict::NumericsDiffer {
            step,
            quantity,
            baseline: b,
            run: r,
            differing_values,
        } => {
            let (bf, rf) = (f32::from_bits(*b), f32::from_bits(*r));
            let by = match baseline.tolerance {
                0.0 => String::new(),
                t => format!(" by more than {t:e} (relative)"),
            };
            format!(
                "smoke: FAIL: numerics differ from {bp}{by}\n  first differing step: {step} ({quantity})\n  baseline: {bf:e} ({b:#010x})\n  this run: {rf:e} ({r:#010x})\n  difference: {} ULPs ({:+e})\n  {differing_values} of {} recorded values differ; {mem}{cpu_note}\n  if the change is intended, re-bless with `kiln smoke --bless --baseline {bp}` and commit the file",
                ulp_distance(*b, *r),
                f64::from(rf) - f64::from(bf),
                2 * baseline.records.len().min(run.records.len()),
            )
        }
        Verdict::LengthDiffers {
            baseline: b,
            run: r,
        } => format!(
            "smoke: FAIL: the baseline {bp} has {b} recorded steps, this run {r} (a guard rolled back or skipped in one of them); {mem}"
        ),
        Verdict::MemoryGrew {
            baseline: b,
            run: r,
            tolerance,
        } => format!(
            "smoke: FAIL: numerics bit-identical, but peak memory grew from {b:.1} MiB to {r:.1} MiB (+{:.0} %, tolerance {:.0} %) against {bp}",
            (r / b - 1.0) * 100.0,
            tolerance * 100.0
        ),
    }
}

#[cfg(test)]
mod kind_tests {
    use super::*;

    #[test]
    fn each_cpu_kind_has_its_baseline_beside_the_given_one() {
        let p = Path::new("gates/smoke-default.json");
        assert_eq!(
            kind_path(p, "x86_64 avx2"),
            Path::new("gates/smoke-default@x86_64-avx2.json")
        );
        assert_eq!(kind_path(Path::new("b"), "aarch64"), Path::new("b@aarch64"));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ulps() {
        let one = 1.0f32.to_bits();
        assert_eq!(ulp_distance(one, one), 0);
        assert_eq!(ulp_distance(one, one + 1), 1);
        assert_eq!(ulp_distance(one + 3, one), 3);
        assert_eq!(ulp_distance(0.0f32.to_bits(), (-0.0f32).to_bits()), 1);
        let tiny = f32::from_bits(1);
        assert_eq!(ulp_distance(tiny.to_bits(), (-tiny).to_bits()), 3);
    }

    #[test]
    fn bits_round_trip() {
        let r = StepRecord::new(1, 2.5, 0.1);
        assert_eq!(parse_bits(&r.loss_bits), Some(2.5f32.to_bits()));
        assert_eq!(parse_bits("0x1234"), None);
        assert_eq!(parse_bits("40200000"), None);
    }

    #[test]
    fn config_diff_names_keys() {
        let a = "[training]\nseed = 1\nsteps = 3\n[model]\nd_model = 8\n";
        let b = "[training]\nseed = 7\nsteps = 3\n[model]\nd_model = 8\n";
        assert_eq!(
            config_differences(a, b),
            vec![(
                "training.seed".to_string(),
                "1".to_string(),
                "7".to_string()
            )]
        );
    }

    fn fake(values: &[(f32, f32)]) -> SmokeRun {
        SmokeRun {
            format: FORMAT.into(),
            kiln_version: "x".into(),
            cpu: "x".into(),
            steps: values.len() as u64,
            config_sha256: String::new(),
            config: "[training]\nsteps = 2\n".into(),
            peak_rss_mib: 100.0,
            seconds: 1.0,
            tolerance: 0.0,
            ranks: 1,
            records: values
                .iter()
                .enumerate()
                .map(|(i, &(l, g))| StepRecord::new(i as u64 + 1, l, g))
                .collect(),
        }
    }

    #[test]
    fn a_baseline_of_another_rank_count_is_refused_by_name() {
        let one = fake(&[(2.0, 1.0)]);
        let two = SmokeRun {
            ranks: 2,
            ..one.clone()
        };
        let Verdict::ConfigMismatch(diffs) = compare(&one, &two, Setup::Same, 0.25) else {
            panic!("not refused");
        };
        assert_eq!(
            diffs,
            [("ranks (data-parallel)".into(), "1".into(), "2".into())]
        );
        let refusal =
            refuse_config(&one, &one.config, 3, Path::new("b.json"), Setup::Same).unwrap();
        assert!(
            refusal.contains("ranks (data-parallel): baseline 1, this run 3"),
            "{refusal}"
        );
        assert!(refuse_config(&one, &one.config, 1, Path::new("b.json"), Setup::Same).is_none());
        // A baseline written before the field existed was made on one rank.
        let mut old = serde_json::to_value(&one).unwrap();
        old.as_object_mut().unwrap().remove("ranks");
        let old: SmokeRun = serde_json::from_value(old).unwrap();
        assert_eq!(old.ranks, 1);
    }

    #[test]
    fn first_difference_is_reported_with_ulps() {
        let a = fake(&[(2.0, 1.0), (1.5, 0.5)]);
        let b = fake(&[(2.0, 1.0), (f32::from_bits(1.5f32.to_bits() + 2), 0.5)]);
        assert_eq!(compare(&a, &a, Setup::Same, 0.25), Verdict::Identical);
        let v = compare(&a, &b, Setup::Same, 0.25);
        let text = report(&v, &a, &b, Path::new("base.json"));
        assert!(text.contains("first differing step: 2 (loss)"), "{text}");
        assert!(text.contains("2 ULPs"), "{text}");
        let mut c = a.clone();
        c.peak_rss_mib = 200.0;
        assert!(matches!(
            compare(&a, &c, Setup::Same, 0.25),
            Verdict::MemoryGrew { .. }
        ));
        // With a tolerance, a difference within it passes and one beyond it fails.
        let mut tolerant = a.clone();
        tolerant.tolerance = 1e-6;
        assert_eq!(
            compare(&tolerant, &b, Setup::Same, 0.25),
            Verdict::Identical
        );
        let text = report(&Verdict::Identical, &tolerant, &b, Path::new("b"));
        assert!(text.contains("within 1e-6 (relative)"), "{text}");
        tolerant.tolerance = 1e-9;
        let v = compare(&tolerant, &b, Setup::Same, 0.25);
        assert!(
            matches!(v, Verdict::NumericsDiffer { step: 2, .. }),
            "{v:?}"
        );
        let text = report(&v, &tolerant, &b, Path::new("b"));
        assert!(text.contains("by more than 1e-9 (relative)"), "{text}");
        let nan = fake(&[(2.0, 1.0), (f32::NAN, 0.5)]);
        tolerant.tolerance = 0.5;
        assert!(matches!(
            compare(&tolerant, &nan, Setup::Same, 0.25),
            Verdict::NumericsDiffer { .. }
        ));
        assert!(check_tolerance(0.0).is_ok() && check_tolerance(1e-3).is_ok());
        for bad in [-1e-3, 1.0, f64::NAN, f64::INFINITY] {
            assert!(check_tolerance(bad).is_err(), "{bad}");
        }
        let mut d = a.clone();
        d.config = "[training]\nsteps = 3\n".into();
        let text = report(&compare(&a, &d, Setup::Same, 0.25), &a, &d, Path::new("b"));
        assert!(
            text.contains("training.steps: baseline 2, this run 3"),
            "{text}"
        );
    }
}

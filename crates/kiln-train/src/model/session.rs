//! [`Session`]: a model and its parameters on a device, built from a config. What training,
//! the gates, eval and export all start from; it needs no training data (the vocabulary is
//! given, or read from the weights).

use crate::checkpoint::HostTensor;
use crate::config::Config;
use crate::error::TrainError;
use crate::model::{Llama, dtype_of};
use crate::tensor::{DeviceTensor, int_tensor, target_tensor};
use burn::tensor::{Device, Tensor, TensorData};
use sha2::{Digest, Sha256};
use std::ops::Range;
use std::path::Path;

/// The model, its parameters and the device they live on.
pub struct Session {
    /// The effective config.
    pub config: Config,
    /// Device the tensors live on.
    pub device: Device,
    /// Model structure.
    pub model: Llama,
    /// Parameters (flat, in `model.specs()` order), without autodiff, in the master dtype
    /// (`training.master_dtype`).
    pub params: Vec<Tensor<1>>,
}

pub(crate) fn sha256_hex(text: &str) -> String {
    hex::encode(Sha256::digest(text.as_bytes()))
}

/// Parses a device name (`flex`, `cuda:0`, `rocm:1`, `vulkan`, `wgpu`, `metal`,
/// `cubecl-cpu`: CubeCL's CPU runtime, the GPU code path on the host). `cpu` is `flex`.
pub fn parse_device(name: &str) -> Result<Device, TrainError> {
    let (kind, index) = match name.split_once(':') {
        Some((k, i)) => {
            let idx: usize = i.parse().map_err(|_| {
                TrainError::Device(name.into(), "index after ':' must be a number".into())
            })?;
            (k, idx)
        }
        None => (name, 0),
    };
    let _ = index;
    let not_built = |feature: &str| {
        TrainError::Device(
            name.into(),
            format!(
                "this kiln was built without the `{feature}` feature; rebuild with `cargo build --release --features {feature}`"
            ),
        )
    };
    match kind {
        "flex" | "cpu" => Ok(Device::flex()),
        #[cfg(feature = "cuda")]
        "cuda" => cuda_present(index)
            .map(|()| Device::cuda(index))
            .map_err(|why| TrainError::Device(name.into(), why)),
        #[cfg(feature = "rocm")]
        "rocm" => Ok(Device::rocm(index)),
        #[cfg(feature = "vulkan")]
        "vulkan" => Ok(Device::vulkan(Default::default())),
        #[cfg(feature = "wgpu")]
        "wgpu" => Ok(Device::wgpu(Default::default())),
        #[cfg(feature = "metal")]
        "metal" => Ok(Device::metal(Default::default())),
        #[cfg(feature = "cubecl-cpu")]
        "cubecl-cpu" => Ok(Device::cpu()),
        // A guard, not a pattern: with a GPU feature on, its name is matched above and a
        // pattern listing it here would be unreachable (a warning in that build).
        k if ["cuda", "rocm", "vulkan", "wgpu", "metal", "cubecl-cpu"].contains(&k) => {
            Err(not_built(k))
        }
        _ => Err(TrainError::Device(
            name.into(),
            "unknown device; use flex, cuda:N, rocm:N, vulkan, wgpu, metal or cubecl-cpu".into(),
        )),
    }
}

/// A guess of the dense peak FLOP/s of the device `name` (a `training.device`) in the compute
/// type `dtype`, for the MFU estimate when `training.peak_flops` is 0. The host (flex,
/// CubeCL's CPU runtime): 80 GFLOP/s a thread of `threads` (32 f32 FLOP a cycle, two AVX2 FMA
/// units, at 2.5 GHz). CUDA GPUs by name: the bf16 tensor-core peak, half of it in f32 (burn's
/// f32 matmul takes TF32 there). `None` for other accelerators: kiln does not know their peak.
pub fn guess_peak_flops(
    name: &str,
    dtype: crate::config::Precision,
    threads: usize,
) -> Option<f64> {
    let kind = name.split(':').next().unwrap_or(name);
    if !crate::budget::on_accelerator(kind) {
        return Some(threads as f64 * 80e9);
    }
    let bf16 = gpu_bf16_peak(name)?;
    Some(match dtype {
        crate::config::Precision::Bf16 => bf16,
        crate::config::Precision::F32 => bf16 / 2.0,
    })
}

/// Dense bf16 tensor-core peaks (FLOP/s, with f32 accumulation) of data-centre GPUs, matched in
/// order against the device's name (the first that it contains).
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
const GPU_BF16_PEAKS: &[(&str, f64)] = &[
    ("H100 PCIe", 756e12),
    ("H100", 989e12),
    ("H200", 989e12),
    ("H800", 989e12),
    ("B200", 2250e12),
    ("B100", 1750e12),
    ("A100", 312e12),
    ("A800", 312e12),
    ("L40S", 362e12),
];

/// The bf16 peak of the CUDA device `name` (`cuda`, `cuda:N`), by its name from the driver.
fn gpu_bf16_peak(name: &str) -> Option<f64> {
    #[cfg(feature = "cuda")]
    if let Some(("cuda", index)) = name.split_once(':').or(Some((name, "0"))) {
        use cudarc::driver::result;
        let ordinal = index.parse::<i32>().ok()?;
        // SAFETY: only probes for the library (dlopen), calls nothing in it.
        if !unsafe { cudarc::driver::sys::is_culib_present() } {
            return None;
        }
        result::init().ok()?;
        let gpu = result::device::get_name(result::device::get(ordinal).ok()?).ok()?;
        return bf16_peak_of(&gpu);
    }
    let _ = name;
    None
}

/// The bf16 peak of the GPU the driver calls `gpu` ([`GPU_BF16_PEAKS`]).
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
fn bf16_peak_of(gpu: &str) -> Option<f64> {
    GPU_BF16_PEAKS
        .iter()
        .find(|(model, _)| gpu.contains(model))
        .map(|&(_, peak)| peak)
}

/// Whether CUDA GPU `index` is there, asked of the driver before CubeCL opens it (CubeCL
/// panics in its device thread when the driver or the GPU is missing).
#[cfg(feature = "cuda")]
fn cuda_present(index: usize) -> Result<(), String> {
    use cudarc::driver::result;
    let visible = std::env::var("CUDA_VISIBLE_DEVICES").unwrap_or_else(|_| "unset".into());
    // SAFETY: only probes for the library (dlopen), calls nothing in it.
    if !unsafe { cudarc::driver::sys::is_culib_present() } {
        return Err(
            "the CUDA driver library (libcuda.so) was not found: is this a GPU host with \
                    NVIDIA's driver installed?"
                .into(),
        );
    }
    result::init().map_err(|e| {
        format!("the CUDA driver (libcuda) did not start: {e:?}; is this a GPU host?")
    })?;
    let count = result::device::get_count().map_err(|e| format!("CUDA device count: {e:?}"))?;
    if index >= count.max(0) as usize {
        return Err(format!(
            "the driver sees {count} CUDA GPU(s) (CUDA_VISIBLE_DEVICES={visible}), so there is no GPU {index}"
        ));
    }
    Ok(())
}

/// Keeps freed tensor memory in the process for reuse instead of returning it to the kernel
/// (glibc only; elsewhere a no-op).
///
/// Why: every step allocates and frees the same few hundred MB of activations and
/// gradients. With glibc's defaults, buffers above the (adaptive, at most 32 MB) mmap
/// threshold are mmap'd and unmapped each time, and worker threads allocate from their own
/// arenas, whose heaps are trimmed as they empty, so each step page-faults its memory back
/// in, zero-filled by the kernel: ~110,000 faults per step on the benchmark model, 13% of
/// the step. One arena (the allocations are few and large, so the lock is not contended),
/// the highest mmap threshold and no trimming bring that to ~15,000. The peak RSS is the
/// same; the RSS just stays at the peak between steps.
pub fn tune_allocator() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: mallopt only changes allocator parameters; it is called before the thread
    // pool starts, and glibc allows it at any time.
    unsafe {
        libc::mallopt(libc::M_ARENA_MAX, 1);
        libc::mallopt(libc::M_MMAP_THRESHOLD, 32 << 20);
        libc::mallopt(libc::M_TRIM_THRESHOLD, i32::MAX);
    }
}

/// On CubeCL devices, keeps this process's CubeCL cache (autotune decisions and compiled
/// kernels) in the run directory, one file a rank ([`kiln_run::layout::device_cache`]), before
/// the device is first used. Autotune times its candidate kernels and keeps the fastest; a
/// resumed process that timed them afresh could pick another kernel with another summation
/// order and leave the run it continues by a few bits. Reading the choices back makes resume
/// exact by construction, and skips the tuning and compiling. A cache that cannot be written
/// degrades to memory (CubeCL's behaviour). Nothing to do on flex.
pub fn keep_device_cache(config: &Config, run_dir: &Path, rank: usize) {
    #[cfg(feature = "cube")]
    if !matches!(config.training.device.as_str(), "flex" | "cpu") {
        use cubecl::config::{CubeClRuntimeConfig, RuntimeConfig};
        // CubeCL's runtime config, loaded on first use, activates its own environment (and
        // would undo the mount below if it loaded later): load it first.
        let _ = CubeClRuntimeConfig::get();
        cubecl::environment::load(run_dir.join(kiln_run::layout::device_cache(rank)));
        tracing::debug!(path = %cubecl::environment::path().display(), "device cache");
    }
    #[cfg(not(feature = "cube"))]
    let _ = (config, run_dir, rank);
}

/// Sets the CPU thread count of the flex backend (rayon's global pool). Only the first call
/// in a process takes effect; see [`crate::budget::start_threads`].
pub fn set_threads(threads: usize) -> Result<(), TrainError> {
    Ok(crate::budget::start_threads(threads)?)
}

impl Session {
    /// Builds the model for `vocab` tokens with fresh parameters drawn from the seed, for one
    /// rank alone (tools, tests; a job's ranks: [`Session::for_rank_of`]).
    pub fn new(config: &Config, vocab: usize) -> Result<Self, TrainError> {
        Self::for_rank_of(config, vocab, 1)
    }

    /// [`Session::new`] for one rank of a job of `ranks` ranks, whose share of the model and
    /// its state the memory checks count.
    pub fn for_rank_of(config: &Config, vocab: usize, ranks: usize) -> Result<Self, TrainError> {
        config.validate()?;
        // The memory of the model, its optimizer and a step, before any of it is allocated.
        crate::budget::check(config, vocab, ranks)?;
        // And of the device, on an accelerator whose memory is known.
        crate::budget::check_device(config, vocab, ranks)?;
        tune_allocator();
        set_threads(config.training.threads)?;
        crate::kernels::settings::configure(crate::kernels::settings::Settings::of(config));
        let device = parse_device(&config.training.device)?;
        let model = Llama::new(&config.model, vocab).with_compute(config.training.dtype);
        let master = dtype_of(config.training.master_dtype);
        let params = model
            .init(config.training.seed, &device)
            .into_iter()
            .map(|p| p.cast(master))
            .collect();
        Ok(Self {
            config: config.clone(),
            device,
            model,
            params,
        })
    }

    /// Builds the model for trained weights: the vocabulary is read from the embedding's
    /// shape (or, for weights assembled from a parameter-sharded checkpoint, which are flat,
    /// from its size over `model.d_model`), so no training data is needed (eval, export).
    pub fn from_weights(
        config: &Config,
        tensors: &[HostTensor],
        origin: &Path,
    ) -> Result<Self, TrainError> {
        let probe = Llama::new(&config.model, 1);
        let embed_name = &probe.specs()[0].name;
        let mismatch = |reason: String| TrainError::ResumeMismatch {
            path: origin.to_path_buf(),
            reason,
        };
        let embed = tensors
            .iter()
            .find(|t| &t.name == embed_name)
            .ok_or_else(|| mismatch(format!("tensor {embed_name} is missing")))?;
        let d = config.model.d_model.max(1);
        let vocab = match embed.shape.as_slice() {
            [n] if n % d == 0 => n / d,
            [n] => {
                return Err(mismatch(format!(
                    "tensor {embed_name} has {n} elements, not a multiple of model.d_model = {d}"
                )));
            }
            shape => shape.first().copied().unwrap_or(0),
        };
        let mut s = Self::new(config, vocab)?;
        s.load_params(tensors, origin)?;
        Ok(s)
    }

    /// Hash of what fixes parameter shapes (model section and vocab).
    pub fn model_hash(&self) -> String {
        let mut m = self.config.model.clone();
        m.vocab_size = self.model.vocab();
        // init values do not change shapes: a resumed run may use another init std
        m.init_std = 0.0;
        m.scale_residual_init = false;
        // where the starting weights came from does not change shapes either
        m.init_from = String::new();
        sha256_hex(&toml::to_string(&m).unwrap_or_default())
    }

    /// The same model with other parameters (an optimizer's published weights to evaluate or
    /// save: [`crate::optim::Optimizer::published`]).
    pub fn with_params(&self, params: Vec<Tensor<1>>) -> Self {
        Self {
            config: self.config.clone(),
            device: self.device.clone(),
            model: self.model.clone(),
            params,
        }
    }

    /// Parameters as named host tensors (logical shapes).
    pub fn host_params(&self) -> Vec<HostTensor> {
        self.named_params()
            .iter()
            .map(DeviceTensor::to_host)
            .collect()
    }

    /// Parameters as named tensors on the device (references, no copy).
    pub fn named_params(&self) -> Vec<DeviceTensor> {
        self.named(&self.params)
    }

    /// `tensors` (one per parameter, in `model.specs()` order) under the parameters' names.
    pub fn named(&self, tensors: &[Tensor<1>]) -> Vec<DeviceTensor> {
        self.model
            .specs()
            .iter()
            .zip(tensors)
            .map(|(s, t)| DeviceTensor {
                name: s.name.clone(),
                shape: s.shape.clone(),
                tensor: t.clone(),
            })
            .collect()
    }

    /// Loads weights (by name) from host tensors; every parameter must be present with its
    /// shape. They are stored in the master dtype (f32 weights into a bf16-master run are
    /// rounded; bf16 weights into an f32 run are widened exactly).
    pub fn load_params(&mut self, tensors: &[HostTensor], origin: &Path) -> Result<(), TrainError> {
        self.params = self.lookup(tensors, origin, None)?;
        Ok(())
    }

    /// Loads this rank's pieces of the weights of a parameter-sharded run (`ranges`, see
    /// [`crate::parallel::shard::ShardPlan::ranges`]): whole tensors are cut, pieces read already cut
    /// (a checkpoint read piecewise) are taken as they are.
    pub fn load_pieces(
        &mut self,
        tensors: &[HostTensor],
        ranges: &[Option<Range<usize>>],
        origin: &Path,
    ) -> Result<(), TrainError> {
        self.params = self.lookup(tensors, origin, Some(ranges))?;
        Ok(())
    }

    /// The tensor of every parameter, by name, in the master dtype, checked against its
    /// shape (a flat tensor of its size is taken too: the weights assembled from a
    /// parameter-sharded checkpoint have no other shape); with `ranges`, this rank's range
    /// of each (from the whole tensor, or a piece of exactly that length).
    fn lookup(
        &self,
        tensors: &[HostTensor],
        origin: &Path,
        ranges: Option<&[Option<Range<usize>>]>,
    ) -> Result<Vec<Tensor<1>>, TrainError> {
        let by_name: std::collections::HashMap<&str, &HostTensor> =
            tensors.iter().map(|t| (t.name.as_str(), t)).collect();
        let master = dtype_of(self.config.training.master_dtype);
        let mismatch = |reason: String| TrainError::ResumeMismatch {
            path: origin.to_path_buf(),
            reason,
        };
        let specs = self.model.specs();
        let mut out = Vec::with_capacity(specs.len());
        for (i, s) in specs.iter().enumerate() {
            let name = &s.name;
            let t = by_name
                .get(name.as_str())
                .ok_or_else(|| mismatch(format!("tensor {name} is missing")))?;
            let range = ranges.map_or(0..s.numel(), |r| r[i].clone().unwrap_or(0..0));
            // A whole tensor for a parameter this rank holds a box of (tensor parallelism):
            // the box first.
            let boxed;
            let t = match s.placement.is_whole() {
                false if t.values.len() == s.placement.global.iter().product::<usize>() => {
                    let values = s.placement.take(&t.values);
                    boxed = HostTensor::f32(t.name.clone(), s.shape.clone(), values);
                    &boxed
                }
                _ => *t,
            };
            let values = t
                .elements(&s.shape, range, ranges.is_some())
                .ok_or_else(|| {
                    mismatch(format!(
                        "tensor {name} has shape {:?}, the model needs {:?}",
                        t.shape, s.shape
                    ))
                })?;
            let len = values.len();
            let data = TensorData::new(values, [len]);
            out.push(Tensor::<1>::from_data(data, &self.device).cast(master));
        }
        Ok(out)
    }

    /// Loss of one batch of `seq_len + 1`-token rows without gradients (for eval).
    pub fn eval_loss(&self, rows: &[Vec<u32>]) -> f32 {
        let len = rows.first().map_or(0, Vec::len).saturating_sub(1);
        let inputs = int_tensor(rows, len, &self.device);
        let targets = target_tensor(rows, len, &self.device);
        self.model
            .loss(&self.params, inputs, targets)
            .into_scalar::<f32>()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The host's guess counts threads; an accelerator kiln cannot name has no guess (its MFU
    /// reads 0 rather than a figure against the host's peak, as it did on an H200).
    #[test]
    fn peak_flops_are_guessed_for_the_host_and_named_gpus_only() {
        use crate::config::Precision;
        for host in ["flex", "cpu", "cubecl-cpu"] {
            assert_eq!(guess_peak_flops(host, Precision::F32, 2), Some(160e9));
        }
        for gpu in ["rocm:0", "vulkan", "wgpu", "metal"] {
            assert_eq!(guess_peak_flops(gpu, Precision::Bf16, 2), None, "{gpu}");
        }
        assert_eq!(bf16_peak_of("NVIDIA H100 PCIe"), Some(756e12));
        assert_eq!(bf16_peak_of("NVIDIA H100 80GB HBM3"), Some(989e12));
        assert_eq!(bf16_peak_of("NVIDIA H200"), Some(989e12));
        assert_eq!(bf16_peak_of("NVIDIA GH200 480GB"), Some(989e12));
        assert_eq!(bf16_peak_of("NVIDIA GeForce GTX 1080"), None);
    }

    /// Flat weights (assembled from a parameter-sharded checkpoint) give the vocabulary by
    /// their size; a size that is not a whole number of rows is refused naming the tensor.
    #[test]
    fn a_flat_embedding_gives_the_vocabulary_or_a_clear_error() {
        let cfg = Config::default();
        let d = cfg.model.d_model;
        let probe = Llama::new(&cfg.model, 40);
        let params = probe.init(1, &Device::flex());
        let flat: Vec<HostTensor> = probe
            .specs()
            .iter()
            .zip(&params)
            .map(|(s, t)| {
                HostTensor::f32(s.name.clone(), vec![s.numel()], crate::tensor::to_vec(t))
            })
            .collect();
        let s = Session::from_weights(&cfg, &flat, Path::new("ckpt")).unwrap();
        assert_eq!(s.model.vocab(), 40);
        let embed = &probe.specs()[0].name;
        let bad = [HostTensor::f32(
            embed.clone(),
            vec![d * 40 + 1],
            vec![0.0; d * 40 + 1],
        )];
        let err = Session::from_weights(&cfg, &bad, Path::new("ckpt"))
            .err()
            .expect("refused")
            .to_string();
        assert!(
            err.contains("ckpt") && err.contains("not a multiple of model.d_model"),
            "{err}"
        );
    }
}

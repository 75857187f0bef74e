//! The kernel settings of this process: whether kiln's fused kernels run at all
//! (`training.fused_kernels`) and how they run on CubeCL devices (the `[kernels]` section),
//! set once per run by [`configure`] before the first kernel runs, and read by each op's
//! chooser. Process-wide, as the device is: two runs in one process share the last one's.

use crate::config::{AttentionPath, Config, CudaCompiler, CudaGemm, FlashTiling};
use std::path::PathBuf;
use std::sync::{Arc, LazyLock, RwLock};

/// How the kernels run.
#[derive(Debug, Clone, PartialEq)]
pub struct Settings {
    /// The fused kernels on (`training.fused_kernels`); off, every op takes its composed twin.
    pub fused: bool,
    /// Causal attention's path on CubeCL devices (`kernels.attention`).
    pub attention: AttentionPath,
    /// The flash kernels' tilings (`kernels.flash_tiling`); `None`: 64x64x4, 64x32x4,
    /// 32x32x4. The planes are units on CubeCL's CPU runtime, whose planes are one unit.
    pub flash_tiling: Option<FlashTiling>,
    /// Query rows a cube of attention's row kernels takes (one unit each); 0: the device's
    /// (64 on GPUs; 1 on CubeCL's CPU runtime, which runs a cube barrier as a spinning thread
    /// per unit). Not a config key: for tests of the cooperative loads on that runtime.
    pub attention_rows: usize,
    /// Query positions a chunk of attention by products takes; 0: as many as 256 MiB of f32
    /// scores hold. Not a config key: for tests of the chunk loop at small shapes.
    pub attention_chunk: usize,
    /// Matrix products on CUDA devices (`kernels.cuda_gemm`).
    pub cuda_gemm: CudaGemm,
    /// The compiler of CubeCL's CUDA runtime (`kernels.cuda_compiler`).
    pub cuda_compiler: CudaCompiler,
    /// Where each cuBLAS product's time goes (`kernels.cublas_profile`); `None`: nowhere.
    pub cublas_profile: Option<PathBuf>,
}

impl Default for Settings {
    fn default() -> Self {
        Self {
            fused: true,
            attention: AttentionPath::Auto,
            flash_tiling: None,
            attention_rows: 0,
            attention_chunk: 0,
            cuda_gemm: CudaGemm::Cublas,
            cuda_compiler: CudaCompiler::Llvm,
            cublas_profile: None,
        }
    }
}

impl Settings {
    /// The settings a run of `config` asks for (its `flash_tiling` validated with it).
    pub fn of(config: &Config) -> Self {
        let k = &config.kernels;
        Self {
            fused: config.training.fused_kernels,
            attention: k.attention,
            flash_tiling: k.flash_tiling().ok().flatten(),
            cuda_gemm: k.cuda_gemm,
            cuda_compiler: k.cuda_compiler,
            cublas_profile: (!k.cublas_profile.is_empty()).then(|| k.cublas_profile.clone().into()),
            ..Self::default()
        }
    }
}

static CURRENT: RwLock<Option<Arc<Settings>>> = RwLock::new(None);
static DEFAULT: LazyLock<Arc<Settings>> = LazyLock::new(|| Arc::new(Settings::default()));

/// Sets how the kernels run from here on, in the whole process.
pub fn configure(settings: Settings) {
    #[cfg(feature = "cuda")]
    choose_cuda_compiler(settings.cuda_compiler);
    if let Ok(mut current) = CURRENT.write() {
        *current = Some(Arc::new(settings));
    }
}

/// How the kernels run now ([`Settings::default`] until [`configure`]d).
pub(crate) fn current() -> Arc<Settings> {
    CURRENT
        .read()
        .ok()
        .and_then(|s| s.clone())
        .unwrap_or_else(|| DEFAULT.clone())
}

/// Hands `compiler` to CubeCL's CUDA runtime (patches/cubecl-cuda), which compiles with one
/// backend a process: chosen before its first device starts, fixed from then on.
#[cfg(feature = "cuda")]
fn choose_cuda_compiler(compiler: CudaCompiler) {
    use cubecl::cuda::compiler::{CudaBackend, choose_backend};
    let backend = match compiler {
        CudaCompiler::Llvm => CudaBackend::Llvm,
        CudaCompiler::Nvrtc => CudaBackend::Cpp,
    };
    if let Err(fixed) = choose_backend(backend) {
        tracing::warn!(
            "kernels.cuda_compiler = {compiler:?}: this process compiles CUDA kernels with {fixed:?} already (one backend a process)"
        );
    }
}

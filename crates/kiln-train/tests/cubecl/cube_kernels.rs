//! kiln's CubeCL kernels (each op's `cube.rs` in src/kernels) against their composed twins, values and
//! gradients, on CubeCL's CPU runtime (device `cubecl-cpu`): the same kernel source the GPU
//! runtimes compile, in f32 and bf16 (the comparisons are `kernels::selfcheck`'s, which
//! `kiln doctor --device` runs on a GPU). Shapes cover partial cubes (counts that are not
//! multiples of the 128 units a cube runs), grouped-query ratios 1, 2 and 3, a sequence of one
//! and sequence lengths that are multiples of nothing. Tolerance, of the largest reference
//! value: 2e-5 in f32, for sums taken in another order (the composed path reduces through
//! burn's matmul and reduce kernels); 1e-2 in bf16, against the composed path in f32 on the
//! same bf16 values (bf16's half ulp is 2e-3). Built only with the `cubecl-cpu` feature.

use crate::common;

use burn::tensor::{Device, FloatDType, Tensor, TensorData};
use common::{host, random, rel_diff};
use kiln_train::config::AttentionPath;
use kiln_train::kernels::settings::{Settings, configure};
use kiln_train::kernels::{self, selfcheck};

const TOLERANCE: f32 = 2e-5;

fn device() -> Device {
    kiln_train::model::session::parse_device("cubecl-cpu").unwrap()
}

/// Runs `check` in f32 and in bf16 (CubeCL's CPU runtime runs the bf16 instances of the
/// kernels too: LLVM has the type), prints every comparison and fails on any beyond its
/// tolerance.
fn assert_passes(check: fn(&Device, FloatDType) -> Vec<selfcheck::Check>) {
    for dtype in [FloatDType::F32, FloatDType::BF16] {
        let checks = check(&device(), dtype);
        assert!(!checks.is_empty());
        for c in checks {
            eprintln!(
                "{dtype:?} {} {}: relative difference {:.2e} over {} values",
                c.kernel, c.part, c.rel_diff, c.values
            );
            assert!(c.passed(), "{dtype:?}: {c:?}");
            assert_eq!(c.tolerance, selfcheck::tolerance(dtype));
        }
    }
}

#[test]
fn linear_matches_composed() {
    assert_passes(selfcheck::linear);
}

#[test]
fn mixed_linear_matches_composed() {
    assert_passes(selfcheck::mixed_linear);
}

/// Without a vendor BLAS (CubeCL's CPU runtime, and GPUs other than CUDA) mixed precision's
/// projection is the casts that were around the projection before it was one op, in the same
/// order: the same bits, values and gradients, for f32 and bf16 outputs.
#[test]
fn mixed_linear_is_the_casts_around_linear_bit_for_bit() {
    let dev = device();
    let leaf = |shape: [usize; 3], seed| {
        let data = TensorData::new(random(shape.iter().product(), seed), shape);
        Tensor::<3>::from_data(data, &dev.clone().autodiff()).require_grad()
    };
    for out in [FloatDType::F32, FloatDType::BF16] {
        let run = |fused: bool| {
            let (x, w) = (leaf([2, 37, 70], 5), leaf([1, 70, 45], 6));
            let w2 = w.clone().reshape([70, 45]);
            let bf = FloatDType::BF16;
            let y = match fused {
                true => kernels::linear::mixed_linear(x.clone(), w2, bf.into(), out.into()),
                false => kernels::linear::linear(x.clone().cast(bf), w2.cast(bf), None).cast(out),
            };
            let r =
                Tensor::<3>::from_data(TensorData::new(random(2 * 37 * 45, 7), [2, 37, 45]), &dev);
            let grads = (y.clone().cast(FloatDType::F32) * r).sum().backward();
            let (gx, gw) = (
                x.grad(&grads).map(|g| host(&g)),
                w.grad(&grads).map(|g| host(&g)),
            );
            (host(&y), gx.unwrap_or_default(), gw.unwrap_or_default())
        };
        let (fused, composed) = (run(true), run(false));
        assert!(!fused.1.is_empty() && !fused.2.is_empty());
        assert_eq!(fused, composed, "{out:?}");
    }
}

#[test]
fn rms_norm_matches_composed() {
    assert_passes(selfcheck::rms_norm);
}

#[test]
fn swiglu_matches_composed() {
    assert_passes(selfcheck::swiglu);
}

#[test]
fn rope_matches_composed() {
    assert_passes(selfcheck::rope);
}

/// The flash kernels' tensor-core path splits each tile product's output fragments among the
/// planes of a cube: every fragment once, in the GPU tilings and in ones `kernels.flash_tiling`
/// may set (sides of 16 to 64, 2 to 8 planes, head dimensions not a multiple of 64).
#[test]
fn flash_fragments_are_each_computed_by_one_plane() {
    for (rows, cols, planes) in [
        (64, 64, 4),
        (64, 32, 4),
        (32, 32, 4),
        (64, 64, 8),
        (16, 16, 2),
        (48, 32, 4),
        (16, 48, 8),
    ] {
        for hd in [64, 128, 80] {
            selfcheck::flash_fragment_slots(rows, cols, planes, hd).unwrap();
        }
    }
}

#[test]
fn causal_attention_matches_composed() {
    // Every path is asked for through the kernel settings a run's config gives, and the
    // process is back on the defaults at the end.
    let with = configure;
    // The row kernels, cubes of 4 rows (1 in training on this runtime): the cooperative tile
    // loads, blocks crossing from one query head into the next, several blocks and tiles.
    with(Settings {
        attention: AttentionPath::Rows,
        attention_rows: 4,
        ..Settings::default()
    });
    assert_passes(selfcheck::causal_attention);
    // Then by products (GPUs' path) in chunks of 3 and 16 positions: chunks that do not divide
    // the sequences (7, 13, 70), one chunk for the shorter ones. (Chunks of 1 passed too; each
    // chunk's products are new shapes for burn's matmul autotune here, 25 s more.)
    for chunk in [3, 16] {
        eprintln!("attention by products, {chunk} positions a chunk");
        with(Settings {
            attention: AttentionPath::Products,
            attention_chunk: chunk,
            ..Settings::default()
        });
        assert_passes(selfcheck::causal_attention);
    }
    // Then the flash kernels by their unit-by-unit tile products: 16 query rows against 32
    // keys (forward, dq) and 32 keys against 16 query rows (dk, dv), 4 units a cube (a plane
    // is a unit on this runtime): several blocks and tiles at 70 positions, the last of each
    // partial, head dimensions padded to 16.
    let flash = |rows, cols, units| Settings {
        attention: AttentionPath::Flash,
        flash_tiling: Some([
            (rows, cols, units),
            (rows, cols, units),
            (cols, rows, units),
        ]),
        ..Settings::default()
    };
    eprintln!("flash attention, 16 x 32 tiles");
    with(flash(16, 32, 4));
    assert_passes(selfcheck::causal_attention);
    assert_passes(selfcheck::causal_attention_rising);
    // 3 units: a cube's vector loads of a tile not a multiple of its units (the last round's
    // guard). 32 units: each forward softmax row cut in 2 parts (16 rows), as the GPUs' 128
    // units cut their 64 rows; scores rising past the rescale gap.
    for units in [3, 32] {
        eprintln!("flash attention, 16 x 32 tiles, {units} units");
        with(flash(16, 32, units));
        assert_passes(selfcheck::causal_attention_rising);
    }
    // And at head dimensions 64 and 128 (several fragments of 16 along them on GPUs), in the
    // GPUs' tiling: 64 query rows against 64 keys.
    with(flash(64, 64, 4));
    assert_passes(selfcheck::causal_attention_wide);
    with(Settings::default());
}

#[test]
fn linear_cross_entropy_matches_composed_in_one_chunk_and_in_three() {
    assert_passes(selfcheck::linear_cross_entropy);
}

#[test]
fn adamw_update_matches_the_formula() {
    use kiln_train::kernels::adamw::{AdamWScalars, adamw_update as update};
    // 300 elements (two full cubes and a partial one), clipping and decay on.
    let n = 300;
    let (p, g, m, v) = (random(n, 11), random(n, 12), random(n, 13), random(n, 14));
    let v: Vec<f32> = v.iter().map(|x| x.abs()).collect();
    let s = AdamWScalars {
        grad_scale: Some(0.5),
        b1: (0.9, 0.1),
        b2: (0.95, 0.05),
        decay: Some(0.999),
        bc2_sqrt: 0.3,
        eps: 1e-8,
        step_size: 0.01,
    };
    let on_device = |x: &[f32]| Tensor::<1>::from_data(TensorData::new(x.to_vec(), [n]), &device());
    let Ok((p2, m2, v2)) = update(
        on_device(&p),
        on_device(&g),
        on_device(&m),
        on_device(&v),
        &s,
    ) else {
        panic!("the device update did not cover f32 device tensors");
    };
    let mut want = (vec![], vec![], vec![]);
    for i in 0..n {
        let gi = g[i] as f64 * 0.5;
        let mi = m[i] as f64 * 0.9 + gi * 0.1;
        let vi = v[i] as f64 * 0.95 + gi * gi * 0.05;
        let pi = p[i] as f64 * 0.999 - mi / (vi.sqrt() / 0.3 + 1e-8) * 0.01;
        want.0.push(pi as f32);
        want.1.push(mi as f32);
        want.2.push(vi as f32);
    }
    for (name, got, want) in [("p", p2, want.0), ("m", m2, want.1), ("v", v2, want.2)] {
        let d = rel_diff(&host(&got), &want);
        eprintln!("adamw {name}: relative difference {d:.2e}");
        assert!(d <= 1e-6, "adamw {name}: {d:e}");
    }
}

/// The order `kernels::fixed_order::device_square_sum` promises, on the host: per tensor, unit `u` of
/// `units_for(n)` sums the squares of elements `u, u + units, ...` in f32, passes over the
/// partials the same way (without squaring) until at most 64 remain, and the partials of every
/// tensor are added in f64 in parameter order. Each square is added by a fused multiply-add:
/// CubeCL's CPU runtime contracts `acc += v * v` into one (with separate rounding the bits
/// differ, 6e-8 relative here), as NVPTX does by default.
fn fixed_order_square_sum(data: &[Vec<f32>]) -> f64 {
    let units_for = |n: usize| n.div_ceil(64).clamp(1, 1 << 16);
    let pass = |x: &[f32], units: usize, square: bool| -> Vec<f32> {
        (0..units)
            .map(|u| {
                let mut acc = 0.0f32;
                for &v in x.iter().skip(u).step_by(units) {
                    acc = if square { v.mul_add(v, acc) } else { acc + v };
                }
                acc
            })
            .collect()
    };
    let mut partials = Vec::new();
    for x in data.iter().filter(|x| !x.is_empty()) {
        let mut len = units_for(x.len());
        let mut sums = pass(x, len, true);
        while len > 64 {
            len = units_for(len);
            sums = pass(&sums, len, false);
        }
        partials.extend(sums);
    }
    partials.iter().map(|&s| f64::from(s)).sum()
}

#[test]
fn gradient_norm_is_the_formula_and_the_same_bits_every_time() {
    // Sizes for one pass (1, 63, 65), two (5000: 79 partials, then 2) and three (300 000:
    // 4688, then 74, then 2), and an empty piece (a rank's share of nothing).
    let sizes = [1usize, 63, 65, 0, 5000, 300_000];
    let data: Vec<Vec<f32>> = (0..sizes.len())
        .map(|i| random(sizes[i], 40 + i as u64))
        .collect();
    let tensors: Vec<Tensor<1>> = data
        .iter()
        .map(|x| Tensor::<1>::from_data(TensorData::new(x.clone(), [x.len()]), &device()))
        .collect();
    let want: f64 = data
        .iter()
        .flatten()
        .map(|&x| f64::from(x) * f64::from(x))
        .sum();
    let got =
        kernels::fixed_order::device_square_sum(&tensors).expect("f32 device tensors are covered");
    let d = ((got - want) / want).abs();
    eprintln!(
        "square sum: relative difference {d:.2e} over {} values",
        sizes.iter().sum::<usize>()
    );
    assert!(d <= 1e-6, "square sum {got} against {want}");
    assert_eq!(
        got.to_bits(),
        fixed_order_square_sum(&data).to_bits(),
        "the device sum is the fixed order's, to the bit"
    );
    for _ in 0..3 {
        let again = kernels::fixed_order::device_square_sum(&tensors).expect("covered");
        assert_eq!(
            again.to_bits(),
            got.to_bits(),
            "the sum changed between calls"
        );
    }
    let norm = kiln_train::optim::global_norm(&tensors);
    assert_eq!(
        norm,
        got.sqrt() as f32,
        "global_norm takes the fixed-order sum on devices"
    );
}

/// Muon's arithmetic on replicated state: the fixed-kernel matmul agrees with burn's
/// autotuned one (shapes that fill no tile: 7x13 @ 13x5, and a transposed view as Newton-Schulz
/// passes it), and the Frobenius norm stays on the device, equals the f64 formula and keeps
/// its bits from call to call.
#[test]
fn replicated_matmul_and_frobenius_norm_match_burn() {
    let on_device = |x: Vec<f32>, shape: [usize; 2]| {
        Tensor::<2>::from_data(TensorData::new(x, shape), &device())
    };
    let a = on_device(random(7 * 13, 81), [7, 13]);
    let b = on_device(random(13 * 5, 82), [13, 5]);
    for (name, got, want) in [
        (
            "a @ b",
            kernels::fixed_order::replicated_matmul(a.clone(), b.clone()),
            a.clone().matmul(b.clone()),
        ),
        (
            "a @ a^T",
            kernels::fixed_order::replicated_matmul(a.clone(), a.clone().transpose()),
            a.clone().matmul(a.clone().transpose()),
        ),
    ] {
        let d = rel_diff(&host(&got), &host(&want));
        eprintln!("replicated matmul {name}: relative difference {d:.2e}");
        assert_eq!(got.dims(), want.dims());
        assert!(d <= TOLERANCE, "{name}: {d:e}");
    }
    let x = random(7 * 13, 81);
    let want = x
        .iter()
        .map(|&v| f64::from(v) * f64::from(v))
        .sum::<f64>()
        .sqrt();
    let norm = kernels::fixed_order::frobenius_norm(&a);
    assert_eq!(norm.dims(), [1]);
    let got = host(&norm)[0];
    assert!(
        ((f64::from(got) - want) / want).abs() <= 1e-6,
        "{got} vs {want}"
    );
    assert_eq!(
        host(&kernels::fixed_order::frobenius_norm(&a))[0].to_bits(),
        got.to_bits()
    );
}

/// NCCL is for CUDA devices only: on this device the gradients stay host-staged.
#[test]
fn nccl_joins_only_on_cuda_devices() {
    let joined = kiln_train::parallel::nccl::Nccl::join(&kiln_dist::Solo, &device());
    assert!(matches!(joined, Ok(None)), "NCCL joined on cubecl-cpu");
}

/// With a CUDA GPU (skipped, reason printed, without one): NCCL joins a one-rank
/// communicator and hands gradients of several sizes back unchanged (`nccl::check_one_rank`,
/// which `kiln doctor --device cuda` runs too).
#[cfg(feature = "cuda")]
#[test]
fn nccl_on_one_cuda_rank_hands_the_gradients_back() {
    let gpu = std::process::Command::new("nvidia-smi")
        .arg("-L")
        .output()
        .is_ok_and(|o| o.status.success() && o.stdout.starts_with(b"GPU "));
    if !gpu {
        eprintln!("skipped: no CUDA GPU here (nvidia-smi -L)");
        return;
    }
    let cuda = kiln_train::model::session::parse_device("cuda").unwrap();
    let diff = kiln_train::parallel::nccl::check_one_rank(&cuda).expect("NCCL joins and reduces");
    assert_eq!(diff, Some(0.0));
}

/// The flash attention kernels compile for an H100/H200 (`sm_90`) through the backend CubeCL's
/// CUDA runtime uses, and ptxas assembles them, all without a device: their tile products are
/// tensor-core instructions (`wmma.mma.sync` on bf16 fragments accumulating in f32), loaded
/// from and stored to shared memory, what CubeCL's CPU runtime (no matrix instructions) cannot
/// run. Whether they compute the right values on a GPU is `kiln doctor --device cuda`'s check.
///
/// The compiler links libdevice (the math functions) from `CUDA_PATH`, read in the process, so
/// this test runs [`flash_ptx_with_libdevice`] in a child process of this test binary with
/// `CUDA_PATH` set to the tools of scripts/install-cuda-tools.sh (no GPU, no CUDA toolkit).
#[cfg(feature = "cuda")]
#[test]
fn flash_attention_kernels_assemble_for_sm90_with_tensor_core_products() {
    let tools = match std::env::var_os("KILN_CUDA_TOOLS_DIR") {
        Some(dir) => std::path::PathBuf::from(dir),
        None => {
            let cache = std::env::var_os("XDG_CACHE_HOME")
                .map(std::path::PathBuf::from)
                .unwrap_or_else(|| {
                    std::path::PathBuf::from(std::env::var_os("HOME").unwrap()).join(".cache")
                });
            cache.join("kiln/nvidia-cuda-nvcc-cu12-12.8.93")
        }
    }
    .join("nvidia/cuda_nvcc");
    assert!(
        tools.join("nvvm/libdevice/libdevice.10.bc").is_file() && tools.join("bin/ptxas").is_file(),
        "no libdevice/ptxas under {}: run scripts/install-cuda-tools.sh",
        tools.display()
    );
    let out = tempfile::tempdir().unwrap();
    let status = std::process::Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            // The test's name in this binary: its module path without the crate's name.
            &child_test_name("flash_ptx_with_libdevice"),
            "--ignored",
            "--nocapture",
        ])
        .env("CUDA_PATH", &tools)
        .env("KILN_PTX_OUT", out.path())
        .status()
        .unwrap();
    assert!(status.success(), "the child test failed: {status}");
    // The child wrote and assembled all six kernels.
    assert_eq!(std::fs::read_dir(out.path()).unwrap().count(), 12);
}

/// A test's full name as libtest knows it (`cube_kernels::NAME`): `module_path!()` less the
/// test binary's own name, so the child runs the test even if this file moves.
#[cfg(any(feature = "cuda", feature = "rocm"))]
fn child_test_name(name: &str) -> String {
    let module = module_path!();
    let inner = module.split_once("::").map_or("", |(_, rest)| rest);
    if inner.is_empty() {
        name.to_string()
    } else {
        format!("{inner}::{name}")
    }
}

/// Run by [`flash_attention_kernels_assemble_for_sm90_with_tensor_core_products`] with
/// `CUDA_PATH` and `KILN_PTX_OUT` set.
#[cfg(feature = "cuda")]
#[test]
#[ignore = "run by flash_attention_kernels_assemble_for_sm90_with_tensor_core_products"]
fn flash_ptx_with_libdevice() {
    let cuda = std::path::PathBuf::from(std::env::var_os("CUDA_PATH").unwrap());
    let out = std::path::PathBuf::from(std::env::var_os("KILN_PTX_OUT").unwrap());
    for hd in [64, 128] {
        let ptx = selfcheck::flash_ptx(hd, FloatDType::BF16, 90).unwrap();
        for (name, code) in ["forward", "dq", "dkv"].iter().zip(&ptx) {
            let mma = code.matches("wmma.mma.sync").count();
            assert!(
                mma > 0,
                "{name} at hd {hd}: no tensor-core products\n{code}"
            );
            assert!(code.contains("wmma.mma.sync.aligned.row.col.m16n16k16.f32.bf16.bf16.f32"));
            assert!(code.contains("wmma.load.a.sync") && code.contains("wmma.store.d.sync"));
            assert!(code.contains(".shared"), "{name}: tiles in shared memory");
            let file = out.join(format!("{name}-hd{hd}.ptx"));
            std::fs::write(&file, code).unwrap();
            let cubin = out.join(format!("{name}-hd{hd}.cubin"));
            let asm = std::process::Command::new(cuda.join("bin/ptxas"))
                .args(["-arch=sm_90a", "-v", "-o"])
                .arg(&cubin)
                .arg(&file)
                .output()
                .unwrap();
            let report = String::from_utf8_lossy(&asm.stderr);
            assert!(
                asm.status.success(),
                "ptxas refused {name} at hd {hd}:\n{report}"
            );
            let usage: Vec<&str> = report
                .lines()
                .filter(|l| l.contains("Used") || l.contains("spill"))
                .collect();
            eprintln!(
                "hd {hd} {name}: {mma} wmma.mma.sync in PTX; ptxas: {}",
                usage.join("; ")
            );
        }
    }
    assert!(selfcheck::flash_ptx(64, FloatDType::F32, 90).is_err());
}

/// RCCL is for ROCm devices only: on this device the gradients stay host-staged.
#[test]
fn rccl_joins_only_on_rocm_devices() {
    let joined = kiln_train::parallel::rccl::Rccl::join(&kiln_dist::Solo, &device());
    assert!(matches!(joined, Ok(None)), "RCCL joined on cubecl-cpu");
}

/// With no RCCL here, opening it fails with every place it looked and how to fix it: what each
/// rank logs before the run falls back to host-staged MPI.
#[cfg(feature = "rocm")]
#[test]
fn a_missing_rccl_names_where_it_was_looked_for() {
    use kiln_train::parallel::rccl::{LIBRARY_VAR, library_candidates};
    let candidates = library_candidates(&|var| match var {
        "ROCM_PATH" => Some("/nonexistent/rocm".into()),
        _ => None,
    });
    let Err(err) = kiln_train::parallel::rccl::hip::Library::open(&candidates) else {
        eprintln!("skipped: this host has an RCCL");
        return;
    };
    for looked in [
        "/nonexistent/rocm/lib/librccl.so",
        "/opt/rocm/lib/librccl.so",
        "librccl.so.1",
    ] {
        assert!(err.contains(looked), "{looked} missing from: {err}");
    }
    assert!(err.contains(LIBRARY_VAR), "{err}");
}

/// The AMD GPUs kiln's kernels are compiled for here: MI300X (`gfx942`) and MI200 (`gfx90a`),
/// CDNA, wave64; and RDNA4 (`gfx1201`), wave32.
#[cfg(feature = "rocm")]
const AMD_ARCHS: [&str; 3] = ["gfx942", "gfx90a", "gfx1201"];

/// Those of [`AMD_ARCHS`] the flash kernels are compiled for: CubeCL 0.11.3's AMDGPU backend
/// lowers tile products to WMMA only (RDNA3 and RDNA4; it panics on CDNA's MFMA), and kiln
/// launches the flash kernels only on 32-unit planes, which CDNA's wave64 is not; so on an
/// MI300X or MI200 attention takes the row or product kernels, compiled for them above.
#[cfg(feature = "rocm")]
const FLASH_ARCHS: [&str; 1] = ["gfx1201"];

/// kiln's CubeCL kernels compile for AMD GPUs through the backend CubeCL's ROCm runtime uses
/// (LLVM's AMDGPU target, ROCm's device bitcode for the math functions, an external LLD: the
/// patched `cubecl-llvm`) and link into code objects, all without a GPU or ROCm: every op's
/// kernels in f32 and bf16 for each of [`AMD_ARCHS`], and the flash kernels in bf16 at head
/// dimensions 64 and 128 for [`FLASH_ARCHS`] (not CDNA: see there), each an AMDGPU ELF shared
/// object (`EM_AMDGPU`, `ET_DYN`) whose entry point is in its symbols, the flash kernels' tile
/// products on the matrix cores. Whether they compute the right
/// values on a GPU is `kiln doctor --device rocm`'s check, and nothing has run on one.
///
/// The device bitcode is Debian's rocm-device-libs (scripts/install-rocm-device-libs.sh),
/// ROCm 5.2's, which has no `gfx942` ISA library: the child links `gfx940`'s for it (the same
/// MI300 instruction set; the library only holds the version number), in a directory of links.
/// The linker is the Rust toolchain's `rust-lld` (LLD 22) unless `CUBECL_AMDGPU_LINKER` names
/// another. CubeCL reads these once a process, so the compilation runs in a child process of
/// this test binary ([`amd_code_objects_offline`]).
#[cfg(feature = "rocm")]
#[test]
fn kernels_link_into_amd_code_objects_for_mi300x_and_mi200() {
    use std::path::PathBuf;
    let libs = match std::env::var_os("KILN_ROCM_DEVICE_LIBS_DIR") {
        Some(dir) => PathBuf::from(dir),
        None => std::env::var_os("XDG_CACHE_HOME")
            .map(PathBuf::from)
            .unwrap_or_else(|| PathBuf::from(std::env::var_os("HOME").unwrap()).join(".cache"))
            .join("kiln/rocm-device-libs-5.2.3-2"),
    }
    .join("usr/lib/x86_64-linux-gnu/amdgcn/bitcode");
    assert!(
        libs.join("ocml.bc").is_file(),
        "no ROCm device bitcode under {}: run scripts/install-rocm-device-libs.sh",
        libs.display()
    );
    let bitcode = tempfile::tempdir().unwrap();
    for entry in std::fs::read_dir(&libs).unwrap() {
        let entry = entry.unwrap();
        std::os::unix::fs::symlink(entry.path(), bitcode.path().join(entry.file_name())).unwrap();
    }
    let isa_942 = bitcode.path().join("oclc_isa_version_942.bc");
    if !isa_942.exists() {
        std::os::unix::fs::symlink(libs.join("oclc_isa_version_940.bc"), &isa_942).unwrap();
    }
    let linker = match std::env::var_os("CUBECL_AMDGPU_LINKER") {
        Some(chosen) => PathBuf::from(chosen),
        None => {
            let sysroot = std::process::Command::new("rustc")
                .args(["--print", "sysroot"])
                .output()
                .expect("rustc runs");
            let sysroot = String::from_utf8(sysroot.stdout).unwrap();
            let host = std::process::Command::new("rustc")
                .args(["--print", "host-tuple"])
                .output()
                .expect("rustc runs");
            let host = String::from_utf8(host.stdout).unwrap();
            PathBuf::from(sysroot.trim())
                .join("lib/rustlib")
                .join(host.trim())
                .join("bin/rust-lld")
        }
    };
    assert!(linker.is_file(), "no linker at {}", linker.display());
    let (out, dumps) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    // One child per architecture's ops and one for the flash kernels, all at once: each
    // compiles on one core, and the others would wait (this binary runs one test at a time).
    let parts = AMD_ARCHS
        .iter()
        .map(|arch| format!("ops:{arch}"))
        .chain(["flash".to_string()]);
    let children: Vec<_> = parts
        .map(|part| {
            let child = std::process::Command::new(std::env::current_exe().unwrap())
                .args([
                    "--exact",
                    // The test's name in this binary: its module path without the crate's name.
                    &child_test_name("amd_code_objects_offline"),
                    "--ignored",
                    "--nocapture",
                ])
                .env("CUBECL_ROCM_DEVICE_LIB_PATH", bitcode.path())
                .env("CUBECL_AMDGPU_LINKER", &linker)
                // For the assembly (a directory: a build with CubeCL's dumps on writes them there).
                .env("CUBECL_DEBUG_PLIRON", dumps.path())
                .env("KILN_AMD_OUT", out.path())
                .env("KILN_AMD_PART", &part)
                .spawn()
                .unwrap();
            (part, child)
        })
        .collect();
    for (part, mut child) in children {
        let status = child.wait().unwrap();
        assert!(
            status.success(),
            "the child test for {part} failed: {status}"
        );
    }
    // The child ran (a name that matched no test would run nothing and pass): it wrote a code
    // object per kernel, type and architecture.
    let written = std::fs::read_dir(out.path()).unwrap().count();
    let ops = kiln_train::kernels::offline::kernels(FloatDType::F32)
        .unwrap()
        .len();
    let flash = FLASH_ARCHS.len() * 2 * 3;
    assert_eq!(
        written,
        AMD_ARCHS.len() * 2 * ops + flash,
        "code objects written"
    );
}

/// `EM_AMDGPU`, the ELF machine of AMD GPU code objects.
#[cfg(feature = "rocm")]
const EM_AMDGPU: u16 = 224;

/// Checks that `code` is a loadable AMDGPU code object for `arch` with `entry` among its
/// symbols: a 64-bit little-endian ELF, `ET_DYN`, `EM_AMDGPU`, HSA's OS ABI.
#[cfg(feature = "rocm")]
fn assert_code_object(code: &[u8], entry: &str, what: &str) {
    assert!(code.len() > 64, "{what}: {} bytes", code.len());
    assert_eq!(&code[..4], b"\x7fELF", "{what}: not an ELF");
    assert_eq!(code[4], 2, "{what}: not ELF64");
    assert_eq!(code[5], 1, "{what}: not little-endian");
    assert_eq!(
        code[7], 64,
        "{what}: OS ABI {} is not ELFOSABI_AMDGPU_HSA",
        code[7]
    );
    let half = |at: usize| u16::from_le_bytes([code[at], code[at + 1]]);
    assert_eq!(half(16), 3, "{what}: e_type {} is not ET_DYN", half(16));
    assert_eq!(half(18), EM_AMDGPU, "{what}: e_machine {}", half(18));
    assert!(
        code.windows(entry.len()).any(|w| w == entry.as_bytes()),
        "{what}: no symbol {entry}"
    );
}

/// Run by [`kernels_link_into_amd_code_objects_for_mi300x_and_mi200`] with the device
/// bitcode, the linker and `KILN_AMD_OUT` set, and `KILN_AMD_PART` saying what to compile:
/// `ops:<arch>` (every op's kernels for that architecture) or `flash` (the flash kernels).
#[cfg(feature = "rocm")]
#[test]
#[ignore = "run by kernels_link_into_amd_code_objects_for_mi300x_and_mi200"]
fn amd_code_objects_offline() {
    use kiln_train::kernels::offline::{amdgpu, kernels};
    let out = std::path::PathBuf::from(std::env::var_os("KILN_AMD_OUT").unwrap());
    let part = std::env::var("KILN_AMD_PART").unwrap();
    let ops_archs: Vec<&str> = AMD_ARCHS
        .into_iter()
        .filter(|arch| part == format!("ops:{arch}"))
        .collect();
    let flash_archs: &[&str] = if part == "flash" { &FLASH_ARCHS } else { &[] };
    assert!(
        !ops_archs.is_empty() || !flash_archs.is_empty(),
        "KILN_AMD_PART={part} names nothing to compile"
    );
    let mut failed = Vec::new();
    for arch in ops_archs {
        for dtype in [FloatDType::F32, FloatDType::BF16] {
            for (name, kernel) in kernels(dtype).unwrap() {
                let what = format!("{arch} {dtype:?} {name}");
                match amdgpu(&*kernel, arch) {
                    Ok(code) => {
                        assert_code_object(&code.code_object, &code.entrypoint, &what);
                        let file = out.join(format!("{arch}-{dtype:?}-{name}.hsaco"));
                        std::fs::write(file, &code.code_object).unwrap();
                        eprintln!("{what}: {} bytes", code.code_object.len());
                    }
                    Err(e) => failed.push(format!("{what}: {e}")),
                }
            }
        }
    }
    for &arch in flash_archs {
        for hd in [64, 128] {
            let codes = match selfcheck::flash_amdgpu(hd, FloatDType::BF16, arch) {
                Ok(codes) => codes,
                Err(e) => {
                    failed.push(format!("{arch} flash hd {hd}: {e}"));
                    continue;
                }
            };
            for (name, code) in ["forward", "dq", "dkv"].iter().zip(&codes) {
                let what = format!("{arch} flash {name} hd {hd}");
                assert_code_object(&code.code_object, &code.entrypoint, &what);
                let asm = code.asm.as_deref().unwrap_or_default();
                // The tile products on the matrix cores (RDNA's WMMA).
                let products = asm.matches("v_wmma_f32_16x16x16_bf16").count();
                assert!(products > 0, "{what}: no matrix-core products\n{asm}");
                let file = out.join(format!("{arch}-flash-{name}-hd{hd}.hsaco"));
                std::fs::write(file, &code.code_object).unwrap();
                eprintln!(
                    "{what}: {} bytes, {products} matrix-core products",
                    code.code_object.len()
                );
            }
        }
    }
    assert!(
        failed.is_empty(),
        "{} failed:\n{}",
        failed.len(),
        failed.join("\n")
    );
}

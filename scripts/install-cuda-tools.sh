#!/usr/bin/env bash
# Installs libdevice.10.bc and ptxas from NVIDIA's CUDA compiler wheel on PyPI (pinned, with
# hashes, in scripts/cuda-tools-requirements.txt), so that the CUDA kernels' offline test
# (tests/cubecl/cube_kernels.rs: the flash attention kernels compiled to PTX by CubeCL's NVPTX backend
# and assembled for sm_90 by ptxas) runs on a machine with no GPU and no CUDA toolkit.
#
# Usage: scripts/install-cuda-tools.sh                install (a no-op when done)
#        scripts/install-cuda-tools.sh --print-prefix  the toolkit-shaped directory it fills
#                                                      (nvvm/libdevice/libdevice.10.bc, bin/ptxas)
# Environment: KILN_CUDA_TOOLS_DIR  where the wheel is unpacked (default
#              ${XDG_CACHE_HOME:-~/.cache}/kiln/nvidia-cuda-nvcc-cu12-12.8.93, ~100 MB)
# The test finds the directory the same way (KILN_CUDA_TOOLS_DIR, else that default).
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
req="$here/cuda-tools-requirements.txt"
die() {
  echo "install-cuda-tools: error: $*" >&2
  exit 1
}
[ -n "${HOME:-}" ] || die "HOME is not set"
root=${KILN_CUDA_TOOLS_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/kiln/nvidia-cuda-nvcc-cu12-12.8.93}
prefix=$root/nvidia/cuda_nvcc
stamp=$root/.kiln-cuda-tools-installed

case "${1:-}" in
  "") ;;
  --print-prefix)
    echo "$prefix"
    exit 0
    ;;
  *) die "unknown argument '$1' (use --print-prefix)" ;;
esac

req_sum=$(sha256sum "$req" | cut -d' ' -f1)
ok() { [ -f "$prefix/nvvm/libdevice/libdevice.10.bc" ] && "$prefix/bin/ptxas" --version >/dev/null 2>&1; }
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$req_sum" ] && ok; then
  echo "install-cuda-tools: ready at $prefix"
  exit 0
fi
python3 -m pip --version >/dev/null 2>&1 || die "python3 has no pip (Debian: apt-get install python3-pip)"
mkdir -p "$(dirname "$root")"
tmp=$(mktemp -d "$root.tmp.XXXXXX")
trap 'rm -rf "$tmp"' EXIT
echo "install-cuda-tools: installing nvidia-cuda-nvcc-cu12 12.8.93 from PyPI into $root"
PIP_ROOT_USER_ACTION=ignore python3 -m pip install --disable-pip-version-check --no-input \
  --no-deps --only-binary=:all: --require-hashes -r "$req" --target "$tmp" ||
  die "pip could not install the pinned wheel (network? a hash mismatch means the wheel on the
  index is not the one pinned in $req)"
rm -rf "$root"
mv "$tmp" "$root"
trap - EXIT
ok || die "the wheel did not give $prefix/nvvm/libdevice/libdevice.10.bc and a working bin/ptxas"
echo "$req_sum" >"$stamp"
echo "install-cuda-tools: ready at $prefix"

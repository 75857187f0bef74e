#!/usr/bin/env bash
# Builds kiln for CUDA here (offline, with the pinned LLVM of scripts/install-llvm.sh) and packs
# what the GPU machine needs into bench/gpu/carry/ (git-ignored), within the device tool's
# 64 MiB carry limit: the stripped binary, xz-compressed (the GPU host has python3's lzma to
# unpack it, and no Rust). Then prints the exact `device` call that runs the benchmark.
#
# Usage: bench/gpu/pack.sh            (CUDARC_CUDA_VERSION defaults to 13000, .cargo/config.toml)
# Build: ~40 min cold on 2 cores (burn's CUDA backend and LLVM's NVPTX link); target/cuda keeps
# it apart from the test build.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
"$root/scripts/install-llvm.sh"
(cd "$root" && cargo build --release -p kiln --features kiln/cuda --target-dir target/cuda)
mkdir -p "$here/carry"
bin="$here/carry/kiln"
cp "$root/target/cuda/release/kiln" "$bin"
strip "$bin"
xz -T0 -9 -f -k "$bin"
rm -f "$bin"
size=$(stat -c %s "$bin.xz")
limit=$((60 * 1024 * 1024)) # 64 MiB for the whole tree; leave room for the sources
echo "packed $bin.xz: $((size / 1024 / 1024)) MiB"
[ "$size" -lt "$limit" ] || { echo "pack: $bin.xz is over 60 MiB: it will not travel" >&2; exit 1; }
cat <<'CALL'
Run it on the lent GPU (device tool), from the repository root:
  run(command="bash bench/gpu/run.sh", carry=["bench/gpu/carry"], timeout_s=600)
CALL

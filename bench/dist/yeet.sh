#!/usr/bin/env bash
# yeet benchmark, side by side in one run: put one tree (a Python-environment-like mix of many
# small files and a few large ones) into N destinations on this machine with
#   kiln yeet (N ranks over OpenMPI, each rank its own destination via {rank}),
#   cp -a     (N copies one after another, and N in parallel),
#   rsync -a  (N in parallel, as ezpz's per-file rsync fan-out does per node).
# Prints MB/s (tree bytes x N / seconds) of each. The page cache is warm for every tool
# (the tree is read once before timing).
#
# Usage: bench/dist/yeet.sh [--ranks N] [--mb SIZE_MB]
# Needs rsync (apt-get install rsync) and kiln built with --features mpi.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
ranks=3 mb=512
while [ $# -gt 0 ]; do
  case "$1" in
    --ranks) ranks=$2; shift 2 ;;
    --mb) mb=$2; shift 2 ;;
    *) echo "unknown argument $1" >&2; exit 2 ;;
  esac
done
command -v rsync >/dev/null || { echo "needs rsync (apt-get install rsync)" >&2; exit 1; }
(cd "$root" && cargo build --release -q --features kiln/mpi -p kiln)
kiln="$root/target/release/kiln"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1

# The tree: 90% of the bytes in 8 large files, the rest in 4000 small ones over 200 dirs.
src="$work/env"
python3 - "$src" "$mb" <<'PY'
import os, sys
root, mb = sys.argv[1], int(sys.argv[2])
big = mb * 9 // 10 * (1 << 20) // 8
small_total = mb * (1 << 20) - 8 * big
os.makedirs(root)
for i in range(8):
    with open(f"{root}/lib{i}.so", "wb") as f:
        f.write(os.urandom(big))
per = max(1, small_total // 4000)
for i in range(4000):
    d = f"{root}/site-packages/pkg{i % 200}"
    os.makedirs(d, exist_ok=True)
    with open(f"{d}/mod{i}.py", "wb") as f:
        f.write(os.urandom(per))
PY
bytes=$(du -sb "$src" | cut -f1)
cat $(find "$src" -type f) > /dev/null   # warm the page cache for everyone
sync

time_it() { # prints seconds of the command
  local t0 t1
  t0=$(date +%s.%N); "$@" >/dev/null 2>&1; t1=$(date +%s.%N)
  python3 -c "print($t1 - $t0)"
}
fresh() { rm -rf "$work/dst"; mkdir -p "$work/dst"; sync; }

fresh; t_yeet=$(time_it "$kiln" launch --mpi --np "$ranks" --run-dir "$work/launch" -- \
  "$kiln" yeet "$src" --dest "$work/dst/node-{rank}")
for r in $(seq 0 $((ranks - 1))); do
  diff -r "$src" "$work/dst/node-$r/env" >/dev/null || { echo "yeet copy $r differs" >&2; exit 1; }
done
fresh; t_cp_seq=$(time_it bash -c "for r in \$(seq 1 $ranks); do mkdir -p '$work/dst/n'\$r; cp -a '$src' '$work/dst/n'\$r/; done")
fresh; t_cp_par=$(time_it bash -c "for r in \$(seq 1 $ranks); do (mkdir -p '$work/dst/n'\$r && cp -a '$src' '$work/dst/n'\$r/) & done; wait")
fresh; t_rsync=$(time_it bash -c "for r in \$(seq 1 $ranks); do (mkdir -p '$work/dst/n'\$r && rsync -a '$src' '$work/dst/n'\$r/) & done; wait")
fresh
python3 - "$bytes" "$ranks" "$t_yeet" "$t_cp_seq" "$t_cp_par" "$t_rsync" "$here/yeet-result.json" <<'PY'
import json, sys
b, n = int(sys.argv[1]), int(sys.argv[2])
t = dict(zip(["kiln yeet", "cp -a (sequential)", "cp -a (parallel)", "rsync -a (parallel)"], map(float, sys.argv[3:7])))
print(f"tree {b/1e6:.0f} MB to {n} destinations on one machine")
for k, s in t.items():
    print(f"{k:22} {s:7.2f} s {b*n/s/1e6:8.1f} MB/s  (yeet takes {t['kiln yeet']/s:.2f}x as long)" if k != "kiln yeet" else f"{k:22} {s:7.2f} s {b*n/s/1e6:8.1f} MB/s")
json.dump(dict(bytes=b, destinations=n, seconds=t), open(sys.argv[7], "w"), indent=1)
PY

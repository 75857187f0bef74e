#!/usr/bin/env bash
# The cost of bf16 compute on this CPU: the same run with training.dtype = f32 and bf16
# (f32 master weights), back to back, median step time of each over the timed steps.
# burn's flex backend has no bf16 kernels: a bf16 matmul widens both operands to f32,
# multiplies in f32 and rounds the result, so on a CPU bf16 only adds casts. The setting is
# there for GPUs, where bf16 tensor cores run 2x (H100: 16x vs FP32 CUDA cores) faster.
#
# Usage: bench/train/precision.sh [--steps N] [--model default|reference]
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
steps=20 model=default
while [ $# -gt 0 ]; do
  case "$1" in
    --steps) steps=$2; shift 2 ;;
    --model) model=$2; shift 2 ;;
    *) echo "unknown argument $1" >&2; exit 2 ;;
  esac
done
(cd "$root" && cargo build --release -q -p kiln)
kiln="$root/target/release/kiln"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
shape=()
if [ "$model" = reference ]; then
  shape=(--set model.vocab_size=8192 --set model.d_model=384 --set model.n_layers=6
         --set model.n_heads=6 --set model.n_kv_heads=2 --set model.ffn_hidden=1024
         --set training.batch_size=8 --set training.seq_len=256)
fi
warmup=3
for dtype in f32 bf16; do
  "$kiln" train --run-dir "$work/$dtype" --no-progress-bar "${shape[@]}" \
    --set training.dtype=$dtype --set training.steps=$((steps + warmup)) \
    --set checkpoint.interval=0 --set eval.interval=0 --set eval.samples=0 \
    --set guards.frozen_check_interval=0 --set guards.snapshot_interval=0 >/dev/null
done
python3 - "$work" "$warmup" <<'PY'
import json, sys, statistics as st
t = {}
for d in ("f32", "bf16"):
    rows = [json.loads(l) for l in open(f"{sys.argv[1]}/{d}/metrics.jsonl") if '"step_time_s"' in l]
    t[d] = st.median(r["step_time_s"] for r in rows[int(sys.argv[2]):])
    print(f"{d:5} median step {1000 * t[d]:.1f} ms")
print(f"bf16 / f32 step time: {t['bf16'] / t['f32']:.2f}x")
PY

#!/usr/bin/env bash
# Checkpoint stall, asynchronous vs synchronous: the same run (the reference model's shape of
# bench/train/bench.sh: 8192 vocab, d 384, 6 layers, 15.7M parameters, so a checkpoint is
# 181 MB of weights and AdamW moments) checkpointing every 8 steps (room for the writer to
# finish before the next save, as in a real run), once with
# checkpoint.async=true and once with false. Prints, per mode, the mean and max of the
# step's stall (stall_s of the checkpoint_saved events) and of the write time (write_s),
# and the async stall as a fraction of the synchronous save.
#
# Usage: bench/train/checkpoint-stall.sh [--steps N] [--interval N] [--dir DIR]   (DIR on the disk to measure)
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
steps=24 interval=8 dir=""
while [ $# -gt 0 ]; do
  case "$1" in
    --steps) steps=$2; shift 2 ;;
    --interval) interval=$2; shift 2 ;;
    --dir) dir=$2; shift 2 ;;
    *) echo "unknown argument $1" >&2; exit 2 ;;
  esac
done
(cd "$root" && cargo build --release -q -p kiln)
kiln="$root/target/release/kiln"
work=${dir:-$(mktemp -d)}
[ -n "$dir" ] || trap 'rm -rf "$work"' EXIT
for mode in true false; do
  rm -rf "$work/ck-$mode"
  "$kiln" train --run-dir "$work/ck-$mode" --no-progress-bar \
    --set model.vocab_size=8192 --set model.d_model=384 --set model.n_layers=6 \
    --set model.n_heads=6 --set model.n_kv_heads=2 --set model.ffn_hidden=1024 \
    --set training.batch_size=2 --set training.seq_len=64 --set training.steps="$steps" \
    --set checkpoint.interval=$interval --set checkpoint.keep_latest_k=2 --set checkpoint.async=$mode \
    --set eval.interval=0 --set eval.samples=0 --set guards.frozen_check_interval=0 \
    --set guards.snapshot_interval=0 >/dev/null
done
python3 - "$work" <<'PY'
import json, sys, statistics as st
res = {}
for mode in ("true", "false"):
    ev = [json.loads(l) for l in open(f"{sys.argv[1]}/ck-{mode}/events.jsonl")]
    saves = [e for e in ev if e["event"] == "checkpoint_saved"]
    stall = [e["stall_s"] for e in saves]
    write = [e["write_s"] for e in saves]
    steps = [json.loads(l)["step_time_s"] for l in open(f"{sys.argv[1]}/ck-{mode}/metrics.jsonl") if '"step_time_s"' in l]
    res[mode] = (st.mean(stall), max(stall), st.mean(write), max(write), st.median(steps), len(saves))
    name = "async" if mode == "true" else "sync"
    print(f"{name:5}  saves={len(saves)}  stall mean={res[mode][0]:.3f}s max={res[mode][1]:.3f}s  "
          f"write mean={res[mode][2]:.3f}s max={res[mode][3]:.3f}s  median step={res[mode][4]:.3f}s")
print(f"async stall / sync save: {100 * res['true'][0] / res['false'][0]:.1f} % (goal <= 5 %)")
PY

#!/usr/bin/env bash
# Side-by-side training-step benchmark: kiln (burn flex) vs the PyTorch eager reference
# (bench/train/torch_ref.py), same model, batch and optimizer, same thread count, in one
# run, back to back. Prints both tokens/s and the ratio kiln/PyTorch.
#
# Reference model: vocab 8192, d_model 384, 6 layers, 6 query / 2 kv heads (head_dim 64), RoPE,
# RMSNorm, SwiGLU 1024, untied head, fp32, batch 8 x 256, AdamW (lr 3e-4, wd 0.1), clip 1.0.
#
# Prints peak RSS of both processes too (kiln: the child's ru_maxrss; PyTorch: its own).
#
# Usage: bench/train/bench.sh [--threads N] [--steps N] [--rounds N] [--torch fp32|compile]
#          [--set key=value]...   (--torch compile: torch.compile as the peer; --set: kiln overrides)
# Needs torch: installed from PyPI into bench/.venv on first use (~3 min, ~5 GB).
# Time it on a quiet machine: under load PyTorch degrades more than kiln and the ratio moves.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
threads=2 steps=20 rounds=2 variant=fp32
sets=()
while [ $# -gt 0 ]; do
  case "$1" in
    --torch) variant=$2; shift 2 ;;
    --set) sets+=(--set "$2"); shift 2 ;;
    --threads) threads=$2; shift 2 ;;
    --steps) steps=$2; shift 2 ;;
    --rounds) rounds=$2; shift 2 ;;
    *) echo "unknown argument $1" >&2; exit 2 ;;
  esac
done
ref="$root/bench/train/torch_ref.py"
[ -f "$ref" ] || { echo "missing $ref (the PyTorch reference)" >&2; exit 1; }
venv="$root/bench/.venv"
if ! "$venv/bin/python" -c 'import torch' 2>/dev/null; then
  echo "installing torch into $venv ..." >&2
  python3 -m venv "$venv"
  "$venv/bin/pip" install -q torch numpy
fi
(cd "$root" && cargo build --release -q -p kiln)
kiln="$root/target/release/kiln"
warmup=3
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

run_kiln() {
  rm -rf "$work/kiln"
  # peak RSS of the kiln process (ru_maxrss of the waited-for child), in MiB
  RAYON_NUM_THREADS=$threads python3 -c '
import resource, subprocess, sys
rc = subprocess.run(sys.argv[2:], stdout=subprocess.DEVNULL).returncode
open(sys.argv[1], "w").write(f"{resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024:.0f}")
sys.exit(rc)' "$work/kiln_rss" "$kiln" train --run-dir "$work/kiln" --no-progress-bar \
    --set model.vocab_size=8192 --set model.d_model=384 --set model.n_layers=6 \
    --set model.n_heads=6 --set model.n_kv_heads=2 --set model.ffn_hidden=1024 \
    --set model.tie_embeddings=false --set model.scale_residual_init=false \
    --set training.batch_size=8 --set training.seq_len=256 --set training.threads="$threads" \
    --set training.steps=$((steps + warmup)) --set optimizer.lr=3e-4 --set optimizer.weight_decay=0.1 \
    --set optimizer.beta2=0.999 --set optimizer.max_grad_norm=1.0 \
    --set lr_scheduler.kind=constant --set lr_scheduler.warmup_steps=0 \
    --set checkpoint.interval=0 --set eval.interval=0 --set eval.samples=0 \
    --set guards.frozen_check_interval=0 --set guards.snapshot_interval=0 "${sets[@]}"
  # tokens/s over the timed steps (after warmup), from the step times in metrics.jsonl
  python3 - "$work/kiln/metrics.jsonl" "$warmup" "$(cat "$work/kiln_rss")" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if '"step_time_s"' in l]
timed = rows[int(sys.argv[2]):]
t = sum(r["step_time_s"] for r in timed)
print(f"{8 * 256 * len(timed) / t:.1f} {1000 * t / len(timed):.1f} {sys.argv[3]}")
PY
}

run_torch() {
  "$venv/bin/python" "$ref" --variant "$variant" --threads "$threads" --steps "$steps" --warmup "$warmup" \
    | awk -F= '/^tokens_per_s=/{tps=$2} /^step_ms=/{ms=$2} /^peak_rss_mib=/{rss=$2} END{printf "%s %s %.0f\n", tps, ms, rss}'
}

echo "threads=$threads steps=$steps (+$warmup warmup) rounds=$rounds torch=$variant load=$(cut -d' ' -f1-3 /proc/loadavg)"
printf '%-6s %12s %9s %10s %12s %9s %10s %7s %6s\n' round kiln_tok/s kiln_ms kiln_rss torch_tok/s torch_ms torch_rss ratio load1
best_k=0 best_t=0
for r in $(seq 1 "$rounds"); do
  read -r kt kms krss < <(run_kiln)
  read -r tt tms trss < <(run_torch)
  ratio=$(python3 -c "print(f'{$kt/$tt:.3f}')")
  printf '%-6s %12s %9s %7s MiB %12s %9s %6s MiB %7s %6s\n' "$r" "$kt" "$kms" "$krss" "$tt" "$tms" "$trss" "$ratio" "$(cut -d' ' -f1 /proc/loadavg)"
  best_k=$(python3 -c "print(max($best_k, $kt))")
  best_t=$(python3 -c "print(max($best_t, $tt))")
done
echo "best: kiln=${best_k} tok/s torch($variant)=${best_t} tok/s ratio(kiln/torch)=$(python3 -c "print(f'{$best_k/$best_t:.3f}')")"

#!/usr/bin/env bash
# Data-parallel benchmark, side by side in one run: the reference model (see bench.sh) on
# 1 rank x 1 thread and on 2 ranks x 1 thread, with kiln (kiln launch --mpi, OpenMPI) and with
# PyTorch DDP (gloo, torchrun; bench/train/ddp_ref.py). Every rank trains on its own batch of
# 8 x 256 tokens (global batch = 8 x ranks). Prints global tokens/s, the kiln/PyTorch ratio,
# each one's scaling efficiency against its own 1-rank run, kiln's gradient all-reduce time per
# step and a raw MPI all-reduce of the same bytes (crates/kiln-dist/examples/allreduce.rs).
#
# Usage: bench/train/dp.sh [--steps N] [--ranks N]    (needs torch in bench/.venv: see bench.sh)
# Run on a quiet machine: MPI and gloo both poll, so a busy core distorts both.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
steps=10 ranks=2 warmup=3
while [ $# -gt 0 ]; do
  case "$1" in
    --steps) steps=$2; shift 2 ;;
    --ranks) ranks=$2; shift 2 ;;
    *) echo "unknown argument $1" >&2; exit 2 ;;
  esac
done
venv="$root/bench/.venv"
"$venv/bin/python" -c 'import torch' 2>/dev/null || { echo "no torch in $venv: run bench/train/bench.sh once" >&2; exit 1; }
(cd "$root" && cargo build --release -q --features kiln/mpi -p kiln -p kiln-dist --examples --bins)
kiln="$root/target/release/kiln"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMP_NUM_THREADS=1

model=(--set model.vocab_size=8192 --set model.d_model=384 --set model.n_layers=6
  --set model.n_heads=6 --set model.n_kv_heads=2 --set model.ffn_hidden=1024
  --set model.tie_embeddings=false --set model.scale_residual_init=false
  --set training.batch_size=8 --set training.seq_len=256 --set training.threads=1
  --set training.compute_shards=1 --set training.steps=$((steps + warmup))
  --set optimizer.lr=3e-4 --set optimizer.weight_decay=0.1 --set optimizer.beta2=0.999
  --set optimizer.max_grad_norm=1.0 --set lr_scheduler.kind=constant --set lr_scheduler.warmup_steps=0
  --set checkpoint.interval=0 --set eval.interval=0 --set eval.samples=0
  --set guards.frozen_check_interval=0 --set guards.snapshot_interval=0 --set guards.replica_check_interval=0)

# prints: tokens/s step_ms allreduce_ms params
kiln_stats() {
  python3 - "$1/metrics.jsonl" "$warmup" "$1/events.jsonl" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if '"step_time_s"' in l][int(sys.argv[2]):]
t = sum(r["step_time_s"] for r in rows)
tok = sum(r["global_batch"] for r in rows) * 256
ar = sum(r.get("allreduce_s", 0.0) for r in rows) / len(rows)
params = next(json.loads(l)["params"] for l in open(sys.argv[3]) if '"event":"start"' in l)
print(f"{tok / t:.1f} {1000 * t / len(rows):.1f} {1000 * ar:.1f} {params}")
PY
}

run_kiln() { # $1 ranks
  rm -rf "$work/k$1"
  if [ "$1" = 1 ]; then
    "$kiln" train --run-dir "$work/k1" --no-progress-bar "${model[@]}" >/dev/null
  else
    "$kiln" launch --mpi --np "$1" --run-dir "$work/k$1" -- \
      "$kiln" train --run-dir "$work/k$1" --no-progress-bar "${model[@]}" >/dev/null
  fi
  kiln_stats "$work/k$1"
}

run_torch() { # $1 ranks
  "$venv/bin/torchrun" --standalone --nproc_per_node "$1" "$here/ddp_ref.py" \
    --threads 1 --steps "$steps" --warmup "$warmup" 2>/dev/null \
    | awk -F= '/^tokens_per_s=/{tps=$2} /^step_ms=/{ms=$2} END{print tps, ms}'
}

echo "steps=$steps (+$warmup warmup) ranks=$ranks load=$(cut -d' ' -f1-3 /proc/loadavg)"
read -r k1 k1ms _ params < <(run_kiln 1)
read -r t1 t1ms < <(run_torch 1)
read -r kn knms kar _ < <(run_kiln "$ranks")
read -r tn tnms < <(run_torch "$ranks")
raw=$(mpirun --oversubscribe -np "$ranks" "$root/target/release/examples/allreduce" --floats "$params" --reps 10 \
  | sed -n 's/.*median_ms=\([0-9.]*\).*/\1/p')
python3 - "$ranks" "$k1" "$k1ms" "$t1" "$t1ms" "$kn" "$knms" "$tn" "$tnms" "$kar" "$raw" "$params" "$here/dp-result.json" <<'PY'
import json, sys
n = int(sys.argv[1]); k1, k1ms, t1, t1ms, kn, knms, tn, tnms, kar, raw = map(float, sys.argv[2:12])
params = int(sys.argv[12])
print(f"{'':24} {'kiln':>12} {'pytorch':>12} {'ratio':>7}")
print(f"{'1 rank x 1 thread tok/s':24} {k1:12.1f} {t1:12.1f} {k1/t1:7.3f}")
print(f"{f'{n} ranks x 1 thread tok/s':24} {kn:12.1f} {tn:12.1f} {kn/tn:7.3f}")
print(f"{'scaling efficiency':24} {kn/(n*k1):12.3f} {tn/(n*t1):12.3f}")
print(f"kiln all-reduce per step: {kar:.1f} ms (gradients of {params} params, {4*params/1e6:.1f} MB, incl. host copies and the wait for the slower rank);"
      f" raw MPI all-reduce of the same bytes: {raw:.1f} ms")
json.dump(dict(ranks=n, kiln_1=k1, torch_1=t1, kiln_n=kn, torch_n=tn, ratio_n=kn/tn,
               kiln_efficiency=kn/(n*k1), torch_efficiency=tn/(n*t1), kiln_allreduce_ms=kar,
               raw_mpi_allreduce_ms=raw, params=params), open(sys.argv[13], "w"), indent=1)
PY

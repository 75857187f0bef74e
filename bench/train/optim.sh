#!/usr/bin/env bash
# Optimizer benchmark, side by side in one run, on 2 ranks x 1 thread: kiln's AdamW, Muon, Mano,
# SophiaG, SPAM and Schedule-Free AdamW, each replicated (parallelism.shard = none) and sharded
# (gradients; Schedule-Free: parameters, the sharding it takes), beside PyTorch
# DDP with torch.optim.AdamW and torch.optim.Muon (bench/train/optim_ref.py: Muon for the
# blocks' matrices, AdamW for the rest, as kiln splits them). Two models: the reference model
# of bench.sh (~15.7M, batch 8 x 256 per rank) and the ~107M model of tp.sh (batch 4 x 256).
# Per row: global tokens/s (median step), the step and the optimizer's median time per step
# (kiln: update_s in metrics.jsonl, the update with, when sharded, the gather of the updated
# parameters and Muon's whole matrices; PyTorch: opt.step()), its share of the step, and the
# largest peak RSS of a rank. SophiaG's Hessian pass (every optimizer.sophia.hessian_interval
# = 10 steps, an extra forward and backward) falls outside the median; its mean is beside it.
# Writes PREFIX-rows.jsonl and PREFIX-result.md.
#
# Usage: bench/train/optim.sh [--steps N] [--warmup N] [--models "ref 107m"] [--out PREFIX]
# Needs torch in bench/.venv (see bench.sh). Run on a quiet machine.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
cmdline="bench/train/optim.sh${*:+ $*}"
steps=6 warmup=2 models="ref 107m" out="$here/optim"
while [ $# -gt 0 ]; do
  case "$1" in
    --steps) steps=$2; shift 2 ;;
    --warmup) warmup=$2; shift 2 ;;
    --models) models=$2; shift 2 ;;
    --out) out=$2; shift 2 ;;
    *) echo "unknown argument $1" >&2; exit 2 ;;
  esac
done
venv="$root/bench/.venv"
"$venv/bin/python" -c 'import torch' 2>/dev/null || { echo "no torch in $venv: run bench/train/bench.sh once" >&2; exit 1; }
(cd "$root" && cargo build --release -q --features kiln/mpi -p kiln)
kiln="$root/target/release/kiln"
commit=$(cd "$root" && git describe --always --dirty)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMP_NUM_THREADS=1
results="$out-rows.jsonl"
: >"$results"

model() { # $1 ref|107m
  case "$1" in
    ref) echo --set model.d_model=384 --set model.n_layers=6 --set model.n_heads=6 \
      --set model.n_kv_heads=2 --set model.ffn_hidden=1024 --set training.batch_size=8 ;;
    107m) echo --set model.d_model=1024 --set model.n_layers=8 --set model.n_heads=16 \
      --set model.n_kv_heads=4 --set model.ffn_hidden=2816 --set training.batch_size=4 ;;
  esac
  echo --set model.vocab_size=8192 --set model.tie_embeddings=false \
    --set model.scale_residual_init=false --set training.seq_len=256 --set training.threads=1 \
    --set training.compute_shards=1 --set training.steps=$((steps + warmup)) \
    --set optimizer.lr=3e-4 --set optimizer.weight_decay=0.1 --set optimizer.max_grad_norm=1.0 \
    --set lr_scheduler.kind=constant --set lr_scheduler.warmup_steps=0 \
    --set checkpoint.interval=0 --set checkpoint.snapshot_interval=0 --set eval.interval=0 \
    --set eval.samples=0 --set guards.frozen_check_interval=0 --set guards.snapshot_interval=0 \
    --set guards.replica_check_interval=0
}

run_kiln() { # $1 model $2 optimizer $3 shard
  local rd="$work/k-$1-$2-$3"
  # shellcheck disable=SC2046
  "$kiln" launch --mpi --np 2 --heartbeat-timeout 30 --run-dir "$rd" -- \
    "$kiln" train --run-dir "$rd" --no-progress-bar $(model "$1") \
    --set optimizer.kind="$2" --set parallelism.shard="$3" >/dev/null
  python3 - "$rd" "$warmup" "$1" "$2" "$3" >>"$results" <<'PY'
import json, statistics, sys
rd, warm, model, opt, shard = sys.argv[1], int(sys.argv[2]), *sys.argv[3:6]
rows = [json.loads(l) for l in open(f"{rd}/metrics.jsonl") if '"step_time_s"' in l][warm:]
step = statistics.median(r["step_time_s"] for r in rows)
upd = statistics.median(r["update_s"] for r in rows)
ev = [json.loads(l) for l in open(f"{rd}/events.jsonl")]
rss = max(next(e["rank_mib"] for e in ev if e["event"] == "peak_memory"))
print(json.dumps(dict(peer="kiln", model=model, optimizer=opt, shard=shard,
                      tokens_per_s=rows[0]["global_batch"] * 256 / step, step_ms=1000 * step,
                      opt_ms=1000 * upd, opt_mean_ms=1000 * statistics.mean(r["update_s"] for r in rows),
                      peak_rss_mib=rss, loss=rows[-1]["loss"])))
PY
  rm -rf "$rd"
}

run_torch() { # $1 model $2 optimizer
  local batch=8
  [ "$1" = 107m ] && batch=4
  "$venv/bin/torchrun" --standalone --nproc_per_node 2 "$here/optim_ref.py" --model "$1" \
    --optimizer "$2" --batch $batch --steps "$steps" --warmup "$warmup" >"$work/t.out" 2>"$work/t.err" \
    || { echo "pytorch $1 $2 failed:" >&2; tail -5 "$work/t.err" >&2; return 0; }
  python3 -c '
import json, sys
kv = dict(l.strip().split("=", 1) for l in open(sys.argv[1]) if "=" in l)
f = lambda k: float(kv[k])
print(json.dumps(dict(peer="pytorch", model=sys.argv[2], optimizer=sys.argv[3], shard="none",
                      tokens_per_s=f("tokens_per_s"), step_ms=f("step_ms"), opt_ms=f("opt_ms"),
                      opt_mean_ms=f("opt_ms"), peak_rss_mib=f("peak_rss_mib"), torch=kv["torch"])))' \
    "$work/t.out" "$1" "$2" >>"$results"
}

echo "steps=$steps (+$warmup warmup) models=[$models] load=$(cut -d' ' -f1-3 /proc/loadavg)"
for m in $models; do
  for o in adamw muon mano sophiag spam schedule_free_adamw; do
    sharded=gradients
    [ "$o" = schedule_free_adamw ] && sharded=parameters
    for s in none $sharded; do
      echo "$m: kiln $o shard=$s" >&2
      run_kiln "$m" "$o" "$s" || echo "kiln $m $o $s failed" >&2
    done
    if [ "$o" = adamw ] || [ "$o" = muon ]; then
      echo "$m: pytorch $o" >&2
      run_torch "$m" "$o"
    fi
  done
done
python3 - "$results" "$out-result.md" "$cmdline" "$steps" "$warmup" "$commit" "$(nproc --all)" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
cmd, steps, warmup, commit, cpus = sys.argv[3:8]
torch = next((r["torch"] for r in rows if r["peer"] == "pytorch"), "?")
out = [f"`{cmd}`", "",
       f"kiln {commit} (`kiln launch --mpi --np 2`) vs PyTorch {torch} DDP (torchrun, gloo, "
       f"bench/train/optim_ref.py), {cpus} CPUs, 2 ranks x 1 thread, fp32, clip 1.0, lr 3e-4, "
       f"wd 0.1; median of {steps} timed steps after {warmup} warmup. opt = the optimizer's "
       f"median time per step (kiln: update_s; sharded: with the gather of the updated "
       f"parameters and Muon's whole matrices); vs AdamW = tok/s over the same peer's and "
       f"sharding's AdamW row.", "",
       "| model | peer | optimizer | shard | tok/s | vs AdamW | step ms | opt ms (share) | opt mean ms | peak RSS/rank MiB |",
       "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
for r in rows:
    base = next((b for b in rows if b["peer"] == r["peer"] and b["model"] == r["model"]
                 and b["shard"] == r["shard"] and b["optimizer"] == "adamw"), None)
    vs = f"{r['tokens_per_s'] / base['tokens_per_s']:.2f}" if base else "-"
    out.append(f"| {r['model']} | {r['peer']} | {r['optimizer']} | {r['shard']} | "
               f"{r['tokens_per_s']:.0f} | {vs} | {r['step_ms']:.0f} | "
               f"{r['opt_ms']:.0f} ({100 * r['opt_ms'] / r['step_ms']:.0f} %) | "
               f"{r['opt_mean_ms']:.0f} | {r['peak_rss_mib']:.0f} |")
open(sys.argv[2], "w").write("\n".join(out) + "\n")
print("\n".join(out))
PY

#!/usr/bin/env bash
# Sharding benchmark, side by side in one run: the reference model of bench.sh (16M params,
# batch 8 x 256 a rank) and one 4x its width (d_model 1536, ffn 4096: 176M params, batch 1 x 256
# a rank), on 1, 2 and 4 ranks x 1 thread; kiln (kiln launch --mpi, OpenMPI) with
# parallelism.shard = none / optimizer / gradients / parameters, and "hybrid" (parameters with
# parallelism.dp_replicate = 2, on 4 ranks), and PyTorch (gloo, torchrun;
# bench/train/shard_ref.py) with DDP / ZeroRedundancyOptimizer + DDP / FSDP2 fully_shard (the
# peer of both gradient and parameter sharding: FSDP2 shards all three; it runs once) / HSDP
# (fully_shard on a 2 x ranks/2 mesh).
# For each: global tokens/s, the largest peak RSS of any rank (VmHWM; kiln's `peak_memory`
# event), and the largest per-rank training state (kiln: weights 4P + gradients + AdamW
# moments 8P as its mode keeps them; PyTorch: counted from the tensors a rank holds).
# Writes bench/train/shard-result.json and shard-result.md.
#
# Usage: bench/train/shard.sh [--steps N] [--ranks "1 2 4"] [--widths "1 4"]
#        [--modes "none optimizer gradients parameters hybrid"] [--out PREFIX]
# (PREFIX-result.json and PREFIX-result.md; default bench/train/shard, for a partial run elsewhere)
# Needs torch in bench/.venv (see bench.sh). Run on a quiet machine; with more ranks than
# cores both kiln and PyTorch are oversubscribed alike.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
steps=3 warmup=2 ranks="1 2 4" widths="1 4" out="$here/shard"
modes="none optimizer gradients parameters hybrid"
while [ $# -gt 0 ]; do
  case "$1" in
    --steps) steps=$2; shift 2 ;;
    --ranks) ranks=$2; shift 2 ;;
    --widths) widths=$2; shift 2 ;;
    --modes) modes=$2; shift 2 ;;
    --out) out=$2; shift 2 ;;
    *) echo "unknown argument $1" >&2; exit 2 ;;
  esac
done
venv="$root/bench/.venv"
"$venv/bin/python" -c 'import torch' 2>/dev/null || { echo "no torch in $venv: run bench/train/bench.sh once" >&2; exit 1; }
(cd "$root" && cargo build --release -q --features kiln/mpi -p kiln)
kiln="$root/target/release/kiln"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMP_NUM_THREADS=1
# Rows land beside the results as they come, so a run cut short keeps what it measured.
results="$out-rows.jsonl"
: >"$results"

model() { # $1 width
  local d=$((384 * $1)) f=$((1024 * $1)) b=8
  [ "$1" = 1 ] || b=1
  echo --set model.vocab_size=8192 --set model.d_model=$d --set model.n_layers=6 \
    --set model.n_heads=6 --set model.n_kv_heads=2 --set model.ffn_hidden=$f \
    --set model.tie_embeddings=false --set model.scale_residual_init=false \
    --set training.batch_size=$b --set training.seq_len=256 --set training.threads=1 \
    --set training.compute_shards=1 --set training.steps=$((steps + warmup)) \
    --set optimizer.lr=3e-4 --set optimizer.weight_decay=0.1 --set optimizer.max_grad_norm=1.0 \
    --set lr_scheduler.kind=constant --set lr_scheduler.warmup_steps=0 \
    --set checkpoint.interval=0 --set checkpoint.snapshot_interval=0 --set eval.interval=0 \
    --set eval.samples=0 --set guards.frozen_check_interval=0 --set guards.snapshot_interval=0 \
    --set guards.replica_check_interval=0
}

run_kiln() { # $1 width $2 ranks $3 mode
  local rd="$work/k-$1-$2-$3" shard="--set parallelism.shard=$3"
  [ "$3" != hybrid ] || shard="--set parallelism.shard=parameters --set parallelism.dp_replicate=2"
  # shellcheck disable=SC2046,SC2086
  if [ "$2" = 1 ]; then
    "$kiln" train --run-dir "$rd" --no-progress-bar $(model "$1") $shard >/dev/null
  else
    # 4 ranks of the x4 model take 22 GB of this 24 GB machine: under that memory pressure a
    # rank's heartbeat thread can starve past the default 1 s bound (seen at the final save).
    "$kiln" launch --mpi --np "$2" --heartbeat-timeout 30 --run-dir "$rd" -- \
      "$kiln" train --run-dir "$rd" --no-progress-bar $(model "$1") $shard >/dev/null
  fi
  python3 - "$rd" "$warmup" "$1" "$2" "$3" >>"$results" <<'PY'
import json, sys
rd, warm, width, n, mode = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
rows = [json.loads(l) for l in open(f"{rd}/metrics.jsonl") if '"step_time_s"' in l][warm:]
t = sum(r["step_time_s"] for r in rows)
tok = sum(r["global_batch"] for r in rows) * 256
ev = [json.loads(l) for l in open(f"{rd}/events.jsonl")]
p = next(e["params"] for e in ev if e["event"] == "start")
peak = max(next(e["rank_mib"] for e in ev if e["event"] == "peak_memory"))
s = n // 2 if mode == "hybrid" else n  # the ranks the state is cut over
grads = {"none": 4 * p, "optimizer": 4 * p}.get(mode, 4 * p / s)
weights = 4 * p / s if mode in ("parameters", "hybrid") else 4 * p
moments = 8 * p / (1 if mode == "none" else s)
print(json.dumps(dict(peer="kiln", width=width, ranks=n, mode=mode, params=p, tokens_per_s=tok / t,
                      peak_rss_mib=peak, state_mib=(weights + grads + moments) / 2**20)))
PY
  rm -rf "$rd" # its final checkpoint: 2 GB on the x4 model
}

run_torch() { # $1 width $2 ranks $3 mode
  local b=8
  [ "$1" = 1 ] || b=1
  "$venv/bin/torchrun" --standalone --nproc_per_node "$2" "$here/shard_ref.py" --mode "$3" \
    --width "$1" --batch $b --threads 1 --steps "$steps" --warmup "$warmup" 2>"$work/torch.err" \
    | python3 -c '
import json, sys
kv = dict(l.strip().split("=", 1) for l in sys.stdin if "=" in l and not l.startswith("torch="))
w, n, mode = map(str, sys.argv[1:4])
print(json.dumps(dict(peer="pytorch", width=int(w), ranks=int(n), mode=mode,
                      tokens_per_s=float(kv["tokens_per_s"]), peak_rss_mib=float(kv["peak_rss_mib"]),
                      state_mib=float(kv["state_mib"]))))' "$1" "$2" "$3" >>"$results" \
    || { echo "pytorch $3 on $2 ranks failed:" >&2; tail -3 "$work/torch.err" >&2; }
}

echo "steps=$steps (+$warmup warmup) ranks=[$ranks] widths=[$widths] load=$(cut -d' ' -f1-3 /proc/loadavg)"
for w in $widths; do
  for n in $ranks; do
    for pair in "none ddp" "optimizer zero" "gradients fsdp2" "parameters -" "hybrid hsdp"; do
      set -- $pair
      case " $modes " in *" $1 "*) ;; *) continue ;; esac
      if [ "$n" = 1 ] && [ "$1" != none ]; then continue; fi
      if [ "$1" = hybrid ] && [ "$n" != 4 ]; then continue; fi
      # Without the gradients row, the parameters row runs FSDP2 itself.
      if [ "$1" = parameters ] && [[ " $modes " != *" gradients "* ]]; then set -- parameters fsdp2; fi
      echo "width x$w, $n rank(s): kiln $1, pytorch $2" >&2
      run_kiln "$w" "$n" "$1"
      [ "$2" = - ] || run_torch "$w" "$n" "$2"
    done
  done
done
python3 - "$results" "$out-result.json" "$out-result.md" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
json.dump(rows, open(sys.argv[2], "w"), indent=1)
pair = {"none": "ddp", "optimizer": "zero", "gradients": "fsdp2", "parameters": "fsdp2", "hybrid": "hsdp"}
out = ["| width | ranks | kiln mode | kiln tok/s | PyTorch mode | PyTorch tok/s | ratio | kiln peak RSS / rank | PyTorch peak RSS / rank | kiln state / rank | PyTorch state / rank |",
       "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
mib = lambda r, key: f"{r[key]:.0f} MiB" if r else "-"
for k in (r for r in rows if r["peer"] == "kiln"):
    t = next((r for r in rows if r["peer"] == "pytorch" and r["width"] == k["width"]
              and r["ranks"] == k["ranks"] and r["mode"] == pair[k["mode"]]), None)
    tt = f"{t['tokens_per_s']:.0f}" if t else "failed"
    ratio = f"{k['tokens_per_s'] / t['tokens_per_s']:.2f}" if t else "-"
    out.append(f"| x{k['width']} | {k['ranks']} | {k['mode']} | {k['tokens_per_s']:.0f} | {pair[k['mode']]} | {tt} | {ratio} | "
               f"{mib(k, 'peak_rss_mib')} | {mib(t, 'peak_rss_mib')} | {mib(k, 'state_mib')} | {mib(t, 'state_mib')} |")
open(sys.argv[3], "w").write("\n".join(out) + "\n")
print("\n".join(out))
PY

#!/usr/bin/env bash
# Tensor-parallel benchmark, side by side in one run: a ~107M-parameter Llama (vocab 8192,
# d_model 1024, 8 layers, 16 q heads / 4 kv heads of 64, SwiGLU 2816, untied head, seq 256,
# fp32, AdamW 3e-4 wd 0.1, clip 1.0), batch 4 x 256 per data-parallel rank, 1 thread a rank:
#   single      1 rank: kiln (parallelism.tp = 1) / PyTorch plain (no parallelism)
#   tp=2        2 ranks: kiln parallelism.tp = 2 / PyTorch DTensor TP on a 1-D mesh of 2
#   tp=4        4 ranks: kiln parallelism.tp = 4 / PyTorch DTensor TP on a 1-D mesh of 4
#   tp=2xfsdp=2 4 ranks: kiln parallelism.tp = 2 + parallelism.shard = parameters / PyTorch
#               (dp, tp) = (2, 2) mesh, TP on "tp" then FSDP2 fully_shard on "dp"
# kiln runs under `kiln launch --mpi` (OpenMPI), PyTorch under torchrun (gloo;
# bench/train/tp_ref.py, torchtitan's apply_tp plan), each layout kiln then PyTorch.
# For each: global tokens/s (global tokens of a step over the median step time of the timed
# steps), the largest peak RSS of any rank (VmHWM; kiln's `peak_memory` event; PyTorch's
# ru_maxrss), and the largest per-rank training state (weights + gradients + AdamW moments),
# all of it and the 2-D matrices only. Writes PREFIX-rows.jsonl, PREFIX-result.json and
# PREFIX-result.md.
#
# Usage: bench/train/tp.sh [--steps N] [--warmup N] [--layouts "single tp2 tp4 tp2fsdp2"]
#        [--out PREFIX]   (default PREFIX bench/train/tp)
# Needs torch in bench/.venv (see bench.sh). Run on a quiet machine; with more ranks than
# cores both kiln and PyTorch are oversubscribed alike.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
cmdline="bench/train/tp.sh${*:+ $*}"
steps=3 warmup=2 layouts="single tp2 tp4 tp2fsdp2" out="$here/tp" batch=4
while [ $# -gt 0 ]; do
  case "$1" in
    --steps) steps=$2; shift 2 ;;
    --warmup) warmup=$2; shift 2 ;;
    --layouts) layouts=$2; shift 2 ;;
    --out) out=$2; shift 2 ;;
    *) echo "unknown argument $1" >&2; exit 2 ;;
  esac
done
venv="$root/bench/.venv"
"$venv/bin/python" -c 'import torch' 2>/dev/null || { echo "no torch in $venv: run bench/train/bench.sh once" >&2; exit 1; }
(cd "$root" && cargo build --release -q --features kiln/mpi -p kiln)
kiln="$root/target/release/kiln"
commit=$(cd "$root" && git describe --always --dirty) # what the binary was built from
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMP_NUM_THREADS=1
# Rows land beside the results as they come, so a run cut short keeps what it measured.
results="$out-rows.jsonl"
: >"$results"

model() {
  echo --set model.vocab_size=8192 --set model.d_model=1024 --set model.n_layers=8 \
    --set model.n_heads=16 --set model.n_kv_heads=4 --set model.ffn_hidden=2816 \
    --set model.tie_embeddings=false --set model.scale_residual_init=false \
    --set training.batch_size=$batch --set training.seq_len=256 --set training.threads=1 \
    --set training.compute_shards=1 --set training.steps=$((steps + warmup)) \
    --set optimizer.lr=3e-4 --set optimizer.weight_decay=0.1 --set optimizer.max_grad_norm=1.0 \
    --set lr_scheduler.kind=constant --set lr_scheduler.warmup_steps=0 \
    --set checkpoint.interval=0 --set checkpoint.snapshot_interval=0 --set eval.interval=0 \
    --set eval.samples=0 --set guards.frozen_check_interval=0 --set guards.snapshot_interval=0 \
    --set guards.replica_check_interval=0
}

layout() { # $1 layout -> "ranks tp fsdp pytorch-mode"
  case "$1" in
    single) echo 1 1 1 plain ;;
    tp2) echo 2 2 1 tp ;;
    tp4) echo 4 4 1 tp ;;
    tp2fsdp2) echo 4 2 2 fsdp_tp ;;
    *) echo "unknown layout $1" >&2; exit 2 ;;
  esac
}

load() { cut -d' ' -f1 /proc/loadavg; }

run_kiln() { # $1 layout $2 ranks $3 tp $4 fsdp
  local rd="$work/k-$1" par="--set parallelism.tp=$3" l0
  [ "$4" = 1 ] || par="$par --set parallelism.shard=parameters"
  l0=$(load)
  # shellcheck disable=SC2046,SC2086
  if [ "$2" = 1 ]; then
    "$kiln" train --run-dir "$rd" --no-progress-bar $(model) $par >/dev/null
  else
    # As in shard.sh: under memory pressure a rank's heartbeat can starve past the 1 s default.
    "$kiln" launch --mpi --np "$2" --heartbeat-timeout 30 --run-dir "$rd" -- \
      "$kiln" train --run-dir "$rd" --no-progress-bar $(model) $par >/dev/null
  fi
  python3 - "$rd" "$warmup" "$1" "$2" "$3" "$4" "$l0" "$(load)" >>"$results" <<'PY'
import json, statistics, sys
rd, warm, lay = sys.argv[1], int(sys.argv[2]), sys.argv[3]
n, tp, fsdp = map(int, sys.argv[4:7])
rows = [json.loads(l) for l in open(f"{rd}/metrics.jsonl") if '"step_time_s"' in l][warm:]
med = statistics.median(r["step_time_s"] for r in rows)
ev = [json.loads(l) for l in open(f"{rd}/events.jsonl")]
p = next(e["params"] for e in ev if e["event"] == "start")
ranks_mib = next(e["rank_mib"] for e in ev if e["event"] == "peak_memory")
steady = max(r["rss_mib"] for r in rows)  # this process's (rank 0's) RSS at the timed steps' ends
# kiln's per-rank state, from the model's dims: each parameter's local numel on this tp rank
# (Llama::tensor_parallel: embedding [V/tp, D] and head [D, V/tp] by the vocabulary; q [D, H*hd/tp],
# k and v [D, KV*hd/tp] (tp divides KV here), gate and up [D, F/tp] by columns; o [H*hd/tp, D] and
# down [F/tp, D] by rows; the norms' [D] whole on every tp rank), times 4 bytes of weight + 4 of
# gradient + 8 of AdamW moments, over the FSDP ranks (parallelism.shard = parameters cuts all three
# over dp_shard; 1 without it). Padding of the flat shards is not counted.
V, D, L, H, KV, hd, F = 8192, 1024, 8, 16, 4, 64, 2816
mats = [V * D // tp, D * V // tp] + L * [D * H * hd // tp, 2 * D * KV * hd // tp,
                                         H * hd * D // tp, 2 * D * F // tp, F * D // tp]
norms = (2 * L + 1) * [D]
assert sum(mats) * tp + sum(norms) == p, (sum(mats) * tp + sum(norms), p)
mib = lambda elems: 16 * elems / fsdp / 2**20
print(json.dumps(dict(peer="kiln", layout=lay, ranks=n, tp=tp, fsdp=fsdp, params=p,
                      tokens_per_s=rows[0]["global_batch"] * 256 / med, step_ms=1000 * med,
                      step_ms_all=[round(1000 * r["step_time_s"], 1) for r in rows],
                      global_batch=rows[0]["global_batch"], peak_rss_mib=max(ranks_mib),
                      peak_rss_mib_ranks=ranks_mib, rank0_step_rss_mib=steady,
                      state_mib=mib(sum(mats) + sum(norms)), matrix_state_mib=mib(sum(mats)),
                      matrix_state_replicated_mib=16 * sum(mats) * tp / 2**20,
                      load=[float(sys.argv[7]), float(sys.argv[8])])))
PY
  rm -rf "$rd" # its final checkpoint
}

run_torch() { # $1 layout $2 ranks $3 mode
  local l0
  l0=$(load)
  "$venv/bin/torchrun" --standalone --nproc_per_node "$2" "$here/tp_ref.py" --mode "$3" \
    --batch $batch --threads 1 --steps "$steps" --warmup "$warmup" >"$work/torch.out" 2>"$work/torch.err" \
    || { echo "pytorch $3 on $2 ranks failed:" >&2; grep -v _redistribute "$work/torch.err" | tail -15 >&2; }
  python3 -c '
import json, sys
kv = dict(l.strip().split("=", 1) for l in open(sys.argv[1]) if "=" in l and not l.startswith("torch="))
lay, n, mode, l0, l1 = sys.argv[2:7]
f = lambda k: float(kv[k])
print(json.dumps(dict(peer="pytorch", layout=lay, ranks=int(n), mode=mode, params=int(kv["params"]),
                      tokens_per_s=f("tokens_per_s"), step_ms=f("step_ms"),
                      step_ms_all=[float(t) for t in kv["step_ms_all"].split(",")],
                      peak_rss_mib=f("peak_rss_mib"), state_mib=f("state_mib"),
                      matrix_state_mib=f("matrix_state_mib"),
                      matrix_state_replicated_mib=f("matrix_state_replicated_mib"),
                      loss=f("loss"), load=[float(l0), float(l1)])))' \
    "$work/torch.out" "$1" "$2" "$3" "$l0" "$(load)" >>"$results" \
    || echo "pytorch $3 on $2 ranks: no result" >&2
}

echo "steps=$steps (+$warmup warmup) layouts=[$layouts] load=$(cut -d' ' -f1-3 /proc/loadavg)"
for l in $layouts; do
  read -r n tp fsdp mode < <(layout "$l")
  echo "$l, $n rank(s): kiln tp=$tp fsdp=$fsdp, pytorch $mode (load $(load))" >&2
  run_kiln "$l" "$n" "$tp" "$fsdp" || echo "kiln $l failed" >&2
  run_torch "$l" "$n" "$mode"
done
torch_version=$("$venv/bin/python" -c 'import torch; print(torch.__version__)')
python3 - "$results" "$out-result.json" "$out-result.md" "$cmdline" "$steps" "$warmup" \
  "$torch_version" "$commit" "$(nproc --all)" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
json.dump(rows, open(sys.argv[2], "w"), indent=1)
cmd, steps, warmup, torch_version, commit, cpus = sys.argv[4:10]
names = {"single": "1 rank (no TP)", "tp2": "tp=2", "tp4": "tp=4", "tp2fsdp2": "tp=2 x FSDP=2"}
out = [f"`{cmd}`", "",
       f"kiln {commit} (`kiln launch --mpi`, OpenMPI) vs PyTorch {torch_version} (torchrun, gloo, "
       f"bench/train/tp_ref.py: torchtitan's apply_tp plan), {cpus} CPUs, 1 thread a rank; "
       f"~107M-parameter Llama (vocab 8192, d 1024, 8 layers, 16/4 heads, SwiGLU 2816, untied), "
       f"fp32, AdamW, clip 1.0, batch 4 x 256 per data-parallel rank; tok/s = global tokens of a "
       f"step / median of {steps} timed steps (after {warmup} warmup). Peak RSS: the largest of any "
       f"rank. State: weights + gradients + AdamW moments of one rank (kiln: from the model's dims "
       f"and its placements; PyTorch: counted from the local shards); matrices = the 2-D weights "
       f"only; vs replicated = that over the matrices' state on one unsharded rank.", "",
       "| layout | ranks | kiln tok/s | PyTorch tok/s | ratio (kiln/PyTorch) | kiln peak RSS/rank | "
       "PyTorch peak RSS/rank | kiln matrix state/rank | PyTorch matrix state/rank | "
       "matrix state vs replicated (kiln / PyTorch) |",
       "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
mib = lambda r, key: f"{r[key]:.0f} MiB" if r else "-"
for lay in names:
    k = next((r for r in rows if r["peer"] == "kiln" and r["layout"] == lay), None)
    t = next((r for r in rows if r["peer"] == "pytorch" and r["layout"] == lay), None)
    if not k and not t:
        continue
    n = (k or t)["ranks"]
    tok = lambda r: f"{r['tokens_per_s']:.0f}" if r else "failed"
    ratio = f"{k['tokens_per_s'] / t['tokens_per_s']:.2f}" if k and t else "-"
    frac = lambda r: f"{r['matrix_state_mib'] / r['matrix_state_replicated_mib']:.3f}" if r else "-"
    out.append(f"| {names[lay]} | {n} | {tok(k)} | {tok(t)} | {ratio} | {mib(k, 'peak_rss_mib')} | "
               f"{mib(t, 'peak_rss_mib')} | {mib(k, 'matrix_state_mib')} | {mib(t, 'matrix_state_mib')} | "
               f"{frac(k)} / {frac(t)} |")
loads = [x for r in rows for x in r["load"]]
out += ["", f"1-minute load average at the start and end of each row: {min(loads):.2f} to {max(loads):.2f} "
        f"(the benchmark's own ranks count in it)."]
open(sys.argv[3], "w").write("\n".join(out) + "\n")
print("\n".join(out))
PY

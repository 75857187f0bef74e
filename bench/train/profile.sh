#!/usr/bin/env bash
# Per-op profile of one training step, kiln vs PyTorch eager, on the benchmark model
# (bench.sh's): where the time goes, forward and backward, in the same categories.
#
# kiln: the step_profile example (forward/backward, clipping, AdamW on a fixed batch, inside a
#   rayon pool so every sample's stack reaches the model code) under `perf record` (cpu-clock
#   sampling with DWARF call stacks); bench/train/kiln_ops.py puts each sample in a category
#   from its stack. CPU time, so other load on the machine does not inflate it.
# torch: bench/train/torch_ops.py runs bench/train/torch_ref.py's model under
#   torch.profiler and sums each op's self time into the same categories (scaled by process
#   CPU time over wall time, as the profiler measures wall time).
#
# Default one thread, where attribution is exact on both sides (with more threads kiln's
# stolen rayon tasks lose their stacks). Prints the table (ms per step) and writes
# bench/train/ops.json.
#
# Usage: bench/train/profile.sh [--threads N] [--steps N] [--set key=value]...
# Needs perf (linux-perf) and torch in bench/.venv (bench.sh installs it).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
threads=1 steps=3
sets=()
while [ $# -gt 0 ]; do
  case "$1" in
    --threads) threads=$2; shift 2 ;;
    --steps) steps=$2; shift 2 ;;
    --set) sets+=(--set "$2"); shift 2 ;;
    *) echo "unknown argument $1" >&2; exit 2 ;;
  esac
done
command -v perf >/dev/null || { echo "profile.sh needs perf (apt install linux-perf)" >&2; exit 1; }
py="$root/bench/.venv/bin/python"
"$py" -c 'import torch' 2>/dev/null || { echo "no torch in bench/.venv: run bench/train/bench.sh once" >&2; exit 1; }
(cd "$root" && cargo build --release -q -p kiln-train --example step_profile)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
freq=250
model=(--set model.vocab_size=8192 --set model.d_model=384 --set model.n_layers=6
  --set model.n_heads=6 --set model.n_kv_heads=2 --set model.ffn_hidden=1024
  --set model.tie_embeddings=false --set model.scale_residual_init=false
  --set training.batch_size=8 --set training.seq_len=256 --set training.compute_shards=1
  --set optimizer.lr=3e-4 --set optimizer.weight_decay=0.1 --set optimizer.beta2=0.999
  --set optimizer.max_grad_norm=1.0)
echo "load before: $(cut -d' ' -f1-3 /proc/loadavg)"
perf record -q -k mono -e cpu-clock -F "$freq" --call-graph dwarf,32768 -o "$work/perf.data" -- \
  "$root/target/release/examples/step_profile" --threads "$threads" --steps "$steps" --warmup 2 \
  "${model[@]}" "${sets[@]}" >"$work/steps.txt"
perf script -i "$work/perf.data" --no-inline 2>/dev/null >"$work/perf.txt"
read -r _ begin end < <(grep '^timed_window' "$work/steps.txt")
python3 "$here/kiln_ops.py" "$work/perf.txt" --window "$begin" "$end" --steps "$steps" \
  --ms-per-sample "$(python3 -c "print(1000 / $freq)")" --json "$work/kiln.json" >/dev/null
"$py" "$here/torch_ops.py" --threads "$threads" --steps "$steps" --json "$work/torch.json" 2>/dev/null \
  | grep -v '^ ' || true
echo "load after: $(cut -d' ' -f1-3 /proc/loadavg)"
python3 - "$work/kiln.json" "$work/torch.json" "$here/ops.json" "$threads" <<'PY'
import collections, json, sys
k = json.load(open(sys.argv[1]))["ms_per_step"]
t = json.load(open(sys.argv[2]))
tt = dict(t["ms_per_step"])
# kiln's projection kernel has one backward for every projection (its stack does not say
# which layer it serves): compare against torch's attention and MLP projection backwards
# together.
for cat in ("attention projections", "MLP projections"):
    if f"bwd:{cat}" in tt:
        tt["bwd:projections (attention + MLP)"] = tt.get("bwd:projections (attention + MLP)", 0) + tt.pop(f"bwd:{cat}")
order = lambda x: (x.split(":")[0] != "fwd", x.split(":")[0] != "bwd", -(k.get(x, 0) + tt.get(x, 0)))
keys = sorted(set(k) | set(tt), key=order)
print(f"{'op (ms per step, ' + sys.argv[4] + ' thread)':<58} {'kiln':>8} {'torch':>8}")
for key in keys:
    print(f"{key:<58} {k.get(key, 0):8.1f} {tt.get(key, 0):8.1f}")
print(f"{'total':<58} {sum(k.values()):8.1f} {sum(tt.values()):8.1f}")
# The same by category, forward and backward together (kiln's output head + cross-entropy
# kernel computes its gradients in the forward pass, and its projections' backward is one
# category): the comparison that lines up.
def by_cat(d):
    out = collections.Counter()
    for key, ms in d.items():
        ph, cat = key.split(":", 1)
        if cat.startswith("projections") or cat.endswith("projections"):
            cat = "projections (attention + MLP)"
        out[cat if ph != "step" else f"step: {cat}"] += ms
    return out
kc, tc = by_cat(k), by_cat(tt)
print()
print(f"{'category, forward + backward (ms per step)':<58} {'kiln':>8} {'torch':>8}")
for cat in sorted(set(kc) | set(tc), key=lambda c: -(kc.get(c, 0) + tc.get(c, 0))):
    print(f"{cat:<58} {kc.get(cat, 0):8.1f} {tc.get(cat, 0):8.1f}")
json.dump({"threads": int(sys.argv[4]), "kiln_ms": k, "torch_ms": tt, "torch": t.get("torch"),
           "loadavg_after": open("/proc/loadavg").read().split()[:3]}, open(sys.argv[3], "w"), indent=1)
PY

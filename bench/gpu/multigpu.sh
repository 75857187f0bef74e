#!/usr/bin/env bash
# On the GPU machine (device tool): several ranks on the one GPU lent, each an NCCL host of its
# own (issue 42). In order of value, under one deadline (the plan and its minutes:
# bench/gpu/results/next-run.md):
#   1. NCCL across 2 ranks on known values, with PyTorch (nccl_check.py) and with kiln
#      (`kiln doctor --device cuda` under `kiln launch --mpi --np 2`);       ~1 min
#   2. the GPU tests (gpu_path `nccl_on_cuda...`: 2 and 4 ranks, every sharding mode, against one
#      rank and the host-staged path, SIGKILL and resume);                     ~3 min
#   3. the benchmark rows (bench.py --plan MULTIGPU_PLAN) until the deadline.
# Results: stdout, $OUT/result.json, $OUT/logs.tgz (every run's log), $OUT/tests.log.
#
# Usage: bench/gpu/multigpu.sh        DEADLINE=S (570: the whole script), STEPS=N, WARMUP=N,
#                                      SKIP=checks,tests (parts to leave out), PLAN=...
set -uo pipefail
# shellcheck source=env.sh
. "$(dirname "$0")/env.sh"
t0=$(date +%s)
deadline=${DEADLINE:-570}
left() { echo $((deadline - ($(date +%s) - t0))); }
out=${OUT:-$here}
work=$(mktemp -d)
trap '(cd "$work" && find . -type f \( -name "*.log" -o -name "*.txt" -o -name "*.jsonl" -o -name "*.json" \) -size -20M -print0 | tar --null -T - -czf "$out/logs.tgz") 2>/dev/null || true' EXIT
skip=${SKIP:-}
if [[ $skip != *checks* ]]; then
  echo "== 1. NCCL across 2 ranks on one GPU (known values)"
  timeout -k 5 90 python3 -m torch.distributed.run --standalone --nproc-per-node=2 \
    "$here/nccl_check.py" 2>&1 | grep -E "torch NCCL|Error|error" | head -20
  echo "torch nccl_check: exit ${PIPESTATUS[0]}"
  KILN_NCCL_RANKS_AS_HOSTS=1 timeout -k 5 120 "$kiln" launch --mpi --np 2 --timeout 110 \
    --run-dir "$work/doctor" -- "$kiln" doctor --device cuda 2>&1 | tee "$work/doctor.log" |
    grep -E "^nccl|ERROR|error" | head -20
  echo "kiln doctor (2 ranks): exit ${PIPESTATUS[0]}"
fi
if [[ $skip != *tests* ]] && [ -x "$here/carry/gpu_path" ]; then
  budget=$(( $(left) < 240 ? $(left) : 240 ))
  echo "== 2. GPU tests: NCCL on 2 and 4 ranks, every mode ($budget s at most)"
  (cd "$work" && timeout -k 5 "$budget" "$here/carry/gpu_path" --exact --nocapture \
    nccl_on_cuda_trains_every_mode_like_one_rank_and_like_the_host_path) >"$work/tests.log" 2>&1
  rc=$?
  grep -E "ranks|rank,|test result|panicked|skipped|NCCL tests|differs|failed" "$work/tests.log" | tail -40
  echo "gpu_path NCCL test: exit $rc"
  cp "$work/tests.log" "$out/tests.log" 2>/dev/null || true
fi
echo "== 3. Benchmark rows ($(left) s left)"
plan=${PLAN:-1b-dp:kiln-dp@1,1b-dp:kiln-fsdp@2,1b-dp:fsdp@2,1b-dp:kiln-fsdp@4,1b-dp:fsdp@4,1b-dp:kiln-dp@2,1b-dp:ddp@2,1b-dp:kiln-dp@4,1b-dp:ddp@4,1b-dp:fsdp@1,7b:kiln-fsdp-ac@4}
python3 "$here/bench.py" --kiln "$kiln" --work "$work" --plan "$plan" \
  --steps "${STEPS:-6}" --warmup "${WARMUP:-2}" --deadline "$(( $(left) - 10 ))" --cap 150
true

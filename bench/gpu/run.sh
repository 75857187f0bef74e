#!/usr/bin/env bash
# On the GPU machine (device tool): unpacks the carried kiln, sets what the CUDA runtime needs,
# and runs bench.py (kiln vs PyTorch eager and torch.compile, reference and 1B-class models).
# Results: stdout, and result.json in $OUT (or bench/gpu/), with every run's log, the doctor's
# report and the per-kernel tables (with --profile) in $OUT/logs.tgz.
#
# Usage: bench/gpu/run.sh [bench.py options]
#   KILN_DOCTOR=first|last|off   when `kiln doctor --device cuda` runs (first)
#   KILN_DOCTOR_TIMEOUT=S        its bound (150 s; it compiles every kernel twice, ~100 s)
#
# What the GPU host needs, and how it is provided: env.sh.
set -euo pipefail
# shellcheck source=env.sh
. "$(dirname "$0")/env.sh"
out=${OUT:-$here}
work=$(mktemp -d)
# Logs, reports and kernel tables (not the run directories' caches and checkpoints) to $OUT.
trap '(cd "$work" && find . -type f \( -name "*.log" -o -name "*.txt" -o -name "*.jsonl" -o -name "*.json" \) -size -20M -print0 | tar --null -T - -czf "$out/logs.tgz") 2>/dev/null || true' EXIT
# The kernels' f32 and bf16 instances against their composed twins on this GPU, and NCCL's
# one-rank check (the libnccl.so link above): a failure is reported, the benchmark still runs.
doctor() {
  timeout -k 5 "${KILN_DOCTOR_TIMEOUT:-150}" "$kiln" doctor --device cuda 2>&1 | tee "$work/doctor.log"
  echo "kiln doctor --device cuda: exit ${PIPESTATUS[0]}"
}
set +e
[ "${KILN_DOCTOR:-first}" = first ] && doctor
python3 "$here/bench.py" --kiln "$kiln" --work "$work" "$@"
[ "${KILN_DOCTOR:-first}" = last ] && doctor
true

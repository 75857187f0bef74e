#!/usr/bin/env bash
# Each optimizer trains the default model (the README's `kiln train`, 500 steps) to the
# default AdamW run's bar: answer_accuracy >= 0.99 on held-out numbers. Too long for the test
# suite (3 default runs: ~4 min on a quiet 2-core machine, 30 min on a busy one), so a script.
# LRs: AdamW and Muon (adjust_lr = match_rms_adamw) share the default 1e-3; SophiaG's clipped
# sign-like update moves every coordinate by up to lr, so it needs ~10x less (3e-4; at 3e-3 it
# plateaus, at 1e-3 it reaches 0.19).
#
# Usage: scripts/optimizer-bar.sh [--out DIR]
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
out=$(mktemp -d)
[ "${1:-}" = --out ] && out=$2
(cd "$root" && cargo build --release -q -p kiln)
kiln="$root/target/release/kiln"
fail=0
for spec in adamw:1e-3 muon:1e-3 sophiag:3e-4; do
  kind=${spec%%:*} lr=${spec#*:}
  rm -rf "$out/$kind"
  line=$("$kiln" train --run-dir "$out/$kind" --no-progress-bar \
    --set optimizer.kind="$kind" --set optimizer.lr="$lr" | grep '^done:')
  acc=$(sed -n 's/.*answer_accuracy=\([0-9.]*\).*/\1/p' <<<"$line")
  ok=$(python3 -c "print('PASS' if $acc >= 0.99 else 'FAIL')")
  [ "$ok" = PASS ] || fail=1
  echo "$ok $kind lr=$lr: $line"
done
exit $fail

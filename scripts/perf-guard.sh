#!/usr/bin/env bash
# kiln's performance guard (instructions counted under callgrind, peak memory beside them,
# against bench/guard/baselines.json): bench/guard/README.md.
#   scripts/perf-guard.sh            check
#   scripts/perf-guard.sh --bless    accept the current counts (commit them with the change)
exec python3 "$(dirname "$0")/../bench/guard/guard.py" "$@"

#!/usr/bin/env bash
# Byte compatibility of kiln's data layer with megatron-core, both ways:
#   - datasets written by megatron-core's IndexedDatasetBuilder read back identically in kiln;
#   - datasets written by `kiln data tokenize` read back identically in megatron-core, and
#     rewriting them with megatron-core's builder gives byte-identical .bin/.idx files;
#   - `kiln data blend` gives the blend order of megatron-core's build_blending_indices.
# Usage: scripts/megatron-compat.sh [KILN_BINARY]
#   KILN_MEGATRON_VENV: the venv's python (default bench/.venv/bin/python; created if missing).
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
kiln="${1:-${KILN_BIN:-$root/target/release/kiln}}"
py="${KILN_MEGATRON_VENV:-$root/bench/.venv/bin/python}"
if [ ! -x "$py" ]; then
  venv="$(dirname "$(dirname "$py")")"
  echo "creating $venv (torch + megatron-core from PyPI)" >&2
  start=$(date +%s)
  python3 -m venv "$venv"
  "$venv/bin/pip" install --quiet torch megatron-core pybind11 numpy
  echo "venv installed in $(( $(date +%s) - start ))s" >&2
fi
"$py" -c 'import megatron.core.datasets.helpers_cpp' 2>/dev/null \
  || "$py" -m pip install --quiet megatron-core pybind11 numpy
exec "$py" "$root/scripts/megatron-compat.py" "$kiln"

#!/usr/bin/env bash
# Data-layer benchmark, side by side with megatron-core in one run (not a test):
#   - index build: 24 synthetic corpora, 100B tokens (only .idx metadata; sparse .bin), from an
#     empty cache: megatron-core's BlendedMegatronDatasetBuilder vs `kiln data blend`;
#   - tokenization: the same JSONL through `kiln data tokenize` and through Megatron-LM's
#     preprocess_data.py pipeline re-created on megatron-core (its tools/ are not on PyPI).
# See bench/data/bench.py for what exactly is measured.
#
# Usage: bench/data/bench.sh [--tokens 100e9] [--text-mb 64] [--workers N] [--out DIR]
# Needs ~3 GB free disk for megatron-core's index cache and ~4 GB of memory at 100B tokens.
# megatron-core, torch and tokenizers are installed from PyPI into bench/.venv on first use.
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
venv="$root/bench/.venv"
if ! "$venv/bin/python" -c 'import megatron.core, tokenizers, torch' 2>/dev/null; then
  echo "installing torch, megatron-core and tokenizers into $venv ..." >&2
  [ -x "$venv/bin/python" ] || python3 -m venv "$venv"
  "$venv/bin/pip" install -q torch numpy megatron-core pybind11 tokenizers
fi
# KILN_BIN: measure that binary instead of building target/release/kiln.
if [ -z "${KILN_BIN:-}" ]; then
  (cd "$root" && cargo build --release -q -p kiln)
fi
exec "$venv/bin/python" "$root/bench/data/bench.py" --kiln "${KILN_BIN:-$root/target/release/kiln}" \
  --out "$root/target/bench-data" "$@"

#!/usr/bin/env bash
# Makes (once) the Python venv the gated peer checks use and prints its python:
#   torch >= 2.9 (torch.optim.Muon), transformers, safetensors, pyarrow, tensorboard and
#   schedulefree (the Schedule-Free AdamW parity test), from
#   PyPI, in bench/.venv
#   (the venv bench/train/bench.sh uses too; ~3 min and a few GB the first time).
# Then:
#   export KILN_TORCH_PYTHON=$(scripts/peer-venv.sh)
#   cargo test --release -p kiln-train --test suite torch_parity:: -- --nocapture   # Muon vs torch.optim.Muon
#   cargo test --release -p kiln --test suite export:: -- --nocapture             # export vs transformers
#   cargo test --release -p kiln --test suite tensorboard:: -- --nocapture        # TensorBoard's reader
#   scripts/hf-import-fixture.py, scripts/parquet-fixture.py                      # rewrite the fixtures
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
venv="$root/bench/.venv"
if ! "$venv/bin/python" -c 'import torch, transformers, safetensors, pyarrow, tensorboard, schedulefree; from torch.optim import Muon' 2>/dev/null; then
  echo "installing torch>=2.9, transformers, safetensors into $venv ..." >&2
  python3 -m venv "$venv"
  "$venv/bin/pip" install -q "torch>=2.9" numpy safetensors transformers pyarrow tensorboard schedulefree >&2
fi
echo "$venv/bin/python"

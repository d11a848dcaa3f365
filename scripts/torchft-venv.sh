#!/usr/bin/env bash
# Create ./.venv-torchft with torchft (Manager, lighthouse, Gloo process groups) for the
# side-by-side figures in benchmarks/torchft_compare.py. Separate from ./.venv so potluck never
# depends on it; potluck itself is put on its path (PYTHONPATH=src) by the benchmark.
# Usage: scripts/torchft-venv.sh        (idempotent; prints the venv's python path)
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="$ROOT/.venv-torchft"
PY="${PYTHON:-python3}"
TORCHFT_VERSION="${TORCHFT_VERSION:-0.2.0}"

[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
if ! "$VENV/bin/python" -c 'import torchft, blake3' 2>/dev/null; then
  echo "setting up $VENV (takes a few minutes)..." >&2
  "$VENV/bin/python" -m pip install -q --upgrade pip >/dev/null
  # The CPU build of PyTorch first, as in scripts/venv.sh (a bare "torch" pulls a GPU build).
  "$VENV/bin/python" -c 'import torch' 2>/dev/null || "$VENV/bin/python" -m pip install -q "torch==2.13.0"
  # msgpack, cryptography, pydantic, blake3: potluck's own imports (potluck.cli.demo loads through them).
  "$VENV/bin/python" -m pip install -q "torchft==$TORCHFT_VERSION" numpy msgpack cryptography pydantic blake3
fi
echo "$VENV/bin/python"

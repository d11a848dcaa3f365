#!/usr/bin/env bash
# Create ./.venv-hivemind with hivemind (and its Go daemon, p2pd, shipped in the wheel) for the
# side-by-side figures in benchmarks/dht.py. Separate from ./.venv so potluck never depends on it.
# Usage: scripts/hivemind-venv.sh        (idempotent; prints the venv's python path)
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="$ROOT/.venv-hivemind"
PY="${PYTHON:-python3}"
HIVEMIND_VERSION="${HIVEMIND_VERSION:-1.1.12}"

[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
if ! "$VENV/bin/python" -c 'import hivemind, blake3' 2>/dev/null; then
  echo "setting up $VENV (takes a few minutes)..." >&2
  "$VENV/bin/python" -m pip install -q --upgrade pip >/dev/null
  # The CPU build of PyTorch first, as in scripts/venv.sh (a bare "torch" pulls a GPU build).
  "$VENV/bin/python" -c 'import torch' 2>/dev/null || "$VENV/bin/python" -m pip install -q "torch==2.13.0"
  # blake3: potluck's own import (the benchmarks' workers load potluck.cli.tasks)
  "$VENV/bin/python" -m pip install -q "hivemind==$HIVEMIND_VERSION" blake3
fi
echo "$VENV/bin/python"

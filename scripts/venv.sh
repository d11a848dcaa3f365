# Sourced by the other scripts: create or reuse ./.venv and install potluck into it.
# Usage: source scripts/venv.sh [EXTRAS]   (e.g. "test")
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="$ROOT/.venv"
PY="${PYTHON:-python3}"
EXTRAS="${1:-}"

if ! "$PY" -c 'import sys; sys.exit(sys.version_info < (3, 10))' 2>/dev/null; then
  echo "potluck needs Python 3.10 or newer; set PYTHON=/path/to/python3.10 (or newer)" >&2
  exit 1
fi
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"

# Reinstall only when the project's requirements change.
STAMP="$VENV/.potluck-installed-$EXTRAS"
WANT="$(cat "$ROOT/pyproject.toml" | sha256sum | cut -c1-16)"
if [ "$(cat "$STAMP" 2>/dev/null)" != "$WANT" ]; then
  echo "setting up $VENV (first run takes a minute or two)..." >&2
  LOG="$VENV/install.log"
  install() { "$VENV/bin/python" -m pip install -q "$@" >>"$LOG" 2>&1 || { cat "$LOG" >&2; echo "installing $* failed (log: $LOG)" >&2; exit 1; }; }
  install --upgrade pip
  # PyTorch first, pinned: left to the resolver, a bare "torch" pulls the newest multi-GB GPU
  # build. Where pip has no local CPU wheel, POTLUCK_TORCH_INDEX=https://download.pytorch.org/whl/cpu
  # fetches the CPU build instead of PyPI's GPU one.
  "$VENV/bin/python" -c 'import torch' 2>/dev/null \
    || install "torch==2.13.0" ${POTLUCK_TORCH_INDEX:+--index-url "$POTLUCK_TORCH_INDEX"}
  install -e "$ROOT${EXTRAS:+[$EXTRAS]}"
  echo "$WANT" > "$STAMP"
fi
export PATH="$VENV/bin:$PATH"

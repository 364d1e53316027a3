# Sourced by the set-up scripts: make .venv (if missing) and install megamoe into it.
# Usage: source scripts/env.sh [extras]   e.g. "logging" or "test,logging"
set -euo pipefail
EXTRAS="${1:-}"
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
if [ ! -x .venv/bin/python ]; then
  "${PYTHON:-python3}" -m venv .venv
fi
# shellcheck disable=SC1091
. .venv/bin/activate
export PIP_DISABLE_PIP_VERSION_CHECK=1
if ! python -c "import torch" >/dev/null 2>&1; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    pip install -q torch            # CUDA machine: the registry's CUDA build
  else
    pip install -q torch==2.13.0    # no CUDA: the CPU build (an unpinned torch pulls GBs)
  fi
fi
STAMP=".venv/.megamoe-installed-${EXTRAS:-base}"
if [ ! -f "$STAMP" ] || [ setup.py -nt "$STAMP" ]; then
  if [ -n "$EXTRAS" ]; then SPEC=".[${EXTRAS}]"; else SPEC="."; fi
  pip install -q -e "$SPEC"
  touch "$STAMP"
fi

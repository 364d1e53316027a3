#!/usr/bin/env bash
# The test suite. `bash scripts/test.sh` runs the default set (< 10 min on 2 cores);
# `bash scripts/test.sh --slow` runs only the tests marked slow. Extra args go to pytest.
set -euo pipefail
# shellcheck disable=SC1091
source "$(dirname "$0")/env.sh" "test,logging"
MARK="not slow"
if [ "${1:-}" = "--slow" ]; then MARK="slow"; shift; fi
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-2}" WANDB_MODE=offline
set +e
python -m pytest -m "$MARK" "$@"
rc=$?
set -e
if [ "$rc" -eq 5 ]; then echo "no tests selected (marker: $MARK)"; exit 0; fi
exit "$rc"

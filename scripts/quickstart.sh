#!/usr/bin/env bash
# One command from a fresh clone: environment, corpus, a small Mixtral-style MoE trained
# on CPU, a checkpoint under runs/tiny-cpu/checkpoints.
set -euo pipefail
# shellcheck disable=SC1091
source "$(dirname "$0")/env.sh" "logging"
bash scripts/prepare_corpus.sh
bash scripts/pretrain_tiny_cpu.sh "$@"

#!/usr/bin/env bash
# OLMoE-1B-7B pretraining (configs/olmoe-1b-7b.yaml) on one node of 8 GPUs of 80 GB:
# TP1 PP1 EP8 DP8, distributed optimizer (DRY_RUN=1: 32.9 GiB per rank, global batch 1024 of 4096 tokens).
#   bash scripts/pretrain_olmoe_1b_7b.sh CHECKPOINT_PATH DATA_PATH [extra flags]
# Every variable of scripts/pretrain_moe.sh overrides these defaults.
set -euo pipefail
if [ $# -lt 2 ]; then echo "usage: $0 CHECKPOINT_PATH DATA_PATH [extra flags]" >&2; exit 2; fi
export NNODES=${NNODES:-1} TP=${TP:-1} PP=${PP:-1} EP=${EP:-8} GBS=${GBS:-1024}
export RECOMPUTE=${RECOMPUTE-} VOCAB_SIZE=50304
exec bash "$(dirname "$0")/pretrain_moe.sh" configs/olmoe-1b-7b.yaml "$1" \
  "${TOKENIZER:-allenai/OLMoE-1B-7B-0924}" "$2" "${@:3}"

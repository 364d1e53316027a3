#!/usr/bin/env bash
# DeepSeek-MoE 16B pretraining (configs/deepseek-moe-16b.yaml) on one node of 8 GPUs of
# 80 GB: TP1 PP1 EP8 DP8, distributed optimizer, selective recompute of the experts'
# activation and the norms (DRY_RUN=1: 65.1 GiB per rank, global batch 1024 of 4096 tokens).
#   bash scripts/pretrain_deepseek_moe_16b.sh CHECKPOINT_PATH DATA_PATH [extra flags]
# Every variable of scripts/pretrain_moe.sh overrides these defaults.
set -euo pipefail
if [ $# -lt 2 ]; then echo "usage: $0 CHECKPOINT_PATH DATA_PATH [extra flags]" >&2; exit 2; fi
export NNODES=${NNODES:-1} TP=${TP:-1} PP=${PP:-1} EP=${EP:-8} GBS=${GBS:-1024}
export RECOMPUTE=${RECOMPUTE-moe_act layernorm} VOCAB_SIZE=102400
exec bash "$(dirname "$0")/pretrain_moe.sh" configs/deepseek-moe-16b.yaml "$1" \
  "${TOKENIZER:-deepseek-ai/deepseek-moe-16b-base}" "$2" "${@:3}"

#!/usr/bin/env bash
# Mixtral 8x22B pretraining (configs/mixtral-8x22b.yaml) on 8 nodes x 8 GPUs of 80 GB:
# TP4 PP4 DP4, experts EP4 x ETP4, distributed optimizer, selective recompute of the MoE
# layers and norms (DRY_RUN=1: 45.6 GiB per rank, global batch 1024 of 4096 tokens).
#   bash scripts/pretrain_mixtral_8x22b.sh CHECKPOINT_PATH DATA_PATH [extra flags]
# Every variable of scripts/pretrain_moe.sh overrides these defaults;
# scripts/pretrain_mixtral_8x7b.sh is Megatron-LM's own Mixtral example, adapted.
set -euo pipefail
if [ $# -lt 2 ]; then echo "usage: $0 CHECKPOINT_PATH DATA_PATH [extra flags]" >&2; exit 2; fi
export NNODES=${NNODES:-8} TP=${TP:-4} PP=${PP:-4} EP=${EP:-4} ETP=${ETP:-4}
export GBS=${GBS:-1024} RECOMPUTE=${RECOMPUTE-moe layernorm} VOCAB_SIZE=32768
exec bash "$(dirname "$0")/pretrain_moe.sh" configs/mixtral-8x22b.yaml "$1" \
  "${TOKENIZER:-mistralai/Mixtral-8x22B-v0.1}" "$2" "${@:3}"

#!/usr/bin/env bash
# Qwen3-235B-A22B pretraining (configs/qwen3-235b-a22b.yaml) on 32 nodes x 8 GPUs of 80 GB:
# TP2 PP4 EP32 DP32, the 94 layers split 23 / 24 / 24 / 23, distributed optimizer,
# selective recompute of the MoE layers and norms (DRY_RUN=1: 48.0 GiB per rank, global
# batch 1024 of 4096 tokens).
#   bash scripts/pretrain_qwen3_235b_a22b.sh CHECKPOINT_PATH DATA_PATH [extra flags]
# Every variable of scripts/pretrain_moe.sh overrides these defaults; FIRST / LAST set the
# first and last stages' layer counts (Megatron's --decoder-first/last-pipeline-num-layers).
set -euo pipefail
if [ $# -lt 2 ]; then echo "usage: $0 CHECKPOINT_PATH DATA_PATH [extra flags]" >&2; exit 2; fi
export NNODES=${NNODES:-32} TP=${TP:-2} PP=${PP:-4} EP=${EP:-32} ETP=${ETP:-1}
export GBS=${GBS:-1024} RECOMPUTE=${RECOMPUTE-moe layernorm} VOCAB_SIZE=151936
SPLIT=()
if [ "$PP" != 1 ]; then
  SPLIT=(--decoder-first-pipeline-num-layers "${FIRST:-23}"
         --decoder-last-pipeline-num-layers "${LAST:-23}")
fi
exec bash "$(dirname "$0")/pretrain_moe.sh" configs/qwen3-235b-a22b.yaml "$1" \
  "${TOKENIZER:-Qwen/Qwen3-235B-A22B}" "$2" "${SPLIT[@]}" "${@:3}"

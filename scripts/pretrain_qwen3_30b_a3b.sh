#!/usr/bin/env bash
# Qwen3-30B-A3B pretraining (configs/qwen3-30b-a3b.yaml) on 2 nodes x 8 GPUs of 80 GB:
# TP1 PP2 EP8 DP8, distributed optimizer, selective recompute of the MoE layers and norms
# (DRY_RUN=1: 49.4 GiB per rank, global batch 512 of 4096 tokens).
#   bash scripts/pretrain_qwen3_30b_a3b.sh CHECKPOINT_PATH DATA_PATH [extra flags]
# Every variable of scripts/pretrain_moe.sh overrides these defaults (TP, PP, EP, NNODES,
# GBS, RECOMPUTE, TOKENIZER, DRY_RUN, ...); FROM_HF=1 after tools/checkpoint/convert.py
# hf-to-megamoe of Qwen/Qwen3-30B-A3B.
set -euo pipefail
if [ $# -lt 2 ]; then echo "usage: $0 CHECKPOINT_PATH DATA_PATH [extra flags]" >&2; exit 2; fi
export NNODES=${NNODES:-2} TP=${TP:-1} PP=${PP:-2} EP=${EP:-8} GBS=${GBS:-512}
export RECOMPUTE=${RECOMPUTE-moe layernorm} VOCAB_SIZE=151936
exec bash "$(dirname "$0")/pretrain_moe.sh" configs/qwen3-30b-a3b.yaml "$1" \
  "${TOKENIZER:-Qwen/Qwen3-30B-A3B}" "$2" "${@:3}"

#!/usr/bin/env bash
# DeepSeek-V3 pretraining (configs/deepseek-v3.yaml: MLA, 256 experts + 1 shared, one MTP
# depth) on 64 nodes x 8 GPUs of 80 GB: TP1 PP8 EP64 DP64, the 61 layers split 7 / 8 x 6 /
# 6 (the first and last stages also hold the embedding and the MTP depth + output layer),
# distributed optimizer, selective recompute of the MoE layers, norms and MLA's
# up-projections (DRY_RUN=1: 65.1 GiB per rank, global batch 1024 of 4096 tokens).
#   bash scripts/pretrain_deepseek_v3.sh CHECKPOINT_PATH DATA_PATH [extra flags]
# Every variable of scripts/pretrain_moe.sh overrides these defaults; FIRST / LAST set the
# first and last stages' layer counts (Megatron's --decoder-first/last-pipeline-num-layers).
set -euo pipefail
if [ $# -lt 2 ]; then echo "usage: $0 CHECKPOINT_PATH DATA_PATH [extra flags]" >&2; exit 2; fi
export NNODES=${NNODES:-64} TP=${TP:-1} PP=${PP:-8} EP=${EP:-64} GBS=${GBS:-1024}
export RECOMPUTE=${RECOMPUTE-moe layernorm mla_up_proj} VOCAB_SIZE=129280
SPLIT=()
if [ "$PP" != 1 ]; then
  SPLIT=(--decoder-first-pipeline-num-layers "${FIRST:-7}"
         --decoder-last-pipeline-num-layers "${LAST:-6}")
fi
exec bash "$(dirname "$0")/pretrain_moe.sh" configs/deepseek-v3.yaml "$1" \
  "${TOKENIZER:-deepseek-ai/DeepSeek-V3}" "$2" "${SPLIT[@]}" "${@:3}"

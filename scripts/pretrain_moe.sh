#!/usr/bin/env bash
# Pretraining a MoE preset on a GPU cluster: the launcher the per-family scripts share.
#   bash scripts/pretrain_moe.sh PRESET CHECKPOINT_PATH TOKENIZER DATA_PATH [extra flags]
# PRESET is a configs/*.yaml (the architecture, with Megatron-LM flag names); TOKENIZER a
# Hugging Face tokenizer name or folder (TOKENIZER_TYPE=HuggingFaceTokenizer by default).
# The family scripts (scripts/pretrain_qwen3_30b_a3b.sh, ...) call it with their layout.
# Multi-node: run it once per node with the same MASTER_ADDR/MASTER_PORT/NNODES and that
# node's NODE_RANK (scripts/slurm_pretrain.sbatch shows how under Slurm). Extra flags are
# appended last, so they override everything here.
#
# The layout comes from the environment: TP, PP, EP, ETP (default TP), CP, VPP (virtual
# stages per rank; 1 = none), DIST_OPT (1: distributed optimizer), RECOMPUTE (Megatron's
# --recompute-modules list; empty: none), MBS, GBS, SEQ, TRAIN_ITERS, GPUS_PER_NODE,
# NNODES. DRY_RUN=1 checks the whole command line on any machine (no torchrun): flags and
# layout for WORLD_SIZE = GPUS_PER_NODE x NNODES, the model built on the meta device, its
# parameter counts and per-rank memory printed (VOCAB_SIZE stands in for the tokenizer).
# tools/plan_parallel.py ranks other layouts for your cluster.
set -euo pipefail
cd "$(dirname "$0")/.."

if [ $# -lt 4 ]; then
  echo "usage: $0 PRESET CHECKPOINT_PATH TOKENIZER DATA_PATH [extra pretrain_gpt.py flags]" >&2
  exit 2
fi
PRESET=$1 CHECKPOINT_PATH=$2 TOKENIZER=$3 DATA_PATH=$4
shift 4
if [ ! -f "$PRESET" ]; then
  echo "$0: no preset $PRESET (see configs/)" >&2
  exit 2
fi

export CUDA_DEVICE_MAX_CONNECTIONS=1
GPUS_PER_NODE=${GPUS_PER_NODE:-8}
NNODES=${NNODES:-1}
WORLD_SIZE=$((GPUS_PER_NODE * NNODES))

# A dead worker (or node) makes torchrun restart the group up to MAX_RESTARTS times; it
# resumes from the last complete checkpoint (--save = --load). On SIGTERM torchrun forwards
# the signal: --exit-signal-handler saves within SHUTDOWN_TIMEOUT seconds.
DISTRIBUTED_ARGS=(
  --nproc_per_node "$GPUS_PER_NODE" --nnodes "$NNODES" --node_rank "${NODE_RANK:-${SLURM_NODEID:-0}}"
  --master_addr "${MASTER_ADDR:-localhost}" --master_port "${MASTER_PORT:-6000}"
  --max-restarts "${MAX_RESTARTS:-3}"
)
if torchrun --help 2>/dev/null | grep -q -- --shutdown-timeout; then  # torch >= 2.8
  DISTRIBUTED_ARGS+=(--shutdown-timeout "${SHUTDOWN_TIMEOUT:-300}")
fi

ARGS=(
  --config "$PRESET"
  --tokenizer-type "${TOKENIZER_TYPE:-HuggingFaceTokenizer}" --tokenizer-model "$TOKENIZER"
  --data-path "$DATA_PATH" --split 99990,8,2
  --micro-batch-size "${MBS:-1}" --global-batch-size "${GBS:-1024}"
  --train-iters "${TRAIN_ITERS:-500000}" --lr "${LR:-3e-4}" --min-lr "${MIN_LR:-3e-5}"
  --lr-decay-style cosine --lr-warmup-iters "${WARMUP:-2000}" --weight-decay 0.1
  --clip-grad 1.0 --bf16 --exit-signal-handler
  --tensor-model-parallel-size "${TP:-1}" --pipeline-model-parallel-size "${PP:-1}"
  --expert-model-parallel-size "${EP:-1}" --expert-tensor-parallel-size "${ETP:-${TP:-1}}"
  --context-parallel-size "${CP:-1}" --sequence-parallel --overlap-grad-reduce
  --log-interval 1 --log-throughput --save-interval "${SAVE_INTERVAL:-1000}"
  --eval-interval "${EVAL_INTERVAL:-1000}" --eval-iters 10
  --save "$CHECKPOINT_PATH" --load "$CHECKPOINT_PATH"
  --tensorboard-dir "${CHECKPOINT_PATH}/tensorboard"
)
if [ -n "${SEQ:-}" ]; then ARGS+=(--seq-length "$SEQ"); fi
if [ "${VPP:-1}" != "1" ]; then ARGS+=(--num-virtual-stages-per-pipeline-rank "$VPP"); fi
if [ "${DIST_OPT:-1}" = "1" ]; then
  ARGS+=(--use-distributed-optimizer --overlap-param-gather)
fi
if [ -n "${RECOMPUTE:-}" ]; then
  # shellcheck disable=SC2206  # a space-separated module list, as Megatron's flag takes
  ARGS+=(--recompute-granularity selective --recompute-modules $RECOMPUTE)
fi
if [ "${FROM_HF:-0}" = "1" ]; then
  # From a Hugging Face conversion (tools/checkpoint/convert.py): no optimizer state or
  # RNG there. Never for a restart: that resumes the optimizer and RNG exactly.
  ARGS+=(--no-load-optim --no-load-rng)
fi
if [ -n "${PEAK_TFLOPS:-}" ]; then ARGS+=(--peak-tflops "$PEAK_TFLOPS"); fi
if [ -n "${WANDB_API_KEY:-}" ] || [ -n "${WANDB_PROJECT:-}" ]; then
  ARGS+=(--wandb-project "${WANDB_PROJECT:-megamoe}"
         --wandb-exp-name "${WANDB_NAME:-$(basename "$PRESET" .yaml)}")
fi

if [ "${DRY_RUN:-0}" = "1" ]; then
  WORLD_SIZE=$WORLD_SIZE exec "${PYTHON:-python}" pretrain_gpt.py "${ARGS[@]}" \
    --vocab-size "${VOCAB_SIZE:-32000}" "$@" --dry-run
fi
exec torchrun "${DISTRIBUTED_ARGS[@]}" pretrain_gpt.py "${ARGS[@]}" "$@"

#!/usr/bin/env bash
# Mixtral 8x7B pretraining, Megatron-LM's example script adapted to megamoe.
#   bash scripts/pretrain_mixtral_8x7b.sh CHECKPOINT_PATH TOKENIZER_MODEL DATA_PATH [extra flags]
# Multi-node: run it once per node with the same MASTER_ADDR/MASTER_PORT/NNODES and that
# node's NODE_RANK (scripts/slurm_pretrain.sbatch does this under Slurm). Extra flags are
# appended last, so they override the arrays below.
#
# DRY_RUN=1 checks the whole command line on any machine, GPUs or not: no torchrun, the
# flags and layout are validated for WORLD_SIZE = GPUS_PER_NODE x NNODES, the model is
# built on the meta device and its parameter counts are printed (a missing tokenizer file
# is replaced by the Llama-2 vocabulary size).
#
# Parallel layout (Megatron's values, 16 GPUs: TP4 x DP4, EP4, ETP = TP, distributed
# optimizer, sharded torch_dist checkpoints that load under any other layout). Override
# them from the environment (TP, EP, PP, DIST_OPT) and ask tools/plan_parallel.py which
# layout fits your cluster; DRY_RUN=1 prints the per-rank memory of the layout
# (59.2 GiB per GPU for the defaults on 16 GPUs).
set -euo pipefail
cd "$(dirname "$0")/.."

export CUDA_DEVICE_MAX_CONNECTIONS=1
GPUS_PER_NODE=${GPUS_PER_NODE:-8}
MASTER_ADDR=${MASTER_ADDR:-"localhost"}
MASTER_PORT=${MASTER_PORT:-"6000"}
NNODES=${NNODES:-"2"}
NODE_RANK=${NODE_RANK:-${SLURM_NODEID:-0}}
WORLD_SIZE=$((GPUS_PER_NODE * NNODES))
TP=${TP:-4}
PP=${PP:-1}
EP=${EP:-4}
DIST_OPT=${DIST_OPT:-1}

if [ $# -lt 3 ]; then
  echo "usage: $0 CHECKPOINT_PATH TOKENIZER_MODEL DATA_PATH [extra pretrain_gpt.py flags]" >&2
  exit 2
fi
CHECKPOINT_PATH=$1
TOKENIZER_MODEL=$2
DATA_PATH=$3
shift 3

# A dead worker (or node) makes torchrun restart the group up to MAX_RESTARTS times; it
# resumes from the last complete checkpoint in $CHECKPOINT_PATH (--save = --load).
# On SIGTERM (preemption) torchrun forwards the signal and kills the workers after
# SHUTDOWN_TIMEOUT seconds: --exit-signal-handler saves within that grace period.
DISTRIBUTED_ARGS=(
  --nproc_per_node "$GPUS_PER_NODE"
  --nnodes "$NNODES"
  --node_rank "$NODE_RANK"
  --master_addr "$MASTER_ADDR"
  --master_port "$MASTER_PORT"
  --max-restarts "${MAX_RESTARTS:-3}"
)
if torchrun --help 2>/dev/null | grep -q -- --shutdown-timeout; then  # torch >= 2.8
  DISTRIBUTED_ARGS+=(--shutdown-timeout "${SHUTDOWN_TIMEOUT:-300}")
fi

MODEL_ARGS=(
  --use-mcore-models            # accepted: megamoe has one model implementation
  --disable-bias-linear
  --seq-length 2048
  --max-position-embeddings 32768
  --num-layers 32
  --hidden-size 4096
  --ffn-hidden-size 14336
  --num-attention-heads 32
  --init-method-std 0.01
  --attention-dropout 0.0
  --hidden-dropout 0.0
  --normalization RMSNorm
  --position-embedding-type rope
  --rotary-base 1000000         # Mixtral's RoPE base (Megatron's script keeps 10000)
  --swiglu
  --untie-embeddings-and-output-weights
  --group-query-attention
  --num-query-groups 8
  --no-masked-softmax-fusion    # accepted: the unfused softmax is what always runs
  --no-position-embedding
)

MOE_ARGS=(
  --num-experts 8
  --expert-model-parallel-size "$EP"
  --moe-router-load-balancing-type aux_loss  # or seq_aux_loss, global_aux_loss, sinkhorn, none
  --moe-router-topk 2
  --moe-aux-loss-coeff 1e-2
  --moe-grouped-gemm
  --moe-per-layer-logging       # per-layer aux loss and expert load in TensorBoard / W&B
)

DATA_ARGS=(
  --tokenizer-type Llama2Tokenizer
  --tokenizer-model "$TOKENIZER_MODEL"
  --data-path "$DATA_PATH"
  --split 99990,8,2
)

TRAINING_ARGS=(
  --micro-batch-size 1
  --global-batch-size 128
  --lr 1e-4
  --train-iters 500000
  --lr-decay-iters 320000
  --lr-decay-style cosine
  --min-lr 1.0e-5
  --weight-decay 0.1
  --lr-warmup-iters 500
  --clip-grad 1.0
  --bf16
  --exit-signal-handler         # SIGTERM: finish the step, save, exit 0
)

MODEL_PARALLEL_ARGS=(
  --tensor-model-parallel-size "$TP"
  --pipeline-model-parallel-size "$PP"
  --sequence-parallel           # needed by MoE with TP > 1; ignored (as in Megatron) at TP 1
)
MODEL_PARALLEL_ARGS+=(--overlap-grad-reduce)  # gradient buckets reduced during backward
if [ "$DIST_OPT" = "1" ]; then
  MODEL_PARALLEL_ARGS+=(--use-distributed-optimizer --overlap-param-gather)
fi

LOGGING_ARGS=(
  --log-interval 1
  --save-interval 10000
  --eval-interval 1000
  --eval-iters 10
  --save "$CHECKPOINT_PATH"
  --load "$CHECKPOINT_PATH"
  --tensorboard-dir "${CHECKPOINT_PATH}/tensorboard"
  --log-throughput
)
if [ "${FROM_HF:-0}" = "1" ]; then
  # Starting from a checkpoint converted from Hugging Face (tools/checkpoint/convert.py):
  # it has no optimizer state or RNG, as in Megatron's Mixtral script. Never for a
  # restart or a resubmission: those resume the optimizer and RNG exactly.
  LOGGING_ARGS+=(--no-load-optim --no-load-rng)
fi
if [ -n "${PEAK_TFLOPS:-}" ]; then
  LOGGING_ARGS+=(--peak-tflops "$PEAK_TFLOPS")  # for MFU; measured with a matmul if unset
fi
if [ -n "${WANDB_API_KEY:-}" ] || [ -n "${WANDB_PROJECT:-}" ]; then
  # Without WANDB_API_KEY, W&B writes an offline run to sync later (`wandb sync`).
  LOGGING_ARGS+=(
    --wandb-project "${WANDB_PROJECT:-Mixtral-Finetuning}"
    --wandb-exp-name "${WANDB_NAME:-Mixtral_8x7B}"
  )
fi

ALL_ARGS=("${MODEL_ARGS[@]}" "${MOE_ARGS[@]}" "${DATA_ARGS[@]}" "${TRAINING_ARGS[@]}"
          "${MODEL_PARALLEL_ARGS[@]}" "${LOGGING_ARGS[@]}")

if [ "${DRY_RUN:-0}" = "1" ]; then
  WORLD_SIZE=$WORLD_SIZE exec "${PYTHON:-python}" pretrain_gpt.py "${ALL_ARGS[@]}" \
    --vocab-size 32000 "$@" --dry-run
fi
exec torchrun "${DISTRIBUTED_ARGS[@]}" pretrain_gpt.py "${ALL_ARGS[@]}" "$@"

#!/usr/bin/env bash
# A small Mixtral-style MoE (RMSNorm, RoPE, GQA, SwiGLU experts, 8 experts top-2, aux and
# z losses) on the bundled Shakespeare corpus, on CPU. What the quickstart runs.
#   bash scripts/pretrain_tiny_cpu.sh [extra pretrain_gpt.py flags]
#   NPROC=2 bash scripts/pretrain_tiny_cpu.sh      # two data-parallel ranks via torchrun
# Expects the prepared corpus (bash scripts/prepare_corpus.sh) and an active environment.
set -euo pipefail
cd "$(dirname "$0")/.."
PREP=${PREP:-data/shakespeare/prepared}
OUT=${OUT:-runs/tiny-cpu}
NPROC=${NPROC:-1}
TRAIN_ITERS=${TRAIN_ITERS:-400}

MODEL_ARGS=(
  --num-layers 4 --hidden-size 256 --ffn-hidden-size 512
  --num-attention-heads 8 --group-query-attention --num-query-groups 4
  --seq-length 256 --max-position-embeddings 256
  --normalization RMSNorm --position-embedding-type rope --swiglu
  --disable-bias-linear --untie-embeddings-and-output-weights
  --attention-dropout 0.0 --hidden-dropout 0.0 --init-method-std 0.02
)
MOE_ARGS=(
  --num-experts 8 --moe-router-topk 2 --moe-grouped-gemm
  --moe-router-load-balancing-type aux_loss --moe-aux-loss-coeff 1e-2 --moe-z-loss-coeff 1e-3
)
DATA_ARGS=(
  --tokenizer-type SentencePieceTokenizer --tokenizer-model "$PREP/tokenizer.model"
  --data-path "$PREP/shakespeare_text_document" --split 98,2,0 --num-workers 0
)
TRAINING_ARGS=(
  --micro-batch-size 4 --global-batch-size 8 --train-iters "$TRAIN_ITERS"
  --lr 3e-3 --min-lr 3e-4 --lr-decay-style cosine --lr-warmup-iters 20
  --weight-decay 0.1 --adam-beta2 0.95 --clip-grad 1.0 --seed 1234
)
LOGGING_ARGS=(
  --log-interval 20 --eval-interval 100 --eval-iters 5
  --save "$OUT/checkpoints" --save-interval "$TRAIN_ITERS"
  --tensorboard-dir "$OUT/tensorboard"
)
if [ "$NPROC" -gt 1 ]; then
  LAUNCH=(torchrun --standalone --nproc_per_node "$NPROC")
else
  LAUNCH=(python)
fi
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-$(( $(nproc) / NPROC > 0 ? $(nproc) / NPROC : 1 ))}
"${LAUNCH[@]}" pretrain_gpt.py "${MODEL_ARGS[@]}" "${MOE_ARGS[@]}" "${DATA_ARGS[@]}" \
  "${TRAINING_ARGS[@]}" "${LOGGING_ARGS[@]}" "$@"

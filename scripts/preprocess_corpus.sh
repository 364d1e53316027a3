#!/usr/bin/env bash
# Any jsonl corpus -> sentencepiece tokenizer + Megatron .bin/.idx, ready for --data-path.
#   bash scripts/preprocess_corpus.sh INPUT.jsonl[.gz|.xz] OUTPUT_DIR
# Environment: VOCAB_SIZE (32000), JSON_KEYS ("text"), WORKERS (nproc), MODEL_TYPE (bpe),
# TOKENIZER_MODEL (an existing sentencepiece model: skip training one),
# NAME (the output file stem, default: the input's name).
# Writes OUTPUT_DIR/tokenizer.{model,vocab} and OUTPUT_DIR/NAME_<key>_document.{bin,idx};
# prints the --tokenizer-model and --data-path flags to pass to pretrain_gpt.py.
# (scripts/prepare_corpus.sh does the same for the bundled Shakespeare corpus.)
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
PY=${PYTHON:-python}

if [ $# -ne 2 ]; then
  echo "usage: $0 INPUT.jsonl OUTPUT_DIR" >&2
  exit 2
fi
INPUT=$1
OUT=$2
if [ ! -f "$INPUT" ]; then
  echo "preprocess_corpus.sh: error: input not found: $INPUT" >&2
  exit 1
fi
VOCAB_SIZE=${VOCAB_SIZE:-32000}
JSON_KEYS=${JSON_KEYS:-text}
WORKERS=${WORKERS:-$(nproc)}
MODEL_TYPE=${MODEL_TYPE:-bpe}
NAME=${NAME:-$(basename "$INPUT")}
NAME=${NAME%.gz}; NAME=${NAME%.xz}; NAME=${NAME%.jsonl}; NAME=${NAME%.json}
mkdir -p "$OUT"
START=$SECONDS

read -r -a KEYS <<< "$JSON_KEYS"
if [ -n "${TOKENIZER_MODEL:-}" ]; then
  if [ ! -f "$TOKENIZER_MODEL" ]; then
    echo "preprocess_corpus.sh: error: TOKENIZER_MODEL not found: $TOKENIZER_MODEL" >&2
    exit 1
  fi
  TOK=$TOKENIZER_MODEL
else
  TOK=$OUT/tokenizer.model
  "$PY" "$ROOT/tools/train_tokenizer.py" --input "$INPUT" --json-keys "${KEYS[@]}" \
    --vocab-size "$VOCAB_SIZE" --model-type "$MODEL_TYPE" --output-prefix "$OUT/tokenizer"
fi
"$PY" "$ROOT/tools/preprocess_data.py" --input "$INPUT" --json-keys "${KEYS[@]}" \
  --output-prefix "$OUT/$NAME" --tokenizer-type SentencePieceTokenizer \
  --tokenizer-model "$TOK" --append-eod --workers "$WORKERS"

echo "> corpus ready in $((SECONDS - START)) s. Train with:"
echo "  --tokenizer-type SentencePieceTokenizer --tokenizer-model $TOK \\"
PREFIXES=()
for k in "${KEYS[@]}"; do PREFIXES+=("$OUT/${NAME}_${k}_document"); done
echo "  --data-path ${PREFIXES[*]}"

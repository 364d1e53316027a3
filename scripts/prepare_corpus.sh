#!/usr/bin/env bash
# Bundled corpus -> sentencepiece tokenizer + Megatron .bin/.idx, for the tiny CPU run.
#   bash scripts/prepare_corpus.sh            (expects an active venv: source scripts/env.sh)
# Writes data/shakespeare/prepared/{tokenizer.model,tokenizer.vocab,
# shakespeare_text_document.bin,.idx}; does nothing when they are newer than the input.
# VOCAB_SIZE (2048) and WORKERS (2) can be overridden from the environment.
set -euo pipefail
cd "$(dirname "$0")/.."
SRC=data/shakespeare/shakespeare.jsonl.xz
OUT=data/shakespeare/prepared
VOCAB_SIZE=${VOCAB_SIZE:-2048}
WORKERS=${WORKERS:-2}

up_to_date() {
  local f
  for f in "$@"; do
    [ -f "$f" ] && [ "$f" -nt "$SRC" ] || return 1
  done
}

if [ ! -f "$SRC" ]; then
  echo "prepare_corpus.sh: error: $SRC not found" >&2
  exit 1
fi
mkdir -p "$OUT"
START=$SECONDS

if up_to_date "$OUT/tokenizer.model"; then
  echo "> tokenizer up to date: $OUT/tokenizer.model"
else
  python tools/train_tokenizer.py --input "$SRC" --json-keys text \
    --vocab-size "$VOCAB_SIZE" --model-type bpe --output-prefix "$OUT/tokenizer"
fi

DOC="$OUT/shakespeare_text_document"
if up_to_date "$DOC.bin" "$DOC.idx" && [ "$DOC.idx" -nt "$OUT/tokenizer.model" ]; then
  echo "> dataset up to date: $DOC.{bin,idx}"
else
  python tools/preprocess_data.py --input "$SRC" --json-keys text \
    --output-prefix "$OUT/shakespeare" --tokenizer-type SentencePieceTokenizer \
    --tokenizer-model "$OUT/tokenizer.model" --append-eod --workers "$WORKERS"
fi
echo "> corpus ready in $((SECONDS - START)) s: $OUT"

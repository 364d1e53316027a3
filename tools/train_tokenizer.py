"""Train a sentencepiece tokenizer on a jsonl corpus for --tokenizer-type SentencePieceTokenizer.

    python tools/train_tokenizer.py --input corpus.jsonl.xz --json-keys text \
        --vocab-size 2048 --output-prefix data/tokenizer   # -> tokenizer.model/.vocab

The model round-trips text exactly: identity normalisation, whitespace kept as is,
newline as its own piece and byte fallback (no unknown characters). It has unk=0, bos=1
and eos=2; eos is what SentencePieceTokenizer uses as eod. Files are written atomically.
"""

from __future__ import annotations

import argparse
import io
import os
import sys
import time
from typing import Iterator, Optional, Sequence

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), os.path.pardir)))

from megamoe.data import DataError  # noqa: E402
from megamoe.data.atomic import tmp_path_for  # noqa: E402
from megamoe.data.jsonl import read_lines  # noqa: E402

MAX_DOCUMENT_BYTES = 1 << 20  # longer documents are truncated for training only


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--input", required=True, help="jsonl, .jsonl.gz, .jsonl.xz or .jsonl.zst")
    p.add_argument("--json-keys", nargs="+", default=["text"])
    p.add_argument("--vocab-size", type=int, default=2048)
    p.add_argument("--output-prefix", required=True, help="writes PREFIX.model, PREFIX.vocab")
    p.add_argument("--model-type", default="bpe", choices=["bpe", "unigram"])
    p.add_argument("--character-coverage", type=float, default=1.0)
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    return p.parse_args(argv)


def iter_texts(path: str, keys: Sequence[str]) -> Iterator[str]:
    import json

    if not os.path.isfile(path):
        raise DataError(f"{path}: input file not found")
    for lineno, line in read_lines(path):
        if not line.strip():
            continue
        try:
            doc = json.loads(line)
        except ValueError as e:
            raise DataError(f"{path}:{lineno}: invalid JSON ({e})") from None
        for key in keys:
            text = doc.get(key) if isinstance(doc, dict) else None
            if not isinstance(text, str):
                raise DataError(f"{path}:{lineno}: key {key!r} missing or not a string")
            if text:
                yield text.encode("utf-8")[:MAX_DOCUMENT_BYTES].decode("utf-8", "ignore")


def train(args: argparse.Namespace) -> str:
    """Train and publish PREFIX.model / PREFIX.vocab; returns the model path."""
    import sentencepiece as spm

    texts = list(iter_texts(args.input, args.json_keys))
    if not texts:
        raise DataError(f"{args.input}: no text to train on")
    model = io.BytesIO()
    try:
        spm.SentencePieceTrainer.train(
            sentence_iterator=iter(texts), model_writer=model, vocab_size=args.vocab_size,
            model_type=args.model_type, character_coverage=args.character_coverage,
            normalization_rule_name="identity", remove_extra_whitespaces=False,
            user_defined_symbols=["\n"], byte_fallback=True, split_digits=True,
            max_sentence_length=MAX_DOCUMENT_BYTES, unk_id=0, bos_id=1, eos_id=2, pad_id=-1,
            num_threads=args.threads, minloglevel=2)
    except RuntimeError as e:
        raise DataError(f"{args.input}: sentencepiece training failed "
                        f"({str(e).strip().splitlines()[-1]})") from None
    sp = spm.SentencePieceProcessor(model_proto=model.getvalue())
    vocab = "".join(f"{sp.id_to_piece(i)}\t{sp.get_score(i)}\n"
                    for i in range(sp.get_piece_size()))
    os.makedirs(os.path.dirname(os.path.abspath(args.output_prefix)), exist_ok=True)
    for suffix, data in ((".model", model.getvalue()), (".vocab", vocab.encode("utf-8"))):
        path = args.output_prefix + suffix
        tmp = tmp_path_for(path)
        with open(tmp, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    return args.output_prefix + ".model"


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    start = time.time()
    try:
        path = train(args)
    except DataError as e:
        sys.stderr.write(f"train_tokenizer.py: error: {e}\n")
        return 1
    sys.stderr.write(f"trained a {args.vocab_size}-piece {args.model_type} model in "
                     f"{time.time() - start:.1f} s -> {path}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

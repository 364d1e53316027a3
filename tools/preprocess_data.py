"""Tokenize a jsonl corpus into Megatron `.bin/.idx` files (Megatron-LM's flags).

    python tools/preprocess_data.py --input corpus.jsonl.xz --json-keys text \
        --output-prefix data/corpus --tokenizer-type SentencePieceTokenizer \
        --tokenizer-model tokenizer.model --append-eod --workers 4

Writes `{output-prefix}_{key}_document.bin/.idx` per json key. Documents keep the input
order (a worker pool with chunked, ordered imap). Bad input (missing file, malformed JSON,
missing key, unusable tokenizer) prints one line naming the file and line and exits 1;
outputs are only published once complete, so existing files are never half-overwritten.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import sys
import time
from typing import Optional, Sequence

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), os.path.pardir)))

from megamoe.data import DataError, IndexedDatasetBuilder, build_tokenizer  # noqa: E402
from megamoe.data.indexed_dataset import optimal_dtype  # noqa: E402
from megamoe.data.jsonl import read_lines  # noqa: E402
from megamoe.data.tokenizers import TOKENIZER_TYPES  # noqa: E402

_TOKENIZER = None  # per worker process


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    g = p.add_argument_group("input")
    g.add_argument("--input", required=True, help="jsonl, .jsonl.gz or .jsonl.xz")
    g.add_argument("--json-keys", nargs="+", default=["text"])
    g = p.add_argument_group("tokenizer")
    g.add_argument("--tokenizer-type", required=True, choices=TOKENIZER_TYPES)
    g.add_argument("--tokenizer-model", default=None)
    g.add_argument("--vocab-file", default=None)
    g.add_argument("--merge-file", default=None)
    g.add_argument("--vocab-size", type=int, default=None, help="for NullTokenizer")
    g.add_argument("--append-eod", action="store_true", help="end every document with eod")
    g = p.add_argument_group("output")
    g.add_argument("--output-prefix", required=True)
    g = p.add_argument_group("runtime")
    g.add_argument("--workers", type=int, default=1)
    g.add_argument("--chunk-size", type=int, default=32, help="documents per worker task")
    g.add_argument("--log-interval", type=int, default=1000,
                   help="documents between throughput updates")
    args = p.parse_args(argv)
    if args.workers < 1:
        p.error("--workers must be >= 1")
    return args


def _tokenizer_from(args: argparse.Namespace):
    return build_tokenizer(args.tokenizer_type, tokenizer_model=args.tokenizer_model,
                           vocab_file=args.vocab_file, merge_file=args.merge_file,
                           vocab_size=args.vocab_size)


def _init_worker(args: argparse.Namespace) -> None:
    global _TOKENIZER
    _TOKENIZER = _tokenizer_from(args)


def encode(job: tuple[int, str, list[str], bool]) -> tuple[int, Optional[dict], int, str]:
    """(line number, line, keys, append_eod) -> (line, {key: ids} or None, bytes, error)."""
    lineno, line, keys, append_eod = job
    if not line.strip():
        return lineno, None, len(line), ""
    try:
        doc = json.loads(line)
    except ValueError as e:
        return lineno, None, len(line), f"invalid JSON ({e})"
    if not isinstance(doc, dict):
        return lineno, None, len(line), "expected a JSON object"
    out = {}
    for key in keys:
        text = doc.get(key)
        if not isinstance(text, str):
            what = "missing" if key not in doc else f"not a string ({type(text).__name__})"
            return lineno, None, len(line), f"key {key!r} {what}"
        try:
            ids = _TOKENIZER.tokenize(text) if text else []
        except DataError as e:
            return lineno, None, len(line), str(e)
        if ids and append_eod:
            ids.append(_TOKENIZER.eod)
        out[key] = ids
    return lineno, out, len(line), ""


def output_prefix(prefix: str, key: str) -> str:
    return f"{prefix}_{key}_document"


def run(args: argparse.Namespace) -> int:
    """Tokenize `args.input`; returns the number of documents written."""
    from tqdm import tqdm

    if not os.path.isfile(args.input):
        raise DataError(f"{args.input}: input file not found")
    tokenizer = _tokenizer_from(args)  # fail on a bad tokenizer before spawning workers
    out_dir = os.path.dirname(os.path.abspath(args.output_prefix))
    os.makedirs(out_dir, exist_ok=True)
    dtype = optimal_dtype(tokenizer.vocab_size)
    builders = {k: IndexedDatasetBuilder(output_prefix(args.output_prefix, k) + ".bin", dtype)
                for k in args.json_keys}
    jobs = ((n, line, args.json_keys, args.append_eod) for n, line in read_lines(args.input))
    pool = None
    try:
        if args.workers > 1:
            pool = multiprocessing.Pool(args.workers, initializer=_init_worker, initargs=(args,))
            results = pool.imap(encode, jobs, chunksize=args.chunk_size)
        else:
            _init_worker(args)
            results = map(encode, jobs)
        n_docs, n_bytes, start = 0, 0, time.time()
        # A live bar on a terminal; plain lines every --log-interval documents in logs.
        interactive = sys.stderr.isatty()
        with tqdm(desc="documents", unit="doc", file=sys.stderr, mininterval=1.0,
                  disable=not interactive) as bar:
            for lineno, doc, size, error in results:
                if error:
                    raise DataError(f"{args.input}:{lineno}: {error}")
                n_bytes += size
                if doc is None:
                    continue
                for key, ids in doc.items():
                    builders[key].add_document(ids, [len(ids)] if ids else [])
                n_docs += 1
                bar.update(1)
                if n_docs % args.log_interval == 0:
                    elapsed = max(time.time() - start, 1e-9)
                    rate = f"{n_docs / elapsed:.0f} docs/s, {n_bytes / 2**20 / elapsed:.2f} MB/s"
                    if interactive:
                        bar.set_postfix_str(rate)
                    else:
                        sys.stderr.write(f"processed {n_docs} documents ({rate})\n")
        if n_docs == 0:
            raise DataError(f"{args.input}: no documents")
        for key, builder in builders.items():
            builder.finalize(output_prefix(args.output_prefix, key) + ".idx")
    finally:
        if pool is not None:
            pool.terminate()
            pool.join()
        for builder in builders.values():
            builder.abort()  # no-op after finalize; drops partial files otherwise
    elapsed = time.time() - start
    outputs = ", ".join(output_prefix(args.output_prefix, k) + ".bin/.idx" for k in builders)
    sys.stderr.write(f"processed {n_docs} documents ({n_bytes / 2**20:.1f} MB) in "
                     f"{elapsed:.1f} s -> {outputs}\n")
    return n_docs


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    try:
        run(args)
    except DataError as e:
        sys.stderr.write(f"preprocess_data.py: error: {e}\n")
        return 1
    except KeyboardInterrupt:
        sys.stderr.write("preprocess_data.py: interrupted; no output written\n")
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())

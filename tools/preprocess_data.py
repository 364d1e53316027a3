"""Tokenize a corpus into Megatron `.bin/.idx` files, with Megatron-LM's options.

    python tools/preprocess_data.py --input corpus.jsonl.zst --json-keys text \
        --output-prefix data/corpus --tokenizer-type HuggingFaceTokenizer \
        --tokenizer-model tokenizer_dir --append-eod --workers 4

Inputs: jsonl (plain, .gz, .xz, .zst) or Parquet (columns named by --json-keys), streamed
in chunks with bounded memory. Writes `{output-prefix}_{key}_document.bin/.idx` per key
(`_sentence` with --split-sentences: nltk punkt sentences as sequences, documents as
groups; nltk and its punkt_tab data must be installed),
byte-identical to Megatron-LM's tools/preprocess_data.py for the same input and tokenizer
(tools/bench_preprocess.py checks it and measures the speed). Every Megatron option is
accepted with Megatron's meaning or refused with one line (megamoe/cli/preprocess_args.py).
Bad input prints one line naming the file and line/row and exits 1; nothing is published
unless the whole run succeeded.
"""

from __future__ import annotations

import functools
import os
import sys
from typing import Optional, Sequence

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), os.path.pardir)))

from megamoe.cli.preprocess_args import parse_args  # noqa: E402
from megamoe.data import DataError, build_tokenizer  # noqa: E402
from megamoe.data.indexed_dataset import optimal_dtype  # noqa: E402
from megamoe.data.preprocess_encode import EncodeConfig  # noqa: E402
from megamoe.data.preprocess_run import RunConfig, input_files, run  # noqa: E402
from megamoe.data.sentence_split import load_splitter  # noqa: E402


def tokenizer_factory(args):
    """A picklable zero-argument builder of the tokenizer (each worker builds its own)."""
    return functools.partial(build_tokenizer, args.tokenizer_type,
                             tokenizer_model=args.tokenizer_model, vocab_file=args.vocab_file,
                             merge_file=args.merge_file, vocab_size=args.vocab_size,
                             null_eod_id=args.null_tokenizer_eod_id,
                             trust_remote_code=args.trust_remote_code)


def run_config(args, workers: int, **overrides) -> RunConfig:
    factory = tokenizer_factory(args)
    dtype = optimal_dtype(factory().vocab_size)  # also fails on a bad tokenizer early
    out_dir = os.path.dirname(os.path.abspath(args.output_prefix))
    if not os.path.isdir(out_dir):
        raise DataError(f"{out_dir}: output directory not found (--output-prefix)")
    if args.split_sentences:  # nltk and its punkt_tab data: checked before any output
        load_splitter(args.lang, args.keep_newlines)
    return RunConfig(inputs=input_files(args.input, args.partitions),
                     output_prefix=args.output_prefix,
                     encode=EncodeConfig(tuple(args.json_keys), args.append_eod,
                                         np_name(dtype), args.split_sentences, args.lang,
                                         args.keep_newlines),
                     workers=workers, partitions=args.partitions,
                     keep_sequential_samples=args.keep_sequential_samples,
                     chunk_docs=args.chunk_size, log_interval=args.log_interval, **overrides)


def np_name(dtype) -> str:
    import numpy as np

    return np.dtype(dtype).name


def find_optimal_num_workers(args) -> None:
    """Megatron's --find-optimal-num-workers: time the first --max-documents documents
    with each of --workers-to-check and rank them. megamoe publishes nothing in this mode
    (Megatron leaves a dataset truncated to --max-documents at --output-prefix)."""
    results = []
    for workers in args.workers_to_check:
        if workers % args.partitions:
            print(f"Removing num_workers ({workers}) from workers list because it's not "
                  f"divisible by num_partitions ({args.partitions})")
            continue
        cfg = run_config(args, workers, max_documents=args.max_documents, publish=False)
        n_docs, seconds, _ = run(cfg, tokenizer_factory(args))
        results.append((workers, n_docs / max(seconds, 1e-9)))
    results.sort(key=lambda r: r[1], reverse=True)
    print("Performance results (fastest -> slowest):")
    for i, (workers, rate) in enumerate(results, start=1):
        print(f"{i}. {workers} workers -> avg. docs/s: {rate:.4f}")
    print(f"The most optimal num of workers is {results[0][0]} with avg. preprocessed "
          f"docs/s: {results[0][1]:.4f}.")


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    try:
        if args.find_optimal_num_workers:
            find_optimal_num_workers(args)
            return 0
        n_docs, seconds, published = run(run_config(args, args.workers),
                                         tokenizer_factory(args))
    except DataError as e:
        sys.stderr.write(f"preprocess_data.py: error: {e}\n")
        return 1
    except KeyboardInterrupt:
        sys.stderr.write("preprocess_data.py: interrupted; no output written\n")
        return 130
    outputs = ", ".join(p + ".bin/.idx" for p in published)
    sys.stderr.write(f"processed {n_docs} documents in {seconds:.1f} s -> {outputs}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

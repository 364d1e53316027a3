"""tools/preprocess_data.py's options: every option of Megatron-LM's parser (pinned in
tests/fixtures/megatron_preprocess_options.json), each with Megatron's meaning, answered
in one of three ways:

* built: the option does what Megatron's does (most of them);
* deliberate no-op: Megatron's preprocessing parses it and never reads it for the
  output (NOOP names why), so megamoe accepts it and it changes nothing either;
* refused: a feature megamoe has not built (other tokenizer families): the run stops
  with one `not supported yet: --flag (why)` line, exit 2.

--split-sentences (with --keep-newlines, --lang) is built on nltk, an optional
dependency (megamoe/data/sentence_split.py); --keep-newlines and --lang are read only
with it, as in Megatron.

megamoe's own additions: --chunk-size (documents per worker task).
"""

from __future__ import annotations

import argparse
from typing import Optional, Sequence

from megamoe.config.data import TOKENIZER_TYPES

MEGATRON_TOKENIZER_TYPES = (
    "BertWordPieceLowerCase", "BertWordPieceCase", "GPT2BPETokenizer",
    "SentencePieceTokenizer", "GPTSentencePieceTokenizer", "HuggingFaceTokenizer",
    "Llama2Tokenizer", "TikTokenizer", "MultimodalTokenizer", "NullTokenizer",
    "NullMultimodalTokenizer", "SFTTokenizer")

# Parsed by Megatron's preprocess_data.py but never read when writing .bin/.idx.
NOOP = {
    "--padded-vocab-size": "the model's padded embedding size; the output dtype comes "
                           "from the tokenizer's own vocab size",
    "--no-pad-vocab-size": "embedding padding only (as --padded-vocab-size)",
    "--disable-pad-vocab-size": "embedding padding only (as --padded-vocab-size)",
    "--vocab-extra-ids": "Megatron's get_args overwrites it with 0",
    "--null-tokenizer-pad-id": "padding is never written by preprocessing",
}

# option -> why it is refused when given (with a non-default value).
REFUSED = {
    "--tokenizer-metadata": "tokenizer metadata files are not read by megamoe's tokenizers",
    "--tokenizer-special-tokens": "extra special tokens are not added by megamoe's "
                                  "tokenizers",
    "--tiktoken-pattern": "TikTokenizer is not built",
    "--tiktoken-num-special-tokens": "TikTokenizer is not built",
    "--tokenizer-sentencepiece-legacy": "only sentencepiece's default mode is built",
    "--no-tokenizer-sentencepiece-ignore-extra-whitespaces": "only sentencepiece's "
                                                             "default mode is built",
    "--disable-tokenizer-sentencepiece-ignore-extra-whitespaces": "only sentencepiece's "
                                                                  "default mode is built",
    "--tokenizer-hf-no-use-fast": "megamoe reads tokenizer.json with the fast tokenizer",
    "--tokenizer-hf-no-include-special-tokens": "the tokenizer's post-processor always "
                                                "runs",
    "--chat-template": "chat templates are not applied by preprocessing",
    "--use-gigatoken": "gigatoken is not built",
}


def _positive(flag: str):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{flag} must be an integer, got {text!r}") from None
        if value < 1:
            raise argparse.ArgumentTypeError(f"{flag} must be >= 1, got {value}")
        return value
    return parse


def _language(text: str) -> str:
    """--lang names one punkt_tab model folder (nltk's own rule: letters, digits, - and
    _), so a path like `english/../german` is a bad flag, not a missing file."""
    if not text or not all(c.isalnum() or c in "-_" for c in text):
        raise argparse.ArgumentTypeError(f"--lang must be a punkt model name such as "
                                         f"english (letters, digits, - and _), got {text!r}")
    return text


def add_tokenizer_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("tokenizer")
    g.add_argument("--vocab-size", type=_positive("--vocab-size"), default=None)
    g.add_argument("--padded-vocab-size", type=int, default=None)
    g.add_argument("--no-pad-vocab-size", "--disable-pad-vocab-size", dest="pad_vocab_size",
                   action="store_false")
    g.add_argument("--vocab-file", default=None)
    g.add_argument("--merge-file", default=None)
    g.add_argument("--vocab-extra-ids", type=int, default=0)
    g.add_argument("--tokenizer-type", required=True, choices=MEGATRON_TOKENIZER_TYPES)
    g.add_argument("--tokenizer-model", default=None)
    g.add_argument("--tokenizer-metadata", default=None)
    g.add_argument("--tokenizer-special-tokens", nargs="+", default=None)
    g.add_argument("--tiktoken-pattern", choices=["v1", "v2"], default=None)
    g.add_argument("--tiktoken-num-special-tokens", type=int, default=1000)
    g.add_argument("--tokenizer-sentencepiece-legacy", action="store_true")
    g.add_argument("--no-tokenizer-sentencepiece-ignore-extra-whitespaces",
                   "--disable-tokenizer-sentencepiece-ignore-extra-whitespaces",
                   dest="tokenizer_sentencepiece_ignore_extra_whitespaces",
                   action="store_false")
    g.add_argument("--tokenizer-hf-no-use-fast", action="store_true")
    g.add_argument("--tokenizer-hf-no-include-special-tokens", action="store_true")
    g.add_argument("--trust-remote-code", action="store_true")
    g.add_argument("--null-tokenizer-eod-id", type=int, default=None)
    g.add_argument("--null-tokenizer-pad-id", type=int, default=-1)
    g.add_argument("--chat-template", default=None)
    g.add_argument("--use-gigatoken", action="store_true")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="preprocess_data.py",
                                description="Tokenize a corpus into Megatron .bin/.idx")
    add_tokenizer_args(p)
    g = p.add_argument_group("input data")
    g.add_argument("--input", required=True,
                   help="jsonl, .gz, .xz, .zst or .parquet (a glob with --partitions > 1)")
    g.add_argument("--json-keys", nargs="+", default=["text"],
                   help="JSON keys (Parquet columns) to tokenize")
    g.add_argument("--split-sentences", action="store_true")
    g.add_argument("--keep-newlines", action="store_true")
    g = p.add_argument_group("tokenization process")
    g.add_argument("--append-eod", action="store_true")
    g.add_argument("--lang", type=_language, default="english")
    g = p.add_argument_group("output data")
    g.add_argument("--output-prefix", required=True)
    g = p.add_argument_group("runtime")
    g.add_argument("--workers", type=_positive("--workers"), required=True)
    g.add_argument("--find-optimal-num-workers", action="store_true")
    g.add_argument("--workers-to-check", nargs="+", type=_positive("--workers-to-check"),
                   default=[16, 32, 64])
    g.add_argument("--max-documents", type=_positive("--max-documents"), default=100_000)
    g.add_argument("--partitions", type=_positive("--partitions"), default=1)
    g.add_argument("--log-interval", type=_positive("--log-interval"), default=1000)
    g.add_argument("--keep-sequential-samples", action="store_true")
    g.add_argument("--chunk-size", type=_positive("--chunk-size"), default=256,
                   help="megamoe: documents per worker task (tokenized as one batch)")
    return p


def refused_option(args: argparse.Namespace, parser: argparse.ArgumentParser
                   ) -> Optional[str]:
    """The `not supported yet` line for the first refused option set, or None."""
    if args.tokenizer_type not in TOKENIZER_TYPES:
        return (f"not supported yet: --tokenizer-type {args.tokenizer_type} (built: "
                f"{', '.join(TOKENIZER_TYPES)})")
    for action in parser._actions:
        flag = next((s for s in action.option_strings if s in REFUSED), None)
        if flag is not None and getattr(args, action.dest) != action.default:
            spelled = " / ".join(action.option_strings)  # aliases: name every spelling
            return f"not supported yet: {spelled} ({REFUSED[flag]})"
    return None


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    """Megatron's options; refused ones and inconsistent values exit 2 with one line."""
    parser = build_parser()
    args = parser.parse_args(argv)
    refused = refused_option(args, parser)
    if refused is not None:
        parser.exit(2, f"preprocess_data.py: error: {refused}\n")
    eod = args.null_tokenizer_eod_id
    if eod is not None and args.vocab_size is not None and not 0 <= eod < args.vocab_size:
        parser.error(f"--null-tokenizer-eod-id must be in [0, --vocab-size), got {eod}")
    workers = args.workers_to_check if args.find_optimal_num_workers else [args.workers]
    if not any(w % args.partitions == 0 for w in workers):
        parser.error(f"--workers must be divisible by --partitions ({args.partitions}), "
                     f"got {', '.join(map(str, workers))}")
    return args

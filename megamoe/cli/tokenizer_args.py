"""Megatron-LM's --trust-remote-code (its HuggingFaceTokenizer passes it to transformers'
AutoTokenizer): a tokenizer directory that is its own Python code, as Kimi-K2's and
Moonlight's, is run only when the flag is given (megamoe/data/remote_tokenizer.py)."""

from __future__ import annotations

import argparse


def add_tokenizer_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("tokenizer code")
    g.add_argument("--trust-remote-code", action="store_true",
                   help="with --tokenizer-type HuggingFaceTokenizer: run the Python code a "
                        "tokenizer directory names in its tokenizer_config.json auto_map "
                        "(from the directory, never the network)")

"""Reading jsonl corpora, plain or compressed, with line numbers for error messages.

The decompression is corpus_reader.py's (the one tools/preprocess_data.py streams with),
so every tool reads the same inputs: .jsonl, .gz, .xz and .zst, and a file cut short is
one error naming it, whichever tool meets it first.
"""

from __future__ import annotations

import io
import lzma
from typing import Iterator

from megamoe.data.corpus_reader import open_binary, require_module
from megamoe.data.errors import DataError


def read_lines(path: str) -> Iterator[tuple[int, str]]:
    """(1-based line number, line) of a .jsonl, .gz, .xz or .zst file as UTF-8 text;
    missing, unreadable, truncated or corrupt files raise DataError naming `path`."""
    require_module(path)  # .zst without zstandard: one line, not an ImportError
    try:
        with open(path, "rb") as raw:
            with io.TextIOWrapper(open_binary(path, raw), encoding="utf-8") as f:
                yield from enumerate(f, start=1)
    except FileNotFoundError:
        raise DataError(f"{path}: input file not found") from None
    except (OSError, EOFError, lzma.LZMAError, UnicodeDecodeError) as e:
        text = str(e).strip().splitlines()
        raise DataError(f"{path}: unreadable input "
                        f"({text[0] if text else type(e).__name__})") from None

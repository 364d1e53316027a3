"""Reading jsonl corpora, plain or compressed, with line numbers for error messages."""

from __future__ import annotations

import gzip
import lzma
from typing import IO, Iterator

from megamoe.data.errors import DataError


def open_text(path: str) -> IO[str]:
    """Open .jsonl, .jsonl.gz or .jsonl.xz as UTF-8 text (by file name)."""
    if path.endswith(".gz"):
        return gzip.open(path, "rt", encoding="utf-8")
    if path.endswith(".xz"):
        return lzma.open(path, "rt", encoding="utf-8")
    return open(path, encoding="utf-8")


def read_lines(path: str) -> Iterator[tuple[int, str]]:
    """(1-based line number, line); unreadable or corrupt files raise DataError."""
    try:
        with open_text(path) as f:
            yield from enumerate(f, start=1)
    except FileNotFoundError:
        raise DataError(f"{path}: input file not found") from None
    except (OSError, EOFError, lzma.LZMAError, UnicodeDecodeError) as e:
        raise DataError(f"{path}: unreadable input ({e})") from None

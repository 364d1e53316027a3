"""Streaming a corpus in chunks of documents: jsonl (plain, .gz, .xz, .zst) or Parquet.

Why chunks: tools/preprocess_data.py hands each chunk to a worker, which tokenizes it in
one batch (tokenizers' encode_batch) and returns packed token bytes, so per-document
Python and pickling overhead stays out of the main process. Memory is bounded by the
chunk size: jsonl is read line by line and Parquet in record batches of the chosen
columns, whatever the file size.

A chunk is ("json", first_line, [lines]) or ("rows", first_row, {key: [values]});
`progress()` is how many bytes of the (compressed) file have been consumed, for the
progress bar's MB/s and ETA. A compressed file cut short, an unreadable file or a
malformed Parquet file raises DataError naming the file.
"""

from __future__ import annotations

import gzip
import importlib.util
import io
import lzma
import os
from typing import BinaryIO, Iterator, Sequence

from megamoe.data.errors import DataError

CHUNK_BYTES = 512 << 10  # a chunk also ends at this many bytes of jsonl text


class _ZstdRaw(io.RawIOBase):
    """Decompresses a .zst file frame after frame; a file that ends inside a frame raises
    EOFError (zstandard's own stream_reader returns a short read silently)."""

    def __init__(self, f: BinaryIO) -> None:
        import zstandard

        self._zstd = zstandard
        self._f = f
        self._d = zstandard.ZstdDecompressor().decompressobj()
        self._in_frame = False
        self._pending = b""

    def readable(self) -> bool:
        return True

    def readinto(self, buf) -> int:
        while not self._pending:
            raw = self._f.read(1 << 20)
            if not raw:
                if self._in_frame:
                    raise EOFError("compressed file ended before the end of a zstd frame")
                return 0
            try:
                self._pending = self._feed(raw)
            except self._zstd.ZstdError as e:
                raise EOFError(f"corrupt zstd data ({e})") from None
        n = min(len(buf), len(self._pending))
        buf[:n] = self._pending[:n]
        self._pending = self._pending[n:]
        return n

    def _feed(self, raw: bytes) -> bytes:
        out = []
        while raw:
            self._in_frame = True
            out.append(self._d.decompress(raw))
            if not self._d.eof:
                break
            self._in_frame = False
            raw = self._d.unused_data
            self._d = self._zstd.ZstdDecompressor().decompressobj()
        return b"".join(out)


def open_binary(path: str, raw: BinaryIO) -> BinaryIO:
    """`raw` decompressed by file name (.gz, .xz, .zst; anything else as is). Closing the
    result leaves `raw` open: the caller's `with` owns it."""
    if path.endswith(".gz"):
        return gzip.GzipFile(fileobj=raw)
    if path.endswith(".xz"):
        return lzma.LZMAFile(raw)
    if path.endswith(".zst"):
        return io.BufferedReader(_ZstdRaw(raw), 1 << 20)
    return raw


def require_module(path: str) -> None:
    """A missing optional reader is one line naming the file, not an ImportError."""
    module = "pyarrow" if is_parquet(path) else "zstandard" if path.endswith(".zst") else None
    if module is not None and importlib.util.find_spec(module) is None:
        raise DataError(f"{path}: reading it needs the {module} package "
                        f"(pip install {module})")


def is_parquet(path: str) -> bool:
    return path.endswith(".parquet")


class CorpusReader:
    """Chunks of documents from one file; iterate once."""

    def __init__(self, path: str, keys: Sequence[str], chunk_docs: int) -> None:
        if not os.path.isfile(path):
            raise DataError(f"{path}: input file not found")
        require_module(path)
        self.path = path
        self.keys = list(keys)
        self.chunk_docs = chunk_docs
        self.total_bytes = os.path.getsize(path)
        self._raw = None

    def progress(self) -> int:
        try:
            return self._raw.tell() if self._raw is not None else 0
        except (OSError, ValueError):
            return self.total_bytes

    def __iter__(self) -> Iterator[tuple]:
        try:
            with open(self.path, "rb") as raw:
                self._raw = raw
                if is_parquet(self.path):
                    yield from self._parquet_chunks(raw)
                else:
                    yield from self._json_chunks(open_binary(self.path, raw))
        except (OSError, EOFError, lzma.LZMAError) as e:
            raise DataError(f"{self.path}: unreadable input ({_one_line(e)})") from None
        finally:
            self._raw = None

    def _json_chunks(self, f: BinaryIO) -> Iterator[tuple]:
        lines: list[bytes] = []
        size, first = 0, 1
        for lineno, line in enumerate(f, start=1):
            if not lines:
                first = lineno
            lines.append(line)
            size += len(line)
            if len(lines) >= self.chunk_docs or size >= CHUNK_BYTES:
                yield "json", first, lines
                lines, size = [], 0
        if lines:
            yield "json", first, lines

    def _parquet_chunks(self, raw: BinaryIO) -> Iterator[tuple]:
        import pyarrow as pa
        import pyarrow.parquet as pq

        try:
            pf = pq.ParquetFile(raw)
            names = pf.schema_arrow.names
            for key in self.keys:
                if key not in names:
                    raise DataError(f"{self.path}: no column {key!r} (--json-keys; columns: "
                                    f"{', '.join(names[:20])})")
            row = 0
            for batch in pf.iter_batches(batch_size=self.chunk_docs, columns=self.keys):
                cols = {k: batch.column(k).to_pylist() for k in self.keys}
                yield "rows", row, cols
                row += batch.num_rows
        except (pa.ArrowException, ValueError) as e:
            raise DataError(f"{self.path}: malformed Parquet file ({_one_line(e)})") from None


def parquet_rows(path: str) -> int:
    """Row count from the Parquet footer (no data read)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        return int(pq.ParquetFile(path).metadata.num_rows)
    except (pa.ArrowException, OSError, ValueError) as e:
        raise DataError(f"{path}: malformed Parquet file ({_one_line(e)})") from None


def count_documents(path: str) -> int:
    """Documents in a file (non-blank jsonl lines or Parquet rows), for
    --keep-sequential-samples' partition size."""
    require_module(path)
    if is_parquet(path):
        return parquet_rows(path)
    try:
        with open(path, "rb") as raw:
            return sum(1 for line in open_binary(path, raw) if line.strip())
    except (OSError, EOFError, lzma.LZMAError) as e:
        raise DataError(f"{path}: unreadable input ({_one_line(e)})") from None


def _one_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return text[0] if text else type(e).__name__

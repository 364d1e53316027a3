"""The main-process side of tools/preprocess_data.py: read, farm out, write, publish.

Chunks of documents go to a worker pool through a bounded window of pending tasks
(multiprocessing's imap would read the whole input ahead: memory must stay flat however
large the corpus is), results come back in input order and one buffered writer per
output appends them. With Megatron's --partitions P, document i goes to partition
i mod P (or, with --keep-sequential-samples, to consecutive blocks of ceil(N/P)), each
partition is published as `{prefix}_{p}_{key}_{level}` and the partitions are merged in
order into `{prefix}_{key}_{level}` (level: `sentence` with --split-sentences, else
`document`, Megatron's names): the same files Megatron's partition run leaves
(megamoe does not write the partitioned copies of the input). Nothing is published
unless every document was encoded: outputs are written to temporary names first.
"""

from __future__ import annotations

import collections
import glob
import math
import multiprocessing
import os
import sys
import time
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import numpy as np
from tqdm import tqdm

from megamoe.data.corpus_reader import CorpusReader, count_documents
from megamoe.data.errors import DataError
from megamoe.data.indexed_dataset import IndexedDatasetBuilder
from megamoe.data.preprocess_encode import EncodeConfig, encode_chunk, init_worker


@dataclass(frozen=True)
class RunConfig:
    inputs: tuple[str, ...]
    output_prefix: str
    encode: EncodeConfig
    workers: int
    partitions: int = 1
    keep_sequential_samples: bool = False
    chunk_docs: int = 256
    log_interval: int = 1000
    max_documents: Optional[int] = None  # stop after this many (--find-optimal-num-workers)
    publish: bool = True


def dataset_prefix(prefix: str, key: str, split_sentences: bool = False) -> str:
    return f"{prefix}_{key}_{'sentence' if split_sentences else 'document'}"


class _Sink:
    """Builders per (partition, key) and the routing of documents to partitions."""

    def __init__(self, cfg: RunConfig, total_docs: Optional[int]) -> None:
        self.cfg = cfg
        self.block = math.ceil(total_docs / cfg.partitions) if total_docs else None
        self.n_docs = 0
        self.builders = {(p, k): IndexedDatasetBuilder(
            self._name(self._prefix(p), k) + ".bin", np.dtype(cfg.encode.dtype))
            for p in range(cfg.partitions) for k in cfg.encode.keys}

    def _name(self, prefix: str, key: str) -> str:
        return dataset_prefix(prefix, key, self.cfg.encode.split_sentences)

    def _prefix(self, p: int) -> str:
        prefix = self.cfg.output_prefix
        return prefix if self.cfg.partitions == 1 else f"{prefix}_{p}"

    def _partition(self, i: int) -> int:
        if self.block is not None:
            return min(i // self.block, self.cfg.partitions - 1)
        return i % self.cfg.partitions

    def add(self, n_docs: int, packed: dict) -> None:
        if self.cfg.partitions == 1:
            for key, (tokens, lengths, per_doc) in packed.items():
                self.builders[0, key].add_packed(tokens, lengths, per_doc)
        else:
            for key, (tokens, lengths, per_doc) in packed.items():
                self._route(key, tokens, lengths, per_doc)
        self.n_docs += n_docs

    def _route(self, key: str, tokens: bytes, lengths: np.ndarray, per_doc: np.ndarray):
        size = np.dtype(self.cfg.encode.dtype).itemsize
        seq_at = np.concatenate([[0], np.cumsum(per_doc)])
        tok_at = np.concatenate([[0], np.cumsum(lengths)]) * size
        for d in range(len(per_doc)):
            s0, s1 = int(seq_at[d]), int(seq_at[d + 1])
            b = self.builders[self._partition(self.n_docs + d), key]
            b.add_packed(tokens[int(tok_at[s0]):int(tok_at[s1])], lengths[s0:s1],
                         per_doc[d:d + 1])

    def finish(self) -> list[str]:
        """Publish every output (partitions first, then their merge); returns prefixes."""
        keys, parts = self.cfg.encode.keys, range(self.cfg.partitions)
        for (p, key), b in self.builders.items():
            b.finalize(self._name(self._prefix(p), key) + ".idx")
        if self.cfg.partitions == 1:
            return [self._name(self.cfg.output_prefix, k) for k in keys]
        merged = []
        for key in keys:
            final = self._name(self.cfg.output_prefix, key)
            with IndexedDatasetBuilder(final + ".bin", np.dtype(self.cfg.encode.dtype)) as m:
                for p in parts:
                    m.add_index(self._name(self._prefix(p), key))
                m.finalize(final + ".idx")
            merged.append(final)
        return merged

    def abort(self) -> None:
        for b in self.builders.values():
            b.abort()


class _Progress:
    """tqdm over input bytes (MB/s, ETA) with documents/s in the postfix on a terminal;
    Megatron's "Processed N documents" line every --log-interval documents otherwise."""

    def __init__(self, total_bytes: int, log_interval: int) -> None:
        self.interactive = sys.stderr.isatty()
        self.bar = tqdm(total=total_bytes, unit="B", unit_scale=True, unit_divisor=1 << 20,
                        desc="input", file=sys.stderr, mininterval=0.5,
                        disable=not self.interactive)
        self.log_interval, self.start, self.done, self.next_log = (
            log_interval, time.time(), 0, log_interval)

    def update(self, done_bytes: int, n_docs: int) -> None:
        self.bar.update(max(done_bytes - self.done, 0))
        self.done = max(done_bytes, self.done)
        elapsed = max(time.time() - self.start, 1e-9)
        if self.interactive:
            self.bar.set_postfix_str(f"{n_docs} docs, {n_docs / elapsed:.0f} docs/s",
                                     refresh=False)
        if n_docs >= self.next_log:  # once per chunk that crosses a multiple
            if not self.interactive:
                sys.stderr.write(f"Processed {n_docs} documents ({n_docs / elapsed:.1f} "
                                 f"docs/s, {self.done / elapsed / 2**20:.2f} MB/s).\n")
            self.next_log = (n_docs // self.log_interval + 1) * self.log_interval

    def close(self) -> None:
        self.bar.close()


def run(cfg: RunConfig, tokenizer_factory: Callable) -> tuple[int, float, list[str]]:
    """Tokenize cfg.inputs; returns (documents, seconds, published dataset prefixes)."""
    total = None
    if cfg.partitions > 1 and cfg.keep_sequential_samples:
        total = sum(count_documents(path) for path in cfg.inputs)
    readers = [CorpusReader(p, cfg.encode.keys, cfg.chunk_docs) for p in cfg.inputs]
    sink = _Sink(cfg, total) if cfg.publish else None
    progress = _Progress(sum(r.total_bytes for r in readers), cfg.log_interval)
    pool = None
    n_docs, start = 0, time.time()
    try:
        if cfg.workers > 1:
            pool = multiprocessing.Pool(cfg.workers, initializer=init_worker,
                                        initargs=(tokenizer_factory, cfg.encode))
        else:
            init_worker(tokenizer_factory, cfg.encode)
        for reader, location, done_bytes, result in _results(readers, pool, cfg):
            if result.error:
                raise DataError(f"{reader.path}: {result.error}")
            take = result.n_docs
            if cfg.max_documents is not None:
                take = min(take, cfg.max_documents - n_docs)
            if sink is not None:
                sink.add(take, _first(result.packed, take) if take < result.n_docs
                         else result.packed)
            n_docs += take
            progress.update(done_bytes + sum(r.total_bytes for r in readers[:location]),
                            n_docs)
            if cfg.max_documents is not None and n_docs >= cfg.max_documents:
                break
        if n_docs == 0:
            raise DataError(f"{', '.join(cfg.inputs)}: no documents")
        published = sink.finish() if sink is not None else []
    finally:
        progress.close()
        if pool is not None:
            pool.terminate()
            pool.join()
        if sink is not None:
            sink.abort()  # no-op after finish; drops partial files otherwise
    return n_docs, time.time() - start, published


def _results(readers: Sequence[CorpusReader], pool, cfg: RunConfig):
    """(reader, reader index, bytes read of it, EncodedChunk) in input order, with at most
    a few chunks per worker in flight (bounded memory)."""
    window = collections.deque()
    for i, reader in enumerate(readers):
        for chunk in reader:
            if pool is None:
                yield reader, i, reader.progress(), encode_chunk(chunk)
                continue
            window.append((reader, i, reader.progress(),
                           pool.apply_async(encode_chunk, (chunk,))))
            if len(window) >= 3 * cfg.workers:
                r, j, done, res = window.popleft()
                yield r, j, done, res.get()
    while window:
        r, j, done, res = window.popleft()
        yield r, j, done, res.get()


def _first(packed: dict, n: int) -> dict:
    """The first `n` documents of a chunk's packed output."""
    out = {}
    for key, (tokens, lengths, per_doc) in packed.items():
        n_seq = int(per_doc[:n].sum())
        n_tok = int(lengths[:n_seq].sum())
        size = len(tokens) // max(int(lengths.sum()), 1)
        out[key] = (tokens[:n_tok * size], lengths[:n_seq], per_doc[:n])
    return out


def input_files(pattern: str, partitions: int) -> tuple[str, ...]:
    """Megatron's reading of --input: one path, or with --partitions > 1 a glob (sorted
    here, so the order does not depend on the file system)."""
    if partitions == 1:
        return (pattern,)
    found = tuple(sorted(p for p in glob.glob(pattern) if os.path.isfile(p)))
    if not found:
        raise DataError(f"{pattern}: no input file matches (--input)")
    return found

"""DataConfig -> (train, valid, test) datasets, Megatron's BlendedMegatronDatasetBuilder.

Three ways to name data, as in Megatron-LM:
- `--data-path "p"` or `"w1 p1 w2 p2"` with `--split "969,30,1"`: every prefix is split
  by *documents* (contiguous ranges, normalised weights); each split blends the prefixes.
  Unweighted `"p1 p2"` blends by size, as Megatron: each prefix's split used once whole
  (one epoch), weights = their sample counts, min(requested, sum) samples; more is an error.
- `--train-data-path / --valid-data-path / --test-data-path`: whole datasets per split.
- `--data-args-path` / `--per-split-data-args-path`: the same two, read from files.
- `--mock-data`: synthetic documents (mock_dataset.py), split like a real prefix.
"""

from __future__ import annotations

import math
import os
import re
from typing import Optional, Sequence

import numpy as np

from megamoe.config import DataConfig
from megamoe.data.blended_dataset import BlendedDataset, component_sizes
from megamoe.data.data_args import resolve_data_paths
from megamoe.data.errors import DataError
from megamoe.data.gpt_dataset import GPTDataset
from megamoe.data.index_cache import DEFAULT_TIMEOUT_S
from megamoe.data.indexed_dataset import IndexedDataset
from megamoe.data.mock_dataset import MockIndexedDataset

SPLIT_NAMES = ("train", "valid", "test")


def parse_split(split: str) -> list[float]:
    """"969,30,1" (or "969/30/1", fewer parts padded with 0) -> normalised weights."""
    parts = [p for p in re.split(r"[,/]", split.strip()) if p.strip()]
    try:
        weights = [float(p) for p in parts]
    except ValueError:
        raise DataError(f"--split {split!r}: expected up to 3 numbers like 969,30,1") from None
    if (not 1 <= len(weights) <= 3 or not all(math.isfinite(w) and w >= 0 for w in weights)
            or sum(weights) <= 0):
        raise DataError(f"--split {split!r}: expected up to 3 non-negative numbers, not all 0")
    weights += [0.0] * (3 - len(weights))
    return [w / sum(weights) for w in weights]


def split_document_ranges(num_documents: int, weights: Sequence[float]) -> list[tuple[int, int]]:
    """Megatron's split boundaries: rounded cumulative shares, corrected to sum exactly."""
    bounds = [0]
    for w in weights:
        bounds.append(bounds[-1] + int(round(w * float(num_documents))))
    diff = bounds[-1] - num_documents
    bounds = [bounds[0]] + [b - diff for b in bounds[1:]]
    return [(max(0, bounds[i]), max(0, bounds[i + 1])) for i in range(len(weights))]


def parse_data_path(values: Sequence[str]) -> tuple[Optional[list[float]], list[str]]:
    """Megatron's "p1 p2" (weights None: blended by size) or "w1 p1 w2 p2" ->
    (weights, prefixes)."""
    values = list(values)
    if not values:
        raise DataError("empty data path list")
    try:
        float(values[0])
        weighted = len(values) > 1
    except ValueError:
        weighted = False
    if not weighted:
        return None, values
    if len(values) % 2:
        raise DataError(f"data path {' '.join(values)!r}: expected weight/prefix pairs")
    try:
        weights = [float(w) for w in values[0::2]]
    except ValueError:
        raise DataError(f"data path {' '.join(values)!r}: expected weight/prefix pairs") from None
    if not all(math.isfinite(w) and w >= 0 for w in weights) or sum(weights) <= 0:
        raise DataError(f"data path {' '.join(values)!r}: weights must be finite, "
                        "non-negative and not all 0")
    return weights, values[1::2]


def one_epoch_samples(indexed, begin: int, end: int, seq_length: int) -> int:
    """Samples of one epoch of documents [begin, end): (tokens - 1) // seq_length, as
    Megatron's GPTDataset with num_samples None (each sample reads one extra token)."""
    seqs = indexed.document_indices[begin:end + 1]
    tokens = int(indexed.sequence_lengths[seqs[0]:seqs[-1]].sum(dtype=np.int64))
    return max(0, (tokens - 1) // seq_length)


def build_gpt_datasets(config: DataConfig, tokenizer, num_samples: tuple[int, int, int], *,
                       seq_length: int, seed: int, wait_timeout_s: float = DEFAULT_TIMEOUT_S):
    """(train, valid, test) of `seq_length`-token samples, shuffled with `seed`; a split is
    None when its weight or its num_samples is 0. Index files missing from the cache are
    built by one process; the others wait up to `wait_timeout_s` (the run's
    --distributed-timeout-minutes: Megatron's ranks wait at a barrier bounded by it)."""
    builder = _Builder(config, tokenizer, seq_length, seed, wait_timeout_s)
    if config.mock_data:
        mock = MockIndexedDataset(tokenizer.vocab_size, tokenizer.eod, seq_length, seed)
        return tuple(builder.split_of(mock, i, n, None)
                     for i, n in enumerate(num_samples))
    data_path, paths = resolve_data_paths(config)
    if data_path:
        weights, prefixes = parse_data_path(data_path)
        split = parse_split(config.split)
        return tuple(builder.blend(weights, prefixes, i, n, split)
                     for i, n in enumerate(num_samples))
    if paths[0]:
        out = []
        for i, (values, n) in enumerate(zip(paths, num_samples)):
            if not values:
                out.append(None)
                continue
            weights, prefixes = parse_data_path(values)
            out.append(builder.blend(weights, prefixes, i, n, [float(j == i) for j in range(3)]))
        return tuple(out)
    raise DataError("no data: pass --data-path, --train-data-path or --mock-data")


class _Builder:
    def __init__(self, config: DataConfig, tokenizer, seq_length: int, seed: int,
                 wait_timeout_s: float) -> None:
        self.config = config
        self.wait_timeout_s = wait_timeout_s
        self.tokenizer = tokenizer
        self.seq_length, self.seed = seq_length, seed
        self._opened: dict[str, IndexedDataset] = {}

    def open(self, prefix: str) -> IndexedDataset:
        if prefix not in self._opened:
            self._opened[prefix] = IndexedDataset(prefix, self.config.mmap_bin_files)
            _check_vocab(self._opened[prefix], self.tokenizer)
        return self._opened[prefix]

    def cache_dir(self, prefix: Optional[str]) -> Optional[str]:
        if self.config.data_cache_path is not None:
            return self.config.data_cache_path
        if prefix is None:
            return None
        return os.path.join(os.path.dirname(os.path.abspath(prefix)), "cache")

    def split_of(self, indexed, i: int, num_samples: int, prefix: Optional[str],
                 split: Optional[list[float]] = None,
                 one_epoch: bool = False) -> Optional[GPTDataset]:
        """Split `i` of one dataset, or None when it is empty or not wanted; `one_epoch`:
        exactly the samples one pass over its documents gives (Megatron's num_samples
        None), whatever `num_samples` says."""
        split = parse_split(self.config.split) if split is None else split
        if not num_samples or split[i] == 0:
            return None
        n_docs = len(indexed.document_indices) - 1
        begin, end = split_document_ranges(n_docs, split)[i]
        if end <= begin:
            return None
        c = self.config
        if one_epoch:
            num_samples = one_epoch_samples(indexed, begin, end, self.seq_length)
            if num_samples == 0:
                return None
        return GPTDataset(indexed, np.arange(begin, end), num_samples, self.seq_length, self.seed,
                          self.tokenizer.eod, eod_mask_loss=c.eod_mask_loss,
                          reset_position_ids=c.reset_position_ids,
                          reset_attention_mask=c.reset_attention_mask,
                          cache_dir=self.cache_dir(prefix), name=SPLIT_NAMES[i],
                          wait_timeout_s=self.wait_timeout_s)

    def blend(self, weights: Optional[list[float]], prefixes: list[str], i: int,
              num_samples: int, split: list[float]):
        if not num_samples or split[i] == 0:
            return None
        if len(prefixes) == 1:
            return self.split_of(self.open(prefixes[0]), i, num_samples, prefixes[0], split)
        if weights is None:
            return self.blend_by_size(prefixes, i, num_samples, split)
        sizes = component_sizes(weights, num_samples)
        parts = [self.split_of(self.open(p), i, n, p, split) if n else None
                 for p, n in zip(prefixes, sizes)]
        wanted = [(p, d) for p, d, n in zip(prefixes, parts, sizes) if n]
        if all(d is None for _, d in wanted):
            return None
        for p, d in wanted:
            if d is None:
                raise DataError(f"{p}: no documents fall in the {SPLIT_NAMES[i]} split "
                                f"({self.config.split}) but its blending weight is non-zero")
        kept = [(w, d, p) for w, d, p in zip(weights, parts, prefixes) if d is not None]
        return BlendedDataset([d for _, d, _ in kept], [w for w, _, _ in kept], num_samples,
                              cache_dir=self.cache_dir(prefixes[0]),
                              descriptions=[d.description for _, d, _ in kept],
                              wait_timeout_s=self.wait_timeout_s)


    def blend_by_size(self, prefixes: list[str], i: int, num_samples: int,
                      split: list[float]) -> Optional[BlendedDataset]:
        """Megatron's unweighted blend (BlendedMegatronDatasetBuilder, weights None): one
        epoch of each prefix's split, weighted by its sample count, min(requested, total)
        samples, so nothing repeats. Megatron then runs out of data mid-run when more are
        requested; here that is one error naming the sizes before training starts."""
        parts = [(p, self.split_of(self.open(p), i, 1, p, split, one_epoch=True))
                 for p in prefixes]
        kept = [(p, d) for p, d in parts if d is not None and len(d)]
        if not kept:
            return None
        sizes = [len(d) for _, d in kept]
        if sum(sizes) < num_samples:
            raise DataError(
                f"--data-path without weights uses each dataset once (as Megatron): the "
                f"{SPLIT_NAMES[i]} split holds {sum(sizes)} samples of {self.seq_length} "
                f"tokens ({', '.join(map(str, sizes))}) but {num_samples} are needed; give "
                f"weights (w1 p1 w2 p2) to repeat data, or ask for fewer samples")
        return BlendedDataset([d for _, d in kept], sizes, num_samples,
                              cache_dir=self.cache_dir(kept[0][0]),
                              descriptions=[d.description for _, d in kept],
                              wait_timeout_s=self.wait_timeout_s)


def _check_vocab(indexed: IndexedDataset, tokenizer) -> None:
    """Token ids beyond the tokenizer would index past the embedding: fail at load."""
    if indexed.dtype.kind == "f":
        raise DataError(f"{indexed.path_prefix}.idx: float tokens ({indexed.dtype.name})")
    limit = np.iinfo(indexed.dtype).max
    if limit >= tokenizer.vocab_size and indexed.num_tokens and indexed.num_tokens <= 1 << 24:
        top = indexed.max_token_id()
        if top >= tokenizer.vocab_size:
            raise DataError(f"{indexed.path_prefix}.bin: token id {top} >= tokenizer vocabulary "
                            f"size {tokenizer.vocab_size}; wrong --tokenizer-model?")

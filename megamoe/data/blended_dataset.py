"""Megatron's BlendedDataset: a weighted, deterministic interleaving of datasets.

The blending index (blending_index.py) is Megatron's greedy rule: at each position pick
the dataset whose realised share lags its weight the most (ties to the lowest index).
With a cache directory it is streamed into .npy files once and memory-mapped back.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import sys
from typing import Optional, Sequence

import numpy as np
import torch

from megamoe.data.blending_index import (
    build_blending_indices,
    check_blending_indices,
    normalize_weights,
    write_blending_indices,
)
from megamoe.data.errors import DataError
from megamoe.data.index_cache import DEFAULT_TIMEOUT_S, build_once, timed

SIZE_MARGIN = 1.005  # each component holds 0.5 % more samples than its share needs

__all__ = ["BlendedDataset", "build_blending_indices", "component_sizes", "normalize_weights"]


def component_sizes(weights: Sequence[float], num_samples: int) -> list[int]:
    """Samples to request from each component (Megatron: ceil(w * n * 1.005))."""
    return [int(math.ceil(w * num_samples * SIZE_MARGIN)) for w in normalize_weights(weights)]


class BlendedDataset(torch.utils.data.Dataset):
    """`num_samples` items drawn from `datasets` in proportion to `weights`."""

    def __init__(self, datasets: Sequence[torch.utils.data.Dataset], weights: Sequence[float],
                 num_samples: int, cache_dir: Optional[str] = None,
                 descriptions: Optional[Sequence[dict]] = None,
                 wait_timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        if len(datasets) != len(weights) or not datasets:
            raise ValueError("need one weight per dataset and at least one dataset")
        if len(datasets) > np.iinfo(np.int16).max:
            raise DataError(f"cannot blend {len(datasets)} datasets (at most 32767)")
        self.datasets = list(datasets)
        self.weights = normalize_weights(weights)
        self.num_samples = int(num_samples)
        self._cache_files: Optional[tuple[str, str]] = None
        what = f"blending index ({self.num_samples} samples, {len(self.datasets)} datasets)"
        if cache_dir is None or descriptions is None:
            with timed(what, always=False):
                arrays = build_blending_indices(self.weights, self.num_samples)
        else:
            arrays = self._cached(cache_dir, descriptions, what, wait_timeout_s)
        self.dataset_index, self.dataset_sample_index = arrays
        check_blending_indices(self.dataset_index, self.dataset_sample_index, self.num_samples,
                               [len(d) for d in self.datasets],
                               (self._cache_files or ("blending index",))[0])

    def _cached(self, cache_dir: str, descriptions: Sequence[dict], what: str,
                wait_timeout_s: float):
        """Built once into the cache (streamed, whatever its length), memory-mapped back."""
        key = hashlib.md5(json.dumps({"class": "BlendedDataset", "weights": self.weights,
                                      "num_samples": self.num_samples,
                                      "datasets": list(descriptions)},
                                     sort_keys=True).encode()).hexdigest()
        paths = tuple(os.path.join(cache_dir, f"{key}-BlendedDataset-{n}.npy")
                      for n in ("dataset_index", "dataset_sample_index"))
        try:
            build_once(paths, lambda: write_blending_indices(self.weights, self.num_samples,
                                                             paths), what, wait_timeout_s)
        except OSError as e:
            sys.stderr.write(f"megamoe.data: warning: cannot write the blending cache in "
                             f"{cache_dir} ({e.strerror or e}); indices kept in memory\n")
            return build_blending_indices(self.weights, self.num_samples)
        self._cache_files = paths
        return _load(paths)

    def __getstate__(self) -> dict:
        """Pickle cached indices by path so DataLoader workers map instead of copy them."""
        state = dict(self.__dict__)
        if self._cache_files is not None:
            state.pop("dataset_index")
            state.pop("dataset_sample_index")
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        if self._cache_files is not None:
            self.dataset_index, self.dataset_sample_index = _load(self._cache_files)

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, idx: int):
        d = int(self.dataset_index[idx])
        return self.datasets[d][int(self.dataset_sample_index[idx])]


def _load(paths: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
    try:
        return tuple(np.load(p, mmap_mode="r", allow_pickle=False) for p in paths)
    except (OSError, ValueError) as e:
        raise DataError(f"{paths[0]}: unreadable blending cache ({e}); delete the "
                        "cache directory to rebuild it") from None

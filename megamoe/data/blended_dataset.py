"""Megatron's BlendedDataset: a weighted, deterministic interleaving of datasets.

The blending index is Megatron's greedy rule: at each position pick the dataset whose
realised share lags its weight the most (ties to the lowest index). It needs no random
numbers, so it is the same on every rank and run, and every prefix of it tracks the
weights to within one sample per dataset.
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

from megamoe.data.atomic import save_npy_atomic
from megamoe.data.errors import DataError

SIZE_MARGIN = 1.005  # each component holds 0.5 % more samples than its share needs


def normalize_weights(weights: Sequence[float]) -> list[float]:
    total = float(sum(weights))
    if total <= 0 or any(w < 0 for w in weights):
        raise DataError(f"blending weights must be >= 0 with a positive sum, got {list(weights)}")
    return [float(w) / total for w in weights]


def component_sizes(weights: Sequence[float], num_samples: int) -> list[int]:
    """Samples to request from each component (Megatron: ceil(w * n * 1.005))."""
    return [int(math.ceil(w * num_samples * SIZE_MARGIN)) for w in normalize_weights(weights)]


def build_blending_indices(weights: Sequence[float],
                           num_samples: int) -> tuple[np.ndarray, np.ndarray]:
    """(dataset_index [n] int16, dataset_sample_index [n] int64) by the greedy rule."""
    w = normalize_weights(weights)
    k = len(w)
    counts = [0] * k
    dataset_index = np.empty(num_samples, dtype=np.int16)
    sample_index = np.empty(num_samples, dtype=np.int64)
    for i in range(num_samples):
        t = float(max(i, 1))
        best, best_err = 0, w[0] * t - counts[0]
        for d in range(1, k):
            err = w[d] * t - counts[d]
            if err > best_err:
                best, best_err = d, err
        dataset_index[i] = best
        sample_index[i] = counts[best]
        counts[best] += 1
    return dataset_index, sample_index


class BlendedDataset(torch.utils.data.Dataset):
    """`num_samples` items drawn from `datasets` in proportion to `weights`."""

    def __init__(self, datasets: Sequence[torch.utils.data.Dataset], weights: Sequence[float],
                 num_samples: int, cache_dir: Optional[str] = None,
                 descriptions: Optional[Sequence[dict]] = None) -> None:
        if len(datasets) != len(weights) or not datasets:
            raise ValueError("need one weight per dataset and at least one dataset")
        if len(datasets) > np.iinfo(np.int16).max:
            raise DataError(f"cannot blend {len(datasets)} datasets (at most 32767)")
        self.datasets = list(datasets)
        self.weights = normalize_weights(weights)
        self.num_samples = int(num_samples)
        self.dataset_index, self.dataset_sample_index = self._indices(cache_dir, descriptions)
        for d, ds in enumerate(self.datasets):
            used = self.dataset_sample_index[self.dataset_index == d]
            if used.size and int(used.max()) >= len(ds):
                raise DataError(f"blended component {d} has {len(ds)} samples but the "
                                f"blend needs {int(used.max()) + 1}")

    def _indices(self, cache_dir: Optional[str], descriptions: Optional[Sequence[dict]]):
        if cache_dir is None or descriptions is None:
            return build_blending_indices(self.weights, self.num_samples)
        key = hashlib.md5(json.dumps({"class": "BlendedDataset", "weights": self.weights,
                                      "num_samples": self.num_samples,
                                      "datasets": list(descriptions)},
                                     sort_keys=True).encode()).hexdigest()
        paths = [os.path.join(cache_dir, f"{key}-BlendedDataset-{n}.npy")
                 for n in ("dataset_index", "dataset_sample_index")]
        if all(os.path.isfile(p) for p in paths):
            try:
                return tuple(np.load(p, allow_pickle=False) for p in paths)
            except (OSError, ValueError) as e:
                raise DataError(f"{paths[0]}: unreadable blending cache ({e}); delete the "
                                "cache directory to rebuild it") from None
        arrays = build_blending_indices(self.weights, self.num_samples)
        try:
            os.makedirs(cache_dir, exist_ok=True)
            for p, a in zip(paths, arrays):
                save_npy_atomic(p, a)
        except OSError as e:
            sys.stderr.write(f"megamoe.data: warning: cannot write the blending cache in "
                             f"{cache_dir} ({e.strerror}); indices kept in memory\n")
        return arrays

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, idx: int):
        d = int(self.dataset_index[idx])
        return self.datasets[d][int(self.dataset_sample_index[idx])]

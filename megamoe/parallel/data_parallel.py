"""Data-parallel gradient reduction: average gradients over the data-parallel group.

Gradients are flattened into buckets of at most `bucket_numel` elements per dtype so a
model with many small tensors costs a few collectives, not one per parameter. Averaging
(sum / dp) matches the loss normalisation in the training step: each rank's loss is the
mean over its own micro-batches, so the average over ranks is the mean over the global
batch, the same number a single process computes.
"""

from __future__ import annotations

from typing import Iterable, Optional

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors


def _buckets(grads: list[torch.Tensor], bucket_numel: int) -> Iterable[list[torch.Tensor]]:
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for g in grads:
        by_dtype.setdefault(g.dtype, []).append(g)
    for same_dtype in by_dtype.values():
        bucket: list[torch.Tensor] = []
        size = 0
        for g in same_dtype:
            if bucket and size + g.numel() > bucket_numel:
                yield bucket
                bucket, size = [], 0
            bucket.append(g)
            size += g.numel()
        if bucket:
            yield bucket


def allreduce_gradients(grads: list[torch.Tensor], group: Optional[dist.ProcessGroup],
                        bucket_numel: int = 40_000_000) -> None:
    """Average `grads` in place over `group` (no-op when group is None)."""
    if group is None:
        return
    world = dist.get_world_size(group)
    for bucket in _buckets(grads, bucket_numel):
        flat = _flatten_dense_tensors(bucket)
        dist.all_reduce(flat, group=group)
        flat.div_(world)
        for g, reduced in zip(bucket, _unflatten_dense_tensors(flat, bucket)):
            g.copy_(reduced)

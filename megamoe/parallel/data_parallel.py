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


def _sum_marked(grads: list[torch.Tensor], params: list[torch.nn.Parameter], attr: str,
                group: Optional[dist.ProcessGroup], bucket_numel: int) -> None:
    if group is None:
        return
    marked = [g for g, p in zip(grads, params) if getattr(p, attr, False)]
    for bucket in _buckets(marked, bucket_numel):
        flat = _flatten_dense_tensors(bucket)
        dist.all_reduce(flat, group=group)
        for g, reduced in zip(bucket, _unflatten_dense_tensors(flat, bucket)):
            g.copy_(reduced)


def reduce_gradients(grads: list[torch.Tensor], params: list[torch.nn.Parameter],
                     tp_group: Optional[dist.ProcessGroup],
                     dp_group: Optional[dist.ProcessGroup],
                     bucket_numel: int = 40_000_000, *,
                     embd_group: Optional[dist.ProcessGroup] = None) -> None:
    """Make `grads` (aligned with `params`) the full-batch gradients, in place.

    1. Sum over TP the gradients of TP-replicated parameters that saw only this rank's
       sequence shard (`param.sequence_parallel`: norms, row-parallel biases, position
       embeddings under sequence parallelism). Sharded parameters own their gradient;
       other replicated parameters already hold the full, identical gradient.
    2. Sum over the embedding group (first and last pipeline stage) the two copies of a
       tied word embedding (`param.shared_embedding`), so both get the full gradient.
    3. Average everything over DP.
    """
    _sum_marked(grads, params, "sequence_parallel", tp_group, bucket_numel)
    _sum_marked(grads, params, "shared_embedding", embd_group, bucket_numel)
    allreduce_gradients(grads, dp_group, bucket_numel)

"""Data-parallel gradient reduction: dense gradients averaged over the data-parallel group,
routed-expert gradients over the expert-data-parallel group (see `reduce_gradients`).

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
                        bucket_numel: int = 40_000_000, divisor: Optional[int] = None) -> None:
    """Sum `grads` in place over `group`, then divide by `divisor` (default: the group's
    size, i.e. average; no-op when there is nothing to sum and nothing to divide)."""
    world = 1 if group is None else dist.get_world_size(group)
    divisor = world if divisor is None else divisor
    if world == 1 and divisor == 1:
        return
    for bucket in _buckets(grads, bucket_numel):
        if world == 1:
            torch._foreach_div_(bucket, float(divisor))
            continue
        flat = _flatten_dense_tensors(bucket)
        dist.all_reduce(flat, group=group)
        flat.div_(divisor)
        for g, reduced in zip(bucket, _unflatten_dense_tensors(flat, bucket)):
            g.copy_(reduced)


def sum_marked(grads: list[torch.Tensor], params: list[torch.nn.Parameter], attr: str,
                group: Optional[dist.ProcessGroup], bucket_numel: int) -> None:
    if group is None:
        return
    marked = [g for g, p in zip(grads, params) if getattr(p, attr, False)]
    for bucket in _buckets(marked, bucket_numel):
        if len(bucket) == 1 and bucket[0].is_contiguous():  # in place: no flat copy
            dist.all_reduce(bucket[0], group=group)
            continue
        flat = _flatten_dense_tensors(bucket)
        dist.all_reduce(flat, group=group)
        for g, reduced in zip(bucket, _unflatten_dense_tensors(flat, bucket)):
            g.copy_(reduced)


def reduce_gradients(grads: list[torch.Tensor], params: list[torch.nn.Parameter],
                     tp_group: Optional[dist.ProcessGroup],
                     dp_group: Optional[dist.ProcessGroup],
                     bucket_numel: int = 40_000_000, *,
                     embd_group: Optional[dist.ProcessGroup] = None,
                     edp_group: Optional[dist.ProcessGroup] = None) -> None:
    """Make `grads` (aligned with `params`) the full-batch gradients, in place.

    1. Sum over TP the gradients of TP-replicated parameters that saw only this rank's
       sequence shard (`param.sequence_parallel`: norms, row-parallel biases, position
       embeddings under sequence parallelism). Sharded parameters own their gradient;
       other replicated parameters already hold the full, identical gradient.
    2. Sum over the embedding group (first and last pipeline stage) the two copies of a
       tied word embedding (`param.shared_embedding`), so both get the full gradient.
    3. Average dense parameters over DP. Routed-expert parameters (`param.expert_parallel`,
       see moe/sharding.py) are summed over their expert-data-parallel group only and
       divided by DP: an ep rank's expert gradient already sums the contributions of every
       rank of its ep group (the all-to-all's backward brings them), the edp sum adds the
       remaining replicas, so sum / DP is the global-batch mean, as for dense parameters
       (Megatron's edp / dp scaling of an edp average).
    """
    sum_marked(grads, params, "sequence_parallel", tp_group, bucket_numel)
    sum_marked(grads, params, "shared_embedding", embd_group, bucket_numel)
    is_expert = [getattr(p, "expert_parallel", False) for p in params]
    dense = [g for g, e in zip(grads, is_expert) if not e]
    expert = [g for g, e in zip(grads, is_expert) if e]
    allreduce_gradients(dense, dp_group, bucket_numel)
    if expert:
        dp_size = 1 if dp_group is None else dist.get_world_size(dp_group)
        allreduce_gradients(expert, edp_group, bucket_numel, divisor=dp_size)


def local_grad_norm(grads: list[torch.Tensor]) -> torch.Tensor:
    """The L2 norm of `grads` (fp32, 0-d, on their device)."""
    return torch.linalg.vector_norm(
        torch.stack([torch.linalg.vector_norm(g, dtype=torch.float32) for g in grads]))


def clip_coefficient(norm: torch.Tensor, max_norm: float) -> torch.Tensor:
    """min(1, max_norm / (norm + 1e-6)) on the device (Megatron's clipping): multiplying
    by 1 leaves unclipped gradients bitwise as they are."""
    return (max_norm / (norm + 1e-6)).clamp(max=1.0)


def model_parallel_grad_norm(grads: list[torch.Tensor], params: list[torch.nn.Parameter],
                             tp_group: Optional[dist.ProcessGroup],
                             pp_group: Optional[dist.ProcessGroup],
                             ep_group: Optional[dist.ProcessGroup] = None,
                             etp_group: Optional[dist.ProcessGroup] = None) -> torch.Tensor:
    """L2 norm of the whole model's gradient, each parameter counted once (see
    model_parallel_sum)."""
    return model_parallel_sum(squares(grads), params, tp_group, pp_group, ep_group,
                              etp_group).sqrt()


def model_parallel_sum(values: list[torch.Tensor], params: list[torch.nn.Parameter],
                       tp_group: Optional[dist.ProcessGroup],
                       pp_group: Optional[dist.ProcessGroup],
                       ep_group: Optional[dist.ProcessGroup] = None,
                       etp_group: Optional[dist.ProcessGroup] = None,
                       dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Sum over the whole model of per-parameter values (0-d, aligned with `params`: the
    squares of a norm, counts of zeros), each parameter counted once: TP-sharded parameters
    (`param.tensor_model_parallel`) summed over TP, TP-replicated ones taken from this rank
    (identical on every TP rank), routed experts (`param.expert_parallel`: each ep rank
    holds different experts) summed over EP, and the ones split over the expert-tensor-
    parallel group (`param.etp_sharded`) over ETP first, stages summed over PP. DP / EDP
    replicas hold identical values, so they are not summed; the last stage's copy of a tied
    embedding (`param.shared_copy`) is not counted. A 0-d tensor of `dtype`."""
    device = values[0].device if values else torch.device("cpu")  # (none: a CPU zero)
    sq = torch.zeros(4, dtype=dtype, device=device)  # [tp-sharded, replicated, expert,
    for v, p in zip(values, params):                 #  etp-sharded expert]
        if getattr(p, "shared_copy", False):
            continue
        if getattr(p, "expert_parallel", False):
            i = 3 if getattr(p, "etp_sharded", False) else 2
        else:
            i = 0 if getattr(p, "tensor_model_parallel", False) else 1
        sq[i] += v.to(dtype)
    if tp_group is not None:
        dist.all_reduce(sq[:1], group=tp_group)
    if etp_group is not None:
        dist.all_reduce(sq[3:], group=etp_group)
    if ep_group is not None:
        dist.all_reduce(sq[2:], group=ep_group)
    total = sq.sum().reshape(1)
    if pp_group is not None:
        dist.all_reduce(total, group=pp_group)
    return total[0]


def zero_counts(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Per tensor: how many of its elements are exactly zero (0-d int64, on its device)."""
    return [t.numel() - torch.count_nonzero(t) for t in tensors]


def squares(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Per tensor: its squared L2 norm, accumulated in fp32 (0-d, on its device)."""
    return [torch.linalg.vector_norm(t, dtype=torch.float32).square() for t in tensors]


def square_sum(grad: torch.Tensor) -> torch.Tensor:
    """The squared L2 norm of one gradient, accumulated in fp32 (a bf16 main gradient is not
    summed in bf16; an fp32 one as the distributed optimizer always summed it)."""
    if grad.dtype == torch.float32:
        return grad.square().sum()
    return torch.linalg.vector_norm(grad, dtype=torch.float32).square()

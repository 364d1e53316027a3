"""Where megatron-core's distributed optimizer keeps each parameter in its flat buffers:
the layout a `dp_reshardable` checkpoint (Megatron-LM's default
`distrib_optim_sharding_type`) is written in, rebuilt from the saved args.

megatron-core 0.19 (optimizer/distrib_optimizer.py `_compute_per_buffer_param_layout`,
optimizer/param_layout.py, distributed/distributed_data_parallel.py) lays out each
buffer (one per (param dtype, grad dtype, expert-parallel) group of a model chunk) so:

- parameters in REVERSE registration order (backprop order);
- each parameter's start rounded up to a multiple of 64 elements (`pad_param_start`);
- a bucket closes once it holds >= bucket_size elements (bucket_size None: one bucket);
  a `shared_embedding` parameter gets a bucket of its own (only with PP > 1);
- each bucket's end padded to lcm(DP, 128) (with --ddp-pad-buckets-for-high-nccl-busbw
  lcm(DP, 128, 2**16)), the next bucket starting there;
- bucket_size: None unless --overlap-grad-reduce (and not
  --overlap-param-gather-with-optimizer-step), else --ddp-bucket-size or
  max(4e7, 1e6 * DP).

The checkpoint stores each bucket as one flat tensor of its unpadded length, so a
parameter's states are the slice [start, end) relative to its bucket's start: this is
what `bucket_layout` returns. A pure function of the parameter list; proven against the
offsets megatron-core itself computes (tests/tools/test_convert_megatron_dp_reshard.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional

PARAM_ALIGN = 64


@dataclass
class Bucket:
    """One bucket: its padded and unpadded lengths and each parameter's [start, end)
    from the bucket's start."""

    numel: int = 0
    numel_unpadded: int = 0
    params: dict[str, tuple[int, int]] = field(default_factory=dict)


def _round_up(value: int, divisor: int) -> int:
    return -(-value // divisor) * divisor


def bucket_end_divisor(dp_size: int, pad_for_high_nccl_busbw: bool) -> int:
    return math.lcm(dp_size, 128, 2**16) if pad_for_high_nccl_busbw else math.lcm(dp_size, 128)


def bucket_layout(params: list[tuple[str, int]], bucket_size: Optional[int], dp_size: int,
                  pad_for_high_nccl_busbw: bool = False,
                  new_bucket: frozenset[str] = frozenset()) -> list[Bucket]:
    """params: (name, numel) in the model's registration order -> the buffer's buckets.
    `new_bucket`: names of `shared_embedding` parameters (a bucket of their own)."""
    buckets: list[Bucket] = []
    current = Bucket()
    bucket_start = start = end = 0

    def close(param_end: int) -> int:
        current.numel_unpadded = param_end - bucket_start
        bucket_end = _round_up(param_end, bucket_end_divisor(dp_size,
                                                             pad_for_high_nccl_busbw))
        current.numel = bucket_end - bucket_start
        buckets.append(current)
        return bucket_end

    for name, numel in reversed(params):
        start = _round_up(start, PARAM_ALIGN)
        if name in new_bucket and current.params:
            bucket_start = close(start)
            current, start = Bucket(), bucket_start
        end = start + numel
        current.params[name] = (start - bucket_start, end - bucket_start)
        if (bucket_size is not None and end - bucket_start >= bucket_size) or (
                name in new_bucket):
            bucket_start = close(end)
            current, start = Bucket(), bucket_start
        else:
            start = end
    if current.params:
        close(end)
    return buckets


def bucket_size_of(overlap_grad_reduce: bool, ddp_bucket_size: Optional[int], dp_size: int,
                   disable_bucketing: bool) -> Optional[int]:
    """megatron-core DistributedDataParallel's bucket size (None: one bucket)."""
    if not overlap_grad_reduce or disable_bucketing:
        return None
    return ddp_bucket_size if ddp_bucket_size is not None else max(40_000_000,
                                                                     1_000_000 * dp_size)

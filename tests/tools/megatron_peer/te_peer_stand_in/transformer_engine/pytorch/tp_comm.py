"""The tensor-parallel communication TE's Linear / LayerNormLinear do themselves (TE
27486e03 module/linear.py and layernorm_linear.py with `parallel_mode` and `tp_group`),
as plain torch.distributed autograd functions on the module's tp_group:

- column: the input enters as is (sequence parallel: all-gathered along the sequence, dim
  0) and its gradient is all-reduced (sequence parallel: reduce-scattered);
- row: the output is all-reduced (sequence parallel: reduce-scattered along dim 0) and its
  gradient enters as is (sequence parallel: all-gathered).

Megatron-LM's tensor_parallel/mappings.py has the same four; written here so the stand-in
does not reach into megatron-core (it stands for TE, which does not import it either).
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def _all_reduce(x: torch.Tensor, group) -> torch.Tensor:
    x = x.contiguous().clone()
    dist.all_reduce(x, group=group)
    return x


def _all_gather0(x: torch.Tensor, group) -> torch.Tensor:
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, x.contiguous(), group=group)
    return torch.cat(parts)


def _reduce_scatter0(x: torch.Tensor, group) -> torch.Tensor:
    n = dist.get_world_size(group)
    if x.shape[0] % n:
        raise ValueError(f"sequence length {x.shape[0]} not divisible by TP {n}")
    summed = _all_reduce(x, group)  # (gloo has no reduce_scatter)
    return summed.chunk(n)[dist.get_rank(group)].contiguous()


class _Enter(torch.autograd.Function):
    """Column-parallel input: identity / all-gather forward, all-reduce / reduce-scatter
    backward."""

    @staticmethod
    def forward(ctx, x, group, sp):
        ctx.group, ctx.sp = group, sp
        return _all_gather0(x, group) if sp else x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        if ctx.sp:
            return _reduce_scatter0(grad, ctx.group), None, None
        return _all_reduce(grad, ctx.group), None, None


class _Leave(torch.autograd.Function):
    """Row-parallel output: all-reduce / reduce-scatter forward, identity / all-gather
    backward."""

    @staticmethod
    def forward(ctx, x, group, sp):
        ctx.group, ctx.sp = group, sp
        return _reduce_scatter0(x, group) if sp else _all_reduce(x, group)

    @staticmethod
    def backward(ctx, grad):
        return (_all_gather0(grad, ctx.group) if ctx.sp else grad), None, None


def enter_column(x: torch.Tensor, group, tp_size: int, sequence_parallel: bool
                 ) -> torch.Tensor:
    return x if tp_size == 1 else _Enter.apply(x, group, sequence_parallel)


def leave_row(y: torch.Tensor, group, tp_size: int, sequence_parallel: bool) -> torch.Tensor:
    return y if tp_size == 1 else _Leave.apply(y, group, sequence_parallel)

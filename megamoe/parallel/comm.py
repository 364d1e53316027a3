"""Autograd-aware collectives for tensor and sequence parallelism (Megatron's mappings).

Each op is a pair (forward, backward) of conjugate collectives, so the gradients of a
tensor-parallel region are exact:

    copy_to_tp               identity      / all-reduce
    reduce_from_tp           all-reduce    / identity
    scatter_to_sequence      split dim 0   / all-gather dim 0
    gather_from_sequence     all-gather 0  / reduce-scatter 0 (or split, see below)
    reduce_scatter_to_sequence  reduce-scatter 0 / all-gather 0
    all_reduce_sum           all-reduce    / all-reduce (a statistic every rank uses)
    all_to_all_uneven        all-to-all    / all-to-all with the splits swapped
    all_to_all_start/_wait   the same, asynchronous in both directions (overlap)

The gather/reduce-scatter pair also serves the allgather token dispatcher over the ep
group, and the uneven all-to-all the alltoall dispatcher (moe/dispatchers/).
Every op is the identity when `group` is None (one rank), so layers call them unguarded.
Tensors are split along dim 0, the sequence dimension of Megatron's [S, B, H] layout.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

Group = Optional[dist.ProcessGroup]


def group_size(group: Group) -> int:
    """Ranks in `group`; 1 for None (this codebase's "no such parallelism")."""
    return 1 if group is None else dist.get_world_size(group)


def group_rank(group: Group) -> int:
    """This rank's index in `group`; 0 for None."""
    return 0 if group is None else dist.get_rank(group)



# torch >= 2.10 names (gloo implements both); older torch: the *_tensor spellings.
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def _all_reduce_copy(x: torch.Tensor, group: Group) -> torch.Tensor:
    """The sum over `group` in a new tensor (for inputs that must stay as they are)."""
    if group_size(group) == 1:
        return x
    x = x.contiguous().clone()
    dist.all_reduce(x, group=group)
    return x


def _split(x: torch.Tensor, group: Group) -> torch.Tensor:
    n = group_size(group)
    if n == 1:
        return x
    if x.shape[0] % n:
        raise ValueError(f"sequence length {x.shape[0]} is not divisible by the tensor-parallel "
                         f"size {n} (sequence parallelism)")
    return x.chunk(n, dim=0)[dist.get_rank(group)].contiguous()


def _all_gather(x: torch.Tensor, group: Group) -> torch.Tensor:
    """Every rank's `x` stacked along dim 0, gathered straight into one tensor."""
    n = group_size(group)
    if n == 1:
        return x
    out = torch.empty((n * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)
    _all_gather_single(out, x.contiguous(), group=group)
    return out


def _reduce_scatter(x: torch.Tensor, group: Group) -> torch.Tensor:
    n = group_size(group)
    if n == 1:
        return x
    if x.shape[0] % n:
        raise ValueError(f"dim 0 ({x.shape[0]}) is not divisible by the group size {n}")
    out = torch.empty((x.shape[0] // n, *x.shape[1:]), dtype=x.dtype, device=x.device)
    _reduce_scatter_single(out, x.contiguous(), group=group)
    return out


class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, g):
        # A copy: autograd may hand one gradient tensor to several backward functions
        # (both addends of a residual sum get the same one); summing it in place would
        # change the other branch's gradient too.
        return _all_reduce_copy(g, ctx.group), None


class _ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        """In place: the input is a partial product nothing saved for backward (a
        row-parallel GEMM saves its input and weight, not its output); mark_dirty makes
        autograd refuse if anything did save it."""
        if group_size(group) == 1:
            return x
        if x.is_contiguous() and not x.is_leaf:
            ctx.mark_dirty(x)
        else:  # a strided view or a leaf: sum a copy
            x = x.contiguous().clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, g):
        return g, None


class _ScatterToSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _split(x, group)

    @staticmethod
    def backward(ctx, g):
        return _all_gather(g, ctx.group), None


class _GatherFromSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, reduce_grad):
        ctx.group, ctx.reduce_grad = group, reduce_grad
        return _all_gather(x, group)

    @staticmethod
    def backward(ctx, g):
        if ctx.reduce_grad:
            return _reduce_scatter(g, ctx.group), None, None
        return _split(g, ctx.group), None, None


class _ReduceScatterToSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _reduce_scatter(x, group)

    @staticmethod
    def backward(ctx, g):
        return _all_gather(g, ctx.group), None


class _AllReduceSum(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _all_reduce_copy(x, group)

    @staticmethod
    def backward(ctx, g):
        return _all_reduce_copy(g, ctx.group), None


def all_reduce_sum(x: torch.Tensor, group: Group) -> torch.Tensor:
    """Differentiable sum over `group` of per-rank partial statistics that every rank then
    uses on its own shard (the whole-projection q/k norm's sum of squares over heads split
    by TP): each rank's partial feeds every rank's consumer, so its gradient is the sum of
    all the consumers' gradients, an all-reduce in backward too."""
    return x if group is None else _AllReduceSum.apply(x, group)


def copy_to_tp(x: torch.Tensor, group: Group) -> torch.Tensor:
    """Enter a TP region with a replicated input: gradients are summed over ranks."""
    return x if group is None else _CopyToTP.apply(x, group)


def reduce_from_tp(x: torch.Tensor, group: Group) -> torch.Tensor:
    """Leave a TP region: sum the partial outputs of every rank."""
    return x if group is None else _ReduceFromTP.apply(x, group)


def scatter_to_sequence(x: torch.Tensor, group: Group) -> torch.Tensor:
    """Full sequence (replicated) -> this rank's [S/TP, ...] shard."""
    return x if group is None else _ScatterToSequence.apply(x, group)


def gather_from_sequence(x: torch.Tensor, group: Group, *,
                         reduce_grad: bool = True) -> torch.Tensor:
    """[S/TP, ...] shards -> full sequence. `reduce_grad=True` when each rank's consumer
    yields a partial gradient (a column-parallel GEMM), so the backward reduce-scatters;
    False when every rank computes the same full gradient (a replicated consumer), so the
    backward just keeps the local chunk."""
    return x if group is None else _GatherFromSequence.apply(x, group, reduce_grad)


def reduce_scatter_to_sequence(x: torch.Tensor, group: Group) -> torch.Tensor:
    """Partial full-sequence outputs -> summed [S/TP, ...] shard (row-parallel exit)."""
    return x if group is None else _ReduceScatterToSequence.apply(x, group)


def all_reduce_tensor(x: torch.Tensor, group: Group, op=dist.ReduceOp.SUM) -> torch.Tensor:
    """Non-differentiable in-place all-reduce (statistics, norms); no-op without a group."""
    if group_size(group) > 1:
        dist.all_reduce(x, op=op, group=group)
    return x


class _AllToAllUneven(torch.autograd.Function):
    """Uneven all-to-all along dim 0; the backward is the same exchange with the splits
    swapped (what this rank sent to rank r comes back as the gradient from rank r)."""

    @staticmethod
    def forward(ctx, x, output_splits, input_splits, group):
        ctx.group, ctx.output_splits, ctx.input_splits = group, output_splits, input_splits
        return _all_to_all(x, output_splits, input_splits, group)

    @staticmethod
    def backward(ctx, g):
        return _all_to_all(g, ctx.input_splits, ctx.output_splits, ctx.group), None, None, None


def _all_to_all(x: torch.Tensor, output_splits: list[int], input_splits: list[int],
                group: Group) -> torch.Tensor:
    out = x.new_empty((sum(output_splits), *x.shape[1:]))
    dist.all_to_all_single(out, x.contiguous(), output_splits, input_splits, group=group)
    return out


def all_to_all_uneven(x: torch.Tensor, output_splits: list[int], input_splits: list[int],
                      group: Group) -> torch.Tensor:
    """Rows [sum(input_splits), ...] -> [sum(output_splits), ...]: input_splits[r] rows go to
    rank r, output_splits[r] rows arrive from rank r (zeros allowed). Differentiable."""
    if group is None:
        return x
    return _AllToAllUneven.apply(x, list(output_splits), list(input_splits), group)


def all_to_all_counts(counts: torch.Tensor, group: Group) -> torch.Tensor:
    """Exchange equal-size integer blocks (split sizes): chunk r of `counts` (dim 0 split
    into group-size chunks) goes to rank r; returns the chunks received, source-major."""
    if group is None:
        return counts
    out = torch.empty_like(counts)
    dist.all_to_all_single(out, counts.contiguous(), group=group)
    return out


def all_gather_no_grad(x: torch.Tensor, group: Group) -> torch.Tensor:
    """Concatenate every rank's `x` along dim 0 (equal shapes); no autograd (masks, ids)."""
    return _all_gather(x.detach(), group)


class AsyncHandle:
    """Pending work of one asynchronous all-to-all, forward and backward."""

    def __init__(self) -> None:
        self.work: Optional[dist.Work] = None
        self.backward_work: Optional[dist.Work] = None
        self.keep: list[torch.Tensor] = []  # buffers that must outlive the pending work
        self.grad_input: Optional[torch.Tensor] = None  # filled by backward_work


class _AllToAllStart(torch.autograd.Function):
    """Launch the exchange and return its (not yet filled) output; _AllToAllWait completes
    it. Backward: wait for the gradient exchange that _AllToAllWait's backward launched."""

    @staticmethod
    def forward(ctx, x, output_splits, input_splits, group, handle):
        ctx.handle = handle
        x = x.contiguous()
        out = x.new_empty((sum(output_splits), *x.shape[1:]))
        handle.keep = [x]
        handle.work = dist.all_to_all_single(out, x, output_splits, input_splits, group=group,
                                             async_op=True)
        return out

    @staticmethod
    def backward(ctx, g):
        handle = ctx.handle
        handle.backward_work.wait()
        grad_input, handle.grad_input, handle.keep = handle.grad_input, None, []
        return grad_input, None, None, None, None


class _AllToAllWait(torch.autograd.Function):
    @staticmethod
    def forward(ctx, out, output_splits, input_splits, group, handle):
        handle.work.wait()
        handle.keep = []
        ctx.splits, ctx.group, ctx.handle = (output_splits, input_splits), group, handle
        return out.view_as(out)

    @staticmethod
    def backward(ctx, g):
        output_splits, input_splits = ctx.splits
        g = g.contiguous()
        grad_in = g.new_empty((sum(input_splits), *g.shape[1:]))
        ctx.handle.keep = [g]
        ctx.handle.grad_input = grad_in
        ctx.handle.backward_work = dist.all_to_all_single(
            grad_in, g, input_splits, output_splits, group=ctx.group, async_op=True)
        return g, None, None, None, None  # unused by the start's backward (it takes grad_in)


def all_to_all_start(x: torch.Tensor, output_splits: list[int], input_splits: list[int],
                     group: Group, handle: AsyncHandle) -> torch.Tensor:
    """Asynchronous all_to_all_uneven: the result may be read only after
    all_to_all_wait(result, ...). Its gradient exchange is asynchronous too (launched by
    the wait's backward, awaited by the start's backward), so compute scheduled between the
    two overlaps with it in both directions. Ranks must issue starts in the same order."""
    return _AllToAllStart.apply(x, list(output_splits), list(input_splits), group, handle)


def all_to_all_wait(out: torch.Tensor, output_splits: list[int], input_splits: list[int],
                    group: Group, handle: AsyncHandle) -> torch.Tensor:
    return _AllToAllWait.apply(out, list(output_splits), list(input_splits), group, handle)

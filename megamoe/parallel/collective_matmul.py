"""Collective matmul: the sequence-parallel linears' all-gather and reduce-scatter
overlapped with their GEMMs (Megatron-LM's --tp-comm-overlap, built portably with
torch.distributed instead of Transformer Engine's userbuffers; docs/tp-comm-overlap.md).

Two rings over the TP group, both made of one `batch_isend_irecv` per step in which every
rank posts [send to the next rank, receive from the previous one] in that order. Every rank
issues the same steps in the same order, so NCCL, which ignores tags and matches a pair's
point-to-point operations by issue order, pairs them right (tests/parallel/
test_collective_matmul.py records the programs and checks them as test_p2p_order does).

* all_gather_matmul: rank r holds sequence chunk r. At step k it multiplies the chunk it
  holds, (r - k) mod n, into those rows of the output while passing that chunk on and
  receiving chunk (r - k - 1) mod n. The gathered input is assembled in passing.
* matmul_reduce_scatter: the partial sum for chunk d starts on rank d + 1 and travels the
  ring, each rank adding its own GEMM of chunk d, until it ends on rank d. The GEMM of the
  next chunk runs while the previous partial sum is in flight. The additions happen in
  ring order, not in the reduce-scatter's order: equal to rounding only.

`ColumnSP` / `RowSP` are the two layers' autograd functions on top of them; which
communication overlaps which GEMM, forward and backward, is chosen by TPCommOverlap
(config/tp_comm_overlap.py).
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F

from megamoe.config.tp_comm_overlap import TPCommOverlap
from megamoe.parallel.comm import Group, group_rank, group_size

# torch >= 2.10 names (gloo implements both); older torch: the *_tensor spellings.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
Gemm = Callable[[torch.Tensor], torch.Tensor]
_Works = list


def _peers(group: Group) -> tuple[int, int]:
    """Global ranks of the next and the previous rank of the ring."""
    n, r = group_size(group), group_rank(group)
    return dist.get_global_rank(group, (r + 1) % n), dist.get_global_rank(group, (r - 1) % n)


def _exchange(send: torch.Tensor, recv: torch.Tensor, peers: tuple[int, int],
              group: Group) -> _Works:
    """One ring step: send to the next rank and receive from the previous one, posted
    together (one NCCL group: no rank waits on its send before posting its receive)."""
    return dist.batch_isend_irecv([dist.P2POp(dist.isend, send, peers[0], group),
                                   dist.P2POp(dist.irecv, recv, peers[1], group)])


def _wait(works: _Works) -> None:
    for w in works:
        w.wait()


def _chunk_rows(total: int, n: int) -> int:
    if total % n:
        raise ValueError(f"sequence length {total} is not divisible by the tensor-parallel "
                         f"size {n} (sequence parallelism)")
    return total // n


def all_gather_matmul(x_shard: torch.Tensor, gemm: Gemm, group: Group
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """(gemm(all-gather(x_shard)), all-gather(x_shard)) along dim 0, the gather
    pipelined with the GEMM chunk by chunk (module docstring)."""
    n, r = group_size(group), group_rank(group)
    s = x_shard.shape[0]
    x_full = x_shard.new_empty((n * s, *x_shard.shape[1:]))
    x_full[r * s:(r + 1) * s].copy_(x_shard)
    peers = _peers(group) if n > 1 else (0, 0)
    y_full: Optional[torch.Tensor] = None
    for k in range(n):
        c, nxt = (r - k) % n, (r - k - 1) % n
        works = (_exchange(x_full[c * s:(c + 1) * s], x_full[nxt * s:(nxt + 1) * s], peers,
                           group) if k < n - 1 else [])
        y_c = gemm(x_full[c * s:(c + 1) * s])
        if y_full is None:
            y_full = y_c.new_empty((n * s, *y_c.shape[1:]))
        y_full[c * s:(c + 1) * s] = y_c
        _wait(works)
    return y_full, x_full


def matmul_reduce_scatter(x_full: torch.Tensor, gemm: Gemm, group: Group) -> torch.Tensor:
    """reduce-scatter(gemm(x_full)) along dim 0, each chunk's GEMM overlapping the previous
    partial sum's transfer (module docstring)."""
    n, r = group_size(group), group_rank(group)
    chunks = x_full.split(_chunk_rows(x_full.shape[0], n))
    peers = _peers(group) if n > 1 else (0, 0)
    works: _Works = []
    sending = received = None
    for k in range(n):
        partial = gemm(chunks[(r - k - 1) % n])
        if k > 0:
            _wait(works)
            partial = partial + received  # (the chunk's sum so far, from the previous rank)
        if k == n - 1:
            return partial
        sending, received = partial.contiguous(), torch.empty_like(partial)
        works = _exchange(sending, received, peers, group)  # `sending` alive until waited
    raise AssertionError("unreachable")


def _all_gather(x: torch.Tensor, group: Group, async_op: bool = False):
    out = x.new_empty((group_size(group) * x.shape[0], *x.shape[1:]))
    work = _all_gather_single(out, x.contiguous(), group=group, async_op=async_op)
    return (out, work) if async_op else out


def _reduce_scatter(x: torch.Tensor, group: Group, async_op: bool = False):
    n = group_size(group)
    out = x.new_empty((_chunk_rows(x.shape[0], n), *x.shape[1:]))
    work = _reduce_scatter_single(out, x.contiguous(), group=group, async_op=async_op)
    return (out, work) if async_op else out


def _wgrad(grad_y: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """dW = grad_y^T x over every leading (token) dimension."""
    return grad_y.flatten(0, -2).t().mm(x.flatten(0, -2))


class ColumnSP(torch.autograd.Function):
    """y_local = all-gather(x_shard) @ W_local^T (+ b_local), sequence parallel.

    Forward: the all-gather pipelined with the GEMM (`ag`). Saves only the sequence shard,
    as Megatron does. Backward: the re-gather of the input for the weight gradient in
    flight during the dgrad GEMM (`bulk_wgrad`); the input gradient's reduce-scatter
    either pipelined with the dgrad GEMM (`rs_dgrad`) or in flight during the
    weight-gradient GEMM (`bulk_dgrad`)."""

    @staticmethod
    def forward(ctx, x_shard, weight, bias, group, cfg: TPCommOverlap):
        def gemm(x):
            return F.linear(x, weight, bias)

        if cfg.ag:
            y, _ = all_gather_matmul(x_shard, gemm, group)
        else:
            y = gemm(_all_gather(x_shard, group))
        ctx.save_for_backward(x_shard, weight)
        ctx.group, ctx.cfg, ctx.has_bias = group, cfg, bias is not None
        return y

    @staticmethod
    def backward(ctx, grad_y):
        x_shard, weight = ctx.saved_tensors
        group, cfg = ctx.group, ctx.cfg
        grad_y = grad_y.contiguous()
        if cfg.bulk_wgrad:
            x_full, gather = _all_gather(x_shard, group, async_op=True)
        scatter = None
        if cfg.rs_dgrad:
            grad_x = matmul_reduce_scatter(grad_y, lambda g: g.matmul(weight), group)
        elif cfg.bulk_dgrad:
            grad_x, scatter = _reduce_scatter(grad_y.matmul(weight), group, async_op=True)
        else:
            grad_x = _reduce_scatter(grad_y.matmul(weight), group)
        if cfg.bulk_wgrad:
            gather.wait()
        else:
            x_full = _all_gather(x_shard, group)
        grad_w = _wgrad(grad_y, x_full)
        grad_b = grad_y.flatten(0, -2).sum(0) if ctx.has_bias else None
        if scatter is not None:
            scatter.wait()
        return grad_x, grad_w, grad_b, None, None


class RowSP(torch.autograd.Function):
    """y_shard = reduce-scatter(x_local @ W_local^T), sequence parallel (no bias: the
    replicated bias is added after, by the layer).

    Forward: the reduce-scatter pipelined with the GEMM (`rs`). Backward: the output
    gradient's all-gather pipelined with the dgrad GEMM (`ag`); the gathered gradient then
    gives the weight gradient."""

    @staticmethod
    def forward(ctx, x, weight, group, cfg: TPCommOverlap):
        def gemm(a):
            return F.linear(a, weight)

        y = (matmul_reduce_scatter(x, gemm, group) if cfg.rs
             else _reduce_scatter(gemm(x), group))
        ctx.save_for_backward(x, weight)
        ctx.group, ctx.cfg = group, cfg
        return y

    @staticmethod
    def backward(ctx, grad_y_shard):
        x, weight = ctx.saved_tensors
        group, cfg = ctx.group, ctx.cfg

        def gemm(g):
            return g.matmul(weight)

        if cfg.ag:
            grad_x, grad_y = all_gather_matmul(grad_y_shard.contiguous(), gemm, group)
        else:
            grad_y = _all_gather(grad_y_shard, group)
            grad_x = gemm(grad_y)
        return grad_x, _wgrad(grad_y, x), None, None

"""Tensor-parallel layers and collectives vs the dense layers, forward and gradients, on 2
gloo ranks (one spawn runs every check to keep the suite fast, --tp-comm-overlap's
collective matmul layers included: tests/parallel/test_collective_matmul.py)."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from megamoe.parallel.comm import (
    copy_to_tp,
    gather_from_sequence,
    reduce_from_tp,
    reduce_scatter_to_sequence,
    scatter_to_sequence,
)
from megamoe.parallel.linear import Embedding, Linear
from megamoe.parallel.tensor_parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    TensorParallel,
    VocabParallelEmbedding,
    shard_rows,
    vocab_parallel_cross_entropy,
)
from tests.distributed import run_distributed

TOL = dict(rtol=1e-5, atol=1e-6)


def _close(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    torch.testing.assert_close(a, b, **TOL, msg=lambda m: f"{what}: {m}")


def _column(tp: TensorParallel, r: int, n: int) -> None:
    s, b, h, blocks = 4, 3, 8, (8, 4, 4)  # q/k/v-like blocks
    torch.manual_seed(0)
    dense = Linear(h, sum(blocks), bias=True, init_std=0.1)
    torch.manual_seed(0)
    col = ColumnParallelLinear(h, sum(blocks), bias=True, init_std=0.1, tp=tp, blocks=blocks)
    _close(col.weight, shard_rows(dense.weight, blocks, n, r), "column init is a slice")
    with torch.no_grad():
        dense.bias.normal_()
        col.bias.copy_(shard_rows(dense.bias, blocks, n, r))
    x = torch.randn(s, b, h, generator=torch.Generator().manual_seed(1))
    grad_y = torch.randn(s, b, sum(blocks), generator=torch.Generator().manual_seed(2))
    xd = x.clone().requires_grad_(True)
    (dense(xd) * grad_y).sum().backward()
    x_in = x.chunk(n)[r] if tp.sp else x
    xl = x_in.clone().requires_grad_(True)
    y = col(xl)
    _close(y, shard_rows(dense(x).transpose(0, -1), blocks, n, r).transpose(0, -1), "column y")
    (y * shard_rows(grad_y.transpose(0, -1), blocks, n, r).transpose(0, -1)).sum().backward()
    _close(xl.grad, xd.grad.chunk(n)[r] if tp.sp else xd.grad, "column dx")
    _close(col.weight.grad, shard_rows(dense.weight.grad, blocks, n, r), "column dW")
    _close(col.bias.grad, shard_rows(dense.bias.grad, blocks, n, r), "column db")


def _row(tp: TensorParallel, r: int, n: int) -> None:
    s, b, f, h = 4, 3, 6, 5
    torch.manual_seed(0)
    dense = Linear(f, h, bias=True, init_std=0.1)
    torch.manual_seed(0)
    row = RowParallelLinear(f, h, bias=True, init_std=0.1, tp=tp)
    _close(row.weight, dense.weight.chunk(n, dim=1)[r], "row init is a slice")
    x = torch.randn(s, b, f, generator=torch.Generator().manual_seed(1))
    grad_y = torch.randn(s, b, h, generator=torch.Generator().manual_seed(2))
    xd = x.clone().requires_grad_(True)
    (dense(xd) * grad_y).sum().backward()
    xl = x.chunk(n, dim=-1)[r].clone().requires_grad_(True)
    y = row(xl)
    g = grad_y.chunk(n)[r] if tp.sp else grad_y
    _close(y, dense(x).chunk(n)[r] if tp.sp else dense(x), "row y")
    (y * g).sum().backward()
    _close(xl.grad, xd.grad.chunk(n, dim=-1)[r], "row dx")
    _close(row.weight.grad, dense.weight.grad.chunk(n, dim=1)[r], "row dW")
    bias_grad = row.bias.grad.clone()
    if tp.sp:  # replicated bias fed by a sequence shard: partial, summed over TP
        assert row.bias.sequence_parallel
        dist.all_reduce(bias_grad, group=tp.group)
    _close(bias_grad, dense.bias.grad, "row db")


def _embedding(tp: TensorParallel, r: int, n: int) -> None:
    torch.manual_seed(3)
    dense = Embedding(16, 4, init_std=1.0)
    torch.manual_seed(3)
    emb = VocabParallelEmbedding(16, 4, init_std=1.0, tp=tp)
    _close(emb.weight, dense.weight.chunk(n)[r], "embedding init is a slice")
    ids = torch.tensor([[0, 15, 7, 8], [9, 3, 3, 12]])
    grad_y = torch.randn(2, 4, 4, generator=torch.Generator().manual_seed(4))
    (dense(ids) * grad_y).sum().backward()
    y = reduce_from_tp(emb(ids), tp.group)
    _close(y, dense(ids), "embedding y")
    (y * grad_y).sum().backward()
    _close(emb.weight.grad, dense.weight.grad.chunk(n)[r], "embedding dW")


def _cross_entropy(tp: TensorParallel, r: int, n: int) -> None:
    vocab, padded = 13, 16  # rank 0 owns 8 real rows, rank 1 only 5 (3 padded rows)
    logits = torch.randn(3, 5, vocab, generator=torch.Generator().manual_seed(5)) * 3
    target = torch.randint(0, vocab, (3, 5), generator=torch.Generator().manual_seed(6))
    grad_loss = torch.rand(3, 5, generator=torch.Generator().manual_seed(7))
    ld = logits.clone().requires_grad_(True)
    ref = F.cross_entropy(ld.reshape(-1, vocab), target.reshape(-1), reduction="none")
    (ref * grad_loss.reshape(-1)).sum().backward()
    per = padded // n
    start = r * per
    local = logits[..., start:min(start + per, vocab)].clone().requires_grad_(True)
    loss = vocab_parallel_cross_entropy(local, target, start, tp.group)
    _close(loss, ref.view(3, 5), "vocab-parallel loss")
    (loss * grad_loss).sum().backward()
    _close(local.grad, ld.grad[..., start:start + per], "vocab-parallel dlogits")


def _collectives(tp: TensorParallel, r: int, n: int) -> None:
    x = torch.arange(24.0).view(4, 3, 2) + 100 * r  # differs per rank
    xl = x.clone().requires_grad_(True)
    y = gather_from_sequence(xl, tp.group)
    assert y.shape == (4 * n, 3, 2)
    y.sum().backward()  # reduce-scatter of the ones from every rank
    _close(xl.grad, torch.full_like(x, float(n)), "gather backward reduce-scatters")
    xl.grad = None
    gather_from_sequence(xl, tp.group, reduce_grad=False).sum().backward()
    _close(xl.grad, torch.ones_like(x), "gather backward splits")
    full = torch.arange(8.0).view(8, 1).requires_grad_(True)
    part = scatter_to_sequence(full, tp.group)
    _close(part, full.detach().chunk(n)[r], "scatter")
    part.sum().backward()
    _close(full.grad, torch.ones(8, 1), "scatter backward all-gathers")
    z = torch.ones(4, 2, requires_grad=True)
    out = reduce_scatter_to_sequence(z * (r + 1), tp.group)
    _close(out, torch.full((4 // n, 2), float(sum(range(1, n + 1)))), "reduce-scatter")
    c = torch.ones(3, requires_grad=True)
    (copy_to_tp(c, tp.group) * (r + 1)).sum().backward()
    _close(c.grad, torch.full((3,), float(sum(range(1, n + 1)))), "copy backward all-reduces")


def _layers_worker(rank: int, world_size: int) -> None:
    from tests.parallel.test_collective_matmul import overlap_checks  # (it imports this file)

    torch.set_default_dtype(torch.float32)
    group = dist.group.WORLD
    for sp in (False, True):
        tp = TensorParallel(group, sequence_parallel=sp)
        _column(tp, rank, world_size)
        _row(tp, rank, world_size)
    tp = TensorParallel(group)
    _embedding(tp, rank, world_size)
    _cross_entropy(tp, rank, world_size)
    _collectives(tp, rank, world_size)
    overlap_checks(rank, world_size)  # --tp-comm-overlap's layers (test_collective_matmul.py)


def test_parallel_layers_match_dense_forward_and_backward():
    run_distributed(_layers_worker, 2, 90)


def test_single_rank_layers_equal_the_dense_layers():
    torch.manual_seed(0)
    dense = Linear(6, 10, bias=True, init_std=0.02)
    torch.manual_seed(0)
    col = ColumnParallelLinear(6, 10, bias=True, init_std=0.02, blocks=(6, 4))
    assert torch.equal(col.weight, dense.weight)
    x = torch.randn(2, 6)
    assert torch.equal(col(x), dense(x))
    assert torch.equal(scatter_to_sequence(x, None), x)
    logits = torch.randn(5, 7)
    t = torch.randint(0, 7, (5,))
    torch.testing.assert_close(vocab_parallel_cross_entropy(logits, t, 0, None),
                               F.cross_entropy(logits, t, reduction="none"))

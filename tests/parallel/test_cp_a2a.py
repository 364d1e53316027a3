"""`--cp-comm-type a2a` (megamoe/parallel/cp_a2a.py) equals full attention, forward and
backward, on gloo ranks: each rank gives its load-balanced chunks of the same q/k/v and
must get those chunks of the single-process output and gradients. Also: joining every
rank's parts inverts the split, and heads that do not split over CP are refused."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from megamoe.parallel.cp_a2a import a2a_attention, a2a_bytes_per_layer
from megamoe.parallel.cp_layout import join_from_cp, split_for_cp
from tests.distributed import run_distributed
from tests.parallel.test_cp_attention import _inputs

S = 32


def _reference(q, k, v, dout, ids, scale):
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    mask = torch.ones(S, S, dtype=torch.bool).tril()
    if ids is not None:
        mask = (mask & (ids[:, :, None] == ids[:, None]))[:, None]
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True,
                                         scale=scale)
    out.backward(dout)
    return out.detach(), q.grad, k.grad, v.grad


def _worker(rank, world_size, docs, v_dim, gqa):
    q, k, v, _, ids = _inputs()
    if not gqa:  # as many k/v heads as query heads
        k, v = k.repeat_interleave(2, dim=1), v.repeat_interleave(2, dim=1)
    g = torch.Generator().manual_seed(1)
    v = torch.randn(*v.shape[:3], v_dim, generator=g, dtype=v.dtype)  # V narrower (MLA)
    dout = torch.randn(*q.shape[:3], v_dim, generator=g, dtype=q.dtype)
    ids = ids if docs else None
    scale = 0.3
    ref = _reference(q, k, v, dout, ids, scale)
    local = [split_for_cp(t, rank, world_size, dim=2).clone().requires_grad_()
             for t in (q, k, v)]
    ids_local = None if ids is None else split_for_cp(ids, rank, world_size, dim=1)
    out = a2a_attention(*local, dist.group.WORLD, ids_local, scale=scale)
    out.backward(split_for_cp(dout, rank, world_size, dim=2))
    got = (out.detach(), *(t.grad for t in local))
    want = [split_for_cp(t, rank, world_size, dim=2) for t in ref]
    return [float((a - b).abs().max()) for a, b in zip(got, want)]


@pytest.mark.slow  # (the default set's CP2 a2a training parity covers the op)
@pytest.mark.parametrize("cp, docs, v_dim, gqa", [
    (2, True, 5, True), (2, False, 8, True), (4, True, 8, False)])
def test_a2a_attention_equals_full_attention(cp, docs, v_dim, gqa):
    for errs in run_distributed(_worker, cp, 120, docs, v_dim, gqa):
        assert max(errs) < 1e-12, errs


@pytest.mark.parametrize("cp", [1, 2, 4])
def test_join_from_cp_inverts_split_for_cp(cp):
    """The a2a op gathers every rank's parts back into sequence order with join_from_cp."""
    x = torch.arange(2 * 3 * S).view(2, 3, S)
    parts = [split_for_cp(x, r, cp, dim=2) for r in range(cp)]
    assert torch.equal(join_from_cp(parts, dim=2), x)


def _refusal_worker(rank, world_size):
    q = torch.zeros(1, 3, 4, 2)
    k = torch.zeros(1, 1, 4, 2)
    try:
        a2a_attention(q, k, k, dist.group.WORLD)
    except ValueError as e:
        return str(e)
    return None


@pytest.mark.slow  # (the flags refuse such a layout first: test_pretrain_context_parallel.py)
def test_heads_that_do_not_split_over_cp_are_refused():
    for msg in run_distributed(_refusal_worker, 2, 60):
        assert msg is not None and "multiples of --context-parallel-size (2)" in msg


def _count_a2a_bytes(rank, world_size, v_dim):
    """Bytes this rank's all-to-alls send to other ranks for one forward + backward (fp32),
    with V's head dim `v_dim` (K's is D), G = N / 2 K/V heads."""
    from megamoe.parallel import comm

    sent = []
    exchange = comm._all_to_all  # (the differentiable all-to-all's forward and backward)

    def counting(x, output_splits, input_splits, group):
        row = x[0].numel() * x.element_size()
        sent.append(sum(n for r, n in enumerate(input_splits) if r != rank) * row)
        return exchange(x, output_splits, input_splits, group)

    comm._all_to_all = counting
    q, k, v, dout, _ = _inputs()
    v, dout = v[..., :1].expand(-1, -1, -1, v_dim), dout[..., :1].expand(-1, -1, -1, v_dim)
    local = [split_for_cp(t.float(), rank, world_size, dim=2).requires_grad_()
             for t in (q, k, v)]
    out = a2a_attention(*local, dist.group.WORLD)
    out.backward(split_for_cp(dout.float(), rank, world_size, dim=2))
    return sum(sent)


@pytest.mark.slow  # (default-set budget: a representative case stays)
def test_planner_a2a_volume_is_what_the_all_to_alls_send():
    """The planner's CP cost for a2a layouts (a2a_bytes_per_layer) equals the bytes the
    op's all-to-alls send per rank for one forward and backward, V narrower than K."""
    from tests.parallel.test_cp_attention import B, D, G, N

    predicted = a2a_bytes_per_layer(N, G, D, 3, B * S / 2, 2, dtype_bytes=4)
    for sent in run_distributed(_count_a2a_bytes, 2, 120, 3):
        assert sent == predicted, (sent, predicted)

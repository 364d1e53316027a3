"""Context-parallel attention (megamoe/parallel/context_parallel.py) equals full attention,
forward and backward, on gloo ranks: CP = 2 and 4, p2p ring and allgather, causal and
document masks, GQA. Each rank gets its load-balanced chunks (r, 2CP-1-r) of the same
full-sequence q/k/v; its output and its q/k/v gradients must equal those chunks of the
single-process result."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d
import torch.nn.functional as F
from torch.testing._internal.distributed.fake_pg import FakeStore

from megamoe.parallel.context_parallel import (
    cp_attention,
    parse_cp_comm_type,
    ring_bytes_per_layer,
)
from megamoe.parallel.cp_layout import split_for_cp
from tests.distributed import run_distributed
from tests.training.test_p2p_order import Recorder, assert_mirrored, simulate

B, N, G, S, D = 2, 4, 2, 32, 8


def _inputs(k_dim: int = D, v_dim: int = D, seed: int = 0):
    """q, k [.., k_dim], v, dout [.., v_dim] (fp64) and two packings' document ids."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, N, S, k_dim, generator=g, dtype=torch.float64)
    k = torch.randn(B, G, S, k_dim, generator=g, dtype=torch.float64)
    v = torch.randn(B, G, S, v_dim, generator=g, dtype=torch.float64)
    dout = torch.randn(B, N, S, v_dim, generator=g, dtype=torch.float64)
    lengths = [5, 9, 1, 11, 6]  # packed documents (not aligned to chunks)
    ids = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)])
    ids = torch.stack([ids, torch.roll(ids, 3).cummax(0).values])  # two different packings
    return q, k, v, dout, ids


def _reference(q, k, v, dout, ids):
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    if ids is None:
        mask = torch.ones(S, S, dtype=torch.bool).tril()
    else:
        mask = torch.ones(S, S, dtype=torch.bool).tril() & (ids[:, :, None] == ids[:, None])
        mask = mask[:, None]
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    out.backward(dout)
    return out.detach(), q.grad, k.grad, v.grad


def _worker(rank, world_size, comm_type, docs):
    q, k, v, dout, ids = _inputs()
    ids = ids if docs else None
    ref = _reference(q, k, v, dout, ids)
    group = dist.new_group(list(range(world_size)))
    local = [split_for_cp(t, rank, world_size, dim=2) for t in (q, k, v)]
    local = [t.clone().requires_grad_() for t in local]
    ids_local = None if ids is None else split_for_cp(ids, rank, world_size, dim=1)
    out = cp_attention(*local, group, comm_type, ids_local)
    out.backward(split_for_cp(dout, rank, world_size, dim=2))
    got = (out.detach(), *(t.grad for t in local))
    want = [split_for_cp(t, rank, world_size, dim=2) for t in ref]
    return [float((a - b).abs().max()) for a, b in zip(got, want)]


@pytest.mark.parametrize("cp,comm_type,docs", [
    pytest.param(2, "p2p", False, marks=pytest.mark.slow), (2, "p2p", True),
    pytest.param(4, "allgather", True, marks=pytest.mark.slow),
    pytest.param(4, "p2p", True, marks=pytest.mark.slow),
    pytest.param(4, "p2p", False, marks=pytest.mark.slow),
    pytest.param(2, "allgather", False, marks=pytest.mark.slow),
])
def test_cp_attention_equals_full_attention(cp, comm_type, docs):
    for errs in run_distributed(_worker, cp, 120, comm_type, docs):
        assert max(errs) < 1e-12, errs


DK, DV, SCALE = 12, 6, 0.37  # MLA-shaped: K wider than V (qk + pe vs v), own scale


def _plain_reference(q, k, v, dout, ids):
    """softmax(q k^T * SCALE, document-causal) v written out, and its q/k/v gradients."""
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    mask = torch.ones(S, S, dtype=torch.bool).tril() & (ids[:, :, None] == ids[:, None])
    rep = N // G
    s = q @ k.repeat_interleave(rep, 1).transpose(-1, -2) * SCALE
    p = torch.softmax(s.masked_fill(~mask[:, None], float("-inf")), dim=-1)
    out = p @ v.repeat_interleave(rep, 1)
    out.backward(dout)
    return out.detach(), q.grad, k.grad, v.grad


def _mla_worker(rank, world_size, comm_type):
    q, k, v, dout, ids = _inputs(DK, DV, seed=1)
    ref = _plain_reference(q, k, v, dout, ids)
    group = dist.new_group(list(range(world_size)))
    local = [split_for_cp(t, rank, world_size, dim=2).clone().requires_grad_()
             for t in (q, k, v)]
    out = cp_attention(*local, group, comm_type, split_for_cp(ids, rank, world_size, 1),
                       scale=SCALE)
    out.backward(split_for_cp(dout, rank, world_size, dim=2))
    got = (out.detach(), *(t.grad for t in local))
    want = [split_for_cp(t, rank, world_size, dim=2) for t in ref]
    assert [tuple(t.shape) for t in got] == [tuple(t.shape) for t in want]
    return [float((a - b).abs().max()) for a, b in zip(got, want)]


@pytest.mark.parametrize("cp,comm_type", [
    (2, "p2p"), pytest.param(2, "allgather", marks=pytest.mark.slow),
    pytest.param(4, "p2p", marks=pytest.mark.slow),
    pytest.param(4, "allgather", marks=pytest.mark.slow),
])
def test_cp_attention_with_wider_keys_than_values(cp, comm_type):
    """MLA's shape: K head dim (qk + pe) != V head dim, a softmax scale of its own, GQA
    and documents; the output has V's head dim and it and the q/k/v gradients equal the
    written-out attention's."""
    for errs in run_distributed(_mla_worker, cp, 120, comm_type):
        assert max(errs) < 1e-12, errs


def test_cp_comm_type_parsing():
    assert parse_cp_comm_type(["p2p"], 3) == ["p2p"] * 3
    assert parse_cp_comm_type(["p2p", "allgather"], 2) == ["p2p", "allgather"]
    assert parse_cp_comm_type(["a2a"], 2) == ["a2a"] * 2
    with pytest.raises(ValueError, match="not supported yet: --cp-comm-type a2a\\+p2p"):
        parse_cp_comm_type(["p2p", "a2a+p2p"], 2)
    with pytest.raises(ValueError, match="one value or one per layer"):
        parse_cp_comm_type(["p2p", "p2p"], 3)


@pytest.mark.parametrize("cp", [2, 4])
def test_ring_p2p_is_ordered_for_nccl(cp):
    """The ring's posts (forward and backward) checked like the pipeline schedule's
    (tests/training/test_p2p_order.py): for every rank pair the sends of one are the
    receives of the other in the same order and shapes, and NCCL's strictest progress
    (each send waits for its receive) reaches the end on every rank."""
    rec = Recorder()
    with pytest.MonkeyPatch.context() as mp:
        for module in (dist, c10d):
            for name in ("batch_isend_irecv", "isend", "irecv", "send", "recv"):
                mp.setattr(module, name, getattr(rec, name))
        for rank in range(cp):
            dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=cp)
            try:
                rec.rank, rec.param = rank, (torch.float32, torch.device("cpu"))
                rec.programs[rank] = []
                q, k, v, dout, ids = _inputs()
                local = [split_for_cp(t.float(), rank, cp, dim=2).requires_grad_()
                         for t in (q, k, v)]
                with torch.device("meta"):  # a buffer allocated without device= lands here
                    out = cp_attention(*local, dist.group.WORLD, "p2p",
                                       split_for_cp(ids, rank, cp, dim=1))
                    out.backward(torch.ones_like(out, device="cpu"))
            finally:
                dist.destroy_process_group()
    assert all(rec.programs.values())
    assert_mirrored(rec.programs)
    simulate(rec.programs)


def _count_ring_bytes(rank, world_size, v_dim):
    """Bytes this rank's ring sends for one forward + backward (fp32 model dtype), with
    V's head dim `v_dim` (K's is D)."""
    from megamoe.parallel import context_parallel as cpmod

    sent = []
    start = cpmod._Ring.start

    def counting(self, t):
        sent.append(t.numel() * t.element_size())
        return start(self, t)

    cpmod._Ring.start = counting
    q, k, v, dout, ids = _inputs()
    v, dout = v[..., :1].expand(-1, -1, -1, v_dim), dout[..., :1].expand(-1, -1, -1, v_dim)
    local = [split_for_cp(t.float(), rank, world_size, dim=2).requires_grad_()
             for t in (q, k, v)]
    out = cp_attention(*local, dist.new_group(list(range(world_size))), "p2p")
    out.backward(split_for_cp(dout.float(), rank, world_size, dim=2))
    return sum(sent)


@pytest.mark.parametrize("cp,v_dim", [  # (V narrower than K covers the equal case's sizes)
    (2, 3), pytest.param(2, D, marks=pytest.mark.slow),
    pytest.param(4, D, marks=pytest.mark.slow), pytest.param(4, 3, marks=pytest.mark.slow)])
@pytest.mark.slow  # (default-set budget: a representative case stays)
def test_planner_ring_volume_is_what_the_ring_sends(cp, v_dim):
    """The planner's CP cost (ring_bytes_per_layer) equals the bytes the real ring sends
    per rank for one layer's forward and backward, also when V's head dim is not K's
    (MLA: K and V travel in one buffer at their own widths, no padding)."""
    predicted = ring_bytes_per_layer(G, D, B * S / cp, cp, dtype_bytes=4, v_channels=v_dim)
    for sent in run_distributed(_count_ring_bytes, cp, 120, v_dim):
        assert sent == predicted, (sent, predicted)


def test_planner_counts_mla_keys_and_values():
    """The planner's CP cost of an MLA model: every head's K at qk + pe and V at v."""
    from megamoe.config import ModelConfig
    from megamoe.planning.planner import _cp_kv_dims

    mla = ModelConfig(num_layers=2, hidden_size=64, num_attention_heads=8,
                      multi_latent_attention=True, kv_lora_rank=16, qk_head_dim=24,
                      qk_pos_emb_head_dim=8, v_head_dim=16)
    assert _cp_kv_dims(mla) == (8, 32, 16)
    gqa = ModelConfig(num_layers=2, hidden_size=64, num_attention_heads=8,
                      num_query_groups=2)
    assert _cp_kv_dims(gqa) == (2, 8, 8)


def _dropout_worker(rank, world_size, comm_type):
    """CP attention with dropout; returns this rank's output, q/k/v gradients and the keep
    masks of its blocks (by source rank) as the forward drew them."""
    import megamoe.parallel.context_parallel as cp_module

    q, k, v, dout, ids = _inputs()
    group = dist.new_group(list(range(world_size)))
    local = [split_for_cp(t, rank, world_size, dim=2).clone().requires_grad_()
             for t in (q, k, v)]
    drawn = []
    original = cp_module._Dropout.forward_keep

    def spy(self, shape, device, dtype):
        keep = original(self, shape, device, dtype)
        drawn.append(keep.clone())
        return keep

    cp_module._Dropout.forward_keep = spy
    try:
        torch.manual_seed(100 + rank)
        out = cp_attention(*local, group, comm_type, split_for_cp(ids, rank, world_size, 1),
                           dropout_p=0.3)
    finally:
        cp_module._Dropout.forward_keep = original
    torch.rand(7)  # the backward must redraw from the noted states, not the current one
    out.backward(split_for_cp(dout, rank, world_size, dim=2))
    keeps = {(rank - i) % world_size: m for i, m in enumerate(drawn)}
    return [t.numpy() for t in (out.detach(), *(t.grad for t in local))], {
        src: m.numpy() for src, m in keeps.items()}


@pytest.mark.parametrize("cp,comm_type", [
    (2, "p2p"), pytest.param(4, "allgather", marks=pytest.mark.slow)])
def test_cp_attention_dropout_equals_full_attention_with_the_same_masks(cp, comm_type):
    """Each block's dropout is the full attention's dropout restricted to that block: with
    the keep masks the ranks drew assembled into one [S, S] mask, the reference
    softmax(scores) * keep @ V and its gradients equal what the ranks computed (the
    backward redrew the masks from the generator states it noted)."""
    from megamoe.parallel.cp_layout import cp_positions

    results = run_distributed(_dropout_worker, cp, 120, comm_type)
    q, k, v, dout, ids = _inputs()
    keep = torch.zeros(B, N, S, S, dtype=torch.float64)
    for r, (_, keeps) in enumerate(results):
        rows = cp_positions(S // cp, r, cp, "cpu")
        for src, m in keeps.items():
            cols = cp_positions(S // cp, src, cp, "cpu")
            keep[:, :, rows[:, None], cols[None, :]] = torch.as_tensor(m)
    assert 0.5 < float((keep > 0).double().mean()) < 0.9  # about 1 - p kept
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    mask = (torch.ones(S, S, dtype=torch.bool).tril() & (ids[:, :, None] == ids[:, None]))
    rep = N // G
    s = q @ k.repeat_interleave(rep, 1).transpose(-1, -2) / D ** 0.5
    p = torch.softmax(s.masked_fill(~mask[:, None], float("-inf")), dim=-1)
    out = (p * keep) @ v.repeat_interleave(rep, 1)
    out.backward(dout)
    for r, (got, _) in enumerate(results):
        want = [split_for_cp(t, r, cp, dim=2) for t in (out.detach(), q.grad, k.grad, v.grad)]
        for a, b in zip(got, want):
            assert (torch.as_tensor(a) - b).abs().max() < 1e-12, r

"""Expert-parallel token dispatchers == a naive per-token loop over all experts of one
process, forward and backward, on gloo ranks; including forced routings where a rank sends
no token to some rank and experts receive nothing."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from megamoe.config import MoEConfig, MoEExecutionConfig
from megamoe.moe.dispatchers import AllGatherDispatcher, AllToAllDispatcher
from megamoe.moe.experts import GroupedExperts
from megamoe.moe.layer import MoELayer
from megamoe.moe.losses import MoELossTracker, set_aux_loss_backward_scale
from megamoe.parallelize import parallelize_moe
from tests.distributed import run_distributed

E, H, FF, T = 4, 8, 6, 6


def _experts(bias: bool) -> GroupedExperts:
    torch.manual_seed(0)
    ex = GroupedExperts(E, H, FF, swiglu=True, add_bias=bias, init_method_std=0.3,
                        output_init_std=0.3, grouped_gemm=True)
    if bias:
        with torch.no_grad():
            ex.fc1_bias.normal_(0.0, 0.5)
            ex.fc2_bias.normal_(0.0, 0.5)
    return ex


def _naive(x_TH, probs_TE, map_TE, ex: GroupedExperts) -> torch.Tensor:
    out = torch.zeros_like(x_TH)
    for t in range(x_TH.shape[0]):
        for e in range(E):
            if map_TE[t, e]:
                h = x_TH[t] @ ex.fc1_weight[e]
                if ex.fc1_bias is not None:
                    h = h + ex.fc1_bias[e]
                g, u = h.chunk(2)
                y = (F.silu(g) * u) @ ex.fc2_weight[e]
                if ex.fc2_bias is not None:
                    y = y + ex.fc2_bias[e]
                out[t] = out[t] + probs_TE[t, e] * y
    return out


def _inputs(world: int, routing: str):
    """Global tokens, probs, routing map and upstream gradient for `world` ranks."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(world * T, H, generator=g)
    probs = torch.rand(world * T, E, generator=g)
    grad = torch.randn(world * T, H, generator=g)
    if routing == "random":
        top = torch.rand(world * T, E, generator=g).topk(2, dim=1).indices
        rmap = torch.zeros(world * T, E, dtype=torch.bool).scatter_(1, top, True)
    else:  # "skewed": rank 0 routes only to expert 1; the others only to the last rank's
        rmap = torch.zeros(world * T, E, dtype=torch.bool)  # experts; expert 0 gets nothing
        rmap[:T, 1] = True
        rmap[T:, E - 1] = True
        rmap[T:T + 2, E - 2] = True
    return x, probs * rmap, rmap, grad


def _dispatch_worker(rank: int, world: int, dispatcher_type: str, routing: str, bias: bool,
                     overlap: int = 1):
    full = _experts(bias)
    x, probs, rmap, grad = _inputs(world, routing)
    rows = slice(rank * T, (rank + 1) * T)
    # Reference: one process, every token, every expert.
    x_ref, p_ref = x.clone().requires_grad_(), probs.clone().requires_grad_()
    ref = _naive(x_ref, p_ref, rmap, full)
    (ref * grad).sum().backward()
    # Expert parallel: this rank's tokens, this rank's experts.
    layer_experts = copy.deepcopy(full)
    layer_experts.zero_grad()
    d = (AllToAllDispatcher(E, dist.group.WORLD, overlap) if dispatcher_type == "alltoall"
         else AllGatherDispatcher(E, dist.group.WORLD))
    n = d.num_local_experts
    with torch.no_grad():
        for name in ("fc1_weight", "fc2_weight", "fc1_bias", "fc2_bias"):
            w = getattr(layer_experts, name)
            if w is not None:
                setattr(layer_experts, name,
                        torch.nn.Parameter(w[d.local_start:d.local_start + n].clone()))
    layer_experts.num_local_experts = n
    x_loc = x[rows].clone().requires_grad_()
    p_loc = probs[rows].clone().requires_grad_()
    out = d.forward(x_loc, p_loc, rmap[rows], layer_experts)
    (out * grad[rows]).sum().backward()
    torch.testing.assert_close(out, ref[rows], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(x_loc.grad, x_ref.grad[rows], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(p_loc.grad, p_ref.grad[rows], rtol=1e-5, atol=1e-6)
    for name in ("fc1_weight", "fc2_weight", "fc1_bias", "fc2_bias"):
        w = getattr(layer_experts, name)
        if w is not None:
            ref_grad = getattr(full, name).grad[d.local_start:d.local_start + n]
            torch.testing.assert_close(w.grad, ref_grad, rtol=1e-5, atol=1e-6)
    return True


CASES = [(dtype, routing, bias) for dtype in ("alltoall", "allgather")
         for routing, bias in (("random", False), ("skewed", True))]
# --moe-a2a-overlap-degree: 2 chunks, and 4 chunks of T = 6 tokens (uneven, some chunks
# send nothing under the skewed routing).
CASES += [("alltoall", routing, True, overlap) for routing in ("random", "skewed")
          for overlap in (2, 4)]


def _cases_worker(rank: int, world: int) -> list[bool]:
    # One spawn for every case: process start-up dominates the cost of these tiny shapes.
    return ([_dispatch_worker(rank, world, *case) for case in CASES]
            + [_layer_worker(rank, world, dtype) for dtype in ("alltoall", "allgather")]
            + [_module_experts_worker(rank, world)])


def test_dispatchers_match_naive_loop():
    """Both dispatchers, random and skewed routing (rank 0 sends nothing to rank 1, expert 0
    receives nothing), with and without expert biases, on 2 ranks; then a whole MoELayer
    sharded by parallelize_moe against the single-process layer."""
    assert run_distributed(_cases_worker, 2, 120) == [[True] * (len(CASES) + 3)] * 2


@pytest.mark.slow
def test_dispatchers_match_naive_loop_four_ranks():
    # 4 experts on 4 ranks: one expert per rank; skewed routing leaves ranks idle.
    assert run_distributed(_cases_worker, 4, 180) == [[True] * (len(CASES) + 3)] * 4


def _forward_backward_both(full, ep, rank: int, world: int) -> None:
    """The whole batch through the single-process layer, this rank's rows through the
    expert-parallel one (same output gradient); outputs must agree on this rank's rows."""
    x, _, _, grad = _inputs(world, "random")
    rows = slice(rank * T, (rank + 1) * T)
    ref = full(x)
    (ref * grad).sum().backward()
    out = ep(x[rows])
    (out * grad[rows]).sum().backward()
    torch.testing.assert_close(out, ref[rows], rtol=1e-5, atol=1e-6)


def _layer_worker(rank: int, world: int, dispatcher_type: str):
    """A whole MoELayer (router, aux losses off) sharded with parallelize_moe equals
    the single-process layer on the concatenated tokens."""
    MoELossTracker.clear()
    set_aux_loss_backward_scale(1.0)
    torch.manual_seed(0)
    cfg = MoEConfig(num_experts=E, topk=2, ffn_hidden_size=FF, aux_loss_coeffs=[0.0])
    full = MoELayer(cfg, H, init_method_std=0.3, grouped_gemm=True)
    ep = parallelize_moe(copy.deepcopy(full), ep_group=dist.group.WORLD,
                         execution=MoEExecutionConfig(token_dispatcher_type=dispatcher_type))
    assert ep.experts.fc1_weight.shape[0] == E // world
    assert all(p.expert_parallel for p in ep.experts.parameters())
    _forward_backward_both(full, ep, rank, world)
    router_grad = ep.router.weight.grad.clone()
    dist.all_reduce(router_grad)  # each rank saw its own tokens
    torch.testing.assert_close(router_grad, full.router.weight.grad, rtol=1e-5, atol=1e-6)
    lo = rank * (E // world)
    torch.testing.assert_close(ep.experts.fc2_weight.grad,
                               full.experts.fc2_weight.grad[lo:lo + E // world],
                               rtol=1e-5, atol=1e-6)
    return True


def _module_experts_worker(rank: int, world: int) -> bool:
    """User-supplied expert modules (SequentialExperts) are sharded the same way."""
    MoELossTracker.clear()
    torch.manual_seed(0)
    modules = [torch.nn.Sequential(torch.nn.Linear(H, FF), torch.nn.GELU(),
                                   torch.nn.Linear(FF, H)) for _ in range(E)]
    full = MoELayer(hidden_size=H, experts=modules, topk=2, aux_loss_coeffs=[0.0])
    ep = parallelize_moe(copy.deepcopy(full), ep_group=dist.group.WORLD,
                         execution=MoEExecutionConfig(token_dispatcher_type="alltoall"))
    assert len(ep.experts.local_experts) == E // world
    _forward_backward_both(full, ep, rank, world)
    lo = rank * (E // world)
    for j, expert in enumerate(ep.experts.local_experts):
        torch.testing.assert_close(expert[0].weight.grad,
                                   full.experts.local_experts[lo + j][0].weight.grad,
                                   rtol=1e-5, atol=1e-6)
    return True

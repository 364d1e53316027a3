"""Capacity: exactly the right assignments are dropped for each policy (naive reference)."""

from __future__ import annotations

import math

import pytest
import torch

from megamoe.moe.capacity import apply_capacity, expert_capacity
from megamoe.moe.router import topk_routing


def _naive_keep(probs, rmap, capacity, policy):
    """Per expert with Python sorting: the tokens that keep their slot."""
    T, E = len(rmap), len(rmap[0])
    keep = [[False] * E for _ in range(T)]
    for e in range(E):
        routed = [t for t in range(T) if rmap[t][e]]
        if policy == "probs":
            routed = sorted(routed, key=lambda t: -probs[t][e])
        for t in routed[:capacity]:
            keep[t][e] = True
    return keep


@pytest.mark.parametrize("policy", ["probs", "position"])
@pytest.mark.parametrize("cf", [0.5, 1.0, 1.5, 0.0, -0.75])
def test_apply_capacity_matches_naive(policy, cf):
    g = torch.Generator().manual_seed(0)
    T, E, k = 40, 4, 2
    logits = torch.randn(T, E, generator=g)
    logits[:, 1] += 1.0  # expert 1 overloaded
    probs, rmap = topk_routing(logits, k)
    needed = int(rmap.sum(0).max())
    cap = expert_capacity(rmap, k, cf)
    fair = T * k / E
    want_cap = {0.5: math.ceil(0.5 * fair), 1.0: math.ceil(fair), 1.5: math.ceil(1.5 * fair),
                0.0: needed, -0.75: min(needed, math.ceil(0.75 * fair))}[cf]
    assert cap == want_cap
    kept_probs, keep = apply_capacity(probs, rmap, cap, policy)
    assert keep.tolist() == _naive_keep(probs.tolist(), rmap.tolist(), cap, policy)
    assert torch.equal(kept_probs, probs * keep)
    assert int(keep.sum(0).max()) <= cap
    if cf == 0.0:
        assert torch.equal(keep, rmap)  # Tutel's 0: no drops
    if cf == 0.5:
        assert int(keep.sum()) < int(rmap.sum())


def test_capacity_gradient_flows_to_kept_probs_only():
    """The combine weights of dropped assignments get no gradient, kept ones get exactly
    theirs. Top-1 with pre-softmax scores (Megatron refuses top-1 post-softmax: its weights
    are all 1.0, so every logit gradient would be zero whatever capacity did)."""
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(16, 4, generator=g, requires_grad=True)
    probs, rmap = topk_routing(logits, 1, pre_softmax=True)
    probs.retain_grad()
    kept, keep = apply_capacity(probs, rmap, 2, "position")
    kept.sum().backward()
    assert torch.equal(probs.grad, keep.to(probs.grad.dtype))  # 1 where kept, else 0
    dropped_tokens = (rmap & ~keep).any(1)
    assert dropped_tokens.any() and (~dropped_tokens).any()
    assert logits.grad[dropped_tokens].abs().max() == 0
    assert (logits.grad[~dropped_tokens].abs().amax(1) > 1e-3).all()  # kept: a real gradient
    with pytest.raises(ValueError, match="--moe-token-drop-policy"):
        apply_capacity(probs, rmap, 2, "random")


@pytest.mark.parametrize("policy", ["probs", "position"])
@pytest.mark.parametrize("cf", [0.5, 1.0, 0.0, -0.75])
def test_capacity_per_shard_equals_each_shard_alone(policy, cf):
    """num_shards = 2 (the TP ranks' sequence shards): one capacity for both blocks keeps
    exactly what each block would keep with its own capacity, and every block fits it."""
    g = torch.Generator().manual_seed(3)
    T, E, k = 40, 4, 2
    logits = torch.randn(T, E, generator=g)
    logits[: T // 2, 1] += 1.5  # expert 1 overloaded in the first shard only
    probs, rmap = topk_routing(logits, k)
    cap = expert_capacity(rmap, k, cf, num_shards=2)
    kept_probs, keep = apply_capacity(probs, rmap, cap, policy, num_shards=2)
    want, owns = [], []
    for half in (slice(0, T // 2), slice(T // 2, T)):
        owns.append(expert_capacity(rmap[half], k, cf))
        want += _naive_keep(probs[half].tolist(), rmap[half].tolist(), owns[-1], policy)
    assert cap == max(owns)  # the padding every block fits in, no more
    assert keep.tolist() == want
    assert torch.equal(kept_probs, probs * keep)
    if cf > 0:
        assert keep.tolist() != _naive_keep(probs.tolist(), rmap.tolist(),
                                            expert_capacity(rmap, k, cf), policy)

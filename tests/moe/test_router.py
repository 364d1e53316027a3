"""topk_routing / TopKRouter against a per-token reference written from the definitions."""

from __future__ import annotations

import math

import pytest
import torch

from megamoe.config import MoEConfig
from megamoe.moe.losses import MoELossTracker
from megamoe.moe.router import TopKRouter, topk_routing


def _ref_route(logits: list[float], k: int, score: str, pre_softmax: bool, groups, group_topk,
               scale, bias) -> dict[int, float]:
    """{expert: prob} for one token, with plain Python lists and loops."""
    E = len(logits)
    if score == "sigmoid":
        s = [1.0 / (1.0 + math.exp(-v)) for v in logits]
    elif pre_softmax:
        m = max(logits)
        z = sum(math.exp(v - m) for v in logits)
        s = [math.exp(v - m) / z for v in logits]
    else:
        s = list(logits)
    sel = [s[e] + (bias[e] if bias is not None else 0.0) for e in range(E)]
    allowed = set(range(E))
    if groups is not None:
        size = E // groups
        gscore = []
        for g in range(groups):
            members = sorted((sel[e] for e in range(g * size, (g + 1) * size)), reverse=True)
            gscore.append(sum(members[: k // group_topk]))
        keep = sorted(range(groups), key=lambda g: -gscore[g])[:group_topk]
        allowed = {e for g in keep for e in range(g * size, (g + 1) * size)}
    chosen = sorted(allowed, key=lambda e: -sel[e])[:k]
    vals = [s[e] for e in chosen]
    if score == "softmax" and not pre_softmax:
        m = max(vals)
        z = sum(math.exp(v - m) for v in vals)
        vals = [math.exp(v - m) / z for v in vals]
    if score == "sigmoid" and k > 1:
        tot = sum(vals)
        vals = [v / (tot + 1e-20) for v in vals]
    if scale is not None:
        vals = [v * scale for v in vals]
    return dict(zip(chosen, vals))


CASES = [
    dict(score="softmax", pre_softmax=False, groups=None, group_topk=None, scale=None, bias=False),
    dict(score="softmax", pre_softmax=True, groups=None, group_topk=None, scale=None, bias=False),
    dict(score="sigmoid", pre_softmax=False, groups=None, group_topk=None, scale=None, bias=False),
    dict(score="sigmoid", pre_softmax=False, groups=None, group_topk=None, scale=2.5, bias=True),
    dict(score="softmax", pre_softmax=False, groups=4, group_topk=2, scale=None, bias=False),
    dict(score="sigmoid", pre_softmax=False, groups=4, group_topk=2, scale=1.5, bias=True),
    dict(score="softmax", pre_softmax=True, groups=2, group_topk=1, scale=None, bias=True),
    dict(score="softmax", pre_softmax=False, groups=None, group_topk=None, scale=None, bias=True),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(f"{v}" for v in c.values()))
@pytest.mark.parametrize("k", [1, 2, 4])
def test_topk_routing_matches_reference(case, k):
    if case["groups"] is not None and k % case["group_topk"] != 0:
        pytest.skip("topk must be divisible by group_topk")
    torch.manual_seed(0)
    T, E = 37, 8
    logits = torch.randn(T, E, dtype=torch.float64)
    bias = torch.randn(E, dtype=torch.float64) * 0.5 if case["bias"] else None
    probs, rmap = topk_routing(logits, k, score_function=case["score"],
                               pre_softmax=case["pre_softmax"], num_groups=case["groups"],
                               group_topk=case["group_topk"], scaling_factor=case["scale"],
                               expert_bias=bias)
    assert probs.dtype == torch.float64 and rmap.dtype == torch.bool
    assert torch.equal(rmap.sum(1), torch.full((T,), k))
    for t in range(T):
        ref = _ref_route(logits[t].tolist(), k, case["score"], case["pre_softmax"],
                         case["groups"], case["group_topk"], case["scale"],
                         None if bias is None else bias.tolist())
        for e in range(E):
            assert bool(rmap[t, e]) == (e in ref), (t, e)
            assert float(probs[t, e]) == pytest.approx(ref.get(e, 0.0), abs=1e-12), (t, e)


def test_bias_changes_selection_not_weights():
    logits = torch.tensor([[2.0, 1.0, 0.5, -1.0]], dtype=torch.float64)
    bias = torch.tensor([0.0, 0.0, 0.0, 10.0], dtype=torch.float64)
    probs, rmap = topk_routing(logits, 2, score_function="sigmoid", expert_bias=bias)
    assert rmap.tolist() == [[True, False, False, True]]
    s0, s3 = torch.sigmoid(logits[0, 0]), torch.sigmoid(logits[0, 3])
    assert torch.allclose(probs[0, [0, 3]], torch.stack([s0, s3]) / (s0 + s3))


def _cfg(**kw) -> MoEConfig:
    base = dict(num_experts=8, topk=2, ffn_hidden_size=16)
    base.update(kw)
    return MoEConfig(**base)


@pytest.mark.parametrize("router_dtype", ["fp32", "fp64"])
def test_router_dtype_with_bf16_input(router_dtype):
    torch.manual_seed(0)
    router = TopKRouter(32, _cfg(router_dtype=router_dtype), 0, 1, 0.02)
    x = torch.randn(10, 32).to(torch.bfloat16)
    probs, rmap = router(x)
    dtype = torch.float32 if router_dtype == "fp32" else torch.float64
    assert router.weight.dtype == torch.float32
    assert probs.dtype == dtype
    logits = x.to(dtype) @ router.weight.to(dtype).t()
    ref_probs, ref_map = topk_routing(logits, 2)
    assert torch.equal(rmap, ref_map)
    assert torch.equal(probs.detach(), ref_probs)


def test_router_losses_only_when_training_with_grad():
    MoELossTracker.clear()
    cfg = _cfg(aux_loss_coeffs=[1e-2], z_loss_coeff=1e-3)
    router = TopKRouter(16, cfg, 0, 1, 0.02)
    x = torch.randn(12, 16)
    assert router.route(x).aux_loss is not None
    with torch.no_grad():
        assert router.route(x).aux_loss is None
    router.eval()
    assert router.route(x).aux_loss is None
    report = MoELossTracker.report(1)
    assert set(report) == {"load_balancing_loss", "z_loss"}
    assert all(v.shape == (1,) for v in report.values())


def test_router_rejects_unsupported_balancing():
    with pytest.raises(ValueError, match="sinkhorn"):
        TopKRouter(16, _cfg(load_balancing_types=["sinkhorn"]), 0, 1, 0.02)

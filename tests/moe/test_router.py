"""topk_routing / TopKRouter against a per-token reference written from the definitions."""

from __future__ import annotations

import math

import pytest
import torch

from megamoe.config import ConfigError, MoEConfig
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


def test_router_rejects_unknown_balancing():
    with pytest.raises(ValueError, match="switch"):
        TopKRouter(16, _cfg(load_balancing_types=["switch"]), 0, 1, 0.02)
    with pytest.raises(ValueError, match="sinkhorn"):
        TopKRouter(16, _cfg(load_balancing_types=["sinkhorn"], enable_expert_bias=True),
                   0, 1, 0.02)


# --- sinkhorn (S-BASE) -------------------------------------------------------------------

def _naive_sinkhorn(cost: list[list[float]], iters: int = 2000) -> list[list[float]]:
    """Plain-Python Sinkhorn-Knopp: alternately rescale rows to 1/T and columns to 1/E."""
    T, E = len(cost), len(cost[0])
    m = [[math.exp(v) for v in row] for row in cost]
    for _ in range(iters):
        for t in range(T):
            s = sum(m[t])
            m[t] = [v / (s * T) for v in m[t]]
        for e in range(E):
            s = sum(m[t][e] for t in range(T))
            for t in range(T):
                m[t][e] = m[t][e] / (s * E)
    return m


def test_sinkhorn_converges_to_doubly_normalised_matrix():
    from megamoe.moe.router import sinkhorn

    g = torch.Generator().manual_seed(0)
    cost = torch.randn(12, 4, generator=g, dtype=torch.float64) * 2 + 30  # exp would be big
    out = sinkhorn(cost, tol=1e-10)
    assert torch.allclose(out.sum(1), torch.full((12,), 1 / 12, dtype=torch.float64),
                          rtol=1e-6)
    assert torch.allclose(out.sum(0), torch.full((4,), 1 / 4, dtype=torch.float64), rtol=1e-6)
    ref = torch.tensor(_naive_sinkhorn((cost - 30).tolist()), dtype=torch.float64)
    assert torch.allclose(out, ref, rtol=1e-5, atol=0)


@pytest.mark.parametrize("k", [1, 2])
def test_sinkhorn_routing_train_and_eval(k):
    from megamoe.moe.router import sinkhorn, sinkhorn_routing

    g = torch.Generator().manual_seed(1)
    logits = torch.randn(32, 4, generator=g)
    logits[:, 0] += 3.0  # everyone prefers expert 0: sinkhorn must spread the load
    probs, rmap = sinkhorn_routing(logits, k, training=True)
    raw = torch.sigmoid(logits) if k == 1 else torch.softmax(logits, -1)
    sel = sinkhorn(logits.double()).topk(k, dim=1).indices
    assert torch.equal(rmap, torch.zeros_like(rmap).scatter(1, sel, True))
    assert torch.allclose(probs, raw * rmap)  # combine weights: raw scores, not sinkhorn's
    plain = torch.zeros_like(rmap).scatter(1, logits.topk(k, 1).indices, True)
    assert rmap.sum(0).max() < plain.sum(0).max() - 8  # far more balanced than top-k
    probs_e, rmap_e = sinkhorn_routing(logits, k, training=False)
    assert torch.equal(rmap_e, torch.zeros_like(rmap).scatter(1, raw.topk(k, 1).indices, True))
    assert torch.allclose(probs_e, raw * rmap_e)


@pytest.mark.parametrize("types,coeffs", [(["sinkhorn"], [1e-2]),
                                          (["sinkhorn", "aux_loss"], [0.0, 1e-2])])
def test_sinkhorn_refuses_an_aux_loss_coefficient(types, coeffs):
    """Megatron's sinkhorn router asserts moe_aux_loss_coeff == 0 ("Sinkhorn routing does
    not support aux loss"): a coefficient would otherwise be dropped without a word."""
    with pytest.raises(ConfigError, match="--moe-aux-loss-coeff must be 0 with "
                                          "--moe-router-load-balancing-type sinkhorn"):
        _cfg(load_balancing_types=types, aux_loss_coeffs=coeffs)
    _cfg(load_balancing_types=types, aux_loss_coeffs=[0.0] * len(types))  # 0 is fine


def test_router_sinkhorn_balances_without_a_balancing_loss():
    """Same weights and tokens: sinkhorn spreads the load of a router that favours one
    expert and records no balancing loss (only the z-loss, which Megatron applies before
    any routing); the aux-loss router picks plain top-k and records its loss."""
    torch.manual_seed(0)
    x = torch.randn(64, 16)
    sink = TopKRouter(16, _cfg(num_experts=4, load_balancing_types=["sinkhorn"],
                               aux_loss_coeffs=[0.0], z_loss_coeff=1e-3), 0, 1, 0.5)
    aux = TopKRouter(16, _cfg(num_experts=4, load_balancing_types=["aux_loss"],
                              aux_loss_coeffs=[1e-2], z_loss_coeff=1e-3), 0, 1, 0.5)
    with torch.no_grad():
        sink.weight[0] += x.mean(0) * 4.0  # every token prefers expert 0
    aux.load_state_dict(sink.state_dict())
    MoELossTracker.clear()
    out = sink.route(x)
    assert set(MoELossTracker.report(1)) == {"z_loss"}
    logits = sink.gating(x)
    assert torch.allclose(out.aux_loss, 1e-3 * torch.logsumexp(logits, -1).square().mean())
    ref = aux.route(x)
    assert set(MoELossTracker.report(1)) == {"load_balancing_loss", "z_loss"}
    assert torch.equal(ref.routing_map_TE,
                       torch.zeros_like(ref.routing_map_TE).scatter(1, logits.topk(2).indices,
                                                                    True))
    assert out.routing_map_TE.sum(1).eq(2).all()
    assert out.routing_map_TE.sum(0).max() < ref.routing_map_TE.sum(0).max() - 8


@pytest.mark.parametrize("score,pre_softmax,types,topk", [
    ("softmax", False, ["aux_loss"], 1),  # Megatron refuses: weight 1.0, no router gradient
    ("softmax", True, ["aux_loss"], 1),
    ("sigmoid", False, ["aux_loss"], 1),
    ("softmax", False, ["sinkhorn"], 1),  # sinkhorn's top-1 weight is a sigmoid
    ("softmax", False, ["aux_loss"], 2),
])
def test_top1_rule_refuses_exactly_the_router_the_loss_cannot_train(score, pre_softmax,
                                                                   types, topk):
    """--moe-router-topk 1 without --moe-router-pre-softmax (softmax, not sinkhorn) is the
    one case where every combine weight is 1.0 and the LM loss gives the router no
    gradient; it is the one case check_router_gradient (RunConfig) refuses."""
    torch.manual_seed(0)
    cfg = _cfg(num_experts=4, topk=topk, score_function=score, pre_softmax=pre_softmax,
               load_balancing_types=types, aux_loss_coeffs=[0.0])
    router = TopKRouter(16, cfg, 0, 1, 0.5)
    probs = router.route(torch.randn(32, 16)).probs_TE  # no balancing loss attached
    (probs * torch.randn_like(probs)).sum().backward()  # an LM loss through the weights
    trainable = bool(router.weight.grad.abs().max() > 0)
    refused = False
    try:
        cfg.check_router_gradient()
    except ConfigError as e:
        refused = True
        assert "--moe-router-topk 1" in str(e) and "--moe-router-pre-softmax" in str(e)
        assert torch.equal(probs.sum(1), torch.ones(32))  # every weight is 1.0
    assert refused == (not trainable)


# --- aux-loss-free expert bias ------------------------------------------------------------

@pytest.mark.parametrize("score", ["sigmoid", "softmax"])
def test_expert_bias_update_rule_and_selection_only(score):
    torch.manual_seed(0)
    cfg = _cfg(num_experts=4, score_function=score, enable_expert_bias=True,
               bias_update_rate=0.1, aux_loss_coeffs=[0.0])
    router = TopKRouter(16, cfg, 0, 1, 0.5)
    assert "expert_bias" in router.state_dict()  # learned state: saved in checkpoints
    x1, x2 = torch.randn(10, 16), torch.randn(6, 16)
    counts = torch.zeros(4)
    for x in (x1, x2):  # two micro-batches of one global batch
        _, rmap, _ = router.route(x)
        counts += rmap.sum(0)
    router.update_expert_bias(None)
    expected = 0.1 * torch.sign(counts.mean() - counts)
    assert torch.allclose(router.expert_bias, expected)
    assert float(router.local_tokens_per_expert.abs().sum()) == 0  # counts restart
    router.update_expert_bias(None)  # no tokens since: sign(0) = 0, bias unchanged
    assert torch.allclose(router.expert_bias, expected)
    # The bias steers selection only: combine weights are the unbiased scores.
    with torch.no_grad():
        router.expert_bias.copy_(torch.tensor([5.0, 0.0, 0.0, 5.0]))
        router.eval()
        probs, rmap, _ = router.route(x1)
        logits = router.gating(x1)
    assert rmap[:, [0, 3]].all()
    if score == "sigmoid":
        s = torch.sigmoid(logits[:, [0, 3]])
        want = s / s.sum(-1, keepdim=True)
    else:
        want = torch.softmax(logits[:, [0, 3]], -1)
    assert torch.allclose(probs[:, [0, 3]], want, atol=1e-6)
    # eval forwards do not count towards the next update
    assert float(router.local_tokens_per_expert.abs().sum()) == 0


# --- input jitter ---------------------------------------------------------------------------

def test_input_jitter_training_only_and_bounded():
    cfg = _cfg(input_jitter_eps=0.1)
    router = TopKRouter(16, cfg, 0, 1, 0.5)
    x = torch.randn(50, 16)
    torch.manual_seed(3)
    jittered = router.apply_input_jitter(x)
    ratio = jittered / x
    assert (ratio >= 0.9 - 1e-6).all() and (ratio <= 1.1 + 1e-6).all()
    assert not torch.allclose(jittered, x)
    torch.manual_seed(3)
    noise = torch.empty_like(x).uniform_(0.9, 1.1)
    assert torch.equal(jittered, x * noise)  # exactly Megatron's multiplicative noise
    torch.manual_seed(3)
    logits = router.gating(jittered)
    torch.manual_seed(3)
    assert torch.equal(router.route(x).probs_TE,
                       topk_routing(logits, 2)[0])  # the router sees the jittered input
    router.eval()
    assert torch.equal(router.apply_input_jitter(x), x)


# --- expert choice ---------------------------------------------------------------------------

def test_expert_choice_routing_matches_per_expert_sort():
    from megamoe.moe.router import expert_choice_capacity

    g = torch.Generator().manual_seed(2)
    logits = torch.randn(10, 4, generator=g, requires_grad=True)
    cfg = _cfg(num_experts=4, topk=2, router_type="expert_choice", aux_loss_coeffs=[0.0],
               capacity_factor=1.0)
    router = TopKRouter(16, cfg, 0, 1, 0.5)
    cap = expert_choice_capacity(10, 4, 2, 1.0)
    assert cap == 5
    probs, rmap = router.routing(logits)
    scores = torch.softmax(logits, -1)
    for e in range(4):  # each expert takes its 5 highest-scoring tokens
        order = sorted(range(10), key=lambda t: -float(scores[t, e].detach()))[:cap]
        assert sorted(torch.nonzero(rmap[:, e]).flatten().tolist()) == sorted(order)
    assert torch.allclose(probs, scores * rmap)
    probs.sum().backward()
    assert logits.grad is not None and logits.grad.abs().sum() > 0
    with pytest.raises(ValueError, match="expert choice"):
        TopKRouter(16, _cfg(router_type="expert_choice", aux_loss_coeffs=[0.1]), 0, 1, 0.5)


def test_expert_bias_stays_fp32_and_counts_exact_under_bf16():
    cfg = _cfg(num_experts=4, enable_expert_bias=True, bias_update_rate=1e-3,
               aux_loss_coeffs=[0.0])
    router = TopKRouter(16, cfg, 0, 1, 0.5)
    with torch.no_grad():
        router.expert_bias.copy_(torch.tensor([1.001, 0.0, 0.0, 0.0]))
    router = router.to(torch.bfloat16)
    assert router.expert_bias.dtype == torch.float32
    assert float(router.expert_bias[0]) == pytest.approx(1.001, abs=1e-7)  # not rounded
    assert router.local_tokens_per_expert.dtype == torch.long
    assert router.global_tokens_per_expert.dtype == torch.long

"""Where megamoe differs from Megatron-LM (docs/megatron-compatibility.md, section of that
name), one test each: what Megatron-LM computes is written out by hand from its code
(megatron/core/transformer/moe/router.py, moe_utils.py, transformer_config.py) and
megamoe's value is shown to differ from it in the documented way. Where megamoe follows
Megatron by default and keeps its earlier behaviour behind a flag, both are shown."""

from __future__ import annotations

import copy
import math
import os
import re
import shlex

import pytest
import torch
import torch.distributed as dist

from megamoe.cli.arguments import parse_args
from megamoe.cli.mapping import run_config_from_args
from megamoe.config import MoEConfig, ParallelConfig
from megamoe.moe.layer import MoELayer
from megamoe.moe.losses import MoELossTracker, set_aux_loss_backward_scale
from megamoe.moe.router import TopKRouter, topk_routing
from megamoe.parallel.mesh import build_mesh
from megamoe.parallelize import parallelize_moe
from tests.distributed import run_distributed

E, K, H = 4, 2, 8


def _megatron_switch_loss(scores_TE, counts_E, total_tokens, topk, coeff):
    """moe_utils.switch_load_balancing_loss_func (unfused)."""
    num_experts = scores_TE.shape[1]
    return (scores_TE.sum(0) * counts_E).sum() * (
        num_experts * coeff / (topk * total_tokens * total_tokens))


def _naive_keep(probs_TE, map_TE, capacity, policy, shards):
    """Per block of T / shards rows and per expert, with Python sorting: the kept slots."""
    T = len(map_TE)
    keep = [[False] * E for _ in range(T)]
    block = T // shards
    for s in range(shards):
        for e in range(E):
            routed = [t for t in range(s * block, (s + 1) * block) if map_TE[t][e]]
            if policy == "probs":
                routed = sorted(routed, key=lambda t: -probs_TE[t][e])
            for t in routed[:capacity]:
                keep[t][e] = True
    return keep


# --- 1. global_aux_loss is scaled by dp x cp (Megatron #3672) ------------------------------

def _global_router(grad_average_size: int) -> TopKRouter:
    torch.manual_seed(0)
    cfg = MoEConfig(num_experts=E, topk=K, ffn_hidden_size=8,
                    load_balancing_types=["global_aux_loss"], aux_loss_coeffs=[0.5])
    group = dist.group.WORLD if dist.is_initialized() else None
    r = TopKRouter(16, cfg, 0, 1, 0.5, balancing_group=group,
                   grad_average_size=grad_average_size)
    with torch.no_grad():
        r.weight.normal_(0.0, 1.0)
    return r


def _dp_tokens(rank: int) -> torch.Tensor:
    return torch.randn(8, 16, generator=torch.Generator().manual_seed(20 + rank))


def _global_aux_worker(rank: int, world: int) -> tuple:
    mine = _global_router(world)  # parallelize: grad_average_size = dp x cp
    x = _dp_tokens(rank)
    loss = mine.route(x).aux_loss
    loss.backward()
    # Megatron's _apply_global_aux_loss: counts all-reduced over tp_dp_cp, total tokens =
    # local tokens x group size, this rank's probabilities, no dp factor.
    w = mine.weight.detach().clone().requires_grad_(True)
    scores = torch.softmax(x @ w.t(), dim=-1)
    counts = torch.zeros(len(x), E).scatter(1, scores.topk(K, dim=-1).indices, 1.0).sum(0)
    dist.all_reduce(counts)
    megatron = _megatron_switch_loss(scores, counts, len(x) * world, K, 0.5)
    megatron.backward()
    grads = []
    for g in (mine.weight.grad.clone(), w.grad.clone()):
        dist.all_reduce(g)  # data-parallel gradient averaging (DDP)
        grads.append(g / world)
    return float(loss), float(megatron), grads[0], grads[1]


def test_global_aux_loss_is_dp_times_megatrons():
    """Megatron's per-rank global_aux_loss divides this rank's probabilities by the global
    token count, so after DP gradient averaging its gradient is 1/DP of the global loss's
    (Megatron #3672). megamoe multiplies by dp x cp: loss and averaged gradient are DP x
    Megatron's, and the gradient is that of the global-batch loss on one process."""
    results = run_distributed(_global_aux_worker, 2, 120)
    ref = _global_router(1)
    ref.route(torch.cat([_dp_tokens(0), _dp_tokens(1)])).aux_loss.backward()
    for loss, megatron, grad, megatron_grad in results:
        assert loss == pytest.approx(2 * megatron, rel=1e-6)
        torch.testing.assert_close(grad, 2 * megatron_grad, rtol=1e-5, atol=1e-7)
        torch.testing.assert_close(grad, ref.weight.grad, rtol=1e-5, atol=1e-7)
        assert (megatron_grad - ref.weight.grad).abs().max() > 0.1 * ref.weight.grad.abs().max()


# --- 2. the aux losses count the routing map actually dispatched (Megatron #2767) ----------

def _steered_router(case: str, kind: str) -> TopKRouter:
    torch.manual_seed(1)
    kw = dict(num_experts=8, topk=2, ffn_hidden_size=8, load_balancing_types=[kind],
              aux_loss_coeffs=[1.0])
    if case == "group_limited":
        kw.update(num_groups=4, group_topk=1)
    else:
        kw.update(score_function="sigmoid", enable_expert_bias=True)
    r = TopKRouter(16, MoEConfig(**kw), 0, 1, 1.0)
    with torch.no_grad():
        if case == "expert_bias":  # expert 7 scores lowest, yet the bias steers all to it
            r.weight[7] -= 4.0 * _DIRECTION
            r.expert_bias[7] = 10.0
        else:  # experts 0 and 2 (groups 0 and 1) are every token's plain top 2
            r.weight[[0, 2]] += 4.0 * _DIRECTION
    return r


_DIRECTION = torch.nn.functional.normalize(torch.ones(16), dim=0)


@pytest.mark.parametrize("kind", ["aux_loss", "seq_aux_loss", "global_aux_loss"])
@pytest.mark.parametrize("case", ["group_limited", "expert_bias"])
def test_aux_loss_counts_the_dispatched_routing_map(case, kind):
    """Megatron's compute_routing_scores_for_aux_loss recounts a plain top-k of the scores,
    ignoring the group limit and the expert bias the dispatch used; megamoe counts the
    routing map it dispatches (one sequence, one micro-batch: every kind is this formula)."""
    MoELossTracker.clear()
    r = _steered_router(case, kind)
    x = torch.randn(32, 16, generator=torch.Generator().manual_seed(3)) + 2.0 * _DIRECTION
    out = r.route(x)
    logits = x @ r.weight.detach().t()
    if case == "group_limited":  # 4 groups of 2 experts, 1 group: its 2 experts
        scores = torch.softmax(logits, dim=-1)
        best_T = logits.view(-1, 4, 2).sum(-1).argmax(-1)
        dispatched = torch.zeros(32, 4).scatter(1, best_T[:, None], 1.0).repeat_interleave(2, 1)
    else:
        s = torch.sigmoid(logits)
        scores = s / s.sum(-1, keepdim=True)
        top1 = s[:, :7].argmax(-1)  # expert 7 plus the best other
        dispatched = torch.zeros(32, 8).scatter(1, top1[:, None], 1.0)
        dispatched[:, 7] = 1.0
    assert torch.equal(out.routing_map_TE, dispatched.bool())
    plain = torch.zeros(32, 8).scatter(1, scores.topk(2, dim=-1).indices, 1.0)
    ours = _megatron_switch_loss(scores, dispatched.sum(0), 32, 2, 1.0)
    megatron = _megatron_switch_loss(scores, plain.sum(0), 32, 2, 1.0)
    assert float(out.aux_loss.detach()) == pytest.approx(float(ours), rel=1e-5)
    assert abs(float(megatron) - float(ours)) > 0.1 * float(ours)
    MoELossTracker.clear()


# --- 3. expert bias with softmax scores: an extension ---------------------------------------

def test_expert_bias_with_softmax_is_accepted_and_steers_selection():
    """Megatron's TransformerConfig raises ValueError for --moe-router-enable-expert-bias
    with --moe-router-score-function softmax; megamoe accepts it: the bias is added to the
    logits (pre-softmax: to the probabilities) for selection only."""
    args = parse_args(shlex.split(
        "--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16 "
        "--micro-batch-size 2 --global-batch-size 4 --train-iters 1 --lr 1e-3 --mock-data "
        "--num-experts 4 --moe-router-topk 2 --moe-router-score-function softmax "
        "--moe-router-enable-expert-bias"), world_size=1)
    moe = run_config_from_args(args, 97).model.moe
    assert moe.score_function == "softmax" and moe.enable_expert_bias
    logits = torch.tensor([[2.0, 1.0, 0.5, -1.0]], dtype=torch.float64)
    bias = torch.tensor([0.0, 0.0, 0.0, 10.0], dtype=torch.float64)
    probs, rmap = topk_routing(logits, 2, expert_bias=bias)
    assert rmap.tolist() == [[True, False, False, True]]
    torch.testing.assert_close(probs[0, [0, 3]], torch.softmax(logits[0, [0, 3]], -1))


# --- 4. the router computes in fp32 when --moe-router-dtype is unset ------------------------

def test_router_computes_in_fp32_when_router_dtype_is_unset():
    """Megatron's Router.gating computes the logits in the input's dtype (bf16 under --bf16)
    unless --moe-router-dtype fp32/fp64 is given; megamoe always routes in >= fp32."""
    args = parse_args(shlex.split(
        "--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16 "
        "--micro-batch-size 2 --global-batch-size 4 --train-iters 1 --lr 1e-3 --mock-data "
        "--num-experts 4 --moe-router-topk 2 --bf16"), world_size=1)
    moe = run_config_from_args(args, 97).model.moe
    assert args.bf16 and moe.router_dtype == "fp32"
    router = TopKRouter(32, moe, 0, 1, 0.5).to(torch.bfloat16)
    x = torch.randn(16, 32, generator=torch.Generator().manual_seed(7)).to(torch.bfloat16)
    probs, _ = router.eval()(x)
    weight = router.weight.detach()
    megatron, _ = topk_routing(x @ weight.to(torch.bfloat16).t(), 2)
    assert probs.dtype == torch.float32 and megatron.dtype == torch.bfloat16
    torch.testing.assert_close(probs, topk_routing(x.float() @ weight.float().t(), 2)[0])
    assert not torch.equal(probs, megatron.float())


# --- 5. expert-bias counts: after capacity drops, without padding -------------------------

def _bias_layer(pad: bool, before: bool) -> MoELayer:
    torch.manual_seed(2)
    cfg = MoEConfig(num_experts=E, topk=K, ffn_hidden_size=6, score_function="sigmoid",
                    enable_expert_bias=True, bias_update_rate=0.1, aux_loss_coeffs=[0.0],
                    capacity_factor=0.75, pad_to_capacity=pad,
                    expert_bias_counts_before_capacity=before)
    return MoELayer(cfg, H, init_method_std=0.3)




def _sign_update(counts):
    counts = torch.tensor(counts, dtype=torch.float64)
    return 0.1 * torch.sign(counts.mean() - counts).float()


@pytest.mark.parametrize("pad", [False, True], ids=["unpadded", "padded"])
@pytest.mark.parametrize("before", [False, True], ids=["default", "before_flag"])
def test_expert_bias_counts_after_capacity_drops(pad, before):
    """Megatron (router.py `_apply_expert_bias` after `apply_router_token_dropping`) counts
    the assignments kept by capacity, the default; --moe-expert-bias-counts-before-capacity
    counts the routed ones. With --moe-pad-expert-input-to-capacity Megatron's routing map
    is the capacity mask, so every expert counts C and the bias never moves; megamoe
    counts no padding."""
    layer = _bias_layer(pad, before)
    x = torch.randn(16, H, generator=torch.Generator().manual_seed(4))  # routed 10/12/2/8
    layer(x).sum().backward()
    counted = layer.router.local_tokens_per_expert.tolist()
    layer.router.update_expert_bias(None)
    # By hand: sigmoid scores, top-2, normalised probs, capacity ceil(0.75 x 16 x 2 / 4).
    s = torch.sigmoid(x @ layer.router.weight.detach().t())
    idx = s.topk(K, dim=-1).indices
    routed = torch.zeros(16, E, dtype=torch.bool).scatter(1, idx, True)
    probs = torch.zeros(16, E).scatter(1, idx, s.gather(1, idx) / s.gather(1, idx).sum(-1,
                                                                                     True))
    capacity = math.ceil(0.75 * 16 * K / E)
    keep = _naive_keep(probs.tolist(), routed.tolist(), capacity, "probs", 1)
    kept_counts = torch.tensor(keep).sum(0).tolist()
    routed_counts = routed.sum(0).tolist()
    assert kept_counts != routed_counts  # the data drops
    after, pre = _sign_update(kept_counts), _sign_update(routed_counts)
    assert not torch.equal(after, pre)  # and the two counts move the bias differently
    assert counted == (routed_counts if before else kept_counts)
    torch.testing.assert_close(layer.router.expert_bias, pre if before else after)
    if pad and not before:  # Megatron's padded map: C per expert, sign(0) = 0
        assert torch.equal(_sign_update([capacity] * E), torch.zeros(E))
        assert layer.router.expert_bias.abs().sum() > 0


# --- 6. capacity over each TP rank's sequence shard ------------------------------------------

S, B = 8, 2
CAPACITY_CASES = [(gathered, policy, pad) for gathered in (False, True)
                  for policy, pad in (("probs", False), ("position", True))]


def _capacity_layer(gathered: bool, policy: str, pad: bool) -> MoELayer:
    torch.manual_seed(5)
    cfg = MoEConfig(num_experts=E, topk=K, ffn_hidden_size=6, aux_loss_coeffs=[0.0],
                    capacity_factor=0.5, token_drop_policy=policy, pad_to_capacity=pad,
                    capacity_over_tp_gathered_sequence=gathered)
    return MoELayer(cfg, H, init_method_std=0.3, grouped_gemm=True)


def _capacity_data(layer: MoELayer) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(6)
    x, grad = torch.randn(S, B, H, generator=g), torch.randn(S, B, H, generator=g)
    direction = layer.router.weight.detach()[0]
    x[: S // 2] += 3.0 * direction / direction.norm()  # shard 0 overloads expert 0
    return x, grad


def _tp_capacity_worker(rank: int, world: int, etp: int) -> list[bool]:
    set_aux_loss_backward_scale(1.0)
    mesh = build_mesh(ParallelConfig.layout(world, tp=2, etp=etp), "gloo")
    own = slice(rank * S // 2, (rank + 1) * S // 2)
    differs = []
    for gathered, policy, pad in CAPACITY_CASES:
        full = _capacity_layer(gathered, policy, pad)
        layer = parallelize_moe(copy.deepcopy(full), tp_group=mesh.group("tp"),
                                etp_group=mesh.group("etp"))
        x, grad = _capacity_data(full)
        # The kept set: each shard's (Megatron), or the gathered sequence's (the flag).
        shards = 1 if gathered else 2
        capacity = math.ceil(0.5 * (S * B // shards) * K / E)
        with torch.no_grad():
            probs, rmap, _ = layer.router.route(x.reshape(-1, H))
            _, keep, padded = layer.apply_capacity(probs, rmap)
        assert keep.tolist() == _naive_keep(probs.tolist(), rmap.tolist(), capacity, policy,
                                            shards)
        assert padded == (capacity if pad else None)
        # The layer's output and input gradient on this rank's shard: those of one process
        # running this shard alone (Megatron), or the whole sequence (the flag).
        x_local = x[own].clone().requires_grad_(True)
        out = layer(x_local)
        (out * grad[own]).sum().backward()
        alone, whole = copy.deepcopy(full), copy.deepcopy(full)
        x_alone, x_whole = x[own].clone().requires_grad_(True), x.clone().requires_grad_(True)
        out_alone, out_whole = alone(x_alone), whole(x_whole)
        (out_alone * grad[own]).sum().backward()
        (out_whole * grad).sum().backward()
        want_out, want_grad = ((out_whole[own], x_whole.grad[own]) if gathered
                               else (out_alone, x_alone.grad))
        torch.testing.assert_close(out, want_out.detach(), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(x_local.grad, want_grad, rtol=1e-5, atol=1e-6)
        differs.append(not torch.allclose(out_alone, out_whole[own], atol=1e-4))
    return differs


@pytest.mark.parametrize("etp", [1, 2], ids=["etp1", "etp2"])
def test_tp_capacity_counts_each_ranks_shard(etp):
    """TP = 2 + SP, capacity factor 0.5, shard 0 overloading expert 0: by default each
    rank keeps what its shard alone would keep (Megatron's router drops on each rank's
    sequence shard), padding included; --moe-capacity-over-tp-gathered-sequence keeps
    what the gathered sequence would (megamoe's earlier behaviour)."""
    per_rank = run_distributed(_tp_capacity_worker, 2, 180, etp)
    assert any(any(flags) for flags in per_rank)  # the two counts keep different sets


# --- the documented list -------------------------------------------------------------------------

def test_readme_differences_name_tests_that_exist():
    """Every test the section "Where megamoe differs from Megatron-LM, and why" of
    docs/megatron-compatibility.md names exists, and this file's tests are all named there."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    with open(os.path.join(root, "docs", "megatron-compatibility.md"), encoding="utf-8") as f:
        readme = f.read()
    section = readme.split("## Where megamoe differs from Megatron-LM, and why")[1]
    section = section.split("\n## ")[0]
    named = re.findall(r"`(tests/[\w/]+\.py)::(\w+)(?:\[[\w-]+\])?`", section)
    assert len(named) >= 12
    for path, name in named:
        with open(os.path.join(root, path), encoding="utf-8") as f:
            assert f"def {name}(" in f.read(), (path, name)
    here = {n for p, n in named if p.endswith("test_megatron_differences.py")}
    mine = {n for n in globals() if n.startswith("test_") and "readme" not in n}
    assert mine <= here, mine - here

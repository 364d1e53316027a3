"""Every balancing type under gradient accumulation == a hand-built reference loss.

The reference model has its balancing coefficients set to 0 and records its router logits;
the test then writes each loss from its formula (independent of megamoe.moe.losses) and
backpropagates sum_m (lm_m + aux_m) / n. Also: seq_aux_loss does not depend on how a
global batch is split into micro-batches, global_aux_loss restarts with each global batch,
and the aux-loss-free expert bias is updated once per train step.
"""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

from megamoe.config import ModelConfig, MoEConfig
from megamoe.model.gpt_model import GPTModel
from megamoe.moe.experts import use_grouped_gemm
from megamoe.moe.router import TopKRouter
from megamoe.training.schedules.local import forward_backward_no_pipelining, forward_step

E, K, S, B = 4, 2, 8, 2


def _model(types, coeffs, z=None, **moe_kw) -> GPTModel:
    torch.manual_seed(0)
    moe = MoEConfig(num_experts=E, topk=K, ffn_hidden_size=16, load_balancing_types=types,
                    aux_loss_coeffs=coeffs, z_loss_coeff=z, **moe_kw)
    cfg = ModelConfig(num_layers=2, hidden_size=32, ffn_hidden_size=64, num_attention_heads=4,
                      seq_length=S, max_position_embeddings=S, vocab_size=50,
                      hidden_dropout=0.0, attention_dropout=0.0, swiglu=True,
                      add_bias_linear=False, normalization="RMSNorm",
                      position_embedding_type="rope", moe=moe)
    model = GPTModel(cfg)
    use_grouped_gemm(model, True)
    with torch.no_grad():  # sharper routers: the losses are far from their minimum
        for r in model.modules():
            if isinstance(r, TopKRouter):
                r.weight.normal_(0.0, 0.5)
    return model


def _batches(n, mbs=B, seed=0):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, 50, (n * mbs, S + 1), generator=g)
    return [{"tokens": tokens[i * mbs:(i + 1) * mbs, :-1],
             "labels": tokens[i * mbs:(i + 1) * mbs, 1:],
             "loss_mask": torch.ones(mbs, S)} for i in range(n)]


def _grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _reference_grads(model, batches, types, coeffs, z=None):
    """Zero-coefficient copy + hand-written losses from the recorded router logits."""
    ref = copy.deepcopy(model)
    ref.zero_grad()
    routers = [m for m in ref.modules() if isinstance(m, TopKRouter)]
    logits_seen = []
    for r in routers:
        r.config = dataclasses.replace(r.config, load_balancing_types=list(types),
                                       aux_loss_coeffs=[0.0] * len(types), z_loss_coeff=None)
        orig = r.gating
        r.gating = (lambda o: (lambda x: logits_seen.append(o(x)) or logits_seen[-1]))(orig)
    n = len(batches)
    running = [(torch.zeros(E), 0) for _ in routers]
    for batch in batches:
        logits_seen.clear()
        total = forward_step(ref, batch)
        for li, logits in enumerate(logits_seen):  # [T, E], T = S * B in [S, B] order
            T = logits.shape[0]
            p = torch.softmax(logits, -1)
            rmap = torch.zeros(T, E).scatter(1, logits.detach().topk(K, -1).indices, 1.0)
            for kind, c in zip(types, coeffs):
                if kind == "aux_loss":
                    total = total + c * E / (K * T * T) * (p.sum(0) * rmap.sum(0)).sum()
                elif kind == "seq_aux_loss":
                    mbs = T // S
                    per_seq = []
                    for b in range(mbs):
                        rows = torch.arange(b, T, mbs)  # token s * B + b
                        per_seq.append(E / (K * S * S) * (p[rows].sum(0) * rmap[rows].sum(0)).sum())
                    total = total + c * torch.stack(per_seq).mean()
                elif kind == "global_aux_loss":
                    counts, seen = running[li]
                    counts, seen = counts + rmap.sum(0), seen + T
                    running[li] = (counts, seen)
                    total = total + c * E / K * ((p.sum(0) / T) * (counts / seen)).sum()
            if z:
                total = total + z * torch.logsumexp(logits, -1).square().mean()
        (total / n).backward()
    return _grads(ref)


CASES = [
    (["aux_loss"], [0.3], None),
    (["seq_aux_loss"], [0.3], None),
    (["global_aux_loss"], [0.3], None),
    (["aux_loss", "seq_aux_loss", "global_aux_loss"], [0.1, 0.2, 0.3], 0.05),
    (["none"], [0.0], 0.05),
]


@pytest.mark.parametrize("types,coeffs,z", CASES, ids=lambda v: str(v))
def test_accumulated_gradient_matches_hand_built_loss(types, coeffs, z):
    model = _model(types, coeffs, z)
    batches = _batches(3)
    ref = _reference_grads(model, batches, types, coeffs, z)
    model.zero_grad()
    forward_backward_no_pipelining(model, iter(batches), 3)
    got = _grads(model)
    assert set(got) == set(ref)
    for name in got:
        torch.testing.assert_close(got[name], ref[name], atol=2e-6, rtol=1e-5, msg=name)
    # the balancing part is not negligible: without it the router gradient differs
    if types != ["none"]:
        plain = _reference_grads(model, batches, ["none"], [0.0])
        r = next(n for n in got if "router" in n)
        assert (got[r] - plain[r]).abs().max() > 1e-4


def test_sinkhorn_accumulated_gradient_is_mean_of_microbatches():
    """sinkhorn has no loss and no cross-micro-batch state: accumulation == mean."""
    model = _model(["sinkhorn"], [0.0])
    batches = _batches(3)
    model.zero_grad()
    forward_backward_no_pipelining(model, iter(batches), 3)
    acc = _grads(model)
    singles = []
    for b in batches:
        model.zero_grad()
        forward_backward_no_pipelining(model, iter([b]), 1)
        singles.append(_grads(model))
    for name, g in acc.items():
        torch.testing.assert_close(g, torch.stack([s[name] for s in singles]).mean(0),
                                   atol=1e-6, rtol=1e-5, msg=name)


def test_seq_aux_loss_gradient_independent_of_micro_batch_size():
    """Megatron #5798: the same global batch split 1x4, 2x2 or 4x1 gives the same gradient."""
    model = _model(["seq_aux_loss"], [0.5])
    one = _batches(1, mbs=4)[0]
    grads = []
    for mbs in (4, 2, 1):
        n = 4 // mbs
        batches = [{k: v[i * mbs:(i + 1) * mbs] for k, v in one.items()} for i in range(n)]
        model.zero_grad()
        forward_backward_no_pipelining(model, iter(batches), n)
        grads.append(_grads(model))
    for g in grads[1:]:
        for name in g:
            torch.testing.assert_close(g[name], grads[0][name], atol=2e-6, rtol=1e-5,
                                       msg=name)


def test_global_aux_state_restarts_each_global_batch():
    model = _model(["global_aux_loss"], [0.3])
    batches = _batches(2)
    model.zero_grad()
    forward_backward_no_pipelining(model, iter(batches), 2)
    first = _grads(model)
    model.zero_grad()
    forward_backward_no_pipelining(model, iter(batches), 2)  # same batch again
    for name, g in _grads(model).items():
        torch.testing.assert_close(g, first[name], atol=0, rtol=0, msg=name)
    router = next(m for m in model.modules() if isinstance(m, TopKRouter))
    assert float(router.global_num_tokens) == 2 * S * B


def _router(group=None, avg=1):
    torch.manual_seed(0)
    cfg = MoEConfig(num_experts=E, topk=K, ffn_hidden_size=8, score_function="softmax",
                    load_balancing_types=["global_aux_loss"], aux_loss_coeffs=[0.5],
                    enable_expert_bias=True, bias_update_rate=0.1)
    r = TopKRouter(16, cfg, 0, 1, 0.5, balancing_group=group, grad_average_size=avg)
    with torch.no_grad():
        r.weight.normal_(0.0, 1.0)
    return r


def _rank_tokens(rank):
    return torch.randn(6 + 4 * rank, 16, generator=torch.Generator().manual_seed(10 + rank))


def _dp_body(rank, world):
    import torch.distributed as dist

    r = _router(dist.group.WORLD, world)
    out = r.route(_rank_tokens(rank))
    out.aux_loss.backward()
    grad = r.weight.grad.clone()
    dist.all_reduce(grad)  # data-parallel gradient averaging
    r.update_expert_bias(dist.group.WORLD)
    return grad / world, r.expert_bias.clone(), out.routing_map_TE.sum(0)


@pytest.mark.slow  # (test_megatron_differences keeps a DP2 global-aux case)
def test_global_aux_loss_and_expert_bias_over_data_parallel_ranks():
    """2 ranks with unequal token counts: the DP-averaged gradient equals the gradient of
    the global loss over all tokens (not 1/DP of it, Megatron #3672), and the bias update
    uses the all-reduced counts."""
    from tests.distributed import run_distributed

    results = run_distributed(_dp_body, 2, 120)
    ref = _router()
    x_all = torch.cat([_rank_tokens(0), _rank_tokens(1)])
    out = ref.route(x_all)
    out.aux_loss.backward()
    counts = out.routing_map_TE.sum(0).double()
    want_bias = 0.1 * torch.sign(counts.mean() - counts).float()
    for grad, bias, _ in results:
        torch.testing.assert_close(grad, ref.weight.grad, atol=1e-6, rtol=1e-5)
        torch.testing.assert_close(bias, want_bias)
    assert torch.equal(results[0][2] + results[1][2], out.routing_map_TE.sum(0))

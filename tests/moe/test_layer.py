"""MoELayer == a naive per-token, per-expert loop: forward and every gradient."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from megamoe.config import MoEConfig
from megamoe.moe.grouped_gemm import resolve_backend
from megamoe.moe.layer import MoELayer
from megamoe.moe.losses import MoELossTracker, set_aux_loss_backward_scale

ZERO_EXPERTS = {4: [2], 8: [0, 5], 6: [3]}


def _build(E, k, H, F_, *, swiglu, bias, grouped, aux=0.0, z=None, seed=0):
    torch.manual_seed(seed)
    cfg = MoEConfig(num_experts=E, topk=k, ffn_hidden_size=F_, aux_loss_coeffs=[aux],
                    z_loss_coeff=z)
    layer = MoELayer(cfg, H, layer_number=0, num_layers=2, init_method_std=0.3,
                     add_bias_linear=bias, swiglu=swiglu, grouped_gemm=grouped)
    with torch.no_grad():
        layer.router.weight.normal_(0.0, 1.0)
        layer.router.weight[ZERO_EXPERTS[E], 0] = -20.0  # with x[..., 0] = 3: never chosen
        if bias:
            layer.experts.fc1_bias.normal_(0.0, 0.5)
            layer.experts.fc2_bias.normal_(0.0, 0.5)
    return layer


def _input(shape, H, seed=1):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, H, generator=g)
    x[..., 0] = 3.0
    return x


def _naive(params, x_TH, E, k, swiglu, aux, z):
    """Token by token: route with Python sorting, run each chosen expert on one vector."""
    wr, w1, b1, w2, b2 = params
    T = x_TH.shape[0]
    outs, probs_all, counts = [], [], [0] * E
    for t in range(T):
        logits = x_TH[t].float() @ wr.t()
        chosen = sorted(range(E), key=lambda e: -float(logits[e].detach()))[:k]
        p = torch.softmax(logits[chosen], dim=0)
        acc = torch.zeros_like(x_TH[t])
        for j, e in enumerate(chosen):
            counts[e] += 1
            h = x_TH[t] @ w1[e] + (b1[e] if b1 is not None else 0.0)
            if swiglu:
                half = h.shape[0] // 2
                a = F.silu(h[:half]) * h[half:]
            else:
                a = F.gelu(h)
            y = a @ w2[e] + (b2[e] if b2 is not None else 0.0)
            acc = acc + p[j] * y
        outs.append(acc)
        probs_all.append(torch.softmax(logits, dim=0))
    out = torch.stack(outs)
    aux_total = out.new_zeros(())
    if aux:
        P = torch.stack(probs_all).sum(0)
        aux_total = aux_total + E * aux / (k * T * T) * sum(P[e] * counts[e] for e in range(E))
    if z:
        lse = torch.stack([torch.logsumexp(x_TH[t].float() @ wr.t(), 0) for t in range(T)])
        aux_total = aux_total + z * (lse ** 2).mean()
    return out, aux_total, counts


def _params(layer):
    ex = layer.experts
    return [layer.router.weight, ex.fc1_weight, ex.fc1_bias, ex.fc2_weight, ex.fc2_bias]


SHAPES = [(4, 1, (5, 3), 16, 12), (8, 2, (6, 2), 16, 8), (6, 3, (7,), 8, 20)]


@pytest.mark.parametrize("E,k,shape,H,F_", SHAPES, ids=["E4k1", "E8k2", "E6k3"])
@pytest.mark.parametrize("swiglu", [False, True], ids=["gelu", "swiglu"])
@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("grouped", [False, True], ids=["loop", "grouped"])
def test_layer_matches_naive_loop(E, k, shape, H, F_, swiglu, bias, grouped):
    layer = _build(E, k, H, F_, swiglu=swiglu, bias=bias, grouped=grouped)
    if grouped:  # the grouped path really runs a fused backend for these shapes
        fc1 = layer.experts.fc1_weight
        assert resolve_backend(torch.randn(4, H), fc1, "auto") != "loop"
    x = _input(shape, H).requires_grad_(True)
    out = layer(x)
    assert out.shape == x.shape
    grad = torch.randn_like(out)
    params = [p for p in _params(layer) if p is not None]
    got = torch.autograd.grad((out * grad).sum(), [x, *params])

    ref_params = [p.detach().clone().requires_grad_(True) if p is not None else None
                  for p in _params(layer)]
    x_ref = x.detach().clone().requires_grad_(True)
    ref_TH, _, counts = _naive(ref_params, x_ref.reshape(-1, H), E, k, swiglu, 0.0, None)
    ref = ref_TH.reshape(x.shape)
    want = torch.autograd.grad((ref * grad).sum(), [x_ref, *[p for p in ref_params
                                                              if p is not None]])
    assert all(counts[e] == 0 for e in ZERO_EXPERTS[E])
    assert layer.tokens_per_expert.tolist() == counts
    assert (out - ref).abs().max() <= 1e-5
    names = ["x", "router", "fc1", "fc1_bias", "fc2", "fc2_bias"] if bias else \
        ["x", "router", "fc1", "fc2"]
    for name, a, b in zip(names, got, want):
        assert a.shape == b.shape, name
        assert (a - b).abs().max() <= 1e-5, name
    # Zero-token experts get exactly zero expert-weight gradients.
    zero = ZERO_EXPERTS[E]
    assert got[2][zero].abs().max() == 0 and got[names.index("fc2")][zero].abs().max() == 0


@pytest.mark.parametrize("grouped", [False, True])
def test_layer_aux_and_z_loss_gradients(grouped):
    """Gradients with balancing losses == autograd of (lm + scale * (aux + z)) of the loop."""
    E, k, H, F_ = 8, 2, 16, 8
    layer = _build(E, k, H, F_, swiglu=True, bias=False, grouped=grouped, aux=0.05, z=0.01)
    x = _input((5, 2), H).requires_grad_(True)
    scale = 0.5
    set_aux_loss_backward_scale(scale)
    out = layer(x)
    grad = torch.randn_like(out)
    params = [p for p in _params(layer) if p is not None]
    got = torch.autograd.grad((out * grad).sum(), [x, *params])

    ref_params = [p.detach().clone().requires_grad_(True) if p is not None else None
                  for p in _params(layer)]
    x_ref = x.detach().clone().requires_grad_(True)
    ref_TH, aux, _ = _naive(ref_params, x_ref.reshape(-1, H), E, k, True, 0.05, 0.01)
    total = (ref_TH.reshape(x.shape) * grad).sum() + scale * aux
    want = torch.autograd.grad(total, [x_ref, *[p for p in ref_params if p is not None]])
    for a, b in zip(got, want):
        assert (a - b).abs().max() <= 1e-5
    report = MoELossTracker.report(1)
    assert set(report) == {"load_balancing_loss", "z_loss"}


def test_eval_and_no_grad_record_nothing():
    layer = _build(4, 2, 16, 8, swiglu=False, bias=True, grouped=True, aux=0.01, z=1e-3)
    x = _input((3, 2), 16)
    layer.eval()
    y_eval = layer(x)
    layer.train()
    with torch.no_grad():
        y_nograd = layer(x)
    assert MoELossTracker.report(1) == {}
    assert torch.allclose(y_eval, y_nograd)
    layer(x)
    report = MoELossTracker.report(1)
    assert report["load_balancing_loss"].shape == (1,) and report["z_loss"].shape == (1,)


def test_bf16_layer_close_to_fp32():
    layer = _build(8, 2, 32, 16, swiglu=True, bias=True, grouped=True)
    x = _input((4, 4), 32)
    with torch.no_grad():
        ref = layer(x)
        out = layer.to(torch.bfloat16)(x.to(torch.bfloat16))
    assert out.dtype == torch.bfloat16
    assert layer.router.weight.dtype == torch.bfloat16  # logits still computed in fp32
    assert (out.float() - ref).abs().max() <= 5e-2 * max(1.0, float(ref.abs().max()))


def test_init_and_unsupported_features():
    cfg = MoEConfig(num_experts=4, topk=2, ffn_hidden_size=64)
    layer = MoELayer(cfg, 128, layer_number=1, num_layers=8, init_method_std=0.02,
                     add_bias_linear=True, swiglu=True)
    ex = layer.experts
    assert ex.fc1_weight.shape == (4, 128, 128) and ex.fc2_weight.shape == (4, 64, 128)
    assert ex.fc1_bias.shape == (4, 128) and ex.fc2_bias.shape == (4, 128)
    assert float(ex.fc1_bias.detach().abs().max()) == 0.0
    assert abs(float(ex.fc1_weight.detach().std()) - 0.02) < 2e-3
    assert abs(float(ex.fc2_weight.detach().std()) - 0.02 / math.sqrt(16)) < 5e-4
    assert abs(float(layer.router.weight.detach().std()) - 0.02) < 4e-3
    with pytest.raises(ValueError, match="--moe-shared-expert-intermediate-size"):
        MoELayer(MoEConfig(num_experts=4, shared_expert_gate=True), 16, layer_number=0,
                 num_layers=1, init_method_std=0.02, add_bias_linear=False, swiglu=False)


# --- capacity, padding, shared experts, custom experts, expert choice, statistics --------

def _expert_out(layer, e, x_H):
    ex = layer.experts
    h = x_H @ ex.fc1_weight[e]
    return ex.activation(h) @ ex.fc2_weight[e]


def _naive_from_map(layer, x_TH, probs_TE, map_TE):
    """sum over (t, e) in the map of probs[t, e] * expert_e(x_t), token by token."""
    out = []
    for t in range(x_TH.shape[0]):
        acc = torch.zeros_like(x_TH[t])
        for e in torch.nonzero(map_TE[t]).flatten().tolist():
            acc = acc + probs_TE[t, e] * _expert_out(layer, e, x_TH[t])
        out.append(acc)
    return torch.stack(out)


@pytest.mark.parametrize("policy", ["probs", "position"])
@pytest.mark.parametrize("pad", [False, True])
def test_layer_capacity_drops_and_padding(policy, pad):
    from megamoe.moe.capacity import apply_capacity, expert_capacity
    from megamoe.moe.stats import routing_stats

    torch.manual_seed(0)
    cfg = MoEConfig(num_experts=4, topk=2, ffn_hidden_size=8, capacity_factor=0.75,
                    token_drop_policy=policy, pad_to_capacity=pad)
    layer = MoELayer(cfg, 16, init_method_std=0.3, swiglu=True, grouped_gemm=True)
    with torch.no_grad():
        layer.router.weight[1] += 0.5  # unbalanced: drops happen
    x = torch.randn(6, 4, 16, requires_grad=True)
    out = layer(x)
    x_TH = x.reshape(-1, 16)
    probs, rmap, _ = layer.router.route(x_TH)
    cap = expert_capacity(rmap, 2, 0.75)
    kept_probs, keep = apply_capacity(probs, rmap, cap, policy)
    assert int(keep.sum()) < int(rmap.sum())
    ref = _naive_from_map(layer, x_TH, kept_probs, keep).reshape(x.shape)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    g = torch.randn_like(out)
    got = torch.autograd.grad((out * g).sum(), [x, layer.experts.fc1_weight])
    want = torch.autograd.grad((ref * g).sum(), [x, layer.experts.fc1_weight])
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    # tokens that lost every assignment get no gradient through the experts
    lost = ~keep.any(1)
    assert got[0].reshape(-1, 16)[lost].abs().max() == 0 if lost.any() else True
    # padding: every group has `cap` rows, padding rows are zero inputs with weight 0
    # (the grouped experts take the [T(+1), H] tokens and gather them inside fc1)
    (x_in, tokens_per_expert_E, _, token_indices_N), state = layer.dispatcher.dispatch(
        x_TH, kept_probs, keep, cap if pad else None)
    if pad:
        assert tokens_per_expert_E.tolist() == [cap] * 4
        is_pad = token_indices_N == x_TH.shape[0]
        assert int(is_pad.sum()) == 4 * cap - int(keep.sum())
        rows = x_in.index_select(0, token_indices_N)
        assert rows[is_pad].abs().max() == 0 and state.probs_N[is_pad].abs().max() == 0
    else:
        assert int(tokens_per_expert_E.sum()) == int(keep.sum())
    stats = routing_stats(layer)[0]
    dropped = (int(rmap.sum()) - int(keep.sum())) / int(rmap.sum())
    assert stats["dropped_fraction"] == pytest.approx(dropped)
    assert stats["tokens_per_expert"] == keep.sum(0).tolist()
    assert stats["routed_per_expert"] == rmap.sum(0).tolist()
    assert stats["max_load"] == max(keep.sum(0).tolist())
    assert stats["mean_load"] == pytest.approx(float(keep.sum()) / 4)
    assert routing_stats(layer) == {}  # read resets


@pytest.mark.parametrize("gate", [False, True])
def test_layer_shared_expert(gate):
    torch.manual_seed(0)
    cfg = MoEConfig(num_experts=4, topk=2, ffn_hidden_size=8,
                    shared_expert_intermediate_size=12, shared_expert_gate=gate)
    layer = MoELayer(cfg, 16, init_method_std=0.3, swiglu=True, add_bias_linear=True)
    x = torch.randn(5, 2, 16)
    out = layer(x)
    x_TH = x.reshape(-1, 16)
    probs, rmap, _ = layer.router.route(x_TH)
    sh = layer.shared_experts
    a, b = (x_TH @ sh.linear_fc1.weight.t() + sh.linear_fc1.bias).chunk(2, -1)
    shared = (F.silu(a) * b) @ sh.linear_fc2.weight.t() + sh.linear_fc2.bias
    if gate:
        shared = shared * torch.sigmoid(x_TH @ sh.gate_weight.t())
    ex = layer.experts
    routed = []
    for t in range(x_TH.shape[0]):
        acc = torch.zeros(16)
        for e in torch.nonzero(rmap[t]).flatten().tolist():
            h = x_TH[t] @ ex.fc1_weight[e] + ex.fc1_bias[e]
            acc = acc + probs[t, e] * (ex.activation(h) @ ex.fc2_weight[e] + ex.fc2_bias[e])
        routed.append(acc)
    ref = (torch.stack(routed) + shared).reshape(x.shape)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    assert (sh.gate_weight is not None) == gate


def test_layer_custom_expert_modules():
    """Tutel/FastMoE style: any nn.Module experts; [B, S, H] input; keyword construction."""
    import megamoe

    torch.manual_seed(0)
    experts = [torch.nn.Sequential(torch.nn.Linear(16, 24), torch.nn.Tanh(),
                                   torch.nn.Linear(24, 16)) for _ in range(3)]
    layer = megamoe.MoELayer(hidden_size=16, experts=experts, topk=2, sequence_dim=1,
                             load_balancing_types=["seq_aux_loss"], aux_loss_coeffs=[0.1])
    assert layer.config.num_experts == 3
    x = torch.randn(2, 7, 16, requires_grad=True)
    out = layer(x)
    x_TH = x.reshape(-1, 16)
    probs, rmap, _ = layer.router.route(x_TH)
    ref = torch.stack([sum(probs[t, e] * experts[e](x_TH[t])
                           for e in torch.nonzero(rmap[t]).flatten().tolist())
                       for t in range(14)]).reshape(x.shape)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    out.sum().backward()
    assert all(p.grad is not None for p in experts[0].parameters())


def test_seq_aux_loss_follows_sequence_dim():
    """[S, B, H] with sequence_dim=0 and its [B, S, H] transpose with sequence_dim=1 give the
    same per-sequence loss; a [T, H] input is one sequence."""
    torch.manual_seed(0)
    cfg = MoEConfig(num_experts=4, topk=2, ffn_hidden_size=8,
                    load_balancing_types=["seq_aux_loss"], aux_loss_coeffs=[1.0])
    layer = MoELayer(cfg, 16, init_method_std=0.5)
    x_SBH = torch.randn(6, 3, 16)
    layer(x_SBH)
    a = MoELossTracker.report(1)["seq_load_balancing_loss"]
    layer.sequence_dim = 1
    layer(x_SBH.transpose(0, 1).contiguous())
    b = MoELossTracker.report(1)["seq_load_balancing_loss"]
    torch.testing.assert_close(a, b)
    layer.sequence_dim = 0
    layer(x_SBH[:, 0])  # one sequence of 6 tokens: equals the batch's first sequence alone
    c = MoELossTracker.report(1)["seq_load_balancing_loss"]
    layer(x_SBH[:, :1].contiguous())
    d = MoELossTracker.report(1)["seq_load_balancing_loss"]
    torch.testing.assert_close(c, d)


def test_layer_expert_choice():
    torch.manual_seed(0)
    cfg = MoEConfig(num_experts=4, topk=2, ffn_hidden_size=8, router_type="expert_choice",
                    aux_loss_coeffs=[0.0], capacity_factor=1.0)
    layer = MoELayer(cfg, 16, init_method_std=0.3, grouped_gemm=True)
    x = torch.randn(10, 16)
    out = layer(x)
    probs, rmap, _ = layer.router.route(x)
    assert rmap.sum(0).tolist() == [5, 5, 5, 5]
    torch.testing.assert_close(out, _naive_from_map(layer, x, probs, rmap), atol=1e-5,
                               rtol=1e-5)

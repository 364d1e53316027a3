"""Which GEMMs the FP8 policy runs in FP8 (as Megatron with Transformer Engine), that the
parameters and checkpoint names do not change, and the experts' FP8 path against the same
experts without FP8."""

from __future__ import annotations

import shlex

import pytest
import torch

from megamoe.cli.arguments import parse_args
from megamoe.cli.mapping import run_config_from_args
from megamoe.model.fp8.linear import LinearScaling
from megamoe.moe.experts import GroupedExperts
from megamoe.training.build import build_model
from tests.training.test_pretrain import TINY_MOE

SHARED = "--moe-shared-expert-intermediate-size 32 --train-iters 1"


def _model(extra: str = ""):
    run = run_config_from_args(parse_args(shlex.split(f"{TINY_MOE} {SHARED} {extra}"),
                                          world_size=1), 97)
    return build_model(run)


def test_policy_covers_the_layer_gemms_only_and_keeps_the_parameters():
    plain, fp8 = _model(), _model("--fp8-format hybrid --fp8-recipe tensorwise")
    with_fp8 = {n for n, m in fp8.named_modules() if getattr(m, "fp8", None) is not None}
    layer = "decoder.layers.0."
    assert {layer + s for s in ("self_attention.linear_qkv", "self_attention.linear_proj",
                                "mlp.experts", "mlp.shared_experts.linear_fc1",
                                "mlp.shared_experts.linear_fc2")} <= with_fp8, with_fp8
    # router, norms, embeddings and the output layer stay in the model's precision
    assert not any("router" in n or "embedding" in n or "output_layer" in n or "norm" in n
                   for n in with_fp8)
    assert len(with_fp8) == 2 * 5
    assert all(getattr(m, "fp8", None) is None for m in plain.modules())
    sd_plain, sd_fp8 = plain.state_dict(), fp8.state_dict()
    assert list(sd_plain) == list(sd_fp8)
    assert all(torch.equal(sd_plain[k], sd_fp8[k]) for k in sd_plain)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def test_fp8_experts_against_the_same_experts_without_fp8():
    """Forward (two E4M3 GEMMs around SwiGLU) and gradients (E5M2 output gradients)
    norm-wise within 2u of the coarsest format in play (forward E4M3: 2^-3, backward E5M2:
    2^-2). Why 2u: a rounding to a format of unit roundoff u is uniform in [-u, u]|x|
    (RMS u/sqrt(3)); the four operand roundings of the two GEMMs add in quadrature to about
    1.15u of the output's norm (measured: 0.063 forward, 0.074-0.087 backward); 2u leaves room
    for non-uniform rounding, while a wrong scale or expert costs O(1).
    """
    plain, fp8 = _model(), _model("--fp8-format hybrid --fp8-recipe tensorwise")
    e_plain = plain.decoder.layers[0].mlp.experts
    e_fp8 = fp8.decoder.layers[0].mlp.experts
    assert isinstance(e_fp8, GroupedExperts) and isinstance(e_fp8.fp8_fc1, LinearScaling)
    torch.manual_seed(3)
    sizes = torch.tensor([5, 0, 9, 2])
    x = torch.randn(16, 32)
    probs = torch.rand(16)
    outs, grads = [], []
    for experts in (e_plain, e_fp8):
        xi = x.clone().requires_grad_()
        y = experts(xi, sizes, probs)
        y.backward(torch.linspace(-1, 1, y.numel()).reshape(y.shape))
        outs.append(y.detach())
        grads.append((xi.grad, experts.fc1_weight.grad, experts.fc2_weight.grad))
    fwd = _rel(outs[1], outs[0])
    assert 0 < fwd < 2.0 ** -3, fwd
    for g_fp8, g_ref in zip(grads[1], grads[0]):
        assert 0 < _rel(g_fp8, g_ref) < 2.0 ** -2, _rel(g_fp8, g_ref)
    assert bool((e_fp8.fc1_weight.grad[1] == 0).all())  # the expert with no rows


@pytest.mark.parametrize("recipe,moe", [
    ("blockwise", ""),
    ("mxfp8", "--moe-expert-capacity-factor 1.0 --moe-pad-expert-input-to-capacity"),
    ("rowwise", ""),
    ("blockwise", "--moe-expert-capacity-factor 1.0 --moe-pad-expert-input-to-capacity"),
    ("mxfp8", ""),
    ("rowwise", "--moe-expert-capacity-factor 0.5 --moe-pad-expert-input-to-capacity"),
])
def test_block_recipe_moe_layer_against_the_same_layer_without_fp8(recipe, moe):
    """The whole MoE layer (router in high precision, shared expert and routed experts in
    FP8; dropless, or padded to capacity: padding rows are zeros, which quantise to zero
    and keep every tile's scale) against the same layer without FP8, norm-wise within the
    2u bounds of test_fp8_experts_against_the_same_experts_without_fp8 (E4M3 forward
    2^-3, E5M2 gradients 2^-2): block scales are finer than per-tensor ones, so the
    tensor-wise argument holds a fortiori. (Measured: 0.067-0.069 forward, 0.076-0.094
    gradients; the three recipes agree to 4 digits here because power-of-2 scales leave
    the relative rounding unchanged except for values far below their tile's amax.)"""
    plain = _model(moe)
    fp8 = _model(f"{moe} --fp8-format hybrid --fp8-recipe {recipe}")
    layers = [m.decoder.layers[0].mlp for m in (plain, fp8)]
    torch.manual_seed(4)
    x = torch.randn(16, 2, 32)
    outs, grads = [], []
    for layer in layers:
        xi = x.clone().requires_grad_()
        y = layer(xi)
        y.backward(torch.linspace(-1, 1, y.numel()).reshape(y.shape))
        outs.append(y.detach())
        grads.append([xi.grad] + [p.grad for p in layer.parameters() if p.grad is not None])
    assert 0 < _rel(outs[1], outs[0]) < 2.0 ** -3, _rel(outs[1], outs[0])
    assert len(grads[0]) == len(grads[1]) > 3
    for g_fp8, g_ref in zip(grads[1], grads[0]):
        assert _rel(g_fp8, g_ref) < 2.0 ** -2, _rel(g_fp8, g_ref)

"""Balancing-loss values, the once-per-micro-batch gradient injection, and the tracker."""

from __future__ import annotations

import math

import pytest
import torch

from megamoe.config import MoEConfig
from megamoe.moe.losses import (
    MoELossTracker,
    attach_aux_loss,
    set_aux_loss_backward_scale,
    switch_load_balancing_loss,
    z_loss,
)
from megamoe.moe.router import TopKRouter


def test_switch_loss_hand_computed():
    # T=2 tokens, E=3 experts, k=1: P = [0.7+0.2, 0.2+0.5, 0.1+0.3], counts = [1, 1, 0].
    probs = torch.tensor([[0.7, 0.2, 0.1], [0.2, 0.5, 0.3]])
    counts = torch.tensor([1, 1, 0])
    loss = switch_load_balancing_loss(probs, counts, topk=1, coeff=0.1)
    expected = 3 * 0.1 / (1 * 2 * 2) * (0.9 * 1 + 0.7 * 1 + 0.4 * 0)
    assert float(loss) == pytest.approx(expected, rel=1e-6)


def test_switch_loss_is_coeff_when_balanced():
    probs = torch.full((8, 4), 0.25)
    counts = torch.tensor([4, 4, 4, 4])  # 8 tokens * k=2 spread evenly
    assert float(switch_load_balancing_loss(probs, counts, topk=2, coeff=0.01)) == \
        pytest.approx(0.01, rel=1e-6)


def test_z_loss_hand_computed():
    logits = torch.tensor([[0.0, 0.0], [1.0, 2.0]], dtype=torch.float64)
    lse0 = math.log(2.0)
    lse1 = math.log(math.exp(1.0) + math.exp(2.0))
    expected = 1e-3 * (lse0 ** 2 + lse1 ** 2) / 2
    assert float(z_loss(logits, 1e-3)) == pytest.approx(expected, rel=1e-12)


def test_attach_aux_loss_identity_and_scaled_gradient():
    w = torch.tensor([1.0, 2.0], requires_grad=True)
    out = w * 3.0
    aux = (w ** 2).sum()
    set_aux_loss_backward_scale(0.25)
    y = attach_aux_loss(out, aux)
    assert torch.equal(y, out)
    y.sum().backward()
    assert torch.allclose(w.grad, torch.tensor([3.0, 3.0]) + 0.25 * 2 * w.detach())


@pytest.mark.parametrize("z_coeff", [None, 1e-2])
def test_router_aux_gradient_counted_once_with_scale(z_coeff):
    """Router weight grad through the layer output == autograd of lm + scale * aux."""
    torch.manual_seed(0)
    cfg = MoEConfig(num_experts=4, topk=2, ffn_hidden_size=8, aux_loss_coeffs=[0.1],
                    z_loss_coeff=z_coeff)
    router = TopKRouter(8, cfg, 0, 1, 0.5)
    x = torch.randn(16, 8)
    target = torch.randn(16, 4)
    scale = 1.0 / 3

    set_aux_loss_backward_scale(scale)
    probs, _, aux = router.route(x)
    lm = (attach_aux_loss(probs, aux) * target).sum()
    lm.backward()
    got = router.weight.grad.clone()

    router.weight.grad = None
    probs, _, aux = router.route(x)
    ((probs * target).sum() + scale * aux).backward()
    assert torch.allclose(got, router.weight.grad, atol=1e-7, rtol=0)
    # The aux part is non-trivial, so the check above can fail.
    router.weight.grad = None
    probs, _, aux = router.route(x)
    (probs * target).sum().backward()
    assert not torch.allclose(got, router.weight.grad, atol=1e-7, rtol=0)


def test_tracker_report_and_clear():
    MoELossTracker.record("load_balancing_loss", 3, 4, torch.tensor(1.0))
    MoELossTracker.record("load_balancing_loss", 1, 4, torch.tensor(2.0))
    MoELossTracker.record("load_balancing_loss", 3, 4, torch.tensor(3.0))
    MoELossTracker.record("load_balancing_loss", 1, 4, torch.tensor(4.0, requires_grad=True))
    MoELossTracker.record("z_loss", 1, 4, torch.tensor(0.5))
    report = MoELossTracker.report(num_microbatches=2)
    # Ordered by layer: layer 1 then layer 3; non-recording layers 0 and 2 are absent.
    assert torch.allclose(report["load_balancing_loss"], torch.tensor([3.0, 2.0]))
    assert torch.allclose(report["z_loss"], torch.tensor([0.25]))
    assert not report["load_balancing_loss"].requires_grad
    assert MoELossTracker.report(1) == {}
    MoELossTracker.record("z_loss", 0, 1, torch.tensor(1.0))
    MoELossTracker.clear()
    assert MoELossTracker.report(1) == {}
    with pytest.raises(ValueError):
        MoELossTracker.record("z_loss", 2, 2, torch.tensor(1.0))


def test_router_records_loss_over_coeff():
    torch.manual_seed(0)
    cfg = MoEConfig(num_experts=4, topk=2, ffn_hidden_size=8, aux_loss_coeffs=[0.1],
                    z_loss_coeff=1e-3)
    router = TopKRouter(8, cfg, 2, 3, 0.02)
    x = torch.randn(64, 8)
    _, rmap, aux = router.route(x)
    logits = router.gating(x)
    lb = switch_load_balancing_loss(torch.softmax(logits, -1), rmap.sum(0), 2, 1.0)
    z = z_loss(logits, 1.0)
    assert torch.allclose(aux, 0.1 * lb + 1e-3 * z)
    report = MoELossTracker.report(1)
    assert torch.allclose(report["load_balancing_loss"], lb.detach().reshape(1))
    assert torch.allclose(report["z_loss"], z.detach().reshape(1))
    # Tiny init => near-uniform probs => logged balancing loss close to 1.
    assert 0.9 < float(report["load_balancing_loss"]) < 1.2

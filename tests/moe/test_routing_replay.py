"""A recomputed MoE layer reuses the forward's routing decisions (issue 27 item 5).

On a GPU the replay's router logits may differ from the forward's in their last bits
(another GEMM kernel or reduction order); a second top-k on them could send a token to
another expert, so the replay would dispatch other sizes than the forward (other
all-to-all splits, other saved shapes) and backpropagate through the wrong experts. The
router here is perturbed on purpose in the replay, far beyond rounding, so its own top-k
would choose differently: the dispatcher must still see, in the replay, exactly the
forward's routing map, and (top-1 softmax: every combine weight is 1, so the logits'
values reach nothing else) the gradients must equal those of the run without recompute.
"""

from __future__ import annotations

import pytest
import torch

from megamoe.config import MoEConfig
from megamoe.moe.layer import MoELayer
from megamoe.parallel.checkpointing import checkpoint, is_recomputing

H, T = 8, 24


def _layer(**config) -> MoELayer:
    torch.manual_seed(0)
    cfg = MoEConfig(**{"num_experts": 4, "topk": 1, "ffn_hidden_size": 16, **config})
    return MoELayer(cfg, H, init_method_std=0.3)


def _perturb_replay(layer: MoELayer, seen: dict) -> None:
    """The router's logits are shifted by noise in the replay only; the dispatcher's
    routing maps are recorded, forward then replay."""
    gating = layer.router.gating
    noise = torch.randn(T, layer.config.num_experts,
                        generator=torch.Generator().manual_seed(7)) * 2.0

    def perturbed(x_TH: torch.Tensor) -> torch.Tensor:
        logits = gating(x_TH) + (noise if is_recomputing() else 0.0)
        seen["replay_logits" if is_recomputing() else "logits"] = logits.detach()
        return logits

    layer.router.gating = perturbed
    layer.dispatcher = _Recording(layer.dispatcher, seen.setdefault("maps", []))


class _Recording:
    """The layer's dispatcher, recording the routing map of each call."""

    def __init__(self, inner, maps: list) -> None:
        self.inner, self.maps = inner, maps

    def __call__(self, x_TH, probs_TE, routing_map_TE, *rest):
        self.maps.append(routing_map_TE.clone())
        return self.inner(x_TH, probs_TE, routing_map_TE, *rest)

    def __getattr__(self, name: str):
        return getattr(self.inner, name)


def _grads(layer: MoELayer, recompute: bool) -> list[torch.Tensor]:
    x = torch.randn(T, H, generator=torch.Generator().manual_seed(1)).requires_grad_()
    w = torch.randn(T, H, generator=torch.Generator().manual_seed(2))
    out = checkpoint(layer, x) if recompute else layer(x)
    (out * w).sum().backward()
    return [x.grad] + [p.grad for p in layer.parameters()]


@pytest.mark.parametrize("config", [{}, {"capacity_factor": 1.0},
                                    {"capacity_factor": 1.0, "token_drop_policy": "position",
                                     "pad_to_capacity": True}],
                         ids=["dropless", "capacity-probs", "capacity-position-padded"])
def test_replay_reuses_the_forwards_routing(config):
    want = _grads(_layer(**config), recompute=False)
    layer, seen = _layer(**config), {}
    _perturb_replay(layer, seen)
    got = _grads(layer, recompute=True)
    forward_map, replay_map = seen["maps"]
    # The replay's own top-1 would choose otherwise for some tokens:
    assert not torch.equal(seen["replay_logits"].argmax(-1), seen["logits"].argmax(-1))
    assert torch.equal(replay_map, forward_map)
    for a, b in zip(got, want):
        assert a is not None and torch.equal(a, b)


@pytest.mark.parametrize("config", [
    {"score_function": "sigmoid", "capacity_factor": 0.5},
    {"router_type": "expert_choice", "capacity_factor": 1.0},
    {"load_balancing_types": ["sinkhorn"]}],
    ids=["capacity-drops-by-perturbed-probs", "expert-choice", "sinkhorn"])
def test_replay_reuses_every_routing_decision(config):
    """Where the combine weights follow the perturbed logits (so the gradients do too),
    the choices still do not: capacity drops ranked by probability, expert choice's
    per-expert top-k, sinkhorn's balanced top-k."""
    layer, seen = _layer(**config), {}
    _perturb_replay(layer, seen)
    _grads(layer, recompute=True)
    forward_map, replay_map = seen["maps"]
    assert torch.equal(replay_map, forward_map)
